"""Models: where a base model comes from, and what every role does with a policy.

- `sources`: `model.base` resolved to a local model directory (a built-in name, a GGUF
  file converted once, a Hub id downloaded once, your own directory); `cache`: the model
  cache those conversions (and the tiny model) live in;
- `policy`: loading a directory (safetensors only), its EOS and pad ids, completion text;
- `decoding`: the `hf` backend's decoding loop, recording the learner's log-prob rule;
- `logprobs`: the learner's chunked per-token log-probs, with gradient;
- `evaluation`: held-out accuracy, sampled and greedy;
- `tiny`: the built-in tiny model, its tokenizer and its supervised warm-up (`builtin:tiny`).

The names below are the public face; import them from here.
"""

from pipeline.models.evaluation import evaluate_policy
from pipeline.models.logprobs import completion_logprobs, logits_chunk_tokens
from pipeline.models.policy import (DTYPES, attention_kernel, decode_completion, eos_ids, generation_eos_ids, load_policy, load_tokenizer,
                                    load_weights_into, pad_id, tokenizer_fingerprint)
from pipeline.models.decoding import SampledGroup, greedy_completions, sample_groups
from pipeline.models.sources import BUILTIN_MODELS, TINY, ModelSourceError, resolve_model

__all__ = [
    "BUILTIN_MODELS",
    "DTYPES",
    "TINY",
    "attention_kernel",
    "ModelSourceError",
    "SampledGroup",
    "completion_logprobs",
    "decode_completion",
    "eos_ids",
    "evaluate_policy",
    "generation_eos_ids",
    "greedy_completions",
    "load_policy",
    "load_tokenizer",
    "load_weights_into",
    "logits_chunk_tokens",
    "pad_id",
    "resolve_model",
    "sample_groups",
    "tokenizer_fingerprint",
]
