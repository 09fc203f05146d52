"""Validators on the real local servers: `heterorl train` with a validator process, whose
verdicts are the only way a group gets into a batch (docs/security.md, "Validators")."""

import json

import pytest

from pipeline.update_log import read_entries_file
from tests.integration.test_samplers_and_tasks import train

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_train_with_a_validator_uses_only_groups_it_passed(tmp_path):
    proc = train(tmp_path, "train.num_validators=1", "learner.max_steps=4", "eval.every=null", "eval.problems=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_policy_version"] == 4
    learner = json.loads((run / "learner_summary.json").read_text())
    verdicts = learner["verdicts"]
    assert verdicts["passed"] >= learner["groups_used"] > 0
    assert not any(k.startswith("refused:") for k in verdicts), verdicts  # the honest validator's all accepted
    assert learner["checks"].get("logprobs_checked_fresh", 0) == 0  # the learner checked nothing itself
    assert len(list((tmp_path / "data" / "keys" / "validators").glob("*.key"))) == 1  # made and registered
    entries = [e for e in read_entries_file(run / "updates.jsonl") if e.kind == "step"]
    used = [g for e in entries for g in e.used]
    assert len(used) == learner["groups_used"]
    assert all(g.verdict and ":" in g.verdict for g in used)  # each let in by a recorded verdict
    log = (run / "logs" / "validator-0.log").read_text()
    assert "holding partition(s) [0]" in log and "stopped after" in log
