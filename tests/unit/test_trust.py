"""Signatures, the key registry, the per-message seal check, the content rules and strikes."""

import json
import math
import os
import stat
import time

import msgpack
import numpy as np
import pytest

from pipeline.learning.admission import Admission, RolloutLimits
from pipeline.config import LearnerConfig
from pipeline.wire.rollout import decode_rollout, encode_rollout, seal_rollout
from pipeline.wire.signing import (KeyFileError, SignatureError, SigningKey, read_key_file, sign_document,
                              verify_document, write_key_file)
from pipeline.trust import KeyEntry, KeyRegistry, Rejected, RolloutVerifier, StrikePolicy, logprob_gap, termination_error
from pipeline.weights.store import sign_pointer, verify_pointer
from tests.unit.test_rollout import make_rollout

NOW = 1_700_000_000.0
RUN = "run-a"


def registry_with(*entries: KeyEntry) -> KeyRegistry:
    reg = KeyRegistry.empty(RUN)
    for e in entries:
        reg = reg.with_key(e)
    return reg


def entry(key: SigningKey, sampler_id: str = "s1", expires_at: float = NOW + 3600) -> KeyEntry:
    return KeyEntry(key.key_id, sampler_id, key.public, "active", expires_at, NOW - 10)


def sealed(key: SigningKey, seq: int = 1, **over) -> bytes:
    fields = dict(run=RUN, key_id=key.key_id, seq=seq, sampler_id="s1")
    fields.update(over)
    return seal_rollout(make_rollout(**fields), key)


def test_only_a_root_signed_entry_marks_a_key_as_the_run_s_own():
    """`local` (a key the run minted for a sampler it started) survives the signed round trip;
    an entry without it, a revoked one or a validator's is not trusted; and nobody without the
    root key can mark their key local."""
    from pipeline.trust import trusted_sampler

    root, own, stranger, validator = (SigningKey.generate() for _ in range(4))
    reg = registry_with(KeyEntry(own.key_id, "s1", own.public, "active", NOW + 3600, NOW, local=True),
                        entry(stranger, "s2"),
                        KeyEntry(validator.key_id, "v1", validator.public, "active", NOW + 3600, NOW,
                                 role="validator", local=True))
    read = KeyRegistry.from_signed(json.loads(json.dumps(reg.signed(root))), root.public, RUN)
    assert read.keys[own.key_id].local and not read.keys[stranger.key_id].local
    assert [k for k in read.keys if read.is_local(k)] == [own.key_id]
    assert trusted_sampler(read, own.key_id, True) and not trusted_sampler(read, own.key_id, False)
    assert not trusted_sampler(read, stranger.key_id, True) and not trusted_sampler(None, own.key_id, True)
    assert not read.with_revoked(own.key_id, NOW).is_local(own.key_id)
    forged = reg.signed(root)
    forged["keys"][stranger.key_id]["local"] = True  # a stranger marking itself local
    with pytest.raises(SignatureError):
        KeyRegistry.from_signed(forged, root.public, RUN)


# ---- signing ---------------------------------------------------------------------------------
def test_a_signed_document_verifies_and_any_change_breaks_it():
    key = SigningKey.generate()
    doc = sign_document({"version": 3, "files": [{"sha256": "ab"}]}, key)
    assert verify_document(json.loads(json.dumps(doc)), key.public, "m") == {"version": 3, "files": [{"sha256": "ab"}]}
    doc["files"][0]["sha256"] = "cd"
    with pytest.raises(SignatureError, match="bad signature"):
        verify_document(doc, key.public, "m")
    with pytest.raises(SignatureError, match="not the trusted"):
        verify_document(sign_document({"version": 3}, SigningKey.generate()), key.public, "m")
    with pytest.raises(SignatureError, match="not signed"):
        verify_document({"version": 3}, key.public, "m")


def test_key_files_are_private_and_never_overwritten(tmp_path):
    key = SigningKey.generate()
    path = write_key_file(key, tmp_path / "k.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_key_file(path).key_id == key.key_id
    with pytest.raises(FileExistsError):
        write_key_file(SigningKey.generate(), path)
    with pytest.raises(KeyFileError, match="does not exist"):
        read_key_file(tmp_path / "missing.key")
    (tmp_path / "bad.key").write_text("{}")
    with pytest.raises(KeyFileError, match="not a heterorl key file"):
        read_key_file(tmp_path / "bad.key")


def test_the_policy_pointer_signature_binds_version_and_manifest():
    key = SigningKey.generate()
    sig = sign_pointer(RUN, 7, "run-a/v7/manifest.json", "123.5", key)
    verify_pointer(RUN, 7, "run-a/v7/manifest.json", "123.5", sig, key.public)
    for run, version, manifest in ((RUN, 8, "run-a/v7/manifest.json"), (RUN, 7, "run-a/v3/manifest.json"),
                                   ("other", 7, "run-a/v7/manifest.json")):
        with pytest.raises(SignatureError):
            verify_pointer(run, version, manifest, "123.5", sig, key.public)
    with pytest.raises(SignatureError, match="not signed"):
        verify_pointer(RUN, 7, "run-a/v7/manifest.json", "123.5", None, key.public)


# ---- the registry ----------------------------------------------------------------------------
def test_the_registry_is_accepted_only_as_the_root_signed_it():
    root, sampler = SigningKey.generate(), SigningKey.generate()
    doc = registry_with(entry(sampler)).signed(root)
    reg = KeyRegistry.from_signed(json.loads(json.dumps(doc)), root.public, RUN)
    assert reg.keys[sampler.key_id].sampler_id == "s1" and reg.serial == 1
    with pytest.raises(SignatureError, match="not .*run-b|run-a"):
        KeyRegistry.from_signed(doc, root.public, "run-b")
    doc["keys"][sampler.key_id]["status"] = "active"  # unchanged: still fine
    doc["keys"][sampler.key_id]["expires_at"] = NOW + 10**9  # an attacker extends the key
    with pytest.raises(SignatureError, match="bad signature"):
        KeyRegistry.from_signed(doc, root.public, RUN)
    with pytest.raises(SignatureError):
        KeyRegistry.from_signed(registry_with(entry(sampler)).signed(SigningKey.generate()), root.public, RUN)


# ---- the seal of each message ----------------------------------------------------------------
def rejected(verifier: RolloutVerifier, value: bytes, now: float = NOW) -> Rejected:
    with pytest.raises(Rejected) as info:
        verifier.check(value, now)
    return info.value


def test_a_valid_seal_passes_and_each_forgery_is_rejected_with_its_reason():
    key, stranger = SigningKey.generate(), SigningKey.generate()
    verifier = RolloutVerifier(RUN, registry_with(entry(key)))
    assert verifier.check(sealed(key, seq=1), NOW).key_id == key.key_id

    assert rejected(verifier, encode_rollout(make_rollout())).code == "unsigned"
    forged = msgpack.unpackb(sealed(key, seq=2), raw=False)
    better = decode_rollout(forged["signed_rollout"])
    better.rewards = [1.0, 1.0, 1.0]  # rewards raised after signing
    tampered = msgpack.packb({"signed_rollout": encode_rollout(better), "signature": forged["signature"]},
                             use_bin_type=True)
    r = rejected(verifier, tampered)
    assert r.code in ("bad_signature",) and not r.attributable
    assert rejected(verifier, sealed(stranger, seq=3)).code == "unknown_key"
    assert rejected(verifier, sealed(key, seq=4), now=NOW + 7200).code == "expired_key"
    assert rejected(verifier, sealed(key, seq=5, run="run-b")).code == "wrong_run"
    r = rejected(verifier, sealed(key, seq=6, sampler_id="someone-else"))
    assert r.code == "sampler_id_mismatch" and r.attributable

    verifier.registry = verifier.registry.with_revoked(key.key_id, NOW)
    assert rejected(verifier, sealed(key, seq=7)).code == "revoked_key"
    assert dict(verifier.rejected) == {"unsigned": 1, "bad_signature": 1, "unknown_key": 1, "expired_key": 1,
                                       "wrong_run": 1, "sampler_id_mismatch": 1, "revoked_key": 1}


def test_a_reused_sequence_number_is_the_key_holders_doing_an_exact_copy_is_not():
    key = SigningKey.generate()
    verifier = RolloutVerifier(RUN, registry_with(entry(key)))
    first = sealed(key, seq=10)
    verifier.check(first, NOW)
    assert verifier.check(first, NOW).seq == 10  # a copy: the admission ignores it as a duplicate
    r = rejected(verifier, sealed(key, seq=10))  # a new message (new rollout id) under a used number
    assert r.code == "sequence_reused" and r.attributable


def test_unsigned_rollouts_pass_only_when_signatures_are_not_required():
    verifier = RolloutVerifier(RUN, None, require_signatures=False)
    assert verifier.check(encode_rollout(make_rollout()), NOW).key_id == ""
    assert rejected(verifier, sealed(SigningKey.generate())).code == "no_registry"


def test_the_seal_keeps_the_body_bytes_so_any_client_can_decode_it():
    key = SigningKey.generate()
    value = sealed(key, seq=3)
    envelope = msgpack.unpackb(value, raw=False)
    assert key.public.verify(envelope["signature"], envelope["signed_rollout"])
    back = decode_rollout(value)
    assert (back.run, back.key_id, back.seq) == (RUN, key.key_id, 3)


# ---- content rules -----------------------------------------------------------------------------
def test_logprob_gap_is_the_median_of_expm1_abs_delta():
    sampler = [[-1.0, -2.0, -0.5], [-3.0]]
    learner = [[-1.0, -2.5, -0.4], [-1.0]]
    deltas = sorted(math.exp(abs(a - b)) - 1 for a, b in zip([-1.0, -2.0, -0.5, -3.0], [-1.0, -2.5, -0.4, -1.0]))
    assert logprob_gap(sampler, learner) == pytest.approx((deltas[1] + deltas[2]) / 2, rel=1e-12)
    assert logprob_gap(sampler, sampler) == 0.0
    rng = np.random.default_rng(0)  # the noise adversary: N(0, 0.5) gives a median of about e^0.337 - 1 = 0.40
    honest = rng.uniform(-3, 0, size=(8, 40))
    noisy = honest + rng.normal(0, 0.5, honest.shape)
    assert 0.3 < logprob_gap(noisy.tolist(), honest.tolist()) < 0.5


def test_termination_rule():
    eos = [2]
    assert termination_error([[5, 2], [5, 6, 7]], eos, max_new_tokens=3) == ""
    assert "after an EOS" in termination_error([[5, 2, 6]], eos, max_new_tokens=3)
    assert "without an EOS" in termination_error([[5, 6]], eos, max_new_tokens=3)
    limits = RolloutLimits(vocab_size=100, temperature=1.0, max_new_tokens=3, max_positions=64, eos_ids=(2,))
    admission = Admission(LearnerConfig(groups_per_step=4), limits)
    bad = make_rollout(completion_ids=[[8, 9]], sampler_logps=[[-0.5, -0.5]], rewards=[0.0], policy_version=0,
                       sampling={"temperature": 1.0})
    verdict = admission.admit_message(0, 0, encode_rollout(bad), 0, bad.created_at)
    assert verdict.verdict == "malformed" and "termination rule" in verdict.reason


def test_strikes_quarantine_at_the_limit_or_at_once_for_signed_impossibilities():
    policy = StrikePolicy(strikes_to_quarantine=2)
    assert policy.strike("k1", "s1", "reward_mismatch", "3 of 8", NOW) is None
    q = policy.strike("k1", "s1", "logprob_mismatch", "0.4 > 0.1", NOW)
    assert q is not None and policy.is_quarantined("k1") and len(q.strikes) == 2
    assert policy.strike("k1", "s1", "reward_mismatch", "again", NOW) is None  # already quarantined
    q = policy.strike("k2", "s2", "future_version", "v1000", NOW)
    assert q is not None and q.reason.startswith("future_version")
    assert policy.strike("", "anon", "future_version", "unsigned", NOW) is None  # nobody to blame
    assert not policy.is_quarantined("")


def test_refused_and_withdrawn_groups_are_accounted_as_dropped_with_their_reason():
    admission = Admission(LearnerConfig(groups_per_step=10))
    groups = [make_rollout(policy_version=0, key_id=k) for k in ("a", "b", "a")]
    for i, g in enumerate(groups):
        assert admission.admit_rollout(g, 0, i, 0, g.created_at).verdict == "kept"
    assert admission.withdraw(lambda g: g.rollout.key_id != "a", lambda g: "quarantined") == 2
    late = make_rollout(policy_version=0, key_id="a")
    assert admission.refuse(late, 0, 3, 0, "quarantined").verdict == "dropped"
    assert admission.refuse(late, 0, 4, 0, "quarantined").verdict == "duplicate"
    admission.reject(0, 5, "bad_signature", "bad signature for key x")
    v = admission.take_verdicts()
    assert sorted((d.offset, d.reason) for d in v.dropped) == [(0, "quarantined"), (2, "quarantined"),
                                                               (3, "quarantined")]
    assert [m.reason for m in v.malformed] == ["rejected: bad signature for key x"]
    assert [g.rollout.key_id for g in admission.pending] == ["b"]
    c = admission.counters.as_dict()
    assert c["refused_by_reason"] == {"quarantined": 3} and c["rejected_by_reason"] == {"bad_signature": 1}
    assert c["groups_consumed"] == 6


def test_status_shows_quarantined_samplers_and_why_and_the_validators_at_work():
    from heterorl.status import format_status

    status = {"kafka_bootstrap": "k:1", "redis_url": "redis://r:2/0", "s3_endpoint": "http://s:3", "bucket": "b",
              "local_stack": True, "run": "r", "rollout_topic": "r.rollouts", "topic_end_offsets": {}, "policy_version": 4,
              "checkpoints": [4], "learner": {}, "samplers": {}, "expired_samplers": {}, "claims": {},
              "quarantined": {"a4aef1d86ef55e62": {"sampler_id": "box-9", "reason": "2 failed checks, last reward_mismatch",
                                                   "groups_seen": 2, "dropped_in_flight": 1, "at": NOW}},
              "validators": {"run-v0": {"partitions": [0, 2]}, "run-v1": {"partitions": []}}}
    text = format_status(status)
    assert "validators 2 live\n  run-v0: checking partitions 0, 2\n  run-v1: checking partitions none yet" in text
    assert "quarantined 1 sampler key(s)" in text
    assert "box-9 (key a4aef1d86ef55e62): 2 failed checks, last reward_mismatch; after 2 of its groups" in text


def test_a_sampler_key_comes_from_the_environment_then_the_file(tmp_path, monkeypatch):
    from pipeline.config import load_config
    from pipeline.trust.keyring import SAMPLER_KEY_ENV, key_paths, load_sampler_key

    paths = key_paths(load_config(None, [f"services.data_dir={tmp_path}"]))
    with pytest.raises(KeyFileError, match="heterorl keys add box-1"):
        load_sampler_key(paths, "box-1", None)
    on_disk = SigningKey.generate()
    write_key_file(on_disk, paths.sampler_key("box-1"))
    assert load_sampler_key(paths, "box-1", None).key_id == on_disk.key_id
    other = SigningKey.generate()
    write_key_file(other, tmp_path / "elsewhere.key")
    assert load_sampler_key(paths, "box-1", str(tmp_path / "elsewhere.key")).key_id == other.key_id
    from_env = SigningKey.generate()
    monkeypatch.setenv(SAMPLER_KEY_ENV, from_env.seed_b64())
    assert load_sampler_key(paths, "box-1", None).key_id == from_env.key_id
    monkeypatch.setenv(SAMPLER_KEY_ENV, "not-a-key")
    with pytest.raises(KeyFileError, match="HETERORL_SAMPLER_KEY"):
        load_sampler_key(paths, "box-1", None)


def test_what_a_reader_parses_back_verifies_int_keys_and_all():
    key = SigningKey.generate()
    offsets = {i: 5 * i for i in range(12)}  # ints sort 2 < 10, their JSON text "10" < "2"
    doc = sign_document({"extra": {"offsets": offsets}}, key)
    assert verify_document(json.loads(json.dumps(doc)), key.public, "m")["extra"]["offsets"]["10"] == 50


def test_a_document_that_cannot_be_encoded_is_refused_not_a_crash():
    root = SigningKey.generate()
    forged = json.loads('{"x": "\\ud800", "signature": {"key_id": "%s", "value": "AAAA"}}' % root.key_id)
    with pytest.raises(SignatureError):
        KeyRegistry.from_signed(forged, root.public, RUN)


def test_a_registry_entry_must_be_active_or_revoked_and_match_its_key():
    root, sampler = SigningKey.generate(), SigningKey.generate()
    odd = KeyEntry(sampler.key_id, "s1", sampler.public, "trusted", NOW + 10, NOW)
    with pytest.raises(SignatureError, match="malformed"):
        KeyRegistry.from_signed(registry_with(odd).signed(root), root.public, RUN)
    swapped = KeyEntry("0" * 16, "s1", sampler.public, "active", NOW + 10, NOW)
    with pytest.raises(SignatureError, match="malformed"):
        KeyRegistry.from_signed(registry_with(swapped).signed(root), root.public, RUN)


@pytest.mark.parametrize("over, reason", [
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(sampling={"temperature": "hot"}), "not a number"),
    (dict(created_at=float("nan")), "created_at"),
])
def test_groups_the_rules_cannot_read_are_malformed_not_a_crash(over, reason):
    from pipeline.wire.rollout import RolloutDecodeError

    with pytest.raises(RolloutDecodeError, match=reason):
        decode_rollout(encode_rollout(make_rollout(**over)))


def test_an_unsigned_group_claims_no_key():
    verifier = RolloutVerifier(RUN, None, require_signatures=False)
    assert verifier.check(encode_rollout(make_rollout(key_id="a4aef1d86ef55e62", run=RUN, seq=1)), NOW).key_id == ""


def test_every_group_the_learner_reads_counts_as_judged_for_the_sampler_it_names():
    """The fleet paces on each sampler's groups sent less those the learner judged
    (`run_state.fleet_unjudged`): a group rejected at its seal was judged too, or a sampler whose
    key is not (yet) registered would hold every sampler back by what it sent."""
    from types import SimpleNamespace

    from consumers.intake import Intake
    from pipeline.clients.topics import RawRecord
    from pipeline.config import load_config
    from pipeline.records.metrics import StageClock
    from tests.unit.test_past_policies import State

    cfg = load_config(None, ["security.require_signatures=true"], env={})
    intake = Intake(cfg, Admission(cfg.learner), SimpleNamespace(check=lambda *a, **k: []), state=State(),
                    registry=None, dead_letter=lambda *a: None, clock=StageClock(), fresh_in_step=True)
    known, unknown = SigningKey.generate(), SigningKey.generate()
    intake.verifier.registry = KeyRegistry.empty(cfg.run.name).with_key(entry(known, "s1", time.time() + 3600))
    messages = [sealed(known, 1, run=cfg.run.name, policy_version=0),
                sealed(unknown, 1, run=cfg.run.name, sampler_id="s2", policy_version=0),
                b"not a rollout"]
    for offset, value in enumerate(messages):
        intake.offer(RawRecord(0, offset, value, [], 0), 0, "t")
    def unreachable(judged):
        raise ConnectionError("Redis went away")

    with pytest.raises(ConnectionError):
        intake.report_judged(unreachable)  # nothing lost: sent again next time
    sent = []
    intake.report_judged(sent.append)
    intake.report_judged(sent.append)
    assert sent == [{"s1": 1, "s2": 1}, {}]
    assert intake.verifier.rejected["unknown_key"] == 1
