"""Unit tests for pipeline.models: the tiny tokenizer, sampling, learner log-probs, evaluation, base-model cache."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from pipeline.models import (
    completion_logprobs,
    decode_completion,
    evaluate_policy,
    greedy_completions,
    load_policy,
    sample_groups,
)
from pipeline.models import decoding, tiny
from pipeline.models.tiny import BaseModelSettings, ModelSize, build_tiny_model, build_tokenizer, ensure_base_model
from pipeline.tasks import make_task
from tests.conftest import torch_threads

TINY = ModelSize(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=32)
# Prompts of different lengths, so left padding (sampler) and right padding (learner) both matter.
PROMPTS = ["1+2=", "37+58=", "123+4=", "9*9=", "70-71="]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def eos_model(tok):
    """A random tiny model with an output bias towards EOS, so completions have mixed lengths."""
    model = build_tiny_model(tok, TINY, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Larger-than-init weights so outputs depend strongly on content and position
        # (a padding or position bug then shows up as a log-prob mismatch).
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    head = torch.nn.Linear(TINY.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.3)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 1.5
    model.lm_head = head
    return model.eval()


def _flat(groups):
    P = [g.prompt_ids for g in groups for _ in g.completion_ids]
    C = [c for g in groups for c in g.completion_ids]
    Q = [q for g in groups for q in g.sampler_logps]
    return P, C, Q


# -- tokenizer -------------------------------------------------------------------------
def test_tokenizer_roundtrip(tok):
    text = "0123456789+-*=() "
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("37+58=", add_special_tokens=False)["input_ids"]) == "37+58="
    assert tok.convert_ids_to_tokens(tok("a")["input_ids"]) == ["<bos>", "<unk>"]
    assert tok.pad_token_id == 0 and tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.decode([8, 9, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "45"


def test_tokenizer_offline_reload(tok, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in PROMPTS + ["95", " 1 2 "]:
        assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert (again.bos_token, again.eos_token, again.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert again.decode(again("37+58=")["input_ids"], skip_special_tokens=True) == "37+58="


# -- sampling / learner agreement ------------------------------------------------------
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 2, 1.0)])
def test_sampler_and_learner_logps_agree(tok, eos_model, temperature, top_k, top_p):
    groups = sample_groups(
        eos_model, tok, PROMPTS, group_size=4, temperature=temperature, top_k=top_k, top_p=top_p,
        max_new_tokens=6, seed=11,
    )
    P, C, Q = _flat(groups)
    lengths = {len(c) for c in C}
    assert len(lengths) > 1, "want completions of different lengths"
    logps, mask = completion_logprobs(eos_model, P, C, temperature)
    assert logps.shape == mask.shape == (len(C), max(len(c) for c in C))
    assert logps.requires_grad
    for b, (c, q) in enumerate(zip(C, Q)):
        assert mask[b].sum().item() == len(c)
        assert torch.all(logps[b, len(c):] == 0)
        got = logps[b, : len(c)].detach()
        assert torch.allclose(got, torch.tensor(q), atol=1e-5, rtol=0), (b, got, q)
        assert all(x <= 0 for x in q)


def test_logps_agree_after_save_and_load(tok, tmp_path):
    model = build_tiny_model(tok, TINY, seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_policy(tmp_path)
    assert not loaded.training
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    groups = sample_groups(loaded, ltok, PROMPTS, group_size=3, temperature=1.0, max_new_tokens=5, seed=0)
    P, C, Q = _flat(groups)
    logps, _ = completion_logprobs(model, P, C, 1.0)
    for b, q in enumerate(Q):
        assert torch.allclose(logps[b, : len(q)].detach(), torch.tensor(q), atol=1e-5, rtol=0)


def test_learner_logps_have_gradients(tok):
    model = build_tiny_model(tok, TINY, seed=2)
    groups = sample_groups(model, tok, PROMPTS[:2], group_size=2, temperature=1.0, max_new_tokens=3, seed=0)
    P, C, _ = _flat(groups)
    logps, mask = completion_logprobs(model, P, C, 1.0)
    (logps * mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()


def test_generation_respects_max_new_tokens_and_eos(tok, eos_model):
    eos = tok.eos_token_id
    for max_new in (1, 3, 7):
        groups = sample_groups(eos_model, tok, PROMPTS, group_size=6, temperature=1.0, max_new_tokens=max_new, seed=3)
        assert [g.prompt_ids for g in groups] == [tok(p)["input_ids"] for p in PROMPTS]
        for g in groups:
            assert len(g.completion_ids) == len(g.sampler_logps) == 6
            for c, q in zip(g.completion_ids, g.sampler_logps):
                assert 1 <= len(c) <= max_new
                assert len(q) == len(c)
                # EOS only ever as the last token; no tokens after it.
                assert eos not in c[:-1]
                if c[-1] != eos:
                    assert len(c) == max_new  # truncated
    groups = sample_groups(eos_model, tok, PROMPTS, group_size=6, temperature=1.0, max_new_tokens=7, seed=3)
    ends = [c[-1] == eos for g in groups for c in g.completion_ids]
    assert any(ends) and not all(ends)


def test_sampling_is_seeded_and_leaves_global_rng_alone(tok, eos_model):
    kw = dict(group_size=3, temperature=1.0, max_new_tokens=5)
    state = torch.random.get_rng_state()
    a = sample_groups(eos_model, tok, PROMPTS, seed=5, **kw)
    assert torch.equal(state, torch.random.get_rng_state())
    b = sample_groups(eos_model, tok, PROMPTS, seed=5, **kw)
    c = sample_groups(eos_model, tok, PROMPTS, seed=6, **kw)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    assert [g.completion_ids for g in a] != [g.completion_ids for g in c]
    # Splitting the batch into chunks does not change the stream of draws per row order.
    d = sample_groups(eos_model, tok, PROMPTS, seed=5, max_batch_rows=6, **kw)
    assert len(d) == len(PROMPTS)


def test_top_k_one_is_greedy(tok, eos_model):
    greedy = greedy_completions(eos_model, tok, PROMPTS, max_new_tokens=4)
    sampled = sample_groups(eos_model, tok, PROMPTS, group_size=2, temperature=1.0, top_k=1, max_new_tokens=4, seed=0)
    for g, c in zip(sampled, greedy):
        assert g.completion_ids == [c, c]
        # The recorded log-prob is still over the full vocabulary, not the truncated one.
        assert all(x < 0 for x in g.sampler_logps[0])


def test_filter_logits_keeps_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(decoding._filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(decoding._filter_logits(logits, 0, 0.1))
    assert kept.tolist() == [[True, False, False, False]]
    kept = torch.isfinite(decoding._filter_logits(logits, 3, 1.0))
    assert kept.tolist() == [[True, True, True, False]]


def test_bad_sampling_arguments(tok, eos_model):
    with pytest.raises(ValueError):
        sample_groups(eos_model, tok, PROMPTS, group_size=2, temperature=0.0, max_new_tokens=3, seed=0)
    with pytest.raises(ValueError):
        sample_groups(eos_model, tok, PROMPTS, group_size=0, temperature=1.0, max_new_tokens=3, seed=0)
    with pytest.raises(ValueError):
        completion_logprobs(eos_model, [[1, 2]], [[3], [4]], 1.0)


def test_decode_completion_stops_at_eos(tok):
    ids = tok("95", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + tok("7", add_special_tokens=False)["input_ids"]
    assert decode_completion(tok, ids) == "95"
    assert decode_completion(tok, ids[:2]) == "95"


# -- evaluation ------------------------------------------------------------------------
def test_evaluate_policy_shapes(tok, eos_model):
    task = make_task("arithmetic", eval_size=20)
    problems = task.eval_problems()
    r = evaluate_policy(eos_model, tok, task, problems, n_samples=3, temperature=1.0, max_new_tokens=4, seed=0)
    for key in ("accuracy_sampled", "accuracy_greedy", "mean_completion_tokens", "truncated_fraction"):
        assert key in r
    assert 0.0 <= r["accuracy_sampled"] <= 1.0 and 0.0 <= r["accuracy_greedy"] <= 1.0
    assert r == {**r, **evaluate_policy(eos_model, tok, task, problems, n_samples=3, temperature=1.0,
                                        max_new_tokens=4, seed=0), "eval_seconds": r["eval_seconds"]}
    r2 = evaluate_policy(eos_model, tok, task, problems, n_samples=2, temperature=1.0, greedy=False,
                         max_new_tokens=4, seed=0)
    assert math.isnan(r2["accuracy_greedy"])


def test_evaluate_policy_counts_correct_answers(tok):
    """A model that copies the answer through its bias is scored exactly."""
    task = make_task("arithmetic", eval_size=5)
    model = build_tiny_model(tok, TINY, seed=0)
    problems = [p for p in task.eval_problems()]
    target = problems[0].answer
    head = torch.nn.Linear(TINY.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-50.0)
    model.lm_head = head

    calls = {"n": 0}
    seq = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def pre_hook(module, args):
        # Force token seq[k] at generation step k (all rows), through the bias.
        k = min(calls["n"], len(seq) - 1)
        with torch.no_grad():
            module.bias.fill_(-50.0)
            module.bias[seq[k]] = 50.0
        calls["n"] += 1

    model.lm_head.register_forward_pre_hook(pre_hook)
    calls["n"] = 0
    comps = greedy_completions(model, tok, [p.prompt for p in problems], max_new_tokens=5)
    assert all(decode_completion(tok, c) == target for c in comps)
    calls["n"] = 0
    r = evaluate_policy(model, tok, task, problems, n_samples=2, temperature=1.0, greedy=False,
                        max_new_tokens=5, seed=0)
    expected = sum(p.answer == target for p in problems) / len(problems)
    assert r["accuracy_sampled"] == pytest.approx(expected)


# -- base model cache ------------------------------------------------------------------
def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ensure_base_model_builds_once_and_loads_offline(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = BaseModelSettings(
        task_settings={"digits": 1, "ops": "+", "eval_size": 3},
        size=TINY,
        warmup_steps=3,
        warmup_batch_size=8,
        warmup_target_accuracy=None,
        seed=0,
    )
    path = ensure_base_model(tmp_path, settings)
    assert path.parent == tmp_path and path.name == f"base-{settings.cache_key()}"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "heterorl_base.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle")) for n in names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    info = json.loads((path / "heterorl_base.json").read_text())
    assert info["settings"]["warmup_steps"] == 3 and info["warmup_steps_taken"] == 3

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("1+2=")["input_ids"] == build_tokenizer()("1+2=")["input_ids"]
    assert model.config.num_hidden_layers == TINY.num_layers

    sha, mtime = _sha(path / "model.safetensors"), (path / "model.safetensors").stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("ensure_base_model retrained a cached model")

    monkeypatch.setattr(tiny, "warmup_supervised", no_training)
    again = ensure_base_model(tmp_path, settings.to_dict())  # a plain mapping works too
    assert again == path
    assert _sha(path / "model.safetensors") == sha
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_key_covers_every_setting():
    base = BaseModelSettings()
    variants = [
        BaseModelSettings(seed=1),
        BaseModelSettings(warmup_steps=base.warmup_steps + 1),
        BaseModelSettings(size=ModelSize(hidden_size=96)),
        BaseModelSettings(task_settings={"digits": 3, "ops": "+"}),
        BaseModelSettings(warmup_label_smoothing=0.0),
        BaseModelSettings(warmup_target_accuracy=None),
    ]
    keys = {base.cache_key()} | {v.cache_key() for v in variants}
    assert len(keys) == len(variants) + 1
    assert BaseModelSettings.from_mapping(base.to_dict()).cache_key() == base.cache_key()
    with pytest.raises(ValueError, match="bogus"):
        BaseModelSettings.from_mapping({"bogus": 1})


def test_warmup_stops_at_target(tok):
    task = make_task("arithmetic", digits=1, eval_size=3)
    model = build_tiny_model(tok, TINY, seed=0)
    report = tiny.warmup_supervised(model, tok, task, steps=4, batch_size=8, lr=1e-3, target_accuracy=0.0,
                                 check_every=2, check_problems=8)
    # Accuracy >= 0 holds at the first check, so no step is taken.
    assert report["steps"] == 0 and report["checks"][0][0] == 0


def test_a_top_k_draw_has_the_distribution_of_the_truncated_softmax():
    """With top-k on, only the k largest logits are ranked and drawn from; the frequencies are
    those of the softmax over what `_filter_logits` keeps (top-k, then the top-p nucleus)."""
    logits = torch.log(torch.tensor([0.30, 0.05, 0.25, 0.15, 0.10, 0.08, 0.07]))[None].repeat(20000, 1)
    for top_k, top_p in ((3, 1.0), (4, 0.8), (6, 0.9)):
        want = decoding._filter_logits(logits[:1], top_k, top_p).softmax(-1)[0]
        draws = decoding._draw(logits, top_k, top_p, torch.Generator().manual_seed(0))
        got = torch.bincount(draws, minlength=7).double() / len(draws)
        assert float((got - want).abs().max()) < 0.012, (top_k, top_p, got, want)
        assert set(torch.nonzero(want).flatten().tolist()) == set(draws.unique().tolist())
