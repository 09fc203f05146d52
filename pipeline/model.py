"""The policy model: tiny model construction and warm-up, loading, sampling, log-probs, evaluation.

Shared by samplers (``sample_groups``), the learner (``completion_logprobs``) and the
evaluator (``evaluate_policy``). Everything except ``build_tokenizer``,
``build_tiny_model`` and ``ensure_base_model`` works with any local Hugging Face causal
LM directory (``load_policy(path)``), not only the tiny one.

The log-prob rule, used identically on both sides (docs/task_and_model.md):

    logp(token) = log_softmax(logits / temperature)[token]

over the FULL vocabulary, i.e. before any top-k / top-p truncation, at the sampled
token. Positions are counted from the first real (non-pad) token of each row, so a
left-padded batch in the sampler and a right-padded batch in the learner see the same
positions and agree to float rounding (about 1e-6).

No pickles anywhere: weights are safetensors, the tokenizer is tokenizer.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from pipeline.tasks import Problem, Task, make_task

__all__ = [
    "SPECIAL_TOKENS",
    "CHARS",
    "ModelSize",
    "BaseModelSettings",
    "SampledGroup",
    "build_tokenizer",
    "build_tiny_model",
    "ensure_base_model",
    "load_policy",
    "load_tokenizer",
    "sample_groups",
    "greedy_completions",
    "decode_completion",
    "completion_logprobs",
    "evaluate_policy",
    "warmup_supervised",
]

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Every character the built-in tasks use; anything else maps to <unk>.
CHARS: str = "0123456789+-*=() "

# File written last into a finished base-model directory (the directory is renamed
# into place atomically; this also records how it was made).
BASE_MODEL_INFO = "heterorl_base.json"


# ----------------------------------------------------------------------------------
# Tokenizer and tiny model
# ----------------------------------------------------------------------------------
def build_tokenizer():
    """A character-level fast tokenizer made locally (no download).

    One token per character of :data:`CHARS`, plus ``<pad>``=0, ``<bos>``=1, ``<eos>``=2,
    ``<unk>``=3. Encoding prepends ``<bos>``; decoding concatenates characters.
    ``save_pretrained`` writes tokenizer.json so ``AutoTokenizer.from_pretrained(dir)``
    reloads it offline.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece (spaces included; "." does not match "\n",
    # which still becomes its own piece through "isolated" and maps to <unk>).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    return fast


@dataclass(frozen=True)
class ModelSize:
    """Size of the tiny Llama-architecture model."""

    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 128
    max_positions: int = 64
    head_dim: int | None = 32  # None: hidden_size // num_heads. vLLM's CPU attention needs >= 32


def build_tiny_model(tokenizer, size: ModelSize | Mapping[str, Any] | None = None, *, seed: int = 0):
    """A randomly initialised Llama-architecture causal LM sized by ``size``."""
    if size is None:
        size = ModelSize()
    elif isinstance(size, Mapping):
        size = ModelSize(**size)
    if size.head_dim is None and size.hidden_size % size.num_heads:
        raise ValueError(f"hidden_size {size.hidden_size} is not divisible by num_heads {size.num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        head_dim=size.head_dim or size.hidden_size // size.num_heads,
        max_position_embeddings=size.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.float()


class _seeded:
    """Fork the global torch RNG for a block (model init uses it)."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._ctx = torch.random.fork_rng(devices=[])
        self._ctx.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


# ----------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a local HF model directory; one without a pad token gets its EOS token as pad."""
    tokenizer = AutoTokenizer.from_pretrained(Path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load any local HF causal-LM directory: (model in `dtype` eval mode on `device`, tokenizer).

    Only safetensors weights are accepted (``use_safetensors=True``: no pickle is ever
    unpickled). A tokenizer without a pad token gets its EOS token as pad.
    """
    path = Path(path)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    model.to(device).eval()
    return model, tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map and special tokens: equal iff ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def _eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS, then any other EOS of the model's generation config."""
    return _merge_eos(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def generation_eos_ids(model_dir: str | os.PathLike, tokenizer) -> list[int]:
    """`_eos_ids` for a model directory that is not loaded (generation_config.json read as JSON)."""
    path = Path(model_dir) / "generation_config.json"
    gen_eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return _merge_eos(tokenizer, gen_eos)


def _merge_eos(tokenizer, gen_eos) -> list[int]:
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    for i in gen_eos or []:
        if int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation_config defines an EOS token")
    return ids


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return int(tokenizer.eos_token_id)


def decode_completion(tokenizer, completion_ids: Sequence[int], eos_ids: Sequence[int] | None = None) -> str:
    """Text of a completion's tokens before its first EOS, special tokens skipped.

    This is what samplers pass to ``Task.reward``.
    """
    eos = set(eos_ids) if eos_ids is not None else {tokenizer.eos_token_id}
    ids = list(completion_ids)
    for k, t in enumerate(ids):
        if t in eos:
            ids = ids[:k]
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------
@dataclass
class SampledGroup:
    """G completions of one prompt, with the sampler's per-token log-probs."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]  # each ends with EOS unless truncated at max_new_tokens
    sampler_logps: list[list[float]]  # one per completion token, same rule as completion_logprobs


def _filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k and outside the top-p nucleus; used only to pick."""
    if top_k and 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the
        # most likely token is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


@torch.no_grad()
def _decode_loop(
    model,
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float | None,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """KV-cached decoding of left-padded ``rows``; ``temperature=None`` means greedy.

    Returns per row the completion tokens (cut after the first EOS) and, when sampling,
    log_softmax(logits / temperature) at each chosen token over the full vocabulary.
    """
    device = next(model.parameters()).device
    B = len(rows)
    Lp = max(len(r) for r in rows)
    input_ids = torch.full((B, Lp), pad_id, dtype=torch.long)
    attn = torch.zeros((B, Lp), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, Lp - len(r) :] = torch.tensor(r, dtype=torch.long)
        attn[i, Lp - len(r) :] = 1
    # Positions count real tokens only, so row i's first real token is position 0,
    # exactly as in the learner's right-padded forward pass.
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    input_ids, attn, position_ids = input_ids.to(device), attn.to(device), position_ids.to(device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)

    out = model(
        input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    next_pos = position_ids[:, -1:] + 1

    done = torch.zeros(B, dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        if temperature is None:
            tok = logits.argmax(dim=-1)
            lp = torch.zeros(B, device=device)
        else:
            scaled = logits / temperature
            full_logp = torch.log_softmax(scaled, dim=-1)
            pick = _filter_logits(scaled, top_k, top_p).softmax(dim=-1)
            tok = torch.multinomial(pick, 1, generator=generator).squeeze(-1)
            lp = full_logp.gather(-1, tok[:, None]).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(lp)
        done = done | torch.isin(tok, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        next_pos = next_pos + 1

    tok_mat = torch.stack(tokens, dim=1).cpu().tolist()
    lp_mat = torch.stack(logps, dim=1).cpu().tolist()
    eos_set = set(int(e) for e in eos_ids)
    completions, completion_logps = [], []
    for toks, lps in zip(tok_mat, lp_mat):
        n = len(toks)
        for k, t in enumerate(toks):
            if t in eos_set:
                n = k + 1
                break
        completions.append(toks[:n])
        completion_logps.append(lps[:n])
    return completions, completion_logps


def _decode_in_chunks(model, tokenizer, rows: list[list[int]], chunk: int, **decode) -> tuple[list, list]:
    """`_decode_loop` over `rows`, at most `chunk` rows at a time (bounds the KV cache);
    returns (completions, log-probs) in row order."""
    eos_ids, pad_id = _eos_ids(model, tokenizer), _pad_id(tokenizer)
    completions: list[list[int]] = []
    logps: list[list[float]] = []
    for start in range(0, len(rows), chunk):
        c, lp = _decode_loop(model, rows[start : start + chunk], eos_ids=eos_ids, pad_id=pad_id, **decode)
        completions += c
        logps += lp
    return completions, logps


def _encode_prompts(tokenizer, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Token ids of each prompt: a string is encoded (with the tokenizer's BOS), a list of ids is kept."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
    ids = [list(next(encoded)) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for p, r in zip(prompts, ids):
        if not r:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
    return ids


def sample_groups(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    group_size: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int,
    seed: int,
    max_batch_rows: int = 4096,
) -> list[SampledGroup]:
    """Sample ``group_size`` completions for each prompt, all prompts batched together.

    A prompt is text (encoded with the tokenizer's BOS) or a list of token ids (kept).
    ``top_k=0`` and ``top_p=1.0`` disable truncation. Truncation only changes which
    token is picked; the recorded log-prob is always the full-vocabulary
    log_softmax(logits / temperature) at the picked token. Tokens after EOS are not
    part of a completion. Deterministic for a given ``seed`` (a private generator is
    used; the global RNG is untouched).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy_completions for greedy), got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    prompt_ids = _encode_prompts(tokenizer, prompts)
    rows = [p for p in prompt_ids for _ in range(group_size)]
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    chunk = max(group_size, (max_batch_rows // group_size) * group_size)  # whole groups per chunk
    comps, lps = _decode_in_chunks(model, tokenizer, rows, chunk, max_new_tokens=max_new_tokens,
                                   temperature=float(temperature), top_p=top_p, top_k=top_k, generator=gen)
    return [
        SampledGroup(
            prompt_ids=prompt_ids[i],
            completion_ids=comps[i * group_size : (i + 1) * group_size],
            sampler_logps=lps[i * group_size : (i + 1) * group_size],
        )
        for i in range(len(prompts))
    ]


def greedy_completions(
    model, tokenizer, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int, max_batch_rows: int = 4096
) -> list[list[int]]:
    """Greedy (argmax) completion tokens for each prompt, batched."""
    completions, _ = _decode_in_chunks(model, tokenizer, _encode_prompts(tokenizer, prompts), max_batch_rows,
                                       max_new_tokens=max_new_tokens, temperature=None)
    return completions


# ----------------------------------------------------------------------------------
# Learner-side log-probs
# ----------------------------------------------------------------------------------
LOGITS_CHUNK_BYTES = 64 << 20
"""Float32 logits computed at once: completion positions go through the LM head this many
bytes' worth at a time (with a 151,936-token vocabulary, 110 positions)."""


def logits_chunk_tokens(model) -> int:
    """Completion positions per LM-head chunk (LOGITS_CHUNK_BYTES of float32 logits)."""
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or model.config.vocab_size  # (a ZeRO-3 weight is a stub)
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def completion_logprobs(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float,
    *,
    chunk_tokens: int | None = None,
    n_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt, with gradient.

    Returns ``(logps [B, T], mask [B, T])`` with T the longest completion;
    ``logps[b, t] = log_softmax(logits / temperature)[completion_ids[b][t]]`` over the
    full vocabulary (the sampler's rule), 0 where ``mask`` is 0. Rows are right-padded
    with positions counted from each row's first token, matching the sampler.

    No [B, L, vocabulary] tensor is made: the decoder's hidden states are taken at the
    positions that predict a completion token only, and go through the LM head
    ``chunk_tokens`` positions at a time (default: LOGITS_CHUNK_BYTES of float32 logits),
    or in exactly ``n_chunks`` chunks (some may be empty: ranks of a ZeRO-3 learner must
    call the head as often as each other).
    With gradients on and more than one chunk, each chunk is recomputed in the backward
    pass (activation checkpointing), so at most one chunk's logits exist at a time.
    Models whose causal-LM head does more than a linear layer (logit soft-capping or
    scaling) are refused with ValueError.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B = len(prompt_ids)
    if B == 0:
        raise ValueError("empty batch")
    head = model.get_output_embeddings()
    for option in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(model.config, option, None) not in (None, 1, 1.0):
            raise ValueError(f"model config sets {option}: its LM head is more than a linear layer, which the "
                             "learner's chunked log-probs do not reproduce")
    device = head.weight.device
    P = [len(p) for p in prompt_ids]
    C = [len(c) for c in completion_ids]
    if min(P) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(C)
    if T == 0:
        raise ValueError("every completion is empty")
    L = max(p + c for p, c in zip(P, C))
    # The last completion token is never fed as input, so L - 1 input positions suffice.
    L_in = max(L - 1, max(P))
    pad = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)  # never seen by a real position (below)
    seqs = [(list(prompt_ids[b]) + list(completion_ids[b]))[:L_in] for b in range(B)]
    input_ids = torch.tensor([seq + [pad] * (L_in - len(seq)) for seq in seqs], dtype=torch.long)
    mask = torch.tensor([[1.0] * c + [0.0] * (T - c) for c in C], dtype=torch.float32)
    rows, positions, targets = [], [], []
    for b in range(B):
        rows += [b] * C[b]
        positions += range(P[b] - 1, P[b] - 1 + C[b])  # position k predicts token k + 1
        targets += completion_ids[b]
    # Neither an attention mask nor position ids: rows are right-padded, so under causal
    # attention no real position sees a pad (a row's pads change hidden states at pad
    # positions only, which are never read), and every row starts at position 0, the
    # model's default. So the model's causal fast path applies, with no check of the
    # position ids for packed sequences (a device-to-host sync in transformers).
    hidden = model.base_model(input_ids=input_ids.to(device), use_cache=False).last_hidden_state
    selected = hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]  # [N, H]
    targets = torch.tensor(targets, dtype=torch.long, device=device)
    if n_chunks is None:
        n_chunks = -(-len(targets) // (chunk_tokens or logits_chunk_tokens(model)))
    checkpointed = torch.is_grad_enabled() and n_chunks > 1

    def token_logps(h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits = head(h).float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)

    flat = torch.cat([
        torch.utils.checkpoint.checkpoint(token_logps, h, t, use_reentrant=False) if checkpointed
        else token_logps(h, t)
        for h, t in zip(selected.tensor_split(n_chunks), targets.tensor_split(n_chunks))])
    mask = mask.to(device)
    logps = torch.zeros((B, T), dtype=flat.dtype, device=device).masked_scatter(mask.bool(), flat)
    return logps, mask


# ----------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_policy(
    model,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    *,
    n_samples: int,
    temperature: float,
    greedy: bool = True,
    max_new_tokens: int,
    seed: int,
    top_p: float = 1.0,
    top_k: int = 0,
) -> dict[str, float]:
    """Held-out accuracy, batched.

    ``accuracy_sampled``: mean reward over ``n_samples`` samples per problem at
    ``temperature`` (the training temperature); ``accuracy_greedy``: mean reward of the
    argmax completion (only when ``greedy``; otherwise NaN). Also reports the mean
    sampled completion length and the fraction truncated without EOS.
    """
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        prompts = [task.encode_prompt(p, tokenizer) for p in problems]
        eos_ids = _eos_ids(model, tokenizer)
        result: dict[str, float] = {"n_problems": float(len(problems)), "n_samples": float(n_samples)}
        if n_samples > 0:
            groups = sample_groups(
                model,
                tokenizer,
                prompts,
                group_size=n_samples,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=max_new_tokens,
                seed=seed,
            )
            rewards, lengths, truncated = [], [], []
            for prob, g in zip(problems, groups):
                for c in g.completion_ids:
                    rewards.append(task.reward(prob, decode_completion(tokenizer, c, eos_ids)))
                    lengths.append(len(c))
                    truncated.append(not c or c[-1] not in eos_ids)
            result["accuracy_sampled"] = sum(rewards) / len(rewards)
            result["mean_completion_tokens"] = sum(lengths) / len(lengths)
            result["truncated_fraction"] = sum(truncated) / len(truncated)
        else:
            result["accuracy_sampled"] = math.nan
        if greedy:
            comps = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
            result["accuracy_greedy"] = sum(
                task.reward(p, decode_completion(tokenizer, c, eos_ids)) for p, c in zip(problems, comps)
            ) / max(1, len(problems))
        else:
            result["accuracy_greedy"] = math.nan
        result["eval_seconds"] = time.perf_counter() - t0
        return result
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------
# Supervised warm-up and the cached base model
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaseModelSettings:
    """Everything that determines the warmed-up base model (all of it goes into the cache key)."""

    task: str = "arithmetic"
    task_settings: Mapping[str, Any] = field(default_factory=lambda: {"digits": 2, "ops": "+"})
    size: ModelSize = ModelSize()
    warmup_steps: int = 2000  # upper bound on supervised steps (about 75 s on one core)
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3
    # Stop the warm-up once sampled accuracy on train problems reaches this (None: run
    # all warmup_steps). Keeps the start of RL low but non-zero whatever the seed.
    warmup_target_accuracy: float | None = 0.25
    warmup_check_every: int = 25
    # Label smoothing keeps the base model's sampling distribution wide: it reaches the
    # target sampled accuracy while its greedy accuracy is already higher, so RL has a
    # strong, reliable signal to sharpen (docs/task_and_model.md, feasibility).
    warmup_label_smoothing: float = 0.2
    seed: int = 0

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "BaseModelSettings":
        m = dict(m)
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(m) - allowed)
        if unknown:
            raise ValueError(f"unknown base-model setting(s) {unknown}; allowed: {sorted(allowed)}")
        if isinstance(m.get("size"), Mapping):
            m["size"] = ModelSize(**m["size"])
        return cls(**m)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["task_settings"] = dict(self.task_settings)
        return d

    def cache_key(self) -> str:
        blob = json.dumps({"format": 1, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _target(problem: Problem) -> str:
    """What the warm-up teaches for `problem`: its worked solution, else its answer."""
    return problem.solution if problem.solution is not None else problem.answer


def _supervised_batch(tokenizer, task: Task, problems: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt (as the task encodes it) + target + eos; labels only on target+eos
    tokens. The target is the problem's worked solution when it has one, else its answer."""
    prompt_ids = [task.encode_prompt(p, tokenizer) for p in problems]
    answer_ids = tokenizer([_target(p) for p in problems], add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, _pad_id(tokenizer)
    seqs = [pi + ai + [eos] for pi, ai in zip(prompt_ids, answer_ids)]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, pi) in enumerate(zip(seqs, prompt_ids)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, len(pi) : len(s)] = torch.tensor(s[len(pi) :])
    return ids, attn, labels


def warmup_supervised(
    model,
    tokenizer,
    task: Task,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    start_index: int = 0,
    target_accuracy: float | None = None,
    check_every: int = 25,
    check_problems: int = 256,
    check_temperature: float = 1.0,
    label_smoothing: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Teacher-forced cross-entropy on the answer+EOS tokens of train problems.

    Batch k uses train problems ``start_index + k*batch_size ...``. With
    ``target_accuracy``, every ``check_every`` steps the model samples one completion
    (at ``check_temperature``) for ``check_problems`` other train problems, and the
    warm-up stops as soon as that accuracy reaches the target (at most ``steps`` steps).
    Stopping on a target rather than a fixed step count matters because small models
    learn addition through a sharp, seed-dependent phase transition. The held-out split
    is never looked at. Returns losses, checks and the number of steps taken.
    """
    check = []
    if target_accuracy is not None:
        check = [task.train_problem(start_index + 10**12 + k) for k in range(check_problems)]
        answer_tokens = max(len(tokenizer(_target(p), add_special_tokens=False)["input_ids"]) for p in check)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    losses: list[float] = []
    checks: list[tuple[int, float]] = []
    taken = 0
    for step in range(steps + 1):
        if check and step % check_every == 0:
            acc = evaluate_policy(
                model, tokenizer, task, check, n_samples=1, temperature=check_temperature, greedy=False,
                max_new_tokens=answer_tokens + 1, seed=seed + step,
            )["accuracy_sampled"]
            checks.append((step, acc))
            log.info("warm-up step %d/%d: sampled accuracy on train problems %.3f (stops at %.2f)",
                     step, steps, acc, target_accuracy)
            if acc >= target_accuracy:
                break
        if step == steps:
            break
        model.train()
        base = start_index + step * batch_size
        problems = [task.train_problem(base + k) for k in range(batch_size)]
        ids, attn, labels = _supervised_batch(tokenizer, task, problems)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), label_smoothing=label_smoothing
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        taken = step + 1
    model.eval()
    return {"losses": losses, "checks": checks, "steps": taken}


def ensure_base_model(cache_dir: str | os.PathLike, settings: BaseModelSettings | Mapping[str, Any] | None = None) -> Path:
    """Path of the warmed-up tiny base model for ``settings``, building it on first use.

    The directory ``cache_dir/base-<sha256 of settings>`` holds config.json,
    model.safetensors, the tokenizer files and heterorl_base.json (settings, warm-up
    losses, seconds). It is built in a temporary sibling directory and renamed into
    place, so readers never see a partial model and concurrent builders are safe (the
    loser discards its copy). A second call returns the existing path immediately.
    """
    if settings is None:
        settings = BaseModelSettings()
    elif not isinstance(settings, BaseModelSettings):
        settings = BaseModelSettings.from_mapping(settings)
    cache_dir = Path(cache_dir)
    task = make_task(settings.task, **dict(settings.task_settings))
    data = {k: v for k, v in getattr(task, "settings", dict)().items() if k.endswith("sha256")}
    # A task read from a file: the data's hashes are part of the key (new data, new model).
    key = settings.cache_key() if not data else hashlib.sha256(
        json.dumps([settings.cache_key(), data], sort_keys=True).encode()).hexdigest()[:16]
    final = cache_dir / f"base-{key}"
    if (final / BASE_MODEL_INFO).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer, settings.size, seed=settings.seed)
        with _seeded(settings.seed):
            report = warmup_supervised(
                model,
                tokenizer,
                task,
                steps=settings.warmup_steps,
                batch_size=settings.warmup_batch_size,
                lr=settings.warmup_lr,
                # Far from the indices an RL run starts at, so RL begins on unseen problems.
                start_index=1_000_000_000,
                target_accuracy=settings.warmup_target_accuracy,
                check_every=settings.warmup_check_every,
                label_smoothing=settings.warmup_label_smoothing,
                seed=settings.seed,
            )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info = {
            "settings": settings.to_dict(),
            "cache_key": key,
            "warmup_seconds": round(time.perf_counter() - t0, 3),
            "warmup_steps_taken": report["steps"],
            "warmup_final_loss": report["losses"][-1] if report["losses"] else None,
            "warmup_checks": report["checks"],
            "created_unix": time.time(),
        }
        (tmp / BASE_MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the target exists and is not empty).
            if not (final / BASE_MODEL_INFO).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
