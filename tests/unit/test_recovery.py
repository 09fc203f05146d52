"""The learner's recovery decisions (pipeline/weights/recovery.py): which version a resumed
learner continues as, and when its recovery state is due."""

import pytest

from pipeline.weights.recovery import RecoverySchedule, resume_version


@pytest.mark.parametrize("state_version, published, expected", [
    (0, [], (0, True)),                       # a fresh run: the base model is published as v0
    (0, [0], (0, False)),                     # killed before its first step: v0 is the base already
    (3, [0, 1, 2, 3], (3, False)),            # a clean restart: nothing was lost
    (3, [0, 1, 2, 3, 4, 5], (6, True)),       # v4, v5 were lost with the learner: never reused
    (0, [0, 1, 2], (3, True)),                # killed before its first recovery state
    (10, [0, 7, 8], (10, True)),              # sync_every > 1: the state's version was never published
    (3, [0, 1, 2, 3, 9], (10, True)),         # a version left by an older, crashed learner counts too
])
def test_a_resumed_learner_never_reuses_a_published_version(state_version, published, expected):
    version, publish = resume_version(state_version, published)
    assert (version, publish) == expected
    assert version not in published or not publish  # a number already published is only kept as is


def test_the_recovery_state_is_due_by_steps_or_seconds_whichever_first():
    schedule = RecoverySchedule(every_steps=10, every_s=600.0, last_step=0, last_at=0.0)
    assert not schedule.due(9, 599.0)
    assert schedule.due(10, 1.0)
    assert schedule.due(3, 600.0)
    schedule.written(3, 600.0)
    assert not schedule.due(3, 5000.0)  # never twice for one step
    assert not schedule.due(12, 700.0) and schedule.due(13, 700.0)
    by_time = RecoverySchedule(every_steps=0, every_s=60.0)
    assert not by_time.due(1000, 59.0) and by_time.due(1, 60.0)
    by_steps = RecoverySchedule(every_steps=2, every_s=None)
    assert not by_steps.due(1, 10**9) and by_steps.due(2, 0.0)
    only_at_the_end = RecoverySchedule(every_steps=0, every_s=None)
    assert not only_at_the_end.due(10**6, 10**9)


def test_an_empty_recovery_state_is_never_uploaded(tmp_path):
    """A state with no files would be taken for the newest one, and no learner could resume from it."""
    from pipeline.weights.recovery import save_recovery_state

    (tmp_path / "s3").mkdir()
    for snapshot in (tmp_path / "s3", tmp_path / "missing"):
        with pytest.raises(FileNotFoundError, match="the recovery state of step 3 has no files"):
            save_recovery_state(None, 3, snapshot, {"step": 3})
