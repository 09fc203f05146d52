"""Loss library against independent float64 references written as plain loops.

The references below re-derive every loss from docs/losses.md one sequence and one
token at a time with Python floats and the math module; they share no code with
pipeline.learning.losses (no vectorised copies). Then: gradients against the slides' eq. 5,
GEPO's invariances, Theorem 1 numerically, numeric stability, and input errors.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import pipeline.learning.losses as losses
from pipeline.learning.losses import (
    DEFAULT_EPSILONS,
    LOSS_TYPES,
    compute_policy_loss,
    gepo_log_expectation,
    group_advantages,
)

CAP = 20.0  # docs/losses.md: exp continued by its tangent line above this


# ----------------------------------------------------------------- float64 references


def ref_exp(x: float) -> float:
    return math.exp(x) if x <= CAP else math.exp(CAP) * (1.0 + x - CAP)


def ref_clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def ref_group_advantages(rewards: list[float], gids: list[int], scale_by_std: bool) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if gids[j] == gids[i]]
        mean = sum(members) / len(members)
        a = r - mean
        if scale_by_std:
            var = sum((x - mean) ** 2 for x in members) / (len(members) - 1) if len(members) > 1 else 0.0
            a = a / (math.sqrt(var) + 1e-4)
        out.append(a)
    return out


def ref_bnpo_scale(rewards: list[float], gids: list[int]) -> list[float]:
    """1 / Beta density at each group's mean reward, capped at 1e6 (BNPO, docs/losses.md)."""
    groups = sorted(set(gids))
    p = {g: sum(rewards[j] for j in range(len(gids)) if gids[j] == g) / gids.count(g) for g in groups}
    rates = [p[g] for g in groups]
    alpha = beta = 1.0
    if len(rates) >= 2:
        mu = sum(rates) / len(rates)
        var = sum((x - mu) ** 2 for x in rates) / (len(rates) - 1)
        if var > 0:
            common = mu * (1 - mu) / var - 1
            alpha, beta = max(1 + common * mu / 3, 1.0), max(1 + common * (1 - mu) / 3, 1.0)
    norm = math.exp(math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta))
    out = []
    for g in gids:
        density = p[g] ** (alpha - 1) * (1 - p[g]) ** (beta - 1) / norm
        out.append(1e6 if density == 0 else min(1.0 / density, 1e6))
    return out


def ref_loss(loss_type, lp, lq, m, adv, gids, *, eps_low, eps_high, seq_prob, max_len=None,
             kl_coef=0.0, weights=None, rewards=None) -> tuple[float, dict]:
    """The loss and a few metrics of docs/losses.md, one token at a time."""
    n_seq = len(lp)
    w = weights if weights is not None else [1.0] * n_seq
    lengths = [sum(row) for row in m]
    n_tok = sum(lengths)
    sum_p = [sum(lp[i][t] * m[i][t] for t in range(len(m[i]))) for i in range(n_seq)]
    sum_q = [sum(lq[i][t] * m[i][t] for t in range(len(m[i]))) for i in range(n_seq)]
    if seq_prob == "geo_mean":
        seq_p = [sum_p[i] / lengths[i] for i in range(n_seq)]
        seq_q = [sum_q[i] / lengths[i] for i in range(n_seq)]
    else:
        seq_p, seq_q = sum_p, sum_q
    lo, hi = 1 - eps_low, 1 + eps_high

    def surrogate(ratio, a):
        return min(ratio * a, ref_clip(ratio, lo, hi) * a)

    total = 0.0
    iw = []  # importance weights the metrics describe
    for i in range(n_seq):
        a = adv[i]
        tokens = [t for t in range(len(m[i])) if m[i][t] == 1]
        if loss_type in ("grpo", "dr_grpo", "bnpo", "cispo"):
            if loss_type == "bnpo":
                a = a * ref_bnpo_scale(rewards, gids)[i]
            acc = 0.0
            for t in tokens:
                r = ref_exp(lp[i][t] - lq[i][t])
                iw.append(r)
                if loss_type == "cispo":
                    acc += ref_clip(r, lo, hi) * a * lp[i][t]
                else:
                    acc += surrogate(r, a)
            if loss_type == "grpo":
                total += w[i] * acc / lengths[i] / n_seq
            elif loss_type == "dr_grpo":
                total += w[i] * acc / (n_seq * max_len)
            else:
                total += w[i] * acc / n_tok
        elif loss_type == "gspo":
            s = ref_exp(seq_p[i] - seq_q[i])
            iw.append(s)
            total += w[i] * surrogate(s, a) / n_seq
        elif loss_type == "gepo":
            members = [j for j in range(n_seq) if gids[j] == gids[i]]
            qbar = [math.exp(seq_q[j]) for j in members]
            expectation = sum(q * q for q in qbar) / sum(qbar)  # sum_j qhat_j qbar_j
            weight = math.exp(seq_p[i]) / expectation
            iw.append(weight)
            total += w[i] * surrogate(weight, a) / n_seq
        elif loss_type == "gmpo":
            acc = 0.0
            for t in tokens:
                delta = lp[i][t] - lq[i][t]
                bounded = ref_clip(delta, -eps_low, eps_high)
                acc += min(delta, bounded) if a >= 0 else max(delta, bounded)
            if seq_prob == "geo_mean":
                acc /= lengths[i]
            iw.append(ref_exp(seq_p[i] - seq_q[i]))
            total += w[i] * a * ref_exp(acc) / n_seq
        elif loss_type == "topr":
            s = ref_exp(seq_p[i] - seq_q[i])
            iw.append(s)
            taper = 1.0 if a >= 0 else ref_clip(s, lo, hi)
            total += w[i] * a * taper * seq_p[i] / n_seq
        else:
            raise AssertionError(loss_type)

    kl_rows = []
    for i in range(n_seq):
        acc = 0.0
        for t in range(len(m[i])):
            if m[i][t] == 1:
                d = lq[i][t] - lp[i][t]
                acc += ref_exp(d) - d - 1
        kl_rows.append(acc)
    kl_weighted = sum(w[i] * kl_rows[i] for i in range(n_seq)) / n_tok
    loss = -total + kl_coef * kl_weighted
    mean_iw = sum(iw) / len(iw)
    metrics = {
        "kl": sum(kl_rows) / n_tok,
        "iw_mean": mean_iw,
        "iw_max": max(iw),
        "iw_min": min(iw),
        "iw_var": sum((x - mean_iw) ** 2 for x in iw) / len(iw),
        "learner_seq_logp_mean": sum(seq_p) / n_seq,
        "sampler_seq_logp_mean": sum(seq_q) / n_seq,
        "num_tokens": float(n_tok),
    }
    return loss, metrics


# ----------------------------------------------------------------------- random batches


def random_batch(rng: random.Random, loss_type: str, max_len: int = 9):
    """Whole groups of varied sizes and lengths, ids shuffled and non-contiguous."""
    n_groups = rng.randint(1, 4)
    min_size = 2 if loss_type == "gepo" else 1
    ids = rng.sample(range(-50, 1000), n_groups)
    gids = [g for g in ids for _ in range(rng.randint(min_size, 5))]
    rng.shuffle(gids)
    n_seq, width = len(gids), rng.randint(1, max_len)
    mask, lp, lq = [], [], []
    for _ in range(n_seq):
        row = [1 if rng.random() < 0.7 else 0 for _ in range(width)]
        row[rng.randrange(width)] = 1  # at least one completion token, anywhere
        mask.append(row)
        p_row = [-rng.uniform(0.01, 4.0) for _ in range(width)]
        q_row = [min(0.0, x + rng.gauss(0, 0.25)) for x in p_row]
        # padding holds arbitrary finite values: the library must ignore them
        lp.append([x if keep else rng.uniform(-50, 5) for x, keep in zip(p_row, row)])
        lq.append([x if keep else rng.uniform(-50, 5) for x, keep in zip(q_row, row)])
    rewards = [float(rng.random() < 0.5) if rng.random() < 0.7 else rng.random() for _ in range(n_seq)]
    return lp, lq, mask, rewards, gids


def tensors(lp, lq, mask, gids, dtype=torch.float64):
    return (torch.tensor(lp, dtype=dtype, requires_grad=True), torch.tensor(lq, dtype=dtype),
            torch.tensor(mask, dtype=dtype), torch.tensor(gids))


def rel_err(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


# ------------------------------------------------------------------ reference sweeps


@pytest.mark.parametrize("block_elements", [1 << 16, 7], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_float64_reference(loss_type, block_elements, monkeypatch):
    monkeypatch.setattr(losses, "SWEEP_BLOCK_ELEMENTS", block_elements)
    rng = random.Random(f"{loss_type}-{block_elements}")
    for case in range(25):
        lp, lq, mask, rewards, gids = random_batch(rng, loss_type)
        seq_prob = rng.choice(["geo_mean", "product"])
        scale = rng.random() < 0.5
        adv = ref_group_advantages(rewards, gids, scale)
        eps = DEFAULT_EPSILONS[loss_type] if rng.random() < 0.5 else (rng.uniform(0, 0.5), rng.uniform(0, 0.5))
        kl_coef = rng.choice([0.0, 0.0, 0.005, 0.3])
        weights = None if rng.random() < 0.4 else [rng.choice([0.0, 0.25, 1.0, rng.random()]) for _ in gids]
        max_len = len(mask[0]) + rng.randint(0, 3)

        want, want_metrics = ref_loss(loss_type, lp, lq, mask, adv, gids, eps_low=eps[0], eps_high=eps[1],
                                      seq_prob=seq_prob, max_len=max_len, kl_coef=kl_coef, weights=weights,
                                      rewards=rewards)
        lp_t, lq_t, m_t, g_t = tensors(lp, lq, mask, gids)
        adv_t = group_advantages(torch.tensor(rewards, dtype=torch.float64), g_t, scale_by_std=scale)
        loss, metrics = compute_policy_loss(
            loss_type, lp_t, lq_t, m_t, adv_t, g_t, epsilon_low=eps[0], epsilon_high=eps[1], seq_prob=seq_prob,
            max_completion_length=max_len, kl_coef=kl_coef, rewards=torch.tensor(rewards, dtype=torch.float64),
            sequence_weights=None if weights is None else torch.tensor(weights, dtype=torch.float64))
        where = f"case {case}: {seq_prob}, eps={eps}, kl_coef={kl_coef}, weights={weights}"
        assert loss.dtype == torch.float64
        assert rel_err(loss.item(), want) < 1e-6 or abs(loss.item() - want) < 1e-12, where
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
        for key, value in want_metrics.items():
            assert rel_err(metrics[key], value) < 1e-6 or abs(metrics[key] - value) < 1e-12, (key, where)


def test_group_advantages_match_reference():
    rng = random.Random(7)
    for _ in range(30):
        gids = [rng.choice([3, 11, 42, -1]) for _ in range(rng.randint(1, 12))]
        rewards = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in gids]
        for scale in (False, True):
            got = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), scale_by_std=scale)
            want = ref_group_advantages(rewards, gids, scale)
            assert got.dtype == torch.float64
            assert all(abs(g - w) <= 1e-12 * max(1.0, abs(w)) for g, w in zip(got.tolist(), want))


def test_bnpo_scale_matches_reference_and_falls_back_to_uniform():
    rng = random.Random(3)
    for _ in range(20):
        gids = [g for g in range(rng.randint(1, 6)) for _ in range(rng.randint(1, 6))]
        rewards = [float(rng.random() < rng.random()) for _ in gids]
        got = losses.bnpo_advantage_scale(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids))
        want = ref_bnpo_scale(rewards, gids)
        assert all(rel_err(g, w) < 1e-9 for g, w in zip(got.tolist(), want))
    # one group, or no spread between groups: the uniform density, scale 1
    same = losses.bnpo_advantage_scale(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert same.tolist() == [1.0] * 4


# ------------------------------------------------------------ gradients: slides eq. 5


def near_on_policy(seed: int, n_groups=3, size=4, width=6, spread=1e-5, dtype=torch.float64):
    """p close to q so every ratio sits inside the clip region."""
    gen = torch.Generator().manual_seed(seed)
    lq = -torch.rand(n_groups * size, width, generator=gen, dtype=dtype) * 2 - 0.05
    lp = (lq + spread * torch.randn(lq.shape, generator=gen, dtype=dtype)).clamp(max=0)
    mask = (torch.rand(lq.shape, generator=gen) < 0.8).to(dtype)
    mask[:, 0] = 1
    gids = torch.arange(n_groups).repeat_interleave(size) * 5 + 2
    adv = torch.randn(n_groups * size, generator=gen, dtype=dtype)
    return lp.requires_grad_(), lq, mask, gids, adv


@pytest.mark.parametrize("seq_prob", ["geo_mean", "product"])
def test_grpo_gradient_is_token_ratio_over_q_t(seq_prob):
    lp, lq, mask, gids, adv = near_on_policy(0, spread=1e-3)
    loss, metrics = compute_policy_loss("grpo", lp, lq, mask, adv, gids, seq_prob=seq_prob)
    loss.backward()
    assert metrics["clip_frac"] == 0.0
    lengths = mask.sum(-1, keepdim=True)
    p, q = lp.detach().exp(), lq.exp()
    # d(-loss)/d lp_t = A_i/(B·L_i) · p'_t/q_t with p' = dp/d lp = p: each token scaled by 1/q_t
    analytic = -adv[:, None] / (len(adv) * lengths) * p / q * mask
    torch.testing.assert_close(lp.grad, analytic, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seq_prob", ["geo_mean", "product"])
def test_gspo_gradient_is_sequence_ratio_over_q_i(seq_prob):
    lp, lq, mask, gids, adv = near_on_policy(1, spread=1e-6, width=4)
    loss, metrics = compute_policy_loss("gspo", lp, lq, mask, adv, gids, seq_prob=seq_prob)
    loss.backward()
    assert metrics["clip_frac"] == 0.0  # inside GSPO's narrow default band 1 - 3e-4 .. 1 + 4e-4
    lengths = mask.sum(-1)
    norm = lengths if seq_prob == "geo_mean" else torch.ones_like(lengths)
    p_seq = ((lp.detach() * mask).sum(-1) / norm).exp()
    q_seq = ((lq * mask).sum(-1) / norm).exp()
    analytic = -(adv * p_seq / q_seq / (len(adv) * norm))[:, None] * mask  # every token of i scaled by 1/q_i
    torch.testing.assert_close(lp.grad, analytic, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seq_prob", ["geo_mean", "product"])
def test_gepo_gradient_is_scaled_by_one_group_constant(seq_prob):
    # sequences of a group share the same per-token log-probs up to noise, so w ~ 1
    gen = torch.Generator().manual_seed(2)
    n_groups, size, width = 3, 4, 5
    base = -torch.rand(n_groups, 1, width, generator=gen, dtype=torch.float64) - 0.1
    lq = (base + 1e-3 * torch.randn(n_groups, size, width, generator=gen, dtype=torch.float64)).reshape(-1, width)
    lp = (lq + 1e-3 * torch.randn(lq.shape, generator=gen, dtype=torch.float64)).clamp(max=0).requires_grad_()
    mask = torch.ones_like(lq)
    gids = torch.tensor([7, 7, 7, 7, 1, 1, 1, 1, 9, 9, 9, 9])
    adv = torch.randn(len(gids), generator=gen, dtype=torch.float64)
    loss, metrics = compute_policy_loss("gepo", lp, lq, mask, adv, gids, seq_prob=seq_prob)
    loss.backward()
    assert metrics["clip_frac"] == 0.0
    norm = width if seq_prob == "geo_mean" else 1
    p_seq = ((lp.detach() * mask).sum(-1) / norm).exp()
    q_seq = ((lq * mask).sum(-1) / norm).exp()
    for g in gids.unique():
        rows = gids == g
        expectation = (q_seq[rows] ** 2).sum() / q_seq[rows].sum()  # Ê_q[q] over this group only
        analytic = -(adv[rows] * p_seq[rows] / expectation / (len(adv) * norm))[:, None] * mask[rows]
        torch.testing.assert_close(lp.grad[rows], analytic, rtol=1e-10, atol=1e-14)
        # the same constant 1/Ê divides every token of every sequence of the group
        constants = lp.grad[rows] * norm * len(adv) / -(adv[rows] * p_seq[rows])[:, None]
        torch.testing.assert_close(constants, torch.full_like(constants, 1 / expectation.item()), rtol=1e-10, atol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "gspo", "gepo", "gmpo"])
def test_gradients_are_derivatives_of_the_loss(loss_type):
    """Losses without detached factors: autograd equals finite differences of the loss."""
    lp, lq, mask, gids, adv = gepo_batch(12, sizes=(3, 2), width=4)
    rewards = (adv > 0).to(adv.dtype)
    weights = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    for seq_prob in ("geo_mean", "product"):
        def f(x):
            return compute_policy_loss(loss_type, x, lq, mask, adv, gids, seq_prob=seq_prob, kl_coef=0.1,
                                       max_completion_length=4, rewards=rewards, sequence_weights=weights,
                                       epsilon_low=0.3, epsilon_high=0.3)[0]
        start = (lp - 0.01).requires_grad_()  # keep the perturbed log-probs negative
        assert torch.autograd.gradcheck(f, (start,), eps=1e-7, atol=1e-6)


@pytest.mark.parametrize("seq_prob", ["geo_mean", "product"])
def test_cispo_and_topr_weights_are_detached(seq_prob):
    lp, lq, mask, gids, adv = gepo_batch(13, sizes=(3, 3), width=5)
    n_seq, n_tok = len(adv), mask.sum()
    x = lp.clone().requires_grad_()
    compute_policy_loss("cispo", x, lq, mask, adv, gids, seq_prob=seq_prob)[0].backward()
    ratio = (lp - lq).exp()
    clipped = ratio.clamp(max=1.2)  # defaults: no lower bound, 1 + 0.2 above
    torch.testing.assert_close(x.grad, -(clipped * adv[:, None] * mask) / n_tok, rtol=1e-12, atol=1e-15)

    x = lp.clone().requires_grad_()
    compute_policy_loss("topr", x, lq, mask, adv, gids, seq_prob=seq_prob)[0].backward()
    norm = mask.sum(-1) if seq_prob == "geo_mean" else torch.ones(n_seq, dtype=lp.dtype)
    seq_ratio = (((lp - lq) * mask).sum(-1) / norm).exp()
    taper = torch.where(adv < 0, seq_ratio.clamp(0, 1), torch.ones_like(seq_ratio))
    torch.testing.assert_close(x.grad, -(adv * taper / norm / n_seq)[:, None] * mask, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- GEPO invariances


def gepo_batch(seed: int, sizes=(3, 3), width=7, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    n_seq = sum(sizes)
    lq = -torch.rand(n_seq, width, generator=gen, dtype=dtype) * 3
    lp = (lq + 0.3 * torch.randn(n_seq, width, generator=gen, dtype=dtype)).clamp(max=0)
    mask = (torch.rand(n_seq, width, generator=gen) < 0.75).to(dtype)
    mask[:, -1] = 1
    gids = torch.cat([torch.full((s,), 10 * k + 3) for k, s in enumerate(sizes)])
    rewards = (torch.rand(n_seq, generator=gen) < 0.5).to(dtype)
    return lp, lq, mask, gids, group_advantages(rewards, gids)


@pytest.mark.parametrize("seq_prob", ["geo_mean", "product"])
def test_gepo_permutation_changes_nothing(seq_prob):
    lp, lq, mask, gids, adv = gepo_batch(4, sizes=(2, 5, 3))
    lp1 = lp.clone().requires_grad_()
    loss1, m1 = compute_policy_loss("gepo", lp1, lq, mask, adv, gids, seq_prob=seq_prob, kl_coef=0.01)
    loss1.backward()
    perm = torch.randperm(len(gids), generator=torch.Generator().manual_seed(5))
    lp2 = lp[perm].clone().requires_grad_()
    loss2, m2 = compute_policy_loss("gepo", lp2, lq[perm], mask[perm], adv[perm], gids[perm], seq_prob=seq_prob,
                                    kl_coef=0.01)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss1.item(), rel=1e-12)
    for key in m1:
        assert m2[key] == pytest.approx(m1[key], rel=1e-10, abs=1e-14), key
    torch.testing.assert_close(lp2.grad, lp1.grad[perm], rtol=1e-10, atol=1e-15)


def test_gepo_two_equal_groups_give_the_mean_of_their_losses():
    lp, lq, mask, gids, adv = gepo_batch(6, sizes=(4, 4))
    both, _ = compute_policy_loss("gepo", lp, lq, mask, adv, gids)
    first, second = gids == gids[0], gids != gids[0]
    alone = [compute_policy_loss("gepo", lp[r], lq[r], mask[r], adv[r], gids[r])[0].item() for r in (first, second)]
    assert both.item() == pytest.approx(sum(alone) / 2, rel=1e-12)


def test_gepo_expectation_is_per_group_not_per_batch():
    lp, lq, mask, gids, adv = gepo_batch(8, sizes=(3, 3))
    other = gids != gids[0]
    grads = []
    for shift in (0.0, -2.0):  # change only the other group's sampler log-probs
        lq_changed = lq.clone()
        lq_changed[other] += shift
        x = lp.clone().requires_grad_()
        compute_policy_loss("gepo", x, lq_changed.clamp(max=0), mask, adv, gids)[0].backward()
        grads.append(x.grad[~other])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    log_e = gepo_log_expectation(torch.tensor([-1.0, -2.0, -5.0, -0.5]), torch.tensor([1, 1, 2, 2]))
    torch.testing.assert_close(log_e[:2], torch.full((2,), math.log((math.exp(-2) + math.exp(-4)) /
                                                                   (math.exp(-1) + math.exp(-2)))))


# --------------------------------------------------------------- Theorem 1, numerically


def variance_gap(p: list[float], q: list[float]) -> tuple[float, float]:
    """(KL(p||q), Var_q(p/q) - Var_q(p/E_q[q])) for discrete p, q, by direct sums; E_q[q] from the library."""
    log_e = gepo_log_expectation(torch.tensor(q, dtype=torch.float64).log(), torch.zeros(len(q), dtype=torch.long))
    e_q = math.exp(log_e[0].item())
    assert e_q == pytest.approx(sum(x * x for x in q), rel=1e-12)  # one group holding the whole support
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    var_is = sum(qi * (pi / qi) ** 2 for pi, qi in zip(p, q)) - sum(qi * (pi / qi) for pi, qi in zip(p, q)) ** 2
    var_gepo = sum(qi * (pi / e_q) ** 2 for pi, qi in zip(p, q)) - sum(qi * (pi / e_q) for pi, qi in zip(p, q)) ** 2
    return kl, var_is - var_gepo


def softmax(z: list[float]) -> list[float]:
    top = max(z)
    e = [math.exp(x - top) for x in z]
    return [x / sum(e) for x in e]


def test_theorem1_gap_grows_with_kl():
    rng = random.Random(11)
    for _ in range(8):  # fixed-seed sweeps: q over 8 outcomes, p_lambda moves mass onto q's rarest one
        z = [rng.gauss(0, 1) for _ in range(8)]
        z[0] -= 6
        q = softmax(z)
        c = 1 + 1 / sum(x * x for x in q) ** 2  # Var_q(p/q) >= e^KL - 1 and Var_q(p/E_q q) <= 1/E_q[q]^2
        points = [variance_gap(softmax([z[0] + lam] + z[1:]), q) for lam in range(13)]
        kls, gaps = zip(*points)
        assert all(b > a for a, b in zip(kls, kls[1:]))  # KL grows along the sweep, to about 5-8 nats
        assert kls[-1] > 5
        assert all(b > a for a, b in zip(gaps, gaps[1:]))  # and so does the variance gap, monotonically
        assert all(gap >= math.exp(kl) - c for kl, gap in points)  # Theorem 1's bound, with an explicit C
        assert all(gap > 0 for kl, gap in points if kl > math.log(c))  # GEPO's weight varies less past log C
    # random pairs too: ranked by KL, the gap rises (rank correlation)
    pairs = []
    for _ in range(60):
        z = [rng.gauss(0, 1.5) for _ in range(8)]
        p = softmax([zi + rng.uniform(0, 4) * rng.gauss(0, 1) for zi in z])
        pairs.append(variance_gap(p, softmax(z)))
    ranks_kl = rank([kl for kl, _ in pairs])
    ranks_gap = rank([gap for _, gap in pairs])
    n = len(pairs)
    spearman = 1 - 6 * sum((a - b) ** 2 for a, b in zip(ranks_kl, ranks_gap)) / (n * (n * n - 1))
    assert spearman > 0.6


def rank(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0] * len(values)
    for position, index in enumerate(order):
        out[index] = position
    return out


# ------------------------------------------------------------------------- stability


def stability_batch(case: str, width=4096, dtype=torch.float32):
    gen = torch.Generator().manual_seed(["identical", "sampler_far_likelier", "learner_far_likelier"].index(case))
    lp = (-10 + 0.5 * torch.randn(4, width, generator=gen)).clamp(max=0)
    if case == "identical":
        lq = lp.clone()
    elif case == "sampler_far_likelier":  # q >> p at every token, up to 60 nats apart
        lq = -torch.rand(4, width, generator=gen) * 0.1
        lp = lp - 50 * torch.rand(4, width, generator=gen)
    else:  # "learner_far_likelier"
        lq = lp - 60 * torch.rand(4, width, generator=gen)
        lp = -torch.rand(4, width, generator=gen) * 0.1
    mask = torch.ones(4, width)
    mask[1, width // 2 :] = 0
    gids = torch.tensor([5, 5, 8, 8])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return lp.to(dtype).requires_grad_(), lq.to(dtype), mask, gids, rewards


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["identical", "sampler_far_likelier", "learner_far_likelier"])
def test_finite_loss_and_gradients_on_long_extreme_sequences(case, dtype):
    for loss_type in LOSS_TYPES:
        for seq_prob in ("geo_mean", "product"):
            lp, lq, mask, gids, rewards = stability_batch(case, dtype=dtype)
            adv = group_advantages(rewards, gids, scale_by_std=True)
            loss, metrics = compute_policy_loss(loss_type, lp, lq, mask, adv, gids, seq_prob=seq_prob,
                                                max_completion_length=4096, kl_coef=0.005, rewards=rewards)
            loss.backward()
            where = f"{loss_type} {seq_prob}"
            assert loss.dtype == torch.float32 and torch.isfinite(loss), where
            assert lp.grad.dtype == dtype and bool(torch.isfinite(lp.grad).all()), where
            assert all(math.isfinite(v) for v in metrics.values()), (where, metrics)
            assert not lp.grad[1, 2048:].any(), where  # padding gets no gradient
            if case == "identical":  # GEPO's weight is p̄_i / Ê_q[q], not 1, even when p = q
                assert metrics["kl"] == 0.0, where
                assert loss_type == "gepo" or metrics["iw_mean"] == pytest.approx(1.0), where


def test_kl_metric_is_accurate_in_float32_when_p_is_close_to_q():
    gen = torch.Generator().manual_seed(0)
    lq = -torch.empty(64, 512, dtype=torch.float64).exponential_(1.0, generator=gen)
    lp = (lq + 0.01 * torch.randn(lq.shape, generator=gen, dtype=torch.float64)).clamp(max=0)
    mask = torch.ones_like(lq)
    gids = torch.arange(32).repeat_interleave(2)
    adv = torch.zeros(64, dtype=torch.float64)
    d = lq - lp
    want = ((d.exp() - d - 1) * mask).sum().item() / mask.sum().item()  # ~5e-5
    _, m64 = compute_policy_loss("gepo", lp, lq, mask, adv, gids)
    _, m32 = compute_policy_loss("gepo", lp.float(), lq.float(), mask.float(), adv.float(), gids)
    assert rel_err(m64["kl"], want) < 1e-9
    assert rel_err(m32["kl"], want) < 1e-3


def test_exp_cap_is_the_tangent_line_and_applies_to_the_kl_metric():
    x = torch.tensor([-5.0, 0.0, 20.0, 25.0, 1e4], dtype=torch.float64, requires_grad=True)
    y = losses._capped_exp(x)
    y.sum().backward()
    want = [ref_exp(v) for v in x.tolist()]
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(y.tolist(), want))
    assert x.grad.tolist()[3:] == [math.exp(20.0)] * 2  # slope of the tangent line
    # one token 30 nats likelier under the sampler: the sweep redoes its block with the cap
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    lq = lp.clone()
    lp[0, 1] = -31.0
    _, metrics = compute_policy_loss("gspo", lp, lq, torch.ones(2, 3), torch.zeros(2), torch.tensor([0, 0]))
    assert rel_err(metrics["kl"], (ref_exp(30.0) - 30.0 - 1) / 6) < 1e-12


# ------------------------------------------------------------------ sequence weights


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_sequence_weight_gives_exactly_zero_gradient(loss_type):
    lp, lq, mask, gids, adv = gepo_batch(9, sizes=(3, 3))
    rewards = (adv > 0).to(adv.dtype)
    kwargs = dict(max_completion_length=7, kl_coef=0.05, rewards=rewards)
    weights = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25], dtype=torch.float64)
    x = lp.clone().requires_grad_()
    compute_policy_loss(loss_type, x, lq, mask, adv, gids, sequence_weights=weights, **kwargs)[0].backward()
    assert not x.grad[weights == 0].any()
    assert x.grad[weights > 0].abs().sum() > 0
    ones, _ = compute_policy_loss(loss_type, lp, lq, mask, adv, gids, sequence_weights=torch.ones(6), **kwargs)
    none, _ = compute_policy_loss(loss_type, lp, lq, mask, adv, gids, **kwargs)
    assert ones.item() == pytest.approx(none.item(), rel=1e-12)


# ------------------------------------------------------------------------ bad input


def good_inputs():
    lp, lq, mask, gids, adv = gepo_batch(10, sizes=(2, 2), width=4)
    return dict(learner_logps=lp, sampler_logps=lq, mask=mask, advantages=adv, group_ids=gids)


def call(loss_type="gepo", **changes):
    args = good_inputs()
    extra = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update(changes)
    return compute_policy_loss(loss_type, args["learner_logps"], args["sampler_logps"], args["mask"],
                               args["advantages"], args["group_ids"], **extra)


def test_unknown_loss_type_lists_the_valid_names():
    with pytest.raises(ValueError, match="loss_type") as err:
        call("gepoo")
    assert all(name in str(err.value) for name in LOSS_TYPES)
    assert set(losses._LOSSES) == set(LOSS_TYPES) == set(DEFAULT_EPSILONS)


@pytest.mark.parametrize("name, change", [
    ("learner_logps", lambda a: a["learner_logps"][0]),
    ("sampler_logps", lambda a: a["sampler_logps"][:, :3]),
    ("mask", lambda a: a["mask"][:3]),
    ("advantages", lambda a: a["advantages"][:3]),
    ("group_ids", lambda a: a["group_ids"][:3]),
    ("group_ids", lambda a: a["group_ids"].double()),
    ("learner_logps", lambda a: a["learner_logps"].to(torch.long)),
])
def test_shape_and_dtype_errors_name_the_argument(name, change):
    with pytest.raises(ValueError, match=name):
        call(**{name: change(good_inputs())})


@pytest.mark.parametrize("name", ["learner_logps", "sampler_logps"])
@pytest.mark.parametrize("bad, where", [(math.nan, (0, 1)), (math.nan, (0, 0)), (math.inf, (1, 2)),
                                        (-math.inf, (1, 2)), (0.5, (0, 3))])
def test_nan_inf_and_positive_log_probs_name_the_argument(name, bad, where):
    args = good_inputs()
    values = args[name].detach().clone()
    args["mask"][0, 0] = 0  # (0, 0) is padding: NaN and inf are refused there too
    values[where] = bad
    with pytest.raises(ValueError, match=name):
        call(**{name: values, "mask": args["mask"]})


def test_positive_log_probs_in_padding_are_ignored():
    args = good_inputs()
    args["mask"][0, 0] = 0
    lq = args["sampler_logps"].clone()
    lq[0, 0] = 3.0
    call(sampler_logps=lq, mask=args["mask"])


@pytest.mark.parametrize("changes, name", [
    (dict(group_ids=torch.tensor([1, 1, 2, 3])), "group_ids"),  # gepo group of one
    (dict(mask=torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])), "mask"),
    (dict(mask=torch.full((4, 4), 0.3)), "mask"),  # rows sum to a fraction
    (dict(advantages=torch.tensor([0.0, math.nan, 0, 0], dtype=torch.float64)), "advantages"),
    (dict(seq_prob="arithmetic"), "seq_prob"),
    (dict(epsilon_low=-0.1), "epsilon_low"),
    (dict(epsilon_high=math.inf), "epsilon_high"),
    (dict(kl_coef=-1.0), "kl_coef"),
    (dict(sequence_weights=torch.tensor([1.0, -1.0, 1.0, 1.0])), "sequence_weights"),
    (dict(sequence_weights=torch.ones(3)), "sequence_weights"),
    (dict(max_completion_length=0), "max_completion_length"),
])
def test_bad_arguments_name_the_argument(changes, name):
    with pytest.raises(ValueError, match=name):
        call(**changes)


def test_loss_specific_requirements():
    with pytest.raises(ValueError, match="max_completion_length"):
        call("dr_grpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        call("dr_grpo", max_completion_length=1)  # shorter than a completion in the batch
    with pytest.raises(ValueError, match="rewards"):
        call("bnpo")
    with pytest.raises(ValueError, match="rewards"):
        call("bnpo", rewards=torch.tensor([0.0, 2.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.tensor([1.0, math.nan]), torch.tensor([0, 0]))
    for name in LOSS_TYPES:  # a group of one is fine for every loss but gepo
        if name != "gepo":
            call(name, group_ids=torch.tensor([1, 1, 2, 3]), max_completion_length=4,
                 rewards=torch.tensor([0.0, 1.0, 1.0, 0.0]))


def test_defaults_are_documented_and_resolved():
    """Each loss's default clipping range is the one docs/losses.md gives with its source; GSPO's
    is its paper's (3e-4 below, 4e-4 above), not the token-level 0.2."""
    from pathlib import Path
    table = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
    documented = {}
    for line in table.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in LOSS_TYPES:
            low, high = (float(x.split()[0]) for x in cells[3].split(","))
            documented[cells[0]] = (low, high)
            assert "arXiv:" in cells[4], f"{cells[0]}: no source for its defaults"
    assert documented == {name: DEFAULT_EPSILONS[name] for name in LOSS_TYPES}
    assert losses.resolve_epsilons("gspo") == (3e-4, 4e-4)
    assert losses.resolve_epsilons("gepo", None, 0.3) == (0.2, 0.3)
    assert DEFAULT_EPSILONS["gepo"] == (0.2, 0.2) and DEFAULT_EPSILONS["grpo"] == (0.2, 0.2)
    assert losses.validate_loss_type("topr") == "topr"


# ------------------------------------------------------------------------ micro-batches


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batched_gradient_equals_the_one_shot_gradient(loss_type):
    """Rows split at random (cutting through prompt groups), each share backpropagated on its
    own with the whole batch's BatchStats: the summed gradient is the one-shot gradient."""
    rng = random.Random(f"micro-{loss_type}")
    for case in range(20):
        lp, lq, mask, rewards, gids = random_batch(rng, loss_type)
        seq_prob = rng.choice(["geo_mean", "product"])
        kl_coef = rng.choice([0.0, 0.005, 0.3])
        weights = None if rng.random() < 0.4 else [rng.choice([0.0, 0.25, 1.0, rng.random()]) for _ in gids]
        max_len = len(mask[0]) + rng.randint(0, 3)
        lp_t, lq_t, m_t, g_t = tensors(lp, lq, mask, gids)
        r_t = torch.tensor(rewards, dtype=torch.float64)
        w_t = None if weights is None else torch.tensor(weights, dtype=torch.float64)
        adv = group_advantages(r_t, g_t, scale_by_std=rng.random() < 0.5)
        common = dict(seq_prob=seq_prob, kl_coef=kl_coef)
        one_shot, _ = compute_policy_loss(loss_type, lp_t, lq_t, m_t, adv, g_t, max_completion_length=max_len,
                                          rewards=r_t, sequence_weights=w_t, **common)
        (want,) = torch.autograd.grad(one_shot, lp_t)

        stats = losses.batch_stats(loss_type, lq_t, m_t, adv, g_t, seq_prob=seq_prob,
                                   max_completion_length=max_len, rewards=r_t)
        order = list(range(len(gids)))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, len(order)), k=min(len(order) - 1, rng.randint(1, 4)))) if len(order) > 1 else []
        got, total = torch.zeros_like(lp_t), 0.0
        for part in (order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])):
            rows = torch.tensor(part)
            lp_mb = lp_t.detach()[rows].requires_grad_()
            share = losses.micro_batch_loss(loss_type, lp_mb, lq_t[rows], m_t[rows], stats.rows(rows),
                                            sequence_weights=None if w_t is None else w_t[rows], **common)
            share.backward()
            got[rows] += lp_mb.grad
            total += share.item()
        assert rel_err(total, one_shot.item()) < 1e-9 or abs(total - one_shot.item()) < 1e-12, case
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-9 * max(scale, 1e-12), (case, seq_prob, kl_coef)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "bnpo", "gmpo"])
def test_one_ratio_above_the_cap_leaves_the_other_gradients_accurate_in_float32(loss_type):
    """Regression: the capped exp once added and subtracted e^20·g at every token of the tensor,
    so one token above the cap erased every other token's gradient in float32."""
    lp, lq, mask, rewards, gids = random_batch(random.Random(f"cap-{loss_type}"), loss_type, max_len=6)
    lq[0] = [x - 25.0 if keep else x for x, keep in zip(lp[0], mask[0])]  # row 0: ratios e^25 > e^20
    grads = {}
    for dtype in (torch.float64, torch.float32):
        lp_t, lq_t, m_t, g_t = tensors(lp, lq, mask, gids, dtype=dtype)
        r_t = torch.tensor(rewards, dtype=dtype)
        loss, _ = compute_policy_loss(loss_type, lp_t, lq_t, m_t, group_advantages(r_t, g_t), g_t,
                                      max_completion_length=6, rewards=r_t, epsilon_low=30.0, epsilon_high=1e12)
        (grads[dtype],) = torch.autograd.grad(loss, lp_t)
    want, got = grads[torch.float64][1:], grads[torch.float32][1:].double()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "gepo"])
def test_weight_family_variances_match_a_float64_reference_whatever_the_loss(loss_type):
    """Theorem 1 like for like: each loss's step reports all three weights' variances on its batch."""
    rng = random.Random(7)
    lp, lq, mask, _, gids = random_batch(rng, "gepo")
    p, q, m, g = tensors(lp, lq, mask, gids)
    adv = torch.tensor([rng.gauss(0, 1) for _ in gids], dtype=torch.float64)
    _, metrics = compute_policy_loss(loss_type, p, q, m, adv, g)

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    tokens = [math.exp(a - b) for pr, qr, mr in zip(lp, lq, mask) for a, b, k in zip(pr, qr, mr) if k]
    seq_p = [sum(a for a, k in zip(pr, mr) if k) / sum(mr) for pr, mr in zip(lp, mask)]  # geometric mean, in log
    seq_q = [sum(b for b, k in zip(qr, mr) if k) / sum(mr) for qr, mr in zip(lq, mask)]
    expectation = {gid: sum(math.exp(2 * seq_q[j]) for j in range(len(gids)) if gids[j] == gid)
                   / sum(math.exp(seq_q[j]) for j in range(len(gids)) if gids[j] == gid) for gid in set(gids)}
    assert rel_err(metrics["var_token_ratio"], var(tokens)) < 1e-9
    assert rel_err(metrics["var_sequence_ratio"], var([math.exp(a - b) for a, b in zip(seq_p, seq_q)])) < 1e-9
    assert rel_err(metrics["var_group_weight"],
                   var([math.exp(a) / expectation[gid] for a, gid in zip(seq_p, gids)])) < 1e-9
