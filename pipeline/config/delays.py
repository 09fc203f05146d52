"""The settings of the simulated WAN delays (`sampler.delays`): which distribution each delay
draws from, and the log-normal's parameters from "bounds at a confidence level". What a
sampler does with them (the seeded streams, the refresh gate) is `pipeline.sampling.delays`,
which says why they exist and how the paper's setup maps onto them.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DelayKind = Literal["none", "fixed", "lognormal", "weibull"]



def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return v


class DelayDistributionConfig(BaseModel):
    """One delay distribution. Only the fields of the chosen ``kind`` are used; the
    others keep their (valid) defaults, so switching ``kind`` never needs other edits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    kind: DelayKind = "none"
    """`none`: no delay (draws 0). `fixed`: always `value`. `lognormal`: fitted so that
    [`lower`, `upper`] holds `confidence` of the mass. `weibull`: shape `shape`, scale `scale`."""
    value: float = Field(0.0, ge=0)
    """fixed: the delay itself (seconds, or versions when the model's unit is `steps`)."""
    lower: float = Field(60.0, gt=0)
    """lognormal: lower bound of the central `confidence` interval (paper: 60 s)."""
    upper: float = Field(1920.0, gt=0)
    """lognormal: upper bound of the central `confidence` interval (paper: 1920 s)."""
    confidence: float = Field(0.995, gt=0, lt=1)
    """lognormal: mass inside [`lower`, `upper`], split evenly between the two tails (paper: 0.995)."""
    shape: float = Field(1.5, gt=0)
    """weibull: shape k (k < 1 heavy-tailed, k = 1 exponential, k > 1 peaked around `scale`)."""
    scale: float = Field(300.0, gt=0)
    """weibull: scale lambda (the 63rd percentile of the delay)."""

    @field_validator("value", "lower", "upper", "shape", "scale")
    @classmethod
    def _check_finite(cls, v: float, info) -> float:
        return _finite(info.field_name, v)

    @model_validator(mode="after")
    def _check_bounds(self) -> "DelayDistributionConfig":
        if not self.lower < self.upper:
            raise ValueError(f"lower ({self.lower}) must be smaller than upper ({self.upper})")
        return self


class DelayModelConfig(BaseModel):
    """The delay model of a sampler (off by default: both distributions `none`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    unit: Literal["seconds", "steps"] = "seconds"
    """Unit of the refresh delay. `seconds`: wait that long after first seeing a newer
    version. `steps`: refresh only once k versions behind the newest, k drawn from `refresh`."""
    refresh: DelayDistributionConfig = DelayDistributionConfig()
    """Weight-refresh delay: how long a sampler keeps generating with its old weights."""
    transit: DelayDistributionConfig = DelayDistributionConfig()
    """Rollout transit delay, always in seconds: each finished group is held this long
    before it is published (one-way WAN latency)."""
    seed: int = 0
    """Combined with the sampler id within its run (and the purpose) so that each sampler has its
    own streams, the same in every run of the config."""


def lognormal_params(lower: float, upper: float, confidence: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal whose central `confidence` interval is [lower, upper].

    Solves ln(lower) = mu - z*sigma and ln(upper) = mu + z*sigma with
    z = Phi^-1((1 + confidence) / 2), the two-sided standard-normal quantile:
    mu = (ln lower + ln upper) / 2, sigma = (ln upper - ln lower) / (2 z).
    """
    if not (math.isfinite(lower) and lower > 0):
        raise ValueError(f"lower must be a finite number > 0, got {lower!r}")
    if not (math.isfinite(upper) and upper > lower):
        raise ValueError(f"upper must be finite and greater than lower ({lower!r}), got {upper!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    z = NormalDist().inv_cdf((1.0 + confidence) / 2.0)
    log_lo, log_hi = math.log(lower), math.log(upper)
    return (log_lo + log_hi) / 2.0, (log_hi - log_lo) / (2.0 * z)


