"""Parquet export without a broker: one-line errors, the update-log join, exact round trip.

The Kafka reads are replaced by in-memory records here; tests/integration/test_export.py
does the same through the real broker.
"""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.records import archive
from pipeline.records.archive import ArchiveError, export_topic, read_archive, verdicts_by_offset
from pipeline.clients.topics import RawRecord
from pipeline.wire.rollout import decode_rollout, encode_rollout
from pipeline.records.update_log import (DroppedGroup, DuplicateGroup, SkippedMessage, UpdateEntry, UsedGroup,
                                         parse_update_log)
from pipeline.wire.signing import SigningKey
from tests.unit.test_rollout import make_rollout

TOPIC = "unit.rollouts"
LEARNER = SigningKey.generate()


def record_of(rollout, partition: int, offset: int) -> RawRecord:
    return RawRecord(partition, offset, encode_rollout(rollout), rollout.headers(), 1_700_000_000_000 + offset)


def fake_kafka(monkeypatch, records: list[RawRecord], update_log, signer=LEARNER, extra_lines=()) -> None:
    """The topic's `records`, and its update log: `update_log` signed by `signer`, then `extra_lines`."""
    lines = None if update_log is None else [e.to_json(signer).encode() for e in update_log] + list(extra_lines)
    monkeypatch.setattr(archive, "topic_partitions", lambda bootstrap, topic: sorted({r.partition for r in records}))
    monkeypatch.setattr(archive, "read_topic", lambda bootstrap, topic: list(records))
    monkeypatch.setattr(archive, "read_update_log", lambda bootstrap, topic, trusted: None if lines is None else
                        parse_update_log([RawRecord(0, i, v, [], 0) for i, v in enumerate(lines)], trusted))


@pytest.fixture
def run_data():
    rollouts = [make_rollout(policy_version=v, prompt_id=f"p{v}", rewards=[1.0, 0.0, float(v % 2)]) for v in range(4)]
    records = [record_of(r, 0, i) for i, r in enumerate(rollouts[:3])] + [
        RawRecord(0, 3, b"garbage", [], 1_700_000_000_003), record_of(rollouts[3], 1, 0)]
    r = rollouts
    log = [
        UpdateEntry(step=1, policy_version=1, loss_type="gepo", time=10.0,
                    used=[UsedGroup(1, 0, r[3].rollout_id, 3, 0, 1.0, age_s=0.5),
                          UsedGroup(0, 1, r[1].rollout_id, 1, 2, 0.5)],
                    dropped=[DroppedGroup(0, 0, r[0].rollout_id, 0, 9, "too_stale_steps", age_s=7.25)],
                    malformed=[SkippedMessage(0, 3, "not msgpack: ExtraData")], vocab_size=20,
                    tokenizer_sha="ab" * 32),
        UpdateEntry(step=2, policy_version=2, loss_type="gepo", time=11.0,
                    duplicates=[DuplicateGroup(0, 2, r[2].rollout_id)]),
    ]
    return rollouts, records, log


def test_export_then_read_is_exact(monkeypatch, tmp_path, run_data):
    rollouts, records, log = run_data
    fake_kafka(monkeypatch, records, log)
    out = tmp_path / "sub" / "run.parquet"
    summary = export_topic("kafka:9092", TOPIC, out, LEARNER.public)
    assert (summary.messages, summary.decodable, summary.in_update_log, summary.steps) == (5, 4, 5, 2)
    assert summary.has_update_log and summary.path == out
    assert [p.name for p in out.parent.iterdir()] == ["run.parquet"]  # no temporary file left behind

    back = read_archive(out, LEARNER.public)
    assert back.topic == TOPIC
    assert back.records == records  # values, headers, partition, offset, timestamp
    assert back.update_log == log
    assert [decode_rollout(r.value) for r in back.records if r.value != b"garbage"] == rollouts


def test_columns_carry_decoded_fields_and_the_learner_verdict(monkeypatch, tmp_path, run_data):
    rollouts, records, log = run_data
    fake_kafka(monkeypatch, records, log)
    export_topic("kafka:9092", TOPIC, tmp_path / "run.parquet", LEARNER.public)
    table = pq.read_table(tmp_path / "run.parquet")
    assert table.schema.remove_metadata() == archive.COLUMNS
    rows = table.to_pylist()
    assert [(row["partition"], row["offset"]) for row in rows] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert [row["verdict"] for row in rows] == ["dropped", "used", "duplicate", "malformed", "used"]
    assert [row["update_step"] for row in rows] == [1, 1, 2, 1, 1]
    assert [row["batch_index"] for row in rows] == [None, 1, None, None, 0]
    assert [row["recorded_staleness"] for row in rows] == [9, 2, None, None, 0]
    assert [row["weight"] for row in rows] == [None, 0.5, None, None, 1.0]
    assert [row["drop_reason"] for row in rows] == ["too_stale_steps", None, None, "not msgpack: ExtraData", None]
    assert [row["policy_version"] for row in rows] == [0, 1, 2, None, 3]
    assert [row["prompt_id"] for row in rows] == ["p0", "p1", "p2", None, "p3"]
    means = [row["reward_mean"] for row in rows]
    assert means[3] is None and means[:3] + means[4:] == pytest.approx([1 / 3, 2 / 3, 1 / 3, 2 / 3])
    assert rows[3]["decode_error"].startswith("not msgpack") and rows[3]["rollout_id"] is None
    assert rows[4]["group_size"] == 3 and rows[4]["rollout_id"] == rollouts[3].rollout_id
    assert rows[0]["sampler_id"] == "host-1-abc" and rows[0]["topic"] == TOPIC


def test_export_without_update_log_has_null_verdicts_and_no_log(monkeypatch, tmp_path, run_data):
    _, records, _ = run_data
    fake_kafka(monkeypatch, records, None)
    summary = export_topic("kafka:9092", TOPIC, tmp_path / "run.parquet", LEARNER.public)
    assert (summary.in_update_log, summary.steps, summary.has_update_log) == (0, 0, False)
    back = read_archive(tmp_path / "run.parquet", LEARNER.public)
    assert back.update_log is None and back.records == records
    assert set(pq.read_table(tmp_path / "run.parquet").column("verdict").to_pylist()) == {None}


def test_a_non_integer_policy_version_header_is_null_but_kept_in_headers(monkeypatch, tmp_path):
    records = [RawRecord(0, 0, b"x", [("policy_version", b"v7"), ("odd", None)], 5)]
    fake_kafka(monkeypatch, records, None)
    export_topic("kafka:9092", TOPIC, tmp_path / "run.parquet", LEARNER.public)
    assert pq.read_table(tmp_path / "run.parquet").column("policy_version").to_pylist() == [None]
    assert read_archive(tmp_path / "run.parquet", LEARNER.public).records == records


def test_first_step_wins_when_a_log_lists_an_offset_twice():
    entries = [UpdateEntry(1, 1, "gepo", 0.0, duplicates=[DuplicateGroup(0, 5, "a")]),
               UpdateEntry(2, 2, "gepo", 0.0, used=[UsedGroup(0, 5, "a", 1, 1, 1.0)])]
    assert verdicts_by_offset(entries)[(0, 5)]["update_step"] == 1


def test_unknown_and_empty_topics_are_one_line_errors(monkeypatch, tmp_path):
    fake_kafka(monkeypatch, [], None)
    with pytest.raises(ArchiveError, match=r"^topic t does not exist on Kafka at k:1$"):
        export_topic("k:1", "t", tmp_path / "x.parquet", LEARNER.public)
    monkeypatch.setattr(archive, "topic_partitions", lambda bootstrap, topic: [0])
    with pytest.raises(ArchiveError, match=r"^topic t on Kafka at k:1 is empty$"):
        export_topic("k:1", "t", tmp_path / "x.parquet", LEARNER.public)
    assert not list(tmp_path.iterdir())


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(ArchiveError, match=r"^\S+nope\.parquet does not exist$"):
        read_archive(tmp_path / "nope.parquet", LEARNER.public)


def test_a_file_that_is_not_parquet_is_a_one_line_error(tmp_path):
    path = tmp_path / "notes.parquet"
    path.write_text("just some text\n")
    with pytest.raises(ArchiveError, match=r"notes\.parquet is not a Parquet file") as info:
        read_archive(path, LEARNER.public)
    assert "\n" not in str(info.value)


def test_parquet_without_heterorl_metadata_is_refused(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"partition": [0], "offset": [0]}), path)
    with pytest.raises(ArchiveError) as info:
        read_archive(path, LEARNER.public)
    assert str(info.value) == f"{path} is not a heterorl export (no heterorl.schema metadata)"


def test_a_future_schema_is_refused(tmp_path):
    path = tmp_path / "future.parquet"
    pq.write_table(pa.table({"partition": [0]}).replace_schema_metadata({"heterorl.schema": "2"}), path)
    with pytest.raises(ArchiveError, match="schema '2'; this version reads schema 1"):
        read_archive(path, LEARNER.public)


def test_docs_describe_every_column_with_its_type():
    """docs/schema.md is the normative description: it must list the columns the code writes."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "schema.md").read_text()
    section = doc[doc.index("## Parquet export"):]
    documented = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            documented[cells[0].strip("`")] = cells[1]
    assert list(documented) == archive.COLUMNS.names
    for field in archive.COLUMNS:
        arrow_name = {"double": "float64"}.get(str(field.type), str(field.type))
        assert documented[field.name].split("<")[0] == arrow_name.split("<")[0], field.name


def test_the_export_keeps_the_learners_signatures_and_leaves_out_what_it_did_not_sign(monkeypatch, tmp_path,
                                                                                       run_data):
    """An update-log record the learner did not sign is not exported; a replay of the file checks the
    entries it holds again, so a file made without the learner's key (or edited) is not trusted either."""
    _, records, log = run_data
    forged = UpdateEntry(0, 0, "gepo", 0.0, kind="rewind", attempt="forger").to_json().encode()
    fake_kafka(monkeypatch, records, log, extra_lines=[b"this is not json", forged])
    summary = export_topic("kafka:9092", TOPIC, tmp_path / "run.parquet", LEARNER.public)
    assert summary.steps == 2 and summary.refused_update_records == {"not_json": 1, "unsigned": 1}
    back = read_archive(tmp_path / "run.parquet", LEARNER.public)
    assert back.update_log == log and all(e.signature for e in back.update_log)
    assert read_archive(tmp_path / "run.parquet", SigningKey.generate().public).update_log == []

    fake_kafka(monkeypatch, records, log, signer=None)  # a run without signatures, exported as such
    export_topic("kafka:9092", TOPIC, tmp_path / "unsigned.parquet", None)
    assert read_archive(tmp_path / "unsigned.parquet", None).update_log == log
    assert read_archive(tmp_path / "unsigned.parquet", LEARNER.public).update_log == []
