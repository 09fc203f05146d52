"""Sampler leases against the real Redis: live, released and expired samplers, as
`RunState` reports them and as `heterorl status` shows them."""

import json
import time
import uuid

import pytest

from pipeline.clients.run_state import RunState, connect_redis
from heterorl.status import collect_status, format_status
from pipeline.weights.store import PolicyPointer

pytestmark = pytest.mark.integration

INFO = {"host": "gpu-7", "pid": 4242, "policy_version": 3, "groups": 12, "rollouts_per_min": 30.5,
        "started_at": 1.0}


@pytest.fixture
def state(local_stack) -> RunState:
    return RunState(connect_redis(local_stack.redis_url), f"leases-{uuid.uuid4().hex[:8]}")


def wait_until_gone(state: RunState, sampler_id: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sampler_id in state.live_samplers():
        assert time.monotonic() < deadline, f"lease of {sampler_id} did not expire"
        time.sleep(0.05)


def test_a_lease_that_is_not_renewed_expires_with_its_last_info_kept(state):
    before = time.time()
    state.renew_sampler_lease("crashed", INFO, 0.3)
    assert "crashed" in state.live_samplers() and state.expired_samplers() == {}
    wait_until_gone(state, "crashed")

    gone = state.expired_samplers()
    assert list(gone) == ["crashed"]
    info = gone["crashed"]
    assert info["ended"] == "expired"
    assert {k: info[k] for k in INFO} == INFO  # types kept: numbers stay numbers
    assert before <= info["last_heartbeat_at"] <= time.time()
    assert info["ended_at"] == pytest.approx(info["last_heartbeat_at"] + 0.3)
    assert state.expired_samplers(within_s=1e-6) == {}  # outside the window


def test_a_released_lease_is_listed_as_released(state):
    state.renew_sampler_lease("done", INFO, 60.0)
    state.release_sampler_lease("done", reason="max_groups reached")
    assert "done" not in state.live_samplers()
    info = state.expired_samplers()["done"]
    assert info["ended"] == "released" and info["release_reason"] == "max_groups reached"
    assert info["host"] == "gpu-7" and info["ended_at"] >= info["last_heartbeat_at"]
    state.release_sampler_lease("never-renewed")  # tolerated: nothing to show but the release
    assert state.expired_samplers()["never-renewed"]["ended"] == "released"


def test_a_renewed_lease_stays_live_and_a_restart_under_the_same_id_is_live_again(state):
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # 3+ lease lifetimes
        state.renew_sampler_lease("steady", {**INFO, "paused_s": 1.5}, 0.3)
        time.sleep(0.1)
    assert "steady" in state.live_samplers() and "steady" not in state.expired_samplers()
    state.release_sampler_lease("steady")
    state.renew_sampler_lease("steady", INFO, 60.0)
    assert "steady" in state.live_samplers() and state.expired_samplers() == {}


def test_status_lists_live_and_recently_gone_samplers_and_the_claims(local_stack, state):
    PolicyPointer(state).set(3, "unused/manifest.json")
    state.register_run(f"{state.run}.rollouts")
    state.renew_sampler_lease("live-1", {**INFO, "paused_s": 2.5, "backend": "vllm", "weight_load_s": 0.0712}, 60.0)
    state.renew_sampler_lease("crashed-1", INFO, 0.3)
    state.renew_sampler_lease("stopped-1", INFO, 60.0)
    state.claim_prompts("crashed-1", 4)
    state.claim_prompts("stopped-1", 2)
    state.release_sampler_lease("stopped-1")
    wait_until_gone(state, "crashed-1")
    assert len(state.reissue_expired_claims()) == 6

    status = collect_status(local_stack.data_dir, state.run)
    assert json.loads(json.dumps(status)) == status  # `heterorl status --json` stays valid JSON
    assert list(status["samplers"]) == ["live-1"]
    assert {sid: info["ended"] for sid, info in status["expired_samplers"].items()} == {
        "crashed-1": "expired", "stopped-1": "released"}
    assert status["claims"]["reissued"] == 6 and status["claims"]["reissue_queue"] == 6

    text = format_status(status)
    assert "1 live, 2 recently gone" in text
    assert "live-1: v3 groups 12 (30.5/min, paused 2.5s) on gpu-7, vllm backend, weights loaded in 0.07s" in text
    crashed_line = next(line for line in text.splitlines() if "crashed-1" in line)
    stopped_line = next(line for line in text.splitlines() if "stopped-1" in line)
    assert "expired" in crashed_line and "s ago" in crashed_line
    assert "released: stopped" in stopped_line
    assert "reissue queue 6, reissued 6" in text
