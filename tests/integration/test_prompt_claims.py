"""Prompt claims against the real Redis: shared fairly, re-issued once when a sampler dies.

Each test uses its own run name, so the shared session Redis needs no cleaning.
"""

import random
import threading
import time
import uuid
from collections import Counter

import pytest

from pipeline.clients.run_state import RunState, connect_redis

pytestmark = pytest.mark.integration

LONG_TTL_S = 60.0


@pytest.fixture
def state(local_stack) -> RunState:
    return RunState(connect_redis(local_stack.redis_url), f"claims-{uuid.uuid4().hex[:8]}")


def in_threads(n: int, fn) -> list:
    """Run fn(k) in n threads released together, so the calls really overlap."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def body(k: int) -> None:
        try:
            barrier.wait()
            results[k] = fn(k)
        except Exception as e:  # surfaced below: a thread's exception would be lost
            errors.append(e)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def lease(state: RunState, *sampler_ids: str) -> None:
    """A claim is made only under a live lease (pipeline/clients/run_functions.py)."""
    for sampler_id in sampler_ids:
        state.renew_sampler_lease(sampler_id, {"host": "h"}, LONG_TTL_S)


def wait_until_lease_gone(state: RunState, sampler_id: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sampler_id in state.live_samplers():
        assert time.monotonic() < deadline, f"lease of {sampler_id} did not expire"
        time.sleep(0.05)


def assert_accounting(state: RunState) -> dict:
    s = state.claim_stats()
    assert s["claimed"] - s["reissued"] == s["completed"] + s["outstanding"], s
    assert s["cursor"] + s["reissued"] == s["claimed"] + s["reissue_queue"] + s["reissue_withdrawn"], s
    return s


def test_concurrent_claims_take_each_index_exactly_once(state):
    for k in range(8):
        state.renew_sampler_lease(f"s{k}", {"host": "h"}, LONG_TTL_S)

    def claim_many(k: int) -> list[int]:
        return [i for _ in range(200) for i in state.claim_prompts(f"s{k}", 3)]

    per_thread = in_threads(8, claim_many)
    claimed = Counter(i for indices in per_thread for i in indices)
    assert max(claimed.values()) == 1
    assert sorted(claimed) == list(range(8 * 200 * 3))  # contiguous: nothing skipped
    s = assert_accounting(state)
    assert s["cursor"] == s["claimed"] == s["outstanding"] == 4800 and s["reissued"] == 0
    owners = state.client.hgetall(state.prefix + "claims")
    assert Counter(owners.values()) == {f"s{k}": 600 for k in range(8)}


def test_claims_of_a_dead_sampler_are_reissued_once_and_claimed_first(state):
    state.renew_sampler_lease("alive", {"host": "h"}, LONG_TTL_S)
    state.renew_sampler_lease("dead", {"host": "h"}, 0.3)
    dead_indices = state.claim_prompts("dead", 5)
    alive_indices = state.claim_prompts("alive", 2)
    assert state.reissue_expired_claims() == []  # its lease still runs: nothing to take back

    wait_until_lease_gone(state, "dead")  # it stopped renewing
    swept = in_threads(4, lambda _: state.reissue_expired_claims())
    assert sorted(i for result in swept for i in result) == sorted(dead_indices)  # once in all
    assert state.reissue_expired_claims() == []
    assert state.claim_stats()["reissued"] == 5 and state.claim_stats()["reissue_queue"] == 5

    next_claim = state.claim_prompts("alive", 7)
    assert next_claim[:5] == dead_indices  # the holes first, in order
    assert next_claim[5:] == [7, 8]  # then fresh ones

    assert state.complete_prompts("dead", dead_indices) == 0  # the late original owner removes nothing
    s = assert_accounting(state)
    assert s["late_completions"] == 5 and s["reissued"] == 5 and s["outstanding"] == 9
    assert state.complete_prompts("alive", alive_indices + next_claim) == 9
    s = assert_accounting(state)
    assert s["outstanding"] == 0 and s["completed"] == 9


def test_many_sweepers_never_reissue_twice(state):
    """Repeated races of 4 sweepers against fresh departures: each index moves once."""
    state.renew_sampler_lease("survivor", {"host": "h"}, LONG_TTL_S)
    for round_ in range(15):
        leaver = f"leaver-{round_}"
        state.renew_sampler_lease(leaver, {"host": "h"}, LONG_TTL_S)
        indices = state.claim_prompts(leaver, 5)
        state.release_sampler_lease(leaver)
        swept = in_threads(4, lambda _: state.reissue_expired_claims())
        assert sorted(i for result in swept for i in result) == sorted(indices)
        assert state.claim_prompts("survivor", 5) == indices
    s = assert_accounting(state)
    assert s["reissued"] == 75 and s["cursor"] == 75 and s["outstanding"] == 75


def test_a_completed_claim_is_never_reissued(state):
    state.renew_sampler_lease("s", {"host": "h"}, LONG_TTL_S)
    indices = state.claim_prompts("s", 4)
    assert state.complete_prompts("s", indices[:2]) == 2
    state.release_sampler_lease("s")  # a clean stop with claims still open
    assert state.reissue_expired_claims() == indices[2:]
    assert state.reissue_expired_claims() == []
    s = assert_accounting(state)
    assert s["completed"] == 2 and s["reissued"] == 2 and s["late_completions"] == 0


def test_a_late_completion_withdraws_the_index_from_the_queue(state):
    """A sampler cut off long enough to lose its lease, whose groups still reached Kafka:
    its indices are not handed out again if nobody has claimed them yet."""
    state.renew_sampler_lease("slow", {"host": "h"}, 0.3)
    indices = state.claim_prompts("slow", 3)
    wait_until_lease_gone(state, "slow")
    assert state.reissue_expired_claims() == indices
    assert state.complete_prompts("slow", indices) == 0
    s = assert_accounting(state)
    assert s["late_completions"] == 3 and s["reissue_withdrawn"] == 3 and s["reissue_queue"] == 0
    state.renew_sampler_lease("other", {"host": "h"}, LONG_TTL_S)
    assert state.claim_prompts("other", 2) == [3, 4]


def test_claims_report_epochs(state):
    sized = RunState(state.client, state.run, epoch_size=10)
    sized.renew_sampler_lease("s", {"host": "h"}, LONG_TTL_S)
    assert sized.claim_prompts("s", 0) == []
    indices = sized.claim_prompts("s", 25)
    assert [sized.epoch_of(i) for i in (indices[0], indices[9], indices[10], indices[-1])] == [0, 0, 1, 2]
    assert sized.claim_stats()["epoch"] == 2 and sized.claim_stats()["epoch_size"] == 10
    assert state.claim_stats()["epoch_size"] == 10  # a reader that was not told (status) sees it too
    with pytest.raises(ValueError):
        RunState(state.client, state.run, epoch_size=0)


def test_joins_and_leaves_neither_skip_nor_duplicate_work(state):
    """A simulated session: samplers join, claim, complete, stop cleanly or crash, some
    complete after their lease is gone. Every index ever issued ends up done exactly once
    (completed by its owner, or late by a cut-off sampler while still queued), and the
    counters balance at every step."""
    rng = random.Random(7)
    holding: dict[str, list[int]] = {}  # what each sampler believes it holds
    crashed: dict[str, list[int]] = {}  # cut off: they may still complete, late
    done: Counter = Counter()
    serial = 0

    def complete(sampler_id: str, indices: list[int]) -> None:
        for index in indices:  # one at a time, to know which ones counted
            before = state.claim_stats()["reissue_withdrawn"]
            if state.complete_prompts(sampler_id, [index]) or state.claim_stats()["reissue_withdrawn"] > before:
                done[index] += 1

    for _ in range(300):
        action = rng.random()
        if action < 0.1 or not holding:
            serial += 1
            sampler_id = f"s{serial}"
            state.renew_sampler_lease(sampler_id, {"host": "h"}, LONG_TTL_S)
            holding[sampler_id] = []
        elif action < 0.15:
            sampler_id = rng.choice(sorted(holding))
            complete(sampler_id, holding.pop(sampler_id))
            state.release_sampler_lease(sampler_id)
        elif action < 0.2:
            sampler_id = rng.choice(sorted(holding))
            state.renew_sampler_lease(sampler_id, {"host": "h"}, 0.001)  # stops renewing: gone in 1 ms
            crashed[sampler_id] = holding.pop(sampler_id)
        elif action < 0.25 and crashed:
            sampler_id = rng.choice(sorted(crashed))
            complete(sampler_id, crashed.pop(sampler_id))  # its groups made it after all
        elif action < 0.7:
            sampler_id = rng.choice(sorted(holding))
            holding[sampler_id] += state.claim_prompts(sampler_id, rng.randint(1, 4))
        else:
            sampler_id = rng.choice(sorted(holding))
            finished = holding[sampler_id][: rng.randint(0, len(holding[sampler_id]))]
            holding[sampler_id] = holding[sampler_id][len(finished):]
            complete(sampler_id, finished)
        if rng.random() < 0.3:
            time.sleep(0.002)
            state.reissue_expired_claims()
        assert_accounting(state)

    for sampler_id in sorted(holding):  # everyone stops cleanly
        complete(sampler_id, holding.pop(sampler_id))
        state.release_sampler_lease(sampler_id)
    time.sleep(0.01)
    state.reissue_expired_claims()
    state.renew_sampler_lease("finisher", {"host": "h"}, LONG_TTL_S)
    while state.claim_stats()["reissue_queue"]:
        complete("finisher", state.claim_prompts("finisher", 3))

    s = assert_accounting(state)
    assert s["outstanding"] == 0 and s["reissue_queue"] == 0
    assert s["reissued"] > 0 and s["late_completions"] > 0  # the session did exercise both paths
    assert sorted(done) == list(range(s["cursor"]))  # nothing skipped
    assert set(done.values()) == {1}  # nothing counted done twice


def test_one_sampler_per_interval_sweeps_for_the_whole_fleet(state):
    # 32 samplers' heartbeats at once: exactly one wins the sweep; after the interval, one again.
    winners = in_threads(32, lambda _: state.claim_sweep_due(0.5))
    assert winners.count(True) == 1
    assert not state.claim_sweep_due(0.5)
    time.sleep(0.6)
    assert state.claim_sweep_due(0.5)


def test_a_sampler_sees_the_fleets_groups_in_flight_and_the_learners_unread_count(state):
    view = state.sampler_view()
    assert view.in_flight == 0 and view.learner_unread is None and view.newest_version is None
    lease(state, "a", "b")
    state.claim_prompts("a", 3)
    state.claim_prompts("b", 2)
    state.report_learner_offsets({0: 17}, unread=40)
    view = state.sampler_view(with_policy=False)
    assert view.in_flight == 5 and view.learner_unread == 40 and view.learner_offsets == {0: 17}
    state.complete_prompts("a", [0, 1, 2])  # spooled: no longer in flight, not judged yet
    view = state.sampler_view()
    assert view.in_flight == 2 and view.unjudged == 3 and view.learner_pending == 0
    state.report_learner_offsets({0: 17}, unread=None, pending=5)
    assert state.sampler_view().learner_unread is None and state.sampler_view().learner_pending == 5
    state.note_discarded_at_source("a", 2)  # spooled, then too stale to send: they will never reach the learner
    assert state.sampler_view().unjudged == 1
    state.note_discarded_at_source("a", 5)  # no sampler discards more than it completed
    assert state.sampler_view().unjudged == 0 and int(state.client.hget(state.prefix + "discarded_by", "a")) == 3
    state.complete_prompts("b", [3, 4])
    state.count_judged({"b": 1, "never-seen": 7})  # the learner judged one of b's; an id with no lease is left out
    assert state.sampler_view().unjudged == 1 and "never-seen" not in state.client.hgetall(state.prefix + "judged_by")
    # b's unsent group counts while b was heard from within the window, not once b is gone for good
    state.client.zadd(state.prefix + "samplers_seen", {"b": float(state.client.time()[0]) - 30})
    assert state.sampler_view(live_within_s=60).unjudged == 1 and state.sampler_view(live_within_s=10).unjudged == 0
    stats = state.claim_stats()
    assert stats["claimed"] - stats["reissued"] == stats["completed"] + stats["outstanding"]  # claims unaffected


def test_claims_beyond_the_fleets_limit_are_refused_atomically(state):
    # 16 samplers decide at the same moment that there is room; only 5 batches of 4 fit under 20.
    lease(state, *(f"s{k}" for k in range(16)), "late", "unlimited", "partly")
    got = in_threads(16, lambda k: state.claim_prompts(f"s{k}", 4, in_flight_limit=20))
    assert sorted(len(g) for g in got) == [0] * 11 + [4] * 5
    assert state.claim_stats()["outstanding"] == 20 and state.claim_prompts("late", 1, in_flight_limit=20) == []
    assert len(state.claim_prompts("unlimited", 2)) == 2  # without a limit, as before
    assert state.claim_prompts("partly", 4, in_flight_limit=22) == [] and len(state.claim_prompts(
        "partly", 4, in_flight_limit=25)) == 3  # 22 held: room for 3 of the 4


def test_a_group_spooled_and_discarded_in_one_turn_leaves_nothing_unjudged(state, tmp_path):
    """The sampler's outbox completes a group's claim when it is spooled and reports it discarded
    when it grew too stale to send; both within one turn must leave the fleet's count of groups
    sent and not judged at zero (reported the other way round, the discard was refused, the
    count stayed, and at a small max delay the whole fleet paced itself to a halt)."""
    import logging

    from pipeline.clients.spool import RolloutSpool
    from pipeline.config import DelayModelConfig
    from pipeline.sampling.delays import transit_stream
    from producers.sampler import Outbox
    from tests.unit.test_rollout import make_rollout

    lease(state, "a")
    claimed = state.claim_prompts("a", 2)
    outbox = Outbox(RolloutSpool(tmp_path, max_bytes=1 << 20, max_groups=10),
                    lambda: None, transit_stream(DelayModelConfig(), "a"), 1.0, logging.getLogger("test"), "none")
    outbox.add([make_rollout(prompt_id=f"p{i}") for i in claimed], claimed)
    assert outbox.spool_due()
    outbox.sink = object()  # every group is stale: nothing is sent
    outbox.deliver(is_stale=lambda rollout: True)
    outbox.confirm_claims(state, "a")
    assert outbox.discarded_at_source == 2 and state.sampler_view().unjudged == 0
    assert state.claim_stats()["completed"] == 2
