"""`heterorl wan` end to end on a tiny model: a sampler on this host's network and a volunteer
on a host of its own behind a shaped link (2 Mbit/s in the kernel, 50 ms each way and a
connection reset every 20 s by the fault proxy) that joins mid-run with only an invite. The
report accounts for every group (lost 0, used twice 0), the volunteer is admitted as a stranger
and its groups are used, and the weights it took after its first policy came as deltas.

Network namespaces and tc need root and iproute2; where they are missing the test skips."""

from __future__ import annotations

import json

import pytest

from lab.wan import WanLink, run_wan, why_no_namespaces
from pipeline.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = {"model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "model.head_dim": 32,
       "model.intermediate_size": 64, "model.warmup_steps": 20, "task.eval_size": 20, "sampler.group_size": 4,
       "sampler.prompts_per_batch": 2, "sampler.max_new_tokens": 4, "learner.groups_per_step": 4,
       "learner.max_delay_steps": 128, "learner.sync_every": 8, "learner.keyframe_every": 4,
       "sampler.max_backlog_groups": 32}
"""A tiny model trains about 900 steps a minute here, and each round trip of the volunteer's link
(pointer, manifests, deltas, claims) costs 100 ms or more: a version every 8 steps, a max delay of
16 versions (about 8 s) and a backlog of at most 8 steps' groups (the near sampler would otherwise
queue up to the max delay, and every group the volunteer makes waits behind them) leave it time
to make groups that are used (with a max delay of 8 versions and no backlog cap it made none in
about half the runs); a keyframe every 4 versions gives it keyframes to cross."""


def test_a_volunteer_behind_a_slow_far_flaky_link_joins_and_its_groups_are_used(tmp_path, capsys):
    why = why_no_namespaces()
    if why:
        pytest.skip(f"shaped links need hosts of their own: {why}")
    cfg = load_config(None, [f"{k}={v}" for k, v in RUN.items()] + ["run.name=wan-test",
                                                                    f"services.data_dir={tmp_path / 'cache'}"])
    links = [WanLink("A"), WanLink("V", rate_mbit=2, delay_ms=50, jitter_ms=5, reset_every_s=20, join_at_s=8)]
    code = run_wan(cfg, tmp_path / "wan", minutes=0.6, links=links, compare_unshaped=False)
    report = json.loads((tmp_path / "wan" / "wan_report.json").read_text())
    arm = report["arms"]["shaped"]
    assert code == 0 and report["audit_ok"], arm["audit"]
    assert arm["audit"]["lost"] == 0 and arm["audit"]["used_twice"] == 0 and arm["volunteers_not_admitted"] == []
    a, v = arm["samplers"]["A"], arm["samplers"]["V"]
    assert a["used"] > 0 and v["used"] > 0 and v["started_s"] >= 8
    assert v["used"] + v["dropped_stale"] + v["refused"] <= v["sent"]
    # Its first policy came from a keyframe (packed: less than the model as held); after it, each
    # version cost a fraction of one (the cheaper of the deltas and bridges after what it held and
    # the newest keyframe's path).
    # (a later keyframe packs to a few bytes more or less than v0's)
    assert min(v["first_policy_bytes"], v["keyframe_bytes"]) >= 0.9 * arm["keyframe_bytes"]
    assert 0 < arm["keyframe_bytes"] < arm["model_bytes"]
    assert v["versions_followed"] > 0 and 0 < v["bytes_per_version"] < arm["model_bytes"] / 2
    assert a["versions_followed"] > 0 and 0 < a["bytes_per_version"] < arm["model_bytes"] / 2
    assert (tmp_path / "wan" / "wan_report.png").stat().st_size > 10_000
    assert arm["proxies"]["V"]["bytes_down"] > v["keyframe_bytes"]  # its weights crossed its link
    out = capsys.readouterr().out
    assert "report:" in out and "used_share_V" in out
