"""The versions the learner keeps to re-score stale groups (`PastPolicies`): within a memory
budget (the device, then host memory, then none: downloaded from S3), never an out-of-memory
error, one copy each, and freed when every sampler key is the run's own again."""

import gc
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch

from consumers.intake import Intake
from pipeline.config import load_config
from pipeline.models.tiny import build_tiny_model, build_tokenizer
from pipeline.records.metrics import StageClock
from pipeline.trust import KeyEntry, KeyRegistry
from pipeline.weights.follower import PastPolicies
from pipeline.weights.store import CheckpointNotFound
from pipeline.wire.signing import SigningKey


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A directory of the tiny model, and its weights."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def published(weights, version):
    """Version `version` as samplers get it (bf16)."""
    return {k: (t + 0.01 * version).to(torch.bfloat16) for k, t in weights.items()}


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors.values())


class GoneStore:
    """A checkpoint store in which every version has been pruned; records what was looked for."""

    def __init__(self):
        self.asked = []

    def manifest_key(self, version):
        self.asked.append(version)
        return f"v{version}/manifest.json"

    def read_expected(self, *_, **__):
        raise CheckpointNotFound("pruned")


def exactly(model, weights):
    got = model.state_dict()
    return all(got[k].dtype == torch.float32 and torch.equal(got[k], weights[k].float()) for k in weights)


def test_kept_versions_fill_the_device_budget_then_host_memory_then_are_downloaded(base, tmp_path, caplog):
    path, weights = base
    versions = {v: published(weights, v) for v in range(1, 6)}
    size = nbytes(versions[1])
    store = GoneStore()
    past = PastPolicies(store, tmp_path, path, keep_last=3, device_bytes=size + size // 2, host_bytes=size)
    caplog.set_level(logging.INFO, logger="pipeline.weights.follower")
    assert past.keep(1, versions[1]) == "device"
    assert past.keep(2, versions[2]) == "host"  # the device budget holds one
    assert past.keep(3, versions[3]) is None  # and host memory one: not kept
    assert past.where == {1: "device", 2: "host"} and sorted(past.kept) == [1, 2]
    assert past.used() == {"device": size, "host": size}
    lines = [r.getMessage() for r in caplog.records]
    assert any("kept policy v2" in m and "in host memory" in m and "keep_versions_gib" in m for m in lines), lines
    assert any("not keeping policy v3" in m and "keep_versions_host_gib" in m and "S3" in m for m in lines), lines
    # re-scoring: a kept one is loaded as it was handed over; v3 comes from the download path
    for version in (1, 2, 1):
        assert exactly(past.get(version), versions[version])
    assert store.asked == []
    assert past.get(3) is None and store.asked == [3]  # pruned from this store: nothing to check with
    downloads = []
    past._download = lambda v: downloads.append(v) or {"model.safetensors": versions[v]}
    assert exactly(past.get(3), versions[3]) and downloads == [3]


def test_the_oldest_kept_version_makes_room_for_the_newest(base, tmp_path, monkeypatch):
    path, weights = base
    versions = {v: published(weights, v) for v in range(1, 5)}
    size = nbytes(versions[1])
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=2, device_bytes=size, host_bytes=size)
    assert [past.keep(v, versions[v]) for v in (1, 2)] == ["device", "host"]
    events = []  # a GPU's free memory counts a dropped version only once the cache lets it go
    monkeypatch.setattr(past, "_free_cache", lambda: events.append("freed"))
    real_budgets = past.budgets
    monkeypatch.setattr(past, "budgets", lambda: events.append("budgets") or real_budgets())
    assert past.keep(3, versions[3]) == "device"  # v1 dropped first: its place on the device is v3's
    assert events == ["freed", "budgets"]
    assert past.where == {2: "host", 3: "device"} and past.used() == {"device": size, "host": size}
    for version in (2, 3):
        assert exactly(past.get(version), versions[version])


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"),
                                   RuntimeError("CUDA error: out of memory")])
def test_an_out_of_memory_error_on_the_device_keeps_the_version_in_host_memory(base, tmp_path, monkeypatch, caplog,
                                                                              error):
    path, weights = base
    versions = {v: published(weights, v) for v in (1, 2, 3)}
    size = nbytes(versions[1])
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=3, device_bytes=10 * size, host_bytes=10 * size)
    assert past.keep(1, versions[1]) == "device"
    real, made = PastPolicies._allocate, []

    def allocate(self, like, target, pin, where):
        if where == "device" and len(made) == 2:  # the device runs out part way through a version
            raise error
        made.append(where)
        return real(self, like, target, pin, where)

    monkeypatch.setattr(PastPolicies, "_allocate", allocate)
    caplog.set_level(logging.INFO, logger="pipeline.weights.follower")
    assert past.keep(2, versions[2]) == "host"  # no error: in host memory instead
    assert past.where == {1: "device", 2: "host"} and past.device_bytes == size  # what the device holds now
    assert any("kept policy v2" in r.getMessage() and "out of memory" in r.getMessage() for r in caplog.records)
    assert past.keep(3, versions[3]) == "host"  # the device budget is full now: not tried again
    for version in (1, 2, 3):
        assert exactly(past.get(version), versions[version])


def test_an_error_other_than_memory_is_not_hidden(base, tmp_path, monkeypatch):
    path, weights = base
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=3, device_bytes=None, host_bytes=None)

    def broken(self, like, target, pin, where):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(PastPolicies, "_allocate", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        past.keep(1, published(weights, 1))
    assert past.kept == {}


def test_without_a_budget_the_kept_versions_take_a_share_of_the_free_memory(base, tmp_path, monkeypatch):
    path, weights = base
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=3)
    monkeypatch.setattr(PastPolicies, "host_available", staticmethod(lambda: 8 << 30))
    assert past.budgets() == (2 << 30, 0)  # on a CPU learner the device is host memory: no second tier
    past.keep(1, published(weights, 1))
    assert past.budgets() == (int(0.25 * ((8 << 30) + nbytes(past.kept[1]))), 0)  # what is kept counts as free
    monkeypatch.setattr(PastPolicies, "host_available", staticmethod(lambda: 0))
    assert past.keep(2, published(weights, 2)) is None and sorted(past.kept) == [1]  # no memory: not kept
    sized = PastPolicies(GoneStore(), tmp_path, path, keep_last=3, device_bytes=5, host_bytes=7)
    assert sized.budgets() == (5, 7)


# ---- the intake: what the learner hands over, and when it is freed -------------------------------
class State:
    def quarantines(self):
        return {}


def intake_with(past, *local, stranger=False, **security):
    """An intake whose registry holds sampler keys marked local (`local`), and a key not the
    run's own (`stranger`)."""
    cfg = load_config(None, [f"security.{k}={str(v).lower()}" for k, v in security.items()], env={})
    intake = Intake(cfg, None, SimpleNamespace(), state=State(), registry=None, dead_letter=lambda *a: None,
                    clock=StageClock(), fresh_in_step=True)
    registry = KeyRegistry.empty(cfg.run.name)
    keys = [(f"own-{i}", True) for i in range(len(local))] + [("remote-1", False)] * stranger
    for sampler_id, is_local in keys:
        key = SigningKey.generate()
        registry = registry.with_key(KeyEntry(key.key_id, sampler_id, key.public, "active", 4e9, 1.0, local=is_local))
    intake.verifier.registry, intake.past = registry, past
    return intake


def test_the_intake_keeps_versions_only_while_a_key_is_not_the_run_s_own_and_then_frees_them(base, tmp_path):
    path, weights = base
    versions = {v: published(weights, v) for v in range(1, 5)}
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=2)
    handed = []
    hand = lambda v: lambda: handed.append(v) or versions[v]  # noqa: E731
    some_stranger = intake_with(past, "own", stranger=True)
    for v in (1, 2, 3):
        some_stranger.keep(v, hand(v))
    assert sorted(past.kept) == [2, 3] and handed == [1, 2, 3]  # the newest keep_last
    model = weakref.ref(past.get(2))
    kept = weakref.ref(past.kept[3]["lm_head.weight"] if "lm_head.weight" in past.kept[3]
                       else next(iter(past.kept[3].values())))
    all_own = intake_with(past, "own", "own")
    assert all_own.all_trusted()
    all_own.keep(4, hand(4))  # every key is the run's own again: nothing kept, everything freed
    gc.collect()
    assert past.kept == {} and past.scratch is None and past.loaded is None and handed == [1, 2, 3]
    assert model() is None and kept() is None
    assert past.used() == {"device": 0, "host": 0}
    for v in (1, 2):  # checks after that download what they need
        assert past.get(v) is None
    audited = intake_with(past, "own", trust_local_samplers=False)  # an audit: the run's own are strangers
    audited.keep(4, hand(4))
    assert sorted(past.kept) == [4] and handed == [1, 2, 3, 4]
    intake_with(PastPolicies(GoneStore(), tmp_path, path, keep_last=0), "own", stranger=True).keep(4, hand(4))
    assert handed == [1, 2, 3, 4]  # keep_last 0: not even asked for the tensors


def test_the_learner_hands_over_the_publisher_s_copy_not_a_cast_of_its_own(base, tmp_path):
    """`Checkpoints.publish` gives `keep` the tensors of the publisher's slot (the bytes samplers get,
    already in `learner.policy_dtype`), so the kept version is the only other copy: no whole
    cast of the module's weights is made on the way."""
    from consumers.learner_checkpoints import Checkpoints
    from pipeline.weights.publisher import SnapshotSlots, slot_layout

    path, weights = base
    model = build_tiny_model(build_tokenizer(), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # trained since the base
    slots = SnapshotSlots(slot_layout(path, {k: t.shape for k, t in model.state_dict().items()}, torch.bfloat16),
                          count=1)
    kept = []
    learner = Checkpoints(
        SimpleNamespace(take_slot=lambda: 0, slots=slots, submit_policy=lambda *a, **k: None), None,
        SimpleNamespace(keep=lambda version, tensors: kept.append((version, tensors()))),
        engine=SimpleNamespace(module=model), tokenizer=None, work_dir=tmp_path, lcfg=SimpleNamespace(zero_stage=0),
        clock=StageClock(), link=None, keeps_versions=True, published_version=None, log=None)
    try:
        learner.publish(7, {}, parent_version=None)
        (version, handed), = kept
        views = slots.views(0)["model.safetensors"]
        assert version == 7 and handed.keys() == views.keys()
        assert all(handed[k].data_ptr() == views[k].data_ptr() for k in views)  # the slot itself
        past = PastPolicies(GoneStore(), tmp_path, path, keep_last=1)
        past.keep(7, handed)
        for v in views.values():
            v.zero_()  # the slot is reused for the next version; the kept copy is not
        expect = {k: model.state_dict()[k].to(torch.bfloat16) for k in views}
        assert exactly(past.get(7), expect)
    finally:
        slots.close()


def test_a_validator_keeps_what_it_downloaded_and_names_a_version_altered_in_s3(base, tmp_path, monkeypatch, caplog):
    """A validator has no versions handed over: it downloads each one a check needs
    (`keep_downloads`), keeps it within the same bounds, and re-scores with it again without a
    download, so a version rewritten in S3 after it took it is still checked with what the
    learner signed. A version it can only find altered is named in `altered` (its groups are not
    used: tests/unit/test_screening.py), said once in the log, and let go once it verifies again."""
    from pipeline.weights import follower
    from pipeline.weights.store import CorruptCheckpointError

    path, weights = base
    versions = {v: published(weights, v) for v in range(1, 4)}
    altered: set[int] = set()
    fetched: list[int] = []

    def fetch(store, key, target, expect_version):  # S3 as the tamperer left it
        fetched.append(expect_version)
        if expect_version in altered:
            raise CorruptCheckpointError(f"manifest of v{expect_version}: bad signature")
        return target, None, None

    monkeypatch.setattr(follower, "fetch_policy", fetch)
    monkeypatch.setattr(follower, "read_weights", lambda d: {"model.safetensors": versions[int(d.name[7:])]})
    past = PastPolicies(GoneStore(), tmp_path, path, keep_last=2, keep_downloads=True)
    caplog.set_level(logging.ERROR, logger="pipeline.weights.follower")
    assert exactly(past.get(1), versions[1]) and exactly(past.get(2), versions[2])
    assert fetched == [1, 2] and sorted(past.kept) == [1, 2]
    altered |= {1, 3}  # v1 rewritten after the validator took it; v3 before
    assert exactly(past.get(1), versions[1]) and fetched == [1, 2] and not past.is_altered(1)  # kept: no download
    assert past.get(3) is None and set(past.altered) == {3} and past.is_altered(3) and fetched == [1, 2, 3]
    assert past.get(3) is None and past.is_altered(3) and fetched == [1, 2, 3]  # not again within the minute
    past.altered[3] -= past.ALTERED_RETRY_S  # a minute later: looked at again, still altered
    assert past.is_altered(3) and fetched == [1, 2, 3, 3]
    assert [r.getMessage() for r in caplog.records] == [
        "cannot re-score groups of v3: manifest of v3: bad signature; its groups are not used"]
    altered.clear()  # put back as signed, and a minute later
    past.altered[3] -= past.ALTERED_RETRY_S
    assert not past.is_altered(3) and exactly(past.get(3), versions[3]) and past.altered == {}
    assert sorted(past.kept) == [2, 3]  # the newest keep_last (v1 made room)
    past.get(1)  # an older one than all kept, downloaded again: not kept in place of a newer
    assert sorted(past.kept) == [2, 3]
    # the learner's kind (nothing kept of what it downloads): every check downloads again
    learner = PastPolicies(GoneStore(), tmp_path, path, keep_last=2)
    fetched.clear()
    learner.get(1), learner.get(2), learner.get(1)
    assert fetched == [1, 2, 1] and learner.kept == {}
