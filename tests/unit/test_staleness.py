"""Staleness policy: exact boundaries, reasons, the reweight decay, and the counter."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.learning.admission import REASONS, StalenessCounter, StalenessDecision, decide_staleness


def test_boundary_max_is_kept_and_max_plus_one_is_dropped():
    assert decide_staleness(4, 0.0, max_delay_steps=4) == StalenessDecision(True, 1.0, "fresh")
    assert decide_staleness(5, 0.0, max_delay_steps=4) == StalenessDecision(False, 0.0, "too_stale_steps")
    assert decide_staleness(0, 0.0, max_delay_steps=0).keep
    assert not decide_staleness(1, 0.0, max_delay_steps=0).keep


def test_seconds_boundary_and_reason():
    assert decide_staleness(0, 30.0, max_delay_steps=4, max_delay_seconds=30.0).reason == "fresh"
    assert decide_staleness(0, 30.001, max_delay_steps=4, max_delay_seconds=30.0) == StalenessDecision(
        False, 0.0, "too_old_seconds")
    assert decide_staleness(0, 1e9, max_delay_steps=4).reason == "fresh"  # no seconds limit set
    assert decide_staleness(0, -3.0, max_delay_steps=4, max_delay_seconds=1.0).reason == "fresh"  # clock skew


def test_too_old_is_dropped_under_both_policies_and_wins_over_steps():
    for policy in ("drop", "reweight"):
        d = decide_staleness(9, 100.0, max_delay_steps=4, max_delay_seconds=10.0, stale_policy=policy)
        assert d == StalenessDecision(False, 0.0, "too_old_seconds")


def test_reweight_decays_with_excess_steps():
    for excess in range(1, 6):
        d = decide_staleness(4 + excess, 0.0, max_delay_steps=4, stale_policy="reweight", reweight_decay=0.5)
        assert d == StalenessDecision(True, 0.5**excess, "reweighted")
    d = decide_staleness(7, 0.0, max_delay_steps=4, stale_policy="reweight", reweight_decay=0.9)
    assert d.weight == pytest.approx(0.9**3)
    assert decide_staleness(4, 0.0, max_delay_steps=4, stale_policy="reweight").weight == 1.0


def test_reweight_has_an_optional_hard_limit():
    kw = dict(max_delay_steps=4, stale_policy="reweight", reweight_max_extra_steps=2)
    assert decide_staleness(6, 0.0, **kw).reason == "reweighted"  # excess 2 == limit: kept
    assert decide_staleness(7, 0.0, **kw) == StalenessDecision(False, 0.0, "too_stale_steps")
    only_fresh = decide_staleness(5, 0.0, max_delay_steps=4, stale_policy="reweight", reweight_max_extra_steps=0)
    assert not only_fresh.keep


def test_weight_that_underflows_is_a_drop():
    d = decide_staleness(10_000, 0.0, max_delay_steps=0, stale_policy="reweight", reweight_decay=0.5)
    assert d == StalenessDecision(False, 0.0, "too_stale_steps")


@pytest.mark.parametrize("kwargs, name", [
    (dict(staleness_steps=-1), "staleness_steps"),
    (dict(staleness_steps=1.5), "staleness_steps"),
    (dict(staleness_steps=True), "staleness_steps"),
    (dict(age_seconds=math.nan), "age_seconds"),
    (dict(max_delay_steps=-2), "max_delay_steps"),
    (dict(max_delay_seconds=0.0), "max_delay_seconds"),
    (dict(stale_policy="keep"), "stale_policy"),
    (dict(reweight_decay=0.0), "reweight_decay"),
    (dict(reweight_decay=1.5), "reweight_decay"),
    (dict(reweight_max_extra_steps=-1), "reweight_max_extra_steps"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(staleness_steps=1, age_seconds=0.0, max_delay_steps=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        decide_staleness(args.pop("staleness_steps"), args.pop("age_seconds"), **args)


@settings(database=None, deadline=None)  # no example database written into the repo
@given(
    staleness=st.integers(0, 200),
    age=st.floats(-10, 1e4, allow_nan=False),
    max_steps=st.integers(0, 64),
    max_seconds=st.one_of(st.none(), st.floats(0.5, 5e3)),
    policy=st.sampled_from(["drop", "reweight"]),
    decay=st.floats(0.05, 1.0),
    extra=st.one_of(st.none(), st.integers(0, 20)),
)
def test_decisions_are_consistent(staleness, age, max_steps, max_seconds, policy, decay, extra):
    d = decide_staleness(staleness, age, max_delay_steps=max_steps, max_delay_seconds=max_seconds,
                         stale_policy=policy, reweight_decay=decay, reweight_max_extra_steps=extra)
    assert d.reason in REASONS
    assert d.keep == (d.reason in ("fresh", "reweighted"))
    assert (0 < d.weight <= 1) if d.keep else d.weight == 0.0
    too_old = max_seconds is not None and age > max_seconds
    if too_old:
        assert d.reason == "too_old_seconds"
    elif staleness <= max_steps:
        assert d == StalenessDecision(True, 1.0, "fresh")
    elif policy == "drop":
        assert d.reason == "too_stale_steps"
    elif d.keep:
        assert d.weight == pytest.approx(decay ** (staleness - max_steps))
    # one more step of staleness never raises the weight
    later = decide_staleness(staleness + 1, age, max_delay_steps=max_steps, max_delay_seconds=max_seconds,
                             stale_policy=policy, reweight_decay=decay, reweight_max_extra_steps=extra)
    assert later.weight <= d.weight


def test_counter_tallies_per_reason_and_resets():
    counter = StalenessCounter()
    for staleness, age in [(0, 0.0), (4, 0.0), (5, 0.0), (6, 0.0), (9, 0.0), (1, 99.0)]:
        counter.record(decide_staleness(staleness, age, max_delay_steps=4, max_delay_seconds=60.0,
                                        stale_policy="reweight", reweight_max_extra_steps=2))
    assert counter.as_dict() == {"kept": 4, "dropped": 2, "fresh": 2, "reweighted": 2,
                                 "too_stale_steps": 1, "too_old_seconds": 1}
    assert (counter.kept, counter.dropped, counter.reweighted) == (4, 2, 2)
    assert counter.reset()["kept"] == 4
    assert counter.as_dict() == dict.fromkeys(["kept", "dropped", *REASONS], 0)
    decision = decide_staleness(0, 0.0, max_delay_steps=1)
    assert counter.record(decision) is decision
    with pytest.raises(ValueError, match="reason"):
        counter.record(StalenessDecision(True, 1.0, "lucky"))
