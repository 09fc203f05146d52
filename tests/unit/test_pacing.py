"""A sampler's pause rules, without servers: each named reason, in order, and the backlog."""

from pipeline.pacing import Pacing, too_far_behind


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
