"""One optimizer step: micro-batches by token budget, rank shares balanced by tokens, and the
micro-batched step equal to the one-shot step on a real DeepSpeed engine."""

import random

import pytest
import torch

from pipeline.config import load_config
from pipeline.learning.engine import Ranks, make_deepspeed_engine
from pipeline.wire.rollout import Rollout
from pipeline.learning.update import micro_batches, optimizer_step, rank_share
from tests.unit.test_learner_state import tiny_model, weights


def test_micro_batches_respect_the_token_budget_and_use_every_row_once():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 120)
        batches = micro_batches(list(range(len(tokens))), tokens, budget)
        assert sorted(r for b in batches for r in b) == list(range(len(tokens)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(tokens[r] for r in b) <= budget


def test_rank_shares_cover_the_batch_once_and_balance_the_tokens():
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        world = rng.randint(1, 5)
        shares = [rank_share(tokens, Ranks(rank, rank, world)) for rank in range(world)]
        assert sorted(r for s in shares for r in s) == list(range(len(tokens)))
        loads = [sum(tokens[r] for r in s) for s in shares]
        assert max(loads) - min(loads) <= max(tokens)  # greedy longest-first: within one sequence


def groups(n=3, size=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        comps = [torch.randint(1, 60, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(size)]
        logps = [(-torch.rand(len(c), generator=g) * 3).tolist() for c in comps]
        rewards = [float(torch.rand(1, generator=g) < 0.5) for _ in comps]
        out.append(Rollout(prompt_id=f"p{i}", task="t", sampler_id="s", policy_version=0, prompt_ids=prompt,
                           completion_ids=comps, sampler_logps=logps, rewards=rewards,
                           sampling={"temperature": 1.0}))
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("loss", ["gepo", "bnpo"])
def test_a_micro_batched_step_equals_the_one_shot_step(stage, loss):
    results = []
    for budget in (100_000, 8):  # everything at once; about one sequence per micro-batch
        cfg = load_config(None, [f"learner.zero_stage={stage}", f"learner.loss_type={loss}", "learner.lr=1e-2",
                                 "learner.kl_coef=0.05", f"learner.micro_batch_tokens={budget}"], env={}).learner
        engine = make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu"))
        metrics = [optimizer_step(engine, groups(seed=s), [1.0, 0.5, 1.0], cfg, temperature=1.0,
                                  max_completion_length=8) for s in (2, 3)]
        results.append((weights(engine), metrics))
    (w1, m1), (w2, m2) = results
    # The gradients agree to float32 rounding (their float64 equality is tests/unit/test_losses.py);
    # AdamW's normalised update carries that rounding into the weights at a small fraction of lr.
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 2e-5
    for a, b in zip(m1, m2):
        for key in ("loss", "kl", "iw_mean", "clip_frac", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), key


def honest(groups_, module):
    """The same groups with the sampler log-probs `module` gives them (what its own sampler records)."""
    from pipeline.models import completion_logprobs

    with torch.no_grad():
        for g in groups_:
            logps, mask = completion_logprobs(module, [g.prompt_ids] * g.group_size, g.completion_ids, 1.0)
            g.sampler_logps = [row[: int(m.sum())].tolist() for row, m in zip(logps, mask)]
    return groups_


@pytest.mark.parametrize("overrides", [["learner.zero_stage=0"], ["learner.zero_stage=1"], ["learner.zero_stage=3"],
                                       ["learner.zero_stage=1", "learner.precision=bf16"],
                                       ["learner.zero_stage=1", "learner.offload_optimizer=true"]],
                         ids=["zero0", "zero1", "zero3", "zero1-bf16", "zero1-offload"])
def test_a_step_refused_by_the_fresh_check_leaves_the_engine_as_if_it_never_ran(overrides):
    """The check of fresh groups rides on the training forward: a forged group is found after the
    backward passes, and then the step's gradients are discarded. The engine that refused a step
    and then took two more ends bit for bit where one that took only those two does."""
    from pipeline.learning.update import FreshCheck, StepRefused

    cfg = load_config(None, [*overrides, "learner.lr=1e-2"], env={}).learner
    straight = make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu"))
    refusing = make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu"))
    forged = honest(groups(seed=7), refusing.module)
    forged[1].sampler_logps = [[-5.0] * len(c) for c in forged[1].completion_ids]
    with pytest.raises(StepRefused) as refused:
        optimizer_step(refusing, forged, [1.0] * 3, cfg, temperature=1.0, max_completion_length=8,
                       fresh_check=FreshCheck((0, 1, 2), threshold=0.10))
    assert set(refused.value.failed) == {1} and set(refused.value.gaps) == {0, 1, 2}
    assert max(refused.value.gaps[0], refused.value.gaps[2]) < 0.10  # the honest ones pass
    for seed in (2, 3):
        for engine in (straight, refusing):
            optimizer_step(engine, groups(seed=seed), [1.0] * 3, cfg, temperature=1.0, max_completion_length=8)
    want, got = weights(straight), weights(refusing)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) == 0.0


def test_a_step_whose_fresh_groups_pass_reports_their_statistic_of_float_noise():
    from pipeline.learning.update import FreshCheck

    cfg = load_config(None, ["learner.zero_stage=0", "learner.lr=1e-2"], env={}).learner
    engine = make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu"))
    before = weights(engine)
    metrics = optimizer_step(engine, honest(groups(seed=4), engine.module), [1.0] * 3, cfg, temperature=1.0,
                             max_completion_length=8, fresh_check=FreshCheck((0, 2), threshold=0.10))
    assert set(metrics["fresh_gaps"]) == {0, 2} and max(metrics["fresh_gaps"].values()) < 1e-5
    assert any(float((before[k] - w).abs().max()) > 0 for k, w in weights(engine).items())  # it stepped
