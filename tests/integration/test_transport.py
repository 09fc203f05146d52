"""Rollouts through the real broker: bytes, headers and offsets survive exactly."""

import pytest

from pipeline.clients.topics import TopicWriter, TopicReader, end_offsets, ensure_topic
from pipeline.wire.rollout import decode_rollout, header_value
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration


def test_rollout_round_trip_through_the_broker(local_stack):
    topic = "transport-roundtrip.rollouts"
    ensure_topic(local_stack.kafka_bootstrap, topic, partitions=1)
    sink = TopicWriter(local_stack.kafka_bootstrap, topic)
    sent = [make_rollout(policy_version=v, prompt_id=f"p{v}") for v in range(5)]
    acks = [sink.send(r) for r in sent]
    sink.close()
    assert [offset for _, offset in acks] == list(range(5))
    assert end_offsets(local_stack.kafka_bootstrap, topic) == {0: 5}

    source = TopicReader(local_stack.kafka_bootstrap, topic)
    records = []
    for _ in range(20):
        records += source.poll(1.0)
        if len(records) >= 5:
            break
    assert [r.offset for r in records] == list(range(5))
    assert [decode_rollout(r.value) for r in records] == sent
    assert [header_value(r.headers, "policy_version") for r in records] == [str(v) for v in range(5)]
    assert source.positions() == {0: 5} and source.lag() == 0
    source.close()

    # Resuming from a stored offset reads exactly the rest.
    resumed = TopicReader(local_stack.kafka_bootstrap, topic, start_offsets={0: 3})
    rest = []
    for _ in range(20):
        rest += resumed.poll(1.0)
        if len(rest) >= 2:
            break
    resumed.close()
    assert [decode_rollout(r.value).prompt_id for r in rest] == ["p3", "p4"]


def test_missing_topic_is_a_clear_error(local_stack):
    from pipeline.clients.services import ServiceUnavailable

    with pytest.raises(ServiceUnavailable, match="topic no-such-topic does not exist"):
        TopicReader(local_stack.kafka_bootstrap, "no-such-topic")


def test_end_offsets_count_every_message_of_a_batched_send(local_stack):
    """Tansu under-reports ListOffsets after a multi-record batch; end_offsets must not."""
    import uuid

    from pipeline.clients.topics import TopicWriter, end_offsets, ensure_topic
    from tests.unit.test_rollout import make_rollout

    topic = f"batched-{uuid.uuid4().hex[:8]}"
    ensure_topic(local_stack.kafka_bootstrap, topic)
    sink = TopicWriter(local_stack.kafka_bootstrap, topic)
    acked = sink.send_many([make_rollout() for _ in range(6)])
    sink.close()
    assert [o for _, o in acked] == list(range(6))
    assert end_offsets(local_stack.kafka_bootstrap, topic) == {0: 6}
