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

Every entry the learner writes carries its signature (`signature`: {key_id, value}, Ed25519 of
the learner's key over the entry's canonical JSON, `pipeline.wire.signing.sign_document`). A
reader given the learner's public key (`read_update_log(..., trusted=...)`: a resumed learner,
`heterorl export`, `replay`, the audits) uses only entries that key signed; anything else on the
topic (not JSON, unsigned, signed by another key, altered) is refused and counted with its
reason, never used. A genuine entry sent again later (a replay of the log's own records) is
refused too: a rewind counts only as the first entry of its learner process (`attempt`), and an
entry of a process that a later rewind ended counts no more.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

from pipeline.clients.topics import RawRecord, read_topic, topic_partitions
from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, sign_document, verify_document

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
    numerics: Optional[dict] = None
    """What decided the step's bits besides its data and weights (`pipeline.runtime.learner_numerics`:
    precision, rounding, attention kernel, threads, ZeRO stage, micro-batch tokens, machine,
    torch): a replay takes them (`adopt_numerics`); None in entries of older learners."""
    schema: int = UPDATE_LOG_SCHEMA
    signature: Optional[dict] = field(default=None, compare=False)
    """The learner's signature ({key_id, value}) as read, so that an entry written out again (an
    export) can still be verified; None for an entry not read from a signed log."""

    def to_json(self, signer: Optional[SigningKey] = None) -> str:
        """One line of JSON: signed by `signer` (the learner's key) where given, else with the
        signature it was read with, if any."""
        document = asdict(self)
        signature = document.pop("signature")
        if signer is not None:
            document = sign_document(document, signer)
        elif signature is not None:
            document["signature"] = signature
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "UpdateEntry":
        """The entry `d` holds (its `signature`, if any, is the reader's business: `read_update_log`)."""
        if d.get("schema") != UPDATE_LOG_SCHEMA:
            raise ValueError(f"update log schema {d.get('schema')!r} is not {UPDATE_LOG_SCHEMA}")
        return cls(step=int(d["step"]), policy_version=int(d["policy_version"]), loss_type=str(d["loss_type"]),
                   time=float(d["time"]), used=[UsedGroup(**g) for g in d.get("used", [])],
                   dropped=[DroppedGroup(**g) for g in d.get("dropped", [])],
                   malformed=[SkippedMessage(**g) for g in d.get("malformed", [])],
                   duplicates=[DuplicateGroup(**g) for g in d.get("duplicates", [])],
                   vocab_size=d.get("vocab_size"), tokenizer_sha=d.get("tokenizer_sha"), kind=d.get("kind", "step"),
                   attempt=d.get("attempt", ""), topic=d.get("topic", ""),
                   numerics=d["numerics"] if isinstance(d.get("numerics"), dict) else None,
                   signature=d["signature"] if isinstance(d.get("signature"), dict) else None)

    @classmethod
    def from_json(cls, text: str | bytes) -> "UpdateEntry":
        return cls.from_dict(json.loads(text))


def append_entry(run_dir: Path, entry: UpdateEntry, signer: Optional[SigningKey] = None) -> None:
    """Append one entry (signed by `signer`, where given) to RUN_DIR/updates.jsonl with one write,
    on a line of its own."""
    fd = os.open(Path(run_dir) / UPDATE_LOG_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a crash cut the last line short
        os.write(fd, (("\n" if torn else "") + entry.to_json(signer) + "\n").encode())
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
    """The effective log: one entry per step, in step order, rewinds applied."""
    return _effective(list(entries))[0]


def _effective(entries: list[UpdateEntry]) -> tuple[list[UpdateEntry], list[int]]:
    """(the effective log, the indices in `entries` of records sent again: ignored).

    A learner that crashes after logging step k but before its checkpoint restarts from
    that checkpoint (version c < k) and first writes a rewind to c: steps above c logged
    before it are void, and the redone steps replace them. Each learner process writes its
    rewind first, so a rewind of a process (`attempt`) already seen is a copy, and an entry of a
    process that a later process's rewind ended comes from the past: both are ignored (a copy
    of an early rewind, sent again at the end of the log, would otherwise void every step after
    it). Entries without an attempt (logs of 0.2 and before) are taken as they come.
    """
    by_step: dict[int, UpdateEntry] = {}
    seen: set[str] = set()
    ended: set[str] = set()
    again: list[int] = []
    for index, e in enumerate(entries):
        if e.attempt and (e.attempt in ended or (e.kind == "rewind" and e.attempt in seen)):
            again.append(index)
            continue
        if e.kind == "rewind":
            by_step = {s: x for s, x in by_step.items() if s <= e.step or (e.attempt and x.attempt == e.attempt)}
            ended |= seen - {e.attempt}
        else:
            by_step[e.step] = e
        if e.attempt:
            seen.add(e.attempt)
    return [by_step[s] for s in sorted(by_step)], again


@dataclass(frozen=True)
class RefusedRecord:
    """A record of a control topic (the update log, the dead letters) that no reader uses."""

    partition: int
    offset: int
    reason: str
    """`not_json`, `not_an_entry: ...`, `unsigned`, `signature: ...` (signed by another key,
    altered), `sent_again` (a genuine record sent again), `other_topic` (a dead letter of another
    rollout topic)."""


@dataclass
class UpdateLog:
    """An update log as read from Kafka: its effective entries and the records refused."""

    entries: list[UpdateEntry]
    refused: list[RefusedRecord] = field(default_factory=list)

    def refused_by_reason(self) -> dict[str, int]:
        return count_reasons(self.refused)


def count_reasons(refused: Iterable[RefusedRecord]) -> dict[str, int]:
    """How many records were refused, by the first word of their reason."""
    counts: dict[str, int] = {}
    for r in refused:
        kind = r.reason.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


class ControlRecordRefused(ValueError):
    """A control record no reader may use; `reason` is one of `RefusedRecord.reason`'s forms."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def verified_control_record(value: Optional[bytes | str], trusted: Optional[PublicKey], what: str) -> dict:
    """The JSON object in `value` (its `signature` included), that signature checked against
    `trusted` (the learner's public key; None: an unsigned run, whose records are taken as they
    are); ControlRecordRefused otherwise."""
    try:
        document = json.loads(value or b"")
    except (ValueError, UnicodeDecodeError):
        raise ControlRecordRefused("not_json") from None
    if not isinstance(document, dict):
        raise ControlRecordRefused("not_json")
    if trusted is None:
        return document
    if document.get("signature") is None:
        raise ControlRecordRefused("unsigned")
    try:
        verify_document(document, trusted, what)
    except SignatureError as e:
        raise ControlRecordRefused(f"signature: {e}") from None
    return document


def parse_update_log(records: Iterable[RawRecord], trusted: Optional[PublicKey]) -> UpdateLog:
    """The effective log of the update-log topic's `records` (in offset order), each record verified."""
    kept: list[tuple[RawRecord, UpdateEntry]] = []
    refused: list[RefusedRecord] = []
    for r in records:
        try:
            body = verified_control_record(r.value, trusted, f"update-log record {r.partition}@{r.offset}")
            kept.append((r, UpdateEntry.from_dict(body)))
        except ControlRecordRefused as e:
            refused.append(RefusedRecord(r.partition, r.offset, e.reason))
        except (ValueError, KeyError, TypeError) as e:  # signed, but not an entry: not a learner of this version
            refused.append(RefusedRecord(r.partition, r.offset, f"not_an_entry: {type(e).__name__}: {e}"[:200]))
    entries, again = _effective([e for _, e in kept])
    refused += [RefusedRecord(kept[i][0].partition, kept[i][0].offset, "sent_again") for i in again]
    return UpdateLog(entries, sorted(refused, key=lambda x: (x.partition, x.offset)))


def rewind_entry(step: int, loss_type: str, attempt: str = "", topic: str = "",
                 policy_version: Optional[int] = None) -> UpdateEntry:
    """A learner (re)starting after optimizer step `step`, with weights of `policy_version`."""
    return UpdateEntry(step=step, policy_version=step if policy_version is None else policy_version,
                       loss_type=loss_type, time=time.time(), kind="rewind", attempt=attempt, topic=topic)


def read_update_log(bootstrap: str, rollout_topic: str, trusted: Optional[PublicKey], timeout_s: float = 10.0,
                    security=None) -> Optional[UpdateLog]:
    """The update log of a rollout topic from Kafka, or None if the run wrote none. `trusted`:
    the learner's public key (None only for runs without signatures: every entry is then taken as
    it is). `security`: the servers' `ServiceSecurity`, for an authenticated Kafka."""
    topic = updates_topic(rollout_topic)
    if not topic_partitions(bootstrap, topic, security):
        return None
    return parse_update_log(read_topic(bootstrap, topic, timeout_s=timeout_s, security=security), trusted)


def iter_used(entries: Iterable[UpdateEntry]) -> Iterator[tuple[UpdateEntry, UsedGroup]]:
    for e in entries:
        for g in e.used:
            yield e, g
