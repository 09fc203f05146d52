"""Authentication and TLS settings: validated when the config loads, handed to every client,
never printed; the local stack's Redis users (no server needed)."""

from __future__ import annotations

import pytest
import yaml
import redis
import urllib3
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

import pipeline.clients.topics as topics
from infra.access import redis_acl_rules
from infra.local_stack import StackState, stack_services
from pipeline.config import ConfigError, dump_config, load_config, strip_password
from pipeline.clients.services import ServiceSecurity, Services, require_services

SASL = {"KAFKA_BOOTSTRAP_SERVERS": "kafka.example:9093", "REDIS_URL": "rediss://sampler:r3d1s-pw@redis.example:6380/0",
        "AWS_ENDPOINT_URL": "https://minio.example:9000", "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": "sampler", "KAFKA_SASL_PASSWORD": "k4fka-pw",
        "KAFKA_SSL_CAFILE": "/certs/ca.crt", "REDIS_SSL_CA_CERTS": "/certs/ca.crt", "AWS_CA_BUNDLE": "/certs/ca.crt"}


def _services(env: dict = SASL, overrides: tuple = ()) -> Services:
    return require_services(load_config(None, list(overrides), env=env).services)


def test_settings_from_the_environment_reach_the_kafka_clients():
    kwargs = _services().security.kafka_kwargs()
    assert kwargs == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                      "sasl_plain_username": "sampler", "sasl_plain_password": "k4fka-pw",
                      "ssl_cafile": "/certs/ca.crt", "ssl_certfile": None, "ssl_keyfile": None,
                      "ssl_check_hostname": True}
    for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):  # every name is one kafka-python takes
        assert set(kwargs) <= set(client.DEFAULT_CONFIG), client
    assert ServiceSecurity().kafka_kwargs() == {"security_protocol": "PLAINTEXT"}


def test_the_topic_writer_hands_the_settings_to_the_producer(monkeypatch):
    made = {}

    class Recording(KafkaProducer):
        def __init__(self, **configs):
            made.update(configs)
            raise topics.SaslAuthenticationFailedError("refused")

    monkeypatch.setattr(topics, "KafkaProducer", Recording)
    with pytest.raises(topics.ServiceUnavailable, match="kafka.example:9093 refused the credentials"):
        topics.TopicWriter("kafka.example:9093", "t", security=_services().security)
    assert made["security_protocol"] == "SASL_SSL" and made["sasl_plain_password"] == "k4fka-pw"


def test_redis_tls_files_go_with_a_rediss_url_only():
    services = _services()
    client = redis.Redis.from_url(services.redis_url, **services.security.redis_kwargs(services.redis_url))
    conn = client.connection_pool.connection_kwargs
    assert (conn["username"], conn["password"], conn["ssl_ca_certs"]) == ("sampler", "r3d1s-pw", "/certs/ca.crt")
    assert services.security.redis_kwargs("redis://127.0.0.1:6379/0") == {}


def test_s3_certificate_checks():
    security = _services().security
    assert security.s3_pool_kwargs("https://minio.example") == {"cert_reqs": "CERT_REQUIRED",
                                                                "ca_certs": "/certs/ca.crt"}
    assert security.s3_pool_kwargs("http://127.0.0.1:9000") == {}
    off = _services(overrides=("services.s3_cert_check=false",)).security
    assert off.s3_pool_kwargs("https://minio.example") == {"cert_reqs": "CERT_NONE"}
    urllib3.PoolManager(**security.s3_pool_kwargs("https://minio.example"))  # urllib3 takes them


@pytest.mark.parametrize("overrides, message", [
    (("services.kafka_security_protocol=SASL_SSL",), "needs services.kafka_sasl_mechanism"),
    (("services.kafka_sasl_username=u",), "kafka_security_protocol is PLAINTEXT"),
    (("services.kafka_security_protocol=TLS",), "kafka_security_protocol"),
    (("services.redis_ssl_certfile=/c.pem",), "redis_ssl_certfile and services.redis_ssl_keyfile go together"),
])
def test_inconsistent_settings_fail_when_the_config_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, list(overrides), env={})


def test_passwords_are_never_printed():
    cfg = load_config(None, [], env=SASL)
    dumped = dump_config(cfg)
    assert "k4fka-pw" not in dumped and "r3d1s-pw" not in dumped
    # A Redis URL with a password travels only in the environment: a saved "***" would be used as one.
    assert yaml.safe_load(dumped)["services"]["redis_url"] is None
    services = require_services(cfg.services)
    assert "k4fka-pw" not in repr(services) and "r3d1s-pw" not in str(services.public())
    assert strip_password("redis://admin:s3cret@127.0.0.1:6379/0") == "redis://admin:***@127.0.0.1:6379/0"
    assert strip_password("rediss://:s3cret@h:6380/0") == "rediss://:***@h:6380/0"


def _state(**extra) -> StackState:
    return StackState(data_dir="/tmp/x", kafka_bootstrap="127.0.0.1:1", redis_url="redis://admin:a-pw@127.0.0.1:2/0",
                      s3_endpoint="http://127.0.0.1:3", s3_access_key="k", s3_secret_key="s", s3_region="us-east-1",
                      bucket="heterorl", kafka_storage="memory://tansu/", processes={}, started_at=0.0, **extra)


def test_stack_services_carry_the_role_s_redis_user():
    state = _state(redis_passwords={"admin": "a-pw", "learner": "l-pw", "sampler": "s-pw"})
    assert stack_services(state).redis_url == state.redis_url
    assert stack_services(state, "sampler").redis_url == "redis://sampler:s-pw@127.0.0.1:2/0"
    # A stack recorded before Redis had users keeps its plain URL for every role.
    old = StackState.from_json({k: v for k, v in _state().to_json().items() if k != "redis_passwords"}
                               | {"redis_url": "redis://127.0.0.1:2/0"})
    assert stack_services(old, "sampler").redis_url == "redis://127.0.0.1:2/0"


def test_sampler_acl_reads_the_policy_but_writes_only_its_own_keys():
    rules7 = redis_acl_rules("sampler", (7, 0)).split()
    assert "%R~heterorl:*:policy" in rules7 and "~heterorl:*:policy" not in rules7
    assert "~heterorl:*:claims" in rules7 and "-@dangerous" in rules7
    assert "-@scripting" in rules7 and rules7[-3:] == ["+fcall", "+fcall_ro", "+time"]  # FCALL, no script of its own
    assert "~heterorl:*:policy" in redis_acl_rules("sampler", (6, 2)).split()  # no %R~ before Redis 7
    assert redis_acl_rules("learner", (6, 2)).split()[:2] == ["resetkeys", "~heterorl:*"]
