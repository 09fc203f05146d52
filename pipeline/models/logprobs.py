"""The learner's per-token log-probs of completions, with gradient (the sampler's rule,
`pipeline.models.decoding`), computed without a batch × length × vocabulary tensor."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.utils.checkpoint

__all__ = ["LOGITS_CHUNK_BYTES", "completion_logprobs", "logits_chunk_tokens", "nonlinear_head_option"]

_HEAD_OPTIONS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


def nonlinear_head_option(config) -> str | None:
    """Why this model's LM head is more than a linear layer (logit soft-capping or scaling),
    which the chunked log-probs below do not reproduce; None when it is linear."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for option in _HEAD_OPTIONS:
        value = getattr(text_config, option, None)
        if value not in (None, 1, 1.0):
            return (f"model config sets {option}={value}: its LM head is more than a linear layer, which the "
                    "learner's chunked log-probs do not reproduce")
    return None


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

    Rows with the same prompt (a prompt group's G completions) share one pass over it
    (`_shared_prompt_hidden`): the decoder runs once over the distinct prompts and once over
    the completions, which attend to their prompt's keys and values. With a 47-token chat
    prompt and 16-token completions in groups of 8 that is a third of the positions of one
    pass over whole rows, and the log-probs agree with it to float rounding
    (tests/unit/test_logprobs.py). Under gradient checkpointing (which cannot keep keys and
    values between passes) every row is run whole.
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
    problem = nonlinear_head_option(model.config)
    if problem:
        raise ValueError(problem)
    device = head.weight.device
    P = [len(p) for p in prompt_ids]
    C = [len(c) for c in completion_ids]
    if min(P) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(C)
    if T == 0:
        raise ValueError("every completion is empty")
    mask = torch.tensor([[1.0] * c + [0.0] * (T - c) for c in C], dtype=torch.float32)
    if _shares_prompts(model):
        selected = _shared_prompt_hidden(model, prompt_ids, completion_ids, device)
    else:
        selected = _whole_row_hidden(model, prompt_ids, completion_ids, device)
    targets = [t for c in completion_ids for t in c]
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


def _shares_prompts(model) -> bool:
    """Whether the prompt pass's keys and values can be reused by the completion pass:
    always, except under gradient checkpointing while training (transformers then drops
    any cache). The choice depends on the model alone, so every rank of a ZeRO-3 learner
    makes the same passes."""
    return not (getattr(model, "is_gradient_checkpointing", False) and model.training)


def _whole_row_hidden(model, prompt_ids, completion_ids, device) -> torch.Tensor:
    """[N, H] hidden states predicting each completion token (row by row, token by token),
    from one pass over whole rows, prompt and completion."""
    P = [len(p) for p in prompt_ids]
    C = [len(c) for c in completion_ids]
    L = max(p + c for p, c in zip(P, C))
    # The last completion token is never fed as input, so L - 1 input positions suffice.
    L_in = max(L - 1, max(P))
    pad = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)  # never seen by a real position (below)
    seqs = [(list(p) + list(c))[:L_in] for p, c in zip(prompt_ids, completion_ids)]
    input_ids = torch.tensor([seq + [pad] * (L_in - len(seq)) for seq in seqs], dtype=torch.long)
    rows, positions = [], []
    for b in range(len(prompt_ids)):
        rows += [b] * C[b]
        positions += range(P[b] - 1, P[b] - 1 + C[b])  # position k predicts token k + 1
    # Neither an attention mask nor position ids: rows are right-padded, so under causal
    # attention no real position sees a pad (a row's pads change hidden states at pad
    # positions only, which are never read), and every row starts at position 0, the
    # model's default. So the model's causal fast path applies, with no check of the
    # position ids for packed sequences (a device-to-host sync in transformers).
    hidden = model.base_model(input_ids=input_ids.to(device), use_cache=False).last_hidden_state
    return hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]


def _shared_prompt_hidden(model, prompt_ids, completion_ids, device) -> torch.Tensor:
    """What `_whole_row_hidden` returns, from two passes that share each distinct prompt.

    1. The distinct prompts, left-padded (positions counted from each one's first token, as
       the sampler does): their keys and values, and the last position's hidden state, which
       predicts every completion's first token.
    2. Each row's completion but its last token, right-padded, attending to its prompt's
       keys and values (gathered per row, so the gradient flows back into the one prompt
       pass) at positions that continue the prompt's. A row of one token still feeds that
       token, so both passes always run (ranks of a ZeRO-3 learner run as many as each other).
    """
    pad = int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)
    distinct: dict[tuple[int, ...], int] = {}
    prefix_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]
    width = max(len(p) for p in distinct)
    prompts = torch.full((len(distinct), width), pad, dtype=torch.long)
    attention = torch.zeros((len(distinct), width), dtype=torch.long)
    for u, p in enumerate(distinct):
        prompts[u, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[u, width - len(p):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model.base_model(input_ids=prompts.to(device), attention_mask=attention.to(device),
                           position_ids=positions.to(device), use_cache=True)
    rows = torch.tensor(prefix_of, device=device)
    first = out.last_hidden_state[:, -1][rows]  # [B, H]: predicts each row's first completion token
    cache = out.past_key_values
    cache.batch_select_indices(rows)  # row b reads its prompt's keys and values (a gather: gradients add up)

    C = [len(c) for c in completion_ids]
    fed = max(1, max(C) - 1)
    inputs = torch.full((len(completion_ids), fed), pad, dtype=torch.long)
    for b, c in enumerate(completion_ids):
        head = list(c[: max(1, len(c) - 1)])
        inputs[b, : len(head)] = torch.tensor(head, dtype=torch.long)
    # Right-padded completions need no mask of their own: under causal attention no real
    # position sees a later pad.
    attention = torch.cat([attention[prefix_of], torch.ones((len(completion_ids), fed), dtype=torch.long)], dim=1)
    continued = positions[prefix_of, -1:] + 1 + torch.arange(fed)[None]
    later = model.base_model(input_ids=inputs.to(device), attention_mask=attention.to(device),
                             position_ids=continued.to(device), past_key_values=cache,
                             use_cache=True).last_hidden_state  # [B, fed, H]
    hidden = torch.cat([first[:, None], later], dim=1)  # [B, fed + 1, H]: position t predicts token t
    index = torch.tensor([[b, t] for b in range(len(C)) for t in range(C[b])], device=device)
    return hidden[index[:, 0], index[:, 1]]
