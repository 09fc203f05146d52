"""The capacity rig's small case as a user runs it: 4 simulated samplers against the product's
learner on real servers, their groups checked by a modeled validator, and its books balance
(every group produced is used, dropped or pending; none is used twice)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ENV_OVERRIDES
from pipeline.records.update_log import read_entries_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

FAST = ["--set", "loadtest.warmup_s=2", "--set", "loadtest.warmup_steps=3", "--set", "loadtest.measure_s=10", "--set", "loadtest.learner_step_s=0.5",
        "--set", "learner.groups_per_step=8", "--set", "learner.max_delay_steps=2"]


def test_four_samplers_and_a_validator_every_group_accounted_for(tmp_path):
    out = tmp_path / "lt"
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}  # its own stack
    proc = subprocess.run([sys.executable, "-m", "heterorl", "loadtest", "--samplers", "4", "--validators", "1",
                           "--no-compare", "--out", str(out), *FAST], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((out / "loadtest.json").read_text())
    assert (out / "loadtest.png").stat().st_size > 10_000
    row, = report["rows"]
    assert row["samplers"] == 4 and row["samplers_failed"] == 0 and row["samplers_that_published"] >= 3
    # the books, from the topic, the update log and the learner's final state
    assert row["produced"] > 0 and row["used"] > 0
    assert row["lost"] == 0 and row["used_twice"] == 0 and row["pending"] == 0  # samplers stopped, learner drained
    assert row["produced"] == row["used"] + row["dropped"] + row["dead_lettered"]
    # what was measured is there, and plausible
    assert row["groups_per_s"] > 0 and 0 < row["learner_utilization"] < 1
    assert row["staleness_max"] is not None and row["staleness_max"] <= 2  # never past learner.max_delay_steps
    case_dir, = [p for p in out.iterdir() if p.name.startswith("async-")]
    steps = [e for e in read_entries_file(case_dir / "updates.jsonl") if e.kind == "step"]
    assert all(len(e.used) <= 8 for e in steps)  # learner.groups_per_step, however the verdicts arrive
    assert row["redis_commands_per_sampler_per_s"] > 0 and row["redis_p99_ms"] is not None
    assert row["policy_versions"] > 0 and row["weights_bytes_per_sampler_per_version"] > 0
    validator, = [k for k in row["exit_codes"] if k.startswith("validator-")]
    assert row["bottleneck"] and row["exit_codes"] == {"worker0": 0, "learner": 0, validator: 0}
    # the validator's verdicts: how long a group waited for one, and how busy it was
    assert row["validators"] == 1 and 0 < row["verdict_latency_p50_s"] <= row["verdict_latency_p95_s"] < 30
    assert 0 < row["validator_utilization"] < 1
    assert report["fleet"]["profile"] == "heterogeneous" and report["async_vs_sync"] is None
    assert "samplers | groups/s" in proc.stdout and "verdict p50/p95 s" in proc.stdout
