"""Per-identity S3 permissions on a real local stack (infra.s3_identities enforced by the
localbucket server): a sampler's key reads and lists its run's policy versions and nothing
else, the stack's admin key still does everything, and a key removed from the identities
file is refused on its next request."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import pytest
from minio import Minio
from minio.commonconfig import CopySource
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from infra.local_stack import StackState, s3_client, stack_services, start_stack, stop_stack
from infra.s3_identities import IDENTITIES_FILE, S3Grant, S3Identity, add_identity, grants_for, remove_identity
from pipeline.weights.store import CheckpointStore, connect_s3

pytestmark = pytest.mark.integration

RUN, OTHER, KAFKA_BUCKET = "myrun", "otherrun", "heterorl-kafka"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackState]:
    data_dir = tmp_path_factory.mktemp("s3-identities")
    state = start_stack(data_dir, kafka_storage="memory")
    try:
        if state.s3_server != "localbucket":
            pytest.skip("identities are enforced by the localbucket server (a minio binary is on PATH)")
        yield state
    finally:
        stop_stack(data_dir, wipe=True)


def _put(client: Minio, bucket: str, key: str, data: bytes = b"x") -> None:
    client.put_object(bucket, key, io.BytesIO(data), len(data))


def _as(state: StackState, identity: S3Identity, region: str | None = "us-east-1") -> Minio:
    return Minio(state.s3_endpoint.split("://", 1)[1], access_key=identity.access_key,
                 secret_key=identity.secret_key, secure=False, region=region)


def _refused(call: Callable[[], object], code: str = "AccessDenied") -> None:
    with pytest.raises(S3Error) as err:
        call()
    assert err.value.code == code, err.value


@pytest.fixture(scope="module")
def published(stack: StackState, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs' v1 (published as a learner does) and a broker batch, all written by the admin."""
    admin = s3_client(stack)
    model = tmp_path_factory.mktemp("model")
    (model / "model.safetensors").write_bytes(b"weights" * 100)
    (model / "config.json").write_text("{}")
    for run in (RUN, OTHER):
        CheckpointStore(admin, stack.bucket, run).upload(1, model)
    _put(admin, stack.bucket, f"{RUN}/state/s1/optimizer.bin")
    admin.make_bucket(KAFKA_BUCKET)  # memory storage: the broker's bucket is not made by the stack
    _put(admin, KAFKA_BUCKET, "clusters/tansu/topics/t/partitions/0/batch-0")
    return model


def test_sampler_identity_reads_its_run_and_nothing_else(stack: StackState, published: Path, tmp_path: Path) -> None:
    path = Path(stack.data_dir) / IDENTITIES_FILE
    sampler = S3Identity("test-sampler-1", "sampler-secret-1", "sampler", grants_for("sampler", stack.bucket, RUN))
    add_identity(path, sampler)
    assert path.stat().st_mode & 0o777 == 0o600
    client = _as(stack, sampler)
    admin = s3_client(stack)

    # What a sampler does (pipeline/weights/store.py), through connect_s3: HeadBucket, then
    # list <run>/, read the manifest, range-read the files.
    services = replace(stack_services(stack, "sampler"), s3_access_key=sampler.access_key,
                       s3_secret_key=sampler.secret_key)
    store = CheckpointStore(connect_s3(services, timeout_s=5), stack.bucket, RUN)
    assert store.list_versions() == [1]
    fetched, manifest = store.fetch(store.manifest_key(1), tmp_path / "v1")
    assert (fetched / "model.safetensors").read_bytes() == (published / "model.safetensors").read_bytes()
    # A client made without a region asks GetBucketLocation first: allowed on its bucket.
    assert _as(stack, sampler, region=None).get_object(stack.bucket, manifest.key).read()

    # Not the bucket root, another run, the learner's states, the broker's bucket.
    _refused(lambda: list(client.list_objects(stack.bucket)))
    _refused(lambda: list(client.list_objects(stack.bucket, prefix=f"{OTHER}/", recursive=True)))
    _refused(lambda: client.get_object(stack.bucket, f"{OTHER}/v1/manifest.json"))
    _refused(lambda: client.get_object(stack.bucket, f"{RUN}/state/s1/optimizer.bin"))
    _refused(lambda: client.get_object(KAFKA_BUCKET, "clusters/tansu/topics/t/partitions/0/batch-0"))
    _refused(lambda: list(client.list_objects(KAFKA_BUCKET, recursive=True)))
    _refused(lambda: client.bucket_exists(KAFKA_BUCKET))
    _refused(lambda: client.list_buckets())
    # No writes, no deletes (single or multi-object), not even under its own run.
    _refused(lambda: _put(client, stack.bucket, f"{RUN}/v2/manifest.json", b"{}"))
    _refused(lambda: client.remove_object(stack.bucket, f"{RUN}/v1/manifest.json"))
    _refused(lambda: list(client.remove_objects(stack.bucket, [DeleteObject(f"{RUN}/v1/manifest.json")])))
    _refused(lambda: client.remove_object(KAFKA_BUCKET, "clusters/tansu/topics/t/partitions/0/batch-0"))
    _refused(lambda: client.make_bucket("sampler-bucket"))
    assert store.list_versions() == [1] and admin.stat_object(KAFKA_BUCKET,
                                                              "clusters/tansu/topics/t/partitions/0/batch-0")

    # Removed from the file: its very next request is refused.
    assert remove_identity(path, sampler.access_key)
    _refused(lambda: client.get_object(stack.bucket, manifest.key), "InvalidAccessKeyId")


def test_multi_object_delete_needs_every_key_and_admin_does_everything(stack: StackState, published: Path) -> None:
    path = Path(stack.data_dir) / IDENTITIES_FILE
    pruner = S3Identity("test-pruner-1", "pruner-secret-1", "learner",
                        (S3Grant(stack.bucket, f"{RUN}/", frozenset({"read", "list", "write", "delete"})),))
    add_identity(path, pruner)
    client, admin = _as(stack, pruner), s3_client(stack)
    _put(client, stack.bucket, f"{RUN}/v7/a")
    # One key outside its prefix refuses the whole request: nothing is deleted.
    _refused(lambda: list(client.remove_objects(stack.bucket, [DeleteObject(f"{RUN}/v7/a"),
                                                               DeleteObject(f"{OTHER}/v1/manifest.json")])))
    assert admin.stat_object(stack.bucket, f"{RUN}/v7/a") and admin.stat_object(stack.bucket, f"{OTHER}/v1/manifest.json")
    assert list(client.remove_objects(stack.bucket, [DeleteObject(f"{RUN}/v7/a")])) == []
    _refused(lambda: client.copy_object(stack.bucket, f"{RUN}/v8/x", CopySource(stack.bucket, f"{OTHER}/v1/config.json")))
    remove_identity(path, pruner.access_key)

    # The stack's admin key: every bucket, every operation.
    assert {b.name for b in admin.list_buckets()} >= {stack.bucket, KAFKA_BUCKET}
    assert admin.get_object(KAFKA_BUCKET, "clusters/tansu/topics/t/partitions/0/batch-0").read() == b"x"
    _put(admin, stack.bucket, "scratch/a")
    admin.copy_object(stack.bucket, "scratch/b", CopySource(stack.bucket, "scratch/a"))
    assert list(admin.remove_objects(stack.bucket, [DeleteObject("scratch/a"), DeleteObject("scratch/b")])) == []
    admin.make_bucket("scratch-bucket")
    admin.remove_bucket("scratch-bucket")
