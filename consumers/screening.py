"""The learner's checks of a group's content before it may be used in a step.

`GroupScreen` works in two phases (docs/security.md):

- **when a group is admitted** (`check`): the learner finds the problem the group names,
  checks the prompt tokens are that problem's, scores every completion with the task's
  verifier and puts its own rewards in the group; claimed rewards that differ are a failure
  (`reward_mismatch`). That is all for a group of the run's own samplers (`trusted`: keys
  the run minted for samplers it started on the learner's machine, while
  `security.trust_local_samplers` is on). For any other key: while it is on probation (its
  first `security.probation_groups` checked groups) its log-probs are checked right away,
  against the version it claims, so a forger is quarantined within its first groups (a
  group of staleness 0 is left to its step, which checks it before applying anything).
  Otherwise it is decided here whether they will be checked: every group of staleness 0,
  and a stale group when it is drawn, with probability `security.stale_check_fraction`,
  by a keyed hash of (key, claimed version, rollout id) under a secret only this process
  holds (`StaleDraw`): each group's draw is its own, so no outcome a sampler watches tells it
  which of its next groups go unchecked;
- **when its batch is full** (`check_batch`), before the step: the stale groups to check are
  re-scored with the version each claims, all groups of one version in one batched forward
  pass, on the learner's device and in its precision (`PastPolicies`: the learner's own
  recent versions kept there, nothing rebuilt or hashed; an older one downloaded and
  verified), and compared (`pipeline.trust.logprob_gap` against `security.logprob_threshold`).
  The groups of staleness 0 are checked by the step itself
  (`pipeline.learning.update.FreshCheck`: the training forward computes exactly the
  log-probs the check needs), which the learner reports back with `record_fresh`. A version
  no longer in reach cannot be checked: on probation the group is then not used
  (`unverifiable`, no strike), afterwards it is used unchecked (counted). A version whose
  checkpoint in S3 was altered since the learner signed it (`PastPolicies.altered`) is not
  pruned: anyone who can write to the bucket could make any version unverifiable that way,
  so its groups are not used, on probation or not, drawn for a check or not (`unverifiable`,
  no strike; `PastPolicies.is_altered`).

Failures are handed back; the learner strikes the key and withdraws the group.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import statistics
from collections import Counter, defaultdict
from typing import Callable, Iterable, Optional

import torch

from pipeline.config import SecurityConfig
from pipeline.models import completion_logprobs, decode_completion
from pipeline.trust import logprob_gap
from pipeline.weights.follower import PastPolicies
from pipeline.wire.rollout import Rollout

log = logging.getLogger(__name__)

UNVERIFIABLE = "unverifiable"
"""A failure that proves nothing against the sampler: the group is not used, but no strike."""

RESCORE_ROWS = 256
"""Sequences re-scored in one forward pass at most (a version's groups go in batches of this)."""


class StaleDraw:
    """Which stale groups of an untrusted key have their log-probs checked: each with probability
    `fraction`, decided by HMAC-SHA256 under a secret drawn from the OS when the learner starts
    (never written anywhere) of the group's key, claimed version and rollout id.

    Why per group: a draw shared by several groups (once per version, as before 0.3.0) is learned
    by one probe (a forged group claiming v goes unpunished, so v was not drawn) and then
    exploited with as many forged groups as v can take. Here a key's forged stale groups are
    each caught with probability `fraction`, whatever it saw before, so with quarantine at S
    strikes it gets S (1 - fraction) / fraction of them used on average (`forged_used_bound`).
    Deterministic for one rollout id, so a group put back and judged again keeps its draw (a
    second copy of a rollout id is never used: the intake ignores it)."""

    def __init__(self, fraction: float, secret: Optional[bytes] = None):
        self.fraction = fraction
        self.secret = secret or secrets.token_bytes(32)

    def __call__(self, key_id: str, version: int, rollout_id: str) -> bool:
        message = f"{key_id}\x00{version}\x00{rollout_id}".encode()
        digest = hmac.new(self.secret, message, hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") < self.fraction * 2 ** 64


def forged_used_bound(fraction: float, strikes: int, tail: float = 1e-4) -> int:
    """The most forged stale groups of one key (past probation) that can be used before it is
    quarantined, but with probability `tail`: each is caught with probability `fraction` on its
    own, and the `strikes`-th catch quarantines, so the number used is negative-binomial. The
    bound the attack audit holds the probing forger to (lab/attack.py)."""
    if fraction >= 1:
        return 0
    if fraction <= 0:
        raise ValueError("with stale_check_fraction 0 a forger's stale groups are never checked: no bound")
    used, below = 0, 0.0
    while True:  # P(exactly `used` used) = C(used + strikes - 1, used) f^strikes (1-f)^used
        below += math.comb(used + strikes - 1, used) * fraction ** strikes * (1 - fraction) ** used
        if 1 - below <= tail:
            return used
        used += 1


class GroupScreen:
    """Re-scores rewards of each group as it is admitted; checks log-probs of a batch's groups."""

    def __init__(self, security: SecurityConfig, task, tokenizer, temperature: float,
                 current_policy: Callable[[], Optional[torch.nn.Module]], past: Optional[PastPolicies],
                 trusted: Callable[[Rollout], bool] = lambda rollout: False):
        """`current_policy`: the learner's weights now, for groups of staleness 0 that the step
        cannot check itself (None where they cannot be run on this rank alone). `trusted`:
        whether a group comes from one of the run's own samplers (its log-probs are not checked)."""
        self.security, self.task, self.tokenizer, self.temperature = security, task, tokenizer, temperature
        self.current_policy, self.past, self.trusted = current_policy, past, trusted
        self.drawn = StaleDraw(security.stale_check_fraction)
        """Whether a stale group past probation is checked (a secret draw of its own)."""
        self.checked: Counter = Counter()
        """Key id (sampler id if unsigned) -> its groups whose log-probs were checked (probation)."""
        self.planned: dict[str, tuple[int, bool]] = {}
        """Rollout id -> (the version to check it against, whether its key was on probation)."""
        self.gaps: dict[str, list[float]] = {}
        """Sampler id -> the log-prob statistic of each of its checked groups (calibration data)."""
        self.counts: Counter = Counter()
        self.checked_versions: Optional[dict[str, int]] = None
        """Where set (a validator's screen): rollout id -> the version its log-probs were checked
        with, for each group checked; its reader takes the entries out."""

    # ---- when a group is admitted ---------------------------------------------------------
    def check(self, rollout: Rollout, staleness: int, fresh_in_step: bool = False) -> list[tuple[str, str]]:
        """(kind, detail) of each failed check; the group's rewards are the learner's afterwards.

        A group of a key on probation has its log-probs checked here and now, so that a forger
        is quarantined within its first groups, unless it is fresh, the step will check it
        (`fresh_in_step`: before any of the step's gradients is applied) and the key already
        had as many groups checked as it takes to quarantine it (`security.strikes_to_quarantine`:
        a forger's first groups are still judged one by one as they are read, before a batch
        fills with them); any other is planned for `check_batch` (every one of staleness 0, a
        drawn share of the stale ones) or left unchecked."""
        failures = self._rescore(rollout) if self.security.rescore_rewards else []
        if failures or not self.security.check_logprobs:
            return failures
        if self.trusted(rollout):
            self.counts["logprobs_unchecked_trusted"] += 1
            return []
        if self.past is not None and self.past.is_altered(rollout.policy_version):  # drawn or not
            self.counts["refused_unverifiable_altered"] += 1
            return [(UNVERIFIABLE, f"v{rollout.policy_version}'s checkpoint was altered in S3: it cannot be checked")]
        who = rollout.key_id or rollout.sampler_id
        on_probation = self.checked[who] < self.security.probation_groups
        step_checks_it = (staleness == 0 and fresh_in_step
                          and self.checked[who] >= self.security.strikes_to_quarantine)
        if on_probation and not step_checks_it:
            model = self.current_policy() if staleness == 0 else self._model_for(rollout.policy_version)
            if model is not None:
                failure = self._judge(rollout, self._gaps([rollout], model)[0],
                                      "logprobs_checked_fresh" if staleness == 0 else "logprobs_checked_stale")
                return [failure] if failure else []
            if staleness != 0:
                self.counts["refused_unverifiable_on_probation"] += 1
                return [(UNVERIFIABLE, f"v{rollout.policy_version} cannot be checked and the key is on probation")]
            # staleness 0, and the weights are not whole on this rank (ZeRO-3): the step checks it
        if staleness == 0 or on_probation or self.drawn(who, rollout.policy_version, rollout.rollout_id):
            self.planned[rollout.rollout_id] = (rollout.policy_version, on_probation)
        else:
            self.counts["logprobs_unchecked_not_drawn"] += 1
        return []

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

    # ---- when a batch is full -------------------------------------------------------------
    def check_batch(self, batch: list[tuple[Rollout, int]], *, fresh_in_step: bool,
                    still_pending: Iterable[str] = ()) -> tuple[dict[str, list[tuple[str, str]]], list[int]]:
        """The log-prob checks of a full batch ((group, staleness) pairs) before its step.

        Returns the failures by rollout id, and the indices of the batch's groups that the step
        must check itself (`fresh_in_step`: those of staleness 0; else they are re-scored here
        with `current_policy`), whose checks stay planned until `record_fresh` (a batch that does
        not reach its step checks them when it does). `still_pending`: rollout ids still waiting
        for a batch (the plans of any group neither there nor in `batch` are let go: it was dropped)."""
        failures: dict[str, list[tuple[str, str]]] = {}
        in_step: list[int] = []
        by_version: dict[int, list[tuple[Rollout, bool]]] = defaultdict(list)
        keep = set(still_pending) | {rollout.rollout_id for rollout, _ in batch}
        self.planned = {k: v for k, v in self.planned.items() if k in keep}
        for index, (rollout, staleness) in enumerate(batch):
            plan = self.planned.get(rollout.rollout_id)
            if plan is None:
                continue
            version, on_probation = plan
            if staleness == 0 and fresh_in_step:
                in_step.append(index)
                continue
            del self.planned[rollout.rollout_id]
            by_version[-1 if staleness == 0 else version].append((rollout, on_probation))
        for version, items in sorted(by_version.items()):
            model = self._model_for(version)
            if model is None:
                for rollout, on_probation in items:
                    if self.past is not None and self.past.is_altered(rollout.policy_version):
                        self.counts["refused_unverifiable_altered"] += 1
                        failures[rollout.rollout_id] = [
                            (UNVERIFIABLE, f"v{rollout.policy_version}'s checkpoint was altered in S3: it cannot be checked")]
                    elif on_probation:
                        self.counts["refused_unverifiable_on_probation"] += 1
                        failures[rollout.rollout_id] = [
                            (UNVERIFIABLE, f"v{rollout.policy_version} cannot be checked and the key is on probation")]
                    else:  # pruned (or, fresh, not whole on this rank: ZeRO-3): used unchecked
                        self.counts["logprobs_unchecked_zero3" if version == -1 else "logprobs_unchecked_pruned"] += 1
                continue
            rollouts = [rollout for rollout, _ in items]
            for rollout, gap in zip(rollouts, self._gaps(rollouts, model)):
                failure = self._judge(rollout, gap, "logprobs_checked_fresh" if version == -1 else "logprobs_checked_stale")
                if failure:
                    failures[rollout.rollout_id] = [failure]
        return failures, in_step

    def record_fresh(self, rollout: Rollout, gap: float) -> Optional[tuple[str, str]]:
        """A group of staleness 0 checked by its step: recorded, and its failure if over the threshold."""
        self.planned.pop(rollout.rollout_id, None)
        return self._judge(rollout, gap, "logprobs_checked_fresh")

    def _judge(self, rollout: Rollout, gap: float, count: str) -> Optional[tuple[str, str]]:
        self.checked[rollout.key_id or rollout.sampler_id] += 1
        if self.checked_versions is not None:
            self.checked_versions[rollout.rollout_id] = rollout.policy_version
        self.gaps.setdefault(rollout.sampler_id, []).append(gap)
        self.counts[count] += 1
        if gap > self.security.logprob_threshold:
            return ("logprob_mismatch", f"median exp(|Δ|)-1 = {gap:.3g} > {self.security.logprob_threshold:g} "
                                        f"at v{rollout.policy_version}")
        return None

    def _model_for(self, version: int) -> Optional[torch.nn.Module]:
        """The weights of `version` (-1: the learner's own now), or None where they cannot be had."""
        if version == -1:
            return self.current_policy()
        return self.past.get(version) if self.past is not None else None

    def _gaps(self, rollouts: list[Rollout], model: torch.nn.Module) -> list[float]:
        """The log-prob statistic of each group against `model`'s own log-probs, in batched passes."""
        prompts = [r.prompt_ids for r in rollouts for _ in range(r.group_size)]
        completions = [c for r in rollouts for c in r.completion_ids]
        ours: list[list[float]] = []
        with torch.no_grad():
            for start in range(0, len(prompts), RESCORE_ROWS):
                logps, mask = completion_logprobs(model, prompts[start:start + RESCORE_ROWS],
                                                  completions[start:start + RESCORE_ROWS], self.temperature)
                ours += [row[: int(m.sum())].double().tolist() for row, m in zip(logps, mask)]
        gaps, row = [], 0
        for r in rollouts:
            gaps.append(logprob_gap(r.sampler_logps, ours[row:row + r.group_size]))
            row += r.group_size
        return gaps

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
