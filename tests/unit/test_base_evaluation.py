"""The base model's held-out accuracy is computed once per model and settings, then reused."""

import shutil

import pytest
import torch

from pipeline import runtime
from pipeline.config import HeteroConfig
from pipeline.models.tiny import BaseModelSettings, ModelSize, ensure_base_model
from pipeline.tasks import make_task


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_a_cached_base_is_evaluated_once_per_settings_and_gives_the_same_numbers_with_progress(tmp_path, monkeypatch):
    settings = BaseModelSettings(task_settings={"digits": 1, "ops": "+", "eval_size": 5},
                                 size=ModelSize(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=32, max_positions=32),
                                 warmup_steps=3, warmup_batch_size=8, warmup_target_accuracy=None, seed=0)
    base = ensure_base_model(tmp_path / "models", settings)
    cfg = HeteroConfig.model_validate({"services": {"data_dir": str(tmp_path)},
                                       "task": {"digits": 1, "ops": "+", "eval_size": 5},
                                       "eval": {"n_samples": 3}, "sampler": {"max_new_tokens": 3}})
    task = make_task("arithmetic", digits=1, ops="+", eval_size=5)
    fresh = runtime.evaluate_checkpoint(cfg, base, task)

    calls = []
    real = runtime.evaluate_checkpoint
    monkeypatch.setattr(runtime, "evaluate_checkpoint", lambda *a: calls.append(a) or real(*a))
    first = runtime.evaluate_base(cfg, base, task)
    again = runtime.evaluate_base(cfg, base, task)
    timeless = [{k: v for k, v in r.items() if k != "eval_seconds"} for r in (first, again, fresh)]
    assert timeless[0] == timeless[1] == timeless[2] and len(calls) == 1  # seeded: the stored numbers are a fresh run's

    # Progress: told the completions decoded, pass by pass, without changing a number.
    seen = []
    shown = real(cfg, base, task, seen.append)
    assert runtime.evaluation_completions(cfg, task) == 5 * (3 + 1)
    assert sum(seen) == pytest.approx(5 * (3 + 1)) and len(seen) >= 4  # sampled and greedy
    assert {k: v for k, v in shown.items() if k != "eval_seconds"} == timeless[2]
    from pipeline.models.policy import load_policy
    from pipeline.models.decoding import sample_groups
    model, tokenizer = load_policy(base, torch.device("cpu"), torch.float32)
    prompts = [task.encode_prompt(p, tokenizer) for p in task.eval_problems()]
    chunked = []
    sample_groups(model, tokenizer, prompts, group_size=2, temperature=1.0, max_new_tokens=3, seed=0,
                  max_batch_rows=4, progress=chunked.append)  # 3 chunks of up to 2 prompts x 2
    assert sum(chunked) == pytest.approx(len(prompts) * 2)
    assert first == again
    assert [p.name for p in (tmp_path / "models" / "evaluations").iterdir()][0].startswith(base.name)

    other_seed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 5})})
    runtime.evaluate_base(other_seed, base, task)
    other_temperature = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"temperature": 0.5})})
    runtime.evaluate_base(other_temperature, base, task)
    assert len(calls) == 3                                  # other settings: evaluated afresh
    import pipeline.devices
    monkeypatch.setattr(pipeline.devices, "machine_precision", lambda device: ("fp32", "a CPU without bf16 units"))
    auto = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"precision": "auto"})})
    assert runtime.evaluate_base(auto, base, task) == first  # `auto` resolved first: fp32 here, as configured above
    assert len(calls) == 3                                  # ... the same settings: reused

    own = shutil.copytree(base, tmp_path / "mine")  # a copy outside the model cache, info file and all
    runtime.evaluate_base(cfg, own, task)
    runtime.evaluate_base(cfg, own, task)
    assert len(calls) == 5                                  # a user's directory may change: never reused

    info = base / "heterorl_base.json"                      # the cached model rebuilt: a new info file
    info.write_text(info.read_text().replace("{", '{"created_unix": 1, ', 1))
    runtime.evaluate_base(cfg, base, task)
    assert len(calls) == 6


def test_an_evaluation_gives_the_gpu_allocator_cache_back_when_cuda_is_in_use(monkeypatch):
    """After its base evaluation a supervisor on an H200 held 3.7 GiB of cached blocks for the
    whole run (docs/results/smollm2_study/gpu_h200_partial/); release_memory empties the cache
    of a process that has used CUDA, and leaves CUDA alone in one that has not."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    runtime.release_memory()
    assert emptied == []  # a CPU-only process never initialises CUDA for this
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    runtime.release_memory()
    assert emptied == [True]
