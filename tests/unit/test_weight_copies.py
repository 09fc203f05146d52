"""The learner's copies of its weights on a CPU (into the publisher's slot, and for a recovery
state) run on one intra-op thread: beside a sampler generating on the same cores, a copy split
over OpenMP threads waits at each tensor's barrier for a parked thread (bench/copy_beside_work.py
measures it). The copies stay exact, and the process's thread count is restored after."""

import pytest
import torch

from pipeline.devices import one_cpu_thread
from pipeline.models.tiny import build_tiny_model, build_tokenizer


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_one_cpu_thread_sets_one_and_restores_the_count_even_after_an_error():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_cpu_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), one_cpu_thread():
            raise ValueError("a copy failed")
        assert torch.get_num_threads() == 2
        with one_cpu_thread(enabled=False):  # a model on a GPU: nothing changed
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_slot_copy_runs_on_one_thread_on_a_cpu_and_is_exact(tmp_path, monkeypatch, threads_restored):
    from pipeline.weights import publisher
    from pipeline.weights.publisher import SnapshotSlots, copy_weights_into, slot_layout

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    slots = SnapshotSlots(slot_layout(tmp_path, {k: t.shape for k, t in state.items()}, torch.bfloat16), count=1)
    seen = []
    real = publisher.one_cpu_thread

    def recording(enabled=True):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(publisher, "one_cpu_thread", recording)
    torch.set_num_threads(2)
    try:
        copy_weights_into(model, slots.views(0))
        assert seen == [True] and torch.get_num_threads() == 2
        views = slots.views(0)["model.safetensors"]
        assert all(torch.equal(views[k], state[k].to(torch.bfloat16)) for k in views)
    finally:
        slots.close()


def test_a_recovery_capture_runs_on_one_thread_on_a_cpu(monkeypatch, threads_restored):
    from types import SimpleNamespace

    from pipeline.weights import learner_state

    model = build_tiny_model(build_tokenizer(), seed=0)
    threads = []
    monkeypatch.setattr(learner_state, "capture_weights",
                        lambda engine, leader: threads.append(torch.get_num_threads()) or {
                            k: t.detach().clone() for k, t in engine.module.state_dict().items()})
    torch.set_num_threads(2)
    captured = learner_state.capture(SimpleNamespace(module=model), None, state=False)
    assert threads == [1] and torch.get_num_threads() == 2 and captured.weights.keys() == model.state_dict().keys()
