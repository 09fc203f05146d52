"""The attack audit's judgement of the stale prober (lab/attack.py), without a run: its forged
groups used are counted by rollout id, against the bound the per-group draw allows."""

from lab.attack import _prober
from consumers.screening import forged_used_bound
from pipeline.config import SecurityConfig


def test_the_prober_meets_its_target_only_within_the_bound_and_only_if_it_forged():
    security = SecurityConfig(stale_check_fraction=0.25, strikes_to_quarantine=2)
    bound = forged_used_bound(0.25, 2)
    forged = [f"f{i}" for i in range(200)]
    honest_used = {f"h{i}" for i in range(500)}  # its honest groups, used rightly, are not counted
    within = _prober({"forged_rollout_ids": forged, "probes": 3, "floods": 1}, honest_used | set(forged[:bound]),
                     security)
    assert within["forged_used"] == bound and within["forged_sent"] == 200 and within["target_met"]
    over = _prober({"forged_rollout_ids": forged}, honest_used | set(forged[:bound + 1]), security)
    assert over["forged_used"] == bound + 1 and not over["target_met"]
    assert not _prober({}, honest_used, security)["target_met"]  # it never got past probation: nothing shown
