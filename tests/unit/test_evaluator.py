"""Which published versions the evaluator scores."""

from producers.evaluator import _due
from pipeline.config import load_config


def cfg(every, max_steps=100):
    return load_config(None, [f"eval.every={every}", f"learner.max_steps={max_steps}"], env={})


def test_scores_each_multiple_once_even_when_published_versions_skip_it():
    c = cfg(every=10)
    assert _due(0, set(), c)
    assert not _due(9, {0}, c)
    assert _due(10, {0}, c)
    assert _due(12, {0}, c)        # v10 was never published (sync_every=4): v12 stands in for it
    assert not _due(18, {0, 12}, c)
    assert _due(20, {0, 12}, c)
    assert not _due(20, {0, 12, 20}, c)


def test_the_last_version_is_always_scored():
    c = cfg(every=30, max_steps=100)
    assert _due(100, {0, 90}, c)
    assert not _due(95, {0, 90}, c)


def test_nothing_before_the_start_version_but_v0_and_the_last():
    c = load_config(None, ["eval.every=25", "eval.start_version=100", "learner.max_steps=150"], env={})
    assert _due(0, set(), c)                        # the start is always scored
    assert not _due(25, {0}, c) and not _due(99, {0}, c)
    assert _due(100, {0}, c) and _due(125, {0, 100}, c) and _due(150, {0, 100, 125}, c)
    short = load_config(None, ["eval.every=25", "eval.start_version=100", "learner.max_steps=60"], env={})
    assert _due(60, {0}, short)                     # a run that ends before the start still gets its last
