"""A 90-second chaos run as a user starts it: every fault survived, the audit balances."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ENV_OVERRIDES

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_a_chaos_run_loses_nothing_and_uses_nothing_twice(tmp_path):
    out = tmp_path / "chaos"
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}  # its own stack
    proc = subprocess.run(
        [sys.executable, "-m", "heterorl", "chaos", "--config", "smoke", "--minutes", "1.5", "--partition-s", "20",
         "--samplers", "2", "--out", str(out), "--set", "sampler.max_backlog_groups=64"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    audit = json.loads((out / "audit.json").read_text())
    # every scheduled fault happened
    for kind in ("partition", "kill_learner", "restart_broker", "kill_sampler", "add_sampler", "remove_sampler",
                 "corrupt_delta", "kill_sampler_mid_download"):
        assert audit["faults"].get(kind, 0) >= 1, (kind, audit["faults"])
    assert audit["faults"]["blackholed_windows"] >= 1
    # the books balance, from independent sources
    assert audit["produced"] > 0 and audit["used_in_updates"] > 0
    assert audit["lost"] == 0 and audit["used_twice"] == 0 and audit["unaccounted_count"] == 0
    assert audit["pending_at_end"] == 0  # samplers stopped, learner drained
    assert audit["produced"] == (audit["used_in_updates"] + audit["dropped_stale"] + audit["dead_lettered"]
                                 + audit["duplicates_ignored"])
    assert audit["final_policy_version"] > 0
    # the weight path: the learner killed after publishing past its last recovery state resumed
    # under a new version; the corrupted delta was refused, never loaded
    weights = audit["weight_path"]
    kill, = weights["learner_kills"]
    assert kill["resumed_as_version"] > kill["newest_published"] and weights["versions_reused"] == 0
    assert weights["corrupted_deltas"] and weights["sampler_refused_checkpoints"] >= 1
