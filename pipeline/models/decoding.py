"""Sampling from a policy: the `hf` backend's KV-cached decoding loop, and greedy decoding.

The log-prob rule, the same as the learner's (`pipeline.models.logprobs`; docs/generation.md):

    logp(token) = log_softmax(logits / temperature)[token]

over the FULL vocabulary, i.e. before any top-k / top-p truncation, at the sampled token.
Positions are counted from the first real (non-pad) token of each row, so a left-padded
batch here and the learner's right-padded batch see the same positions and agree to float
rounding (about 1e-6 in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pipeline.models.policy import eos_ids, pad_id

__all__ = ["MAX_BATCH_ROWS", "SampledGroup", "greedy_completions", "sample_groups"]

MAX_BATCH_ROWS = 512
"""Rows decoded together at most (the rest wait for the next chunk). It bounds the KV cache:
the evaluator of `--config smollm2` (400 problems x 4 samples) peaked at 5.4 GB resident
decoding all 1,600 rows as one batch, and at 2.8 GB in chunks of 512, its evaluations
taking about as long (199-377 s against 198-235 s, in two training runs on a 2-core CPU)."""


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


def _draw(scaled: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from softmax(scaled) truncated to top-k, then to the top-p nucleus.

    With top-k on, only the k largest logits are ranked and drawn from (a [B, k] problem,
    not [B, vocabulary]: the sort and the draw over the whole vocabulary took an eighth of
    SmolLM2's sampling time on a CPU). The distribution is `_filter_logits`' but for ties
    at the k-th largest logit, of which this keeps exactly k."""
    if top_k and 0 < top_k < scaled.shape[-1]:
        kept, index = torch.topk(scaled, top_k, dim=-1)  # sorted, largest first
        if top_p < 1.0:
            probs = kept.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs >= top_p
            drop[..., 0] = False
            kept = kept.masked_fill(drop, float("-inf"))
        choice = torch.multinomial(kept.softmax(dim=-1), 1, generator=generator)
        return index.gather(-1, choice).squeeze(-1)
    return torch.multinomial(_filter_logits(scaled, top_k, top_p).softmax(dim=-1), 1, generator=generator).squeeze(-1)


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
    repeats: int = 1,
    pause: Callable[[], None] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """KV-cached decoding of left-padded ``rows``, each ``repeats`` times; ``temperature=None``
    means greedy.

    Each prompt is read once (the prefill), then its keys, values and last logits are
    repeated for its ``repeats`` completions: a group's G samples share one pass over their
    prompt. Returns per decoded row (row i's copies at i·repeats ... (i+1)·repeats - 1) the
    completion tokens (cut after the first EOS) and, when sampling,
    log_softmax(logits / temperature) at each chosen token over the full vocabulary.
    `pause`, if given, is called before the prefill and each token's forward pass (it may
    block: a sampler yielding its cores to a learner on the same machine).
    """
    device = next(model.parameters()).device
    B = len(rows)
    input_ids, attn, position_ids = _left_padded(rows, pad_id, device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)

    if pause is not None:
        pause()
    out = model(
        input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1
    )
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    next_pos = position_ids[:, -1:] + 1
    if repeats > 1:
        cache.batch_repeat_interleave(repeats)
        logits, attn, next_pos = (x.repeat_interleave(repeats, dim=0) for x in (logits, attn, next_pos))
        B *= repeats

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
            tok = _draw(scaled, top_k, top_p, generator)
            lp = full_logp.gather(-1, tok[:, None]).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        logps.append(lp)
        done = done | torch.isin(tok, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        if pause is not None:
            pause()
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

    return _cut_after_eos(torch.stack(tokens, dim=1).cpu().tolist(), torch.stack(logps, dim=1).cpu().tolist(),
                          eos_ids)


def _left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and position ids of ``rows`` left-padded to one length, on ``device``."""
    B, Lp = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, Lp), pad_id, dtype=torch.long)
    attn = torch.zeros((B, Lp), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, Lp - len(r) :] = torch.tensor(r, dtype=torch.long)
        attn[i, Lp - len(r) :] = 1
    # Positions count real tokens only, so row i's first real token is position 0,
    # exactly as in the learner's right-padded forward pass.
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), attn.to(device), position_ids.to(device)


def _cut_after_eos(tok_mat: list[list[int]], lp_mat: list[list[float]],
                   eos_ids: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Each decoded row's tokens and log-probs up to and including its first EOS."""
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


def _decode_in_chunks(model, tokenizer, rows: list[list[int]], chunk: int, repeats: int = 1,
                      progress: Callable[[float], None] | None = None, **decode) -> tuple[list, list]:
    """`_decode_loop` over `rows`, each `repeats` times, at most `chunk` decoded rows at a time
    (bounds the KV cache); returns (completions, log-probs) in row order, a row's copies together.
    `progress`, if given, is told after each forward pass how many completions' worth of
    decoding it did (a chunk's rows spread evenly over its prefill and steps, the rest when the
    chunk ends), so its sum is len(rows) * repeats."""
    eos, pad = eos_ids(model, tokenizer), pad_id(tokenizer)
    completions: list[list[int]] = []
    logps: list[list[float]] = []
    per_chunk = max(1, chunk // repeats)
    pause = decode.pop("pause", None)
    for start in range(0, len(rows), per_chunk):
        part = rows[start : start + per_chunk]
        total, reported, passes = len(part) * repeats, 0.0, 0
        share = total / (decode["max_new_tokens"] + 1)  # a chunk is a prefill and up to max_new_tokens steps

        def before_pass():
            nonlocal reported, passes
            if pause is not None:
                pause()
            if progress is not None and passes:  # the pass before this one is done
                progress(share)
                reported += share
            passes += 1
        c, lp = _decode_loop(model, part, eos_ids=eos, pad_id=pad, repeats=repeats,
                             pause=before_pass if (pause is not None or progress is not None) else None, **decode)
        if progress is not None:  # the last pass, and the steps an early end made unnecessary
            progress(total - reported)
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
    max_batch_rows: int = MAX_BATCH_ROWS,
    pause: Callable[[], None] | None = None,
    progress: Callable[[float], None] | None = None,
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
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    comps, lps = _decode_in_chunks(model, tokenizer, prompt_ids, max_batch_rows, repeats=group_size,
                                   max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=top_p,
                                   top_k=top_k, generator=gen, pause=pause, progress=progress)
    return [
        SampledGroup(
            prompt_ids=prompt_ids[i],
            completion_ids=comps[i * group_size : (i + 1) * group_size],
            sampler_logps=lps[i * group_size : (i + 1) * group_size],
        )
        for i in range(len(prompts))
    ]


def greedy_completions(
    model, tokenizer, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int, max_batch_rows: int = MAX_BATCH_ROWS,
    progress: Callable[[float], None] | None = None,
) -> list[list[int]]:
    """Greedy (argmax) completion tokens for each prompt, batched."""
    completions, _ = _decode_in_chunks(model, tokenizer, _encode_prompts(tokenizer, prompts), max_batch_rows,
                                       max_new_tokens=max_new_tokens, temperature=None, progress=progress)
    return completions
