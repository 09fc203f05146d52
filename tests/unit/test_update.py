"""One optimizer step: micro-batches by token budget, rank shares balanced by tokens, and the
micro-batched step equal to the one-shot step on a real DeepSpeed engine."""

import random

import pytest
import torch

from pipeline.config import load_config
from pipeline.engine import Ranks, make_engine
from pipeline.rollout import Rollout
from pipeline.update import micro_batches, optimizer_step, rank_share
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
        engine = make_engine(tiny_model(), cfg, torch.device("cpu"))
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
