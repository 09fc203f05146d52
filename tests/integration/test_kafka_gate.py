"""The Kafka gate in front of the real local broker: kafka-python clients through it get exactly
their grant, the broker's own port shows what really happened."""

from __future__ import annotations

import socket
import struct
import time
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import (KafkaError, MessageSizeTooLargeError, TopicAuthorizationFailedError)
from kafka.net.sasl.scram import ScramClient
from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse, DeleteTopicsRequest, DeleteTopicsResponse
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest, MetadataResponse
from kafka.protocol.sasl import (SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest,
                                 SaslHandshakeResponse)

from infra.kafka_gate import KafkaGate, KafkaGrant, add_user, remove_user
from infra.local_stack import start_stack, stop_stack

pytestmark = pytest.mark.integration

ROLLOUTS, UPDATES, VERDICTS = "run.rollouts", "run.updates", "run.rollouts.verdicts"
LIMIT = 100_000
PASSWORDS = {"sampler": "sampler-pw", "validator": "validator-pw", "learner": "learner-pw", "fleet": "fleet-pw"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("gate-stack")
    state = start_stack(data_dir, kafka_storage="memory")
    try:
        admin = KafkaAdminClient(bootstrap_servers=state.kafka_bootstrap)
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)
                             for topic in (ROLLOUTS, UPDATES, VERDICTS)])
        admin.close()
        yield state
    finally:
        stop_stack(data_dir, wipe=True)


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gate-users") / "users.json"
    # The sampler may see run.updates (so its produce there reaches the Produce check itself).
    add_user(path, "sampler", PASSWORDS["sampler"], KafkaGrant(
        produce=frozenset({ROLLOUTS}), describe=frozenset({ROLLOUTS, UPDATES}), max_record_bytes=LIMIT))
    add_user(path, "validator", PASSWORDS["validator"], KafkaGrant(
        produce=frozenset({VERDICTS}), fetch=frozenset({ROLLOUTS}), max_record_bytes=LIMIT))
    add_user(path, "learner", PASSWORDS["learner"], KafkaGrant(everything=True))
    add_user(path, "fleet", PASSWORDS["fleet"], KafkaGrant(produce=frozenset({"*.rollouts"}), max_record_bytes=LIMIT))
    return path


@pytest.fixture(scope="module")
def gate(stack, users_file):
    host, port = stack.kafka_bootstrap.rsplit(":", 1)
    with KafkaGate(listen=("127.0.0.1", 0), broker=(host, int(port)), users_file=users_file) as running:
        yield running


def sasl(user: str, password: str | None = None) -> dict:
    return dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256", sasl_plain_username=user,
                sasl_plain_password=password if password is not None else PASSWORDS[user])


def producer(gate: KafkaGate, user: str, **kwargs) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=gate.bootstrap, acks="all", retries=0, request_timeout_ms=5000,
                         max_block_ms=5000, **{**sasl(user), **kwargs})


def broker_values(stack, topic: str) -> list[bytes]:
    """Every value in partition 0 of ``topic``, read on the broker's own port."""
    consumer = KafkaConsumer(bootstrap_servers=stack.kafka_bootstrap, group_id=None, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    end = consumer.end_offsets([tp])[tp]
    values: list[bytes] = []
    deadline = time.monotonic() + 10
    while consumer.position(tp) < end and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            values += [r.value for r in records]
    consumer.close()
    return values


def broker_topics(stack) -> set[str]:
    consumer = KafkaConsumer(bootstrap_servers=stack.kafka_bootstrap, group_id=None)
    try:
        return set(consumer.topics())
    finally:
        consumer.close()


# --------------------------------------------------------------------------- raw protocol helpers


class RawClient:
    """A logged-in socket speaking Kafka frames, for requests kafka-python's clients never send."""

    def __init__(self, gate: KafkaGate, user: str, password: str):
        self.sock = socket.create_connection(gate.address, timeout=5)
        self.correlation = 0
        self.request(SaslHandshakeRequest[1](mechanism="SCRAM-SHA-256"), SaslHandshakeResponse)
        scram = ScramClient(user, password, "SCRAM-SHA-256")
        first = self.request(SaslAuthenticateRequest[2](auth_bytes=scram.first_message()), SaslAuthenticateResponse)
        scram.process_server_first_message(first.auth_bytes)
        final = self.request(SaslAuthenticateRequest[2](auth_bytes=scram.final_message()), SaslAuthenticateResponse)
        assert final.error_code == 0, f"error {final.error_code}: {final.error_message}"
        scram.process_server_final_message(final.auth_bytes)

    def send(self, request) -> int:
        self.correlation += 1
        request.with_header(correlation_id=self.correlation, client_id="raw-test")
        self.sock.sendall(bytes(request.encode(header=True, framed=True)))
        return self.correlation

    def receive(self, response_class, version: int):
        size = struct.unpack(">i", self._exactly(4))[0]
        return response_class.decode(self._exactly(size), version=version, header=True)

    def request(self, request, response_class):
        self.send(request)
        return self.receive(response_class, request.API_VERSION)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed by the gate")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- tests


def test_granted_produce_lands_on_the_broker(gate, stack):
    marker = f"rollout-{uuid.uuid4().hex}".encode()
    sink = producer(gate, "sampler")
    sink.send(ROLLOUTS, marker).get(timeout=10)
    sink.close()
    assert marker in broker_values(stack, ROLLOUTS)


def test_metadata_names_only_the_gate_and_described_topics(gate, stack):
    consumer = KafkaConsumer(bootstrap_servers=gate.bootstrap, group_id=None, **sasl("validator"))
    try:
        assert consumer.topics() == {ROLLOUTS, VERDICTS}  # describe defaults to produce | fetch
        brokers = consumer._client.cluster.brokers()
        assert {(b.host, b.port) for b in brokers} == {gate.advertised}
    finally:
        consumer.close()
    assert {ROLLOUTS, UPDATES, VERDICTS} <= broker_topics(stack)


def test_produce_to_an_ungranted_topic_fails_and_writes_nothing(gate, stack):
    before = broker_values(stack, UPDATES)
    sink = producer(gate, "sampler")
    with pytest.raises(TopicAuthorizationFailedError):  # refused by the Produce check
        sink.send(UPDATES, b"not yours").get(timeout=10)
    sink.close()
    validator = producer(gate, "validator")
    with pytest.raises(TopicAuthorizationFailedError):  # refused already at Metadata (not described)
        validator.send(UPDATES, b"not yours either").get(timeout=10)
    validator.close()
    assert broker_values(stack, UPDATES) == before
    assert gate.stats()["refused"]["sampler"]["produce_denied"] >= 1


def test_one_produce_request_for_two_topics_is_split(gate, stack):
    """Batches for both topics travel in one request (linger): the granted one reaches the broker,
    the other is answered by the gate, and the client sees each outcome."""
    sink = producer(gate, "sampler", linger_ms=200)
    allowed, denied = sink.send(ROLLOUTS, b"half of a request"), sink.send(UPDATES, b"other half")
    sink.flush()
    assert allowed.get(timeout=10).offset >= 0
    with pytest.raises(TopicAuthorizationFailedError):
        denied.get(timeout=10)
    sink.close()
    assert b"half of a request" in broker_values(stack, ROLLOUTS)
    assert b"other half" not in broker_values(stack, UPDATES)


def test_topics_cannot_be_created_or_deleted(gate, stack):
    topics = broker_topics(stack)
    admin = KafkaAdminClient(bootstrap_servers=gate.bootstrap, request_timeout_ms=5000, **sasl("sampler"))
    with pytest.raises(KafkaError):  # the gate does not offer CreateTopics at all
        admin.create_topics([NewTopic("run.evil", num_partitions=10_000, replication_factor=1)])
    with pytest.raises(KafkaError):
        admin.delete_topics([ROLLOUTS])
    admin.close()

    # A client that sends them anyway gets authorization errors, per topic.
    raw = RawClient(gate, "sampler", PASSWORDS["sampler"])
    created = raw.request(CreateTopicsRequest[5](topics=[CreateTopicsRequest.CreatableTopic(
        name="run.evil", num_partitions=10_000, replication_factor=1, assignments=[], configs=[])],
        timeout_ms=1000, validate_only=False), CreateTopicsResponse)
    assert [(t.name, t.error_code) for t in created.topics] == [("run.evil", 29)]
    deleted = raw.request(DeleteTopicsRequest[4](topic_names=[ROLLOUTS], timeout_ms=1000), DeleteTopicsResponse)
    assert [(t.name, t.error_code) for t in deleted.responses] == [(ROLLOUTS, 29)]
    raw.close()
    assert broker_topics(stack) == topics


def test_answers_keep_request_order_when_the_gate_answers_some_itself(gate):
    raw = RawClient(gate, "sampler", PASSWORDS["sampler"])
    requests = [
        (MetadataRequest[12](topics=[MetadataRequest.MetadataRequestTopic(name=ROLLOUTS)],
                             allow_auto_topic_creation=True), MetadataResponse),  # forwarded, rewritten
        (CreateTopicsRequest[5](topics=[], timeout_ms=1000, validate_only=False), CreateTopicsResponse),  # the gate
        (ApiVersionsRequest[3](client_software_name="t", client_software_version="1"), ApiVersionsResponse),
        (MetadataRequest[12](topics=None, allow_auto_topic_creation=False), MetadataResponse),
    ]
    ids = [raw.send(request) for request, _ in requests]  # all in flight before any answer is read
    answers = [raw.receive(cls, request.API_VERSION) for request, cls in requests]
    raw.close()
    assert [a.header.correlation_id for a in answers] == ids
    assert [t.name for t in answers[0].topics] == [ROLLOUTS]
    assert sorted(t.name for t in answers[3].topics) == [ROLLOUTS, UPDATES]  # all topics: only described
    assert {(b.host, b.port) for b in answers[3].brokers} == {gate.advertised}


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_a_record_over_the_limit_is_refused_with_a_clear_error(gate, stack, compression):
    sink = producer(gate, "sampler", max_request_size=4 * LIMIT, compression_type=compression)
    before = len(broker_values(stack, ROLLOUTS))
    for size in (LIMIT + 1, 3 * LIMIT):
        with pytest.raises(MessageSizeTooLargeError, match=f"exceeds this user's limit of {LIMIT} bytes"):
            sink.send(ROLLOUTS, b"\0" * size).get(timeout=10)
    sink.send(ROLLOUTS, b"\0" * LIMIT).get(timeout=10)  # exactly the limit is fine
    sink.close()
    assert len(broker_values(stack, ROLLOUTS)) == before + 1


def test_fetching_needs_a_fetch_grant(gate, stack):
    producer(gate, "sampler").send(ROLLOUTS, b"for the validator").get(timeout=10)
    denied = KafkaConsumer(bootstrap_servers=gate.bootstrap, group_id=None, enable_auto_commit=False,
                           auto_offset_reset="earliest", **sasl("sampler"))
    denied.assign([TopicPartition(ROLLOUTS, 0)])
    with pytest.raises(TopicAuthorizationFailedError):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            denied.poll(timeout_ms=500)
    denied.close()

    reader = KafkaConsumer(bootstrap_servers=gate.bootstrap, group_id=None, enable_auto_commit=False,
                           auto_offset_reset="earliest", **sasl("validator"))
    tp = TopicPartition(ROLLOUTS, 0)
    reader.assign([tp])
    values: list[bytes] = []
    deadline = time.monotonic() + 10
    while b"for the validator" not in values and time.monotonic() < deadline:
        values += [r.value for records in reader.poll(timeout_ms=500).values() for r in records]
    assert b"for the validator" in values
    assert reader.end_offsets([tp])[tp] > 0  # ListOffsets through the gate
    reader.close()


def test_a_validator_writes_its_verdicts_but_not_rollouts(gate, stack):
    sink = producer(gate, "validator")
    sink.send(VERDICTS, b"verdict").get(timeout=10)
    with pytest.raises(TopicAuthorizationFailedError):
        sink.send(ROLLOUTS, b"forged rollout").get(timeout=10)
    sink.close()
    assert b"verdict" in broker_values(stack, VERDICTS)
    assert b"forged rollout" not in broker_values(stack, ROLLOUTS)


def test_a_wrong_password_fails_to_connect(gate, caplog):
    # kafka-python 3.0.12 retries a bootstrap that failed authentication until bootstrap_timeout_ms,
    # then raises; each attempt fails with the gate's SaslAuthenticationFailedError (logged).
    started = time.monotonic()
    with pytest.raises(KafkaError):
        KafkaProducer(bootstrap_servers=gate.bootstrap, bootstrap_timeout_ms=2000, **sasl("sampler", "wrong"))
    assert time.monotonic() - started < 5
    assert "SaslAuthenticationFailedError" in caplog.text and "Authentication failed" in caplog.text
    with pytest.raises(KafkaError):
        KafkaProducer(bootstrap_servers=gate.bootstrap, bootstrap_timeout_ms=1000, **sasl("nobody", "x"))
    with pytest.raises(AssertionError, match="Authentication failed"):
        RawClient(gate, "sampler", "wrong")  # the answer itself: SASL_AUTHENTICATION_FAILED (58)
    failures = gate.stats()["login_failures"]
    assert failures["sampler"] >= 2 and failures["<unknown user>"] >= 1


def test_requests_before_login_and_oversized_frames_close_the_connection(gate):
    sock = socket.create_connection(gate.address, timeout=5)  # no login: Metadata closes it
    request = MetadataRequest[12](topics=None, allow_auto_topic_creation=False)
    request.with_header(correlation_id=1, client_id="stranger")
    sock.sendall(bytes(request.encode(header=True, framed=True)))
    assert sock.recv(100) == b""
    sock.close()

    raw = RawClient(gate, "sampler", PASSWORDS["sampler"])
    raw.sock.sendall(struct.pack(">i", 50_000_000))  # announced, never sent: refused from its size
    assert raw.sock.recv(100) == b""
    raw.close()
    assert gate.stats()["refused"]["sampler"]["frame_too_large"] >= 1


def test_removing_a_user_closes_its_connections_within_two_seconds(gate, users_file, stack):
    add_user(users_file, "leaver", "leaver-pw", KafkaGrant(produce=frozenset({ROLLOUTS})))
    gate.reload_users()
    sink = KafkaProducer(bootstrap_servers=gate.bootstrap, acks="all", request_timeout_ms=2000,
                         delivery_timeout_ms=3000, max_block_ms=3000, **sasl("leaver", "leaver-pw"))
    sink.send(ROLLOUTS, b"before").get(timeout=10)
    assert gate.stats()["open_by_user"].get("leaver", 0) >= 1

    removed = time.monotonic()
    assert remove_user(users_file, "leaver")
    while gate.stats()["open_by_user"].get("leaver", 0) and time.monotonic() - removed < 5:
        time.sleep(0.05)
    assert time.monotonic() - removed < 2.0
    with pytest.raises(KafkaError):  # it cannot log in again: the send expires
        sink.send(ROLLOUTS, b"after").get(timeout=10)
    sink.close(timeout=1)
    assert gate.stats()["login_failures"].get("<unknown user>", 0) >= 1
    assert b"after" not in broker_values(stack, ROLLOUTS)


def test_the_sasl_handshake_v0_flow_works_too(stack, users_file):
    host, port = stack.kafka_bootstrap.rsplit(":", 1)
    with KafkaGate(("127.0.0.1", 0), (host, int(port)), users_file, sasl_handshake_max=0) as legacy:
        sink = producer(legacy, "sampler")
        sink.send(ROLLOUTS, b"via raw SASL tokens").get(timeout=10)
        sink.close()
        assert legacy.stats()["logins"] >= 1
    assert b"via raw SASL tokens" in broker_values(stack, ROLLOUTS)


def test_one_user_holds_a_bounded_number_of_connections_and_few_wait_for_a_login(stack, users_file):
    """Each connection may hold a request frame and answers read ahead: a user (a stranger) gets
    `max_user_connections` of them, and `max_unauthenticated` may wait for a login at once."""
    host, port = stack.kafka_bootstrap.rsplit(":", 1)
    with KafkaGate(("127.0.0.1", 0), (host, int(port)), users_file, max_user_connections=2,
                   max_unauthenticated=1) as small:
        def logged_in(user: str) -> RawClient:
            before = small.stats()["open_by_user"].get(user, 0)
            client, deadline = RawClient(small, user, PASSWORDS[user]), time.monotonic() + 5
            while small.stats()["open_by_user"].get(user, 0) == before and time.monotonic() < deadline:
                time.sleep(0.02)  # the gate counts it once its broker connection is open
            return client

        held = [logged_in("sampler") for _ in range(2)]
        other = logged_in("validator")  # another user is not held back
        with pytest.raises(AssertionError, match="holds 2 connections already"):
            RawClient(small, "sampler", PASSWORDS["sampler"])
        deadline = time.monotonic() + 5
        while small.stats()["open"] > 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # the refused one is closed (after its answer had time to go out)
        waiting = socket.create_connection(small.address, timeout=5)  # connected, never logs in
        time.sleep(0.2)
        late = socket.create_connection(small.address, timeout=5)
        assert late.recv(100) == b""  # closed at once
        for sock in (late, waiting):
            sock.close()
        for client in (*held, other):
            client.close()
        assert small.stats()["refused"]["sampler"]["max_user_connections"] == 1


def test_a_grant_of_everything_creates_topics_and_reads_and_writes_any(gate, stack):
    """The operator's learner on another machine: every request goes through, with the broker's
    address rewritten to the gate's (its clients keep talking to the gate)."""
    topic = f"learner-{uuid.uuid4().hex[:6]}.updates"
    admin = KafkaAdminClient(bootstrap_servers=gate.bootstrap, request_timeout_ms=5000, **sasl("learner"))
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    assert topic in admin.list_topics()
    admin.close()
    sink = producer(gate, "learner")
    sink.send(topic, b"a step", partition=0).get(timeout=10)
    sink.close()
    reader = KafkaConsumer(bootstrap_servers=gate.bootstrap, group_id=None, **sasl("learner"))
    assert {b.host for b in reader._client.cluster.brokers()} <= {gate.advertised[0]}
    tp = TopicPartition(topic, 0)
    reader.assign([tp])
    reader.seek_to_beginning(tp)
    got = [r.value for records in reader.poll(timeout_ms=5000).values() for r in records]
    reader.close()
    assert got == [b"a step"] and broker_values(stack, topic) == [b"a step"]


def test_topic_globs_grant_every_run_s_rollouts_and_nothing_else(gate, stack):
    """The stack's sampler user serves every run: `*.rollouts`, and still not the update log."""
    sink = producer(gate, "fleet")
    assert sink.send(ROLLOUTS, b"any run's rollouts").get(timeout=10).offset >= 0
    with pytest.raises(TopicAuthorizationFailedError):
        sink.send(UPDATES, b"the update log").get(timeout=10)
    sink.close()
    assert b"any run's rollouts" in broker_values(stack, ROLLOUTS)
    assert b"the update log" not in broker_values(stack, UPDATES)
