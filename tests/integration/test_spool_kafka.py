"""Through a broker outage with the real broker: spool while unreachable, flush when it is back."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from kafka import KafkaProducer
from kafka.errors import MessageSizeTooLargeError, UnknownError

from pipeline.clients.topics import TopicWriter, ensure_topic, read_topic
from pipeline.wire.rollout import decode_rollout, header_value
from pipeline.clients.services import ServiceUnavailable
from pipeline.clients.spool import RolloutSpool
from tests.unit.test_rollout import make_rollout

pytestmark = pytest.mark.integration

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1


def test_groups_spooled_during_an_outage_reach_the_topic_in_order_exactly_once(local_stack, tmp_path,
                                                                              monkeypatch):
    topic = f"spool-{uuid.uuid4().hex[:8]}.rollouts"
    ensure_topic(local_stack.kafka_bootstrap, topic, partitions=1)
    # TopicWriter waits kafka-python's bootstrap_timeout_ms (30 s by default, not its
    # send_timeout_s) for a first broker before it raises; shortened so the test is quick.
    monkeypatch.setitem(KafkaProducer.DEFAULT_CONFIG, "bootstrap_timeout_ms", 2000)
    generated = [make_rollout(prompt_id=f"p{i}", policy_version=i) for i in range(20)]

    spool = RolloutSpool(tmp_path / "spool", max_bytes=1 << 24, max_groups=100)
    assert all(spool.append(r) for r in generated[:10])
    with pytest.raises(ServiceUnavailable, match="cannot reach Kafka"):
        TopicWriter(UNREACHABLE, topic, send_timeout_s=2)  # the sampler cannot even build a sink
    assert all(spool.append(r) for r in generated[10:])
    spool.close()  # the sampler restarts during the outage: the spool survives it

    spool = RolloutSpool(tmp_path / "spool", max_bytes=1 << 24, max_groups=100)
    assert spool.pending() == 20
    sink = TopicWriter(local_stack.kafka_bootstrap, topic, send_timeout_s=10)
    try:
        assert spool.flush_to(sink, batch=8) == 20
    finally:
        sink.close()
    assert spool.last_error is None
    assert spool.stats()["pending"] == 0 and spool.stats()["delivered"] == 20
    spool.close()

    records = read_topic(local_stack.kafka_bootstrap, topic)
    received = [decode_rollout(r.value) for r in records]
    assert [r.offset for r in records] == list(range(20))
    assert received == generated  # every field, in generation order, none duplicated
    assert [header_value(r.headers, "rollout_id") for r in records] == [g.rollout_id for g in generated]


def test_a_send_the_broker_fails_is_retried_then_given_up_with_its_error(local_stack, caplog):
    """A validator's verdicts and the learner's update log go through `TopicWriter.retrying`: a
    broker error (here the UnknownError Tansu answered a validator with) costs a logged wait, not
    the process; one that persists past the limit is raised unchanged."""
    topic = f"retry-{uuid.uuid4().hex[:8]}.verdicts"
    ensure_topic(local_stack.kafka_bootstrap, topic, partitions=1)
    sink = TopicWriter(local_stack.kafka_bootstrap, topic, send_timeout_s=10)
    real_send, sends = sink.producer.send, []

    def refused_once(*args, **kwargs):
        sends.append(args)
        if len(sends) == 1:
            raise UnknownError("the broker answered with an unknown error")
        return real_send(*args, **kwargs)

    sink.producer.send = refused_once
    log = logging.getLogger("validator")
    try:
        with caplog.at_level(logging.WARNING, logger="validator"):
            assert sink.retrying(lambda: sink.send_raw_many([b"v1", b"v2"]), 60.0, log) == [(0, 0), (0, 1)]
        assert len(sends) == 3  # refused, then both sent again
        assert f"writing to {topic} on Kafka at {local_stack.kafka_bootstrap} failed (UnknownError); retrying in" \
            in caplog.text

        def always_refused(*args, **kwargs):
            raise UnknownError("still failing")

        sink.producer.send = always_refused
        started = time.monotonic()
        with pytest.raises(UnknownError, match="still failing"):
            sink.retrying(lambda: sink.send_raw_many([b"v3"]), 2.0, log)
        assert time.monotonic() - started < 10

        def too_large(*args, **kwargs):
            raise MessageSizeTooLargeError("the message is larger than the broker accepts")

        sink.producer.send, started = too_large, time.monotonic()
        with pytest.raises(MessageSizeTooLargeError):  # waiting does not mend it: raised at once
            sink.retrying(lambda: sink.send_raw_many([b"v4"]), 60.0, log)
        assert time.monotonic() - started < 1
    finally:
        sink.producer.send = real_send
        sink.close()
    assert [r.value for r in read_topic(local_stack.kafka_bootstrap, topic)] == [b"v1", b"v2"]  # nothing lost or doubled
