"""The built-in tiny model (`model.base: builtin:tiny`): a character-level tokenizer made
locally, a small Llama-architecture causal LM, and its supervised warm-up on the task,
cached in `<data_dir>/models/base-<key>`.

It exists so that the whole loop runs in seconds on one CPU core with no download.
Real models never pass through this module (`pipeline.models.sources`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.models.cache import build_once
from pipeline.models.evaluation import evaluate_policy
from pipeline.models.policy import pad_id
from pipeline.tasks import Problem, Task, make_task

__all__ = [
    "CHARS",
    "SPECIAL_TOKENS",
    "BaseModelSettings",
    "ModelSize",
    "build_tiny_model",
    "build_tokenizer",
    "ensure_base_model",
    "warmup_supervised",
]

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Every character the built-in tasks use; anything else maps to <unk>.
CHARS: str = "0123456789+-*=() "



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
    eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
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
    losses, seconds), built once by `pipeline.models.cache.build_once`; a second call
    returns the existing path immediately.
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

    def build(tmp: Path) -> dict[str, Any]:
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
        return {
            "source": "builtin:tiny",
            "settings": settings.to_dict(),
            "cache_key": key,
            "warmup_steps_taken": report["steps"],
            "warmup_final_loss": report["losses"][-1] if report["losses"] else None,
            "warmup_checks": report["checks"],
        }

    return build_once(final, build)
