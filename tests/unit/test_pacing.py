"""A sampler's pause rules, without servers: each named reason, in order, and the backlog."""

import time

from pipeline.clients.run_state import fleet_unjudged
from pipeline.sampling.pacing import Pacing, StepPeriod, too_far_behind


def test_too_far_behind_counts_versions_behind_and_queued_steps():
    assert not too_far_behind(None, 3, 0, 64, 4)          # nothing published yet
    assert not too_far_behind(10, 6, 0, 64, 4)            # 4 behind = max: still usable
    assert too_far_behind(10, 5, 0, 64, 4)                # 5 behind: would be dropped
    assert not too_far_behind(10, 6, 63, 64, 4)           # queued groups fill the current step
    assert too_far_behind(10, 6, 64, 64, 4)               # a full step queued ahead: 5 at use
    assert too_far_behind(0, 0, 128, 64, 1)               # on the newest version, but 2 steps queued
    assert not too_far_behind(0, 0, 0, 64, 0)             # max delay 0: only with nothing queued


def test_backlog_counts_what_is_here_and_what_the_learner_has_not_read():
    # 3 spooled here; partition 0 acknowledged up to 100, learner at 90; partition 1 not read at all.
    assert Pacing.backlog(3, {0: 100, 1: 5}, {0: 90}) == 3 + 10 + 5
    assert Pacing.backlog(0, {0: 100}, {0: 120}) == 0  # the learner is past what we know of


def test_backlog_is_the_fleets_not_this_samplers():
    # The learner says 40 messages are unread, more than we have seen acknowledged (15): 40 count.
    assert Pacing.backlog(3, {0: 100, 1: 5}, {0: 90}, learner_unread=40) == 3 + 40
    # A stale report (the learner read on since) never hides what the broker acknowledged to us.
    assert Pacing.backlog(0, {0: 100}, {0: 90}, learner_unread=2) == 10
    # What the fleet spooled (live) that the learner has not judged: groups sent during a learner step,
    # which its last report cannot know; and the groups waiting in its partly filled batch.
    assert Pacing.backlog(0, {0: 100}, {0: 90}, learner_unread=2, unjudged=60, learner_pending=20) == 60 + 20
    # Groups being generated anywhere in the fleet (claimed prompts not yet spooled) are ahead too.
    assert Pacing.backlog(0, {}, {}, learner_unread=0, in_flight=48) == 48
    # 64 samplers each with a batch in flight fill the learner's max delay before any reaches the topic.
    p = Pacing(groups_per_step=32, max_delay_steps=4, max_backlog_groups=None)
    assert p.pause_reason(has_policy=True, spool_has_room=True, newest=7, current=7,
                          backlog=Pacing.backlog(0, {}, {}, learner_unread=0, in_flight=64 * 4)) == "behind"


def test_each_pause_reason_in_the_order_it_is_checked():
    p = Pacing(groups_per_step=4, max_delay_steps=2, max_backlog_groups=10)
    ok = dict(has_policy=True, spool_has_room=True, newest=5, current=5, backlog=0)
    assert p.pause_reason(**ok) is None
    assert p.pause_reason(**{**ok, "has_policy": False, "spool_has_room": False}) == "no_policy"
    assert p.pause_reason(**{**ok, "spool_has_room": False, "current": 0}) == "spool_full"
    assert p.pause_reason(**{**ok, "current": 2}) == "behind"                  # 3 versions behind > 2
    assert p.pause_reason(**{**ok, "current": 4, "backlog": 8}) == "behind"    # 1 behind + 2 queued steps
    assert p.pause_reason(**{**ok, "backlog": 12}) == "behind"                 # on the newest, 3 steps queued
    assert p.pause_reason(**{**ok, "backlog": 11}) == "backlog"                # 2 steps queued = max; over 10
    assert Pacing(64, 2, 10).pause_reason(**{**ok, "backlog": 11}) == "backlog"
    assert Pacing(64, 2, None).pause_reason(**{**ok, "backlog": 11}) is None   # no backlog bound


def test_a_group_is_too_stale_at_the_source_past_the_max_delay():
    p = Pacing(groups_per_step=4, max_delay_steps=2, max_backlog_groups=None)
    assert not p.too_stale(None, 0)
    assert not p.too_stale(7, 5) and p.too_stale(8, 5)


def test_a_slow_sampler_counts_the_steps_it_is_overtaken_for():
    period = StepPeriod()
    assert period.steps_during(13.0) == 0  # nothing seen yet
    for version, t in ((3, 0.7), (4, 2.0), (5, 6.0), (6, 10.0), (6, 11.0)):
        period.observe(version, t)
    assert period.seconds_per_step() == 4.0  # from the first whole interval on
    assert period.steps_during(13.0) == 3 and period.steps_during(2.6) == 0
    # no new version for 20 s: the learner slowed down (or waits for data): 13 s is no whole step
    assert period.seconds_per_step(now=30.0) == 20.0 and period.steps_during(13.0, now=30.0) == 0
    # a 13 s batch on the newest version with 1 step queued: 0 + 1 + 3 = 4, still usable; 2 queued: not
    assert not too_far_behind(6, 6, 32, 32, 4, generating_steps=3)
    assert too_far_behind(6, 6, 64, 32, 4, generating_steps=3)
    p = Pacing(groups_per_step=32, max_delay_steps=4, max_backlog_groups=None)
    assert p.pause_reason(has_policy=True, spool_has_room=True, newest=6, current=6, backlog=64,
                          generating_steps=3) == "behind"


def test_the_fleets_claims_are_limited_to_what_stays_within_the_max_delay():
    p = Pacing(groups_per_step=32, max_delay_steps=4, max_backlog_groups=None)
    assert p.in_flight_limit(None, None, 0) is None  # nothing published: no limit yet
    assert p.in_flight_limit(7, 7, 0) == 5 * 32       # groups 0..159 are used within 4 steps
    assert p.in_flight_limit(7, 6, 40, generating_steps=2) == 2 * 32 - 40
    assert p.in_flight_limit(9, 3, 0) == 0            # already too far behind: nothing may be claimed
    # the limit is the pause rule solved for the claims: one group more would be "behind"
    limit = p.in_flight_limit(7, 6, 40, generating_steps=1)
    assert not too_far_behind(7, 6, 40 + limit - 1, 32, 4, generating_steps=1)
    assert too_far_behind(7, 6, 40 + limit, 32, 4, generating_steps=1)


def test_a_sampler_waiting_for_the_next_version_makes_only_groups_fresh_when_used():
    """`sampler.wait_for_next_version`: a group made while the learner has a full batch, or has
    a version newer than the one loaded, would be stale when used: wait instead."""
    ok = dict(has_policy=True, spool_has_room=True, newest=5, current=5, backlog=0, learner_version=5)
    waiting = Pacing(groups_per_step=8, max_delay_steps=8, max_backlog_groups=8, wait_for_next_version=True)
    assert waiting.pause_reason(**ok) is None
    assert waiting.pause_reason(**{**ok, "backlog": 7}) is None            # the batch is not full yet
    assert waiting.pause_reason(**{**ok, "backlog": 8}) == "next_version"  # a step comes first
    assert waiting.pause_reason(**{**ok, "learner_version": 6}) == "next_version"  # made, not yet published
    assert waiting.pause_reason(**{**ok, "newest": 6, "learner_version": 6}) == "next_version"  # not yet loaded
    assert waiting.pause_reason(**{**ok, "newest": 6, "current": 6, "learner_version": 6}) is None
    assert waiting.pause_reason(**{**ok, "learner_version": None}) is None  # a learner that reported no step
    # the other reasons come first; without the setting a sampler generates ahead as before
    assert waiting.pause_reason(**{**ok, "backlog": 9}) == "backlog"
    ahead = Pacing(groups_per_step=8, max_delay_steps=8, max_backlog_groups=8)
    assert ahead.pause_reason(**{**ok, "backlog": 8, "learner_version": 6}) is None


def test_a_version_still_being_published_counts_toward_staleness():
    from pipeline.clients.run_state import RunView
    # The learner stepped to v8 and is uploading it; v7 is the newest published. A sampler on
    # v4 with nothing queued makes groups 4 behind v8 (usable at max delay 4); on v3, 5 (dropped).
    uploading = RunView(7, "m", {}, learner_version=8)
    assert uploading.version_at_use == 8
    assert too_far_behind(uploading.version_at_use, 3, 0, 32, 4)
    assert not too_far_behind(uploading.newest_version, 3, 0, 32, 4)  # the published version alone misses it
    assert not too_far_behind(uploading.version_at_use, 4, 0, 32, 4)
    assert RunView(7, "m", {}, learner_version=None).version_at_use == 7  # no report yet
    assert RunView(None, None, {}, learner_version=2).version_at_use is None  # nothing to load yet: no pacing


def test_a_pacing_margin_aims_inside_the_max_delay_and_still_judges_finished_groups_by_it():
    exact = Pacing(groups_per_step=32, max_delay_steps=4, max_backlog_groups=None)
    margin = Pacing(groups_per_step=32, max_delay_steps=4, max_backlog_groups=None, margin_steps=1)
    # on the newest version, k full batches queued ahead: a group made now is used k steps stale
    assert not exact.behind(10, 10, 5 * 32 - 1) and exact.behind(10, 10, 5 * 32)      # 4 ok, 5 dropped
    assert not margin.behind(10, 10, 4 * 32 - 1) and margin.behind(10, 10, 4 * 32)    # aims at 3
    # the fleet may hold claims up to the aimed staleness: one batch fewer with the margin
    assert exact.in_flight_limit(10, 10, 0) == 5 * 32 and margin.in_flight_limit(10, 10, 0) == 4 * 32
    # what is finished is still sent unless the learner would drop it
    assert not margin.too_stale(10, 6) and margin.too_stale(10, 5)
    assert Pacing(groups_per_step=8, max_delay_steps=0, max_backlog_groups=None, margin_steps=2).aim_steps == 0


def test_pauses_back_off_per_kind_count_stall_episodes_and_reset_on_generating():
    from pipeline.sampling.pacing import PAUSE_MAX_S, PAUSE_SECONDS, Pauses

    p = Pauses()
    assert [p.next("behind") for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]  # doubles up to 1 s
    assert [p.next("next_version") for _ in range(4)] == [0.02, 0.04, 0.08, PAUSE_MAX_S["next_version"]]
    assert p.next("no_policy") == PAUSE_SECONDS["no_policy"]  # a new kind starts short; not in the stats
    p.next("behind")  # still the same stall episode: not generated in between
    p.generated()
    assert p.last is None and p.next("behind") == 0.05
    p.yielded(1.5)
    totals = p.totals()
    assert totals["stalls_behind"] == 2 and totals["stalled_behind_s"] == round(2.55 + 0.05 + 0.05, 1)
    assert totals["waited_for_next_version_s"] == round(0.02 + 0.04 + 0.08 + 0.1, 1)
    assert totals["yielded_to_learner_s"] == 1.5 and p.yielded_s == 1.5
    assert totals["paused_s"] == round(2.65 + 0.24 + 1.5, 1)


def test_a_sampler_far_behind_catches_up_first_to_a_version_it_can_generate_at():
    """A joiner whose first keyframe took minutes holds v9 while the learner is at v22 (max delay
    8): it downloads v15 first, generates there while v15 -> v22 downloads, and a group it makes
    at v15 is still within the max delay after one more learner step."""
    pacing = Pacing(groups_per_step=4, max_delay_steps=8, max_backlog_groups=None)
    every_step = range(23)
    assert pacing.catch_up_to(22, 9, 0, 0, every_step) == 15
    assert pacing.behind(22, 9, 0) and not pacing.behind(23, 15, 0) and pacing.behind(24, 15, 0)
    # The groups queued ahead and the steps a batch takes count as `behind` counts them.
    assert pacing.catch_up_to(22, 9, 8, 1, every_step) == 18
    assert not pacing.behind(23, 18, 8, 1) and pacing.behind(24, 18, 8, 1)
    # Not behind, or nothing held, or no version near enough to generate at: the newest.
    assert pacing.catch_up_to(22, 15, 0, 0, every_step) == 22
    assert pacing.catch_up_to(22, None, 0, 0, every_step) == 22
    assert pacing.catch_up_to(None, 9, 0, 0, every_step) is None
    assert pacing.catch_up_to(22, 9, 32, 0, every_step) == 22
    # A pacing margin is aimed at as `behind` aims at it.
    assert Pacing(4, 8, None, margin_steps=2).catch_up_to(22, 9, 0, 0, every_step) == 17


def test_a_sampler_catching_up_names_only_a_version_it_has_seen_published():
    """A learner publishing every 4 steps (`learner.sync_every`) has no v15: the sampler takes the
    oldest version it saw published at or past it (v16), and the newest where it saw none there
    (as the steps of a test's tiny learner outran its polls, or a joiner has seen one pointer)."""
    pacing = Pacing(groups_per_step=4, max_delay_steps=8, max_backlog_groups=None)
    assert pacing.catch_up_to(22, 9, 0, 0, published=[8, 12, 16, 20]) == 16
    assert not pacing.behind(22, 16, 0)
    assert pacing.catch_up_to(22, 9, 0, 0, published=[4, 8, 12]) == 22
    assert pacing.catch_up_to(22, 9, 0, 0, published=[20]) == 20
    assert pacing.catch_up_to(22, 9, 0) == 22  # nothing seen published: the newest
    period = StepPeriod(window=3)
    for version, t in [(8, 0.0), (12, 1.0), (12, 1.5), (16, 2.0), (20, 3.0)]:
        period.observe(version, t)
    assert period.versions() == [12, 16, 20]


def test_a_sampler_far_behind_asks_for_the_version_it_can_generate_at_then_the_newest(tmp_path):
    """`Sampler.refresh_weights` with the pacing above and `PolicyFollower.on_the_way`: the version
    asked for and its manifest's key (the download itself recorded, not run)."""
    import logging
    from types import SimpleNamespace

    from pipeline.clients.run_state import RunView
    from pipeline.config import HeteroConfig
    from pipeline.weights.follower import PolicyFollower
    from pipeline.weights.store import CheckpointStore
    from producers.sampler import Sampler

    def asked(current: int, not_found=(), refused=(), every: int = 1, newest: int = 22, first_batch_s=1.0,
              step_s=None, download_s=None, **sampler) -> tuple[int, str]:
        cfg = HeteroConfig.model_validate({"run": {"name": "far"}, "learner": {"max_delay_steps": 8},
                                           "sampler": sampler})
        s = Sampler(cfg, sampler_id="far-1")
        requests = []
        store = CheckpointStore(None, "bucket", "far")
        s.handles = SimpleNamespace(store=store)
        s.policy = PolicyFollower(store, tmp_path, logging.getLogger("test.far"))
        s.policy.version, s.policy.not_found, s.policy.refused = current, set(not_found), set(refused)
        s.policy.request = lambda version, key, forced: requests.append((version, key))
        s.backlog = lambda view: 0
        s.last_batch_s, s.policy.last_download_s = first_batch_s, download_s
        now = time.monotonic()
        for version in range(0, 23, every):  # the pointers it read (long ago: no step's length known)
            s.step_period.observe(version, now - (22 - version) * step_s if step_s else float(version))
        s.refresh_weights(RunView(newest, f"far/v{newest}/manifest.json", {}, learner_version=22))
        return requests[-1]

    assert asked(9) == (15, "far/v15/manifest.json")  # groups at v15 while v15 -> v22 downloads
    assert asked(15) == (22, "far/v22/manifest.json")  # near enough: the newest
    # Before a first batch is timed (a joiner), the newest: how stale its groups come is unknown.
    assert asked(9, first_batch_s=None) == (22, "far/v22/manifest.json")
    assert asked(9, not_found={15}) == (22, "far/v22/manifest.json")  # pruned on the way: the newest
    assert asked(9, not_found={16}) == (22, "far/v22/manifest.json")  # and so, likely, what came before it
    assert asked(9, not_found={12}) == (15, "far/v15/manifest.json")  # an older one gone says nothing of v15
    assert asked(9, refused={"far/v15/manifest.json"}) == (22, "far/v22/manifest.json")  # never asked again
    # A step a second: the steps its last batch (1.5 s) and its last download (2 s) took are spared.
    assert asked(9, first_batch_s=1.5, step_s=1.0) == (16, "far/v16/manifest.json")
    assert asked(9, first_batch_s=1.5, step_s=1.0, download_s=2.0) == (18, "far/v18/manifest.json")
    assert asked(9, first_batch_s=1.5, step_s=1.0, download_s=8.0) == (22, "far/v22/manifest.json")
    # Published every 4 steps: v16, the oldest near enough that exists (the learner is at step 22).
    assert asked(9, every=4, newest=20) == (16, "far/v16/manifest.json")
    # A simulated refresh delay loads the newest version once it says so (a study's model of a refresh).
    delayed = {"delays": {"unit": "steps", "refresh": {"kind": "fixed", "value": 1}}}
    assert asked(9, **delayed) == (22, "far/v22/manifest.json")


def test_a_pointer_that_moved_back_or_is_not_the_learners_is_not_followed():
    from pipeline.clients.run_state import RunView
    from pipeline.wire.signing import SigningKey
    from producers.sampler import pointer_problem

    assert pointer_problem("far", RunView(7, "far/v7/manifest.json", {}), 9, None) == (
        "it moved back from v9 to v7 (a rollback)")
    assert pointer_problem("far", RunView(12, "far/v12/manifest.json", {}), 9, None) is None
    assert pointer_problem("far", RunView(12, "far/v12/manifest.json", {}), None, None) is None
    unsigned = pointer_problem("far", RunView(12, "far/v12/manifest.json", {}), 9, SigningKey.generate().public)
    assert unsigned is not None and "sign" in unsigned


def test_the_fleets_unjudged_groups_are_counted_per_sampler_and_bounded_each():
    completed = {"honest": "40", "hoarder": "5000", "quiet": "3", "odd": "x"}
    discarded = {"honest": "5"}
    judged = {"honest": "30", "quiet": "9"}  # judged more than it completed (a resent copy): 0, not -6
    assert fleet_unjudged(completed, discarded, judged) == 5 + 5000
    # each sampler's at most four batches: one that completes claims and sends nothing holds back 32
    assert fleet_unjudged(completed, discarded, judged, each_at_most=32) == 5 + 32
    assert fleet_unjudged({}, {}, {"ghost": "4"}) == 0
