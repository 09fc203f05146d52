"""The update log's effective view: last entry per step wins, rewinds void lost steps."""

from pipeline.records.update_log import UpdateEntry, UsedGroup, append_entry, dedup_by_step, read_entries_file, rewind_entry


def _step(step: int, offset: int) -> UpdateEntry:
    return UpdateEntry(step=step, policy_version=step, loss_type="gepo", time=0.0,
                       used=[UsedGroup(0, offset, f"id{offset}", 0, 0, 1.0, 0.1)])


def test_a_crash_after_the_checkpoint_voids_the_steps_logged_after_it():
    # Learner A: steps 1-4 logged, checkpoint at 2, killed. Learner B resumes at 2, redoes 3.
    log = [rewind_entry(0, "gepo"), _step(1, 0), _step(2, 1), _step(3, 2), _step(4, 3),
           rewind_entry(2, "gepo"), _step(3, 3)]
    effective = dedup_by_step(log)
    assert [(e.step, e.used[0].offset) for e in effective] == [(1, 0), (2, 1), (3, 3)]
    assert all(e.kind == "step" for e in effective)


def test_file_round_trip_skips_a_torn_line(tmp_path):
    for entry in (rewind_entry(0, "gepo"), _step(1, 0), _step(2, 1), _step(3, 2)):
        append_entry(tmp_path, entry)
    with open(tmp_path / "updates.jsonl", "a") as f:
        f.write('{"schema": 1, "step": 4, "us')  # killed mid-write
    append_entry(tmp_path, rewind_entry(2, "gepo"))
    append_entry(tmp_path, _step(3, 5))
    assert [(e.step, e.used[0].offset) for e in read_entries_file(tmp_path / "updates.jsonl")] == [
        (1, 0), (2, 1), (3, 5)]


def test_a_late_copy_of_a_learner_s_own_rewind_does_not_void_its_steps():
    def step(n, attempt):
        e = _step(n, n)
        e.attempt = attempt
        return e

    log = [rewind_entry(0, "gepo", "A"), step(1, "A"), step(2, "A"), rewind_entry(1, "gepo", "B"),
           step(2, "B"), step(3, "B"), rewind_entry(1, "gepo", "B")]  # B's rewind re-sent late
    assert [(e.step, e.attempt) for e in dedup_by_step(log)] == [(1, "A"), (2, "B"), (3, "B")]


def test_companion_topics_are_named_after_the_run():
    from pipeline.records.update_log import dead_letter_topic, updates_topic

    assert updates_topic("demo-20261122-105611.rollouts") == "demo-20261122-105611.updates"
    assert dead_letter_topic("demo-20261122-105611.rollouts") == "demo-20261122-105611.dead"
    assert updates_topic("my-topic") == "my-topic.updates"  # a custom rollout topic
