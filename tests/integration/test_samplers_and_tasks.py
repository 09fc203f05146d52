"""`heterorl train` with a task read from a file, its groups checked by a validator (the vLLM
backend's run is test_end_to_end's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ENV_OVERRIDES
from pipeline.records.metrics import read_metrics
from pipeline.records.update_log import read_entries_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SUMS3 = ROOT / "heterorl" / "configs" / "data" / "sums3.jsonl"


def train(tmp_path, *overrides, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}  # no URLs: the local stack
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--out",
                           str(tmp_path / "run"), "--data-dir", str(tmp_path / "data"), *sets],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_train_on_a_dataset_whose_fields_are_not_prompt_and_answer(tmp_path):
    """Its groups are checked by a validator (docs/security.md "Validators"): the dataset's
    verifier runs there, and the learner uses only the groups it passed."""
    proc = train(tmp_path, "task.name=dataset", f"task.path={SUMS3}", "task.prompt_field=question",
                 "task.answer_field=target", "task.verifier=numeric", "learner.max_steps=4", "eval.every=null",
                 "model.warmup_steps=600",  # smoke's 20 warm-up steps get no sum right
                 "learner.groups_per_step=4",  # 64 completions a step: at ~10 % right, never all wrong by chance
                 "train.num_validators=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_only_groups_a_validator_passed_were_used(tmp_path / "run", tmp_path / "data")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_policy_version"] == 4 and summary["groups_used"] >= 16
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl", "learner")
    assert len(steps) == 4
    assert any(s["reward_mean"] > 0 for s in steps)  # the numeric verifier scored some sums right
    evals = read_metrics(tmp_path / "run" / "metrics.jsonl", "eval")
    assert [e["policy_version"] for e in evals][-1] == 4
    assert all(0.0 <= e["accuracy_sampled"] <= 1.0 for e in evals)
    assert evals[0]["n_problems"] == 20  # smoke's eval_size, from the file's held-out prompts


def test_a_dataset_field_that_does_not_exist_is_one_line_naming_the_field_and_the_file(tmp_path):
    proc = train(tmp_path, "task.name=dataset", f"task.path={SUMS3}", "task.answer_field=target", timeout=120)
    assert proc.returncode == 2
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "sums3.jsonl:1" in message and "'prompt'" in message and "question" in message


def assert_only_groups_a_validator_passed_were_used(run: Path, data: Path) -> None:
    learner = json.loads((run / "learner_summary.json").read_text())
    verdicts = learner["verdicts"]
    assert verdicts["passed"] >= learner["groups_used"] > 0
    assert not any(k.startswith("refused:") for k in verdicts), verdicts  # the honest validator's all accepted
    assert not any(k.startswith("logprobs_checked") for k in learner["checks"])  # the learner checked nothing itself
    assert len(list((data / "keys" / "validators").glob("*.key"))) == 1  # made and registered by train
    steps = [e for e in read_entries_file(run / "updates.jsonl") if e.kind == "step"]
    assert all(len(e.used) <= 4 for e in steps)  # learner.groups_per_step: verdicts never make a batch bigger
    used = [g for e in steps for g in e.used]
    assert len(used) == learner["groups_used"]
    assert all(g.verdict and ":" in g.verdict for g in used)  # each let in by a recorded verdict
    log = (run / "logs" / "validator-0.log").read_text()
    assert "holding partition(s) [0]" in log and "stopped after" in log
