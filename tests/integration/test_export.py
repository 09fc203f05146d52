"""Export through the real broker: a topic and its update log survive a Parquet round trip."""

import uuid

import pyarrow.parquet as pq
import pytest

from pipeline.records.archive import ArchiveError, export_topic, read_archive
from pipeline.clients.topics import TopicWriter, ensure_topic, read_topic
from pipeline.wire.rollout import decode_rollout
from pipeline.records.update_log import DroppedGroup, SkippedMessage, UpdateEntry, UsedGroup, updates_topic
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration


def fresh_topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}.rollouts"


def publish_update_log(bootstrap: str, topic: str, entries: list[UpdateEntry]) -> None:
    """Write the log as the learner does: one message per step, key = step."""
    ensure_topic(bootstrap, updates_topic(topic))
    sink = TopicWriter(bootstrap, updates_topic(topic))
    for entry in entries:
        sink.send_raw(entry.to_json().encode(), key=str(entry.step).encode())
    sink.close()


def test_topic_and_update_log_round_trip_through_parquet(local_stack, tmp_path):
    bootstrap, topic = local_stack.kafka_bootstrap, fresh_topic("export")
    ensure_topic(bootstrap, topic, partitions=2)
    sink = TopicWriter(bootstrap, topic)
    rollouts = [make_rollout(policy_version=v, prompt_id=f"p{v}") for v in range(5)]
    acks = sink.send_many(rollouts)
    garbage_at = sink.send_raw(b"garbage")
    sink.close()
    where = dict(zip((r.rollout_id for r in rollouts), acks))

    def used(i: int, staleness: int) -> UsedGroup:
        return UsedGroup(*where[rollouts[i].rollout_id], rollouts[i].rollout_id, rollouts[i].policy_version,
                         staleness, 1.0, age_s=0.25 * i)

    log = [
        UpdateEntry(step=1, policy_version=1, loss_type="gepo", time=100.0, used=[used(3, 0), used(1, 1)],
                    dropped=[DroppedGroup(*where[rollouts[0].rollout_id], rollouts[0].rollout_id, 0, 7,
                                          "too_stale_steps")],
                    malformed=[SkippedMessage(*garbage_at, "not msgpack: ExtraData")]),
        UpdateEntry(step=2, policy_version=2, loss_type="gepo", time=101.0, used=[used(2, 1)], vocab_size=20,
                    tokenizer_sha="cd" * 32),
    ]
    publish_update_log(bootstrap, topic, log)

    out = tmp_path / "export.parquet"
    summary = export_topic(bootstrap, topic, out, None)
    assert (summary.messages, summary.decodable, summary.in_update_log, summary.steps) == (6, 5, 5, 2)

    originals = read_topic(bootstrap, topic)
    back = read_archive(out, None)
    assert back.topic == topic
    assert [(r.partition, r.offset, r.value) for r in back.records] == \
        [(r.partition, r.offset, r.value) for r in originals]
    assert back.records == originals  # headers and broker timestamps too
    by_id = {r.rollout_id: r for r in rollouts}
    decoded = [decode_rollout(r.value) for r in back.records if r.value != b"garbage"]
    assert sorted(decoded, key=lambda r: r.prompt_id) == rollouts
    assert all(d == by_id[d.rollout_id] for d in decoded)
    assert back.update_log == log

    rows = {(row["partition"], row["offset"]): row for row in pq.read_table(out).to_pylist()}
    expected = {  # (partition, offset) -> verdict, update_step, batch_index, recorded_staleness
        where[rollouts[3].rollout_id]: ("used", 1, 0, 0),
        where[rollouts[1].rollout_id]: ("used", 1, 1, 1),
        where[rollouts[0].rollout_id]: ("dropped", 1, None, 7),
        garbage_at: ("malformed", 1, None, None),
        where[rollouts[2].rollout_id]: ("used", 2, 0, 1),
        where[rollouts[4].rollout_id]: (None, None, None, None),
    }
    got = {key: (row["verdict"], row["update_step"], row["batch_index"], row["recorded_staleness"])
           for key, row in rows.items()}
    assert got == expected
    assert rows[garbage_at]["decode_error"].startswith("not msgpack")


def test_messages_produced_in_one_batch_are_all_exported(local_stack, tmp_path):
    """The samplers' send_many packs several rollouts into one Kafka batch; none may be lost."""
    bootstrap, topic = local_stack.kafka_bootstrap, fresh_topic("export-batched")
    ensure_topic(bootstrap, topic)
    sink = TopicWriter(bootstrap, topic)
    rollouts = [make_rollout(prompt_id=f"p{i}") for i in range(20)]
    acks = sink.send_many(rollouts)
    sink.close()
    summary = export_topic(bootstrap, topic, tmp_path / "x.parquet", None)
    back = read_archive(tmp_path / "x.parquet", None)
    assert summary.messages == 20
    assert [(r.partition, r.offset) for r in back.records] == sorted(acks)
    assert [decode_rollout(r.value) for r in back.records] == rollouts


def test_export_of_a_topic_without_update_log(local_stack, tmp_path):
    bootstrap, topic = local_stack.kafka_bootstrap, fresh_topic("export-nolog")
    ensure_topic(bootstrap, topic)
    sink = TopicWriter(bootstrap, topic)
    sink.send(make_rollout())
    sink.close()
    summary = export_topic(bootstrap, topic, tmp_path / "x.parquet", None)
    assert (summary.messages, summary.has_update_log) == (1, False)
    assert read_archive(tmp_path / "x.parquet", None).update_log is None


def test_nonexistent_topic_is_a_one_line_error(local_stack, tmp_path):
    bootstrap, topic = local_stack.kafka_bootstrap, fresh_topic("export-missing")
    with pytest.raises(ArchiveError) as info:
        export_topic(bootstrap, topic, tmp_path / "x.parquet", None)
    assert str(info.value) == f"topic {topic} does not exist on Kafka at {bootstrap}"
    assert not (tmp_path / "x.parquet").exists()


def test_empty_topic_is_a_one_line_error(local_stack, tmp_path):
    bootstrap, topic = local_stack.kafka_bootstrap, fresh_topic("export-empty")
    ensure_topic(bootstrap, topic)
    with pytest.raises(ArchiveError) as info:
        export_topic(bootstrap, topic, tmp_path / "x.parquet", None)
    assert str(info.value) == f"topic {topic} on Kafka at {bootstrap} is empty"
    assert not list(tmp_path.iterdir())
