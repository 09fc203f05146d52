"""Checkpoints in a real S3 server: manifest last, every file verified, tampering refused."""

import io
import json

import pytest

from pipeline.weights.store import CheckpointStore, CorruptCheckpointError, connect_s3
from pipeline.clients.services import Services

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, ModelSize(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32))
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _store(stack, run) -> CheckpointStore:
    services = Services(stack.kafka_bootstrap, stack.redis_url, stack.s3_endpoint, stack.s3_access_key,
                        stack.s3_secret_key, stack.s3_region, stack.bucket)
    return CheckpointStore(connect_s3(services), stack.bucket, run)


def test_publish_fetch_verify_and_load(local_stack, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = _store(local_stack, "ckpt-roundtrip")
    key = store.upload(5, tiny_model_dir, extra={"offsets": {"0": 12}})
    assert key == "ckpt-roundtrip/v5/manifest.json"
    assert store.list_versions() == [5]
    path, manifest = store.fetch(key, tmp_path / "v5")
    assert manifest.version == 5 and manifest.extra == {"offsets": {"0": 12}}
    names = {f["path"] for f in manifest.files}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest.files)
    # Any published version is a plain Hugging Face directory.
    loaded = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True)
    for (n, a), (_, b) in zip(loaded.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), n
    AutoTokenizer.from_pretrained(path)


def test_tampered_file_is_refused_and_nothing_is_left_to_load(local_stack, tiny_model_dir, tmp_path):
    store = _store(local_stack, "ckpt-tamper")
    key = store.upload(1, tiny_model_dir)
    obj = store.client.get_object(store.bucket, "ckpt-tamper/v1/model.safetensors")
    data = bytearray(obj.read())
    obj.close()
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    store.client.put_object(store.bucket, "ckpt-tamper/v1/model.safetensors", io.BytesIO(bytes(data)), len(data))
    with pytest.raises(CorruptCheckpointError, match=r"refused .* after 2 attempts: model.safetensors: sha256"):
        store.fetch(key, tmp_path / "v1", attempts=2)
    assert not (tmp_path / "v1").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fetch-")]


def test_a_learner_resumes_from_the_state_before_a_newest_that_cannot_be_downloaded(local_stack, tiny_model_dir,
                                                                                    tmp_path):
    from pipeline.weights.recovery import fetch_newest_state, recovery_store

    states = recovery_store(_store(local_stack, "ckpt-fallback"))
    for step in (4, 5):
        states.upload(step, tiny_model_dir, extra={"offsets": {"0": 10 * step}})
    # the newest state's weights altered, then gone, while its manifest still reads
    name = "ckpt-fallback/state/s5/model.safetensors"
    data = b"\x00" * states.client.stat_object(states.bucket, name).size
    states.client.put_object(states.bucket, name, io.BytesIO(data), len(data))
    skipped = []
    model_dir, manifest = fetch_newest_state(states, tmp_path / "a", on_skip=lambda step, e: skipped.append(step))
    assert manifest.version == 4 and manifest.extra["offsets"] == {"0": 40} and skipped == [5]
    assert (model_dir / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    states.client.remove_object(states.bucket, name)
    assert fetch_newest_state(states, tmp_path / "b")[1].version == 4
    # none can be had: an error, never a silent start from the base model
    states.client.remove_object(states.bucket, "ckpt-fallback/state/s4/model.safetensors")
    with pytest.raises(CorruptCheckpointError, match=r"none of the recovery states of steps \[4, 5\]"):
        fetch_newest_state(states, tmp_path / "c")
    assert fetch_newest_state(recovery_store(_store(local_stack, "ckpt-no-state")), tmp_path / "d") is None


def test_version_without_manifest_does_not_exist(local_stack, tiny_model_dir):
    store = _store(local_stack, "ckpt-partial")
    store.upload(1, tiny_model_dir)
    # A learner that died mid-upload: files, no manifest.
    store.client.fput_object(store.bucket, "ckpt-partial/v2/model.safetensors", str(tiny_model_dir / "model.safetensors"))
    assert store.list_versions() == [1]


def test_malicious_manifest_path_is_refused(local_stack, tmp_path):
    store = _store(local_stack, "ckpt-evil")
    body = json.dumps({"format": "heterorl-checkpoint/1", "run": "ckpt-evil", "version": 1, "created_at": 0,
                       "files": [{"path": "../../etc/passwd", "size": 1, "sha256": "0" * 64}]}).encode()
    store.client.put_object(store.bucket, "ckpt-evil/v1/manifest.json", io.BytesIO(body), len(body))
    with pytest.raises(CorruptCheckpointError, match="unsafe path"):
        store.fetch("ckpt-evil/v1/manifest.json", tmp_path / "x")


def test_prune_keeps_the_newest(local_stack, tiny_model_dir):
    store = _store(local_stack, "ckpt-prune")
    for v in range(5):
        store.upload(v, tiny_model_dir)
    # v4 stands for a version an earlier, crashed learner published past the current v3.
    # v0, the base model, stays: a replay of the run starts from it.
    assert store.prune(keep_last=2, current=3) == [1]
    assert store.list_versions() == [0, 2, 3, 4]
    leftover = [o.object_name for o in store.client.list_objects(store.bucket, prefix="ckpt-prune/v1/", recursive=True)]
    assert leftover == []


class _CutOnce:
    """Wraps a Minio client: the first range response breaks after `cut_at` bytes of the object."""

    def __init__(self, client, cut_at: int):
        self.client, self.cut_at, self.requests, self.cut = client, cut_at, [], False

    def __getattr__(self, name):
        return getattr(self.client, name)

    def get_object(self, bucket, key, offset=0, length=0):
        import urllib3

        self.requests.append((key, offset, length))
        response = self.client.get_object(bucket, key, offset=offset, length=length)
        if self.cut or not key.endswith("big.safetensors") or not offset <= self.cut_at < offset + length:
            return response
        self.cut, wrapper = True, self

        class Broken:
            def stream(self, amt):
                sent = offset
                for block in response.stream(amt):
                    keep = block[: max(0, wrapper.cut_at - sent)]
                    if keep:
                        yield keep
                    sent += len(keep)
                    if sent >= wrapper.cut_at:
                        raise urllib3.exceptions.ProtocolError("connection reset by peer (injected)")

            def close(self):
                response.close()

            def release_conn(self):
                response.release_conn()

        return Broken()


def test_an_interrupted_download_resumes_where_it_stopped(local_stack, tmp_path, monkeypatch):
    import os

    import pipeline.weights.store as checkpoints

    model = tmp_path / "model"
    model.mkdir()
    size = 1_000_000
    (model / "big.safetensors").write_bytes(os.urandom(size))
    (model / "config.json").write_text("{}")
    store = _store(local_stack, "ckpt-resume")
    key = store.upload(1, model)
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 256 * 1024)
    cut = _CutOnce(store.client, cut_at=900_000)  # the link drops at 90 %
    store.client = cut
    path, _ = store.fetch(key, tmp_path / "v1")
    assert (path / "big.safetensors").read_bytes() == (model / "big.safetensors").read_bytes()
    big = [(offset, length) for k, offset, length in cut.requests if k.endswith("big.safetensors")]
    # Four chunks of 256 KiB; the fourth broke at 900 000 and resumed there, not at 0.
    assert [offset for offset, _ in big] == [0, 262144, 524288, 786432, 900_000]
    assert big[-1] == (900_000, size - 900_000)


def test_samplers_do_not_download_the_learner_state(local_stack, tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "learner_state").mkdir()
    (model / "learner_state" / "optimizer.safetensors").write_bytes(b"x" * 1000)
    store = _store(local_stack, "ckpt-private")
    key = store.upload(2, model)
    public, _ = store.fetch(key, tmp_path / "sampler")
    assert not (public / "learner_state").exists() and (public / "model.safetensors").is_file()
    private, _ = store.fetch(key, tmp_path / "learner", learner_state=True)
    assert (private / "learner_state" / "optimizer.safetensors").read_bytes() == b"x" * 1000


class _Payload:
    """Unpickling this creates a file: proof that a pickle was executed."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_files_are_never_published_and_a_manifest_naming_one_is_refused(local_stack, tiny_model_dir,
                                                                                 tmp_path):
    import hashlib
    import io
    import json
    import pickle
    import shutil

    from pipeline.weights.store import MANIFEST_FORMAT, CorruptCheckpointError

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for name in ("pytorch_model.bin", "learner_state/state/mp_rank_00_model_states.pt", "extra.pkl", "w.pth"):
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(payload)
    store = _store(local_stack, "ckpt-pickle")
    key = store.upload(1, model)
    names = [f["path"] for f in store.read_manifest(key).files]
    assert "model.safetensors" in names and not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))]

    # Someone who can write to the bucket plants a pickle and a manifest that lists it, sha256 and all.
    manifest = json.loads(store.client.get_object(store.bucket, key).read())
    planted = "learner_state/state/mp_rank_00_model_states.pt"
    store.client.put_object(store.bucket, f"ckpt-pickle/v1/{planted}", io.BytesIO(payload), len(payload))
    manifest["files"].append({"path": planted, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})
    body = json.dumps({**manifest, "format": MANIFEST_FORMAT}).encode()
    store.client.put_object(store.bucket, key, io.BytesIO(body), len(body))
    with pytest.raises(CorruptCheckpointError, match="pickle-based file"):
        store.fetch(key, tmp_path / "learner", learner_state=True)
    assert not marker.exists()


# ---- signed manifests (issue 13) -------------------------------------------------------------
def _signed_stores(stack, run):
    from pipeline.wire.signing import SigningKey

    learner = SigningKey.generate()
    writer, reader = _store(stack, run), _store(stack, run)
    writer.signer, reader.trusted = learner, learner.public
    return learner, writer, reader


def test_a_signed_manifest_is_read_and_names_its_parent(local_stack, tiny_model_dir, tmp_path):
    _, writer, reader = _signed_stores(local_stack, "ckpt-signed")
    key = writer.upload(4, tiny_model_dir, parent_version=2)
    path, manifest = reader.fetch(key, tmp_path / "v4")
    raw = json.loads(writer.client.get_object(writer.bucket, key).read())
    assert raw["parent_version"] == 2 and set(raw["signature"]) == {"key_id", "value"}
    assert manifest.version == 4 and (path / "config.json").is_file()


@pytest.mark.parametrize("attack", ["unsigned", "altered", "other_key", "moved"])
def test_a_sampler_pinning_the_learner_key_refuses_what_the_learner_did_not_sign(
        local_stack, tiny_model_dir, tmp_path, attack):
    from pipeline.wire.signing import SigningKey, sign_document

    run = f"ckpt-forged-{attack}"
    learner, writer, reader = _signed_stores(local_stack, run)
    key = writer.upload(3, tiny_model_dir)
    manifest = json.loads(writer.client.get_object(writer.bucket, key).read())
    if attack == "unsigned":
        writer.signer = None
        key = writer.upload(5, tiny_model_dir)
        expected = "not signed"
    else:
        if attack == "altered":  # a file's sha256 changed to match replaced bytes
            manifest["files"][0]["sha256"] = "0" * 64
            expected = "bad signature"
        elif attack == "other_key":  # a whole manifest of the attacker's, self-signed
            manifest = sign_document(manifest, SigningKey.generate())
            expected = "not the trusted"
        else:  # the learner's genuine v3 manifest copied to v9 (a version it never made)
            key = writer.manifest_key(9)
            expected = "not the one at this key"
        body = json.dumps(manifest).encode()
        writer.client.put_object(writer.bucket, key, io.BytesIO(body), len(body))
    with pytest.raises(CorruptCheckpointError, match=expected):
        reader.fetch(key, tmp_path / "x")
    assert not (tmp_path / "x").exists()
