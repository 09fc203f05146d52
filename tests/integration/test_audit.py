"""The chaos audit on a hand-made record: every offset accounted once; a loss or a reuse is caught;
control records the learner did not sign (or sent again) change no count."""

import uuid

import pytest

from pipeline.clients.topics import RawRecord, TopicWriter, ensure_topic
from pipeline.records.dead_letters import DeadLetter
from pipeline.records.update_log import (DroppedGroup, DuplicateGroup, UpdateEntry, UsedGroup, dead_letter_topic,
                                         rewind_entry, updates_topic)
from pipeline.wire.signing import SigningKey
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration

LEARNER = SigningKey.generate()


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
        sink.send_raw(e.to_json(LEARNER).encode(), key=str(e.step).encode())
    sink.close()
    return topic, rollouts


def _dead_letter(bootstrap: str, topic: str, offset: int, signer=LEARNER, source_topic=None) -> None:
    sink = TopicWriter(bootstrap, dead_letter_topic(topic))
    letter = DeadLetter.of(RawRecord(0, offset, b"junk", [], 0), source_topic or topic, "not msgpack")
    sink.send_raw(letter.to_bytes(signer))
    sink.close()


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
    _dead_letter(local_stack.kafka_bootstrap, topic, 6)
    # offset 7 was not read yet when the final checkpoint was taken at offset 7
    audit = audit_topic(local_stack.kafka_bootstrap, topic, {"offsets": {"0": 7}}, LEARNER.public)
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
    audit = audit_topic(local_stack.kafka_bootstrap, topic, {"offsets": {"0": 4}}, LEARNER.public)
    assert audit["used_twice"] == 1  # offset 1, with its rollout id, in two updates
    assert [m.rsplit(":", 1)[0] for m in audit["unaccounted_offsets"]] == ["0:3"]  # read, but in no update
    assert audit["lost"] == 1


def test_control_records_the_learner_did_not_sign_or_sent_again_change_no_count(local_stack):
    """What a stranger who could write the control topics tried (issue 77, rows 2 and 3): garbage in
    the update log, a forged rewind to step 0 (it voided every step: used 1408 became lost 1408),
    forged dead letters for the groups that were lost (lost 0 again), a copy of a genuine early
    rewind sent at the end of the log. None changes a count; each is refused with its reason."""
    from pipeline.records.audit import audit_topic

    def log(rs):
        return [rewind_entry(0, "gepo", attempt="a1"),
                UpdateEntry(1, 1, "gepo", 0.0, used=[_used(rs[0], 0), _used(rs[1], 1)], attempt="a1"),
                UpdateEntry(2, 2, "gepo", 0.0, used=[_used(rs[2], 2), _used(rs[3], 3)], attempt="a1")]

    bootstrap = local_stack.kafka_bootstrap
    topic, rollouts = _record(bootstrap, log, n=6)
    honest = audit_topic(bootstrap, topic, {"offsets": {"0": 6}}, LEARNER.public)
    assert (honest["used_in_updates"], honest["lost"]) == (4, 2)  # offsets 4 and 5 read, in no update

    sink = TopicWriter(bootstrap, updates_topic(topic))
    sink.send_raw(b"this is not json")
    sink.send_raw(rewind_entry(0, "gepo", attempt="forger").to_json().encode())  # unsigned
    sink.send_raw(rewind_entry(0, "gepo", attempt="forger").to_json(SigningKey.generate()).encode())  # another key
    genuine = rewind_entry(0, "gepo", attempt="a1").to_json(LEARNER)
    sink.send_raw(genuine.replace('"step":0', '"step":-1').encode())  # altered after signing
    sink.send_raw(genuine.encode())  # the learner's own first rewind, sent again at the end
    sink.close()
    for offset in (4, 5):  # dead letters for the two lost groups: unsigned, another key's, another topic's
        _dead_letter(bootstrap, topic, offset, signer=None)
        _dead_letter(bootstrap, topic, offset, signer=SigningKey.generate())
        _dead_letter(bootstrap, topic, offset, source_topic="other.rollouts")

    audit = audit_topic(bootstrap, topic, {"offsets": {"0": 6}}, LEARNER.public)
    counts = ("produced", "used_in_updates", "dropped_stale", "dead_lettered", "lost", "used_twice")
    assert {k: audit[k] for k in counts} == {k: honest[k] for k in counts}
    assert audit["update_steps"] == 2
    assert audit["refused_control_records"] == {"updates": {"not_json": 1, "unsigned": 1, "signature": 2,
                                                            "sent_again": 1},
                                                "dead": {"unsigned": 2, "signature": 2, "other_topic": 2}}


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


def test_a_record_too_large_to_copy_is_set_aside_by_reference(local_stack, tmp_path):
    """Issue 77, row 1: a 9 MB record on the rollout topic stopped the learner for good, as copying it
    to the dead letters failed (the learner's producer takes at most 8 MiB), and again after each
    restart. A dead letter names the message instead: its place, size and hash."""
    import hashlib
    import logging
    import os

    from kafka import KafkaProducer

    from consumers.recorder import LearnerLogs
    from pipeline.clients.topics import TopicReader
    from pipeline.records.dead_letters import read_dead_letters

    bootstrap = local_stack.kafka_bootstrap
    topic = f"big-{uuid.uuid4().hex[:8]}.rollouts"
    for t in (topic, dead_letter_topic(topic)):
        ensure_topic(bootstrap, t)
    value = os.urandom(9 << 20)
    producer = KafkaProducer(bootstrap_servers=bootstrap, max_request_size=16 << 20, compression_type="gzip")
    producer.send(topic, value, headers=[("rollout_id", b"huge")]).get(30)
    producer.close()
    reader = TopicReader(bootstrap, topic, {0: 0})
    records = []
    for _ in range(30):
        records += reader.poll(1.0)
        if records:
            break
    reader.close()
    logs = LearnerLogs(bootstrap, topic, tmp_path, network_retry_s=5.0, log=logging.getLogger("test"), signer=LEARNER)
    logs.dead_letter(records[0], "not msgpack: too large")
    logs.close()
    dead = read_dead_letters(bootstrap, topic, LEARNER.public)
    assert [(d.offset, d.size, d.sha256, d.rollout_id) for d in dead.letters] == [
        (0, len(value), hashlib.sha256(value).hexdigest(), "huge")]
