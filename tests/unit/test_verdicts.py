"""Validators' verdicts: the seal a learner accepts, every forged kind it refuses, the key roles of
the registry, how validators share partitions, and groups waiting for their verdict."""

import json
from dataclasses import replace

import pytest

from consumers.validator import PartitionShare
from pipeline.learning.admission import Admission
from pipeline.config import LearnerConfig
from pipeline.wire.signing import SignatureError, SigningKey
from pipeline.trust import KeyEntry, KeyRegistry, Rejected, RolloutVerifier
from pipeline.trust.verdicts import GroupVerdict, VerdictVerifier, decode_verdict, group_digest, seal_verdict
from tests.unit.test_rollout import make_rollout
from tests.unit.test_trust import NOW, RUN, entry, registry_with, sealed


def validator_entry(key: SigningKey, validator_id: str = "v1") -> KeyEntry:
    return replace(entry(key, validator_id), role="validator")


def verdict(key: SigningKey, seq: int = 1, **over) -> GroupVerdict:
    fields = dict(run=RUN, rollout_id="r1", partition=0, offset=7, group_digest=group_digest(b"group"),
                  sampler_id="s1", key_id="k-s1", passed=True, checks=("rewards", "logprobs"), version_used=3,
                  validator_id="v1", validator_key_id=key.key_id, seq=seq, created_at=NOW)
    fields.update(over)
    return GroupVerdict(**fields)


def test_a_validators_verdict_round_trips_and_is_accepted():
    key = SigningKey.generate()
    checker = VerdictVerifier(RUN, registry_with(validator_entry(key)))
    sent = verdict(key, passed=False, failure="logprob_mismatch", detail="median 0.2 > 0.1", version_used=None)
    got = checker.check(seal_verdict(sent, key), NOW)
    assert got == sent and got.strikes
    assert got.ref == f"{key.key_id}:1"  # the update log's name for the verdict that let a group in


def test_every_forged_verdict_is_refused_with_its_reason():
    validator, sampler, stranger = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    checker = VerdictVerifier(RUN, registry_with(validator_entry(validator), entry(sampler, "s1")))

    def refused(value: bytes) -> str:
        with pytest.raises(Rejected) as e:
            checker.check(value, NOW)
        return e.value.code

    good = seal_verdict(verdict(validator, seq=1), validator)
    unsigned = json.loads(good)
    del unsigned["signature"]
    assert refused(json.dumps(unsigned).encode()) == "unsigned_verdict"
    assert refused(seal_verdict(verdict(sampler, seq=2), sampler)) == "wrong_role"  # a sampler key cannot vouch
    assert refused(seal_verdict(verdict(stranger, seq=3), stranger)) == "unknown_key"
    altered = json.loads(good)
    altered["passed"] = False  # changed after signing
    assert refused(json.dumps(altered).encode()) == "bad_signature"
    assert refused(seal_verdict(verdict(validator, seq=4, run="other-run"), validator)) == "wrong_run"
    assert refused(seal_verdict(verdict(validator, seq=5, validator_id="v2"), validator)) == "validator_id_mismatch"
    assert refused(b"not json") == "malformed_verdict"
    assert refused(json.dumps({"format": "heterorl-verdict/1", "rollout_id": 3}).encode()) == "malformed_verdict"
    assert checker.check(good, NOW).passed
    assert refused(good) == "replayed_verdict"  # the same verdict sent again


def test_a_revoked_or_expired_validator_key_is_refused():
    key = SigningKey.generate()
    registry = registry_with(validator_entry(key))
    with pytest.raises(Rejected, match="revoked"):
        VerdictVerifier(RUN, registry.with_revoked(key.key_id, NOW)).check(seal_verdict(verdict(key), key), NOW)
    with pytest.raises(Rejected, match="expired"):
        VerdictVerifier(RUN, registry).check(seal_verdict(verdict(key), key), NOW + 10 ** 6)


def test_a_verdict_names_the_exact_bytes_of_its_group():
    assert group_digest(b"group") != group_digest(b"group ")
    key = SigningKey.generate()
    document = json.loads(seal_verdict(verdict(key), key))
    assert document["group_digest"] == group_digest(b"group")
    assert decode_verdict(json.dumps(document).encode())[0].group_digest == group_digest(b"group")


def test_the_registry_keeps_each_keys_role_and_a_validator_key_cannot_sign_rollouts():
    root, validator = SigningKey.generate(), SigningKey.generate()
    registry = registry_with(validator_entry(validator))
    assert KeyRegistry.from_signed(registry.signed(root), root.public, RUN).keys[validator.key_id].role == "validator"
    with pytest.raises(Rejected) as e:
        RolloutVerifier(RUN, registry).check(sealed(validator, sampler_id="v1"), NOW)
    assert e.value.code == "wrong_role"
    document = registry.signed(root)
    bad = {**document, "keys": {k: {**v, "role": "admin"} for k, v in document["keys"].items()}}
    from pipeline.wire.signing import sign_document
    with pytest.raises(SignatureError, match="role 'admin'"):
        KeyRegistry.from_signed(sign_document({k: v for k, v in bad.items() if k != "signature"}, root), root.public,
                                RUN)


# ---- validators share the partitions -----------------------------------------------------------
def test_validators_share_the_partitions_and_a_dead_ones_are_taken_over():
    a, b = PartitionShare((0, 1, 2, 3), "a"), PartitionShare((0, 1, 2, 3), "b")
    assert a.plan({}, live_validators=1) == ([0, 1, 2, 3], [])  # alone: everything
    held = {0: "a", 1: "a", 2: "a", 3: "a"}
    assert a.plan(held, live_validators=2) == ([], [2, 3])  # a second one joined: let go of the excess
    assert b.plan({0: "a", 1: "a", 2: None, 3: None}, live_validators=2) == ([2, 3], [])
    assert b.plan({0: "a", 1: "a", 2: "b", 3: "b"}, live_validators=2) == ([], [])
    # a's leases ran out (killed): b alone takes them
    assert b.plan({0: None, 1: None, 2: "b", 3: "b"}, live_validators=1) == ([0, 1], [])
    # more validators than partitions: one each, the rest stand by
    assert PartitionShare((0,), "c").plan({0: "a"}, live_validators=3) == ([], [])


# ---- groups waiting for their verdict ----------------------------------------------------------
def test_a_group_waits_for_its_verdict_and_its_staleness_is_judged_again_when_it_arrives():
    admission = Admission(LearnerConfig(groups_per_step=2, max_delay_steps=2))
    fresh, old = make_rollout(policy_version=5), make_rollout(policy_version=4)
    for offset, group in enumerate((fresh, old)):
        assert admission.admit_rollout(group, 0, offset, 5, group.created_at, hold=True).verdict == "kept"
    assert admission.pending == [] and set(admission.awaiting) == {fresh.rollout_id, old.rollout_id}
    assert admission.take_batch(None) == []  # nothing may be trained before its verdict
    assert admission.release(fresh.rollout_id, 6, None, "k:1").verdict == "kept"  # the learner stepped meanwhile
    assert admission.pending[0].staleness == 1 and admission.pending[0].used().verdict == "k:1"
    assert admission.expire_awaiting(7, None) == 1  # old is 3 behind now: over the max delay, dropped
    assert admission.awaiting == {}
    dropped = admission.take_verdicts().dropped
    assert [(d.rollout_id, d.reason) for d in dropped] == [(old.rollout_id, "too_stale_steps")]
    late = make_rollout(policy_version=7)
    admission.admit_rollout(late, 0, 2, 7, late.created_at, hold=True)
    admission.release(late.rollout_id, 7, late.created_at, "k:2")
    batch = admission.take_batch(late.created_at + 1)  # judged again at use: the verdicts stay recorded
    assert [g.used().verdict for g in batch] == ["k:1", "k:2"]


def test_a_failed_verdict_or_a_quarantine_refuses_a_waiting_group():
    admission = Admission(LearnerConfig(groups_per_step=2))
    a, b = make_rollout(key_id="ka"), make_rollout(key_id="kb")
    for offset, group in enumerate((a, b)):
        admission.admit_rollout(group, 0, offset, 3, group.created_at, hold=True)
    admission.refuse_awaiting(a.rollout_id, "failed_verdict:reward_mismatch")
    assert admission.withdraw(lambda g: g.rollout.key_id != "kb", lambda g: "quarantined") == 1
    assert admission.awaiting == {}
    assert sorted(d.reason for d in admission.take_verdicts().dropped) == ["failed_verdict:reward_mismatch",
                                                                          "quarantined"]
    assert dict(admission.counters.refused) == {"failed_verdict": 1, "quarantined": 1}
