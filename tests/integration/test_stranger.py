"""What a stranger can do with an invite alone, on the real local stack (issue 77's table, row by
row): its credentials are its own, Kafka and Redis reach it only through the gates, its S3 key reads
its run's policies and nothing else, and revoking the invite ends all three. Every refusal is the
server's (or the gate's) answer to the request the stranger really sent; what a sampler needs
goes through (a lease, claims, a rollout, the pointer, the weights)."""

from __future__ import annotations

import gzip
import io
import json
import os
import time
import uuid

import pytest
import redis
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from heterorl import invites
from heterorl.stack import with_services
from infra.local_stack import stack_services
from pipeline.clients.run_functions import MAX_OWNER_CLAIMS, sampler_token
from pipeline.clients.run_state import RunState, RunStateRefused, connect_redis
from pipeline.clients.topics import TopicWriter, ensure_topic, read_topic, topic_partitions
from pipeline.config import load_config
from pipeline.records.update_log import dead_letter_topic, updates_topic
from pipeline.trust.invites import read_invite
from pipeline.trust.keyring import init_keys, key_paths

pytestmark = pytest.mark.integration

REVOKED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def run(local_stack, tmp_path_factory):
    """A run on the session's stack (its topics, a policy object in S3, an honest sampler's lease),
    and an invite of two joins made on it."""
    tmp = tmp_path_factory.mktemp("stranger")
    name = f"str-{uuid.uuid4().hex[:8]}"
    admin = stack_services(local_stack)
    cfg = with_services(load_config(None, [f"run.name={name}", f"security.keys_dir={tmp / 'keys'}",
                                           f"services.data_dir={local_stack.data_dir}"], env={}), admin)
    init_keys(key_paths(cfg))
    for topic in (cfg.run.topic, updates_topic(cfg.run.topic), dead_letter_topic(cfg.run.topic)):
        ensure_topic(admin.kafka_bootstrap, topic)
    s3 = Minio(admin.s3_endpoint.split("://")[1], admin.s3_access_key, admin.s3_secret_key, secure=False,
               region=admin.s3_region)
    s3.put_object(admin.bucket, f"{name}/v0/manifest.json", io.BytesIO(b"{}"), 2)
    s3.put_object(admin.bucket, f"{name}/state/s0/manifest.json", io.BytesIO(b"{}"), 2)
    honest = RunState(connect_redis(stack_services(local_stack, "sampler").redis_url), name)
    honest.hold_as("honest-0", sampler_token(name, "honest-0", b"honest seed"))
    honest.renew_sampler_lease("honest-0", {"host": "h"}, 60.0)
    text, grant, _ = invites.make_run_invite(cfg, with_services(cfg, stack_services(local_stack, "sampler")), 2, 1.0)
    yield type("Run", (), dict(cfg=cfg, name=name, admin=admin, s3=s3, honest=honest, grant=grant,
                               services=read_invite(text).services, admin_redis=connect_redis(admin.redis_url)))


def kafka_login(services: dict) -> dict:
    return dict(bootstrap_servers=services["kafka_bootstrap"], security_protocol=services["kafka_security_protocol"],
                sasl_mechanism=services["kafka_sasl_mechanism"], sasl_plain_username=services["kafka_sasl_username"],
                sasl_plain_password=services["kafka_sasl_password"])


def producer(services: dict) -> KafkaProducer:
    # sends that are never acknowledged (after a revocation) expire in seconds, so close() returns
    return KafkaProducer(acks="all", retries=0, request_timeout_ms=2000, delivery_timeout_ms=3000, max_block_ms=5000,
                         max_request_size=32 << 20, **kafka_login(services))


def stranger_redis(services: dict) -> redis.Redis:
    return redis.Redis.from_url(services["redis_url"], protocol=2, decode_responses=True, socket_timeout=10)


def stranger_s3(services: dict) -> Minio:
    return Minio(services["s3_endpoint"].split("://")[1], services["s3_access_key"], services["s3_secret_key"],
                 secure=False, region=services["s3_region"])


def test_the_invite_carries_credentials_of_its_own_and_no_server_of_the_operator(run, local_stack):
    s = run.services
    assert s["kafka_bootstrap"] != local_stack.kafka_bootstrap  # the gate, never the broker's own port
    assert s["kafka_sasl_username"] == f"invite-{run.grant.grant_id}" and s["kafka_security_protocol"] == "SASL_PLAINTEXT"
    assert f"invite-{run.grant.grant_id}:" in s["redis_url"] and str(local_stack.port("redis")) not in s["redis_url"]
    assert s["s3_access_key"] not in (local_stack.s3_access_key, *(k for k, _ in local_stack.s3_keys.values()))


def test_what_a_sampler_needs_goes_through(run):
    """A lease, claims, a rollout, the pointer and the weights: the gates let a sampler work."""
    state = RunState(stranger_redis(run.services), run.name)
    state.hold_as("vol-1", sampler_token(run.name, "vol-1", b"volunteer seed"))
    state.renew_sampler_lease("vol-1", {"host": "v"}, 30.0)
    assert state.claim_prompts("vol-1", 4) and state.sampler_view(allowance=4).in_flight >= 4
    sink = producer(run.services)
    assert sink.send(run.cfg.run.topic, b"a group").get(timeout=10).offset >= 0
    sink.close()
    assert stranger_s3(run.services).get_object(run.admin.bucket, f"{run.name}/v0/manifest.json").read() == b"{}"


def test_rows_1_to_4_and_12_kafka(run):
    topic = run.cfg.run.topic
    sink = producer(run.services)
    big = gzip.compress(os.urandom(9 << 20))  # row 1: a 9 MB record
    with pytest.raises(KafkaError):
        sink.send(topic, big).get(timeout=20)
    for target, value in ((updates_topic(topic), b"this is not json"),  # row 2
                          (updates_topic(topic), json.dumps({"kind": "rewind", "step": 0}).encode()),  # row 3
                          (dead_letter_topic(topic), b"{}")):
        with pytest.raises(KafkaError):
            sink.send(target, value).get(timeout=10)
    sink.close()
    admin = KafkaAdminClient(request_timeout_ms=5000, **kafka_login(run.services))
    with pytest.raises(KafkaError):  # row 4
        admin.delete_topics([topic])
    with pytest.raises(KafkaError):  # row 12
        admin.create_topics([NewTopic(f"{run.name}.evil", num_partitions=10_000, replication_factor=1)])
    admin.close()
    bootstrap = run.admin.kafka_bootstrap  # the broker's own port shows what really happened
    assert topic_partitions(bootstrap, topic) and not topic_partitions(bootstrap, f"{run.name}.evil")
    assert not read_topic(bootstrap, updates_topic(topic)) and not read_topic(bootstrap, dead_letter_topic(topic))
    assert max(len(r.value) for r in read_topic(bootstrap, topic)) < 1 << 20


def test_rows_5_and_6_s3(run):
    s3 = stranger_s3(run.services)
    refused = [
        lambda: s3.list_objects(f"{run.admin.bucket}-kafka", recursive=True).__next__(),  # the broker's log
        lambda: s3.remove_object(f"{run.admin.bucket}-kafka", "clusters/x"),
        lambda: s3.put_object(f"{run.admin.bucket}-kafka", "clusters/x", io.BytesIO(b"0"), 1),
        lambda: s3.remove_object(run.admin.bucket, f"{run.name}/v0/manifest.json"),  # row 6
        lambda: s3.put_object(run.admin.bucket, f"{run.name}/v9/manifest.json", io.BytesIO(b"{}"), 2),
        lambda: s3.get_object(run.admin.bucket, f"{run.name}/state/s0/manifest.json"),  # the learner's state
        lambda: s3.list_objects(run.admin.bucket, prefix="", recursive=True).__next__(),
    ]
    for attempt in refused:
        with pytest.raises(S3Error) as info:
            attempt()
        assert info.value.code == "AccessDenied"
    with pytest.raises(S3Error, match="AccessDenied"):  # DeleteObjects: refused whole
        list(s3.remove_objects(run.admin.bucket, [DeleteObject(f"{run.name}/v0/manifest.json")]))
    assert run.s3.get_object(run.admin.bucket, f"{run.name}/v0/manifest.json").read() == b"{}"


def test_rows_7_to_11_redis(run):
    client = stranger_redis(run.services)
    prefix = f"heterorl:{run.name}:"
    for command in (("RPUSH", prefix + "reissue", "abc"), ("RPUSH", prefix + "reissue", *["7"] * 1000),  # 8, 10
                    ("EVAL", "while true do end", "0"),  # 9
                    ("HSET", prefix + "meta", "rollout_topic", "evil"), ("HSET", prefix + "sampler:x", "a", "b"),
                    ("PEXPIRE", prefix + "sampler:honest-0", "1"), ("HGETALL", "heterorl:other-run:policy"),
                    ("FUNCTION", "FLUSH"), ("KEYS", "*"), ("CONFIG", "GET", "maxmemory")):
        with pytest.raises(redis.ResponseError, match="may not"):
            client.execute_command(*command)
    for too_large in (("HSET", prefix + "sampler_stats", "x", "y" * (200 << 20)),  # row 11: a 200 MB value
                      ("RPUSH", prefix + "reissue", *["7"] * 3000)):  # more arguments than any request needs
        with pytest.raises((redis.ResponseError, redis.ConnectionError), match="over the gate's limit|closed|Error"):
            stranger_redis(run.services).execute_command(*too_large)  # refused before it is read whole, then closed
    state = RunState(client, run.name)
    with pytest.raises(RunStateRefused, match="held with another token"):  # another sampler's lease and stats
        state.renew_sampler_lease("honest-0", {"host": "evil"}, 30.0)
    state.hold_as("vol-1", sampler_token(run.name, "vol-1", b"volunteer seed"))
    with pytest.raises(RunStateRefused, match="lease time must be"):  # row 7: a lease with no expiry
        state.renew_sampler_lease("vol-1", {"host": "v"}, 10**9)
    state.hold_as("vol-2", sampler_token(run.name, "vol-2", b"volunteer 2"))
    with pytest.raises(RunStateRefused, match="at most 2 keys like"):  # two joins: two sampler ids named already
        state.renew_sampler_lease("vol-2", {"host": "v"}, 30.0)
    vol = RunState(client, run.name)
    vol.hold_as("vol-1", sampler_token(run.name, "vol-1", b"volunteer seed"))
    vol.renew_sampler_lease("vol-1", {"host": "v"}, 30.0)
    held = [i for _ in range(200) for i in vol.claim_prompts("vol-1", 1024)]  # row 7: 100,000 fake claims
    assert len(held) <= MAX_OWNER_CLAIMS and vol.claim_prompts("vol-1", 1024) == []
    assert run.honest.sampler_view(allowance=8).in_flight == 8  # counted as one batch of the fleet's
    assert run.honest.sampler_lease("honest-0")["host"] == "h"


def test_a_stranger_using_the_functions_as_given_cannot_stall_or_rob_the_fleet(run):
    """The second review of issue 77: what a stranger did through the functions themselves. Claiming
    and completing without sending held every honest sampler's pacing back for good (the fleet
    counted everything completed); naming its one admitted lease key it heartbeat as new ids, and
    named it as the lease of an honest sampler whose claims it then had re-issued; it held the sweep
    for ten minutes; it flooded the join stream; it set the run's epoch size."""
    client = stranger_redis(run.services)
    prefix = f"heterorl:{run.name}:"
    vol = RunState(client, run.name)
    vol.hold_as("vol-1", sampler_token(run.name, "vol-1", b"volunteer seed"))
    vol.renew_sampler_lease("vol-1", {"host": "v"}, 30.0)
    before = run.honest.sampler_view(allowance=8).unjudged
    completed = vol.complete_prompts("vol-1", [int(i) for i, owner in client.hgetall(prefix + "claims").items()
                                               if owner == "vol-1"])  # what it hoarded before
    for _ in range(5):  # 5,000 more prompts completed, nothing sent
        completed += vol.complete_prompts("vol-1", vol.claim_prompts("vol-1", 1024))
    assert completed >= 5 * 1024 and int(client.hget(prefix + "completed_by", "vol-1")) == completed
    assert run.honest.sampler_view(allowance=8).unjudged <= before + 4 * 8  # four of its batches at most
    held = run.honest.claim_prompts("honest-0", 2)
    refused = {
        "key 1 must be": lambda: vol._call("hr_heartbeat", vol._keys("hr_heartbeat", "vol-1"),
                                           ["vol-99", "t" * 32, 30000, "{}"]),
        "key 4 must be": lambda: vol._call("hr_reissue", vol._keys("hr_reissue", "vol-1"), ["honest-0", *held]),
        "sweep interval": lambda: vol._call("hr_sweep_due", vol._keys("hr_sweep_due"), [600_000]),
        "may not call function 'hr_epoch_size'": lambda: vol._call("hr_epoch_size", vol._keys("hr_epoch_size"), [7]),
    }
    for why, attempt in refused.items():
        with pytest.raises(RunStateRefused, match=why):
            attempt()
    vol.epoch_size = 7
    assert vol.claim_prompts("vol-1", 1) and b"epoch_size" not in run.admin_redis.hkeys(prefix + "meta")
    with pytest.raises(RunStateRefused, match="at most 8 times"):  # an invite of two joins: 8 requests
        for n in range(20):
            vol.request_join({"n": n})
    assert run.honest.complete_prompts("honest-0", held) == 2  # its claims stayed its own


def test_row_13_revoking_the_invite_ends_its_access_everywhere(run):
    s = run.services
    sink, client, s3 = producer(s), stranger_redis(s), stranger_s3(s)
    assert sink.send(run.cfg.run.topic, b"before").get(timeout=10).offset >= 0 and client.ping()
    revoked_at = time.monotonic()
    lines = invites.revoke_invite(run.cfg, connect_redis(run.admin.redis_url), run.grant.grant_id)
    assert "Kafka, Redis, S3" in lines[-1]
    ended = {}
    while len(ended) < 3 and time.monotonic() - revoked_at < REVOKED_WITHIN_S:
        for name, attempt in (("kafka", lambda: sink.send(run.cfg.run.topic, b"after").get(timeout=2)),
                              ("redis", lambda: client.get(f"heterorl:{run.name}:policy")),
                              ("s3", lambda: s3.get_object(run.admin.bucket, f"{run.name}/v0/manifest.json"))):
            if name in ended:
                continue
            try:
                attempt()
            except (KafkaError, redis.RedisError, S3Error):
                ended[name] = time.monotonic() - revoked_at
        time.sleep(0.2)
    assert set(ended) == {"kafka", "redis", "s3"}, ended
    assert max(ended.values()) <= REVOKED_WITHIN_S
    with pytest.raises(redis.AuthenticationError):  # and no new login either
        stranger_redis(s).ping()
    sink.close()
