"""The data audit of a run: every message the broker holds is accounted for exactly once.

Each count comes from its own source, none is derived from another:

- `produced`: the broker's rollout log, read to its end (what it acknowledged);
- `used_in_updates`, `dropped_stale`, `duplicates_ignored`: the learner's update log
  (`<run>.updates`, rewinds applied: steps lost with a killed learner do not count);
- `dead_lettered`: the dead-letter topic `<run>.dead`, by source offset;
- both control topics count only records the learner signed (given its public key, `trusted`):
  an unsigned, forged, altered or re-sent record changes no count, and is listed in
  `refused_control_records` with its reason;
- `pending_at_end`: the log's end minus the offsets stored with the learner's final
  checkpoint (what it had not read yet); verdicts the learner reached after its last
  step travel in that checkpoint's manifest (`tail_verdicts`);
- `discarded_at_source`: the samplers' own reports in Redis (groups that grew too stale
  in a sampler's spool never reach the broker, so they are not part of `lost`).

A message is identified by (partition, offset, rollout id): the Tansu 0.6 broker of the
local stack can store two different messages under one offset, and skip offsets, when
a producer's connection dies mid-request (counted as `broker_offset_collisions` and
`broker_offset_gaps`; both messages are real and both are accounted for).

Then `lost` = produced − used − dropped − dead-lettered − duplicates − pending, and, as
an independent check, `unaccounted_offsets` lists every message of the log that is in
no category at all (it must be empty when `lost` is 0). `used_twice` counts messages or
rollout ids that went into more than one update.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from pipeline.clients.topics import read_topic, topic_partitions
from pipeline.records.dead_letters import read_dead_letters
from pipeline.wire.rollout import header_value
from pipeline.records.update_log import UpdateEntry, UpdateLog, read_update_log
from pipeline.wire.signing import PublicKey


def audit_topic(bootstrap: str, topic: str, final_manifest_extra: dict, trusted: Optional[PublicKey],
                sampler_reports: Optional[dict[str, dict]] = None, timeout_s: float = 30.0,
                honest_sampler_ids: Optional[set[str]] = None, forged_messages: frozenset = frozenset()) -> dict:
    """Account for every message of `topic`, given the `extra` of the learner's final checkpoint
    manifest (its offsets, and the verdicts it reached after its last step), and the learner's
    public key `trusted` (None: a run without signatures, whose control records count as they are).

    With `honest_sampler_ids` (the samplers the run started itself) it also counts, per sampler
    id, the messages produced and used, and `forged_used_in_updates`: used messages that name
    another sampler, or that are in `forged_messages` (copies an attacker re-sent under an
    honest sampler's name, each as (partition, offset, rollout id): the identity below)."""
    log = read_topic(bootstrap, topic, timeout_s=timeout_s)
    ends: dict[int, int] = {p: 0 for p in topic_partitions(bootstrap, topic)}
    for r in log:
        ends[r.partition] = max(ends[r.partition], r.offset + 1)
    # A message is (partition, offset, rollout id): Tansu 0.6 can give two different messages
    # one offset (and skip others) when a producer dies mid-request, so an offset alone is not
    # an identity. Undecodable messages without an id header are (partition, offset, None).
    messages = {(r.partition, r.offset, header_value(r.headers, "rollout_id")) for r in log}
    per_offset = Counter((p, o) for p, o, _ in messages)
    update_log: UpdateLog = read_update_log(bootstrap, topic, trusted, timeout_s=timeout_s) or UpdateLog([])
    entries: list[UpdateEntry] = update_log.entries
    dead_letters = read_dead_letters(bootstrap, topic, trusted, timeout_s=timeout_s)
    dead = dead_letters.messages()

    final_offsets = {int(p): int(o) for p, o in final_manifest_extra.get("offsets", {}).items()}
    tail = final_manifest_extra.get("tail_verdicts", {})
    used = [(g.partition, g.offset, g.rollout_id) for e in entries for g in e.used]
    used_ids = [g.rollout_id for e in entries for g in e.used]
    dropped = {(g.partition, g.offset, g.rollout_id) for e in entries for g in e.dropped}
    dropped |= {(g["partition"], g["offset"], g["rollout_id"]) for g in tail.get("dropped", [])}
    duplicates = {(g.partition, g.offset, g.rollout_id) for e in entries for g in e.duplicates}
    duplicates |= {(g["partition"], g["offset"], g["rollout_id"]) for g in tail.get("duplicates", [])}
    # A message judged before a restart and read again after it (a learner resumes at its
    # earliest group still waiting for a verdict) counts once, as what was decided first.
    duplicates -= set(used) | dropped
    pending = {m for m in messages if m[1] >= int(final_offsets.get(m[0], 0))}
    accounted = set(used) | dropped | duplicates | dead | pending
    unaccounted = sorted((m for m in messages if m not in accounted), key=lambda m: (m[0], m[1]))

    counts = {
        "produced": len(messages), "used_in_updates": len(set(used) & messages),
        "dropped_stale": len(dropped & messages), "dead_lettered": len(dead & messages),
        "duplicates_ignored": len(duplicates & messages), "pending_at_end": len(pending),
    }
    counts["lost"] = counts["produced"] - sum(counts[k] for k in ("used_in_updates", "dropped_stale", "dead_lettered",
                                                                  "duplicates_ignored", "pending_at_end"))
    messages_twice = sum(n - 1 for n in Counter(used).values() if n > 1)
    ids_twice = sum(n - 1 for n in Counter(used_ids).values() if n > 1)
    reports = sampler_reports or {}
    forged = {}
    if honest_sampler_ids is not None:
        sender = {(r.partition, r.offset, header_value(r.headers, "rollout_id")): header_value(r.headers, "sampler_id")
                  for r in log}
        forged = forged_counts(sender, set(used) & messages, honest_sampler_ids, forged_messages)
    return {
        **forged,
        **counts,
        "used_twice": max(messages_twice, ids_twice),
        "used_without_verdict": sum(1 for e in entries for g in e.used if g.verdict is None),
        "unaccounted_offsets": [f"{p}:{o}:{i}" for p, o, i in unaccounted[:100]],
        "unaccounted_count": len(unaccounted),
        "discarded_at_source": sum(int(r.get("discarded_at_source", 0)) for r in reports.values()),
        "update_steps": len(entries),
        "refused_control_records": {"updates": update_log.refused_by_reason(),
                                    "dead": dead_letters.refused_by_reason()},
        # What the broker did, not the pipeline: offsets holding several messages, offsets skipped.
        "broker_offset_collisions": sum(1 for n in per_offset.values() if n > 1),
        "broker_offset_gaps": sum(e for e in ends.values()) - len(per_offset),
        "log_end_offsets": {str(p): e for p, e in ends.items()},
        "learner_final_offsets": {str(p): o for p, o in final_offsets.items()},
    }


def forged_counts(sender: dict[tuple, Optional[str]], used_messages: set[tuple], honest_sampler_ids: set[str],
                  forged_messages: frozenset = frozenset()) -> dict:
    """Per sampler id, the messages produced and used; `forged_used_in_updates`, the used
    messages that name no honest sampler or are an attacker's copies; `copies_used_in_updates`,
    the copies alone. Messages are (partition, offset, rollout id) throughout, so a message that
    shares its offset with a copy (two messages under one offset: Tansu 0.6) is not taken for it."""
    by_sampler: dict[str, dict] = {}
    for m, sampler_id in sender.items():
        row = by_sampler.setdefault(str(sampler_id), {"produced": 0, "used": 0})
        row["produced"] += 1
        row["used"] += m in used_messages
    return {"forged_used_in_updates": sum(1 for m in used_messages
                                          if sender.get(m) not in honest_sampler_ids or m in forged_messages),
            "copies_used_in_updates": len(used_messages & forged_messages),
            "by_sampler": by_sampler}
