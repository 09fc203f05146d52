"""Policy versions as keyframes and deltas in a real S3 server (pipeline/weights/store.py):
rebuilt bit for bit along either path, and refused whenever a piece does not fit."""

from __future__ import annotations

import io
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.weights.store import CheckpointNotFound, CheckpointStore, CorruptCheckpointError, connect_s3
from pipeline.clients.services import Services
from pipeline.weights.codec import bits, describe
from pipeline.weights.policy import DELTA, KEYFRAME, KeyframeRule, PolicyWriter, fetch_policy, read_weights

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Six versions of a tiny bf16 model (fp32 master weights moved by 1e-5 a step, as the
    learner publishes them), each a plain model directory."""
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, ModelSize(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    root = tmp_path_factory.mktemp("versions")
    master = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    dirs = []
    for version in range(6):
        path = root / f"v{version}"
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        weights = load_file(str(path / "model.safetensors"))
        save_file({k: master[k].to(torch.bfloat16) for k in weights}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        dirs.append(path)
        for k in master:
            master[k] += 1e-5 * torch.randn(master[k].shape, generator=generator).sign()
    return dirs


def _store(stack, run, signer=None, trusted=None) -> CheckpointStore:
    services = Services(stack.kafka_bootstrap, stack.redis_url, stack.s3_endpoint, stack.s3_access_key,
                        stack.s3_secret_key, stack.s3_region, stack.bucket)
    return CheckpointStore(connect_s3(services), stack.bucket, run, signer=signer, trusted=trusted)


def _published(stack, run, versions, keyframe_every=3):
    from pipeline.wire.signing import SigningKey

    learner = SigningKey.generate()
    writer, reader = _store(stack, run, signer=learner), _store(stack, run, trusted=learner.public)
    publisher = PolicyWriter(writer, KeyframeRule(keyframe_every))
    for version, path in enumerate(versions):
        publisher.write(version, path, extra={"step": version}, parent_version=version - 1 if version else None)
    return publisher, writer, reader


def assert_same_weights(rebuilt: Path, original: Path) -> None:
    got, want = read_weights(rebuilt), read_weights(original)
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name])
        for tensor in want[name]:
            assert np.array_equal(bits(got[name][tensor]), bits(want[name][tensor])), tensor


def test_keyframes_and_deltas_rebuild_every_version_bit_for_bit(local_stack, versions, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    publisher, _, reader = _published(local_stack, "policy-chain", versions)
    assert [p["kind"] for p in publisher.published] == [KEYFRAME, DELTA, DELTA, KEYFRAME, DELTA, DELTA]
    deltas = [p["bytes"] for p in publisher.published if p["kind"] == DELTA]
    keyframe_weights = publisher.published[0]["full_bytes"]
    assert max(deltas) < 0.5 * keyframe_weights  # a 1e-5 step leaves most bf16 patterns as they were

    # A sampler holding v4 takes only v5's delta; one holding nothing, the keyframe v3 and its deltas.
    near, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "near", have=(4, versions[4]))
    assert report.path == [5] and not report.from_keyframe and report.refused == []
    assert report.keyframe_bytes == 0 and 0 < report.bytes_downloaded == deltas[-1]
    assert_same_weights(near, versions[5])
    fresh, manifest, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "fresh", expect_version=5)
    assert report.path == [3, 4, 5] and report.from_keyframe and manifest.extra["step"] == 5
    assert report.keyframe_bytes == publisher.published[3]["bytes"] == report.bytes_downloaded - sum(deltas[-2:])
    assert_same_weights(fresh, versions[5])
    # A manifest other than the one the policy pointer announced is refused.
    with pytest.raises(CorruptCheckpointError, match="the policy pointer says v4 but its manifest .* is v5"):
        fetch_policy(reader, reader.manifest_key(5), tmp_path / "moved", expect_version=4)
    # A sampler left behind before the keyframe v3 crosses it by its bridge (the delta from v2 it
    # carries): the deltas after v1 cost less than v3's full copy and the deltas after it.
    # Its deltas come down side by side with the rebuild: the next is downloading while one is
    # applied (the first download waits, up to 5 s, for a second to start: it never would if
    # they came one at a time).
    fetch, second, lock, active, peak = reader.fetch, threading.Event(), threading.Lock(), [0], [0]

    def side_by_side(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] >= 2:
                second.set()
        second.wait(timeout=5)
        try:
            return fetch(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    # Each manifest on the way is read once, and those below the target side by side (on a far
    # link every read is a round trip): a read by a thread waits, up to 5 s, for a second.
    read_manifest, manifests_read, reads_at_once = reader.read_manifest, [], [0, 0]
    read_second = threading.Event()

    def counted_read(key):
        manifests_read.append(key)
        if threading.current_thread() is threading.main_thread():
            return read_manifest(key)
        with lock:
            reads_at_once[0] += 1
            reads_at_once[1] = max(reads_at_once)
            if reads_at_once[0] >= 2:
                read_second.set()
        read_second.wait(timeout=5)
        try:
            return read_manifest(key)
        finally:
            with lock:
                reads_at_once[0] -= 1

    reader.read_manifest = counted_read
    reader.fetch = side_by_side
    behind, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "behind", have=(1, versions[1]))
    reader.fetch, reader.read_manifest = fetch, read_manifest
    assert peak[0] == 2  # PREFETCH_DELTAS downloads at once, never more
    assert sorted(manifests_read) == [reader.manifest_key(v) for v in (2, 3, 4, 5)] and reads_at_once[1] >= 2
    by_version = {p["version"]: p for p in publisher.published}
    assert report.path == [2, 3, 4, 5] and not report.from_keyframe and report.keyframe_bytes == 0
    assert report.bytes_downloaded == sum(by_version[v]["bytes"] for v in (2, 4, 5)) + by_version[3]["bridge_bytes"]
    assert report.bytes_downloaded < sum(by_version[v]["bytes"] for v in (3, 4, 5))
    assert_same_weights(behind, versions[5])
    # Whatever the path, the result is a plain Hugging Face directory, config and tokenizer included.
    model = AutoModelForCausalLM.from_pretrained(near, use_safetensors=True)
    stored = load_file(str(versions[5] / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(model.model.norm.weight.detach(), stored.float())
    AutoTokenizer.from_pretrained(near)
    assert {p.name for p in near.iterdir()} == {p.name for p in versions[5].iterdir()}


def test_a_keyframe_bridge_is_taken_only_while_it_costs_less_than_the_keyframe(local_stack, versions, tmp_path):
    publisher, writer, reader = _published(local_stack, "policy-bridge", versions)
    by_version = {p["version"]: p for p in publisher.published}
    assert by_version[0]["bridge_bytes"] == 0 and 0 < by_version[3]["bridge_bytes"] < by_version[3]["bytes"]
    # The bridge is a delta of its own: v2 -> v3 alone is its bytes, and v3 is rebuilt bit for bit.
    v3, _, report = fetch_policy(reader, reader.manifest_key(3), tmp_path / "v3", have=(2, versions[2]))
    assert report.path == [3] and report.bytes_downloaded == by_version[3]["bridge_bytes"]
    assert_same_weights(v3, versions[3])
    # From v0 the deltas after it would cost more than v3's copy and the deltas after it, or not:
    # whichever is fewer bytes is taken, and the result is the same.
    from_v0, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "from-v0", have=(0, versions[0]))
    bridged = sum(by_version[v]["bytes"] for v in (1, 2, 4, 5)) + by_version[3]["bridge_bytes"]
    keyframe = sum(by_version[v]["bytes"] for v in (3, 4, 5))
    assert report.path == ([1, 2, 3, 4, 5] if bridged < keyframe else [3, 4, 5])
    assert report.bytes_downloaded == min(bridged, keyframe)
    assert_same_weights(from_v0, versions[5])
    # A version on the bridged way pruned: the keyframe path, not a refusal.
    writer.delete(2)
    pruned, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "pruned", have=(1, versions[1]))
    assert report.path == [3, 4, 5] and report.from_keyframe and report.refused == []
    assert_same_weights(pruned, versions[5])


def test_a_sampler_whose_copy_does_not_fit_falls_back_to_the_keyframe(local_stack, versions, tmp_path):
    _, _, reader = _published(local_stack, "policy-wrong-base", versions)
    wrong = shutil.copytree(versions[4], tmp_path / "wrong-v4")
    weights = load_file(str(wrong / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1  # the sampler's copy of v4 is not v4
    save_file(weights, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    rebuilt, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "v5", have=(4, wrong))
    assert report.from_keyframe and report.path == [5, 3, 4, 5]
    assert len(report.refused) == 1 and "sha256" in report.refused[0]
    assert_same_weights(rebuilt, versions[5])


def test_a_tampered_delta_or_manifest_is_refused_and_nothing_is_written(local_stack, versions, tmp_path):
    _, writer, reader = _published(local_stack, "policy-tamper", versions)
    key = "policy-tamper/v5/delta.safetensors"
    data = bytearray(writer.client.get_object(writer.bucket, key).read())
    data[-3] ^= 0xFF
    writer.client.put_object(writer.bucket, key, io.BytesIO(bytes(data)), len(data))
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        fetch_policy(reader, reader.manifest_key(5), tmp_path / "v5", have=(4, versions[4]))
    assert not (tmp_path / "v5").exists()

    # A manifest whose tensor sha256 was rewritten (so that a forged delta would pass) is unsigned now.
    manifest_key = reader.manifest_key(4)
    raw = json.loads(writer.client.get_object(writer.bucket, manifest_key).read())
    entries = raw["extra"]["weights"]["files"]["model.safetensors"]
    next(iter(entries.values()))["sha256"] = "0" * 64
    body = json.dumps(raw).encode()
    writer.client.put_object(writer.bucket, manifest_key, io.BytesIO(body), len(body))
    with pytest.raises(CorruptCheckpointError, match="refused"):
        fetch_policy(reader, manifest_key, tmp_path / "v4", have=(3, versions[3]))
    assert not (tmp_path / "v4").exists()


def test_a_version_altered_after_a_sampler_took_it_does_not_block_the_deltas_after_it(local_stack, versions,
                                                                                       tmp_path):
    """The sampler's copy of v4 was verified when it was fetched: v4 altered in the bucket since
    then (its manifest re-signed by nobody) leaves v5's delta usable from that copy, checked
    against v5's signed manifest; a sampler that does not hold v4 needs v4 and is refused."""
    _, writer, reader = _published(local_stack, "policy-altered-base", versions)
    manifest_key = reader.manifest_key(4)
    raw = json.loads(writer.client.get_object(writer.bucket, manifest_key).read())
    raw["created_at"] += 1
    body = json.dumps(raw).encode()
    writer.client.put_object(writer.bucket, manifest_key, io.BytesIO(body), len(body))
    rebuilt, _, report = fetch_policy(reader, reader.manifest_key(5), tmp_path / "v5", have=(4, versions[4]))
    assert report.path == [5] and report.refused == []
    assert_same_weights(rebuilt, versions[5])
    with pytest.raises(CorruptCheckpointError, match="bad signature"):
        fetch_policy(reader, reader.manifest_key(5), tmp_path / "from-v3", have=(3, versions[3]))
    assert not (tmp_path / "from-v3").exists()


def test_a_missing_base_is_named(local_stack, versions, tmp_path):
    _, writer, reader = _published(local_stack, "policy-pruned", versions)
    for obj in writer.client.list_objects(writer.bucket, prefix="policy-pruned/v4/", recursive=True):
        writer.client.remove_object(writer.bucket, obj.object_name)
    with pytest.raises(CheckpointNotFound, match="v4"):
        fetch_policy(reader, reader.manifest_key(5), tmp_path / "v5")


def test_weights_fetch_takes_a_version_home_and_names_a_bad_address(local_stack, versions, tmp_path, monkeypatch,
                                                                    capsys):
    from heterorl import cli
    from infra.local_stack import stack_env

    publisher = PolicyWriter(_store(local_stack, "policy-cli"), KeyframeRule(3))
    for version, path in enumerate(versions):
        publisher.write(version, path)
    for key, value in stack_env(local_stack).items():
        monkeypatch.setenv(key, value)
    unsigned = ["--set", "security.require_signatures=false"]  # this run's manifests carry no signature

    status = cli.main(["weights", "fetch", f"s3://{local_stack.bucket}/policy-cli/v5/", "--out",
                       str(tmp_path / "home"), *unsigned])
    out = capsys.readouterr().out
    assert status == 0 and "policy v5 of run policy-cli" in out and "v3 -> v4 -> v5" in out, out
    assert_same_weights(tmp_path / "home", versions[5])

    status = cli.main(["weights", "fetch", f"s3://{local_stack.bucket}/policy-cli/", "--out", str(tmp_path / "x"),
                       *unsigned])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "expected s3://BUCKET/RUN/vN/" in err, err
    status = cli.main(["weights", "fetch", f"s3://{local_stack.bucket}/policy-cli/v9/", "--out", str(tmp_path / "y"),
                       *unsigned])
    err = capsys.readouterr().err
    assert status == 2 and "no checkpoint manifest at" in err and "policy-cli/v9" in err, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_what_only_a_keyframe_can_carry_and_a_copy_of_the_target_itself(local_stack, versions, tmp_path):
    """A changed config, a version number not above the last, or nothing changed at all; a
    pickle-based file never travels; a sampler holding the target gets it checked, not trusted."""
    store = _store(local_stack, "policy-edges")
    publisher = PolicyWriter(store, KeyframeRule(10))
    publisher.write(0, versions[0])
    same = shutil.copytree(versions[0], tmp_path / "same")
    (same / "training_args.bin").write_bytes(b"\x80\x04pickled")  # never published, never inherited
    publisher.write(1, same)  # nothing changed: a delta of `same` tensors and an empty payload
    configured = shutil.copytree(versions[1], tmp_path / "configured")
    (configured / "generation_config.json").write_text('{"max_new_tokens": 7}')
    publisher.write(2, configured)
    publisher.write(3, versions[2])
    publisher.write(3, versions[3])  # republished under the same number
    assert [p["kind"] for p in publisher.published] == [KEYFRAME, DELTA, KEYFRAME, KEYFRAME, KEYFRAME]
    manifest = store.read_manifest(store.manifest_key(1))
    assert {e["encoding"] for e in manifest.extra["weights"]["files"]["model.safetensors"].values()} == {"same"}
    assert all(not f["path"].endswith(".bin") for f in manifest.extra["weights"]["inherit"])

    rebuilt, _, report = fetch_policy(store, store.manifest_key(1), tmp_path / "v1")
    assert report.path == [0, 1] and not (rebuilt / "training_args.bin").exists()
    assert_same_weights(rebuilt, versions[0])
    held, _, report = fetch_policy(store, store.manifest_key(1), tmp_path / "held", have=(1, rebuilt))
    assert report.path == [] and report.refused == []
    assert_same_weights(held, versions[0])
    wrong = shutil.copytree(versions[4], tmp_path / "wrong")
    _, _, report = fetch_policy(store, store.manifest_key(1), tmp_path / "again", have=(1, wrong))
    assert report.refused and report.path == [0, 1]


def test_keyframes_travel_packed_and_an_earlier_release_s_whole_files_still_load(local_stack, versions, tmp_path):
    """A keyframe's weights go to S3 packed (well under their bf16 bytes) and come back as the
    plain model directory; a keyframe of an earlier release, its safetensors files as they were,
    still loads."""
    store = _store(local_stack, "policy-packed")
    publisher = PolicyWriter(store, KeyframeRule(10))
    publisher.write(0, versions[0])
    sizes = {f["path"]: f["size"] for f in store.read_manifest(store.manifest_key(0)).files}
    assert "keyframe.safetensors" in sizes and "model.safetensors" not in sizes
    weights = read_weights(versions[0])["model.safetensors"]
    assert sizes["keyframe.safetensors"] < 0.85 * sum(t.numel() * t.element_size() for t in weights.values())
    got, _, report = fetch_policy(store, store.manifest_key(0), tmp_path / "v0", expect_version=0)
    assert report.path == [0] and report.keyframe_bytes == publisher.published[0]["bytes"] == sum(sizes.values())
    assert_same_weights(got, versions[0])
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in versions[0].iterdir())

    tensors = read_weights(versions[1])["model.safetensors"]
    earlier = {"kind": KEYFRAME, "files": {"model.safetensors": {k: describe(t) for k, t in tensors.items()}}}
    store.upload(1, versions[1], {"weights": earlier}, parent_version=0)
    old, _, report = fetch_policy(store, store.manifest_key(1), tmp_path / "v1", expect_version=1)
    assert report.path == [1] and report.from_keyframe
    assert_same_weights(old, versions[1])


@pytest.mark.parametrize("path", ["../../outside.json", "/etc/hostname", "learner_state/optimizer.json",
                                  "model-00002.safetensors"])
def test_a_delta_may_only_inherit_files_inside_its_directory(local_stack, versions, tmp_path, path):
    """Without signatures nothing vouches for a manifest: its paths are checked all the same."""
    store = _store(local_stack, f"policy-inherit-{abs(hash(path))}")
    publisher = PolicyWriter(store, KeyframeRule(10))
    publisher.write(0, versions[0])
    publisher.write(1, versions[1])
    key = store.manifest_key(1)
    raw = json.loads(store.client.get_object(store.bucket, key).read())
    raw["extra"]["weights"]["inherit"].append({"path": path, "size": 1, "sha256": "0" * 64})
    body = json.dumps(raw).encode()
    store.client.put_object(store.bucket, key, io.BytesIO(body), len(body))
    with pytest.raises(CorruptCheckpointError, match="unsafe path|may not inherit"):
        fetch_policy(store, key, tmp_path / "v1", have=(0, versions[0]))
    assert not (tmp_path / "v1").exists() and not (tmp_path.parent / "outside.json").exists()


def _forged_keyframe(store, change) -> str:
    """v0's manifest, rewritten by `change(weights description)` (unsigned: nothing vouches for it)."""
    key = store.manifest_key(0)
    raw = json.loads(store.client.get_object(store.bucket, key).read())
    change(raw["extra"]["weights"])
    body = json.dumps(raw).encode()
    store.client.put_object(store.bucket, key, io.BytesIO(body), len(body))
    return key


@pytest.mark.parametrize("forgery", ["outside", "payload", "renamed", "huge", "negative"])
def test_a_packed_keyframe_that_names_other_files_or_sizes_is_refused_before_it_is_read(local_stack, versions,
                                                                                         tmp_path, forgery):
    """Its tensors are written under the names its manifest gives, and unpacked to the sizes it
    declares: a name outside the model directory, names its payload does not hold, more bytes
    than `MAX_UNPACK_RATIO` times the payload, or a negative size is refused before any download."""
    store = _store(local_stack, f"policy-forged-{forgery}")
    PolicyWriter(store, KeyframeRule(10)).write(0, versions[0])

    def change(weights):
        files, packed = weights["files"], weights["packed"]
        entries, keys = files.pop("model.safetensors"), packed.pop("model.safetensors")
        name = {"outside": "../../outside.safetensors", "payload": "keyframe.safetensors"}.get(forgery,
                                                                                               "model.safetensors")
        files[name], packed[name] = entries, keys
        if forgery == "renamed":  # the payload of a tensor the files do not name
            keys["extra.weight"] = keys.pop(next(iter(keys)))
        first = next(iter(entries.values()))
        if forgery == "huge":
            first["shape"] = [1 << 20, 1 << 20]
        if forgery == "negative":
            first["shape"] = [-1] + first["shape"][1:]

    key = _forged_keyframe(store, change)
    fetch = store.fetch
    store.fetch = lambda *a, **k: pytest.fail("a forged keyframe must be refused before its download")
    refused = "unsafe path|not a weights file|packed weights are not|more than 64 times|not described tensor by tensor"
    with pytest.raises(CorruptCheckpointError, match=refused):
        fetch_policy(store, key, tmp_path / "v0")
    store.fetch = fetch
    assert not (tmp_path / "v0").exists() and not (tmp_path.parent / "outside.safetensors").exists()


def test_weights_of_nearly_one_value_go_as_they_are(local_stack, versions, tmp_path):
    """Packed past `MAX_UNPACK_RATIO`, a reader would refuse them: the learner publishes them unpacked."""
    constant = shutil.copytree(versions[0], tmp_path / "constant")
    weights = load_file(str(constant / "model.safetensors"))
    save_file({k: torch.zeros_like(t) for k, t in weights.items()}, str(constant / "model.safetensors"),
              metadata={"format": "pt"})
    store = _store(local_stack, "policy-constant")
    PolicyWriter(store, KeyframeRule(10)).write(0, constant)
    manifest = store.read_manifest(store.manifest_key(0))
    assert "packed" not in manifest.extra["weights"] and "model.safetensors" in {f["path"] for f in manifest.files}
    got, _, _ = fetch_policy(store, store.manifest_key(0), tmp_path / "v0")
    assert_same_weights(got, constant)


def test_an_unsigned_chain_is_refused_where_signatures_are_required(local_stack, versions, tmp_path):
    from pipeline.wire.signing import SigningKey
    from pipeline.weights.policy import fetch_published

    publisher = PolicyWriter(_store(local_stack, "policy-unsigned"), KeyframeRule(3))
    for version, path in enumerate(versions[:2]):
        publisher.write(version, path)
    with pytest.raises(CorruptCheckpointError, match="refused"):
        fetch_published(publisher.store.client, f"s3://{local_stack.bucket}/policy-unsigned/v1/", tmp_path / "v1",
                        trusted=SigningKey.generate().public)
    assert not (tmp_path / "v1").exists()


def test_pruning_keeps_every_chain_a_kept_version_needs(local_stack, versions, tmp_path):
    """Keyframes every 3 versions: v0 K, v1 D, v2 D, v3 K, v4 D, v5 D. Keeping v4 on keeps v3
    (its keyframe); v1 and v2 go; v0, the base model, stays; everything kept still rebuilds."""
    from pipeline.weights.policy import prune_policies

    publisher, writer, reader = _published(local_stack, "policy-prune", versions)
    assert [p["kind"] for p in publisher.published] == [KEYFRAME, DELTA, DELTA, KEYFRAME, DELTA, DELTA]
    assert prune_policies(writer, current=5, keep_from=2) == []  # v2 rests on v0's chain: nothing can go
    assert prune_policies(writer, current=5, keep_from=4) == [1, 2]
    assert writer.list_versions() == [0, 3, 4, 5]
    for version in (0, 3, 4, 5):
        rebuilt, _, _ = fetch_policy(reader, reader.manifest_key(version), tmp_path / f"v{version}")
        assert_same_weights(rebuilt, versions[version])
    assert prune_policies(writer, current=4, keep_from=5) == []  # nothing above `current` is judged


def test_a_finished_study_cell_keeps_its_base_and_final_policy_only(local_stack, versions, tmp_path):
    """`heterorl study` retires each finished cell's run: v0 and the final version with its chain
    stay (v5 rests on keyframe v3), every other version and every recovery state goes, and the
    bytes it reports freed are the ones gone from S3."""
    from lab.study import retire_run, stored_bytes
    from pipeline.weights.recovery import recovery_store

    _, writer, reader = _published(local_stack, "study-cell-retired", versions)
    states = recovery_store(writer)
    for step in (4, 5):
        states.upload(step, versions[step])
    before = stored_bytes(writer)
    freed = retire_run(writer, final=5)
    assert writer.list_versions() == [0, 3, 4, 5] and states.list_versions() == []
    assert freed == before - stored_bytes(writer) > 0
    for version in (0, 5):
        rebuilt, _, _ = fetch_policy(reader, reader.manifest_key(version), tmp_path / f"v{version}")
        assert_same_weights(rebuilt, versions[version])


def test_a_failed_study_cell_leaves_nothing_in_s3(local_stack, versions, tmp_path, capsys):
    """A failed cell is run again from its start, under a new run name: the study deletes its run
    (named in the config its `heterorl train` wrote) whole, every version, v0 included, every
    recovery state and an upload cut off before its manifest, and says how much that freed."""
    import io

    from lab.study import _retire_cell_run, stored_bytes
    from pipeline.clients.services import Services
    from pipeline.weights.recovery import recovery_store

    _, writer, _ = _published(local_stack, "study-cell-failed", versions)
    recovery_store(writer).upload(4, versions[4])
    writer.client.put_object(local_stack.bucket, "study-cell-failed/v6/model.safetensors", io.BytesIO(b"x" * 1000), 1000)
    before = stored_bytes(writer)
    (tmp_path / "config.yaml").write_text("run:\n  name: study-cell-failed\n")
    services = Services(local_stack.kafka_bootstrap, local_stack.redis_url, local_stack.s3_endpoint,
                        local_stack.s3_access_key, local_stack.s3_secret_key, local_stack.s3_region, local_stack.bucket)
    _retire_cell_run(tmp_path, services)
    assert stored_bytes(writer) == 0 < before
    assert f"deleted study-cell-failed, freed {before / 1e9:.2f} GB" in capsys.readouterr().err


def test_a_policy_carries_no_learner_state_and_is_cast_to_its_dtype(local_stack, versions, tmp_path):
    """The learner's snapshot holds fp32 weights and learner_state/: samplers get bf16 weights
    only; a forced keyframe is a full copy whatever the rule says."""
    snapshot = shutil.copytree(versions[1], tmp_path / "snapshot")
    fp32 = {k: v.float() for k, v in load_file(str(snapshot / "model.safetensors")).items()}
    fp32 = {k: v * (1 + 1e-4) for k, v in fp32.items()}  # well below half a bf16 step: lost in the cast
    save_file(fp32, str(snapshot / "model.safetensors"), metadata={"format": "pt"})
    (snapshot / "learner_state").mkdir()
    (snapshot / "learner_state" / "state.json").write_text("{}")
    store = _store(local_stack, "policy-dtype")
    publisher = PolicyWriter(store, KeyframeRule(10), dtype=torch.bfloat16)
    publisher.write(0, versions[1])
    publisher.write(1, snapshot)
    publisher.write(2, snapshot, keyframe=True)
    assert [p["kind"] for p in publisher.published] == [KEYFRAME, DELTA, KEYFRAME]
    for version in (1, 2):
        manifest = store.read_manifest(store.manifest_key(version))
        assert not [f for f in manifest.files if f["path"].startswith("learner_state")]
        rebuilt, _, _ = fetch_policy(store, store.manifest_key(version), tmp_path / f"v{version}")
        got = load_file(str(rebuilt / "model.safetensors"))
        assert all(t.dtype == torch.bfloat16 for t in got.values())
        assert all(np.array_equal(bits(got[k]), bits(fp32[k].to(torch.bfloat16))) for k in fp32)
    delta = store.read_manifest(store.manifest_key(1)).extra["weights"]["files"]["model.safetensors"]
    assert {e["encoding"] for e in delta.values()} == {"same"}  # the cast absorbed the tiny change


class _Engine:
    """What a sampler's engine does with a verified directory, recorded (no generation here)."""

    backend = "recorded"

    def __init__(self):
        self.installed = []

    def prepare(self, path):
        return read_weights(path), path

    def install(self, prepared):
        self.installed.append(prepared)


def _first_policy_held_at_its_first_chunk(monkeypatch):
    """Every download waits at its first chunk until the event returned second is set; the first
    event is set once one waits there (a far link's minutes of keyframe, in a test's time)."""
    waiting, go = threading.Event(), threading.Event()
    append_chunk = CheckpointStore._append_chunk

    def held(self, key, target, size, transfer=None):
        waiting.set()
        assert go.wait(30), "the test never let the download go on"
        return append_chunk(self, key, target, size, transfer)

    monkeypatch.setattr(CheckpointStore, "_append_chunk", held)
    return waiting, go


def test_a_first_download_gives_way_to_a_newer_version_whose_path_is_fewer_bytes(local_stack, versions, tmp_path,
                                                                                  monkeypatch, caplog):
    """A joiner that starts on v2 (the keyframe v0 and two deltas) when the learner publishes the
    keyframe v3 gives v2 up and downloads v3 alone; one that starts on v1 when v2 appears (the same
    keyframe and one delta more) finishes v1. Only what is left of the first path is weighed."""
    import logging

    from pipeline.weights.follower import PolicyFollower
    from pipeline.weights.policy import path_bytes, restart_is_cheaper
    from pipeline.weights.store import Transfer

    publisher, _, reader = _published(local_stack, "policy-overtaken", versions)
    sizes = {p["version"]: p["bytes"] for p in publisher.published}
    assert path_bytes(reader, reader.manifest_key(3), 3) == sizes[3]
    assert path_bytes(reader, reader.manifest_key(2), 2) == sizes[0] + sizes[1] + sizes[2]
    assert restart_is_cheaper(sizes[0] + sizes[1] + sizes[2], sizes[3])
    assert not restart_is_cheaper(sizes[0] + sizes[1], sizes[0] + sizes[1] + sizes[2])
    # Undisturbed, a transfer's plan is what arrives, and is the report's bytes.
    transfer = Transfer()
    _, _, report = fetch_policy(reader, reader.manifest_key(2), tmp_path / "plain", transfer=transfer)
    assert transfer.planned == transfer.received == report.bytes_downloaded == path_bytes(
        reader, reader.manifest_key(2), 2)

    log = logging.getLogger("test.overtaken")
    waiting, go = _first_policy_held_at_its_first_chunk(monkeypatch)
    engine = _Engine()
    follower = PolicyFollower(reader, tmp_path / "joiner", log, engine)
    follower.request(2, reader.manifest_key(2))
    assert waiting.wait(30)
    with caplog.at_level(logging.INFO, logger="test.overtaken"):
        follower.request(3, reader.manifest_key(3))  # the learner's next keyframe
        follower._weighing.join(30)  # weighed on a thread of its own while the download waits
        go.set()
        follower._thread.join(30)
    assert follower.swap_if_ready() is not None and follower.version == 3 and follower.restarts == 1
    weights, path = engine.installed[-1]
    assert path == tmp_path / "joiner" / "v3" and sorted(p.name for p in (tmp_path / "joiner").iterdir()) == ["v3"]
    assert_same_weights(path, versions[3])
    assert follower.keyframe_bytes == sizes[3] and sizes[3] <= follower.bytes_downloaded < sizes[3] + sizes[0]
    assert follower.stats(0.0)["first_downloads_restarted"] == 1
    assert any("gave up the download of policy v2" in r.getMessage() and "v3 takes" in r.getMessage()
               for r in caplog.records)

    # The same keyframe's chain one delta longer is never fewer bytes, and a version that cannot
    # be weighed (not there) is not taken: v1 is finished.
    go.clear(), waiting.clear()
    engine = _Engine()
    follower = PolicyFollower(reader, tmp_path / "patient", log, engine)
    follower.request(1, reader.manifest_key(1))
    assert waiting.wait(30)
    with caplog.at_level(logging.WARNING, logger="test.overtaken"):
        follower.request(9, reader.manifest_key(9))
        follower._weighing.join(30)
    assert any("could not weigh policy v9 against the download of v1" in r.getMessage() for r in caplog.records)
    follower.request(2, reader.manifest_key(2))
    follower._weighing.join(30)
    go.set()
    follower._thread.join(30)
    assert follower.swap_if_ready() is not None and follower.version == 1 and follower.restarts == 0
    assert follower.bytes_downloaded == sizes[0] + sizes[1]
    assert_same_weights(engine.installed[-1][1], versions[1])

    # A host the learner refused (`heterorl join`) stops its first download before its home goes:
    # the thread ends at its next block, or, finished, no longer waits for an engine.
    go.clear(), waiting.clear()
    follower = PolicyFollower(reader, tmp_path / "refused", log)  # no engine yet, as in `heterorl join`
    follower.request(2, reader.manifest_key(2))
    assert waiting.wait(30)
    stopping = threading.Thread(target=follower.stop)
    stopping.start()
    while not follower._stopped:
        stopping.join(0.01)
    go.set()
    stopping.join(30)
    assert not stopping.is_alive() and not follower._thread.is_alive()
    assert follower.swap_if_ready() is None and follower.version is None
    follower.request(3, reader.manifest_key(3))  # stopped: nothing more is downloaded
    assert follower.downloading is None and not (tmp_path / "refused" / "v3").exists()
    finished = PolicyFollower(reader, tmp_path / "finished", log)
    finished.request(1, reader.manifest_key(1))
    for _ in range(3000):
        if (tmp_path / "finished" / "v1").exists():
            break
        finished._thread.join(0.01)
    assert finished._thread.is_alive()  # downloaded, waiting for an engine
    finished.stop(timeout_s=30)
    assert not finished._thread.is_alive() and finished.swap_if_ready() is None
