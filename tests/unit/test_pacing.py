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
    # 3 waiting here; partition 0 acknowledged up to 100, learner at 90; partition 1 not read at all.
    assert Pacing.backlog(3, {0: 100, 1: 5}, {0: 90}) == 3 + 10 + 5
    assert Pacing.backlog(0, {0: 100}, {0: 120}) == 0  # the learner is past what we know of


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
