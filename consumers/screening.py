"""The learner's checks of a group's content before it may enter a batch.

`GroupScreen.check` runs on every group the admission kept (docs/security.md):

- **rewards**: the learner finds the problem the group names, checks the prompt tokens are
  that problem's, scores every completion with the task's verifier and puts its own rewards
  in the group; claimed rewards that differ are a failure (`reward_mismatch`).
- **log-probs**: for a group of staleness 0 the learner's own weights are the version the
  group claims, so it recomputes the per-token log-probs and compares
  (`pipeline.trust.logprob_gap` against `security.logprob_threshold`). A stale group is
  re-scored with the checkpoint of the version it claims: every one while its key is on
  probation (its first `security.probation_groups` checked groups), then a share
  `security.stale_logprob_check_fraction` drawn from a secret random stream. A version
  already pruned from S3 cannot be checked: on probation the group is then not used
  (`unverifiable`, no strike), afterwards it is used unchecked (counted).

Failures are handed back; the learner strikes the key and withdraws the group.
"""

from __future__ import annotations

import copy
import logging
import random
import shutil
import statistics
from collections import OrderedDict, Counter
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.checkpoints import CheckpointNotFound, CheckpointStore, CorruptCheckpointError
from pipeline.weights.policy import fetch_policy
from pipeline.config import SecurityConfig
from pipeline.models import completion_logprobs, decode_completion, load_policy
from pipeline.rollout import Rollout
from pipeline.trust import logprob_gap

log = logging.getLogger(__name__)

UNVERIFIABLE = "unverifiable"
"""A failure that proves nothing against the sampler: the group is not used, but no strike."""


class PastPolicies:
    """The policies stale groups are re-scored with: the newest `capacity` kept in memory, each
    either handed over by the learner as it publishes it (`remember`) or downloaded from S3 and
    verified like a sampler's (`get`, for a version made before a restart)."""

    def __init__(self, store: CheckpointStore, work_dir: Path, capacity: int = 3, dtype: torch.dtype = torch.float32):
        """`dtype`: the learner's precision, so a stale group's statistic is computed as a fresh one's."""
        self.store, self.work_dir, self.capacity, self.dtype = store, work_dir, capacity, dtype
        self.models: "OrderedDict[int, torch.nn.Module]" = OrderedDict()

    def remember(self, version: int, model_dir: Path, module: Optional[torch.nn.Module] = None) -> None:
        """Keep the learner's own weights of `version` (a copy of `module`, the learner's model,
        else read from `model_dir`, where it just saved them), so its stale groups are re-scored
        without downloading what the learner made itself."""
        if module is not None:
            model = copy.deepcopy(module).to(self.dtype)
        else:
            model, _ = load_policy(model_dir, dtype=self.dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        self._keep(version, model.eval())

    def _keep(self, version: int, model: torch.nn.Module) -> None:
        self.models[version] = model
        self.models.move_to_end(version)
        while len(self.models) > self.capacity:
            self.models.popitem(last=False)

    def get(self, version: int) -> Optional[torch.nn.Module]:
        """The policy of `version` (kept, or downloaded and verified), or None if it is no longer in S3."""
        if version in self.models:
            self.models.move_to_end(version)
            return self.models[version]
        target = self.work_dir / f"check-v{version}"
        try:
            model_dir, _, _ = fetch_policy(self.store, self.store.manifest_key(version), target, expect_version=version)
        except CheckpointNotFound:
            return None
        except CorruptCheckpointError as e:  # altered in S3 since the learner published it
            log.error("cannot re-score groups of v%d: %s", version, e)
            return None
        try:
            model, _ = load_policy(model_dir, dtype=self.dtype)
        finally:
            shutil.rmtree(target, ignore_errors=True)
        self._keep(version, model.eval())
        return model


class GroupScreen:
    """Re-scores rewards and checks log-probs of one group at a time."""

    def __init__(self, security: SecurityConfig, task, tokenizer, temperature: float,
                 current_policy: Callable[[], Optional[torch.nn.Module]], past: Optional[PastPolicies]):
        """`current_policy`: the learner's weights now (None where they cannot be run on this
        rank alone: ZeRO-3 over several ranks)."""
        self.security, self.task, self.tokenizer, self.temperature = security, task, tokenizer, temperature
        self.current_policy, self.past = current_policy, past
        self.draw = random.Random()  # seeded from the OS: samplers cannot predict which groups are checked
        self.checked: Counter = Counter()
        """Key id (sampler id if unsigned) -> its groups whose log-probs were checked (probation)."""
        self.gaps: dict[str, list[float]] = {}
        """Sampler id -> the log-prob statistic of each of its checked groups (calibration data)."""
        self.counts: Counter = Counter()

    def check(self, rollout: Rollout, staleness: int) -> list[tuple[str, str]]:
        """(kind, detail) of each failed check; the group's rewards are the learner's afterwards."""
        failures = []
        if self.security.rescore_rewards:
            failures += self._rescore(rollout)
        if not failures:
            failures += self._logprobs(rollout, staleness)
        return failures

    def _rescore(self, rollout: Rollout) -> list[tuple[str, str]]:
        try:
            problem = self.task.train_problem_by_id(rollout.prompt_id)
        except (KeyError, ValueError):
            return [("unknown_prompt", f"no train problem {rollout.prompt_id!r}")]
        if list(self.task.encode_prompt(problem, self.tokenizer)) != list(rollout.prompt_ids):
            return [("prompt_mismatch", f"prompt tokens are not those of {rollout.prompt_id}")]
        ours = [float(self.task.reward(problem, decode_completion(self.tokenizer, c))) for c in rollout.completion_ids]
        self.counts["rewards_rescored"] += 1
        claimed, rollout.rewards = rollout.rewards, ours
        wrong = sum(abs(a - b) > 1e-6 for a, b in zip(claimed, ours))
        if wrong:
            return [("reward_mismatch", f"{wrong} of {len(ours)} claimed rewards differ from the verifier's")]
        return []

    def _logprobs(self, rollout: Rollout, staleness: int) -> list[tuple[str, str]]:
        if not self.security.check_logprobs:
            return []
        who = rollout.key_id or rollout.sampler_id
        on_probation = self.checked[who] < self.security.probation_groups
        model = self._model_for(rollout, staleness, on_probation)
        if model is None:
            if on_probation:
                self.counts["refused_unverifiable_on_probation"] += 1
                return [(UNVERIFIABLE, f"v{rollout.policy_version} cannot be checked and the key is on probation")]
            return []
        self.checked[who] += 1
        gap = self._gap(rollout, model)
        self.gaps.setdefault(rollout.sampler_id, []).append(gap)
        self.counts["logprobs_checked_fresh" if staleness == 0 else "logprobs_checked_stale"] += 1
        if gap > self.security.logprob_threshold:
            return [("logprob_mismatch", f"median exp(|Δ|)-1 = {gap:.3g} > {self.security.logprob_threshold:g} "
                                         f"at v{rollout.policy_version}")]
        return []

    def _gap(self, rollout: Rollout, model: torch.nn.Module) -> float:
        """The log-prob statistic of `rollout` against `model`'s own log-probs."""
        with torch.no_grad():
            logps, mask = completion_logprobs(model, [rollout.prompt_ids] * rollout.group_size,
                                              rollout.completion_ids, self.temperature)
        ours = [row[: int(m.sum())].double().tolist() for row, m in zip(logps, mask)]
        return logprob_gap(rollout.sampler_logps, ours)

    def _model_for(self, rollout: Rollout, staleness: int, on_probation: bool) -> Optional[torch.nn.Module]:
        if staleness == 0:
            model = self.current_policy()
            if model is None:
                self.counts["logprobs_unchecked_zero3"] += 1
            return model
        drawn = on_probation or self.draw.random() < self.security.stale_logprob_check_fraction
        if self.past is None or not drawn:
            return None
        model = self.past.get(rollout.policy_version)
        if model is None:
            self.counts["logprobs_unchecked_pruned"] += 1
        return model

    def remember(self, version: int, model_dir: Path, module: Optional[torch.nn.Module] = None) -> None:
        """The learner published `version` from `model_dir` (its weights are `module`'s, where this
        rank holds them whole): keep it for re-scoring stale groups."""
        if self.past is not None and self.security.check_logprobs:
            self.past.remember(version, model_dir, module)

    def summary(self) -> dict:
        """The counts, and per sampler the distribution of its checked groups' statistic (the
        calibration data of `security.logprob_threshold`, docs/security.md): n, quantiles, max
        and how many were over the threshold."""
        per_sampler = {}
        for sampler_id, values in sorted(self.gaps.items()):
            gaps = sorted(values)

            def quantile(q: float) -> float:
                return gaps[min(len(gaps) - 1, int(q * len(gaps)))]

            per_sampler[sampler_id] = {"groups": len(gaps), "min": gaps[0], "p10": quantile(0.10),
                                       "median": statistics.median(gaps), "p90": quantile(0.90),
                                       "p99": quantile(0.99), "max": gaps[-1],
                                       "over_threshold": sum(g > self.security.logprob_threshold for g in gaps)}
        return {**self.counts, "logprob_gap_by_sampler": per_sampler}
