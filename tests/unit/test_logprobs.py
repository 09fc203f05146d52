"""The learner's log-probs on real model shapes: exact, and never a batch × length × vocabulary tensor."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipeline.models import completion_logprobs

ROOT = Path(__file__).resolve().parents[2]


def qwen2(vocab=151_936, hidden=32, seed=0):
    """Qwen2 shape (vocabulary of Qwen2-0.5B, grouped KV heads, tied embeddings), random init."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, tie_word_embeddings=True)).float()


def llama(vocab=128_256, hidden=32, seed=0):
    """Llama-3 vocabulary, untied LM head, random init."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, tie_word_embeddings=False)).float()


def batch(vocab, rows=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    comps = [torch.randint(1, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
             for _ in range(rows)]
    return prompts, comps


def reference_logps(model, prompts, comps, temperature):
    """Independent: the full logits of each row on its own, log_softmax in float64, token by token."""
    out = []
    for p, c in zip(prompts, comps):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0].double() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out.append([float(logp[len(p) - 1 + t, tok]) for t, tok in enumerate(c)])
    return out


@pytest.mark.parametrize("make", [qwen2, llama], ids=["qwen2", "llama"])
def test_chunked_log_probs_match_the_full_softmax_and_their_gradients_match_one_chunk(make):
    model = make(vocab=1000)
    prompts, comps = batch(1000)
    want = reference_logps(model, prompts, comps, temperature=0.7)
    one, mask = completion_logprobs(model, prompts, comps, 0.7, chunk_tokens=10_000)
    one = one.detach()
    for b, row in enumerate(want):
        assert mask[b].sum() == len(row)
        assert one[b, : len(row)].tolist() == pytest.approx(row, abs=2e-5)
        assert float(one[b, len(row):].abs().sum()) == 0.0
    grads = []
    for chunk in (10_000, 3):  # one chunk; many chunks, each recomputed in the backward pass
        model.zero_grad()
        logps, _ = completion_logprobs(model, prompts, comps, 0.7, chunk_tokens=chunk)
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # Equal but for float32 summation order (the head's gradient is summed chunk by chunk).
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-5 * float(grads[0].abs().max())


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("make", [qwen2, llama], ids=["qwen2", "llama"])
def test_no_batch_by_length_by_vocabulary_tensor_is_made(make):
    model = make()
    vocab = model.config.vocab_size
    prompts, comps = batch(vocab, rows=8)
    rows, width = len(prompts), max(len(p) + len(c) for p, c in zip(prompts, comps))
    with LargestTensor() as seen:
        logps, _ = completion_logprobs(model, prompts, comps, 1.0, chunk_tokens=16)
        logps.sum().backward()
    # The largest tensors are the vocabulary × hidden weights and one chunk's logits.
    assert seen.largest <= max(16 * vocab, vocab * model.config.hidden_size)
    assert seen.largest < rows * width * vocab / 4


def test_a_batch_whose_full_logits_would_not_fit_the_memory_budget_trains():
    """In a process whose address space cannot hold a batch × length × vocabulary float32
    tensor (1.74 GiB here, against 1 GiB of room), the learner's log-probs and their backward pass still run."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from tests.unit.test_logprobs import qwen2
        from pipeline.models import completion_logprobs
        model = qwen2()
        vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024
        budget = vm + 1024 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
        rows, prompt, completion, vocab = 32, 32, 64, model.config.vocab_size
        prompts = [[1 + (7 * i + j) % 1000 for j in range(prompt)] for i in range(rows)]
        comps = [[1 + (13 * i + j) % (vocab - 1) for j in range(completion)] for i in range(rows)]
        full = rows * (prompt + completion) * vocab * 4
        assert full > budget - vm, (full, budget - vm)
        try:
            torch.empty(rows, prompt + completion, vocab)
            sys.exit("a full logits tensor fitted the budget: the test proves nothing")
        except RuntimeError:
            pass
        logps, mask = completion_logprobs(model, prompts, comps, 1.0)
        logps.sum().backward()
        assert torch.isfinite(logps).all() and mask.sum() == rows * completion
        print("ok", full / 2**30)
    """)
    # One malloc arena: each extra thread's arena would reserve 64 MiB of address space.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MALLOC_ARENA_MAX": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("ok") and math.isclose(float(proc.stdout.split()[1]), 1.74, rel_tol=0.05)


def grouped(vocab, sizes=(4, 3, 5), seed=3):
    """Prompt groups as the learner gets them: each prompt (of its own length) repeated for its
    completions, which differ in length (one of a single token)."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for k, size in enumerate(sizes):
        prompt = torch.randint(1, vocab, (3 + 2 * k,), generator=g).tolist()
        for i in range(size):
            length = 1 if i == 0 else int(torch.randint(2, 9, (1,), generator=g))
            prompts.append(prompt)
            comps.append(torch.randint(1, vocab, (length,), generator=g).tolist())
    return prompts, comps


@pytest.mark.parametrize("make", [qwen2, llama], ids=["qwen2", "llama"])
def test_rows_sharing_a_prompt_read_it_once_with_the_same_logprobs_and_gradients(make, monkeypatch):
    """A group's completions share one pass over their prompt: the log-probs are the full
    softmax's (float64, row by row), and the gradients those of one pass over whole rows."""
    from pipeline.models import logprobs

    model = make(vocab=1000)
    prompts, comps = grouped(1000)
    fed = []
    real = model.base_model.forward
    monkeypatch.setattr(model.base_model, "forward", lambda **kw: fed.append(kw["input_ids"].numel()) or real(**kw))
    shared, mask = completion_logprobs(model, prompts, comps, 0.7)
    shared = shared.detach()
    distinct = {tuple(p) for p in prompts}
    assert len(fed) == 2 and fed[0] == len(distinct) * max(map(len, distinct))  # each prompt once
    assert fed[1] == len(comps) * (max(map(len, comps)) - 1)  # then the completions but their last token
    for b, row in enumerate(reference_logps(model, prompts, comps, temperature=0.7)):
        assert shared[b, : len(row)].tolist() == pytest.approx(row, abs=2e-5)
        assert float(shared[b, len(row):].abs().sum()) == 0.0 and mask[b].sum() == len(row)
    grads = []
    for share in (True, False):
        monkeypatch.setattr(logprobs, "_shares_prompts", lambda m, share=share: share)
        model.zero_grad()
        logps, _ = completion_logprobs(model, prompts, comps, 0.7)
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-5 * float(grads[1].abs().max())
