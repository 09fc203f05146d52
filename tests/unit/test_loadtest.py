"""The load-test rig's pure parts: the modeled fleet, the window arithmetic, the bottleneck rules."""

import threading
import time
from collections import Counter

import numpy as np
import pytest

from lab.loadtest.fleet import (ModeledEngine, assign_classes, completion_lengths, expected_groups_per_s,
                                     lockstep_quotas)
from lab.loadtest.report import name_bottleneck, quantile, steps_per_min, train_overlap
from pipeline.config import HeteroConfig
from pipeline.config.commands import GpuClassConfig, LoadtestConfig
from pipeline.records.metrics import StageClock

FLEET = [GpuClassConfig(name="h100", share=1, tokens_per_s=5000), GpuClassConfig(name="a100", share=1,
                                                                                  tokens_per_s=3000),
         GpuClassConfig(name="l4", share=2, tokens_per_s=1000)]


def test_classes_follow_the_shares_for_every_prefix_of_the_fleet():
    fleet = assign_classes(FLEET, 256)
    assert fleet[0].name == "l4"  # the largest share first
    for n in (1, 4, 16, 64, 256):
        counts = Counter(c.name for c in fleet[:n])
        assert counts == Counter(c.name for c in assign_classes(FLEET, n))  # a fleet of n is a prefix
        for c in FLEET:
            assert abs(counts[c.name] - n * c.share / 4) < 1  # within one sampler of its share
    assert Counter(c.name for c in fleet) == {"l4": 128, "h100": 64, "a100": 64}


def test_lockstep_splits_the_batch_evenly():
    assert lockstep_quotas(32, 16) == [2] * 16
    assert lockstep_quotas(32, 5) == [7, 7, 6, 6, 6]
    quotas = lockstep_quotas(32, 64)
    assert sum(quotas) == 32 and max(quotas) == 1


def test_completion_lengths_are_cut_to_the_sampling_limit():
    lt = LoadtestConfig(completion_tokens_median=300, completion_tokens_sigma=0.8)
    lengths = completion_lengths(np.random.default_rng(0), 20_000, lt, 1024)
    assert lengths.min() >= 1 and lengths.max() == 1024
    assert 280 <= np.median(lengths) <= 320


def test_modeled_engine_takes_its_hardware_time_and_makes_llm_sized_groups():
    lt = LoadtestConfig(prompt_tokens=100, completion_tokens_median=200, completion_tokens_sigma=0.5, vocab_size=1000)
    stop = threading.Event()
    engine = ModeledEngine(GpuClassConfig(name="x", share=1, tokens_per_s=40_000), lt, 512, None, stop)
    started = time.monotonic()
    groups = engine.sample([[1, 2], [3]], group_size=8, seed=7)
    elapsed = time.monotonic() - started
    tokens = sum(len(c) for g in groups for c in g.completion_ids)
    assert engine.generating_s == pytest.approx(tokens / 40_000)
    assert elapsed >= engine.generating_s * 0.95
    assert len(groups) == 2 and all(len(g.completion_ids) == 8 and len(g.prompt_ids) == 100 for g in groups)
    for g in groups:
        for ids, logps in zip(g.completion_ids, g.sampler_logps):
            assert 1 <= len(ids) <= 512 and len(ids) == len(logps)
            assert max(ids) < 1000 and max(logps) <= 0
    again = engine.sample([[1, 2], [3]], group_size=8, seed=7)
    assert [g.completion_ids for g in again] == [g.completion_ids for g in groups]  # seeded


def test_fleet_supply_adds_up_the_classes():
    lt = LoadtestConfig(completion_tokens_median=400, completion_tokens_sigma=0.0)
    assert expected_groups_per_s(FLEET, 4, lt, 8) == pytest.approx((5000 + 3000 + 2 * 1000) / (400 * 8))


def test_window_arithmetic():
    assert quantile([], 0.5) is None
    assert quantile([3, 1, 2, 4], 0.5) == 2 and quantile([3, 1, 2, 4], 0.95) == 4 and quantile([5], 0.99) == 5
    # steps of 2 s ending at 10, 14 and 30; the window [9, 20] holds 1 s of the first, all of the second
    records = [{"time": 10.0, "time_train_s": 2.0}, {"time": 14.0, "time_train_s": 2.0},
               {"time": 30.0, "time_train_s": 2.0}]
    assert train_overlap(records, 9.0, 20.0) == pytest.approx(3.0)
    assert steps_per_min([10.0, 14.0, 22.0]) == pytest.approx(2 / 12 * 60)
    assert steps_per_min([10.0]) == 0.0


def _row(**changes):
    row = {"learner_utilization": 0.5, "learner_wall_share": {"intake": 0.05, "screen": 0.05, "snapshot": 0.01},
           "machine_cpu_busy": 0.5, "redis_p99_ms": 2.0, "fleet_generating_share": 0.85,
           "fleet_loading_weights_share": 0.1,
           "sampler_paused_share": {"paused_backlog": 0.0, "stalled_behind": 0.01}}
    return {**row, **changes}


def test_the_bottleneck_is_named_in_order():
    assert name_bottleneck(_row(learner_utilization=0.93)).startswith("learner: its optimizer step")
    assert name_bottleneck(_row(learner_wall_share={"intake": 0.3, "screen": 0.15})) == "learner: its intake stage"
    assert name_bottleneck(_row(validators=4, validator_utilization=0.95, machine_cpu_busy=0.92)).startswith(
        "validators: their checks")
    assert name_bottleneck(_row(machine_cpu_busy=0.92)).startswith("this machine's CPU")
    assert name_bottleneck(_row(redis_p99_ms=80.0)).startswith("Redis")
    assert name_bottleneck(_row()).startswith("fleet: too few samplers")
    assert name_bottleneck(_row(sampler_paused_share={"stalled_behind": 0.4, "paused_backlog": 0.1})) == \
        "pacing: the samplers pause (stalled_behind, 40% of their time) while the learner waits"


def test_stage_clock_tells_computation_from_waiting():
    clock = StageClock()
    with clock.stage("train"):
        time.sleep(0.2)
    with clock.stage("intake"):
        deadline = time.perf_counter() + 0.1
        while time.perf_counter() < deadline:
            pass
    taken = clock.take()
    assert taken["time_train_s"] >= 0.2 and taken["time_intake_s"] >= 0.1
    assert taken["cpu_train_s"] < taken["cpu_intake_s"]  # sleeping is not computing (on a busy machine too)
    assert taken["cpu_intake_s"] > 0.01
    assert clock.take() == {}


def test_loadtest_config_names_an_unknown_fleet():
    with pytest.raises(ValueError, match="loadtest fleet 'tiny' is not in loadtest.fleets"):
        HeteroConfig.model_validate({"loadtest": {"fleet": "tiny"}})


def test_the_modeled_screen_checks_the_groups_the_real_one_would():
    from lab.loadtest.learner import ModeledScreen
    from pipeline.config import SecurityConfig
    from pipeline.wire.rollout import Rollout

    lt = LoadtestConfig(reward_check_s_per_group=0.0, logprob_check_s_per_group=0.0)
    screen = ModeledScreen(SecurityConfig(probation_groups=1, stale_check_fraction=0.0), lt)
    a, b, c = (Rollout(prompt_id="p", task="t", sampler_id="s", policy_version=3, prompt_ids=[1],
                       completion_ids=[[2], [3]], sampler_logps=[[-1.0], [-1.0]], rewards=[0.0, 1.0], key_id="k")
               for _ in range(3))
    assert screen.check(a, staleness=2) == []   # on probation: to be checked although stale
    assert screen.check_batch([(a, 2)], fresh_in_step=True) == ({}, [])  # ... and it was
    assert screen.check(b, staleness=2) == []   # probation over, none of the stale drawn
    assert screen.check(c, staleness=0) == []   # fresh: always checked, by the step
    assert screen.check_batch([(b, 2), (c, 0)], fresh_in_step=True) == ({}, [1])
    assert screen.record_fresh(c, 0.0) is None
    assert screen.counts == {"rewards_rescored": 3, "logprobs_checked_stale": 1, "logprobs_checked_fresh": 1,
                             "logprobs_unchecked_not_drawn": 1}


def test_async_is_compared_with_lock_step_like_with_like():
    """The lock-step learner checks the groups itself: a row with validators is not its match."""
    from lab.loadtest.report import compare_entry
    from lab.loadtest.rig import Case

    rows = {Case(16, "heterogeneous", "async", 4): {"samplers": 16, "steps_per_min": 13.7, "learner_utilization": 0.91,
                                                    "bottleneck": "learner"},
            Case(16, "heterogeneous", "async"): {"samplers": 16, "steps_per_min": 10.7, "learner_utilization": 0.73,
                                                 "bottleneck": "learner"},
            Case(16, "heterogeneous", "sync"): {"samplers": 16, "steps_per_min": 3.9, "learner_utilization": 0.27,
                                                "bottleneck": "fleet"}}
    entry = compare_entry(rows, "heterogeneous")
    assert entry["async_steps_per_min"] == 10.7 and abs(entry["ratio"] - 10.7 / 3.9) < 1e-12
    assert compare_entry({c: r for c, r in rows.items() if c.mode == "async"}, "heterogeneous") is None
