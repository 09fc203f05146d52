"""The Kafka gate's parts that need no broker: SCRAM, the users file, the decision on each decoded
request, and the record checks (a compression bomb included)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import stat
import time
import tracemalloc

import pytest
from kafka.net.sasl.scram import ScramClient
from kafka.protocol.admin import (CreateTopicsRequest, CreateTopicsResponse, DeleteTopicsRequest,
                                  DeleteTopicsResponse, DescribeConfigsRequest)
from kafka.protocol.api_header import ResponseClassRegistry
from kafka.protocol.consumer import (FetchRequest, FetchResponse, JoinGroupRequest, JoinGroupResponse,
                                     ListOffsetsRequest, ListOffsetsResponse)
from kafka.protocol.metadata import ApiVersionsResponse, MetadataRequest, MetadataResponse
from kafka.protocol.producer import InitProducerIdRequest, InitProducerIdResponse, ProduceRequest, ProduceResponse
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.legacy_records import LegacyRecordBatchBuilder

from infra import kafka_gate
from infra.kafka_gate import (GateError, KafkaGrant, ScramError, ScramServer, ScramVerifier, add_user, authorize,
                              check_records, parse_users, read_users, remove_user, scram_verifier, write_users)

GATE = ("gate.example.org", 19092)
LIMIT = 1 << 20
SAMPLER = KafkaGrant(produce=frozenset({"run.rollouts"}), max_record_bytes=LIMIT)
VALIDATOR = KafkaGrant(produce=frozenset({"run.rollouts.verdicts"}), fetch=frozenset({"run.rollouts"}),
                       max_record_bytes=LIMIT)


def verifier(password: str, **kwargs) -> ScramVerifier:
    return ScramVerifier.from_json(scram_verifier(password, **kwargs))


# --------------------------------------------------------------------------- SCRAM


def test_rfc_7677_test_vector():
    """RFC 7677 section 3: user "user", password "pencil", the exchange byte for byte."""
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    users = {"user": verifier("pencil", salt=salt, iterations=4096)}
    server = ScramServer(users.get, b"secret", server_nonce="%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0")
    server_first = server.step(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    assert server_first == (b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                            b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
    server_final = server.step(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                               b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
    assert server_final == b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
    assert server.authenticated and server.done and server.username == "user"


def exchange(users: dict, user: str, password: str) -> ScramServer:
    """A full exchange between kafka-python's SCRAM client and the gate's server."""
    client = ScramClient(user, password, "SCRAM-SHA-256")
    server = ScramServer(users.get, b"secret")
    client.process_server_first_message(server.step(client.first_message()))
    client.process_server_final_message(server.step(client.final_message()))  # checks the server's signature
    return server


def test_kafka_pythons_client_logs_in_with_the_right_password_only():
    users = {"alice": verifier("correct horse"), "bob": verifier("battery staple")}
    assert exchange(users, "alice", "correct horse").authenticated
    with pytest.raises(ScramError, match="authentication failed"):
        exchange(users, "alice", "battery staple")
    with pytest.raises(ScramError, match="authentication failed"):
        exchange(users, "mallory", "anything")


def test_an_unknown_user_gets_a_stable_made_up_salt():
    """The server-first message must not tell which user names exist."""
    def salt_for(name: str) -> str:
        server = ScramServer({}.get, b"gate secret")
        return server.step(f"n,,n={name},r=abc".encode()).decode().split(",")[1]

    assert salt_for("nobody") == salt_for("nobody") != salt_for("somebody")


@pytest.mark.parametrize("first", [b"p=tls-unique,,n=user,r=abc", b"n,,r=abc,n=user", b"n,a=other,n=user,r=abc",
                                   b"n,,n=us=er,r=abc", b"n,,n=user,r=abc,m=ext", b"\xff\xfe", b"hello"])
def test_malformed_client_first_messages_fail(first):
    with pytest.raises(ScramError):
        ScramServer({"user": verifier("pencil")}.get, b"s").step(first)


@pytest.mark.parametrize("final", [b"c=biws,r=wrong,p=AAAA", b"c=eSws,r={nonce},p=AAAA", b"c=biws,r={nonce}",
                                   b"c=biws,r={nonce},p=not base64!"])
def test_malformed_client_final_messages_fail(final):
    server = ScramServer({"user": verifier("pencil")}.get, b"s", server_nonce="SERVER")
    server.step(b"n,,n=user,r=abc")
    with pytest.raises(ScramError):
        server.step(final.replace(b"{nonce}", b"abcSERVER"))
    with pytest.raises(ScramError, match="over"):
        server.step(b"c=biws")


# --------------------------------------------------------------------------- the users file


def test_users_file_round_trip_keeps_only_verifiers(tmp_path):
    path = tmp_path / "users.json"
    add_user(path, "sampler-1", "s3cret-pw", SAMPLER)
    add_user(path, "validator-1", "other-pw", VALIDATOR)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "s3cret-pw" not in text and "other-pw" not in text
    users = read_users(path)
    assert users["sampler-1"].grant == SAMPLER and users["validator-1"].grant == VALIDATOR
    assert set(json.loads(text)["users"]["sampler-1"]["scram_sha_256"]) == {"salt", "iterations", "stored_key",
                                                                            "server_key"}
    assert exchange({n: u.verifier for n, u in users.items()}, "sampler-1", "s3cret-pw").authenticated

    assert remove_user(path, "sampler-1") and not remove_user(path, "sampler-1")
    assert set(read_users(path)) == {"validator-1"}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_add_user_replaces_the_password(tmp_path):
    path = tmp_path / "users.json"
    add_user(path, "s", "first", SAMPLER)
    before = read_users(path)["s"].verifier
    add_user(path, "s", "second", SAMPLER)
    assert read_users(path)["s"].verifier != before


def test_grant_defaults_and_validation():
    assert KafkaGrant(produce=frozenset({"a"}), fetch=frozenset({"b"})).describable == {"a", "b"}
    assert KafkaGrant(produce=frozenset({"a"}), describe=frozenset()).describable == frozenset()
    assert KafkaGrant.from_json(SAMPLER.to_json()) == SAMPLER
    for bad in ({"produce": "run.rollouts"}, {"produce": [""]}, {"max_record_bytes": 0},
                {"max_record_bytes": True}):
        with pytest.raises(ValueError):
            KafkaGrant.from_json(bad)


def test_a_malformed_entry_is_skipped_and_the_rest_kept(tmp_path):
    good = {"scram_sha_256": scram_verifier("pw"), "grant": SAMPLER.to_json()}
    doc = {"version": 1, "users": {"good": good, "bad name": good,
                                   "weak": {"scram_sha_256": {**good["scram_sha_256"], "iterations": 10}},
                                   "nokeys": {"scram_sha_256": {}}}}
    users, problems = parse_users(doc)
    assert set(users) == {"good"} and len(problems) == 3
    with pytest.raises(ValueError):
        parse_users({"users": {}})
    with pytest.raises(GateError, match="refusing to write"):
        write_users(tmp_path / "u.json", {"weak": doc["users"]["weak"]})
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(GateError, match="users file"):
        read_users(tmp_path / "broken.json")
    with pytest.raises(GateError, match="must match"):
        add_user(tmp_path / "u.json", "two words", "pw", SAMPLER)


# --------------------------------------------------------------------------- decisions on decoded requests


def encode(request, correlation_id: int = 7) -> bytes:
    request.with_header(correlation_id=correlation_id, client_id="test")
    return bytes(request.encode(header=True))


def answer(response, correlation_id: int = 7) -> bytes:
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True))


def records(values: list[bytes], codec: int = 0, magic: int = 2) -> bytes:
    """Record data as kafka-python's producer builds it (which leaves a batch uncompressed when
    compressing would not make it smaller)."""
    if magic < 2:
        builder = LegacyRecordBatchBuilder(magic=magic, compression_type=codec, batch_size=1 << 30)
        for offset, value in enumerate(values):
            builder.append(offset, timestamp=1, key=None, value=value)
        return bytes(builder.build())
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=False, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for offset, value in enumerate(values):
        builder.append(offset, timestamp=1, key=b"k", value=value, headers=[])
    return bytes(builder.build())


def produce(topics: dict[str, bytes], version: int = 9, acks: int = -1, transactional_id=None) -> ProduceRequest:
    data = ProduceRequest.TopicProduceData
    return ProduceRequest[version](transactional_id=transactional_id, acks=acks, timeout_ms=1000, topic_data=[
        data(name=name, partition_data=[data.PartitionProduceData(index=0, records=batch)])
        for name, batch in topics.items()])


def errors(response) -> dict[str, list[int]]:
    return {t.name: [p.error_code for p in t.partition_responses] for t in response.responses}


def test_a_granted_produce_is_forwarded_untouched():
    payload = encode(produce({"run.rollouts": records([b"rollout"])}))
    plan = authorize(payload, SAMPLER, GATE)
    assert plan.forward == payload and plan.reply is None and not plan.refusals and plan.close is None


def test_a_produce_to_another_topic_is_answered_by_the_gate():
    plan = authorize(encode(produce({"run.updates": records([b"x"])})), SAMPLER, GATE)
    assert plan.forward is None and plan.close is None
    response = ProduceResponse.decode(plan.reply, version=9, header=True)
    assert response.header.correlation_id == 7 and errors(response) == {"run.updates": [29]}
    assert "not allowed to produce to run.updates" in response.responses[0].partition_responses[0].error_message
    assert plan.refusals[0][0] == "produce_denied"


def test_a_mixed_produce_forwards_the_allowed_part_and_merges_the_answers():
    plan = authorize(encode(produce({"run.rollouts": records([b"ok"]), "run.updates": records([b"no"])})),
                     SAMPLER, GATE)
    forwarded = ProduceRequest.decode(plan.forward, version=9, header=True)
    assert [t.name for t in forwarded.topic_data] == ["run.rollouts"] and forwarded.header.correlation_id == 7
    topic = ProduceResponse.TopicProduceResponse
    broker = ProduceResponse[9](throttle_time_ms=0, responses=[topic(name="run.rollouts", partition_responses=[
        topic.PartitionProduceResponse(index=0, error_code=0, base_offset=41)])])
    merged = ProduceResponse.decode(plan.transform(answer(broker)), version=9, header=True)
    assert errors(merged) == {"run.rollouts": [0], "run.updates": [29]} and merged.header.correlation_id == 7


def test_refused_acks_0_produce_gets_no_answer_and_transactions_are_refused():
    plan = authorize(encode(produce({"run.updates": records([b"x"])}, acks=0)), SAMPLER, GATE)
    assert plan.reply is None and plan.forward is None and not plan.expect_response and plan.close is None
    plan = authorize(encode(produce({"run.rollouts": records([b"x"])}, transactional_id="tx")), SAMPLER, GATE)
    assert errors(ProduceResponse.decode(plan.reply, version=9, header=True)) == {"run.rollouts": [53]}


def test_produce_versions_above_the_gates_range_close_the_connection():
    plan = authorize(encode(produce({"run.rollouts": records([b"x"])}, version=11)), SAMPLER, GATE)
    assert plan.close == "unsupported_version" and plan.forward is None


def test_metadata_hides_topics_turns_off_auto_creation_and_names_the_gate():
    topic = MetadataRequest.MetadataRequestTopic
    request = MetadataRequest[12](topics=[topic(name="run.rollouts"), topic(name="run.learner.control")],
                                  allow_auto_topic_creation=True)
    plan = authorize(encode(request), SAMPLER, GATE)
    forwarded = MetadataRequest.decode(plan.forward, version=12, header=True)
    assert [t.name for t in forwarded.topics] == ["run.rollouts"] and forwarded.allow_auto_topic_creation is False

    rt = MetadataResponse.MetadataResponseTopic
    broker = MetadataResponse[12](throttle_time_ms=0, cluster_id="c", controller_id=111, brokers=[
        MetadataResponse.MetadataResponseBroker(node_id=111, host="10.0.0.5", port=9092, rack=None)],
        topics=[rt(error_code=0, name=name, partitions=[]) for name in ("run.rollouts", "run.secret")])
    rewritten = MetadataResponse.decode(plan.transform(answer(broker)), version=12, header=True)
    assert [(b.host, b.port) for b in rewritten.brokers] == [GATE]
    assert [(t.name, t.error_code) for t in rewritten.topics] == [("run.rollouts", 0), ("run.learner.control", 29)]
    # Before v4 a Metadata request cannot turn auto-creation off: naming a topic could create it.
    old = authorize(encode(MetadataRequest[3](topics=[topic(name="run.rollouts")])), SAMPLER, GATE)
    assert old.close == "unsupported_version" and old.forward is None


def test_an_all_topics_metadata_request_answers_only_described_topics():
    plan = authorize(encode(MetadataRequest[9](topics=None, allow_auto_topic_creation=True)), VALIDATOR, GATE)
    assert MetadataRequest.decode(plan.forward, version=9, header=True).topics is None
    rt = MetadataResponse.MetadataResponseTopic
    broker = MetadataResponse[9](throttle_time_ms=0, cluster_id="c", controller_id=1, brokers=[
        MetadataResponse.MetadataResponseBroker(node_id=1, host="h", port=1)], topics=[
        rt(error_code=0, name=n, partitions=[]) for n in ("run.rollouts", "run.updates", "run.rollouts.verdicts")])
    rewritten = MetadataResponse.decode(plan.transform(answer(broker)), version=9, header=True)
    assert sorted(t.name for t in rewritten.topics) == ["run.rollouts", "run.rollouts.verdicts"]


def fetch(topic: str, version: int = 12, session_id: int = 0, epoch: int = 0) -> FetchRequest:
    ft = FetchRequest.FetchTopic
    return FetchRequest[version](replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=1 << 20, isolation_level=0,
                                 session_id=session_id, session_epoch=epoch, topics=[ft(topic=topic, partitions=[
                                     ft.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=1 << 20)])],
                                 forgotten_topics_data=[], rack_id="")


def test_fetch_needs_the_fetch_grant_and_runs_without_sessions():
    refused = authorize(encode(fetch("run.rollouts")), SAMPLER, GATE)
    response = FetchResponse.decode(refused.reply, version=12, header=True)
    assert [[p.error_code for p in t.partitions] for t in response.responses] == [[29]]
    allowed = authorize(encode(fetch("run.rollouts", session_id=99, epoch=3)), VALIDATOR, GATE)
    forwarded = FetchRequest.decode(allowed.forward, version=12, header=True)
    assert (forwarded.session_id, forwarded.session_epoch) == (0, -1) and forwarded.topics[0].topic == "run.rollouts"
    assert authorize(encode(fetch("run.rollouts", version=13)), VALIDATOR, GATE).close == "unsupported_version"


def test_list_offsets_needs_the_fetch_grant():
    lt = ListOffsetsRequest.ListOffsetsTopic
    request = ListOffsetsRequest[7](replica_id=-1, isolation_level=0, topics=[
        lt(name="run.rollouts", partitions=[lt.ListOffsetsPartition(partition_index=0, timestamp=-1)])])
    payload = encode(request)
    assert authorize(payload, VALIDATOR, GATE).forward == payload
    response = ListOffsetsResponse.decode(authorize(payload, SAMPLER, GATE).reply, version=7, header=True)
    assert response.topics[0].partitions[0].error_code == 29


def test_init_producer_id_only_without_a_transactional_id():
    plain = encode(InitProducerIdRequest[4](transactional_id=None, transaction_timeout_ms=-1))
    assert authorize(plain, SAMPLER, GATE).forward == plain
    plan = authorize(encode(InitProducerIdRequest[4](transactional_id="tx", transaction_timeout_ms=1000)),
                     SAMPLER, GATE)
    assert InitProducerIdResponse.decode(plan.reply, version=4, header=True).error_code == 53


def test_admin_and_group_apis_are_refused_with_errors_or_a_close():
    create = CreateTopicsRequest[5](topics=[CreateTopicsRequest.CreatableTopic(
        name="run.evil", num_partitions=10_000, replication_factor=1, assignments=[], configs=[])],
        timeout_ms=1000, validate_only=False)
    plan = authorize(encode(create), SAMPLER, GATE)
    assert plan.forward is None and plan.refusals == [("api:CreateTopics", "CreateTopics v5")]
    assert [(t.name, t.error_code) for t in CreateTopicsResponse.decode(plan.reply, version=5, header=True).topics] \
        == [("run.evil", 29)]
    plan = authorize(encode(DeleteTopicsRequest[4](topic_names=["run.rollouts"], timeout_ms=1000)), SAMPLER, GATE)
    assert DeleteTopicsResponse.decode(plan.reply, version=4, header=True).responses[0].error_code == 29
    join = JoinGroupRequest[5](group_id="g", session_timeout_ms=10, rebalance_timeout_ms=10, member_id="",
                               protocol_type="consumer", protocols=[])
    assert JoinGroupResponse.decode(authorize(encode(join), SAMPLER, GATE).reply, version=5,
                                    header=True).error_code == 31
    describe = DescribeConfigsRequest[2](resources=[], include_synonyms=False)
    plan = authorize(encode(describe), SAMPLER, GATE)  # no place for an error in its answer: close
    assert plan.reply is None and plan.close == "api:DescribeConfigs"


def test_every_refusal_answer_kafka_python_can_build_decodes():
    for key, cls in kafka_gate.REQUEST_CLASSES.items():
        if key == kafka_gate.API_VERSIONS:  # answered by the connection, never refused
            continue
        for version in range(cls.valid_versions[0], cls.valid_versions[1] + 1):
            request = cls[version]()
            request.with_header(correlation_id=5, client_id="t")
            payload = kafka_gate.refusal_payload(request, 31, "no")
            if payload is not None:
                response_cls = ResponseClassRegistry.get_response_class(request.header)
                assert response_cls.decode(payload, version=version, header=True).header.correlation_id == 5


def test_api_versions_offers_only_what_the_gate_checks():
    broker = {0: (0, 11), 1: (0, 17), 2: (0, 9), 3: (0, 12), 19: (0, 7), 20: (0, 6), 22: (0, 5), 8: (0, 9)}
    response = ApiVersionsResponse.decode(kafka_gate.api_versions_payload(3, 9, broker), version=3, header=True)
    offered = {k.api_key: (k.min_version, k.max_version) for k in response.api_keys}
    # CreateTopics and DeleteTopics are offered (before login, to everyone) for a grant of `everything`
    # (the operator's learner on another machine); any other user's are refused per topic.
    # Metadata from 4 only: before it a request cannot say "do not create the topics I name".
    assert offered == {0: (3, 9), 1: (4, 12), 2: (1, 9), 3: (4, 12), 17: (0, 1), 18: (0, 4), 19: (2, 7),
                       20: (1, 6), 22: (0, 5), 36: (0, 2)}
    assert kafka_gate.api_versions_payload(0, 9, broker, sasl_handshake_max=0)  # the v0 raw-token flow
    too_new = ApiVersionsResponse.decode(kafka_gate.api_versions_payload(7, 9, broker), version=0, header=True)
    assert too_new.error_code == 35 and [(k.api_key, k.max_version) for k in too_new.api_keys] == [(18, 4)]


# --------------------------------------------------------------------------- record checks


def budget(limit: int = LIMIT) -> kafka_gate._Budget:
    return kafka_gate._Budget(kafka_gate.DECOMPRESSION_FACTOR * (limit + kafka_gate.BATCH_SLACK))


@pytest.mark.parametrize("codec", [0, 1, 4])  # none, gzip, zstd
def test_record_values_are_checked_after_decompression(codec):
    assert check_records(records([b"a" * 1000] * 50, codec), LIMIT, budget()) is None
    assert check_records(records([b"\0" * LIMIT], codec), LIMIT, budget()) is None
    code, kind, message = check_records(records([b"small", b"\0" * (LIMIT + 1)], codec), LIMIT, budget())
    assert (code, kind) == (10, "record_too_large") and f"limit of {LIMIT} bytes" in message


def test_a_compression_bomb_is_refused_without_inflating_it():
    bomb = records([b"\0" * (64 << 20)], codec=1)  # 64 MiB of zeros: about 64 KiB of gzip
    assert len(bomb) < LIMIT // 8
    tracemalloc.start()
    try:
        started = time.monotonic()
        result = check_records(bomb, LIMIT, budget())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result[0] == 10
    assert peak < 3 * LIMIT and time.monotonic() - started < 2


def test_many_tiny_records_run_out_of_the_request_budget():
    plenty = records([b""] * 5000, codec=1)  # small on the wire, many records to parse
    assert check_records(plenty, LIMIT, kafka_gate._Budget(bytes_left=LIMIT, records_left=4000))[0] == 18
    tight = kafka_gate._Budget(bytes_left=10_000)
    assert check_records(records([b"x" * 1000] * 20, codec=1), LIMIT, tight)[0] == 18


def test_record_data_that_cannot_be_checked_is_refused():
    snappy = bytearray(records([b"x"]))
    snappy[22] |= 2  # attributes (int16 at offset 21): codec snappy, which the gate cannot stream
    assert check_records(bytes(snappy), LIMIT, budget())[0] == 76
    assert check_records(records([b"x"], magic=1), LIMIT, budget())[0] == 87
    assert check_records(records([b"x"]) + b"trailing", LIMIT, budget())[0] == 87
    assert check_records(None, LIMIT, budget())[0] == 87
    corrupt = bytearray(records([b"x" * 10_000], codec=1))  # compressible: really gzip
    corrupt[70:75] = b"\xff" * 5
    assert check_records(bytes(corrupt), LIMIT, budget())[0] == 87


def test_oversized_record_data_is_refused_from_its_size():
    assert check_records(records([b"\0" * (2 * LIMIT)]), LIMIT, budget())[:2] == (10, "record_too_large")
    many = records([b"\0" * (LIMIT // 2)] * 4)
    assert check_records(many, LIMIT, budget())[:2] == (18, "batch_too_large")


def test_produce_with_a_bomb_is_answered_message_too_large():
    request = produce({"run.rollouts": records([b"\0" * (64 << 20)], codec=1)})
    plan = authorize(encode(request), SAMPLER, GATE)
    assert errors(ProduceResponse.decode(plan.reply, version=9, header=True)) == {"run.rollouts": [10]}


def test_gzip_records_from_other_clients_are_plain_gzip():
    """The gate reads gzip batches with the standard library's reader: the format is RFC 1952."""
    batch = records([b"hello" * 100], codec=1)
    body = batch[kafka_gate._BATCH_HEADER.size:]
    assert gzip.decompress(body)


def test_a_record_just_under_the_limit_is_checked_within_a_few_copies_of_it():
    batch = records([os.urandom(LIMIT - 100)], codec=1)  # incompressible: kafka-python leaves it plain
    gz = records([b"\0" * (LIMIT - 100)], codec=1)
    for data in (batch, gz):
        tracemalloc.start()
        try:
            assert check_records(data, LIMIT, budget()) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * LIMIT


def test_only_produce_requests_with_work_in_them_go_to_a_worker_thread():
    small = encode(produce({"run.rollouts": records([b"x" * 10_000])}))
    compressed = encode(produce({"run.rollouts": records([b"x" * 10_000], codec=1)}))
    large = encode(produce({"run.rollouts": records([os.urandom(300_000)])}))
    assert not kafka_gate.produce_needs_worker(small, LIMIT)
    assert kafka_gate.produce_needs_worker(compressed, LIMIT)
    assert kafka_gate.produce_needs_worker(large, LIMIT)
    assert kafka_gate.produce_needs_worker(small[:-3], LIMIT)  # malformed: not checked on the loop


# --------------------------------------------------------------------------- the gate's users, without a broker


def wait_until(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_gate_rereads_its_users_file_and_fails_closed(tmp_path):
    path = tmp_path / "users.json"
    add_user(path, "a", "pw", SAMPLER)
    with kafka_gate.KafkaGate(("127.0.0.1", 0), ("127.0.0.1", 9), path) as gate:
        assert gate.stats()["users"] == 1 and gate.bootstrap == f"127.0.0.1:{gate.address[1]}"
        add_user(path, "b", "pw", VALIDATOR)
        assert wait_until(lambda: gate.stats()["users"] == 2)  # polled about every second
        path.write_text("{half a file")
        assert wait_until(lambda: gate.stats()["users"] == 0)  # unreadable: nobody gets in
        add_user(tmp_path / "other.json", "c", "pw", SAMPLER)
        os.replace(tmp_path / "other.json", path)
        gate.reload_users()
        assert gate.stats()["users"] == 1


def test_the_gate_refuses_to_start_without_users_or_an_address_for_clients(tmp_path):
    with pytest.raises(GateError, match="users file"):
        kafka_gate.KafkaGate(("127.0.0.1", 0), ("127.0.0.1", 9), tmp_path / "missing.json").start()
    add_user(tmp_path / "u.json", "a", "pw", SAMPLER)
    with pytest.raises(GateError, match="--advertise"):
        kafka_gate.KafkaGate(("0.0.0.0", 0), ("127.0.0.1", 9), tmp_path / "u.json").start()


def test_a_users_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "users.json"
    add_user(path, "a", "pw", SAMPLER)
    os.chmod(path, 0o644)
    with pytest.raises(GateError, match="chmod 600"):
        read_users(path)
