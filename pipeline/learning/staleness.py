"""Staleness policy: which prompt groups the learner may still use, and with what weight.

A rollout made by policy version v and used when the learner is at version V has
staleness tau = V - v steps (docs/delays.md); its wall-clock age also counts. Within
the limits a group is used as is. Past ``max_delay_steps`` it is dropped (default) or,
with ``stale_policy="reweight"``, kept with weight ``reweight_decay ** (tau - max_delay_steps)``;
the learner passes that weight to compute_policy_loss as the group's sequence_weights.
Past ``max_delay_seconds`` a group is always dropped: an old group is old whatever the
policy. Every decision carries its reason, and StalenessCounter tallies them so the
learner can report kept / dropped / reweighted counts per step.

Pure functions and a plain counter: no clocks, no I/O. The caller measures the age.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

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
