"""Keys as a user manages them, and a revocation reaching a running learner within 5 s;
then the 2-minute `heterorl attack` run whose audit must meet every target."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from pipeline.config import ENV_OVERRIDES
from pipeline.records.update_log import read_update_log
from pipeline.wire.signing import read_public_file

pytestmark = pytest.mark.integration


def heterorl(*args, env=None, check=True, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "heterorl", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _log_time(line: str, day: datetime) -> float:
    h, m, s = map(int, line[:8].split(":"))
    return day.replace(hour=h, minute=m, second=s, microsecond=0).timestamp()


def test_keys_add_list_revoke_and_the_learner_stops_using_a_revoked_key_within_5s(local_stack_env, tmp_path):
    env = dict(os.environ)
    run = f"trust-{int(time.time())}"
    common = ["--config", "smoke", "--data-dir", str(tmp_path), "--set", f"run.name={run}"]
    assert "root key" in heterorl("keys", "init", *common, env=env).stdout
    added = heterorl("keys", "add", "box-1", *common, env=env).stdout
    key_id = re.search(r"added key (\w+) for sampler 'box-1'", added).group(1)
    assert oct((tmp_path / "keys/samplers/box-1.key").stat().st_mode)[-3:] == "600"
    added = heterorl("keys", "add", "val-1", "--role", "validator", *common, env=env).stdout
    validator_key_id = re.search(r"added key (\w+) for validator 'val-1'", added).group(1)
    assert (tmp_path / "keys/validators/val-1.key").exists()
    listed = heterorl("keys", "list", *common, env=env).stdout
    assert re.search(rf"{key_id}\s+sampler\s+box-1\s+active", listed)
    assert re.search(rf"{validator_key_id}\s+validator\s+val-1\s+active", listed)
    missing = heterorl("sampler", *common, "--id", "box-2", env=env, check=False)
    assert missing.returncode == 2 and "heterorl keys add box-2" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    logs = tmp_path / "logs"
    logs.mkdir()
    settings = [*common, "--set", "learner.max_steps=1000", "--set", "learner.groups_per_step=4"]
    learner = subprocess.Popen([sys.executable, "-m", "heterorl", "learner", *settings, "--out", str(tmp_path / "run")],
                               stdout=open(logs / "learner.log", "w"), stderr=subprocess.STDOUT, env=env)
    sampler = subprocess.Popen([sys.executable, "-m", "heterorl", "sampler", *settings, "--id", "box-1"],
                               stdout=open(logs / "sampler.log", "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while "step 3 " not in (logs / "learner.log").read_text():
            assert time.time() < deadline and learner.poll() is None, (logs / "learner.log").read_text()[-3000:]
            time.sleep(1)
        day = datetime.now()
        revoked_at = time.time()
        assert f"revoked key {key_id}" in heterorl("keys", "revoke", "box-1", *common, env=env).stdout
        assert re.search(rf"{key_id}\s+sampler\s+box-1\s+revoked", heterorl("keys", "list", *common, env=env).stdout)
        while "was revoked" not in (logs / "learner.log").read_text():
            assert time.time() < revoked_at + 60, "the learner never refused the revoked key"
            time.sleep(0.5)
        time.sleep(6)
    finally:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(60)
        learner.send_signal(signal.SIGUSR1)  # drain: read the rest, publish, exit 0
        try:
            learner.wait(120)
        except subprocess.TimeoutExpired:
            learner.kill()
    log = (logs / "learner.log").read_text()
    first_refusal = next(_log_time(line, day) for line in log.splitlines() if "was revoked" in line)
    # Log times have whole seconds: the refusal came within 5 s (+1 s of rounding) of the revocation.
    assert first_refusal <= revoked_at + 6, (first_refusal - revoked_at)
    learner_public = read_public_file(tmp_path / "keys" / "learner.pub")
    update_log = read_update_log(local_stack_env.kafka_bootstrap, f"{run}.rollouts", learner_public)
    entries = update_log.entries
    assert entries and not update_log.refused  # every entry signed by the learner's key
    used_late = [g for e in entries if e.time > revoked_at + 5 for g in e.used]
    assert used_late == [], "groups of the revoked key were used more than 5 s after the revocation"
    assert any(g for e in entries if e.time < revoked_at for g in e.used)  # it was used before


@pytest.mark.slow
def test_two_minute_attack_with_a_validator_meets_every_target(tmp_path, demo_data_dir):
    """`heterorl attack --validators 1`: the adversarial samplers join with an invite, the
    groups' content is checked by a validator, and forged verdicts come on top of the forged groups (the learner's own checks of the same
    adversaries are GroupScreen's, tests/unit/test_screening.py; docs/results/attack_and_chaos.md shows a run of each)."""
    out = tmp_path / "attack"
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}  # its own stack
    proc = subprocess.run([sys.executable, "-m", "heterorl", "attack", "--config", "demo", "--minutes", "2",
                           "--validators", "1", "--out", str(out), "--data-dir", str(demo_data_dir),
                           "--set", "model.warmup_target_accuracy=0.1",  # a shorter warm-up: RL from 10 %
                           # fp32 on every machine: the honest statistic below is float32 rounding
                           "--set", "learner.precision=fp32", "--set", "sampler.precision=fp32"],
                          capture_output=True, text=True, timeout=1200, env=env)
    audit = json.loads((out / "attack_audit.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert audit["forged_used_in_updates"] == 0 and audit["accounting"]["used_twice"] == 0
    assert audit["honest_quarantined"] == []
    for kind in ("forged_rewards", "noisy_logprobs", "other_model", "false_version"):
        a = audit["adversaries"][kind]
        assert a["groups_used"] == 0 and a["quarantined"] and a["quarantined_after_groups"] <= 20, (kind, a)
    assert audit["adversaries"]["noisy_logprobs"]["quarantined_after_fresh_groups"] <= 2
    assert audit["adversaries"]["bad_signature"]["groups_used"] == 0
    # probe-and-flood: forged past probation, used no more than a draw of its own per group allows
    prober = audit["adversaries"]["stale_prober"]
    assert prober["forged_sent"] > 0 and prober["forged_used"] <= prober["forged_used_bound"], prober
    assert audit["adversary_keys_local"] == []  # every adversary checked as the stranger it is
    assert audit["adversaries_not_joined"] == []  # each joined with the attack's invite, a key of its own
    assert all(audit["adversaries"][kind]["keys"][0]["invite"] == audit["invite"]
               for kind in ("forged_rewards", "noisy_logprobs", "other_model", "false_version", "bad_signature",
                            "stale_prober"))
    assert audit["adversaries"]["bad_signature"]["groups_produced"] > 20
    assert audit["adversaries"]["replay"]["copies_sent"] > 0 and audit["adversaries"]["replay"]["copies_used"] == 0
    assert audit["adversaries"]["tampered_manifest"]["honest_sampler_refusals"] > 0
    # every kind of forged verdict was sent and every one refused under its reason
    forged = audit["adversaries"]["forged_verdicts"]
    assert all(forged["sent"][k] > 0 for k in ("unsigned", "sampler_key", "other_group", "replayed")), forged
    # at least as many refusals as a reader finds in the verdicts topic, by kind: more come from
    # copies the broker stored twice (a validator's verdict resent after a broker error is refused
    # as a replay too); fewer are found than sent where the broker hid a message at a collided
    # offset, a few at most (the 95 % bound)
    refused, found = forged["refused_by_the_learner"], forged["in_topic"]
    assert all(refused[k] >= found[k] > 0 for k in refused) and forged["target_met"], (forged, audit["learner_verdicts"])
    assert sum(found.values()) >= 0.95 * sum(forged["sent"].values()), forged
    verdicts = audit["learner_verdicts"]
    assert verdicts["passed"] >= audit["accounting"]["used_in_updates"] > 0  # each group used had a passing verdict
    assert not any(k.startswith("logprobs_checked") for k in audit["learner_checks"])  # the learner checked none
    assert audit["eval_accuracy_after"] > audit["eval_accuracy_before"]
    # the stranger, with an invite of its own, tried issue 77's table at the servers during the run:
    # every row refused (or bounded: its claims), the run unharmed (exit 0 above, nothing forged used,
    # nothing used twice), and once the operator revoked its invite, Kafka, Redis and S3 each refused
    # it within 30 s (`lost` is no target of the attack: lab/attack.py says why)
    stranger = audit["stranger"]
    assert all(r["tried"] > 0 and r["accepted"] == 0 for r in stranger["rows"].values()), stranger
    assert stranger["rows"]["7"]["bounded"] > 0 and stranger["target_met"], stranger
    assert set(stranger["revoked_after_s"]) == {"kafka", "redis", "s3"}, stranger
    assert max(stranger["revoked_after_s"].values()) <= 30, stranger
    gaps_by_sampler, = [checks["logprob_gap_by_sampler"] for checks in audit["validator_checks"].values()]
    assert any("-adv-" in s for s in gaps_by_sampler)
    for sampler, gaps in gaps_by_sampler.items():
        if "-adv-" not in sampler:
            assert gaps["max"] < 0.01, (sampler, gaps)  # honest samplers: float noise, far below 0.10
    assert time.monotonic() - started < 900
