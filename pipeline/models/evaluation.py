"""Held-out accuracy of a policy: sampled at the training temperature, and greedy."""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from pipeline.models.policy import decode_completion, eos_ids
from pipeline.models.decoding import greedy_completions, sample_groups
from pipeline.tasks import Problem, Task

__all__ = ["evaluate_policy"]


@torch.no_grad()
def evaluate_policy(
    model,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    n_samples: int,
    temperature: float,
    greedy: bool = True,
    max_new_tokens: int,
    seed: int,
    top_p: float = 1.0,
    top_k: int = 0,
    progress: Callable[[float], None] | None = None,
) -> dict[str, float]:
    """Held-out accuracy, batched.

    ``accuracy_sampled``: mean reward over ``n_samples`` samples per problem at
    ``temperature`` (the training temperature); ``accuracy_greedy``: mean reward of the
    argmax completion (only when ``greedy``; otherwise NaN). Also reports the mean
    sampled completion length and the fraction truncated without EOS. `progress`, if given,
    is told the completions decoded as they are (len(problems) * (n_samples + greedy) in all).
    """
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        prompts = [task.encode_prompt(p, tokenizer) for p in problems]
        eos = eos_ids(model, tokenizer)
        result: dict[str, float] = {"n_problems": float(len(problems)), "n_samples": float(n_samples)}
        if n_samples > 0:
            groups = sample_groups(
                model,
                tokenizer,
                prompts,
                group_size=n_samples,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=max_new_tokens,
                seed=seed,
                progress=progress,
            )
            rewards, lengths, truncated = [], [], []
            for prob, g in zip(problems, groups):
                for c in g.completion_ids:
                    rewards.append(task.reward(prob, decode_completion(tokenizer, c, eos)))
                    lengths.append(len(c))
                    truncated.append(not c or c[-1] not in eos)
            result["accuracy_sampled"] = sum(rewards) / len(rewards)
            result["mean_completion_tokens"] = sum(lengths) / len(lengths)
            result["truncated_fraction"] = sum(truncated) / len(truncated)
        else:
            result["accuracy_sampled"] = math.nan
        if greedy:
            comps = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, progress=progress)
            result["accuracy_greedy"] = sum(
                task.reward(p, decode_completion(tokenizer, c, eos)) for p, c in zip(problems, comps)
            ) / max(1, len(problems))
        else:
            result["accuracy_greedy"] = math.nan
        result["eval_seconds"] = time.perf_counter() - t0
        return result
    finally:
        model.train(was_training)
