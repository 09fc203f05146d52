"""The race's clocks (bench/async_vs_sync.py): every lane timed from its command's start."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from async_vs_sync import lane_clock, steps_per_minute, training_windows  # noqa: E402

LAUNCHED = 1_000.0


def test_a_lane_is_timed_from_its_command_s_start_without_its_own_evaluations():
    # started at 1000 s; a 20 s evaluation of the base model from 1005 s; its first step at 1050 s
    # (imports, loading: start-up); then a step every 6 s, with a 60 s evaluation after step 3
    times = [1050.0, 1056.0, 1062.0, 1128.0, 1134.0]
    pauses = [(1005.0, 1025.0), (1062.0, 1122.0)]
    evals = [{"step": 0, "time": 1005.0, "accuracy_sampled": 0.1},
             {"step": 3, "time": 1062.0, "accuracy_sampled": 0.3},
             {"step": 5, "time": 1134.0, "accuracy_sampled": 0.5}]
    clock = lane_clock(LAUNCHED, times, evals, pauses, target_accuracy=0.25)
    assert clock["first_step_s"] == 30.0
    assert clock["to_last_step_min"] == pytest.approx((134 - 80) / 60, abs=1e-3)
    assert clock["steady_steps_per_min"] == pytest.approx(60 * 4 / 24)  # 4 steps in 24 s of training
    # v0 at minute 0: the base model is there from the start, whenever a lane scores it
    assert [e["minutes"] for e in clock["evals"]] == pytest.approx([0, 42 / 60, 54 / 60], abs=1e-3)
    assert all("time" not in e for e in clock["evals"])
    assert clock["to_target_min"] == pytest.approx(42 / 60, abs=1e-3)
    assert lane_clock(LAUNCHED, times, evals, pauses, target_accuracy=0.9)["to_target_min"] is None


def test_the_steady_rate_and_the_training_windows_leave_the_pauses_out():
    times, pauses = [0.0, 10.0, 20.0, 50.0], [(20.0, 40.0), (50.0, 70.0)]  # the last: after the last step
    assert steps_per_minute(times, pauses) == pytest.approx(60 * 3 / 30)
    assert steps_per_minute(times) == pytest.approx(60 * 3 / 50)
    assert training_windows(times, pauses) == [(0.0, 20.0), (40.0, 50.0)]
    assert training_windows(times, []) == [(0.0, 50.0)]
    with pytest.raises(ValueError, match="two steps"):
        steps_per_minute([1.0])


def test_the_trl_lane_follows_the_product_s_learning_rate_schedule():
    """bench/trl_lane.py hands TRL the learning rate the product's DeepSpeed engine uses at each
    optimizer step (its linear WarmupLR), step for step."""
    import torch

    from pipeline.config import LearnerConfig
    from pipeline.learning.engine import make_deepspeed_engine
    from trl_lane import warmup_factor

    cfg = LearnerConfig(lr=1e-5, lr_warmup_steps=3, zero_stage=0)
    model = torch.nn.Linear(4, 1)
    engine = make_deepspeed_engine(model, cfg, torch.device("cpu"))
    for step in range(7):
        assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.lr * warmup_factor(step, 3), rel=1e-9)
        engine.backward(model(torch.ones(1, 4)).sum())
        engine.step()
    assert warmup_factor(5, 0) == 1.0
