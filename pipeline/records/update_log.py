"""The learner's update log: which recorded rollouts went into which optimizer step.

One entry per optimizer step, written by the learner to the Kafka topic `<run>.updates`
(beside the rollout topic `<run>.rollouts`; key = step) and to `RUN_DIR/updates.jsonl`. Replay follows it
(`--exact-batches`), takes the recorded staleness from it, and the chaos audit counts
`used` from it, independently of the broker's own count of what was produced.

An entry (JSON object; docs/schema.md is the normative description):

    {"schema": 1, "step": 7, "policy_version": 7, "loss_type": "gepo", "time": 1763800000.0,
     "used":    [{"partition": 0, "offset": 412, "rollout_id": "ab12…", "policy_version": 5,
                  "staleness": 2, "weight": 1.0}, …],
     "dropped": [{"partition": 0, "offset": 409, "rollout_id": "…", "policy_version": 1,
                  "staleness": 5, "reason": "too_stale_steps"}, …],
     "malformed": [{"partition": 0, "offset": 410, "reason": "not msgpack: …"}],
     "duplicates": [{"partition": 0, "offset": 411, "rollout_id": "…"}],
     "vocab_size": 20, "tokenizer_sha": "…"}

(`used`/`dropped` items also carry `age_s`, seconds from creation to the verdict.)

`used` is in batch order. `dropped`/`malformed`/`duplicates` are the messages judged so
since the previous step (their verdict is final), so every consumed offset appears in
exactly one entry of one step, except those read after the last step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

from pipeline.clients.topics import read_topic, topic_partitions

UPDATE_LOG_SCHEMA = 1
UPDATE_LOG_FILE = "updates.jsonl"


def _companion_topic(rollout_topic: str, suffix: str) -> str:
    """`<run>.<suffix>` beside the default rollout topic `<run>.rollouts`; a custom rollout
    topic T gets `T.<suffix>`. Either way it follows from the rollout topic alone, so a
    replay given only the topic finds it."""
    base = rollout_topic[: -len(".rollouts")] if rollout_topic.endswith(".rollouts") else rollout_topic
    return f"{base}.{suffix}"


def updates_topic(rollout_topic: str) -> str:
    """Kafka topic of a run's update log: `<run>.updates`."""
    return _companion_topic(rollout_topic, "updates")


def dead_letter_topic(rollout_topic: str) -> str:
    """Kafka topic where the learner sets poison messages aside (header `reason` says why): `<run>.dead`."""
    return _companion_topic(rollout_topic, "dead")


@dataclass(frozen=True)
class UsedGroup:
    partition: int
    offset: int
    rollout_id: str
    policy_version: int
    """Version of the policy that sampled the group."""
    staleness: int
    """Learner version − policy_version when the group was used."""
    weight: float
    """Sequence weight of the group in the loss (1, or the stale-reweight factor)."""
    age_s: Optional[float] = None
    """Seconds from the group's creation to its use (what `max_delay_seconds` judged)."""
    verdict: Optional[str] = None
    """`<validator key id>:<sequence number>` of the passing verdict that let it in (None: the
    learner checked it itself)."""


@dataclass(frozen=True)
class DroppedGroup:
    partition: int
    offset: int
    rollout_id: str
    policy_version: int
    staleness: int
    reason: str
    """`too_stale_steps` or `too_old_seconds`; `failed_check:<kind>`, `failed_verdict:<kind>`,
    `quarantined`, `revoked_key`, `no_verdict` for a group refused."""
    age_s: Optional[float] = None


@dataclass(frozen=True)
class SkippedMessage:
    partition: int
    offset: int
    reason: str


@dataclass(frozen=True)
class DuplicateGroup:
    partition: int
    offset: int
    rollout_id: str


@dataclass
class UpdateEntry:
    step: int
    policy_version: int
    """The version this step produced (= step for a learner that starts from v0)."""
    loss_type: str
    time: float
    used: list[UsedGroup] = field(default_factory=list)
    dropped: list[DroppedGroup] = field(default_factory=list)
    malformed: list[SkippedMessage] = field(default_factory=list)
    duplicates: list[DuplicateGroup] = field(default_factory=list)
    vocab_size: Optional[int] = None
    """Vocabulary size of the learner's model (replay refuses a base that differs)."""
    topic: str = ""
    """The rollout topic the partitions and offsets of this entry refer to."""
    tokenizer_sha: Optional[str] = None
    """pipeline.models.tokenizer_fingerprint of the learner's tokenizer."""
    kind: str = "step"
    """"step", or "rewind": a learner (re)started after step `step`; entries of later steps
    written before it belong to updates that were lost with a crash and are void."""
    attempt: str = ""
    """Id of the learner process that wrote the entry: a rewind voids only entries of earlier
    processes, so a late, re-sent copy of a learner's own rewind cannot void its steps."""
    schema: int = UPDATE_LOG_SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "UpdateEntry":
        if d.get("schema") != UPDATE_LOG_SCHEMA:
            raise ValueError(f"update log schema {d.get('schema')!r} is not {UPDATE_LOG_SCHEMA}")
        return cls(step=int(d["step"]), policy_version=int(d["policy_version"]), loss_type=str(d["loss_type"]),
                   time=float(d["time"]), used=[UsedGroup(**g) for g in d.get("used", [])],
                   dropped=[DroppedGroup(**g) for g in d.get("dropped", [])],
                   malformed=[SkippedMessage(**g) for g in d.get("malformed", [])],
                   duplicates=[DuplicateGroup(**g) for g in d.get("duplicates", [])],
                   vocab_size=d.get("vocab_size"), tokenizer_sha=d.get("tokenizer_sha"), kind=d.get("kind", "step"),
                   attempt=d.get("attempt", ""), topic=d.get("topic", ""))

    @classmethod
    def from_json(cls, text: str | bytes) -> "UpdateEntry":
        return cls.from_dict(json.loads(text))


def append_entry(run_dir: Path, entry: UpdateEntry) -> None:
    """Append one entry to RUN_DIR/updates.jsonl with one write, on a line of its own."""
    fd = os.open(Path(run_dir) / UPDATE_LOG_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a crash cut the last line short
        os.write(fd, (("\n" if torn else "") + entry.to_json() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_entries_file(path: Path) -> list[UpdateEntry]:
    """The effective log of an updates.jsonl; a line torn by a crash mid-write is skipped."""
    entries = []
    for line in Path(path).read_text().splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn: the step it described is redone after the restart
        entries.append(UpdateEntry.from_dict(data))
    return dedup_by_step(entries)


def dedup_by_step(entries: Iterable[UpdateEntry]) -> list[UpdateEntry]:
    """The effective log: one entry per step, in step order, rewinds applied.

    A learner that crashes after logging step k but before its checkpoint restarts from
    that checkpoint (version c < k) and first writes a rewind to c: steps above c logged
    before it are void, and the redone steps replace them.
    """
    by_step: dict[int, UpdateEntry] = {}
    for e in entries:
        if e.kind == "rewind":
            by_step = {s: x for s, x in by_step.items() if s <= e.step or (e.attempt and x.attempt == e.attempt)}
        else:
            by_step[e.step] = e
    return [by_step[s] for s in sorted(by_step)]


def rewind_entry(step: int, loss_type: str, attempt: str = "", topic: str = "",
                 policy_version: Optional[int] = None) -> UpdateEntry:
    """A learner (re)starting after optimizer step `step`, with weights of `policy_version`."""
    return UpdateEntry(step=step, policy_version=step if policy_version is None else policy_version,
                       loss_type=loss_type, time=time.time(), kind="rewind", attempt=attempt, topic=topic)


def read_entries_kafka(bootstrap: str, rollout_topic: str, timeout_s: float = 10.0,
                       security=None) -> Optional[list[UpdateEntry]]:
    """The update log of a rollout topic from Kafka, or None if the run wrote none
    (`security`: the servers' `ServiceSecurity`, for an authenticated Kafka)."""
    topic = updates_topic(rollout_topic)
    if not topic_partitions(bootstrap, topic, security):
        return None
    return dedup_by_step(UpdateEntry.from_json(r.value)
                         for r in read_topic(bootstrap, topic, timeout_s=timeout_s, security=security))


def iter_used(entries: Iterable[UpdateEntry]) -> Iterator[tuple[UpdateEntry, UsedGroup]]:
    for e in entries:
        for g in e.used:
            yield e, g
