"""The embedded local stack against its real servers (Tansu, redis-server, S3)."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from infra.local_stack import (
    STATE_FILE,
    StackError,
    StackState,
    load_stack,
    restart_service,
    s3_client,
    stack_env,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.integration


def _new_topic(state: StackState, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=state.kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    return name


def _produce(state: StackState, topic: str, *values: bytes) -> None:
    producer = KafkaProducer(bootstrap_servers=state.kafka_bootstrap, acks="all")
    try:
        for value in values:
            producer.send(topic, value=value, key=b"k").get(timeout=10)
    finally:
        producer.close(timeout=5)


def _consumer(state: StackState, topic: str, group: str) -> tuple[KafkaConsumer, TopicPartition]:
    consumer = KafkaConsumer(bootstrap_servers=state.kafka_bootstrap, group_id=group,
                             enable_auto_commit=False, auto_offset_reset="earliest")
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    return consumer, tp


def _poll_values(consumer: KafkaConsumer, n: int, timeout_s: float = 10.0) -> list[bytes]:
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(values) < n and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            values.extend(r.value for r in records)
    return values


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_kafka_produce_consume_and_committed_offset(local_stack: StackState) -> None:
    topic = _new_topic(local_stack, "smoke")
    _produce(local_stack, topic, b"rollout-0", b"rollout-1")

    consumer, tp = _consumer(local_stack, topic, group="learner-a")
    try:
        consumer.seek_to_beginning(tp)
        assert _poll_values(consumer, 2) == [b"rollout-0", b"rollout-1"]
        consumer.commit()  # the consumed position, without joining a group
        assert consumer.committed(tp) == 2
    finally:
        consumer.close(autocommit=False)

    # A fresh consumer of the same group resumes from the committed offset.
    consumer, tp = _consumer(local_stack, topic, group="learner-a")
    try:
        assert consumer.committed(tp) == 2
        assert consumer.position(tp) == 2
    finally:
        consumer.close(autocommit=False)


def test_redis_set_get(local_stack: StackState) -> None:
    client = redis.Redis.from_url(local_stack.redis_url)
    try:
        client.set("heterorl:policy_version", 7)
        assert client.get("heterorl:policy_version") == b"7"
        # Not persisted: S3 (moto) and the broker log (memory://) do not outlive the stack either.
        assert client.config_get("appendonly")["appendonly"] == "no"
    finally:
        client.close()


def test_s3_put_get_and_range_read(local_stack: StackState) -> None:
    client = s3_client(local_stack)
    assert client.bucket_exists(local_stack.bucket)
    payload = bytes(range(256)) * 64
    client.put_object(local_stack.bucket, "weights/v1/shard-0", io.BytesIO(payload), len(payload))
    whole = client.get_object(local_stack.bucket, "weights/v1/shard-0")
    part = client.get_object(local_stack.bucket, "weights/v1/shard-0", offset=1000, length=300)
    try:
        assert whole.read() == payload
        assert part.read() == payload[1000:1300]
    finally:
        for resp in (whole, part):
            resp.close()
            resp.release_conn()


def test_load_stack_and_env(local_stack: StackState) -> None:
    assert load_stack(local_stack.data_dir) == local_stack
    assert StackState.from_json(local_stack.to_json()) == local_stack
    env = stack_env(local_stack)
    assert env == {
        "KAFKA_BOOTSTRAP_SERVERS": local_stack.kafka_bootstrap,
        "REDIS_URL": local_stack.redis_url,
        "AWS_ENDPOINT_URL": local_stack.s3_endpoint,
        "AWS_ACCESS_KEY_ID": local_stack.s3_access_key,
        "AWS_SECRET_ACCESS_KEY": local_stack.s3_secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "HETERORL_S3_BUCKET": "heterorl",
    }
    assert env["KAFKA_BOOTSTRAP_SERVERS"].startswith("127.0.0.1:")
    assert env["REDIS_URL"].startswith("redis://127.0.0.1:")
    assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")


def test_start_twice_in_same_dir_raises(local_stack: StackState) -> None:
    with pytest.raises(StackError, match="already running") as info:
        start_stack(local_stack.data_dir)
    assert local_stack.kafka_bootstrap in str(info.value)
    assert load_stack(local_stack.data_dir) == local_stack  # untouched


def test_stop_kills_exactly_the_recorded_processes(tmp_path: Path) -> None:
    state = start_stack(tmp_path / "stack", kafka_storage="memory")
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        # A recorded server that already died: the stack counts as down, stop tolerates it.
        os.kill(state.processes["redis"], signal.SIGKILL)
        time.sleep(0.2)
        assert load_stack(state.data_dir) is None

        stopped = stop_stack(state.data_dir)
        assert sorted(stopped) == ["kafka", "s3"]
        assert all(_gone(pid) for pid in state.processes.values())
        assert bystander.poll() is None
        assert not (tmp_path / "stack" / STATE_FILE).exists()
        assert (tmp_path / "stack" / "logs" / "kafka.log").exists()  # data stays
        assert load_stack(state.data_dir) is None
        assert stop_stack(state.data_dir) == []
        assert not _listening(state.port("kafka"))
    finally:
        bystander.kill()
        bystander.wait()
        stop_stack(state.data_dir)


def test_failed_start_cleans_up_and_names_the_log(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANSU_BIN", "/bin/false")  # a "broker" that exits at once
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        s3_port = sock.getsockname()[1]
    with pytest.raises(StackError) as info:
        start_stack(tmp_path, s3_port=s3_port, timeout_s=20)
    message = str(info.value)
    assert "\n" not in message
    assert "kafka" in message and str(tmp_path / "logs" / "kafka.log") in message
    assert not _listening(s3_port)  # the S3 server this call started is gone again
    assert not (tmp_path / STATE_FILE).exists()


def test_kafka_log_survives_broker_restart(tmp_path: Path) -> None:
    state = start_stack(tmp_path, kafka_storage="s3")
    try:
        assert state.kafka_storage == "s3://heterorl-kafka/"
        topic = _new_topic(state, "durable")
        _produce(state, topic, b"before-restart")
        consumer, tp = _consumer(state, topic, group="learner-b")
        consumer.seek_to_beginning(tp)
        assert _poll_values(consumer, 1) == [b"before-restart"]
        consumer.commit()
        consumer.close(autocommit=False)

        old_pid = state.processes["kafka"]
        state = restart_service(tmp_path, "kafka")
        assert state.processes["kafka"] != old_pid and _gone(old_pid)
        assert load_stack(tmp_path) == state

        _produce(state, topic, b"after-restart")
        consumer, tp = _consumer(state, topic, group="learner-b")
        try:
            assert consumer.committed(tp) == 1
            consumer.seek_to_beginning(tp)
            assert _poll_values(consumer, 2) == [b"before-restart", b"after-restart"]
        finally:
            consumer.close(autocommit=False)
    finally:
        stop_stack(tmp_path)
