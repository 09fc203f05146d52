"""The learner publishes a version it holds back (between `learner.sync_every` steps) once groups
have kept coming without filling a batch (consumers/learner_checkpoints.py, `publish_if_starved`):
samplers whose version's groups cannot be used (its checkpoint altered in the bucket before a
validator read it, so every verdict is `unverifiable`) otherwise hold the run until it ends."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from consumers.learner_checkpoints import STARVED_PUBLISH_S, Checkpoints


def checkpoints(published: int) -> Checkpoints:
    made = Checkpoints.__new__(Checkpoints)
    made.published_version, made.lcfg, made.log = published, SimpleNamespace(sync_every=2), logging.getLogger("test")
    made.saved = []
    made.save = lambda version, step, **kwargs: made.saved.append((version, kwargs))
    return made


def test_a_held_version_is_published_once_groups_come_without_a_step_for_long_enough(caplog):
    starved = checkpoints(published=2)
    with caplog.at_level(logging.WARNING, logger="test"):
        starved.publish_if_starved(3, 3, STARVED_PUBLISH_S + 1)
    assert starved.saved == [(3, {"policy": True, "state": False})]
    assert "publishing v3 now" in caplog.text


def test_nothing_is_published_early_or_twice():
    recent = checkpoints(published=2)
    recent.publish_if_starved(3, 3, STARVED_PUBLISH_S - 1)
    published = checkpoints(published=3)  # sync_every 1, or already published
    published.publish_if_starved(3, 3, 60)
    assert recent.saved == [] and published.saved == []
