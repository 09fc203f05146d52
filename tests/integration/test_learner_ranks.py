"""`heterorl train` with a learner of two processes (gloo ranks on this CPU), as a user runs it.

That two ranks compute the same step as one is proven number for number in
tests/unit/test_ranks.py, and that a run raises accuracy in tests/integration/test_trust.py;
this test proves the command starts the second rank, feeds it every step and finishes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_train_with_two_learner_processes_completes(local_stack, tmp_path, demo_data_dir):
    from infra.local_stack import stack_env

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "heterorl", "train", "--config", "demo", "--out", str(out), "--data-dir",
         str(demo_data_dir), "--set", "learner.num_processes=2", "--set", "learner.max_steps=4",
         "--set", "learner.groups_per_step=16", "--set", "eval.every=null", "--set", "eval.problems=20"],
        cwd=ROOT, env={**os.environ, **stack_env(local_stack)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy_version"] == 4
    log = (out / "logs" / "learner.log").read_text()
    assert "rank 1 of 2 ready" in log  # the second process trained its share of every step
    assert summary["max_staleness_used"] <= 4
