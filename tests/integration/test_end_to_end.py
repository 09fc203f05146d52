"""`heterorl train` as a user runs it: one learner and one sampler as real processes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_short_training_run(local_stack_env, tmp_path):
    from pipeline.metrics import read_metrics
    from pipeline.runtime import connect_run

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(ROOT / "configs/smoke.yaml"),
           "--out", str(out), "--data-dir", str(tmp_path / "data"), "--set", "learner.max_steps=4"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_accuracy_before", "eval_accuracy_after", "final_policy_version", "final_checkpoint",
                "rollout_topic", "groups_consumed", "groups_dropped"):
        assert key in summary, key
    assert summary["final_policy_version"] == 4
    assert summary["groups_consumed"] >= 4 * 2  # groups_per_step = 2
    assert summary["final_checkpoint"] == f"s3://{local_stack_env.bucket}/{summary['run']}/v4/"
    assert summary["local_stack_kept"] is True  # it used the running stack and left it alone

    # The version advanced in Redis and checkpoints with valid manifests exist in S3.
    cfg = load_config(ROOT / "configs/smoke.yaml", [f"run.name={summary['run']}"])
    handles = connect_run(cfg)
    version, manifest_key = handles.state.policy()
    assert version == 4
    versions = handles.store.list_versions()
    assert versions[-1] == 4 and len(versions) == cfg.learner.keep_checkpoints
    for v in versions:
        handles.store.fetch(handles.store.manifest_key(v), tmp_path / f"check-v{v}")  # verifies every sha256

    steps = read_metrics(out / "metrics.jsonl", "learner")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert all(s["staleness_max"] <= cfg.learner.max_delay_steps for s in steps)
    evals = read_metrics(out / "metrics.jsonl", "eval")
    assert [e["policy_version"] for e in evals] == [0, 4]
    assert (out / "report.png").stat().st_size > 10_000
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert "held-out accuracy" in proc.stdout
