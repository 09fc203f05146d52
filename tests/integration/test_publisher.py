"""The publisher process (pipeline/weights/publisher.py) against the real local S3 and Redis:
what the learner copies into a shared buffer is what samplers rebuild, bit for bit; versions
that arrive faster than they can be published are skipped, never reordered; a pointer
somebody else moved is set again; a broken store, or a publisher that cannot copy a slot out,
stops the run with its error. (tests/unit/test_publisher_threads.py: the same without servers,
and a keyframe waiting is never skipped.)"""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import time
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infra.fault_proxy import FaultProxy, Route
from pipeline.config import HeteroConfig
from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3, current as current_pointer
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import Services
from pipeline.weights.codec import bits
from pipeline.weights.policy import fetch_policy, read_weights
from pipeline.weights.publisher import BackgroundPublisher, PublishTarget, copy_weights_into, slot_layout
from pipeline.wire.signing import SigningKey, write_key_file

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model in training (fp32) and its directory (the publisher's template)."""
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, ModelSize(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, path


def start(stack, tmp_path, model, template, run: str, *, signer_key=None, announce=True,
          pointer_check_s=5.0) -> BackgroundPublisher:
    cfg = HeteroConfig.model_validate({"run": {"name": run}, "services": {
        "kafka_bootstrap": stack.kafka_bootstrap, "redis_url": stack.redis_url, "s3_endpoint": stack.s3_endpoint,
        "s3_access_key": stack.s3_access_key, "s3_secret_key": stack.s3_secret_key, "s3_region": stack.s3_region,
        "bucket": stack.bucket}})
    state = model.state_dict()
    places = slot_layout(template, {k: tuple(t.shape) for k, t in state.items()}, torch.bfloat16)
    target = PublishTarget(cfg.model_dump_json(), stack.bucket, run, str(template), str(tmp_path), "bfloat16",
                           keyframe_every=10, signer_key=signer_key, announce=announce, keep_last=100,
                           pointer_check_s=pointer_check_s)
    return BackgroundPublisher(target, places)


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def reader(stack, run, trusted=None) -> CheckpointStore:
    services = Services(stack.kafka_bootstrap, stack.redis_url, stack.s3_endpoint, stack.s3_access_key,
                        stack.s3_secret_key, stack.s3_region, stack.bucket)
    return CheckpointStore(connect_s3(services), stack.bucket, run, trusted=trusted)


def test_each_version_copied_into_a_buffer_is_published_signed_and_rebuilds_bit_for_bit(local_stack, tiny, tmp_path):
    model, template = tiny
    key = SigningKey.generate()
    key_file = write_key_file(key, tmp_path / "learner.key")
    publisher = start(local_stack, tmp_path, model, template, "pub-exact", signer_key=str(key_file),
                      pointer_check_s=0.5)
    expected = {}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for version in range(4):
            slot = publisher.take_slot()
            copy_weights_into(model, publisher.slots.views(slot))
            expected[version] = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
            publisher.submit_policy(slot, version, {"step": version}, parent_version=version - 1 if version else None)
            for p in model.parameters():  # the next step moves the weights while the last version is published
                p.add_(1e-2 * torch.randn(p.shape, generator=generator))
    state = RunState(connect_redis(local_stack.redis_url), "pub-exact")
    pointer = PolicyPointer(state)
    assert wait_for(lambda: current_pointer(state)[0] == 3, 60)  # the pointer names the newest
    # Someone with write access to Redis moves it (to v0, signed by another key; samplers refuse
    # such a pointer, and would wait for a version nobody announces): the publisher sets it again.
    pointer.set(0, reader(local_stack, "pub-exact").manifest_key(0), signer=SigningKey.generate())
    assert wait_for(lambda: pointer.read().version == 3, 10)
    assert pointer.read_verified(key.public).version == 3  # signed by the learner's key again
    # Whatever else the key holds (a hash that is no pointer, another type) is set back the same way.
    for malformed in (lambda c: c.hset(pointer.key, "version", "not a number"),
                      lambda c: c.hdel(pointer.key, "manifest_key"),
                      lambda c: c.delete(pointer.key) + c.set(pointer.key, "v9"),
                      lambda c: c.delete(pointer.key) + c.rpush(pointer.key, "9")):
        malformed(state.client)
        # every reader: no pointer, nothing new (or the publisher has already set it back)
        assert current_pointer(state)[0] in (None, 3)
        assert wait_for(lambda: current_pointer(state)[0] == 3, 10)
        assert pointer.read_verified(key.public).version == 3
    publisher.check()  # the publisher process is still there: a malformed pointer did not stop it
    publisher.close()
    assert sorted(publisher.published + publisher.skipped) == [0, 1, 2, 3] and 3 in publisher.published
    store = reader(local_stack, "pub-exact", trusted=key.public)
    for version in publisher.published:  # rebuilt by a sampler that pins the learner's key
        path, _, _ = fetch_policy(store, store.manifest_key(version), tmp_path / f"got-v{version}",
                                  expect_version=version)
        got = {k: t for tensors in read_weights(path).values() for k, t in tensors.items()}
        assert got and all(np.array_equal(bits(got[k]), bits(expected[version][k])) for k in got), version
    seconds = publisher.take_seconds()
    assert seconds["background_policy_s"] > 0 and "background_copy_s" in seconds


def test_versions_faster_than_publishing_are_skipped_in_order(local_stack, tiny, tmp_path, monkeypatch):
    """With every version handed over at once, the publisher takes each buffer back as soon as it
    copied it out and skips a version still waiting when a newer one comes: the first (a keyframe,
    as the learner hands over v0) and the newest are always published, in order."""
    model, template = tiny
    publisher = start(local_stack, tmp_path, model, template, "pub-skip")
    started = time.monotonic()
    with torch.no_grad():
        for version in range(12):
            slot = publisher.take_slot()
            copy_weights_into(model, publisher.slots.views(slot))
            publisher.submit_policy(slot, version, {"step": version}, parent_version=None,
                                    keyframe=version in (0, 11))
            for p in model.parameters():
                p.add_(1e-2)
    handed_over_s = time.monotonic() - started
    publisher.close()
    assert sorted(publisher.published + publisher.skipped) == list(range(12))
    assert publisher.published == sorted(publisher.published)
    assert publisher.published[0] == 0 and publisher.published[-1] == 11 and publisher.skipped  # some were overtaken
    assert reader(local_stack, "pub-skip").list_versions() == publisher.published
    assert handed_over_s < 10


@pytest.mark.parametrize("fault", ["refused_credentials", "killed", "s3_gone"])
def test_a_publisher_that_fails_stops_the_run_with_its_error(local_stack, tiny, tmp_path, fault):
    """An S3 server that refuses the credentials, a publisher process that dies (a crash, an
    OOM kill), or an S3 server gone after the start: the learner's next hand-over, or its close,
    raises, naming the server where one failed; nothing hangs."""
    model, template = tiny
    stack, proxy = local_stack, None
    fields = ("kafka_bootstrap", "redis_url", "s3_endpoint", "s3_access_key", "s3_secret_key", "s3_region", "bucket")

    def stack_with(**changed):  # the local stack's addresses and credentials, some of them changed
        return type("Stack", (), {**{k: getattr(local_stack, k) for k in fields}, **changed})()

    if fault == "refused_credentials":
        stack = stack_with(s3_secret_key="not-the-secret")
    if fault == "s3_gone":
        target = urlparse(local_stack.s3_endpoint)
        proxy = FaultProxy([Route("s3", 0, target.hostname, target.port)]).start()
        stack = stack_with(s3_endpoint=f"http://{proxy.address('s3')}")
    publisher = start(stack, tmp_path, model, template, f"pub-{fault}")
    if fault == "killed":
        publisher.child.kill()
        publisher.child.wait()
    if proxy is not None:  # one version published through the proxy, then nothing answers there
        try:
            slot = publisher.take_slot()
            copy_weights_into(model, publisher.slots.views(slot))
            publisher.submit_policy(slot, 0, {"step": 0}, parent_version=None)
            deadline = time.monotonic() + 60
            while not publisher.published and time.monotonic() < deadline:
                time.sleep(0.05)
            assert publisher.published == [0]
        finally:
            proxy.stop()
    said = {"refused_credentials": re.escape(f"S3 at {local_stack.s3_endpoint} refused the credentials"),
            "killed": "the publisher process (stopped|exited with code -9)",
            "s3_gone": re.escape(f"S3 at {stack.s3_endpoint} (bucket '{local_stack.bucket}'): ")}[fault]
    with pytest.raises(RuntimeError, match=f"^checkpoint publishing failed: .*{said}"):
        for version in range(1, 5):
            slot = publisher.take_slot()
            copy_weights_into(model, publisher.slots.views(slot))
            publisher.submit_policy(slot, version, {"step": version}, parent_version=None)
        publisher.close(timeout_s=60)


def test_a_slot_the_publisher_cannot_copy_out_stops_the_run_with_its_error(local_stack, tiny, tmp_path):
    """The publisher process's reader failing (here on a slot that does not exist) is said to the
    learner at once, and the process exits: the learner's next hand-over raises naming it, instead
    of waiting forever for slots nobody hands back."""
    model, template = tiny
    publisher = start(local_stack, tmp_path, model, template, "pub-bad-slot")
    missing = len(publisher.slots.buffers)
    publisher.submit_policy(missing, 0, {"step": 0}, parent_version=None)
    raised = []

    def hand_over():  # more versions than slots: one waits for a slot to come back
        try:
            for version in range(1, missing + 2):
                slot = publisher.take_slot()
                copy_weights_into(model, publisher.slots.views(slot))
                publisher.submit_policy(slot, version, {"step": version}, parent_version=None)
        except RuntimeError as e:
            raised.append(e)

    thread = threading.Thread(target=hand_over, daemon=True)  # a wait that never ends cannot hang the tests
    thread.start()
    thread.join(60)
    try:
        assert not thread.is_alive(), "take_slot still waits after 60s"
        assert raised and re.match(f"^checkpoint publishing failed: copying slot {missing} failed: IndexError: ",
                                   str(raised[0])), raised
        assert publisher.child.wait(timeout=30) == 1
    finally:
        with contextlib.suppress(RuntimeError):  # what stopped the run, said again
            publisher.close(timeout_s=10)


class _RecordingEngine:
    """The two calls of a generation engine a follower makes (`PolicyEngine`), recorded."""

    backend = "recording"

    def __init__(self):
        self.installed = []

    def prepare(self, model_dir):
        return read_weights(model_dir)

    def install(self, prepared):
        self.installed.append(prepared)


def test_a_sampler_loads_v0_locally_only_for_the_base_it_was_told_and_a_run_not_past_v0(local_stack, tiny, tmp_path,
                                                                                      caplog):
    import logging
    from types import SimpleNamespace

    from pipeline.weights.same_host import base_digest
    from producers.sampler import new_follower

    _, template = tiny
    digest = base_digest(template)

    def follower(run: str, expected: str):
        cfg = HeteroConfig.model_validate({"run": {"name": run}, "model": {"base": str(template)},
                                           "services": {"data_dir": str(tmp_path / "data")},
                                           "learner": {"policy_dtype": "bf16"},
                                           "sampler": {"local_v0_sha256": expected}})
        handles = SimpleNamespace(store=reader(local_stack, run), state=RunState(connect_redis(local_stack.redis_url), run))
        engine = _RecordingEngine()
        got = new_follower(cfg, handles, tmp_path / run, engine, logging.getLogger("sampler-test"))
        return got, engine, handles

    # a run with nothing published: v0 from the files, in the policy dtype, no byte downloaded
    got, engine, _ = follower("local-v0-fresh", digest)
    assert got.version == 0 and got.first_policy[:2] == (0, 0) and len(engine.installed) == 1
    weights = engine.installed[0]
    assert all(t.dtype == torch.bfloat16 for tensors in weights.values() for t in tensors.values() if t.is_floating_point())

    # a base other than the one the run started from: refused, said, nothing loaded (v0 comes through S3)
    caplog.set_level(logging.ERROR, logger="sampler-test")
    got, engine, _ = follower("local-v0-other", "0" * 64)
    assert got.version is None and engine.installed == [] and not (tmp_path / "local-v0-other" / "v0").exists()
    assert "taking v0 from the learner through S3" in caplog.text

    # a run already past v0 (a sampler restarted in a long run): its newest version, not v0
    _, _, handles = follower("local-v0-fresh", digest)
    PolicyPointer(handles.state).set(3, handles.store.manifest_key(3), signer=SigningKey.generate())
    got, engine, _ = follower("local-v0-fresh", digest)
    assert got.version is None and engine.installed == []


def test_on_the_learner_s_host_v0_comes_from_the_base_files_and_each_version_through_shared_memory(
        local_stack, tiny, tmp_path, caplog):
    """`heterorl train`'s samplers, on the learner's host. `train.fast_start`: a sampler lays v0 out
    from the base model's files (checked against the digest train took of them) instead of
    downloading it: the copy must be the v0 the learner published, tensor for tensor, and the base
    of the deltas after it; a base whose files hash otherwise is refused. `train.weights_by_shared_memory`:
    the publisher writes each version whole on its host before the pointer names it (the newest
    two kept; none left once it closes), and a sampler there takes it, checked against the signed
    manifest, bit for bit what the S3 path rebuilds; a copy altered is downloaded instead."""
    import logging

    from transformers import AutoModelForCausalLM

    from pipeline.weights.follower import PolicyFollower
    from pipeline.weights.policy import check_copy
    from pipeline.weights.same_host import base_digest, lay_out_local_v0
    from pipeline.weights.store import CorruptCheckpointError

    _, template = tiny
    model = AutoModelForCausalLM.from_pretrained(template, torch_dtype=torch.float32)  # as the learner loads it
    copies = tmp_path / "shm"
    (tmp_path / "learner").mkdir()
    cfg = HeteroConfig.model_validate({"run": {"name": "pub-host"}, "services": {
        "kafka_bootstrap": local_stack.kafka_bootstrap, "redis_url": local_stack.redis_url,
        "s3_endpoint": local_stack.s3_endpoint, "s3_access_key": local_stack.s3_access_key,
        "s3_secret_key": local_stack.s3_secret_key, "s3_region": local_stack.s3_region, "bucket": local_stack.bucket}})
    state = model.state_dict()
    publisher = BackgroundPublisher(PublishTarget(
        cfg.model_dump_json(), local_stack.bucket, "pub-host", str(template), str(tmp_path / "learner"), "bfloat16",
        keyframe_every=10, host_copies=str(copies)),
        slot_layout(template, {k: tuple(t.shape) for k, t in state.items()}, torch.bfloat16))
    with torch.no_grad():
        for version in range(4):
            slot = publisher.take_slot()
            copy_weights_into(model, publisher.slots.views(slot))
            publisher.submit_policy(slot, version, {"step": version}, parent_version=version - 1 if version else None)
            assert wait_for(lambda: version in publisher.published or version in publisher.skipped, 60)
            for p in model.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    assert publisher.published == [0, 1, 2, 3]
    store = reader(local_stack, "pub-host")

    # v0 from the base files is v0 as signed: fetching v0 "from" it downloads nothing and checks
    # every tensor; v1's delta applies to it, with no fallback to the keyframe
    local = lay_out_local_v0(template, tmp_path / "sampler-v0" / "v0", torch.bfloat16, base_digest(template))
    _, _, report = fetch_policy(store, store.manifest_key(0), tmp_path / "v0-check", have=(0, local),
                                expect_version=0)
    assert report.refused == [] and report.bytes_downloaded == 0
    _, _, report = fetch_policy(store, store.manifest_key(1), tmp_path / "sampler-v0" / "v1", have=(0, local),
                                expect_version=1)
    assert report.refused == [] and not report.from_keyframe and report.path == [1]
    # one changed file in the base (here its config) is another base: refused, nothing laid out
    other = tmp_path / "other-base"
    shutil.copytree(template, other)
    config = other / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "edited",', 1))
    with pytest.raises(CorruptCheckpointError, match="not the .* of the base the run started from"):
        lay_out_local_v0(other, tmp_path / "sampler2" / "v0", torch.bfloat16, base_digest(template))
    assert not (tmp_path / "sampler2" / "v0").exists()

    assert sorted(p.name for p in copies.iterdir()) == ["v2", "v3"]  # the newest two
    for version in (2, 3):  # each copy is the signed version, bit for bit what the S3 path rebuilds
        check_copy(store, store.manifest_key(version), copies / f"v{version}", expect_version=version)
        downloaded, _, _ = fetch_policy(store, store.manifest_key(version), tmp_path / f"s3-v{version}",
                                        expect_version=version)
        got, want = (read_weights(d) for d in (copies / f"v{version}", downloaded))
        assert got.keys() == want.keys() and all(np.array_equal(bits(got[f][k]), bits(want[f][k]))
                                                 for f in want for k in want[f])

    # a sampler here takes v2 from the copy: nothing downloaded, nothing rebuilt
    follower = PolicyFollower(store, tmp_path / "sampler", logging.getLogger("shm-test"), _RecordingEngine(),
                              host_copies=copies)
    assert follower.update(2, store.manifest_key(2))
    assert follower.version == 2 and follower.host_copies_taken == 1 and follower.bytes_downloaded == 0
    assert follower.copy_dir == copies / "v2"
    # v3's copy altered (one tensor's bytes): refused as the manifest's, and v3 downloaded instead,
    # as the delta from the v2 copy it holds
    name = next(iter(read_weights(copies / "v3")))
    tensors = load_file(str(copies / "v3" / name))
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1
    save_file(tensors, str(copies / "v3" / name), metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="is not what it signed"):
        check_copy(store, store.manifest_key(3), copies / "v3", expect_version=3)
    caplog.set_level(logging.WARNING, logger="shm-test")
    assert follower.update(3, store.manifest_key(3))
    assert follower.version == 3 and follower.host_copies_taken == 1 and 0 < follower.bytes_downloaded
    assert "downloading v3" in caplog.text and follower.copy_dir == tmp_path / "sampler" / "v3"
    loaded = follower.engine.installed[-1]
    want = read_weights(tmp_path / "s3-v3")
    assert all(np.array_equal(bits(loaded[f][k]), bits(want[f][k])) for f in want for k in want[f])
    # the copy a sampler holds, emptied as the publisher removes it (it keeps the newest two, and
    # removes all as its learner ends) while a delta from it is applied: no fault of the
    # version's, said as such, and the keyframe path taken
    second = PolicyFollower(store, tmp_path / "sampler-b", logging.getLogger("shm-test"), _RecordingEngine(),
                            host_copies=copies)
    assert second.update(2, store.manifest_key(2)) and second.copy_dir == copies / "v2"
    for f in (copies / "v2").iterdir():
        f.unlink()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="shm-test")
    assert second.update(3, store.manifest_key(3)) and second.version == 3
    assert "copy of v2 on this host was removed meanwhile; took the keyframe path to v3" in caplog.text
    assert "refused the delta path" not in caplog.text and second.stats(0.0)["refused_delta_paths"] == 0
    assert all(np.array_equal(bits(second.engine.installed[-1][f][k]), bits(want[f][k])) for f in want for k in want[f])
    publisher.close()  # a learner that ends takes its copies with it
    assert not copies.exists()
