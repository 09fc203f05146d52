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


def _records(lines):
    from pipeline.clients.topics import RawRecord

    return [RawRecord(0, i, line if isinstance(line, bytes) else line.encode(), [], 0) for i, line in enumerate(lines)]


def test_only_entries_the_learner_signed_count_and_a_genuine_entry_sent_again_is_refused():
    """A reader given the learner's public key uses only what that key signed; the learner's own
    records, sent again later (a replay of the log's past), change nothing either."""
    from pipeline.records.update_log import parse_update_log
    from pipeline.wire.signing import SigningKey

    learner, other = SigningKey.generate(), SigningKey.generate()
    a1 = [rewind_entry(0, "gepo", attempt="a1"), *(UpdateEntry(s, s, "gepo", 0.0, attempt="a1") for s in (1, 2, 3))]
    a2 = [rewind_entry(2, "gepo", attempt="a2"), UpdateEntry(3, 4, "gepo", 0.0, attempt="a2")]
    signed = [e.to_json(learner) for e in a1 + a2]
    log = parse_update_log(_records(signed + [
        signed[0],  # a1's rewind to step 0, again: it would void a2's step 3
        signed[3],  # a1's step 3, again: it would replace a2's
        signed[4],  # a2's own rewind, again
        a2[1].to_json(),  # unsigned
        a2[1].to_json(other),  # another key
        "[1, 2]",  # JSON, no entry
        b"\xff\xfe",  # no JSON at all
    ]), learner.public)
    assert [(e.step, e.policy_version, e.attempt) for e in log.entries] == [(1, 1, "a1"), (2, 2, "a1"), (3, 4, "a2")]
    assert [r.offset for r in log.refused] == [6, 7, 8, 9, 10, 11, 12]
    assert log.refused_by_reason() == {"sent_again": 3, "unsigned": 1, "signature": 1, "not_json": 2}
    # without a key (a run recorded before signing) every readable entry is taken as it is
    assert [e.step for e in parse_update_log(_records([e.to_json() for e in a1]), None).entries] == [1, 2, 3]


def test_a_signed_entry_written_out_again_keeps_its_signature():
    """An export writes the entries it read: a replay of the file can check them again."""
    from pipeline.records.update_log import parse_update_log
    from pipeline.wire.signing import SigningKey

    learner = SigningKey.generate()
    entry = UpdateEntry(1, 1, "gepo", 12.5, used=[UsedGroup(0, 3, "r", 0, 1, 0.5, age_s=0.25)], attempt="a1")
    read = parse_update_log(_records([entry.to_json(learner)]), learner.public).entries[0]
    again = parse_update_log(_records([read.to_json()]), learner.public)
    assert again.entries == [entry] and not again.refused
