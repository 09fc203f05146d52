"""Who may do what on the local S3 server (infra.s3_identities): the decision for each kind of
request, the identities file and the store that re-reads it. No server: the integration test
tests/integration/test_s3_identities.py has one."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from email.message import Message
from pathlib import Path

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from infra.s3_auth import AuthError, verify_request
from infra.s3_identities import (
    FORMAT, IdentityFileError, IdentityStore, S3Grant, S3Identity, add_identity, admin_identity, authorize,
    grants_for, new_identity, read_identities, remove_identity, write_identities,
)

RUN = "myrun"
SAMPLER = S3Identity("sampler-key", "sampler-secret", "sampler", grants_for("sampler", "heterorl", RUN))
LEARNER = S3Identity("learner-key", "learner-secret", "learner", grants_for("learner", "heterorl"))
BROKER = S3Identity("broker-key", "broker-secret", "broker", grants_for("broker", "heterorl-kafka"))
ADMIN = admin_identity("admin-key", "admin-secret")


def allowed(identity: S3Identity, method: str, bucket: str, key: str = "", query: dict | None = None,
            **kw) -> bool:
    try:
        authorize(identity, method, bucket, key, query or {}, **kw)
    except AuthError as error:
        assert (error.status, error.code) == (403, "AccessDenied")
        assert "\n" not in error.message and identity.access_key in error.message
        return False
    return True


def test_sampler_reads_and_lists_its_runs_policy_versions_only():
    assert grants_for("sampler", "heterorl", RUN) == (
        S3Grant("heterorl", "myrun/", frozenset({"list"})), S3Grant("heterorl", "myrun/v", frozenset({"read"})))
    # What CheckpointStore does for a sampler: HeadBucket (connect_s3), list <run>/, read v<N>/...
    assert allowed(SAMPLER, "HEAD", "heterorl")
    assert allowed(SAMPLER, "GET", "heterorl", query={"location": ""})
    assert allowed(SAMPLER, "GET", "heterorl", query={"list-type": "2", "prefix": "myrun/"})
    assert allowed(SAMPLER, "GET", "heterorl", query={"prefix": "myrun/v3/", "delimiter": "/"})  # v1 listing
    assert allowed(SAMPLER, "GET", "heterorl", "myrun/v3/manifest.json")
    assert allowed(SAMPLER, "HEAD", "heterorl", "myrun/v3/model.safetensors")
    assert allowed(SAMPLER, "GET", "heterorl", "myrun/v3/manifest.json", {"tagging": ""})
    # Not the bucket root, another run (even one whose name starts with its own), the learner's states.
    assert not allowed(SAMPLER, "GET", "heterorl", query={"list-type": "2"})
    assert not allowed(SAMPLER, "GET", "heterorl", query={"list-type": "2", "prefix": "myrun"})
    assert not allowed(SAMPLER, "GET", "heterorl", query={"list-type": "2", "prefix": "myrun2/"})
    assert not allowed(SAMPLER, "GET", "heterorl", "other/v1/manifest.json")
    assert not allowed(SAMPLER, "GET", "heterorl", "myrun2/v1/manifest.json")
    assert not allowed(SAMPLER, "GET", "heterorl", "myrun/state/s4/optimizer.pt")
    assert not allowed(SAMPLER, "GET", "heterorl", "myrun/v1/../../other/v1/manifest.json")
    # Never writes or deletes, single or multi-object; nothing in the broker's bucket; no admin.
    assert not allowed(SAMPLER, "PUT", "heterorl", "myrun/v3/manifest.json")
    assert not allowed(SAMPLER, "POST", "heterorl", "myrun/v9/x", {"uploads": ""})
    assert not allowed(SAMPLER, "DELETE", "heterorl", "myrun/v3/manifest.json")
    assert not allowed(SAMPLER, "POST", "heterorl", query={"delete": ""})
    assert not allowed(SAMPLER, "POST", "heterorl", query={"delete": ""}, delete_keys=["myrun/v3/manifest.json"])
    for method, key, query in (("GET", "clusters/x/batch", {}), ("HEAD", "", {}), ("GET", "", {"list-type": "2"})):
        assert not allowed(SAMPLER, method, "heterorl-kafka", key, query)
    assert not allowed(SAMPLER, "GET", "")
    assert not allowed(SAMPLER, "PUT", "heterorl-new")


def test_validator_gets_the_samplers_grants():
    assert grants_for("validator", "heterorl", RUN) == grants_for("sampler", "heterorl", RUN)
    with pytest.raises(IdentityFileError, match="run"):
        grants_for("validator", "heterorl")


def test_learner_owns_its_bucket_and_nothing_else():
    for method, key, query in (("PUT", "myrun/v4/model.safetensors", {}), ("GET", "myrun/state/s4/x", {}),
                               ("GET", "", {"list-type": "2", "prefix": ""}), ("DELETE", "myrun/v1/x", {}),
                               ("POST", "myrun/v4/big", {"uploads": ""}),
                               ("PUT", "myrun/v4/big", {"uploadId": "ab", "partNumber": "1"}),
                               ("POST", "myrun/v4/big", {"uploadId": "ab"}), ("DELETE", "myrun/v4/big", {"uploadId": "ab"})):
        assert allowed(LEARNER, method, "heterorl", key, query), (method, key, query)
    assert allowed(LEARNER, "POST", "heterorl", query={"delete": ""}, delete_keys=["a/v1/x", "b/v2/y"])
    assert allowed(LEARNER, "PUT", "heterorl", "myrun/v5/x", copy_source="/heterorl/myrun/v4/x")
    assert not allowed(LEARNER, "PUT", "heterorl", "myrun/v5/x", copy_source="heterorl-kafka/clusters/x")
    assert not allowed(LEARNER, "GET", "heterorl-kafka", "clusters/x")
    assert not allowed(LEARNER, "DELETE", "heterorl")  # DeleteBucket
    assert not allowed(LEARNER, "PUT", "heterorl")  # CreateBucket
    assert not allowed(LEARNER, "GET", "")  # ListBuckets


def test_broker_owns_the_kafka_bucket():
    for method, key, query in (("PUT", "clusters/c/topics/t/0/batch", {}), ("GET", "clusters/c/x", {}),
                               ("HEAD", "clusters/c/x", {}), ("GET", "", {"list-type": "2", "prefix": "clusters/"}),
                               ("DELETE", "clusters/c/x", {}), ("HEAD", "", {})):
        assert allowed(BROKER, method, "heterorl-kafka", key, query)
    assert not allowed(BROKER, "GET", "heterorl", "myrun/v1/manifest.json")
    assert not allowed(BROKER, "GET", "heterorl", query={"list-type": "2", "prefix": "myrun/"})


def test_admin_does_everything_and_bucket_admin_needs_the_whole_bucket():
    for method, bucket, key in (("GET", "", ""), ("PUT", "new-bucket", ""), ("DELETE", "heterorl", ""),
                                ("DELETE", "heterorl-kafka", "clusters/x"), ("GET", "heterorl", "a/../b")):
        assert allowed(ADMIN, method, bucket, key)
    assert allowed(ADMIN, "POST", "heterorl", query={"delete": ""}, delete_keys=["x", "y"])
    assert allowed(ADMIN, "PATCH", "heterorl", "x")  # not an S3 operation: left to the server to refuse
    run_admin = S3Identity("runadmin", "run-admin-secret", "x", (S3Grant("heterorl", "myrun/", {"admin"}),))
    assert allowed(run_admin, "DELETE", "heterorl", "myrun/v1/x")
    assert not allowed(run_admin, "DELETE", "heterorl")  # DeleteBucket needs prefix ""
    assert not allowed(run_admin, "GET", "")  # ListBuckets needs bucket "*"


def test_delete_objects_needs_every_key():
    deleter = S3Identity("deleter", "deleter-secret", "x", (S3Grant("heterorl", "myrun/v", {"delete"}),))
    assert allowed(deleter, "POST", "heterorl", query={"delete": ""})  # before the body: some delete grant
    assert allowed(deleter, "POST", "heterorl", query={"delete": ""}, delete_keys=["myrun/v1/a", "myrun/v2/b"])
    with pytest.raises(AuthError, match="DeleteObjects of heterorl/myrun/state/s1/a"):
        authorize(deleter, "POST", "heterorl", "", {"delete": ""}, delete_keys=["myrun/v1/a", "myrun/state/s1/a"])


def test_copy_needs_read_on_its_source():
    copier = S3Identity("copier", "copier-secret", "x", (S3Grant("heterorl", "dst/", {"write"}),
                                                         S3Grant("heterorl", "src/", {"read"})))
    assert allowed(copier, "PUT", "heterorl", "dst/x", copy_source="heterorl/src/x?versionId=1")
    assert allowed(copier, "PUT", "heterorl", "dst/x", {"uploadId": "u", "partNumber": "1"},
                   copy_source="/heterorl/src%2Fx")
    with pytest.raises(AuthError, match="CopyObject of heterorl/other/x"):
        authorize(copier, "PUT", "heterorl", "dst/x", {}, copy_source="/heterorl/other/x")
    assert not allowed(copier, "PUT", "heterorl", "src/x", copy_source="/heterorl/src/y")


def test_grants_and_identities_refuse_mistakes_in_one_line():
    for make in (lambda: S3Grant("heterorl", "", {"rwx"}), lambda: S3Grant("heterorl", "", set()),
                 lambda: S3Grant("", "", {"read"}), lambda: S3Identity("a b", "long-enough"),
                 lambda: S3Identity("okkey", "short"), lambda: grants_for("janitor", "heterorl")):
        with pytest.raises(IdentityFileError) as err:
            make()
        assert "\n" not in str(err.value)
    assert "sampler-secret" not in repr(SAMPLER)


def test_file_round_trip_add_remove_and_mode(tmp_path: Path):
    path = tmp_path / "s3-identities.json"
    assert read_identities(path) == []  # no file: no identities
    write_identities(path, [SAMPLER, LEARNER])
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_identities(path) == [SAMPLER, LEARNER]
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["identities"][0]["grants"] == [{"bucket": "heterorl", "prefix": "myrun/", "actions": ["list"]},
                                               {"bucket": "heterorl", "prefix": "myrun/v", "actions": ["read"]}]
    add_identity(path, BROKER)
    with pytest.raises(IdentityFileError, match="already there"):
        add_identity(path, BROKER)
    moved = S3Identity(SAMPLER.access_key, "new-secret-1", "sampler", grants_for("sampler", "heterorl", "run2"))
    add_identity(path, moved, replace=True)
    assert {i.access_key: i for i in read_identities(path)}[SAMPLER.access_key] == moved
    assert remove_identity(path, LEARNER.access_key) is True
    assert remove_identity(path, LEARNER.access_key) is False
    assert [i.access_key for i in read_identities(path)] == [SAMPLER.access_key, BROKER.access_key]
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    fresh = new_identity("sampler", grants_for("sampler", "heterorl", RUN))
    assert fresh.access_key.startswith("heterorl-sampler-") and fresh.secret_key != new_identity("x", ()).secret_key


@pytest.mark.parametrize("text, match", [
    ("{", "not JSON"),
    ('{"identities": []}', "format"),
    (json.dumps({"format": FORMAT, "identities": [{"access_key": "k1k", "secret_key": "12345678", "grant": []}]}),
     "unknown field"),
    (json.dumps({"format": FORMAT, "identities": [{"access_key": "k1k", "secret_key": "12345678",
                                                   "grants": [{"bucket": "b", "actions": "read"}]}]}), "list of strings"),
    (json.dumps({"format": FORMAT, "identities": [{"access_key": "k1k", "secret_key": "12345678"}] * 2}), "twice"),
])
def test_a_broken_file_is_one_line(tmp_path: Path, text: str, match: str):
    path = tmp_path / "ids.json"
    path.write_text(text)
    with pytest.raises(IdentityFileError, match=match) as err:
        read_identities(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_store_follows_the_file_and_fails_closed(tmp_path: Path):
    path = tmp_path / "s3-identities.json"
    store = IdentityStore(path, [ADMIN])
    assert store.get(ADMIN.access_key) == ADMIN and store.get(SAMPLER.access_key) is None  # no file yet
    add_identity(path, SAMPLER)
    assert store.get(SAMPLER.access_key) == SAMPLER
    add_identity(path, LEARNER)
    remove_identity(path, SAMPLER.access_key)
    assert store.get(SAMPLER.access_key) is None  # revoked on the very next lookup
    assert store.get(LEARNER.access_key) == LEARNER
    # The file cannot shadow or revoke the fixed admin key.
    add_identity(path, S3Identity(ADMIN.access_key, "other-secret", "intruder", ()))
    assert store.get(ADMIN.access_key) == ADMIN
    # A broken file grants nothing (not the last good one) until fixed; a deleted one neither.
    path.write_text("{ broken")
    assert store.get(LEARNER.access_key) is None and store.get(ADMIN.access_key) == ADMIN
    write_identities(path, [LEARNER])
    assert store.get(LEARNER.access_key) == LEARNER
    path.unlink()
    assert store.get(LEARNER.access_key) is None


def test_store_drives_signature_checks_per_key(tmp_path: Path):
    """verify_request with a lookup: each key's own secret; an unknown or removed key is
    InvalidAccessKeyId; the key found is in Verified.credentials."""
    path = tmp_path / "s3-identities.json"
    write_identities(path, [SAMPLER])
    store = IdentityStore(path, [ADMIN])

    def lookup(access_key: str):
        identity = store.get(access_key)
        return identity.credentials("us-east-1") if identity else None

    def signed(access: str, secret: str) -> Message:
        request = AWSRequest(method="GET", url="http://127.0.0.1:9000/heterorl/myrun/v1/x")
        S3SigV4Auth(Credentials(access, secret), "s3", "us-east-1").add_auth(request)
        headers = Message()
        headers["Host"] = "127.0.0.1:9000"
        for name, value in request.headers.items():
            headers[name] = value
        return headers

    now = datetime.now(timezone.utc)
    for identity in (SAMPLER, ADMIN):
        verified = verify_request("GET", "/heterorl/myrun/v1/x", signed(identity.access_key, identity.secret_key),
                                  lookup, now=now)
        assert verified.credentials is not None and verified.credentials.access_key == identity.access_key
    with pytest.raises(AuthError) as err:
        verify_request("GET", "/heterorl/myrun/v1/x", signed(SAMPLER.access_key, ADMIN.secret_key), lookup)
    assert err.value.code == "SignatureDoesNotMatch"
    remove_identity(path, SAMPLER.access_key)
    os.utime(path)
    with pytest.raises(AuthError) as err:
        verify_request("GET", "/heterorl/myrun/v1/x", signed(SAMPLER.access_key, SAMPLER.secret_key), lookup)
    assert err.value.code == "InvalidAccessKeyId"


def test_store_sees_a_rewrite_that_keeps_inode_size_and_mtime(tmp_path: Path):
    """A coarse mtime clock can stamp two writes alike: a recently changed file is re-read."""
    path = tmp_path / "s3-identities.json"
    write_identities(path, [SAMPLER])
    store = IdentityStore(path)
    assert store.get(SAMPLER.access_key) == SAMPLER
    before = path.stat()
    path.write_text(path.read_text().replace("sampler-key", "samplez-key"))  # in place, same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_size) == (before.st_ino, before.st_size)
    assert store.get(SAMPLER.access_key) is None and store.get("samplez-key") is not None
