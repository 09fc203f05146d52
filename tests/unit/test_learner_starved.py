"""The learner publishes a version it holds back (between `learner.sync_every` steps) once groups
have kept coming without filling a batch (consumers/learner.py, `publish_if_starved`): samplers
whose version's groups cannot be used (its checkpoint altered in the bucket before a validator
read it, so every verdict is `unverifiable`) otherwise hold the run until it ends."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from consumers.learner import STARVED_PUBLISH_S, Learner


def learner(published: int, version: int, since_step_s: float) -> SimpleNamespace:
    saved: list[dict] = []
    return SimpleNamespace(published_version=published, version=version, saved=saved,
                           last_step_at=time.monotonic() - since_step_s, lcfg=SimpleNamespace(sync_every=2),
                           log=logging.getLogger("test"),
                           save_checkpoint=lambda **kwargs: saved.append(kwargs))


def test_a_held_version_is_published_once_groups_come_without_a_step_for_long_enough(caplog):
    starved = learner(published=2, version=3, since_step_s=STARVED_PUBLISH_S + 1)
    with caplog.at_level(logging.WARNING, logger="test"):
        Learner.publish_if_starved(starved)
    assert starved.saved == [{"policy": True, "state": False}]
    assert "publishing v3 now" in caplog.text


def test_nothing_is_published_early_or_twice():
    recent = learner(published=2, version=3, since_step_s=STARVED_PUBLISH_S - 1)
    Learner.publish_if_starved(recent)
    published = learner(published=3, version=3, since_step_s=60)  # sync_every 1, or already published
    Learner.publish_if_starved(published)
    assert recent.saved == [] and published.saved == []
