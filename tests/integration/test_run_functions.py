"""The run functions every sampler write goes through (pipeline/clients/run_functions.py), called
with the local stack's sampler user, as a stranger's gate calls them: what issue 77's stranger did
with direct writes is refused, bounded or harmless here."""

import time
import uuid

import pytest
import redis

from infra.local_stack import stack_services
from pipeline.clients.run_functions import MAX_OWNER_CLAIMS, MAX_TTL_MS, SOURCE, ensure_loaded, loaded_version, \
    sampler_token
from pipeline.clients.run_state import RunState, RunStateRefused, connect_redis

pytestmark = pytest.mark.integration


@pytest.fixture
def state(local_stack) -> RunState:
    """A fresh run, seen by the stack's sampler user (no EVAL, only the run functions write)."""
    return RunState(connect_redis(stack_services(local_stack, "sampler").redis_url), f"fn-{uuid.uuid4().hex[:8]}")


def test_the_sampler_user_runs_no_script_of_its_own_and_cannot_load_one(state):
    for attempt in (lambda c: c.eval("while true do end", 0), lambda c: c.function_load(SOURCE, replace=True),
                    lambda c: c.function_flush(), lambda c: c.script_kill()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(state.client)
    assert loaded_version(state.client) is not None and ensure_loaded(state.client) is False  # there, current


def test_a_sampler_id_is_held_by_its_token_alone(state):
    state.hold_as("box-1", sampler_token(state.run, "box-1", b"seed of box-1"))
    state.renew_sampler_lease("box-1", {"host": "a"}, 30.0)
    assert state.claim_prompts("box-1", 2) == [0, 1]
    thief = RunState(state.client, state.run)  # names the id without its token
    for steal in (lambda: thief.renew_sampler_lease("box-1", {"host": "evil"}, 30.0),
                  lambda: thief.release_sampler_lease("box-1"), lambda: thief.claim_prompts("box-1", 5),
                  lambda: thief.complete_prompts("box-1", [0, 1]), lambda: thief.record_sampler_stats("box-1", {}),
                  lambda: thief.note_discarded_at_source("box-1", 7)):
        with pytest.raises(RunStateRefused, match="box-1 is held with another token"):
            steal()
    assert state.sampler_lease("box-1")["host"] == "a" and state.claim_stats()["outstanding"] == 2
    assert state.claim_stats()["completed"] == 0
    # the same sampler restarted (same key, same token) goes on at once
    again = RunState(state.client, state.run)
    again.hold_as("box-1", sampler_token(state.run, "box-1", b"seed of box-1"))
    again.renew_sampler_lease("box-1", {"host": "a"}, 30.0)
    assert again.complete_prompts("box-1", [0, 1]) == 2


def test_leases_always_expire_and_claims_need_one(state):
    with pytest.raises(RunStateRefused, match="holds no lease|never held"):
        state._call("hr_claim", state._keys("hr_claim", "ghost"), ["ghost", state._token("ghost"), 5, ""])
    assert state.claim_prompts("ghost", 5) == []  # a sampler whose lease lapsed: no room until it renews
    for forever in (10**9, 0):  # "no expiry", as the stranger asked, or none at all
        with pytest.raises(RunStateRefused, match="lease time must be"):
            state.renew_sampler_lease("s", {"host": "h"}, forever)
    state.renew_sampler_lease("s", {"host": "h"}, MAX_TTL_MS / 1000)
    assert 0 < state.client.pttl(state._lease_key("s")) <= MAX_TTL_MS


def test_what_one_sampler_holds_is_bounded_and_counted_as_one_batch(state):
    state.renew_sampler_lease("hoarder", {"host": "h"}, 30.0)
    held = []
    for _ in range(3):  # the stranger asked for 100,000 claims
        held += state.claim_prompts("hoarder", 1024)
    assert len(held) == MAX_OWNER_CLAIMS and state.claim_prompts("hoarder", 1) == []
    state.renew_sampler_lease("honest", {"host": "h"}, 30.0)
    # the fleet counts each sampler's claims up to its batch: the hoarder holds back one batch's room
    assert state.sampler_view(with_policy=False, allowance=8).in_flight == 8
    assert len(state.claim_prompts("honest", 8, in_flight_limit=16, allowance=8)) == 8
    big = "x" * 300
    for refused in (lambda: state.renew_sampler_lease("honest", {"note": big}, 30.0),
                    lambda: state.renew_sampler_lease("honest", {f"f{k}": k for k in range(70)}, 30.0),
                    lambda: state.record_sampler_stats("honest", {"blob": "y" * 20_000}),
                    lambda: state.renew_sampler_lease("bad id!", {}, 30.0),
                    lambda: state._call("hr_join_request", state._keys("hr_join_request"), ["z" * 20_000]),
                    lambda: state._call("hr_complete", state._keys("hr_complete"),
                                        ["honest", state._token("honest"), "abc"])):
        with pytest.raises(RunStateRefused, match="at most|must be|non-negative integers|JSON object"):
            refused()


def test_only_the_dead_are_swept_and_a_late_completion_withdraws_only_its_own(state):
    state.renew_sampler_lease("alive", {"host": "h"}, 30.0)
    state.renew_sampler_lease("dead", {"host": "h"}, 0.05)
    alive = state.claim_prompts("alive", 3)
    time.sleep(0.2)
    assert state.reissue_expired_claims() == []  # "dead" claimed nothing; "alive" is alive
    state.renew_sampler_lease("dead", {"host": "h"}, 0.05)
    dead = state.claim_prompts("dead", 2)
    time.sleep(0.2)
    assert state.reissue_expired_claims() == dead
    # a late completion withdraws a re-issued index only for the sampler it was taken from
    assert state.complete_prompts("alive", dead) == 0 and state.claim_stats()["reissue_queue"] == 2
    assert state.complete_prompts("dead", dead) == 0 and state.claim_stats()["reissue_queue"] == 0
    assert state.complete_prompts("alive", alive) == 3


def test_a_function_takes_its_own_keys_of_one_run_and_the_named_samplers_lease_only(state):
    """Review of issue 77's gate: a stranger whose gate admits one lease key named it in every call,
    heartbeating as new ids under it, and re-issued a live sampler's claims by naming a lease that
    was not the owner's. The functions check the keys themselves now."""
    state.renew_sampler_lease("honest", {"host": "h"}, 30.0)
    held = state.claim_prompts("honest", 3)
    state.renew_sampler_lease("mine", {"host": "m"}, 30.0)
    mine = state._keys("hr_heartbeat", "mine")
    with pytest.raises(RunStateRefused, match="key 1 must be .*sampler:new-id"):  # a new id under my lease key
        state._call("hr_heartbeat", mine, ["new-id", state._token("new-id"), 30000, "{}"])
    with pytest.raises(RunStateRefused, match="key 4 must be .*sampler:honest"):  # honest's claims, "its" lease mine
        state._call("hr_reissue", state._keys("hr_reissue", "ghost"), ["honest", *held])
    other_run = [k.replace(state.prefix, "heterorl:another-run:") for k in state._keys("hr_complete")]
    with pytest.raises(RunStateRefused, match="must be"):  # keys of two runs in one call
        state._call("hr_complete", [*state._keys("hr_complete")[:3], *other_run[3:]], ["mine", state._token("mine")])
    with pytest.raises(RunStateRefused, match="takes the keys"):
        state._call("hr_sweep_due", [state.prefix + "claims"], [1000])
    with pytest.raises(RunStateRefused, match="sweep interval must be"):  # nobody holds the sweep for 10 minutes
        state._call("hr_sweep_due", state._keys("hr_sweep_due"), [MAX_TTL_MS])
    assert state.client.hexists(state.prefix + "sampler_owners", "new-id") is False
    assert state.claim_stats()["outstanding"] == 3 and state.complete_prompts("honest", held) == 3
