"""Delay simulation building blocks: the fitted log-normal, per-sampler streams, the
other distributions, the refresh gate in both units (with a fake clock), and config errors."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pipeline.config.delays import DelayDistributionConfig, DelayModelConfig, lognormal_params
from pipeline.sampling.delays import DelayStream, RefreshGate, refresh_stream, stream_key, transit_stream

# The paper's refresh delay: 60..1920 s hold 99.5 % of the mass. These numbers were
# computed outside the code under test, with scipy 1.17:
#   z = scipy.stats.norm.ppf((1 + 0.995) / 2) = 2.807033768343811
#   mu = (ln 60 + ln 1920) / 2                = 5.827212513621964   (median exp(mu) = 339.41 s)
#   sigma = (ln 1920 - ln 60) / (2 z)         = 0.6173306395320922
PAPER_Z = 2.807033768343811
PAPER_MU = 5.827212513621964
PAPER_SIGMA = 0.6173306395320922

PAPER = DelayDistributionConfig(kind="lognormal")  # the defaults are the paper's numbers


def _phi(x: float) -> float:
    """Standard normal CDF via erf: independent of the inverse CDF the module uses."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _lognormal_cdf(x: float, mu: float, sigma: float) -> float:
    return _phi((math.log(x) - mu) / sigma)


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------- lognormal fit


def test_paper_values():
    mu, sigma = lognormal_params(60.0, 1920.0, 0.995)
    assert mu == pytest.approx(PAPER_MU, rel=1e-12)
    assert sigma == pytest.approx(PAPER_SIGMA, rel=1e-9)
    assert _phi(PAPER_Z) == pytest.approx(0.9975, abs=1e-12)  # the literal z is the right quantile


def test_paper_values_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    z = stats.norm.ppf((1 + 0.995) / 2)
    mu, sigma = lognormal_params(60.0, 1920.0, 0.995)
    assert mu == pytest.approx((math.log(60) + math.log(1920)) / 2, rel=1e-12)
    assert sigma == pytest.approx((math.log(1920) - math.log(60)) / (2 * z), rel=1e-9)


@pytest.mark.parametrize("lower,upper,conf", [
    (60.0, 1920.0, 0.995), (1.0, 64.0, 0.9), (0.01, 0.02, 0.5), (5.0, 1e6, 0.999999), (3.0, 4.0, 0.01),
])
def test_lognormal_params_solve_both_equations(lower, upper, conf):
    mu, sigma = lognormal_params(lower, upper, conf)
    z = (mu - math.log(lower)) / sigma
    assert _phi(z) == pytest.approx((1 + conf) / 2, abs=1e-9)  # z is the two-sided quantile
    assert math.log(lower) == pytest.approx(mu - z * sigma, rel=1e-12, abs=1e-12)
    assert math.log(upper) == pytest.approx(mu + z * sigma, rel=1e-12, abs=1e-12)
    # and the fitted distribution holds `conf` of its mass inside [lower, upper], split evenly
    assert _lognormal_cdf(upper, mu, sigma) - _lognormal_cdf(lower, mu, sigma) == pytest.approx(conf, abs=1e-9)
    assert _lognormal_cdf(lower, mu, sigma) == pytest.approx((1 - conf) / 2, abs=1e-9)


@pytest.mark.parametrize("lower,upper,conf", [(60.0, 1920.0, 0.995), (1.0, 64.0, 0.9), (2.0, 3.0, 0.5)])
def test_fitted_mass_with_scipy_lognorm(lower, upper, conf):
    stats = pytest.importorskip("scipy.stats")
    mu, sigma = lognormal_params(lower, upper, conf)
    dist = stats.lognorm(s=sigma, scale=math.exp(mu))
    assert dist.cdf(upper) - dist.cdf(lower) == pytest.approx(conf, abs=1e-9)
    assert dist.cdf(lower) == pytest.approx((1 - conf) / 2, abs=1e-9)


def test_fitted_mass_empirically():
    n = 100_000
    stream = DelayStream(PAPER, seed=7, sampler_id="sampler-0", purpose="refresh")
    x = np.array([stream.draw() for _ in range(n)])
    inside = np.mean((x >= 60.0) & (x <= 1920.0))
    below, above = np.mean(x < 60.0), np.mean(x > 1920.0)
    # Outside-count ~ Binomial(n, 0.005): sd of the fraction = sqrt(0.005 * 0.995 / n) = 2.2e-4,
    # so 1.2e-3 is > 5 sd (false failure ~1e-7 for a random seed; the seed is fixed anyway).
    assert inside == pytest.approx(0.995, abs=1.2e-3)
    # Each tail ~ Binomial(n, 0.0025): sd = 1.6e-4; 8e-4 is 5 sd. Checks the split is symmetric.
    assert below == pytest.approx(0.0025, abs=8e-4)
    assert above == pytest.approx(0.0025, abs=8e-4)
    # The median of log-normal draws is exp(mu) = 339.4 s; the sample median's sd is about
    # 1.2533 * sigma * exp(mu) / sqrt(n) ~ 0.83 s, so 5 s is 6 sd.
    assert np.median(x) == pytest.approx(math.exp(PAPER_MU), abs=5.0)


@pytest.mark.parametrize("args", [(0.0, 10.0, 0.9), (-1.0, 10.0, 0.9), (10.0, 10.0, 0.9), (20.0, 10.0, 0.9),
                                  (1.0, 10.0, 0.0), (1.0, 10.0, 1.0), (1.0, math.inf, 0.9)])
def test_lognormal_params_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        lognormal_params(*args)


# --------------------------------------------------------------------------- streams


def _draws(stream: DelayStream, n: int = 20) -> list[float]:
    return [stream.draw() for _ in range(n)]


@pytest.mark.parametrize("dist", [PAPER, DelayDistributionConfig(kind="weibull")])
def test_streams_are_per_sampler_and_reproducible(dist):
    a = _draws(DelayStream(dist, 0, "sampler-0", "refresh"))
    assert a == _draws(DelayStream(dist, 0, "sampler-0", "refresh"))          # same key, same stream
    assert a != _draws(DelayStream(dist, 0, "sampler-1", "refresh"))          # other sampler
    assert a != _draws(DelayStream(dist, 0, "sampler-0", "transit"))          # other purpose
    assert a != _draws(DelayStream(dist, 1, "sampler-0", "refresh"))          # other seed
    assert len(set(a)) == len(a)                                              # actually random


def test_many_samplers_are_not_correlated():
    # The reference gave all samplers one seed; ours must give them unrelated streams.
    rows = np.array([_draws(DelayStream(PAPER, 0, f"s{i}", "refresh"), 2000) for i in range(8)])
    corr = np.corrcoef(np.log(rows))
    off_diag = corr[~np.eye(8, dtype=bool)]
    # Independent series of 2000: sd of a correlation ~ 1/sqrt(2000) = 0.022; 0.12 is > 5 sd.
    assert np.max(np.abs(off_diag)) < 0.12


def test_model_helpers_use_their_purposes():
    model = DelayModelConfig(refresh=PAPER, transit=PAPER, seed=3)
    assert _draws(refresh_stream(model, "x")) == _draws(DelayStream(PAPER, 3, "x", "refresh"))
    assert _draws(transit_stream(model, "x")) == _draws(DelayStream(PAPER, 3, "x", "transit"))
    assert _draws(refresh_stream(model, "x")) != _draws(transit_stream(model, "x"))


def test_a_train_samplers_delays_are_the_same_in_every_run_of_its_config():
    # `heterorl train` names its samplers <run>-<start time>-s<i>: the start time must not change the draws.
    model = DelayModelConfig(transit=DelayDistributionConfig(kind="weibull"), seed=5)
    first, second = (stream_key(run, f"{run}-s0") for run in ("demo-20261205-035649", "demo-20261205-101500"))
    assert first == second == "s0"
    assert _draws(transit_stream(model, first)) == _draws(transit_stream(model, second))
    assert stream_key("demo-1", "demo-1-s0") != stream_key("demo-1", "demo-1-s1")
    assert stream_key("demo-1", "volunteer-7") == "volunteer-7"      # an id of its own is kept whole
    assert stream_key("demo-1", "demo-1-") == "demo-1-"              # never an empty key


def test_negative_and_huge_seeds_work():
    for seed in (-1, -(2**70), 2**70):
        assert len(set(_draws(DelayStream(PAPER, seed, "s", "refresh")))) == 20


# --------------------------------------------------------------------------- distributions


def test_none_draws_zero():
    s = DelayStream(DelayDistributionConfig(), 0, "s", "refresh")
    assert _draws(s) == [0.0] * 20
    assert s.draw_steps() == 0


def test_fixed_draws_its_value():
    s = DelayStream(DelayDistributionConfig(kind="fixed", value=42.5), 0, "s", "transit")
    assert _draws(s) == [42.5] * 20
    assert DelayStream(DelayDistributionConfig(kind="fixed", value=0.0), 0, "s", "t").draw() == 0.0


@pytest.mark.parametrize("value,steps", [(0.0, 0), (0.49, 0), (0.5, 1), (2.5, 3), (2.49, 2), (3.0, 3), (7.6, 8)])
def test_draw_steps_rounds_half_up(value, steps):
    s = DelayStream(DelayDistributionConfig(kind="fixed", value=value), 0, "s", "refresh")
    assert s.draw_steps() == steps
    assert isinstance(s.draw_steps(), int)


def test_weibull_matches_its_distribution():
    shape, scale, n = 1.5, 300.0, 50_000
    s = DelayStream(DelayDistributionConfig(kind="weibull", shape=shape, scale=scale), 0, "s", "refresh")
    x = np.array(_draws(s, n))
    assert np.all(x >= 0)
    # mean = scale * Gamma(1 + 1/k) = 270.8; sd = scale * sqrt(G(1+2/k) - G(1+1/k)^2) = 184.1,
    # so the sd of the sample mean is 0.82; 5 is > 6 sd.
    assert x.mean() == pytest.approx(scale * math.gamma(1 + 1 / shape), abs=5.0)
    # P(X <= scale) = 1 - 1/e for any shape; sd of the fraction ~ 2.2e-3, tolerance 1e-2.
    assert np.mean(x <= scale) == pytest.approx(1 - math.exp(-1), abs=1e-2)


def test_weibull_with_scipy_ks():
    stats = pytest.importorskip("scipy.stats")
    s = DelayStream(DelayDistributionConfig(kind="weibull", shape=0.7, scale=40.0), 5, "s", "transit")
    x = _draws(s, 5000)
    assert stats.kstest(x, stats.weibull_min(c=0.7, scale=40.0).cdf).pvalue > 1e-3


def test_lognormal_steps_are_nonnegative_ints_within_range_mostly():
    s = DelayStream(DelayDistributionConfig(kind="lognormal", lower=1, upper=64, confidence=0.995), 0, "s", "r")
    ks = [s.draw_steps() for _ in range(5000)]
    assert all(isinstance(k, int) and k >= 0 for k in ks)
    # the 99.5 % interval [1, 64] becomes [1, 64] after rounding, plus the rounding of values
    # just below 1 (>= 0.5 rounds up); allow 1 % outside (expected 0.5 %, sd 0.1 %).
    assert np.mean([1 <= k <= 64 for k in ks]) > 0.99


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["none", "fixed", "lognormal", "weibull"]),
    lower=st.floats(1e-6, 1e4),
    ratio=st.floats(1.0001, 1e4),
    conf=st.floats(0.01, 0.999999),
    shape=st.floats(0.05, 20.0),
    scale=st.floats(1e-6, 1e6),
    value=st.floats(0.0, 1e6),
    seed=st.integers(-(2**40), 2**40),
)
def test_draws_are_finite_and_never_negative(kind, lower, ratio, conf, shape, scale, value, seed):
    dist = DelayDistributionConfig(kind=kind, lower=lower, upper=lower * ratio, confidence=conf,
                                   shape=shape, scale=scale, value=value)
    s = DelayStream(dist, seed, "sid", "refresh")
    for _ in range(50):
        d = s.draw()
        assert d >= 0.0 and math.isfinite(d)
        assert s.draw_steps() >= 0


def test_extreme_lognormal_is_clipped_not_infinite():
    # Found by the property test above: a tiny confidence means a huge sigma, and numpy's
    # lognormal then returns inf for some draws; the stream clips those to the largest float.
    dist = DelayDistributionConfig(kind="lognormal", lower=1.0, upper=2259.0, confidence=0.01171875)
    s = DelayStream(dist, 0, "sid", "refresh")
    draws = _draws(s, 2000)
    assert all(math.isfinite(d) and d >= 0 for d in draws)
    assert max(draws) == sys.float_info.max  # some draws did overflow and were clipped
    assert all(k >= 0 for k in (s.draw_steps() for _ in range(200)))


# --------------------------------------------------------------------------- refresh gate: seconds


def _seconds_gate(dist: DelayDistributionConfig, sampler_id: str = "s0", seed: int = 0):
    clock = FakeClock()
    model = DelayModelConfig(unit="seconds", refresh=dist, seed=seed)
    return RefreshGate(model, sampler_id, clock=clock), clock, model


def test_first_load_is_immediate_and_not_a_refresh():
    gate, clock, _ = _seconds_gate(DelayDistributionConfig(kind="fixed", value=1e9))
    assert gate.should_load(None, 0)
    assert gate.should_load(None, 17)
    gate.loaded()
    assert gate.stats == {"refreshes": 0, "delayed_refreshes": 0, "forced_refreshes": 0, "refresh_wait_s": 0.0}
    assert gate.pending_wait is None  # nothing drawn for the first load


def test_seconds_waits_and_does_not_restart_on_a_newer_version():
    gate, clock, _ = _seconds_gate(DelayDistributionConfig(kind="fixed", value=100.0))
    assert gate.should_load(None, 0); gate.loaded()
    assert not gate.should_load(0, 0)               # nothing newer: no wait starts
    clock.t = 10.0
    assert not gate.should_load(0, 1)               # version 1 seen at t=10: wait 100 s
    assert gate.pending_wait == 100.0
    clock.t = 60.0
    assert not gate.should_load(0, 2)               # still newer: the wait is not restarted
    clock.t = 109.999
    assert not gate.should_load(0, 3)
    clock.t = 110.0
    assert gate.should_load(0, 3)                   # exactly 100 s after first seeing v1
    clock.t = 115.0
    assert gate.should_load(0, 4)                   # stays allowed until loaded() (a failed load retries)
    gate.loaded()
    assert gate.stats == {"refreshes": 1, "delayed_refreshes": 1, "forced_refreshes": 0, "refresh_wait_s": 100.0}
    assert gate.pending_wait is None
    clock.t = 500.0
    assert not gate.should_load(4, 4)
    clock.t = 1000.0
    assert not gate.should_load(4, 5)               # a new wait starts at 1000
    clock.t = 1099.0
    assert not gate.should_load(4, 5)
    clock.t = 1100.0
    assert gate.should_load(4, 5)
    gate.loaded()
    assert gate.stats == {"refreshes": 2, "delayed_refreshes": 2, "forced_refreshes": 0, "refresh_wait_s": 200.0}


def test_seconds_draws_anew_after_each_load_from_the_refresh_stream():
    gate, clock, model = _seconds_gate(PAPER, sampler_id="far-away", seed=11)
    expected = _draws(refresh_stream(model, "far-away"), 5)     # the waits the gate must use, in order
    assert len(set(expected)) == 5
    assert gate.should_load(None, 0); gate.loaded()
    current, total = 0, 0.0
    for w in expected:
        start = clock.t
        assert not gate.should_load(current, current + 1)
        assert gate.pending_wait == w
        clock.t = start + w * 0.999
        assert not gate.should_load(current, current + 2)
        clock.t = start + w
        assert gate.should_load(current, current + 3)
        gate.loaded()
        current += 3
        total += w
        clock.t += 1.0
    assert gate.stats["refreshes"] == 5 and gate.stats["delayed_refreshes"] == 5
    assert gate.stats["refresh_wait_s"] == pytest.approx(total)


def test_seconds_none_loads_at_once_and_counts_undelayed_refreshes():
    gate, clock, _ = _seconds_gate(DelayDistributionConfig())
    assert gate.should_load(None, 0); gate.loaded()
    for v in range(1, 4):
        clock.t += 5.0
        assert gate.should_load(v - 1, v)
        gate.loaded()
    assert gate.stats == {"refreshes": 3, "delayed_refreshes": 0, "forced_refreshes": 0, "refresh_wait_s": 0.0}


def test_wait_counts_from_first_sight_not_from_the_decision_poll():
    # A sampler that polls rarely: the wait elapsed between two polls; it is allowed at the
    # first poll after, and the recorded wait is the real time it waited (not the drawn w).
    gate, clock, _ = _seconds_gate(DelayDistributionConfig(kind="fixed", value=30.0))
    assert gate.should_load(None, 0); gate.loaded()
    clock.t = 100.0
    assert not gate.should_load(0, 1)
    clock.t = 145.0
    assert gate.should_load(0, 1)
    gate.loaded()
    assert gate.stats == {"refreshes": 1, "delayed_refreshes": 1, "forced_refreshes": 0, "refresh_wait_s": 45.0}


def test_gates_of_different_samplers_wait_differently():
    waits = []
    for sid in ("a", "b", "c"):
        gate, clock, _ = _seconds_gate(PAPER, sampler_id=sid)
        gate.should_load(None, 0); gate.loaded()
        gate.should_load(0, 1)
        waits.append(gate.pending_wait)
    assert len(set(waits)) == 3


# --------------------------------------------------------------------------- refresh gate: steps


def _steps_gate(dist: DelayDistributionConfig, sampler_id: str = "s0", seed: int = 0):
    clock = FakeClock()
    model = DelayModelConfig(unit="steps", refresh=dist, seed=seed)
    return RefreshGate(model, sampler_id, clock=clock), clock, model


def test_steps_loads_exactly_when_k_behind():
    gate, clock, _ = _steps_gate(DelayDistributionConfig(kind="fixed", value=3))
    assert gate.should_load(None, 5); gate.loaded()
    clock.t = 1.0
    assert not gate.should_load(5, 5)
    assert not gate.should_load(5, 6)
    assert gate.pending_wait == 3
    clock.t = 4.0
    assert not gate.should_load(5, 7)
    clock.t = 9.0
    assert gate.should_load(5, 8)                   # 3 behind
    gate.loaded()
    assert gate.stats == {"refreshes": 1, "delayed_refreshes": 1, "forced_refreshes": 0, "refresh_wait_s": 8.0}
    assert gate.should_load(8, 20)                  # 12 behind at first sight: load at once
    gate.loaded()
    assert gate.stats == {"refreshes": 2, "delayed_refreshes": 1, "forced_refreshes": 0, "refresh_wait_s": 8.0}


def test_steps_k_zero_or_one_loads_on_any_newer_version():
    for value in (0.0, 1.0):
        gate, _, _ = _steps_gate(DelayDistributionConfig(kind="fixed", value=value))
        assert gate.should_load(None, 0); gate.loaded()
        assert not gate.should_load(0, 0)
        assert gate.should_load(0, 1)


def test_steps_draws_a_new_k_after_each_load():
    dist = DelayDistributionConfig(kind="lognormal", lower=1, upper=16, confidence=0.99)
    gate, clock, model = _steps_gate(dist, sampler_id="s9", seed=4)
    ref = refresh_stream(model, "s9")
    ks = [ref.draw_steps() for _ in range(30)]
    assert len(set(ks)) > 3
    assert gate.should_load(None, 0); gate.loaded()
    current, newest = 0, 0
    for k in ks:
        loaded = False
        for lag in range(1, 200):
            newest = current + lag
            ok = gate.should_load(current, newest)
            assert ok == (lag >= k), (k, lag)
            if ok:
                gate.loaded()
                loaded = True
                break
        assert loaded
        current = newest
    assert gate.stats["refreshes"] == 30
    assert gate.stats["delayed_refreshes"] == sum(1 for k in ks if k > 1)


def test_steps_never_lets_lag_exceed_k_when_polled_every_version():
    # Polling after every new version, the sampler loads at lag exactly max(k, 1).
    gate, _, model = _steps_gate(DelayDistributionConfig(kind="weibull", shape=2.0, scale=5.0), "w")
    ref = refresh_stream(model, "w")
    gate.should_load(None, 0); gate.loaded()
    current = 0
    for _ in range(20):
        k = ref.draw_steps()
        lag = 1
        while not gate.should_load(current, current + lag):
            lag += 1
        assert lag == max(k, 1)
        gate.loaded()
        current += lag


# --------------------------------------------------------------------------- config validation


@pytest.mark.parametrize("kwargs,field", [
    ({"lower": 100.0, "upper": 50.0}, "lower"),
    ({"lower": 100.0, "upper": 100.0}, "upper"),
    ({"lower": 0.0}, "lower"),
    ({"upper": -1.0}, "upper"),
    ({"confidence": 1.0}, "confidence"),
    ({"confidence": 0.0}, "confidence"),
    ({"shape": 0.0}, "shape"),
    ({"scale": -3.0}, "scale"),
    ({"value": -1.0}, "value"),
    ({"scale": math.inf}, "scale"),
    ({"value": math.nan}, "value"),
    ({"kind": "gamma"}, "kind"),
    ({"sigma": 1.0}, "sigma"),      # unknown key
])
def test_distribution_errors_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as exc:
        DelayDistributionConfig(**kwargs)
    assert field in str(exc.value)


def test_model_errors_name_the_field():
    with pytest.raises(ValidationError) as exc:
        DelayModelConfig(refresh={"kind": "lognormal", "lower": 10.0, "upper": 5.0})
    assert "refresh" in str(exc.value) and "lower" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        DelayModelConfig(unit="minutes")
    assert "unit" in str(exc.value)
    with pytest.raises(ValidationError) as exc:
        DelayModelConfig(delay=3)
    assert "delay" in str(exc.value)


def test_assignment_is_validated_and_defaults_are_off():
    cfg = DelayDistributionConfig(kind="lognormal")
    with pytest.raises(ValidationError) as exc:
        cfg.lower = 5000.0
    assert "lower" in str(exc.value)
    model = DelayModelConfig()
    assert model.unit == "seconds" and model.refresh.kind == "none" and model.transit.kind == "none"
    assert (PAPER.lower, PAPER.upper, PAPER.confidence) == (60.0, 1920.0, 0.995)
    # from YAML-like dicts, as the sampler config will load it
    m = DelayModelConfig.model_validate({"unit": "steps", "refresh": {"kind": "fixed", "value": 4}, "seed": 2})
    assert m.refresh.value == 4.0 and m.seed == 2


# --------------------------------------------------------------- too far behind, forced loads

def test_forced_load_is_counted_as_a_refresh_and_apart():
    t = [0.0]
    gate = RefreshGate(DelayModelConfig(unit="steps", refresh=DelayDistributionConfig(kind="fixed", value=5)),
                       "s", clock=lambda: t[0])
    assert gate.should_load(None, 0)
    gate.loaded()
    assert not gate.should_load(0, 2)   # 2 behind, k = 5
    t[0] = 3.0
    gate.loaded(forced=True)            # the sampler had to refresh early
    assert gate.stats["refreshes"] == 1 and gate.stats["forced_refreshes"] == 1
    assert gate.stats["refresh_wait_s"] == 3.0
    assert not gate.should_load(2, 3)   # re-armed: a new k is drawn
