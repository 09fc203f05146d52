"""A sampler whose GPU has no room for a second copy of the weights keeps updating
(pipeline/sampling/generation.py `HfEngine.prepare`, pipeline/weights/follower.py): the new
version is swapped in place from host memory, and an out-of-memory error never refuses a
version. CI has no GPU: the GPU copy is made to fail as a full GPU fails it."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pipeline.sampling.generation as generation
import pipeline.weights.follower as follower_module
from pipeline.devices import out_of_memory
from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer
from pipeline.sampling.generation import HfEngine, SamplingSettings
from pipeline.weights.follower import PolicyFollower

SIZE = ModelSize(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, max_positions=48)
OOM = "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 139.80 GiB"


def save_model(path: Path, seed: int) -> Path:
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, SIZE, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gpu_full(tensors, device, dtype):
    raise torch.cuda.OutOfMemoryError(OOM)


def test_hf_engine_swaps_in_place_from_host_when_the_gpu_is_full(tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    first, second, third = (save_model(tmp_path / f"v{i}", seed=i) for i in (1, 2, 3))
    engine = HfEngine(SamplingSettings(1.0, 1.0, 0, 8), torch.device("cpu"))
    engine.install(engine.prepare(first))
    model = engine.model
    engine.device = torch.device("cuda")  # as on a GPU: later versions get a second copy there
    emptied = []
    monkeypatch.setattr(generation, "copy_to_gpu", gpu_full)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    with caplog.at_level(logging.WARNING, logger=generation.__name__):
        prepared = engine.prepare(second)
        assert all(t.device.type == "cpu" for t in prepared.values())  # left on the host
        engine.install(prepared)
        assert engine.model is model  # copied in place, no new model
        expected = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).state_dict()
        got = engine.model.state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
        engine.install(engine.prepare(third))
    assert engine.in_place_swaps == 2 and len(emptied) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, counted every time
    assert "v2" in warnings[0] and "MB" in warnings[0] and "in place from host memory" in warnings[0]


class FakeTensor:
    """A host tensor whose copy to the GPU fails once `room` copies were made."""

    def __init__(self, made: list, room: int):
        self.made, self.room = made, room

    def is_floating_point(self) -> bool:
        return True

    def to(self, *args, **kwargs):
        if len(self.made) >= self.room:
            raise torch.cuda.OutOfMemoryError(OOM)
        copy = torch.zeros(4)  # stands for the GPU copy
        self.made.append(weakref.ref(copy))
        return copy


def test_copy_to_gpu_drops_its_partial_copy_when_out_of_memory(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: SimpleNamespace(synchronize=lambda: synced.append(1)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    made: list = []
    tensors = {f"w{i}": FakeTensor(made, room=3) for i in range(5)}
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        generation.copy_to_gpu(tensors, torch.device("cuda"), torch.bfloat16)
    gc.collect()
    assert len(made) == 3 and synced
    assert all(ref() is None for ref in made), "the traceback still holds the partial copy"
    assert raised.value is not None


CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to " \
          "allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"


def test_out_of_memory_knows_each_allocator_and_nothing_else():
    assert out_of_memory(torch.cuda.OutOfMemoryError(OOM)) == OOM
    assert out_of_memory(RuntimeError(CPU_OOM)) == CPU_OOM[:160]
    assert out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors ...")) == "CUDA error: out of memory"
    assert out_of_memory(RuntimeError("size mismatch for lm_head.weight")) is None
    assert out_of_memory(ValueError("out of memory")) is None  # not an allocator's error


class FullOnce:
    """An engine whose first `prepare` finds the memory full (`error`)."""

    backend = "hf"

    def __init__(self, error: BaseException):
        self.error, self.prepares, self.installed = error, 0, []

    def prepare(self, path):
        self.prepares += 1
        if self.prepares == 1:
            raise self.error
        return path

    def install(self, prepared):
        self.installed.append(prepared)


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError(OOM), RuntimeError(CPU_OOM)], ids=["gpu", "cpu"])
def test_the_follower_retries_a_version_that_found_the_memory_full(tmp_path, monkeypatch, caplog, error):
    report = SimpleNamespace(bytes_downloaded=0, keyframe_bytes=0, refused=[], path=[])
    monkeypatch.setattr(follower_module, "fetch_policy", lambda store, key, target, **kw: (target, None, report))
    engine = FullOnce(error)
    follower = PolicyFollower(None, tmp_path, logging.getLogger("test.follower"), engine)
    with caplog.at_level(logging.WARNING, logger="test.follower"):
        assert not follower.update(4, "run/v4/manifest.json")
    assert "run/v4/manifest.json" not in follower.refused  # not the version's fault
    assert any("no memory to load policy v4" in r.getMessage() and "retrying" in r.getMessage()
               for r in caplog.records)
    assert follower.update(4, "run/v4/manifest.json") and follower.version == 4  # tried again, loaded
    assert engine.installed == [tmp_path / "v4"]


def test_the_follower_counts_its_first_policy_apart_from_what_each_later_version_cost(tmp_path, monkeypatch):
    """What `heterorl wan` reports per sampler: the first policy's bytes (a keyframe and the deltas
    after it), then bytes per version followed, keyframes taken later included."""
    reports = {4: SimpleNamespace(bytes_downloaded=1000 + 30, keyframe_bytes=1000, refused=[], path=[0, 3, 4]),
               6: SimpleNamespace(bytes_downloaded=20, keyframe_bytes=0, refused=[], path=[5, 6]),
               9: SimpleNamespace(bytes_downloaded=1000, keyframe_bytes=1000, refused=[], path=[9])}
    monkeypatch.setattr(follower_module, "fetch_policy",
                        lambda store, key, target, expect_version, **kw: (target, None, reports[expect_version]))
    engine = FullOnce(RuntimeError("never raised"))
    engine.prepares = 1  # no memory trouble here
    follower = PolicyFollower(None, tmp_path, logging.getLogger("test.follower"), engine)
    assert follower.stats(0.0)["first_policy_bytes"] is None and follower.per_version_bytes() is None
    for version in (4, 6, 9):
        assert follower.update(version, f"run/v{version}/manifest.json")
    stats = follower.stats(0.0)
    assert (stats["first_policy_version"], stats["first_policy_bytes"]) == (4, 1030)
    assert stats["keyframe_bytes"] == 2000 and stats["weights_bytes_downloaded"] == 2050
    assert stats["per_version_bytes"] == round(1020 / 5)  # v4 -> v9: a delta path and a later keyframe
