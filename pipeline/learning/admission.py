"""Admission: what happens to each prompt group the learner reads, decided without I/O.

The learner hands every Kafka message to `Admission.admit_message` with its version and
the time; replay hands every recorded group to `Admission.admit_group` with the
staleness and age the original learner recorded. Either way one object:

  1. decodes the message and checks it fits this learner (`RolloutLimits`); a poison
     message gets the verdict "malformed" with its reason (the caller dead-letters it);
  2. ignores a second copy of a rollout id already judged ("duplicate"), also across a
     restart: a resumed learner starts with the ids its update log has judged;
  3. judges staleness τ = version − rollout version and the age with the learner's rule
     (`decide_staleness`, below): "kept" groups wait in the pending batch,
     "dropped" ones are recorded with their reason;
  4. with validators (`validators.enabled`), holds a kept group aside (`awaiting`) until its
     verdict arrives: a passing one lets it into the batch after judging its staleness again
     (`release`: it may have aged while waiting), a failing one refuses it; after every step
     the waiting groups are judged again too (`expire_awaiting`), so waiting for a verdict
     counts toward the staleness rule like waiting in the batch;
  5. hands out a batch once `groups_per_step` groups wait, after judging them again at use
     (a wall-clock limit may have passed while the batch filled), or, when draining, a
     last smaller batch.

Staleness is decided when a group enters the batch and the batch is handed out the
moment it is full, and versions change only between batches, so τ at decision is τ at
use. Everything judged since the last step (`take_verdicts`) goes into that step's
update-log entry; the counters feed metrics and the learner's summary.

The staleness rule (`decide_staleness`, first below): a rollout made by policy version v
and used when the learner is at version V has staleness tau = V - v steps (docs/delays.md);
its wall-clock age also counts. Within the limits a group is used as is. Past ``max_delay_steps`` it is dropped (default) or,
with ``stale_policy="reweight"``, kept with weight ``reweight_decay ** (tau - max_delay_steps)``;
the learner passes that weight to compute_policy_loss as the group's sequence_weights.
Past ``max_delay_seconds`` a group is always dropped: an old group is old whatever the
policy. Every decision carries its reason, and StalenessCounter tallies them so the
learner can report kept / dropped / reweighted counts per step.

The rule is pure functions and a plain counter, and admission decides without I/O: no
clocks (the caller measures the age), no Kafka.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional

from pipeline.config import LearnerConfig
from pipeline.wire.rollout import Rollout, RolloutDecodeError, decode_rollout
from pipeline.trust import termination_error
from pipeline.records.update_log import DroppedGroup, DuplicateGroup, SkippedMessage, UsedGroup

Verdict = Literal["kept", "dropped", "malformed", "duplicate", "rejected"]


# --- the staleness rule ----------------------------------------------------------------------

StalePolicy = Literal["drop", "reweight"]
STALE_POLICIES: tuple[str, ...] = ("drop", "reweight")
REASONS: tuple[str, ...] = ("fresh", "reweighted", "too_stale_steps", "too_old_seconds")


@dataclass(frozen=True)
class StalenessDecision:
    """One group's verdict. ``weight`` multiplies the group's loss contribution: 1.0 when
    fresh, 0 < w <= 1 when reweighted, 0.0 when dropped."""

    keep: bool  # False -> the group is dropped
    weight: float
    reason: str  # "fresh" | "reweighted" | "too_stale_steps" | "too_old_seconds"


_FRESH = StalenessDecision(True, 1.0, "fresh")
_TOO_STALE = StalenessDecision(False, 0.0, "too_stale_steps")
_TOO_OLD = StalenessDecision(False, 0.0, "too_old_seconds")


def decide_staleness(
    staleness_steps: int,
    age_seconds: float,
    *,
    max_delay_steps: int,
    max_delay_seconds: float | None = None,
    stale_policy: StalePolicy = "drop",
    reweight_decay: float = 0.5,
    reweight_max_extra_steps: int | None = None,
) -> StalenessDecision:
    """Keep, reweight or drop one prompt group.

    Rules, in order:
      1. ``age_seconds > max_delay_seconds`` (when set) -> dropped, "too_old_seconds",
         under either policy (also when the step limit is exceeded too).
      2. ``staleness_steps <= max_delay_steps`` -> kept, weight 1, "fresh".
      3. "drop" -> dropped, "too_stale_steps".
      4. "reweight": excess = staleness_steps - max_delay_steps (>= 1). If
         ``reweight_max_extra_steps`` is set and excess exceeds it -> dropped,
         "too_stale_steps"; otherwise kept with weight reweight_decay ** excess,
         "reweighted" (a weight that underflows to 0.0 is a drop, "too_stale_steps").

    Boundaries are inclusive: staleness == max_delay_steps and age == max_delay_seconds
    are still fresh. A negative age (clock skew between machines) counts as fresh.

    Raises ValueError naming the argument: negative staleness_steps (a rollout from a
    future policy version is a bug upstream), non-integer steps, NaN age, or limits
    out of range.
    """
    _check_steps("staleness_steps", staleness_steps)
    if staleness_steps < 0:
        raise ValueError(f"staleness_steps must be >= 0 (a rollout newer than the learner is a bug), "
                         f"got {staleness_steps}")
    _check_steps("max_delay_steps", max_delay_steps)
    if max_delay_steps < 0:
        raise ValueError(f"max_delay_steps must be >= 0, got {max_delay_steps}")
    if isinstance(age_seconds, bool) or not isinstance(age_seconds, (int, float)) or math.isnan(age_seconds):
        raise ValueError(f"age_seconds must be a number, got {age_seconds!r}")
    if max_delay_seconds is not None and (
        isinstance(max_delay_seconds, bool) or not isinstance(max_delay_seconds, (int, float))
        or not max_delay_seconds > 0
    ):
        raise ValueError(f"max_delay_seconds must be > 0 or None, got {max_delay_seconds!r}")
    if stale_policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
    if isinstance(reweight_decay, bool) or not isinstance(reweight_decay, (int, float)) or not 0 < reweight_decay <= 1:
        raise ValueError(f"reweight_decay must be in (0, 1], got {reweight_decay!r}")
    if reweight_max_extra_steps is not None:
        _check_steps("reweight_max_extra_steps", reweight_max_extra_steps)
        if reweight_max_extra_steps < 0:
            raise ValueError(f"reweight_max_extra_steps must be >= 0 or None, got {reweight_max_extra_steps}")

    if max_delay_seconds is not None and age_seconds > max_delay_seconds:
        return _TOO_OLD
    if staleness_steps <= max_delay_steps:
        return _FRESH
    if stale_policy == "drop":
        return _TOO_STALE
    excess = staleness_steps - max_delay_steps
    if reweight_max_extra_steps is not None and excess > reweight_max_extra_steps:
        return _TOO_STALE
    weight = float(reweight_decay) ** excess
    if weight == 0.0:
        return _TOO_STALE
    return StalenessDecision(True, weight, "reweighted")


def _check_steps(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


@dataclass
class StalenessCounter:
    """Tally of decisions, one count per reason. Make one per learner step (or call reset)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def record(self, decision: StalenessDecision) -> StalenessDecision:
        """Count ``decision`` and return it, so a call can wrap decide_staleness."""
        if decision.reason not in self.counts:
            raise ValueError(f"decision.reason must be one of {REASONS}, got {decision.reason!r}")
        self.counts[decision.reason] += 1
        return decision

    @property
    def kept(self) -> int:
        """Groups used: fresh plus reweighted."""
        return self.counts["fresh"] + self.counts["reweighted"]

    @property
    def reweighted(self) -> int:
        return self.counts["reweighted"]

    @property
    def dropped(self) -> int:
        """Groups dropped for either limit."""
        return self.counts["too_stale_steps"] + self.counts["too_old_seconds"]

    def as_dict(self) -> dict[str, int]:
        """Flat counts for metrics: kept, dropped, and one entry per reason."""
        return {"kept": self.kept, "dropped": self.dropped, **self.counts}

    def reset(self) -> dict[str, int]:
        """Return as_dict() and start again from zero (for per-step reporting)."""
        snapshot = self.as_dict()
        self.counts = dict.fromkeys(REASONS, 0)
        return snapshot


# --- admission ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutLimits:
    """What decoding cannot check: a rollout must fit this learner's model and sampling settings."""

    vocab_size: int
    temperature: float
    max_new_tokens: int
    max_positions: int
    eos_ids: tuple[int, ...] = ()
    """With EOS ids, the termination rule is checked too (`pipeline.trust.termination_error`)."""

    @classmethod
    def of_model(cls, model, tokenizer, eos_ids, sampler) -> "RolloutLimits":
        """The limits of a learner training `model` (its vocabulary and positions), with the
        termination rule of `eos_ids`, for groups sampled as `sampler` (`SamplerConfig`) says."""
        return cls(vocab_size=model.get_input_embeddings().num_embeddings, temperature=sampler.temperature,
                   max_new_tokens=sampler.max_new_tokens,
                   max_positions=int(getattr(model.config, "max_position_embeddings", 1 << 30)),
                   eos_ids=tuple(eos_ids))

    def check(self, rollout: Rollout, version: int) -> None:
        """Raises RolloutDecodeError (with a one-line reason) if the learner at `version` cannot use it."""
        try:
            self._check(rollout, version)
        except (TypeError, ValueError) as e:  # whatever decoding let through that these rules cannot read
            if isinstance(e, RolloutDecodeError):
                raise
            raise RolloutDecodeError(f"unusable group ({type(e).__name__}: {e})") from None

    def _check(self, rollout: Rollout, version: int) -> None:
        if rollout.policy_version > version:
            raise RolloutDecodeError(f"policy_version {rollout.policy_version} is newer than the learner's "
                                     f"{version} (another run on this topic, or a reset Redis)")
        if abs(float(rollout.sampling.get("temperature", -1)) - self.temperature) > 1e-6:
            raise RolloutDecodeError(f"sampled at temperature {rollout.sampling.get('temperature')}, "
                                     f"learner expects sampler.temperature={self.temperature}")
        ids = rollout.token_ids()
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RolloutDecodeError(f"token id outside the model's vocabulary of {self.vocab_size}")
        longest = max(len(c) for c in rollout.completion_ids)
        if longest > self.max_new_tokens:
            raise RolloutDecodeError(f"completion of {longest} tokens exceeds "
                                     f"sampler.max_new_tokens={self.max_new_tokens}")
        if len(rollout.prompt_ids) + longest > self.max_positions:
            raise RolloutDecodeError(f"prompt + completion of {len(rollout.prompt_ids) + longest} tokens exceeds "
                                     f"the model's {self.max_positions} positions")
        if self.eos_ids:
            broken = termination_error(rollout.completion_ids, self.eos_ids, self.max_new_tokens)
            if broken:
                raise RolloutDecodeError(f"termination rule: {broken}")


@dataclass
class PendingGroup:
    """A group admitted into the batch being filled, with what its admission decided."""

    rollout: Rollout
    partition: int
    offset: int
    staleness: int
    age_s: Optional[float]
    """Seconds from creation to judgement (None: a replayed group whose log did not record it)."""
    decision: StalenessDecision
    verdict: Optional[str] = None
    """The passing verdict that let it into the batch (`UsedGroup.verdict`), with validators."""

    def used(self) -> UsedGroup:
        """Its line in the update log's `used` list."""
        return UsedGroup(self.partition, self.offset, self.rollout.rollout_id, self.rollout.policy_version,
                         self.staleness, self.decision.weight, self.age_s, self.verdict)

    def dropped(self) -> DroppedGroup:
        return DroppedGroup(self.partition, self.offset, self.rollout.rollout_id, self.rollout.policy_version,
                            self.staleness, self.decision.reason, self.age_s)


@dataclass
class Admitted:
    """The verdict on one message; `reason` says why for "malformed" and "dropped"."""

    verdict: Verdict
    reason: str = ""
    rollout: Optional[Rollout] = None


@dataclass
class Verdicts:
    """Groups judged since the last step that no step uses: they go into its update-log entry."""

    dropped: list[DroppedGroup] = field(default_factory=list)
    malformed: list[SkippedMessage] = field(default_factory=list)
    duplicates: list[DuplicateGroup] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.dropped or self.malformed or self.duplicates)


@dataclass
class AdmissionCounters:
    groups_consumed: int = 0
    """Every message read, whatever happened to it."""
    malformed: int = 0
    rejected: Counter = field(default_factory=Counter)
    """Messages refused by the signature check, by code (`pipeline.trust.Rejected`)."""
    refused: Counter = field(default_factory=Counter)
    """Signed groups not used because they failed a check or their key is quarantined, by reason."""
    duplicates: int = 0
    """Second copies of a rollout id already judged (producer retries), ignored."""
    staleness: StalenessCounter = field(default_factory=StalenessCounter)
    """Final verdict of every decodable group: fresh / reweighted (used), or dropped by reason."""
    staleness_used: list = field(default_factory=list)
    """τ of every group handed out in a batch."""

    def as_dict(self) -> dict:
        used = self.staleness_used
        counts = self.staleness.counts
        return {"groups_consumed": self.groups_consumed, "groups_used": self.staleness.kept,
                "groups_dropped": self.staleness.dropped, "groups_reweighted": self.staleness.reweighted,
                "malformed": self.malformed, "duplicates_ignored": self.duplicates,
                "rejected_by_reason": dict(self.rejected), "refused_by_reason": dict(self.refused),
                "dropped_by_reason": {r: counts[r] for r in ("too_stale_steps", "too_old_seconds") if counts[r]},
                "max_staleness_used": max(used) if used else None,
                "mean_staleness_used": (sum(used) / len(used)) if used else None,
                "staleness_histogram": {str(t): n for t, n in sorted(Counter(used).items())}}


class Admission:
    """Decode, validate, deduplicate and judge groups; hold the pending batch. No I/O."""

    def __init__(self, rules: LearnerConfig, limits: Optional[RolloutLimits] = None,
                 judged_ids: Iterable[str] = ()):
        """`rules`: the learner's staleness rule and batch size. `limits`: checked on every
        message (`admit_message`); replay, which admits decoded groups, passes None.
        `judged_ids`: rollout ids judged before a restart (from the update log)."""
        self.rules = rules
        self.limits = limits
        self.seen_ids: set[str] = set(judged_ids)
        self.pending: list[PendingGroup] = []
        self.awaiting: dict[str, PendingGroup] = {}
        """Kept groups waiting for a validator's verdict, by rollout id (in arrival order)."""
        self.counters = AdmissionCounters()
        self._verdicts = Verdicts()

    def judge(self, staleness: int, age_s: float) -> StalenessDecision:
        r = self.rules
        return decide_staleness(staleness, age_s, max_delay_steps=r.max_delay_steps,
                                max_delay_seconds=r.max_delay_seconds, stale_policy=r.stale_policy,
                                reweight_decay=r.reweight_decay, reweight_max_extra_steps=r.reweight_max_extra_steps)

    def admit_message(self, partition: int, offset: int, value: bytes, version: int, now: float) -> Admitted:
        """One Kafka message read by a learner at `version` at wall-clock time `now`."""
        try:
            rollout = decode_rollout(value)
        except RolloutDecodeError as e:
            self.counters.groups_consumed += 1
            return self._malformed(partition, offset, e.reason)
        return self.admit_rollout(rollout, partition, offset, version, now)

    def admit_rollout(self, rollout: Rollout, partition: int, offset: int, version: int, now: float,
                      hold: bool = False) -> Admitted:
        """`admit_message` for a message already decoded (and its signature checked); with `hold`
        a kept group waits in `awaiting` for its verdict instead of joining the batch."""
        self.counters.groups_consumed += 1
        try:
            if self.limits is not None:
                self.limits.check(rollout, version)
        except RolloutDecodeError as e:
            return self._malformed(partition, offset, e.reason, rollout)
        return self._admit(rollout, partition, offset, version - rollout.policy_version, now - rollout.created_at,
                           hold)

    def _malformed(self, partition: int, offset: int, reason: str, rollout: Optional[Rollout] = None) -> Admitted:
        self.counters.malformed += 1
        self._verdicts.malformed.append(SkippedMessage(partition, offset, reason))
        return Admitted("malformed", reason, rollout)

    def reject(self, partition: int, offset: int, code: str, reason: str) -> Admitted:
        """A message the signature check refused (the caller dead-letters it). It is logged with
        the malformed ones (skipped messages, reason `rejected: …`) and counted by code."""
        self.counters.groups_consumed += 1
        self.counters.rejected[code] += 1
        self._verdicts.malformed.append(SkippedMessage(partition, offset, f"rejected: {reason}"))
        return Admitted("rejected", reason)

    def refuse(self, rollout: Rollout, partition: int, offset: int, version: int, reason: str) -> Admitted:
        """A signed group not to be used (its key is quarantined): recorded as dropped, with `reason`."""
        self.counters.groups_consumed += 1
        if rollout.rollout_id in self.seen_ids:
            self.counters.duplicates += 1
            self._verdicts.duplicates.append(DuplicateGroup(partition, offset, rollout.rollout_id))
            return Admitted("duplicate", rollout=rollout)
        self.seen_ids.add(rollout.rollout_id)
        self._refuse(PendingGroup(rollout, partition, offset, version - rollout.policy_version, None,
                                  StalenessDecision(False, 0.0, reason)), reason)
        return Admitted("dropped", reason, rollout)

    def withdraw(self, keep, reason_of) -> int:
        """Take the pending (and awaiting) groups `keep` says no to out of the batch, dropped with
        `reason_of(group)`."""
        still = []
        for group in self.pending:
            if keep(group):
                still.append(group)
            else:
                self._refuse(group, reason_of(group))
        withdrawn, self.pending = len(self.pending) - len(still), still
        for rollout_id, group in list(self.awaiting.items()):
            if not keep(group):
                self._refuse(self.awaiting.pop(rollout_id), reason_of(group))
                withdrawn += 1
        return withdrawn

    # ---- groups waiting for a verdict ------------------------------------------------
    def release(self, rollout_id: str, version: int, now: Optional[float], verdict: str) -> Admitted:
        """A waiting group whose passing `verdict` arrived: judged again at `version` (and its age
        at `now`; None: a replay's recorded age) and into the batch, or dropped."""
        group = self.awaiting.pop(rollout_id)
        staleness = version - group.rollout.policy_version
        age_s = group.age_s if now is None else now - group.rollout.created_at
        group = PendingGroup(group.rollout, group.partition, group.offset, staleness, age_s,
                             self.judge(staleness, age_s or 0.0), verdict)
        if not group.decision.keep:
            self._drop(group)
            return Admitted("dropped", group.decision.reason, group.rollout)
        self.pending.append(group)
        return Admitted("kept", rollout=group.rollout)

    def refuse_awaiting(self, rollout_id: str, reason: str) -> None:
        """A waiting group not to be used (a failing verdict, or none in time): dropped with `reason`."""
        self._refuse(self.awaiting.pop(rollout_id), reason)

    def expire_awaiting(self, version: int, now: Optional[float]) -> int:
        """Judge the waiting groups again at `version` (after a step): those past the staleness
        rule are dropped, as they would be in the batch. How many were dropped."""
        dropped = 0
        for rollout_id, group in list(self.awaiting.items()):
            staleness = version - group.rollout.policy_version
            age_s = group.age_s if now is None else now - group.rollout.created_at
            decision = self.judge(staleness, age_s or 0.0)
            if not decision.keep:
                del self.awaiting[rollout_id]
                self._drop(PendingGroup(group.rollout, group.partition, group.offset, staleness, age_s, decision))
                dropped += 1
        return dropped

    def _refuse(self, group: PendingGroup, reason: str) -> None:
        self.counters.refused[reason.split(":")[0]] += 1
        self._verdicts.dropped.append(DroppedGroup(group.partition, group.offset, group.rollout.rollout_id,
                                                   group.rollout.policy_version, group.staleness, reason, group.age_s))

    def admit_group(self, rollout: Rollout, partition: int, offset: int, staleness: int,
                    age_s: Optional[float]) -> Admitted:
        """A decoded group at (partition, offset) with its staleness and age (a replay's recorded
        ones; an age the log did not record counts as 0)."""
        self.counters.groups_consumed += 1
        return self._admit(rollout, partition, offset, staleness, age_s)

    def _admit(self, rollout: Rollout, partition: int, offset: int, staleness: int,
               age_s: Optional[float], hold: bool = False) -> Admitted:
        if rollout.rollout_id in self.seen_ids:
            self.counters.duplicates += 1
            self._verdicts.duplicates.append(DuplicateGroup(partition, offset, rollout.rollout_id))
            return Admitted("duplicate", rollout=rollout)
        self.seen_ids.add(rollout.rollout_id)
        group = PendingGroup(rollout, partition, offset, staleness, age_s, self.judge(staleness, age_s or 0.0))
        if not group.decision.keep:
            self._drop(group)
            return Admitted("dropped", group.decision.reason, rollout)
        if hold:
            self.awaiting[rollout.rollout_id] = group
        else:
            self.pending.append(group)
        return Admitted("kept", rollout=rollout)

    def take_batch(self, now: Optional[float], *, last: bool = False) -> list[PendingGroup]:
        """The next batch once `groups_per_step` groups wait (with `last`, whatever waits), else [].

        The waiting groups are judged again first, their age measured at `now` (None: ages are
        fixed, as in a replay of recorded ages); a group that grew too old meanwhile is dropped
        and the batch keeps filling. Its groups count as used once `count_used` says so.
        """
        if not self.pending or (len(self.pending) < self.rules.groups_per_step and not last):
            return []
        if now is not None:
            self._recheck(now)
        if not self.pending or (len(self.pending) < self.rules.groups_per_step and not last):
            return []
        batch, self.pending = self.pending, []
        return batch

    def put_back(self, batch: list[PendingGroup]) -> None:
        """A batch handed out but not trained on (a check refused some of its groups): its groups
        wait again, ahead of the rest, with the staleness they were judged at (the version
        changes only with a step)."""
        self.pending = list(batch) + self.pending

    def count_used(self, batch: list[PendingGroup]) -> None:
        """The groups of a batch that was trained on."""
        for group in batch:
            self.counters.staleness.record(group.decision)
            self.counters.staleness_used.append(group.staleness)

    def take_verdicts(self) -> Verdicts:
        """What was judged since the last call and used in no batch (for the step's update-log entry)."""
        verdicts, self._verdicts = self._verdicts, Verdicts()
        return verdicts

    def _recheck(self, now: float) -> None:
        still = []
        for group in self.pending:
            age_s = now - group.rollout.created_at
            group = PendingGroup(group.rollout, group.partition, group.offset, group.staleness, age_s,
                                 self.judge(group.staleness, age_s), group.verdict)
            if group.decision.keep:
                still.append(group)
            else:
                self._drop(group)
        self.pending = still

    def _drop(self, group: PendingGroup) -> None:
        self.counters.staleness.record(group.decision)
        self._verdicts.dropped.append(group.dropped())
