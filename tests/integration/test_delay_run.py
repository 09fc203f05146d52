"""A short run with the WAN-delay model on: no used group is past the max delay; drops are counted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.records.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_delayed_samplers_never_feed_the_learner_past_its_max_delay(local_stack_env, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--out", str(out),
           "--data-dir", str(tmp_path / "data"), "--set", "learner.max_steps=8", "--set", "learner.max_delay_steps=1",
           "--set", "train.num_samplers=2", "--set", "sampler.max_backlog_groups=64",
           # refresh only once 2 versions behind (past the max: the sampler must stop and refresh),
           # and hold every finished group 0.3 s before publishing it
           "--set", "sampler.delays.unit=steps", "--set", "sampler.delays.refresh.kind=fixed",
           "--set", "sampler.delays.refresh.value=2", "--set", "sampler.delays.transit.kind=fixed",
           "--set", "sampler.delays.transit.value=0.3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((out / "learner_summary.json").read_text())
    assert summary["final_policy_version"] == 8
    assert summary["max_staleness_used"] <= 1
    steps = read_metrics(out / "metrics.jsonl", "learner")
    assert len(steps) == 8 and all(s["staleness_max"] <= 1 for s in steps)
    # Everything read is accounted for: used, dropped (by reason) or malformed. (Since the samplers
    # pace on the fleet's backlog and claim only within the max delay, this run drops little or
    # nothing: the samplers stall or refresh instead, asserted below.)
    assert summary["groups_dropped"] == sum(summary["dropped_by_reason"].values())
    assert summary["groups_consumed"] == summary["groups_used"] + summary["groups_dropped"] + summary["malformed"]
    assert summary["groups_used"] == 8 * 2
    # The delays bit: each sampler waited out a drawn refresh delay, or stopped generating
    # because its data would have arrived past the max delay (and refreshed early).
    import re

    for i in range(2):
        line = [x for x in (out / "logs" / f"sampler-{i}.log").read_text().splitlines() if "stopped after" in x][-1]
        forced = int(re.search(r"forced_refreshes (\d+)", line).group(1))
        delayed = int(re.search(r"delayed_refreshes (\d+)", line).group(1))
        stalls = float(re.search(r"stalls_behind ([0-9.]+)", line).group(1))
        assert forced + delayed + stalls > 0, line
