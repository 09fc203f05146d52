"""The learner and its sampler agree on the log-probs of the sampler's tokens in every precision:
the product's sampler path (`sample_groups`) records them, the learner's step (`optimizer_step`,
DeepSpeed, the config's precision and `model.attention`) scores them and reports the mismatch
(`mismatch_*`), which `token_mismatch` computes as a float64 hand computation does."""

import math
import statistics

import pytest
import torch

from pipeline.config import load_config
from pipeline.learning.engine import make_deepspeed_engine
from pipeline.learning.update import optimizer_step, token_mismatch
from pipeline.models import DTYPES, attention_kernel, load_policy, sample_groups
from pipeline.models.tiny import BaseModelSettings, ModelSize, ensure_base_model
from pipeline.tasks import make_task
from pipeline.wire.rollout import Rollout


def test_token_mismatch_is_the_hand_computed_median_p99_and_share_over_the_masked_tokens():
    g = torch.Generator().manual_seed(0)
    sampler = -torch.rand(5, 7, generator=g) * 3
    learner = sampler + torch.randn(5, 7, generator=g) * 0.08
    mask = (torch.rand(5, 7, generator=g) < 0.7).float()
    got = token_mismatch(learner, sampler, mask)

    d = [float(s) - float(lp) for s_row, l_row, m_row in zip(sampler.double().tolist(), learner.double().tolist(),
                                                             mask.tolist())
         for s, lp, m in zip(s_row, l_row, m_row) if m]
    k3 = sorted(math.exp(x) - x - 1 for x in d)
    position = 0.99 * (len(k3) - 1)  # linear interpolation between the two nearest ranks
    low = math.floor(position)
    p99 = k3[low] + (k3[min(low + 1, len(k3) - 1)] - k3[low]) * (position - low)
    assert got["tokens"] == len(d)
    assert got["kl_median"] == pytest.approx(statistics.median(k3), rel=1e-12)
    assert got["kl_p99"] == pytest.approx(p99, rel=1e-12)
    assert got["share_over_0.1"] == pytest.approx(sum(abs(x) > 0.1 for x in d) / len(d), rel=1e-12)
    assert 0 < got["share_over_0.1"] < 1  # the data straddles the bar, so the count is tested
    assert token_mismatch(learner, sampler, torch.zeros_like(mask)) == {}


def test_attention_auto_is_eager_in_half_precision_and_sdpa_in_fp32():
    assert attention_kernel(torch.bfloat16) == "eager"
    assert attention_kernel(torch.float32) == "sdpa"
    assert attention_kernel(torch.bfloat16, "sdpa") == "sdpa"
    with pytest.raises(ValueError, match="model.attention must be one of auto, eager, sdpa"):
        attention_kernel(torch.float32, "flash")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small model with a tokenizer, warmed up a little on the task (not just random weights)."""
    settings = BaseModelSettings(task_settings={"digits": 2, "ops": "+"},
                                 size=ModelSize(hidden_size=64, num_layers=4, num_heads=4, head_dim=32,
                                                intermediate_size=128, max_positions=64),
                                 warmup_steps=30, warmup_batch_size=16, warmup_target_accuracy=None, seed=0)
    return ensure_base_model(tmp_path_factory.mktemp("models"), settings)


def on_policy_mismatch(base, precision: str, attention: str, learner_version: int = 3) -> dict:
    """One learner step in `precision` on groups its own weights sampled (version 3), the learner
    holding `learner_version`."""
    torch.manual_seed(0)
    cfg = load_config(None, [f"learner.precision={precision}", "learner.zero_stage=1", f"model.attention={attention}",
                             "learner.lr=1e-3"], env={})
    sampler, tokenizer = load_policy(base, torch.device("cpu"), DTYPES[precision], attention)
    task = make_task("arithmetic", digits=2, ops="+")
    prompts = [task.encode_prompt(p, tokenizer) for p in task.eval_problems()[:6]]
    with torch.no_grad():
        sampled = sample_groups(sampler, tokenizer, prompts, group_size=6, temperature=1.0, max_new_tokens=10, seed=1)
    rollouts = [Rollout(prompt_id=f"p{i}", task="arithmetic", sampler_id="s", policy_version=3,
                        prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, sampler_logps=g.sampler_logps,
                        rewards=[float(j % 2) for j in range(len(g.completion_ids))])
                for i, g in enumerate(sampled)]
    model, _ = load_policy(base, attention=attention_kernel(DTYPES[precision], attention))  # as the learner loads it
    engine = make_deepspeed_engine(model, cfg.learner, torch.device("cpu"))
    return optimizer_step(engine, rollouts, [1.0] * len(rollouts), cfg.learner, temperature=1.0,
                          max_completion_length=10, on_policy_version=learner_version)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_policy_the_learner_scores_the_samplers_tokens_as_the_sampler_did(base, precision):
    metrics = on_policy_mismatch(base, precision, "auto")
    assert metrics["mismatch_tokens"] == metrics["num_tokens"] > 120  # every group was on-policy
    if precision == "bf16":  # eager on both sides: the same bits
        assert metrics["mismatch_kl_p99"] == 0 and metrics["mismatch_share_over_0.1"] == 0
    else:
        assert metrics["mismatch_kl_p99"] < 1e-9 and metrics["mismatch_share_over_0.1"] == 0


def test_groups_of_another_version_are_not_counted_as_on_policy(base):
    metrics = on_policy_mismatch(base, "fp32", "auto", learner_version=4)
    assert metrics["num_tokens"] > 120 and not any(k.startswith("mismatch_") for k in metrics)


def test_bf16_with_sdpa_parts_from_the_sampler(base):
    """Why `auto` runs eager in bf16: sdpa's cached steps and whole passes round differently."""
    metrics = on_policy_mismatch(base, "bf16", "sdpa")
    assert metrics["mismatch_kl_p99"] > 0


def bf16_engine(rounding: str, lr: float = 1e-3, stage: int = 1):
    from tests.unit.test_learner_state import tiny_model

    cfg = load_config(None, ["learner.precision=bf16", f"learner.zero_stage={stage}", f"learner.half_rounding={rounding}",
                             f"learner.lr={lr}", "learner.lr_warmup_steps=0", "learner.kl_coef=0.05"], env={}).learner
    return make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu")), cfg


def test_dithered_rounding_moves_the_share_of_weights_a_master_has_moved_and_only_those():
    """Masters 0.3 of a bf16 step above their bf16 value: about 30 % of the weights round up (one
    step away from zero, the rest down), against none to nearest; masters moved on to 0.31 change
    about 1 % more, none back; the same masters give the same bits in a second engine."""
    def rounded(engine, fraction: float) -> torch.Tensor:
        master = engine.optimizer.single_partition_of_fp32_groups[0]
        grid = start.view(torch.int32) & -(1 << 16)  # each start value truncated to bf16
        step = (grid + (1 << 16)).view(torch.float32) - grid.view(torch.float32)  # one bf16 step up in magnitude
        with torch.no_grad():
            master.copy_(grid.view(torch.float32) + step * fraction)
        engine.heterorl_half_rounding()
        return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]), grid.view(torch.float32)

    engine, _ = bf16_engine("dithered")
    start = engine.optimizer.single_partition_of_fp32_groups[0].detach().clone()
    n = start.numel()
    assert n > 5000
    at_03, grid = rounded(engine, 0.3)
    flat_grid = grid[:n]
    up = (at_03[:n] != flat_grid)
    # the parameters' flat view and the partition share their order (one rank, no padding inside)
    assert abs(float(up.float().mean()) - 0.3) < 0.03
    assert torch.all(at_03[:n].abs() >= flat_grid.abs())  # rounded away from zero or kept, never past a step
    at_031, _ = rounded(engine, 0.31)
    changed = at_031[:n] != at_03[:n]
    assert 0.002 < float(changed.float().mean()) < 0.03 and torch.all(at_031[:n][changed].abs() > at_03[:n][changed].abs())
    again, _ = bf16_engine("dithered")
    assert torch.equal(rounded(again, 0.31)[0], at_031)
    nearest = torch.cat([p.detach().float().flatten() for p in bf16_engine("nearest")[0].module.parameters()])
    assert torch.equal(nearest[:n], start[:n].bfloat16().float())  # what DeepSpeed starts from: round to nearest


@pytest.mark.parametrize("stage", [1, 3])
def test_at_a_small_learning_rate_dithered_bf16_weights_move_as_their_masters_and_nearest_ones_lag(stage):
    from deepspeed.utils import safe_get_full_fp32_param

    from tests.unit.test_learner_state import weights
    from tests.unit.test_update import groups

    moved = {}
    for rounding in ("dithered", "nearest"):
        engine, cfg = bf16_engine(rounding, lr=1e-5, stage=stage)
        before = weights(engine)
        for seed in (2, 3, 4):
            optimizer_step(engine, groups(seed=seed), [1.0, 0.5, 1.0], cfg, temperature=1.0, max_completion_length=8)
        after = weights(engine)
        used = sum(float((after[n] - before[n]).abs().sum()) for n in before)
        masters = sum(float((safe_get_full_fp32_param(p) - before[n]).abs().sum())
                      for n, p in engine.module.named_parameters())
        moved[rounding] = used / masters
    assert 0.9 < moved["dithered"] < 1.1
    assert moved["nearest"] < 0.5


def test_a_replay_takes_each_recorded_numeric_setting_unless_the_user_set_it():
    from pipeline.runtime import NUMERIC_SETTINGS, adopt_numerics

    cfg = load_config(None, ["learner.precision=fp32", "learner.torch_threads=1"], env={})
    mine = {"precision": "fp32", "half_rounding": "dithered", "attention": "eager", "torch_threads": 1,
            "zero_stage": 0, "micro_batch_tokens": 16384, "machine": "AMD EPYC (AVX512)", "torch": "2.9.0"}
    recorded = {**mine, "precision": "bf16", "zero_stage": 1, "torch_threads": 2, "attention": "sdpa",
                "machine": "Intel Xeon (AMX)"}
    adopted, taken, differs = adopt_numerics(cfg, recorded, mine, chosen={"learner.torch_threads"})
    assert (adopted.learner.precision, adopted.learner.zero_stage, adopted.model.attention) == ("bf16", 1, "sdpa")
    assert adopted.learner.torch_threads == 1  # set by the user: kept, and named
    assert taken == ["learner.precision bf16 (was fp32)", "model.attention sdpa (was eager)",
                     "learner.zero_stage 1 (was 0)"]
    assert differs == ["learner.torch_threads: recorded 2, here 1 (set here)",
                       "machine: recorded Intel Xeon (AMX), here AMD EPYC (AVX512)"]
    assert adopt_numerics(cfg, mine, mine, set()) == (cfg, [], [])
    stage0 = load_config(None, ["learner.precision=fp32", "learner.zero_stage=0"], env={})
    kept_stage, _, _ = adopt_numerics(stage0, {**mine, "precision": "bf16"}, mine, chosen={"learner.zero_stage"})
    assert (kept_stage.learner.precision, kept_stage.learner.zero_stage) == ("bf16", 1)  # the stage bf16 needs
    assert set(NUMERIC_SETTINGS) <= set(mine)
