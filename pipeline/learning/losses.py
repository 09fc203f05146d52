"""Policy-gradient losses for the learner: GEPO and its baselines, as pure functions.

The learner, the replay tool and users' own scripts all call these functions, so they
keep no state and do no I/O. Every formula traces to the GEPO paper, arXiv 2508.17850 (and, for the
baselines, to the papers named beside each loss); docs/losses.md writes each one out.

Layout, top to bottom:
  1. Constants a config layer validates against: LOSS_TYPES, DEFAULT_EPSILONS, SEQ_PROB_MODES.
  2. group_advantages: A_i = R_i - mean_g(R), optionally / (std_g(R) + 1e-4).
  3. Numeric helpers: the capped exp, group indexing, GEPO's group expectation.
  4. _TokenSweep: one cache-friendly pass over the [B, T] inputs for the per-sequence
     sums, the validation maxima and the k3 KL metric (why: see its docstring).
  5. BatchStats / batch_stats: what a loss needs from the whole batch (advantages, GEPO's
     group expectation, BNPO's Beta scaling, the normalisers), computed once, so that a
     batch split into micro-batches gives exactly the one-shot gradient.
  6. _Batch / _prepare: inputs validated once, plus what every loss reads.
  7. One small function per loss returning LossTerms, and the _LOSSES registry.
  8. compute_policy_loss (one batch: loss and metrics) and micro_batch_loss (rows of a
     batch whose BatchStats are given): look up -> validate -> loss terms -> sequence
     weights -> k3 KL penalty (-> metrics).

Conventions: B sequences of T token slots; the mask marks completion tokens. Losses
maximise an objective and return its negation. Inputs in bfloat16/float16 are computed
in float32, float64 stays float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Literal

import torch

SeqProb = Literal["geo_mean", "product"]
SEQ_PROB_MODES: tuple[str, ...] = ("geo_mean", "product")

LOSS_TYPES: tuple[str, ...] = ("gepo", "grpo", "dr_grpo", "bnpo", "gspo", "gmpo", "cispo", "topr")

# (epsilon_low, epsilon_high) used when the caller passes None; sources in docs/losses.md.
# For gmpo they bound the token log-ratio; for cispo and topr they bound a detached
# weight, where epsilon_low = 1.0 means "no lower bound" (ratios are positive).
DEFAULT_EPSILONS: dict[str, tuple[float, float]] = {
    "gepo": (0.2, 0.2),
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "bnpo": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "gmpo": (0.4, 0.4),
    "cispo": (1.0, 0.2),
    "topr": (1.0, 0.0),
}

STD_EPS = 1e-4  # added to the group std when advantages are scaled (docs/losses.md)
LOG_RATIO_CAP = 20.0  # above this, exp is continued by its tangent line (see _capped_exp)
BNPO_MAX_SCALE = 1e6  # cap on BNPO's 1/density, as in the BNPO authors' code
SWEEP_BLOCK_ELEMENTS = 1 << 16  # token slots per block of _TokenSweep on CPU (256 KiB in float32)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = False) -> Tensor:
    """Group-relative advantages, [B] -> [B].

    A_i = R_i - mean_{j in g(i)} R_j, divided by (std_{j in g(i)} R_j + 1e-4) when
    ``scale_by_std``. The std is the sample std (n - 1), 0 for a group of one. The switch
    is the same for every loss (the reference scaled only for grpo and gspo).

    Raises ValueError naming the argument for a wrong shape, dtype or non-finite reward.
    """
    _check_tensor("rewards", rewards)
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must have shape [B] with B >= 1, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    index, sizes = _group_index(group_ids, rewards.shape[0])
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains NaN or inf")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.detach().to(dtype)
    counts = sizes.to(dtype)
    mean = _group_sum(r, index, len(sizes)) / counts
    centred = r - mean[index]
    if not scale_by_std:
        return centred
    std = torch.sqrt(_group_sum(centred**2, index, len(sizes)) / (counts - 1).clamp(min=1))
    return centred / (std[index] + STD_EPS)


# ------------------------------------------------------------------------ numeric helpers


def _capped_exp(x: Tensor) -> Tensor:
    """exp(x), continued above LOG_RATIO_CAP by its tangent line.

    Exact for x <= 20 (a ratio of 4.9e8); beyond, value and gradient grow linearly
    instead of overflowing, keeping the gradient's sign. Every ratio and the k3 KL term
    go through it.
    """
    if x.numel() == 0 or float(x.detach().amax()) <= LOG_RATIO_CAP:
        return torch.exp(x)  # nothing to cap: same values, one pass
    # torch.where, not exp(clamp(x)) + (x - clamp(x))·e^20: that sum's gradient adds and
    # subtracts e^20·g at every element, which in float32 wipes out the exp(x)·g of all the
    # elements below the cap as soon as one element of the tensor is above it.
    tangent = math.exp(LOG_RATIO_CAP) * (1 + (x - LOG_RATIO_CAP))
    return torch.where(x > LOG_RATIO_CAP, tangent, torch.exp(x.clamp(max=LOG_RATIO_CAP)))


def _check_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _group_index(group_ids: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """Map arbitrary (unsorted, non-contiguous) group ids to 0..n_groups-1: (index [B], sizes [n_groups])."""
    _check_tensor("group_ids", group_ids)
    if tuple(group_ids.shape) != (batch,):
        raise ValueError(f"group_ids must have shape [{batch}], got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, sizes


def _group_sum(x: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """sum_{j in g} x_j for each group g: [B, ...] -> [n_groups, ...]."""
    return torch.zeros((n_groups, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, index, x)


def _sampler_group_stats(seq_logq: Tensor, index: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """(log q̂_i, log Ê_q[q] of i's group), both [B], from the sampler's sequence log-probs.

    q̂_j = q̄_j / sum_{k in g} q̄_k and Ê_q[q] = sum_j q̂_j q̄_j = sum_j q̄_j² / sum_j q̄_j
    (the GEPO paper; docs/losses.md), in log space: log Ê = logsumexp(2 log q̄) - logsumexp(log q̄) over
    the group. Both sums share one shift by the group max, so nothing under- or
    overflows. Sums run over one prompt's group, never over the batch. Detached.
    """
    seq_logq = seq_logq.detach()
    group_max = torch.full((n_groups,), -math.inf, dtype=seq_logq.dtype, device=seq_logq.device)
    group_max = group_max.scatter_reduce_(0, index, seq_logq, reduce="amax")
    shifted = seq_logq - group_max[index]
    q = torch.exp(shifted)  # q̄ / max q̄ of the group, in (0, 1]
    log_sums = _group_sum(torch.stack([q, q * q], dim=1), index, n_groups).log()  # log sum q̄, log sum q̄² (shifted)
    log_qhat = shifted - log_sums[index, 0]
    log_expectation = (group_max + log_sums[:, 1] - log_sums[:, 0])[index]
    return log_qhat, log_expectation


def gepo_log_expectation(sampler_seq_logps: Tensor, group_ids: Tensor) -> Tensor:
    """log Ê_q[q] of each sequence's own prompt group, [B] -> [B] (detached).

    ``sampler_seq_logps`` are sequence log-probs log q̄_i (as chosen by seq_prob).
    Exposed for tests and offline analysis (e.g. Theorem 1 checks).
    """
    _check_tensor("sampler_seq_logps", sampler_seq_logps)
    if sampler_seq_logps.dim() != 1:
        raise ValueError(f"sampler_seq_logps must have shape [B], got {tuple(sampler_seq_logps.shape)}")
    index, sizes = _group_index(group_ids, sampler_seq_logps.shape[0])
    return _sampler_group_stats(sampler_seq_logps, index, len(sizes))[1]


# ------------------------------------------------------------------ one pass over the tokens


class _TokenSweep(torch.autograd.Function):
    """Everything the losses need from the [B, T] tensors that is not token-level math.

    With d = lq - lp, returns per sequence (each [B]): sum_t m·lp, sum_t m·lq, L and
    sum_t m·(exp(d) - 1) (the k3 KL needs it: sum_t m·k3 = that - sum_t m·d), plus the
    largest m·lp and m·lq for validation. The first and fourth are differentiable in lp.

    Why a custom Function: on CPU the rows are processed in blocks of about
    SWEEP_BLOCK_ELEMENTS, so each input is read from memory once and the products,
    maxima and exponentials run on data still in cache. This is what keeps GEPO (whose
    own math is per sequence) within a small factor of the cost of just reading the
    log-probs. The backward writes the gradient in one pass; with the KL penalty on it
    recomputes exp(d) block by block instead of keeping a [B, T] tensor alive.
    Elsewhere (GPU) there is one block.
    """

    @staticmethod
    def forward(ctx, lp: Tensor, lq: Tensor, mask: Tensor, dtype: torch.dtype):  # type: ignore[override]
        rows = _sweep_rows(lp)
        sums, lengths, exp_sums, maxima = [], [], [], []
        # One scratch block: masked[0] = m·lp and masked[1] = m·lq, so one call reduces both.
        full = torch.empty((2, min(rows, len(lp)), lp.shape[1]), dtype=dtype, device=lp.device)
        full_lp, full_lq = full.unbind(0)
        for m, lp_block, lq_block in zip(mask.split(rows), lp.split(rows), lq.split(rows)):
            m = _as_dtype(m, dtype)
            masked, masked_lp, masked_lq = (full, full_lp, full_lq) if len(m) == len(full_lp) else (
                full[:, : len(m)], full_lp[: len(m)], full_lq[: len(m)])  # the last, shorter block
            torch.mul(_as_dtype(lp_block, dtype), m, out=masked_lp)
            torch.mul(_as_dtype(lq_block, dtype), m, out=masked_lq)
            sums.append(masked.sum(-1))
            maxima.append(masked.amax(dim=(1, 2)))
            lengths.append(m.sum(-1))
            d = masked_lq.sub_(masked_lp)  # m·(lq - lp): 0 at padding, so exp(d) - 1 vanishes there
            exp_sums.append(d.exp_().sum(-1))
        sum_lp, sum_lq = torch.cat(sums, dim=1)
        # sum_t (exp(m·d) - 1) = sum_t exp(m·d) - T: summing a row before subtracting loses
        # little in float32 (a relative 1e-4 of a k3 mean of 5e-5) and saves a pass.
        exp_sums = _cap_exp_sums(torch.cat(exp_sums) - lp.shape[1], lp, lq, mask, dtype)
        ctx.save_for_backward(lp, lq, mask)
        ctx.dtype = dtype
        ctx.set_materialize_grads(False)
        lengths, maxima = torch.cat(lengths), torch.stack(maxima)
        ctx.mark_non_differentiable(sum_lq, lengths, maxima)
        return sum_lp, sum_lq, lengths, exp_sums, maxima

    @staticmethod
    def backward(ctx, grad_sum_lp, grad_sum_lq, grad_lengths, grad_exp_sums, grad_maxima):  # type: ignore[override]
        lp, lq, mask = ctx.saved_tensors
        g = grad_sum_lp if grad_sum_lp is not None else torch.zeros(len(lp), dtype=ctx.dtype, device=lp.device)
        if grad_exp_sums is None:  # d(sum_t m·lp)/d lp_t = m_t
            return (g[:, None] * mask).to(lp.dtype), None, None, None
        rows, grads = _sweep_rows(lp), []
        for start, m, lp_block, lq_block in zip(range(0, len(lp), rows), mask.split(rows),
                                                lp.split(rows), lq.split(rows)):
            m = _as_dtype(m, ctx.dtype)
            d = (_as_dtype(lq_block, ctx.dtype) - _as_dtype(lp_block, ctx.dtype)) * m
            slope = torch.exp(d.clamp_(max=LOG_RATIO_CAP))  # d _capped_exp(d) / d d
            block = slice(start, start + rows)  # d(sum_t m·(exp(d) - 1))/d lp_t = -m_t·slope_t
            grads.append((g[block, None] - grad_exp_sums[block, None] * slope) * m)
        return torch.cat(grads).to(lp.dtype), None, None, None


def _sweep_rows(lp: Tensor) -> int:
    """Rows per block: about SWEEP_BLOCK_ELEMENTS token slots on CPU, everything at once elsewhere."""
    batch, width = lp.shape
    return max(1, SWEEP_BLOCK_ELEMENTS // width) if lp.device.type == "cpu" else batch


def _as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _cap_exp_sums(exp_sums: Tensor, lp: Tensor, lq: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Redo with _capped_exp the rows of sum_t m·(exp(d) - 1) where some d may exceed the cap.

    Each term exp(d) - 1 is >= -1, so a row of T slots whose sum is below e^20 - T has
    every d <= 20 and needs no cap. Checking the sums afterwards spares the sweep a max
    pass per block; the redo is rare (a token 4.9e8 times likelier under the sampler
    than under the learner) and also covers inf and NaN sums.
    """
    safe = exp_sums < math.exp(LOG_RATIO_CAP) - lp.shape[1]  # False for NaN too
    if bool(safe.all()):
        return exp_sums
    rows = (~safe).nonzero().flatten()
    m = _as_dtype(mask[rows], dtype)
    d = (_as_dtype(lq[rows], dtype) - _as_dtype(lp[rows], dtype)) * m
    return exp_sums.index_put((rows,), (_capped_exp(d) - 1).sum(-1))


# ------------------------------------------------------------------------ batch stats


@dataclass(frozen=True)
class BatchStats:
    """What a loss reads from the whole batch rather than from one sequence (detached).

    Every loss is a sum over sequences of terms that depend on the sequence itself and
    on these alone, so with the same BatchStats the losses of disjoint row sets add up to
    the loss of the batch, and so do their gradients (docs/losses.md).
    """

    advantages: Tensor  # [B] A_i; for bnpo already divided by the Beta density of its group
    seq_lq: Tensor  # [B] the sampler's log q̄_i (or log q_i with seq_prob "product")
    log_qhat: Tensor  # [B] log q̂_i within its prompt group
    log_expectation: Tensor  # [B] log Ê_q[q] of its prompt group (GEPO)
    lengths: Tensor  # [B] L_i
    num_sequences: int  # normaliser of grpo, dr_grpo (· max_completion_length), gspo, gepo, gmpo, topr
    num_tokens: float  # normaliser of bnpo, cispo and the KL penalty: sum_i L_i
    smallest_group: int
    max_completion_length: int | None

    def rows(self, index: Tensor | slice | list[int]) -> "BatchStats":
        """The per-sequence entries of some rows; the normalisers stay the whole batch's."""
        return replace(self, advantages=self.advantages[index], seq_lq=self.seq_lq[index],
                       log_qhat=self.log_qhat[index], log_expectation=self.log_expectation[index],
                       lengths=self.lengths[index])


def batch_stats(loss_type: str, sampler_logps: Tensor, mask: Tensor, advantages: Tensor, group_ids: Tensor, *,
                seq_prob: SeqProb = "geo_mean", max_completion_length: int | None = None,
                rewards: Tensor | None = None) -> BatchStats:
    """BatchStats of a whole batch of prompt groups, from the sampler's side alone (no model
    needed): call it once per step, then `micro_batch_loss` on any split of the rows.

    Raises ValueError naming the argument, as compute_policy_loss does.
    """
    validate_loss_type(loss_type)
    _check_shapes(sampler_logps, sampler_logps, mask, advantages, seq_prob, max_completion_length)
    index, sizes = _group_index(group_ids, sampler_logps.shape[0])
    dtype = torch.float64 if sampler_logps.dtype == torch.float64 else torch.float32
    m = mask.detach().to(dtype)
    lengths = m.sum(-1)
    if bool((lengths < 1).any()):
        rows = torch.nonzero(lengths < 1).flatten().tolist()
        raise ValueError(f"mask: sequences {rows[:10]} have no completion tokens (every sequence needs L_i >= 1)")
    sum_lq = (sampler_logps.detach().to(dtype) * m).sum(-1)
    if not bool(torch.isfinite(sum_lq).all()):
        raise ValueError("sampler_logps contains NaN or inf at completion tokens")
    adv = advantages.detach().to(dtype)
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages contains NaN or inf")
    if rewards is not None:
        rewards = _per_sequence_input("rewards", rewards, len(adv), dtype)
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards contains NaN or inf")
    return _stats(loss_type, sum_lq, lengths, adv, index, sizes, seq_prob, max_completion_length, rewards)


def _stats(loss_type: str, sum_lq: Tensor, lengths: Tensor, adv: Tensor, index: Tensor, sizes: Tensor,
           seq_prob: str, max_completion_length: int | None, rewards: Tensor | None) -> BatchStats:
    seq_lq = sum_lq / lengths if seq_prob == "geo_mean" else sum_lq
    log_qhat, log_expectation = _sampler_group_stats(seq_lq, index, len(sizes))
    if loss_type == "bnpo":
        if rewards is None:
            raise ValueError("rewards is required for bnpo (the Beta density is evaluated at each group's mean "
                             "reward)")
        adv = adv * _bnpo_scale(rewards, index, sizes)
    return BatchStats(advantages=adv, seq_lq=seq_lq.detach(), log_qhat=log_qhat, log_expectation=log_expectation,
                      lengths=lengths.detach(), num_sequences=len(adv), num_tokens=float(lengths.sum()),
                      smallest_group=int(sizes.min()), max_completion_length=max_completion_length)


# ------------------------------------------------------------------- validated inputs


@dataclass(frozen=True)
class _Batch:
    """Validated inputs and the per-sequence quantities shared by all losses."""

    learner_logps: Tensor  # [B, T] as given (carries grad)
    sampler_logps: Tensor  # [B, T] as given, detached
    mask_in: Tensor  # [B, T] as given
    dtype: torch.dtype  # float32, or float64 when an input is float64
    lengths: Tensor  # [B] L_i = sum_t m
    num_tokens: float  # sum_i L_i over these rows
    stats: BatchStats  # these rows' entries; the normalisers of the whole batch
    group_index: Tensor | None  # [B] group of each sequence, 0..n_groups-1 (None: rows of a larger batch)
    group_sizes: Tensor | None  # [n_groups]
    sum_lp: Tensor  # [B] sum_t m·lp (carries grad)
    sum_lq: Tensor  # [B] sum_t m·lq
    seq_lp: Tensor  # [B] log p̄_i (geo_mean) or log p_i (product); carries grad
    kl_rows: Tensor  # [B] sum_t m·k3 (carries grad)
    kl_metric: float  # token mean of k3 over these rows (unweighted)
    seq_prob: str
    sequence_weights: Tensor | None  # [B] >= 0, None for all ones

    @property
    def batch_size(self) -> int:
        return self.learner_logps.shape[0]

    @property
    def n_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def advantages(self) -> Tensor:
        return self.stats.advantages

    @property
    def seq_lq(self) -> Tensor:
        return self.stats.seq_lq

    @property
    def log_qhat(self) -> Tensor:
        return self.stats.log_qhat

    @property
    def log_expectation(self) -> Tensor:
        return self.stats.log_expectation

    # Full [B, T] tensors in the compute dtype, for the token-level losses only
    # (a no-op view for float32 inputs).
    @property
    def lp(self) -> Tensor:
        return self.learner_logps.to(self.dtype)

    @property
    def lq(self) -> Tensor:
        return self.sampler_logps.to(self.dtype)

    @property
    def mask(self) -> Tensor:
        return self.mask_in.to(self.dtype)

    def per_sequence(self, token_values: Tensor) -> Tensor:
        """sum_t m·x, or sum_t m·x / L_i for geo_mean: how seq_prob aggregates tokens."""
        sums = (token_values * self.mask).sum(-1)
        return sums / self.lengths if self.seq_prob == "geo_mean" else sums


def _check_shapes(learner_logps: Tensor, sampler_logps: Tensor, mask: Tensor, advantages: Tensor | None,
                  seq_prob: str, max_completion_length: int | None) -> None:
    for name, value in (("learner_logps", learner_logps), ("sampler_logps", sampler_logps),
                        ("mask", mask), ("advantages", advantages)):
        if value is not None:
            _check_tensor(name, value)
    shape = tuple(learner_logps.shape)
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"learner_logps must have shape [B, T] with B, T >= 1, got {shape}")
    for name, value in (("sampler_logps", sampler_logps), ("mask", mask)):
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} must have the shape of learner_logps {shape}, got {tuple(value.shape)}")
    if advantages is not None and tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages must have shape [{shape[0]}], got {tuple(advantages.shape)}")
    for name, value in (("learner_logps", learner_logps), ("sampler_logps", sampler_logps),
                        ("advantages", advantages)):
        if value is not None and not value.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if mask.is_complex():
        raise ValueError(f"mask must be bool, integer or real, got {mask.dtype}")
    if seq_prob not in SEQ_PROB_MODES:
        raise ValueError(f"seq_prob must be one of {SEQ_PROB_MODES}, got {seq_prob!r}")
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int)
        or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")


def _prepare(
    learner_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    seq_prob: str,
    sequence_weights: Tensor | None,
    *,
    stats: BatchStats | None = None,
    loss_type: str = "",
    advantages: Tensor | None = None,
    group_ids: Tensor | None = None,
    max_completion_length: int | None = None,
    rewards: Tensor | None = None,
) -> _Batch:
    """Check every input (ValueError naming the argument) and compute the shared quantities.

    One whole batch: `advantages` and `group_ids` (and `rewards` for bnpo) are given and its
    BatchStats are computed here. Rows of a larger batch: its BatchStats for these rows are.

    The value checks ride on _TokenSweep's block maxima and sums (a NaN or inf anywhere,
    padding included, makes them non-finite); the exact culprit is looked up only when
    something is wrong. All checks together cost one device sync.
    """
    whole = stats is None
    if whole:
        _check_shapes(learner_logps, sampler_logps, mask, advantages, seq_prob, max_completion_length)
        index, sizes = _group_index(group_ids, learner_logps.shape[0])
    else:
        _check_shapes(learner_logps, sampler_logps, mask, None, seq_prob, None)
        if len(stats.lengths) != learner_logps.shape[0]:
            raise ValueError(f"stats hold {len(stats.lengths)} rows, learner_logps {learner_logps.shape[0]}")
        index = sizes = None
    dtype = torch.float64 if torch.float64 in (learner_logps.dtype, sampler_logps.dtype) else torch.float32
    lq_in = sampler_logps.detach()
    optional = {name: _per_sequence_input(name, value, learner_logps.shape[0], dtype)
                for name, value in (("rewards", rewards), ("sequence_weights", sequence_weights)) if value is not None}
    adv = advantages.detach().to(dtype) if whole else stats.advantages

    sum_lp, sum_lq, lengths, exp_sums, maxima = _TokenSweep.apply(learner_logps, lq_in, mask.detach(), dtype)
    # k3 = exp(d) - d - 1 summed per sequence as sum_t m·(exp(d) - 1) - sum_t m·d: the first
    # term token by token, the second from the row sums. In float32 this is about as
    # accurate as summing k3 itself and far better than sum(exp(d)) - sum(d) - L.
    kl_rows = exp_sums - (sum_lq - sum_lp)  # differentiable in lp
    # Everything validation needs, in one transfer: block maxima, L_i, A_i, sum of k3.
    batch, n_max = len(lengths), maxima.numel()
    values = torch.cat([maxima.reshape(-1), lengths, adv, *optional.values(), kl_rows.detach().sum().reshape(1)])
    length_list, kl_total = _check_swept_values(values.tolist(), n_max, batch, lengths, learner_logps, lq_in,
                                                list(optional))
    num_tokens = math.fsum(length_list)

    if whole:
        stats = _stats(loss_type, sum_lq, lengths, adv, index, sizes, seq_prob, max_completion_length,
                       optional.get("rewards"))
    return _Batch(
        learner_logps=learner_logps, sampler_logps=lq_in, mask_in=mask.detach(), dtype=dtype,
        lengths=lengths, num_tokens=num_tokens, stats=stats, group_index=index, group_sizes=sizes,
        sum_lp=sum_lp, sum_lq=sum_lq, seq_lp=sum_lp / lengths if seq_prob == "geo_mean" else sum_lp,
        kl_rows=kl_rows, kl_metric=kl_total / num_tokens, seq_prob=seq_prob,
        sequence_weights=optional.get("sequence_weights"),
    )


def _check_swept_values(values: list[float], n_max: int, batch: int, lengths: Tensor, learner_logps: Tensor,
                        sampler_logps: Tensor, optional: list[str]) -> tuple[list[float], float]:
    """Validate the one transfer _prepare made (block maxima, L_i, A_i, the optional per-sequence inputs,
    sum of k3): a ValueError naming the argument that is wrong. Returns the L_i and the k3 total."""
    lp_max, lq_max = max(values[0:n_max:2]), max(values[1:n_max:2])  # max() would skip a NaN: checked below
    columns = [values[n_max + k * batch : n_max + (k + 1) * batch] for k in range(2 + len(optional))]
    length_list, adv_list, kl_total = columns[0], columns[1], values[-1]
    if any(x % 1 for x in length_list):  # a 0/1 mask has whole row sums; values are not checked one by one (cost)
        raise ValueError("mask must contain only 0 and 1 (a row sums to a fraction)")
    if min(length_list) < 1:
        rows = torch.nonzero(lengths < 1).flatten().tolist()
        raise ValueError(f"mask: sequences {rows[:10]} have no completion tokens (every sequence needs L_i >= 1)")
    if not all(map(math.isfinite, values[:n_max] + [kl_total])):  # NaN/inf anywhere reaches these
        for name, values_in in (("learner_logps", learner_logps.detach()), ("sampler_logps", sampler_logps)):
            if not bool(torch.isfinite(values_in).all()):
                what = "NaN" if bool(torch.isnan(values_in).any()) else "inf"
                raise ValueError(f"{name} contains {what}; every entry, padding included, must be finite")
        raise ValueError("learner_logps or sampler_logps: values so large in magnitude that their sums overflow")
    for name, largest in (("learner_logps", lp_max), ("sampler_logps", lq_max)):
        if largest > 0:
            raise ValueError(f"{name} has positive log-probabilities at completion tokens; log-probs must be <= 0")
    if not all(map(math.isfinite, adv_list)):
        raise ValueError("advantages contains NaN or inf")
    for name, listed in zip(optional, columns[2:]):
        if not all(map(math.isfinite, listed)):
            raise ValueError(f"{name} contains NaN or inf")
        if name == "sequence_weights" and min(listed) < 0:
            raise ValueError("sequence_weights must be >= 0")
    return length_list, kl_total


def _per_sequence_input(name: str, value: Tensor, batch: int, dtype: torch.dtype) -> Tensor:
    """A [B] floating-point input (rewards, sequence_weights) in the compute dtype; values checked by the caller."""
    _check_tensor(name, value)
    if tuple(value.shape) != (batch,) or not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor of shape [{batch}], got {value.dtype} "
                         f"{tuple(value.shape)}")
    return value.detach().to(dtype)


# --------------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class LossTerms:
    """What one loss function returns; compute_policy_loss does the rest.

    objective = sum_i s_i · per_sequence[i] / normaliser, with s_i the sequence weights.
    ``weights`` and ``clipped`` are detached and only feed the metrics: a [B, T] tensor
    is read at completion tokens, a [B] tensor per sequence.
    """

    per_sequence: Tensor  # [B] each sequence's share of the objective (before sequence weights)
    normaliser: float
    weights: Tensor  # importance weights before clipping, [B, T] or [B]
    seq_weights: Tensor  # [B] one importance weight per sequence (for the q̂-weighted variance)
    clipped: Tensor  # bool, [B, T] or [B]: where the clip or truncation was active


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO's min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), and where the clip took over.

    The clipped branch is the smaller one exactly when r > 1+eps_high with A > 0 or
    r < 1-eps_low with A < 0: there the gradient is zero.
    """
    unclipped = ratio * adv
    clipped_branch = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    clipped = (clipped_branch < unclipped).detach()
    return torch.where(clipped, clipped_branch, unclipped), clipped  # = the elementwise min


def _token_ratio(b: _Batch, detach: bool = False) -> Tensor:
    """r_t = exp(lp - lq), [B, T], for the token-level losses."""
    lp = b.lp.detach() if detach else b.lp
    return _capped_exp(lp - b.lq)


def _mean_token_ratio(b: _Batch, ratio: Tensor) -> Tensor:
    return (ratio * b.mask).sum(-1) / b.lengths


def _token_surrogate(b: _Batch, adv: Tensor, eps_low: float, eps_high: float) -> LossTerms:
    """Token-level clipped surrogate shared by grpo, dr_grpo and bnpo: per_sequence = sum_t m·obj_t
    (each caller sets its own per-sequence scaling and normaliser)."""
    ratio = _token_ratio(b)
    objective, clipped = _clipped_surrogate(ratio, adv[:, None], eps_low, eps_high)
    ratio = ratio.detach()
    return LossTerms((objective * b.mask).sum(-1), 1.0, ratio, _mean_token_ratio(b, ratio), clipped)


def _grpo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """GRPO (DeepSeekMath): token-clipped surrogate, mean over each sequence's tokens, mean over sequences."""
    terms = _token_surrogate(b, b.advantages, eps_low, eps_high)
    return replace(terms, per_sequence=terms.per_sequence / b.lengths, normaliser=float(b.stats.num_sequences))


def _dr_grpo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """Dr. GRPO: token-clipped surrogate summed over all tokens / (B · max_completion_length)."""
    max_len = b.stats.max_completion_length
    if max_len is None:
        raise ValueError("max_completion_length is required for dr_grpo (its normaliser is B · max_completion_length)")
    longest = int(b.lengths.max())
    if longest > max_len:
        raise ValueError(f"max_completion_length={max_len} is shorter than a sequence "
                         f"in the batch ({longest} completion tokens)")
    terms = _token_surrogate(b, b.advantages, eps_low, eps_high)
    return replace(terms, normaliser=float(b.stats.num_sequences * max_len))


def _beta_parameters(success_rates: Tensor) -> tuple[float, float]:
    """BNPO's (alpha, beta): method-of-moments Beta(a, b) fit to the groups' success rates,
    then alpha = max(1 + a/3, 1), beta = max(1 + b/3, 1). Fewer than two groups, or no
    spread between them, gives the uniform density (1, 1)."""
    if success_rates.numel() < 2:
        return 1.0, 1.0
    mu = float(success_rates.mean())
    var = float(success_rates.var())  # unbiased, over groups
    if var <= 0.0:
        return 1.0, 1.0
    common = mu * (1 - mu) / var - 1
    return max(1 + common * mu / 3, 1.0), max(1 + common * (1 - mu) / 3, 1.0)


def bnpo_advantage_scale(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """BNPO's per-sequence factor 1 / f_Beta(p_g; alpha, beta), capped at 1e6, [B] -> [B].

    p_g is the mean reward of the sequence's group (its success rate; rewards must lie
    in [0, 1]); alpha, beta come from _beta_parameters over the batch's groups.
    """
    _check_tensor("rewards", rewards)
    index, sizes = _group_index(group_ids, rewards.shape[0])
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    rewards = _per_sequence_input("rewards", rewards, rewards.shape[0], dtype)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains NaN or inf")
    return _bnpo_scale(rewards, index, sizes)


def _bnpo_scale(rewards: Tensor, index: Tensor, sizes: Tensor) -> Tensor:
    if bool(((rewards < 0) | (rewards > 1)).any()):
        raise ValueError("rewards must lie in [0, 1] for bnpo (the group mean is a success probability)")
    p = (_group_sum(rewards, index, len(sizes)) / sizes.to(rewards.dtype)).clamp(0.0, 1.0)  # clamp: rounding
    alpha, beta = _beta_parameters(p)
    log_norm = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
    log_density = torch.xlogy(alpha - 1, p) + torch.xlogy(beta - 1, 1 - p) - log_norm
    return torch.exp(-log_density).clamp(max=BNPO_MAX_SCALE)[index]


def _bnpo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """BNPO: token-clipped surrogate with A_i / f_Beta(p_g) (the division is in BatchStats),
    token mean over the whole batch."""
    return replace(_token_surrogate(b, b.advantages, eps_low, eps_high), normaliser=b.stats.num_tokens)


def _sequence_surrogate(log_weight: Tensor, b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """Sequence-level clipped surrogate, mean over sequences (gspo, gepo)."""
    weight = _capped_exp(log_weight)
    objective, clipped = _clipped_surrogate(weight, b.advantages, eps_low, eps_high)
    weight = weight.detach()
    return LossTerms(objective, float(b.stats.num_sequences), weight, weight, clipped)


def _gspo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """GSPO: s_i = p̄_i / q̄_i, clipped surrogate per sequence."""
    return _sequence_surrogate(b.seq_lp - b.seq_lq, b, eps_low, eps_high)


def _gepo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """GEPO: w_i = p̄_i / Ê_q[q], Ê over the sequence's own prompt group, clipped surrogate."""
    if b.stats.smallest_group < 2:
        singles = "" if b.group_sizes is None else f"; {int((b.group_sizes < 2).sum())} group(s) have 1"
        raise ValueError("group_ids: gepo needs at least 2 sequences per prompt group (its weight is an "
                         f"expectation over the group){singles}")
    return _sequence_surrogate(b.seq_lp - b.log_expectation, b, eps_low, eps_high)


def _gmpo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """GMPO: A_i · exp(aggregate_t l_t), with l_t the token log-ratio clipped to [-eps_low, eps_high]
    on the side the sign of A_i makes pessimistic (min for A >= 0, max for A < 0)."""
    log_ratio = b.lp - b.lq
    bounded = log_ratio.clamp(-eps_low, eps_high)
    positive = (b.advantages >= 0)[:, None]
    clipped_log = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    weight = _capped_exp(b.per_sequence(clipped_log))
    seq_ratio = _capped_exp(b.seq_lp - b.seq_lq).detach()
    clipped = (clipped_log != log_ratio).detach()
    return LossTerms(b.advantages * weight, float(b.stats.num_sequences), seq_ratio, seq_ratio, clipped)


def _cispo(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """CISPO (MiniMax-M1): sg(clip(r_t, 1-eps_low, 1+eps_high)) · A_i · lp_t, token mean over the batch."""
    ratio = _token_ratio(b, detach=True)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_sequence = (weight * b.lp * b.mask).sum(-1) * b.advantages
    clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    return LossTerms(per_sequence, b.stats.num_tokens, ratio, _mean_token_ratio(b, ratio), clipped)


def _topr(b: _Batch, eps_low: float, eps_high: float) -> LossTerms:
    """TOPR: A_i · c_i · log p_i with c_i = 1 for A_i >= 0, sg(clip(p_i/q_i, 1-eps_low, 1+eps_high))
    (default [0, 1]) for A_i < 0; mean over sequences."""
    ratio = _capped_exp(b.seq_lp - b.seq_lq).detach()
    negative = b.advantages < 0
    taper = torch.where(negative, ratio.clamp(1 - eps_low, 1 + eps_high), torch.ones_like(ratio))
    clipped = negative & ((ratio < 1 - eps_low) | (ratio > 1 + eps_high))
    return LossTerms(b.advantages * taper * b.seq_lp, float(b.stats.num_sequences), ratio, ratio, clipped)


LossFn = Callable[[_Batch, float, float], LossTerms]

_LOSSES: dict[str, LossFn] = {
    "gepo": _gepo,
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "bnpo": _bnpo,
    "gspo": _gspo,
    "gmpo": _gmpo,
    "cispo": _cispo,
    "topr": _topr,
}


def validate_loss_type(loss_type: str) -> str:
    """Return ``loss_type`` if it names a loss, else raise ValueError listing the valid names."""
    if loss_type not in _LOSSES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    return loss_type


def resolve_epsilons(loss_type: str, epsilon_low: float | None = None,
                     epsilon_high: float | None = None) -> tuple[float, float]:
    """The (epsilon_low, epsilon_high) a loss will use: given values, else DEFAULT_EPSILONS."""
    default_low, default_high = DEFAULT_EPSILONS[validate_loss_type(loss_type)]
    low = default_low if epsilon_low is None else epsilon_low
    high = default_high if epsilon_high is None else epsilon_high
    return _non_negative("epsilon_low", low), _non_negative("epsilon_high", high)


def _non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------- entry point


def compute_policy_loss(
    loss_type: str,
    learner_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    advantages: Tensor,
    group_ids: Tensor,
    *,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    seq_prob: SeqProb = "geo_mean",
    max_completion_length: int | None = None,
    kl_coef: float = 0.0,
    sequence_weights: Tensor | None = None,
    rewards: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss to minimise for one batch of whole prompt groups, and its metrics.

    Args:
        loss_type: one of LOSS_TYPES.
        learner_logps: [B, T] log-probs of the sampled tokens under the trained params.
        sampler_logps: [B, T] the sampler's recorded log-probs of the same tokens.
        mask: [B, T] 1 for completion tokens, 0 for padding (bool, int or float).
            Every sequence needs >= 1 completion token.
        advantages: [B] one per sequence (see group_advantages).
        group_ids: [B] int; equal ids form one prompt's group (any order, any values).
        epsilon_low, epsilon_high: clip widths; None takes DEFAULT_EPSILONS[loss_type].
        seq_prob: "geo_mean" (log p̄ = sum_t m·lp / L_i) or "product" (sum_t m·lp).
        max_completion_length: required by dr_grpo, ignored by the others.
        kl_coef: weight of the learner-sampler k3 KL penalty (the reference used 0.005).
        sequence_weights: [B] >= 0 from the staleness policy; multiplies each sequence's
            contribution (policy term and KL term). None means all ones; 0 gives that
            sequence exactly zero gradient. Normalisers are not reweighted.
        rewards: [B] in [0, 1], required by bnpo, ignored by the others.

    Returns:
        (loss, metrics): a scalar tensor (float32, or float64 for float64 inputs) and plain
        floats: loss, policy_loss, kl, iw_mean, iw_max, iw_min, iw_var, iw_qhat_var,
        var_token_ratio, var_sequence_ratio, var_group_weight (see weight_family_variances),
        clip_frac, learner_seq_logp_mean, sampler_seq_logp_mean, num_tokens,
        num_sequences, num_groups.

    Raises:
        ValueError naming the argument: unknown loss_type, shape or dtype mismatch, NaN or
        inf anywhere in the log-probs, positive log-probs at completion tokens, a mask
        that is not 0/1 or leaves a sequence empty, a gepo group with one member, a
        missing max_completion_length (dr_grpo) or rewards (bnpo), bad epsilons,
        kl_coef or sequence_weights.
    """
    loss_fn = _LOSSES[validate_loss_type(loss_type)]
    eps_low, eps_high = resolve_epsilons(loss_type, epsilon_low, epsilon_high)
    kl_coef = _non_negative("kl_coef", kl_coef)
    b = _prepare(learner_logps, sampler_logps, mask, seq_prob, sequence_weights, loss_type=loss_type,
                 advantages=advantages, group_ids=group_ids, max_completion_length=max_completion_length,
                 rewards=rewards)
    terms = loss_fn(b, eps_low, eps_high)
    loss, policy_loss = _total(b, terms, kl_coef)
    return loss, _metrics(b, terms, loss, policy_loss)


def micro_batch_loss(
    loss_type: str,
    learner_logps: Tensor,
    sampler_logps: Tensor,
    mask: Tensor,
    stats: BatchStats,
    *,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    seq_prob: SeqProb = "geo_mean",
    kl_coef: float = 0.0,
    sequence_weights: Tensor | None = None,
) -> Tensor:
    """This micro-batch's share of the loss of the batch whose BatchStats are `stats`
    (`batch_stats(...).rows(these rows)`), with gradient; no metrics.

    The shares of disjoint rows add up to compute_policy_loss of the whole batch, and so
    do their gradients, whatever the split (groups may be cut). Arguments and errors as
    for compute_policy_loss; `seq_prob` must be the one `stats` were computed with.
    """
    loss_fn = _LOSSES[validate_loss_type(loss_type)]
    eps_low, eps_high = resolve_epsilons(loss_type, epsilon_low, epsilon_high)
    kl_coef = _non_negative("kl_coef", kl_coef)
    b = _prepare(learner_logps, sampler_logps, mask, seq_prob, sequence_weights, stats=stats)
    return _total(b, loss_fn(b, eps_low, eps_high), kl_coef)[0]


def _total(b: _Batch, terms: LossTerms, kl_coef: float) -> tuple[Tensor, Tensor]:
    """(loss, policy loss): sequence weights applied, normalised, the k3 KL penalty added."""
    weights = b.sequence_weights
    per_sequence = terms.per_sequence if weights is None else terms.per_sequence * weights
    policy_loss = per_sequence.sum() * (-1.0 / terms.normaliser)  # minus the objective
    loss = policy_loss
    if kl_coef > 0:
        weighted = b.kl_rows if weights is None else b.kl_rows * weights
        loss = loss + kl_coef * (weighted.sum() / b.stats.num_tokens)
    return loss, policy_loss


@torch.no_grad()
def _metrics(b: _Batch, terms: LossTerms, loss: Tensor, policy_loss: Tensor) -> dict[str, float]:
    """Plain-float metrics (one device sync). Importance-weight statistics are over
    completion tokens for token-level weights and over sequences otherwise; variances
    divide by n."""
    if terms.weights.dim() == 2:
        iw_mean, iw_max, iw_min, iw_var = _masked_stats(terms.weights, b)
    else:
        iw_var, iw_mean = torch.var_mean(terms.weights, correction=0)
        iw_min, iw_max = torch.aminmax(terms.weights)
    clipped = terms.clipped.to(b.dtype)
    clip_frac = (clipped * b.mask).sum() / b.num_tokens if clipped.dim() == 2 else clipped.mean()
    names = ("loss", "policy_loss", "iw_mean", "iw_max", "iw_min", "iw_var", "iw_qhat_var", "clip_frac",
             "learner_seq_logp_mean", "sampler_seq_logp_mean")
    values = torch.stack([
        loss, policy_loss, iw_mean, iw_max, iw_min, iw_var, _qhat_weighted_variance(terms.seq_weights, b),
        clip_frac, b.seq_lp.detach().mean(), b.seq_lq.mean(),
    ]).tolist()
    metrics = dict(zip(names, values))
    metrics.update(weight_family_variances(b))
    metrics.update(kl=b.kl_metric, num_tokens=b.num_tokens, num_sequences=float(b.batch_size),
                   num_groups=float(b.n_groups))
    return metrics


@torch.no_grad()
def weight_family_variances(b: _Batch) -> dict[str, float]:
    """The variance of each family of importance weights on the same batch, whatever the loss
    (Theorem 1 of the GEPO paper, like for like):

    - var_token_ratio: r_t = p_t / q_t over completion tokens (GRPO's weight);
    - var_sequence_ratio: s_i = p̄_i / q̄_i over sequences (GSPO's);
    - var_group_weight: w_i = p̄_i / Ê_q[q] over sequences, Ê over the prompt group (GEPO's).

    Unclipped, capped like the losses' weights; variances divide by n. A batch of single
    sequences has no group expectation: var_group_weight is then NaN."""
    token = _masked_stats(_capped_exp(b.lp.detach() - b.lq), b)[3]
    sequence = torch.var(_capped_exp(b.seq_lp.detach() - b.seq_lq), correction=0)
    group = torch.var(_capped_exp(b.seq_lp.detach() - b.log_expectation), correction=0)
    values = torch.stack([token, sequence, group]).tolist()
    if b.stats.smallest_group < 2:
        values[2] = math.nan
    return dict(zip(("var_token_ratio", "var_sequence_ratio", "var_group_weight"), values))


def _masked_stats(x: Tensor, b: _Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mean, max, min, variance) of a [B, T] tensor over completion tokens only."""
    m = b.mask
    completion = m > 0
    mean = (x * m).sum() / b.num_tokens
    var = ((x - mean) ** 2 * m).sum() / b.num_tokens
    return mean, x.masked_fill(~completion, -math.inf).amax(), x.masked_fill(~completion, math.inf).amin(), var


def _qhat_weighted_variance(seq_weights: Tensor, b: _Batch) -> Tensor:
    """Mean over groups of sum_j q̂_j (v_j - sum_k q̂_k v_k)², q̂_j = q̄_j / sum_{k in group} q̄_k."""
    qhat = torch.exp(b.log_qhat)
    group_mean = _group_sum(qhat * seq_weights, b.group_index, b.n_groups)
    spread = qhat * (seq_weights - group_mean[b.group_index]) ** 2
    return _group_sum(spread, b.group_index, b.n_groups).mean()
