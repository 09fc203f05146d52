"""The chaos audit on a hand-made record: every offset accounted once; a loss or a reuse is caught."""

import uuid

import pytest

from pipeline.clients.topics import TopicWriter, ensure_topic
from pipeline.records.update_log import (DroppedGroup, DuplicateGroup, UpdateEntry, UsedGroup, dead_letter_topic,
                                 rewind_entry, updates_topic)
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration


def _record(bootstrap: str, log: list[UpdateEntry], n: int = 8, duplicate_at: int = -1, junk_at: int = -1):
    """n messages: fresh rollouts, except a second copy of the first at `duplicate_at` and
    undecodable bytes at `junk_at`."""
    topic = f"audit-{uuid.uuid4().hex[:8]}"
    for t in (topic, updates_topic(topic), dead_letter_topic(topic)):
        ensure_topic(bootstrap, t)
    sink = TopicWriter(bootstrap, topic)
    rollouts = [make_rollout() for _ in range(n)]
    for i, r in enumerate(rollouts):
        if i == junk_at:
            sink.send_raw(b"junk")
        else:
            sink.send(rollouts[0] if i == duplicate_at else r)
    sink.close()
    sink = TopicWriter(bootstrap, updates_topic(topic))
    for e in log(rollouts) if callable(log) else log:
        sink.send_raw(e.to_json().encode(), key=str(e.step).encode())
    sink.close()
    return topic, rollouts


def _used(r, offset):
    return UsedGroup(0, offset, r.rollout_id, 0, 0, 1.0, 0.1)


def test_every_offset_accounted_and_a_voided_step_does_not_count(local_stack):
    from pipeline.records.audit import audit_topic

    def log(rs):
        return [rewind_entry(0, "gepo"),
                UpdateEntry(1, 1, "gepo", 0.0, used=[_used(rs[0], 0), _used(rs[1], 1)],
                            dropped=[DroppedGroup(0, 2, rs[2].rollout_id, 0, 5, "too_stale_steps")]),
                # a learner killed after logging step 2 (offsets 3, 4) but before its checkpoint...
                UpdateEntry(2, 2, "gepo", 0.0, used=[_used(rs[3], 3), _used(rs[4], 4)]),
                # ...restarts from v1 and redoes step 2 with the same groups, and then some
                rewind_entry(1, "gepo"),
                UpdateEntry(2, 2, "gepo", 0.0, used=[_used(rs[3], 3), _used(rs[4], 4)],
                            duplicates=[DuplicateGroup(0, 5, rs[0].rollout_id)])]

    topic, _ = _record(local_stack.kafka_bootstrap, log, duplicate_at=5, junk_at=6)
    sink = TopicWriter(local_stack.kafka_bootstrap, dead_letter_topic(topic))
    sink.send_raw(b"junk", headers=[("reason", b"not msgpack"), ("source_partition", b"0"), ("source_offset", b"6")])
    sink.close()
    # offset 7 was not read yet when the final checkpoint was taken at offset 7
    audit = audit_topic(local_stack.kafka_bootstrap, topic, {"offsets": {"0": 7}})
    assert {k: audit[k] for k in ("produced", "used_in_updates", "dropped_stale", "duplicates_ignored",
                                  "dead_lettered", "pending_at_end", "lost", "used_twice", "unaccounted_count")} == {
        "produced": 8, "used_in_updates": 4, "dropped_stale": 1, "duplicates_ignored": 1, "dead_lettered": 1,
        "pending_at_end": 1, "lost": 0, "used_twice": 0, "unaccounted_count": 0}


def test_a_lost_group_and_a_reused_group_are_found(local_stack):
    from pipeline.records.audit import audit_topic

    def log(rs):
        return [UpdateEntry(1, 1, "gepo", 0.0, used=[_used(rs[0], 0), _used(rs[1], 1)]),
                UpdateEntry(2, 2, "gepo", 0.0, used=[_used(rs[1], 1), _used(rs[2], 2)])]  # offset 1 again

    topic, _ = _record(local_stack.kafka_bootstrap, log, n=4)
    audit = audit_topic(local_stack.kafka_bootstrap, topic, {"offsets": {"0": 4}})
    assert audit["used_twice"] == 1  # offset 1, with its rollout id, in two updates
    assert [m.rsplit(":", 1)[0] for m in audit["unaccounted_offsets"]] == ["0:3"]  # read, but in no update
    assert audit["lost"] == 1


def test_a_message_sharing_its_offset_with_an_attackers_copy_is_not_taken_for_it():
    """Tansu 0.6 can store two messages under one offset: the audit tells them apart by rollout
    id, so an honest group used at the offset a replayed copy was also given is not a forged one,
    while the copy itself, used, is."""
    from pipeline.records.audit import forged_counts

    honest, copy = (0, 7, "honest-id"), (0, 7, "copied-id")  # one offset, two messages
    sender = {honest: "s0", copy: "s0", (0, 3, "copied-id"): "s0", (0, 9, "forged-id"): "adv"}
    counts = forged_counts(sender, {honest, (0, 3, "copied-id")}, {"s0"}, frozenset({copy}))
    assert counts["forged_used_in_updates"] == 0 and counts["copies_used_in_updates"] == 0
    assert counts["by_sampler"] == {"s0": {"produced": 3, "used": 2}, "adv": {"produced": 1, "used": 0}}
    counts = forged_counts(sender, {copy, (0, 9, "forged-id")}, {"s0"}, frozenset({copy}))
    assert counts["forged_used_in_updates"] == 2 and counts["copies_used_in_updates"] == 1
