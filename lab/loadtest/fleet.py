"""The modeled fleet: which hardware each simulated sampler has, and the samplers themselves.

A simulated sampler is `producers.sampler.Sampler` with two parts swapped: its engine
(`ModeledEngine`: waits the time its hardware would take, returns LLM-sized groups of
random tokens) and its rewards (drawn, since there is no text to verify). Everything
else is the product's code: prompt claims and leases in Redis, heartbeats, policy-pointer
polls, the weight download through the delta path (verified tensor by tensor), signing,
the spool and the Kafka produce. `LockstepSampler` is the synchronous baseline's sampler.
"""

from __future__ import annotations

import math
import random
import threading
from collections import Counter
from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.config import HeteroConfig
from pipeline.config.commands import GpuClassConfig, LoadtestConfig
from pipeline.models import SampledGroup
from pipeline.wire.rollout import Rollout
from producers.sampler import Sampler, SamplerParts


def assign_classes(classes: Sequence[GpuClassConfig], count: int) -> list[GpuClassConfig]:
    """The class of each of `count` samplers: every prefix of the fleet is as close to the
    shares as whole samplers allow (the first sampler is of the largest class)."""
    total = sum(c.share for c in classes)
    assigned = [0] * len(classes)
    out = []
    for k in range(count):
        deficits = [c.share / total * (k + 1) - assigned[i] for i, c in enumerate(classes)]
        pick = max(range(len(classes)), key=lambda i: (deficits[i], -i))
        assigned[pick] += 1
        out.append(classes[pick])
    return out


def lockstep_quotas(groups_per_step: int, count: int) -> list[int]:
    """Prompts each of `count` samplers generates per step in lock-step: the batch split evenly
    (the first ones take the remainder), as a synchronous trainer splits it over its workers."""
    base, extra = divmod(groups_per_step, count)
    return [base + (i < extra) for i in range(count)]


def completion_lengths(rng: np.random.Generator, count: int, lt: LoadtestConfig, max_new_tokens: int) -> np.ndarray:
    """Log-normal lengths around `completion_tokens_median`, cut to [1, max_new_tokens]."""
    lengths = lt.completion_tokens_median * np.exp(lt.completion_tokens_sigma * rng.standard_normal(count))
    return np.clip(np.rint(lengths), 1, max_new_tokens).astype(int)


class ModeledEngine:
    """A `pipeline.sampling.generation.PolicyEngine` that models one sampler's hardware: a batch takes its
    completion tokens / `tokens_per_s`; taking new weights in takes `weight_load_s`. The weights
    themselves are downloaded and verified for real before `prepare` sees them."""

    backend = "modeled"

    def __init__(self, gpu: GpuClassConfig, lt: LoadtestConfig, max_new_tokens: int, tokenizer,
                 stop: threading.Event):
        self.gpu, self.lt, self.max_new_tokens, self.tokenizer, self.stop = gpu, lt, max_new_tokens, tokenizer, stop
        self.device = torch.device("cpu")
        self.generating_s = self.loading_s = 0.0
        """Modeled seconds spent generating, and taking new weights in."""

    def prepare(self, model_dir):
        return model_dir

    def install(self, prepared) -> None:
        self.loading_s += self.gpu.weight_load_s
        self.stop.wait(self.gpu.weight_load_s)

    def sample(self, prompt_ids: Sequence[Sequence[int]], *, group_size: int, seed: int,
               pause=None) -> list[SampledGroup]:
        if pause is not None:
            pause()
        rng = np.random.default_rng(seed)
        groups, tokens = [], 0
        for _ in prompt_ids:
            prompt = rng.integers(0, self.lt.vocab_size, self.lt.prompt_tokens, dtype=np.int32).tolist()
            lengths = completion_lengths(rng, group_size, self.lt, self.max_new_tokens)
            tokens += int(lengths.sum())
            groups.append(SampledGroup(
                prompt_ids=prompt,
                completion_ids=[rng.integers(0, self.lt.vocab_size, n, dtype=np.int32).tolist() for n in lengths],
                sampler_logps=[(-rng.exponential(1.0, n)).astype(np.float32).tolist() for n in lengths]))
        self.generating_s += tokens / self.gpu.tokens_per_s
        self.stop.wait(tokens / self.gpu.tokens_per_s)  # a stop ends the wait: the batch is still handed over
        return groups

    def close(self) -> None:
        pass


class ThreadStop:
    """`Sampler.stop` for a sampler that is a thread: set by the hosting process."""

    def __init__(self, event: threading.Event):
        self.event = event

    @property
    def requested(self) -> bool:
        return self.event.is_set()


def count_commands(client, counter: Counter) -> None:
    """Count every command `client` sends (pipelined ones one by one) into `counter`, by name."""
    execute_command, make_pipeline = client.execute_command, client.pipeline

    def counted(*args, **kwargs):
        counter[str(args[0]).upper()] += 1
        return execute_command(*args, **kwargs)

    def pipeline(*args, **kwargs):
        pipe = make_pipeline(*args, **kwargs)
        run = pipe.execute

        def execute(*eargs, **ekwargs):
            counter.update(str(command[0]).upper() for command, _ in pipe.command_stack)
            return run(*eargs, **ekwargs)

        pipe.execute = execute
        return pipe

    client.execute_command, client.pipeline = counted, pipeline


class SimulatedSampler(Sampler):
    """The product's sampler on modeled hardware (`ModeledEngine`), with drawn rewards; the
    Redis commands it sends are counted (`redis_commands`)."""

    def __init__(self, cfg: HeteroConfig, sampler_id: str, gpu: GpuClassConfig, tokenizer, stop: threading.Event):
        self.redis_commands: Counter = Counter()
        super().__init__(cfg, sampler_id, SamplerParts(
            engine=ModeledEngine(gpu, cfg.loadtest, cfg.sampler.max_new_tokens, tokenizer, stop),
            stop=ThreadStop(stop), on_connect=lambda handles: count_commands(handles.state.client, self.redis_commands)))
        self.gpu, self.tokenizer, self.stop_event = gpu, tokenizer, stop
        self.reward_draws = random.Random(self.seed)

    def make_rollouts(self, problems, groups) -> list[Rollout]:
        p = self.cfg.loadtest.reward_p
        rollouts = [Rollout(prompt_id=problem.problem_id, task=self.task.name, sampler_id=self.sampler_id,
                            policy_version=self.policy.version, prompt_ids=group.prompt_ids,
                            completion_ids=group.completion_ids, sampler_logps=group.sampler_logps,
                            rewards=[float(self.reward_draws.random() < p) for _ in group.completion_ids],
                            sampling=self.sampling)
                    for problem, group in zip(problems, groups)]
        if self.signer is not None:
            for r in rollouts:
                self.stamp(r)
        return rollouts


LOCKSTEP_POLL_S = 0.05
"""How long a lock-step sampler that has made its share waits before it looks for the next version."""


class LockstepSampler(SimulatedSampler):
    """The synchronous baseline: generate this sampler's share of the step's batch with the
    newest weights, then wait until the learner published the next version and it is loaded
    (downloaded over the same link) before generating again."""

    def __init__(self, cfg: HeteroConfig, sampler_id: str, gpu: GpuClassConfig, tokenizer, stop: threading.Event,
                 quota: int):
        super().__init__(cfg.model_copy(update={"sampler": cfg.sampler.model_copy(
            update={"prompts_per_batch": max(1, quota)})}), sampler_id, gpu, tokenizer, stop)
        self.quota = quota
        self.generated_with: Optional[int] = None
        """The version whose share this sampler has generated."""

    def turn(self) -> bool:
        self.heartbeat_if_due()
        view, policy_polled = self.read_view()
        if policy_polled:
            self.refresh_weights(view)
        self.swap_weights()
        self.pump_outbox()
        self.outbox.confirm_claims(self.state, self.sampler_id)
        if self.quota == 0 or not self.policy.loaded or self.generated_with == self.policy.version:
            self.stop_event.wait(LOCKSTEP_POLL_S)
            return True
        self.generate()
        self.generated_with = self.policy.version
        return True


def expected_groups_per_s(classes: Sequence[GpuClassConfig], count: int, lt: LoadtestConfig, group_size: int) -> float:
    """What a fleet of `count` could generate if it never paused (for the report's supply column)."""
    mean_tokens = lt.completion_tokens_median * math.exp(lt.completion_tokens_sigma ** 2 / 2)
    return sum(c.tokens_per_s for c in assign_classes(classes, count)) / (mean_tokens * group_size)
