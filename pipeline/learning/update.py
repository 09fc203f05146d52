"""From whole prompt groups to one optimizer step: the learner's update, without the loop.

The learner (every rank of it), the replay tool and the synchronous baseline of
`bench/async_vs_sync.py` all step through `optimizer_step`, so they cannot drift apart.

One step, top to bottom:
  1. collate the groups and compute every batch-level quantity once, over the whole
     batch (`pipeline.learning.losses.batch_stats`: advantages, GEPO's group expectations, BNPO's
     Beta scaling, the normalisers);
  2. this rank's share of the sequences, balanced by tokens (`rank_share`), split into
     micro-batches of at most `learner.micro_batch_tokens` padded tokens
     (`micro_batches`);
  3. per micro-batch: log-probs (`pipeline.models.completion_logprobs`, chunked over the
     vocabulary), its share of the loss, backward (gradients accumulate);
  4. with a `FreshCheck`: the sampler log-probs of the groups sampled by these very weights
     (staleness 0) compared with the log-probs the forward passes just computed, so the
     learner's check of fresh groups costs no pass of its own; if one fails, every gradient
     of the step is discarded and `StepRefused` says which groups failed (no update is made);
  5. one DeepSpeed step (gradients all-reduced across ranks first);
  6. the step's metrics from all its log-probs together, exactly as one-shot.
Because each share uses the whole batch's statistics, the accumulated gradient is the
gradient of the one-shot loss, whatever the split (tests/unit/test_losses.py,
tests/unit/test_update.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import LearnerConfig
from pipeline.learning.engine import Ranks, begin_micro_batch, discard_gradients, round_half_weights
from pipeline.learning.losses import batch_stats, compute_policy_loss, group_advantages, micro_batch_loss
from pipeline.models import completion_logprobs, logits_chunk_tokens
from pipeline.wire.rollout import Rollout
from pipeline.trust import logprob_gap


@dataclass(frozen=True)
class FreshCheck:
    """Groups of a step's batch whose log-probs are checked against the step's own forward
    passes: they claim the version being trained (staleness 0), so those passes compute exactly
    what the learner's check would (docs/security.md)."""

    groups: tuple[int, ...]
    """Indices into the step's groups."""
    threshold: float
    """`security.logprob_threshold`: a group fails when its `logprob_gap` exceeds it."""


class StepRefused(Exception):
    """A fresh group failed its log-prob check: the step's gradients were discarded, no update made."""

    def __init__(self, failed: dict[int, float], gaps: dict[int, float]):
        self.failed, self.gaps = failed, gaps
        """Group index -> its statistic: those over the threshold, and every checked one."""
        super().__init__(f"{len(failed)} group(s) failed the log-prob check: " +
                         ", ".join(f"#{i} {gap:.3g}" for i, gap in sorted(failed.items())))


@dataclass
class GroupBatch:
    """Sequences of several prompt groups, flattened; group i's rows share group_ids == i."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logps: torch.Tensor  # [B, T], 0 where mask is 0
    mask: torch.Tensor           # [B, T] 1 at completion tokens
    rewards: torch.Tensor        # [B]
    group_ids: torch.Tensor      # [B] int64
    sequence_weights: torch.Tensor  # [B] staleness weight of the row's group

    @property
    def num_sequences(self) -> int:
        return len(self.completion_ids)

    def tokens(self, row: int) -> int:
        """Input positions the row takes in a forward pass (prompt + completion)."""
        return len(self.prompt_ids[row]) + len(self.completion_ids[row])

    def to(self, device: torch.device) -> "GroupBatch":
        return GroupBatch(self.prompt_ids, self.completion_ids, self.sampler_logps.to(device), self.mask.to(device),
                          self.rewards.to(device), self.group_ids.to(device), self.sequence_weights.to(device))


def collate_groups(groups: list[Rollout], weights: list[float]) -> GroupBatch:
    if len(groups) != len(weights):
        raise ValueError(f"{len(groups)} groups but {len(weights)} weights")
    prompt_ids, completion_ids, logps, rewards, group_ids, seq_w = [], [], [], [], [], []
    for gi, (group, weight) in enumerate(zip(groups, weights)):
        for completion, lq, reward in zip(group.completion_ids, group.sampler_logps, group.rewards):
            prompt_ids.append(group.prompt_ids)
            completion_ids.append(completion)
            logps.append(lq)
            rewards.append(reward)
            group_ids.append(gi)
            seq_w.append(weight)
    width = max(1, max(len(c) for c in completion_ids))
    sampler = torch.tensor([list(lq) + [0.0] * (width - len(lq)) for lq in logps], dtype=torch.float32)
    mask = torch.tensor([[1.0] * len(lq) + [0.0] * (width - len(lq)) for lq in logps], dtype=torch.float32)
    return GroupBatch(prompt_ids, completion_ids, sampler, mask, torch.tensor(rewards, dtype=torch.float32),
                      torch.tensor(group_ids, dtype=torch.long), torch.tensor(seq_w, dtype=torch.float32))


def rank_share(tokens: list[int], ranks: Ranks) -> list[int]:
    """The rows this rank trains on: longest first, each to the rank with the fewest tokens
    so far (ties to the lowest rank), so every rank does about the same work."""
    load = [0] * ranks.world_size
    mine = []
    for row in sorted(range(len(tokens)), key=lambda r: (-tokens[r], r)):
        rank = min(range(ranks.world_size), key=lambda k: (load[k], k))
        load[rank] += tokens[row]
        if rank == ranks.rank:
            mine.append(row)
    return mine


def micro_batches(rows: list[int], tokens: list[int], budget: int) -> list[list[int]]:
    """`rows` (longest first) packed into micro-batches of at most `budget` padded tokens,
    rows × longest row, with at least one row each."""
    batches: list[list[int]] = []
    for row in sorted(rows, key=lambda r: (-tokens[r], r)):
        if batches and (len(batches[-1]) + 1) * tokens[batches[-1][0]] <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def _lockstep(engine, batch: GroupBatch, batches: list[list[int]], ranks: Ranks) -> list[tuple[list[int], int]]:
    """(rows, LM-head chunks) of each micro-batch, the same number of each on every rank.

    Under ZeRO-3 every forward and backward pass gathers the weights from all ranks, so the
    ranks must make as many passes, and call the LM head as often, as each other: a rank
    with fewer micro-batches gets empty ones (rows []), and the i-th micro-batch of every
    rank has as many chunks as the largest one needs.
    """
    per_token = logits_chunk_tokens(engine.module)
    chunks = [max(1, -(-sum(len(batch.completion_ids[r]) for r in rows) // per_token)) for rows in batches]
    if ranks.world_size == 1:
        return list(zip(batches, chunks))
    count = torch.tensor([len(batches)], dtype=torch.int64, device=engine.device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    most = torch.ones(int(count), dtype=torch.int64, device=engine.device)
    most[: len(chunks)] = torch.tensor(chunks, dtype=torch.int64)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    batches = batches + [[] for _ in range(int(count) - len(batches))]
    return list(zip(batches, most.tolist()))


def optimizer_step(engine, groups: list[Rollout], weights: list[float], cfg: LearnerConfig, *,
                   temperature: float, max_completion_length: int, ranks: Ranks = Ranks(),
                   fresh_check: FreshCheck | None = None, on_policy_version: int | None = None) -> dict:
    """One DeepSpeed step on whole groups; every rank calls it with the same groups (and the
    same `fresh_check`). Returns the step's metrics (the same on every rank); with a
    `fresh_check`, `metrics["fresh_gaps"]` maps each checked group to its statistic; with
    `on_policy_version` (the version the engine holds), the `token_mismatch` of the groups
    sampled by that very version, under `mismatch_*`.

    Raises StepRefused, the engine as it was before the call, when a checked group fails.
    The learner and `heterorl replay` both step through here: with the same weights,
    optimizer state and batches they produce the same parameters.
    """
    batch = collate_groups(groups, weights).to(engine.device)
    advantages = group_advantages(batch.rewards, batch.group_ids, scale_by_std=cfg.scale_adv_by_std)
    stats = batch_stats(cfg.loss_type, batch.sampler_logps, batch.mask, advantages, batch.group_ids,
                        seq_prob=cfg.seq_prob, max_completion_length=max_completion_length, rewards=batch.rewards)
    loss_args = dict(epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, seq_prob=cfg.seq_prob,
                     kl_coef=cfg.kl_coef)
    tokens = [batch.tokens(r) for r in range(batch.num_sequences)]
    learner_logps = torch.zeros_like(batch.sampler_logps)
    for rows, n_chunks in _lockstep(engine, batch, micro_batches(rank_share(tokens, ranks), tokens,
                                                                 cfg.micro_batch_tokens), ranks):
        begin_micro_batch(engine)
        dummy = not rows  # this rank has fewer micro-batches than another: a pass that adds nothing
        rows = rows or [0]
        logps, mask = completion_logprobs(engine.module, [batch.prompt_ids[r] for r in rows],
                                          [batch.completion_ids[r] for r in rows], temperature, n_chunks=n_chunks)
        index = torch.tensor(rows, device=engine.device)
        width = logps.shape[1]
        share = micro_batch_loss(cfg.loss_type, logps, batch.sampler_logps[index, :width], mask, stats.rows(index),
                                 sequence_weights=batch.sequence_weights[index], **loss_args)
        if not torch.isfinite(share):
            raise FloatingPointError(f"non-finite loss {share.item()}")
        # DeepSpeed averages gradients over the ranks; each rank's share is a part of one sum.
        engine.backward(share * (0.0 if dummy else ranks.world_size), scale_wrt_gas=False)
        if not dummy:
            learner_logps[index, :width] = logps.detach().to(learner_logps.dtype)
    if ranks.world_size > 1:  # every row was computed by exactly one rank, zeros elsewhere
        torch.distributed.all_reduce(learner_logps)
    gaps = fresh_gaps(batch, learner_logps, fresh_check)
    failed = {g: gap for g, gap in gaps.items() if gap > fresh_check.threshold} if fresh_check else {}
    if failed:  # every rank sees the same log-probs, so every rank refuses
        discard_gradients(engine)
        raise StepRefused(failed, gaps)
    engine.step()
    round_half_weights(engine)
    with torch.no_grad():
        _, metrics = compute_policy_loss(
            cfg.loss_type, learner_logps, batch.sampler_logps, batch.mask, advantages, batch.group_ids,
            max_completion_length=max_completion_length, sequence_weights=batch.sequence_weights,
            rewards=batch.rewards, **loss_args)
    if on_policy_version is not None:
        rows = torch.tensor([groups[g].policy_version == on_policy_version for g in batch.group_ids.tolist()],
                            device=batch.mask.device)
        metrics.update({f"mismatch_{k}": v for k, v in token_mismatch(
            learner_logps, batch.sampler_logps, batch.mask * rows[:, None]).items()})
    metrics["reward_mean"] = float(batch.rewards.mean())
    metrics["sequences"] = batch.num_sequences
    metrics["completion_tokens"] = float(batch.mask.sum())
    if fresh_check is not None:
        metrics["fresh_gaps"] = gaps
    return {**metrics, "lr": engine.get_lr()[0]}


MISMATCH_GAP = 0.1
"""A token whose learner and sampler log-probs differ by more than this counts in
`token_mismatch`'s share (`mismatch_share_over_0.1`)."""


def token_mismatch(learner_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the learner's log-probs of the tokens under `mask` lie from the sampler's, per token:
    the median and 99th percentile of k3 = exp(d) - d - 1 with d = sampler - learner (the
    estimator of the `kl` metric, which averages it), the share of tokens with |d| > MISMATCH_GAP,
    and how many tokens; {} when `mask` holds none. On groups sampled by the version the learner
    holds, this is the learner-sampler mismatch of the precision and kernels alone (no drift)."""
    d = (sampler_logps.double() - learner_logps.detach().double())[mask.bool()]
    if d.numel() == 0:
        return {}
    k3 = torch.expm1(d) - d
    return {"kl_median": _quantile(k3, 0.5), "kl_p99": _quantile(k3, 0.99),
            "share_over_0.1": float((d.abs() > MISMATCH_GAP).double().mean()), "tokens": float(d.numel())}


def _quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile of a 1-D tensor, interpolated between the two nearest ranks (torch.quantile's
    rule, which refuses more than 2^24 values)."""
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def fresh_gaps(batch: GroupBatch, learner_logps: torch.Tensor, check: FreshCheck | None) -> dict[int, float]:
    """`logprob_gap` of each group `check` names: its sampler log-probs against `learner_logps`."""
    if check is None or not check.groups:
        return {}
    lengths = batch.mask.sum(-1).long().tolist()
    sampler, learner = batch.sampler_logps.double().tolist(), learner_logps.double().tolist()
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        rows.setdefault(group, []).append(row)
    return {g: logprob_gap([sampler[r][: lengths[r]] for r in rows[g]], [learner[r][: lengths[r]] for r in rows[g]])
            for g in check.groups}
