"""A policy as the roles hold it: a `transformers` causal LM and its tokenizer, loaded from a
local directory, with the token ids that end and pad its completions.

Only safetensors weights are read (no pickle is ever unpickled); the tokenizer is
tokenizer.json. Any directory `pipeline.models.sources.resolve_model` returns works here:
the built-in tiny model, a converted GGUF file, a saved Hub model, your own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

__all__ = [
    "ATTENTION_KERNELS",
    "attention_kernel",
    "load_weights_into",
    "DTYPES",
    "decode_completion",
    "eos_ids",
    "generation_eos_ids",
    "load_policy",
    "load_tokenizer",
    "pad_id",
    "tokenizer_fingerprint",
]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The precisions a config names (`sampler.precision`, `learner.precision`) as torch dtypes."""


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a local HF model directory; one without a pad token gets its EOS token as pad."""
    tokenizer = AutoTokenizer.from_pretrained(Path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


ATTENTION_KERNELS = ("auto", "eager", "sdpa")
"""The values of `model.attention`: transformers' attention implementations the product runs."""


def attention_kernel(dtype: torch.dtype, setting: str = "auto") -> str:
    """The attention implementation a model computing in `dtype` runs (`model.attention`).

    `auto`: `eager` in half precision, `sdpa` in fp32. In bf16, `sdpa`'s fused kernel gives a
    sampler's cached one-token steps and the learner's pass over whole completions different
    bits from the first layer on (SmolLM2-135M: on-policy KL 2.8e-3, one token in nine off by
    more than 0.1), while `eager` computes both the same way and they agree exactly; in fp32
    both kernels agree to 1e-7, and `sdpa` holds no sequence x sequence matrix per head."""
    if setting not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_KERNELS)}, got {setting!r}")
    if setting != "auto":
        return setting
    return "sdpa" if dtype == torch.float32 else "eager"


def load_policy(path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                attention: str = "auto"):
    """Load any local HF causal-LM directory: (model in `dtype` eval mode on `device`, tokenizer).

    `attention`: `model.attention` as `attention_kernel` reads it for `dtype` (a learner that
    loads in fp32 to train in bf16 names the kernel of its training precision instead).
    Only safetensors weights are accepted (``use_safetensors=True``: no pickle is ever
    unpickled). A tokenizer without a pad token gets its EOS token as pad.
    """
    path = Path(path)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                 attn_implementation=attention_kernel(dtype, attention))
    model.to(device).eval()
    return model, tokenizer


def load_weights_into(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a state dict (by parameter name, in any float dtype) into `model` in place. A name
    the tensors lack must be a parameter tied to one they have (tied embeddings are stored
    once); anything else missing or extra is a ValueError, and `model` is then not to be used."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    untied = [m for m in missing if not any(params.get(m) is params.get(n) for n in tensors)]
    if untied or unexpected:
        raise ValueError(f"the weights do not fit the model (missing {untied[:3]}, unexpected {unexpected[:3]})")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map and special tokens: equal iff ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS, then any other EOS of the model's generation config."""
    return _merge_eos(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def generation_eos_ids(model_dir: str | os.PathLike, tokenizer) -> list[int]:
    """`eos_ids` for a model directory that is not loaded (generation_config.json read as JSON)."""
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


def pad_id(tokenizer) -> int:
    """The id that fills a batch's empty places: the tokenizer's pad token, else its EOS.

    A pad id equal to EOS (SmolLM2's GGUF sets it so) is harmless here: completions are
    lists of their own tokens, cut after their first EOS, never recovered from a padded
    tensor by looking for pads."""
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
