"""From whole prompt groups to one policy loss: the learner's update, without the loop.

The learner, the replay tool and the synchronous baseline of `bench/async_vs_sync.py`
all build their loss here, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config import LearnerConfig
from pipeline.losses import compute_policy_loss, group_advantages
from pipeline.model import completion_logprobs
from pipeline.rollout import Rollout


@dataclass
class GroupBatch:
    """Sequences of several prompt groups, flattened; group i's rows share group_ids == i."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logps: torch.Tensor  # [B, T], 0 where mask is 0
    rewards: torch.Tensor        # [B]
    group_ids: torch.Tensor      # [B] int64
    sequence_weights: torch.Tensor  # [B] staleness weight of the row's group

    @property
    def num_sequences(self) -> int:
        return len(self.completion_ids)


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
    sampler = torch.zeros(len(completion_ids), width, dtype=torch.float32)
    for row, lq in enumerate(logps):
        sampler[row, : len(lq)] = torch.tensor(lq, dtype=torch.float32)
    return GroupBatch(prompt_ids, completion_ids, sampler, torch.tensor(rewards, dtype=torch.float32),
                      torch.tensor(group_ids, dtype=torch.long), torch.tensor(seq_w, dtype=torch.float32))


def policy_loss(model, batch: GroupBatch, cfg: LearnerConfig, *, temperature: float,
                max_completion_length: int) -> tuple[torch.Tensor, dict]:
    """The configured loss of `model` on `batch` (graph attached), and its metrics."""
    advantages = group_advantages(batch.rewards, batch.group_ids, scale_by_std=cfg.scale_adv_by_std)
    learner_logps, mask = completion_logprobs(model, batch.prompt_ids, batch.completion_ids, temperature)
    sampler_logps = batch.sampler_logps[:, : learner_logps.shape[1]]
    loss, metrics = compute_policy_loss(
        cfg.loss_type, learner_logps, sampler_logps, mask.to(learner_logps.dtype), advantages, batch.group_ids,
        epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, seq_prob=cfg.seq_prob,
        max_completion_length=max_completion_length, kl_coef=cfg.kl_coef,
        sequence_weights=batch.sequence_weights, rewards=batch.rewards)
    metrics = dict(metrics)
    metrics["reward_mean"] = float(batch.rewards.mean())
    metrics["sequences"] = batch.num_sequences
    metrics["completion_tokens"] = float(mask.sum())
    return loss, metrics


def optimizer_step(engine, groups: list[Rollout], weights: list[float], cfg: LearnerConfig, *,
                   temperature: float, max_completion_length: int) -> dict:
    """One loss, one backward, one DeepSpeed step on whole groups; returns the step's metrics.

    The learner and `heterorl replay` both step through here: with the same weights,
    optimizer state and batches they produce the same parameters.
    """
    loss, metrics = policy_loss(engine.module, collate_groups(groups, weights), cfg,
                                temperature=temperature, max_completion_length=max_completion_length)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    engine.backward(loss)
    engine.step()
    return {"loss": loss.item(), **metrics, "lr": engine.get_lr()[0]}
