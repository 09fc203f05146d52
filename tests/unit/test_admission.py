"""Admission without servers: the max-delay boundary, recheck at use, duplicates across a restart,
poison messages, and the batch it hands out."""

import pytest

from pipeline.learning.admission import Admission, RolloutLimits
from pipeline.config import load_config
from pipeline.wire.rollout import encode_rollout
from tests.unit.test_rollout import make_rollout

LIMITS = RolloutLimits(vocab_size=20, temperature=1.0, max_new_tokens=8, max_positions=64)
NOW = 1_000_000.0


def rules(**over):
    return load_config(None, [f"learner.{k}={v}" for k, v in over.items()], env={}).learner


def message(version: int, created_at: float = NOW, **over) -> bytes:
    return encode_rollout(make_rollout(policy_version=version, created_at=created_at, **over))


def test_staleness_max_is_kept_and_max_plus_one_is_dropped():
    adm = Admission(rules(max_delay_steps=4, groups_per_step=8), LIMITS)
    assert adm.admit_message(0, 0, message(6), version=10, now=NOW).verdict == "kept"      # τ = 4 = max
    dropped = adm.admit_message(0, 1, message(5), version=10, now=NOW)                    # τ = 5 = max + 1
    assert (dropped.verdict, dropped.reason) == ("dropped", "too_stale_steps")
    assert [g.staleness for g in adm.pending] == [4]
    verdicts = adm.take_verdicts()
    assert [(d.offset, d.staleness, d.reason) for d in verdicts.dropped] == [(1, 5, "too_stale_steps")]
    assert adm.counters.as_dict()["dropped_by_reason"] == {"too_stale_steps": 1}
    assert not adm.take_verdicts()  # taken once


def test_a_batch_is_handed_out_when_full_and_counts_as_used_once_trained():
    adm = Admission(rules(groups_per_step=3), LIMITS)
    for offset in range(2):
        adm.admit_message(0, offset, message(9), version=10, now=NOW)
        assert adm.take_batch(NOW) == []
    adm.admit_message(0, 2, message(10), version=10, now=NOW)
    batch = adm.take_batch(NOW)
    assert [g.offset for g in batch] == [0, 1, 2] and [g.staleness for g in batch] == [1, 1, 0]
    assert adm.pending == []
    assert adm.counters.as_dict()["groups_used"] == 0  # not until it was trained on
    adm.count_used(batch)
    c = adm.counters.as_dict()
    assert (c["groups_consumed"], c["groups_used"], c["max_staleness_used"]) == (3, 3, 1)
    assert [u.rollout_id for u in (g.used() for g in batch)] == [g.rollout.rollout_id for g in batch]


def test_recheck_at_use_drops_a_group_that_grew_too_old_while_the_batch_filled():
    adm = Admission(rules(groups_per_step=2, max_delay_seconds=30.0), LIMITS)
    assert adm.admit_message(0, 0, message(10, created_at=NOW - 20), version=10, now=NOW).verdict == "kept"
    assert adm.admit_message(0, 1, message(10, created_at=NOW + 15), version=10, now=NOW + 15).verdict == "kept"
    # At use, 15 s later, the first group is 35 s old: past the limit, dropped, and the batch keeps filling.
    assert adm.take_batch(NOW + 15) == []
    assert [g.offset for g in adm.pending] == [1]
    assert [(d.offset, d.reason) for d in adm.take_verdicts().dropped] == [(0, "too_old_seconds")]
    # A replay passes now=None: recorded ages stand and nothing is re-measured.
    replay = Admission(rules(groups_per_step=1, max_delay_seconds=30.0))
    replay.admit_group(make_rollout(created_at=0.0), 0, 0, staleness=0, age_s=10.0)
    assert len(replay.take_batch(None)) == 1
    replay.admit_group(make_rollout(created_at=0.0), 0, 1, staleness=0, age_s=None)  # a log without ages
    (group,) = replay.take_batch(None)
    assert group.decision.keep and group.used().age_s is None


def test_a_drain_takes_the_last_smaller_batch():
    adm = Admission(rules(groups_per_step=8), LIMITS)
    adm.admit_message(0, 0, message(10), version=10, now=NOW)
    assert adm.take_batch(NOW) == []
    assert len(adm.take_batch(NOW, last=True)) == 1


def test_duplicates_are_ignored_also_across_a_restart():
    first = make_rollout(policy_version=9, created_at=NOW)
    adm = Admission(rules(groups_per_step=8), LIMITS)
    assert adm.admit_message(0, 0, encode_rollout(first), version=10, now=NOW).verdict == "kept"
    again = adm.admit_message(0, 1, encode_rollout(first), version=10, now=NOW)
    assert again.verdict == "duplicate" and len(adm.pending) == 1
    # A restarted learner starts with the ids its update log judged before the checkpoint.
    restarted = Admission(rules(groups_per_step=8), LIMITS, judged_ids={first.rollout_id})
    assert restarted.admit_message(0, 7, encode_rollout(first), version=10, now=NOW).verdict == "duplicate"
    assert restarted.pending == []
    assert [(d.offset, d.rollout_id) for d in restarted.take_verdicts().duplicates] == [(7, first.rollout_id)]
    assert restarted.counters.duplicates == 1


@pytest.mark.parametrize("payload, version, reason", [
    (b"\x00not msgpack", 10, "msgpack"),
    (message(11), 10, "newer than the learner's 10"),
    (message(9, sampling={"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8}), 10, "temperature"),
    (message(9, prompt_ids=[1, 99]), 10, "vocabulary of 20"),
    (message(9, completion_ids=[[3] * 9, [2], [2]], sampler_logps=[[-1.0] * 9, [-1.0], [-1.0]]), 10,
     "max_new_tokens=8"),
])
def test_poison_messages_are_malformed_with_their_reason(payload, version, reason):
    adm = Admission(rules(), LIMITS)
    admitted = adm.admit_message(2, 5, payload, version=version, now=NOW)
    assert admitted.verdict == "malformed" and reason in admitted.reason
    assert [(m.partition, m.offset) for m in adm.take_verdicts().malformed] == [(2, 5)]
    assert adm.counters.malformed == 1 and adm.counters.groups_consumed == 1 and adm.pending == []


def test_reweighted_groups_carry_their_weight_into_the_batch():
    adm = Admission(rules(max_delay_steps=2, stale_policy="reweight", reweight_decay=0.5, groups_per_step=1), LIMITS)
    adm.admit_message(0, 0, message(7), version=10, now=NOW)  # τ = 3: one past the limit
    (group,) = adm.take_batch(NOW)
    adm.count_used([group])
    assert group.decision.weight == 0.5 and group.used().weight == 0.5
    assert adm.counters.as_dict()["groups_reweighted"] == 1
