"""The attack audit's judgement of the stale prober (lab/attack.py), without a run: its forged
groups used are counted by rollout id, against the bound the per-group draw allows."""

from lab.attack import _key_findings, _prober, joined_as_stranger, keys_of
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
    # the forged groups that met the draw: those its key had read before the quarantine, less the
    # honest ones it made first (the rest came after it and were refused whatever their draw)
    read = _prober({"forged_rollout_ids": forged, "honest_groups_made": 112}, honest_used, security, 131)
    assert read["forged_read_before_quarantine"] == 19 and read["forged_used"] == 0 and read["target_met"]
    assert _prober({"forged_rollout_ids": forged}, honest_used, security, 131)["forged_read_before_quarantine"] is None


def test_an_adversary_whose_key_is_marked_local_or_did_not_join_fails_the_audit():
    """The attack checks every key as a stranger's, so only this finding catches a registry that
    wrongly trusts an adversary: a key marked the run's own, or one the root registered."""
    from types import SimpleNamespace

    invite = "inv1"
    registry = SimpleNamespace(keys={
        "k1": SimpleNamespace(key_id="k1", sampler_id="adv-a", grant=invite, local=False),
        "k2": SimpleNamespace(key_id="k2", sampler_id="adv-b", grant=invite, local=True),   # wrongly local
        "k3": SimpleNamespace(key_id="k3", sampler_id="adv-c", grant="", local=False),      # root-registered
        "k4": SimpleNamespace(key_id="k4", sampler_id="honest", grant="", local=True)})
    ids = {"a": "adv-a", "b": "adv-b", "c": "adv-c"}
    held = {kind: {"keys": keys_of(registry, sid), "joined_with_invite": joined_as_stranger(keys_of(registry, sid), invite)}
            for kind, sid in ids.items()}
    assert held["a"]["joined_with_invite"] and not held["b"]["joined_with_invite"]
    assert _key_findings(held, ids) == {"adversary_keys_local": ["adv-b"], "adversaries_not_joined": ["adv-b", "adv-c"]}
    clean = {kind: held["a"] for kind in ids}
    assert _key_findings(clean, ids) == {"adversary_keys_local": [], "adversaries_not_joined": []}


def test_forged_verdicts_are_counted_by_what_a_reader_of_the_topic_finds():
    """The learner is held to refusing the forgeries it could read: a forgery is counted once per
    copy found, a replay only for the copies past the genuine verdict it repeats, and one the
    broker acknowledged but no reader sees (a collided offset) is not counted."""
    from collections import Counter

    from lab.adversaries import forgeries_in_topic, message_digest

    unsigned = [message_digest(f"u{i}".encode()) for i in range(3)]
    genuine = message_digest(b"a validator's verdict")
    acknowledged = {"unsigned": Counter(unsigned), "replayed": Counter({genuine: 2})}
    # u2 hidden by the broker; the genuine verdict once, then one of its two replays
    in_topic = Counter({unsigned[0]: 1, unsigned[1]: 1, genuine: 2, message_digest(b"other"): 5})
    assert forgeries_in_topic(acknowledged, in_topic) == {"unsigned": 2, "replayed": 1}
    # a message the broker stored twice counts once: no more copies count than were acknowledged
    assert forgeries_in_topic(acknowledged, in_topic + Counter({unsigned[0]: 1, genuine: 5})) == \
        {"unsigned": 2, "replayed": 2}
    assert forgeries_in_topic(acknowledged, Counter()) == {"unsigned": 0, "replayed": 0}
