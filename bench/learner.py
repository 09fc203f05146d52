"""The learner's optimizer step against a plain-PyTorch step: tokens/s and peak memory.

    python bench/learner.py --shape tiny|20m|smollm2|qwen2-0.5b [--groups N] [--group-size G]
        [--prompt-tokens P] [--completion-tokens C] [--precision fp32|bf16]
        [--gradient-checkpointing | --no-gradient-checkpointing] [--micro-batch-tokens T]
        [--zero-stage S] [--steps K] [--rounds R] [--device auto|cpu|cuda]

Both sides start from the same model (random init, seeded; `smollm2`: the real
SmolLM2-135M-Instruct of `model.base: smollm2-135m-instruct`) and train on the same batch:
`groups` prompt groups of `group-size` sequences of P prompt + C completion tokens, with
random rewards and sampler log-probs near the model's (about log 1/vocabulary).

- product: `pipeline.learning.update.optimizer_step` on a DeepSpeed engine from
  `pipeline.learning.engine.make_deepspeed_engine` with the same settings the learner reads from
  `learner.*` (loss grpo, so both sides compute the same objective);
- reference: what one would write by hand in plain PyTorch: `torch.optim.AdamW`, the same
  micro-batches (rows of equal length, as many as fit the token budget), `torch.autocast`
  for bf16, the same gradient checkpointing, the log-softmax on the hidden states at
  completion positions in checkpointed chunks, the GRPO token-clipped surrogate.

Each side runs in its own fresh process (so neither inherits the other's allocator
state or peak), one warm-up step then `--steps` timed steps; `--rounds` alternates them.
Tokens/s counts every position of every sequence (prompt + completion) per second of
optimizer step. Peak memory is `torch.cuda.max_memory_allocated` on a GPU and the
process's peak resident set (`ru_maxrss`, the Python runtime included) on the CPU.

Targets (issue 11): product >= 0.9x the reference's tokens/s; on a GPU at the qwen2-0.5b
shape, 32 groups x 8 x (256 + 768) tokens, peak memory <= 40 GiB. Exit status 1 if a
target is missed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (model config, default batch: groups, group size, prompt tokens, completion tokens)
SHAPES = {
    "tiny": ("the built-in demo model (Llama, hidden 64, 4 layers, ~40-token vocabulary)", (64, 8, 12, 6)),
    "20m": ("Qwen2 architecture, hidden 320, 6 layers, vocabulary 32,000 (~19M parameters)", (16, 8, 64, 192)),
    "smollm2": ("SmolLM2-135M-Instruct, the real model (Llama, 30 layers, vocabulary 49,152); the smollm2 "
                "config's step: 8 groups of 8, 48-token chat prompts, 16 new tokens", (8, 8, 48, 16)),
    "qwen2-0.5b": ("Qwen2-0.5B's shape, random init (494M parameters, vocabulary 151,936)", (32, 8, 256, 768)),
}
GPU_MEMORY_TARGET_GIB = 40.0
SPEED_TARGET = 0.9


def build_model(shape: str, precision: str):
    """The shape's model in fp32, with the attention kernel the learner runs in `precision`
    (`model.attention: auto`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.models import DTYPES, attention_kernel, load_policy, resolve_model
    from pipeline.models.tiny import build_tiny_model, build_tokenizer

    torch.manual_seed(0)
    kernel = attention_kernel(DTYPES[precision])
    if shape == "tiny":
        model = build_tiny_model(build_tokenizer(), seed=0)
        model.set_attn_implementation(kernel)
        return model
    if shape == "smollm2":
        return load_policy(resolve_model("smollm2-135m-instruct", ROOT / ".heterorl" / "models"),
                           attention=kernel)[0].train()
    if shape == "20m":
        config = Qwen2Config(vocab_size=32000, hidden_size=320, intermediate_size=1280, num_hidden_layers=6,
                             num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=4096,
                             tie_word_embeddings=True)
    elif shape == "qwen2-0.5b":
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
    else:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    config._attn_implementation = kernel
    return Qwen2ForCausalLM(config).float()


def make_groups(args, vocab: int):
    """The batch both sides train on, from a fixed seed."""
    import random

    from pipeline.wire.rollout import Rollout

    rng = random.Random(1)
    near = -math.log(vocab)
    groups = []
    for g in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        completions = [[rng.randrange(vocab) for _ in range(args.completion_tokens)] for _ in range(args.group_size)]
        logps = [[near + rng.gauss(0.0, 0.05) for _ in range(args.completion_tokens)] for _ in range(args.group_size)]
        rewards = [float(rng.random() < 0.5) for _ in range(args.group_size)]
        groups.append(Rollout(prompt_id=f"p{g}", task="bench", sampler_id="bench", policy_version=0,
                              prompt_ids=prompt, completion_ids=completions, sampler_logps=logps, rewards=rewards))
    return groups


def learner_settings(args):
    from pipeline.config import LearnerConfig

    return LearnerConfig(loss_type="grpo", lr=1e-5, lr_warmup_steps=0, grad_clip=1.0, zero_stage=args.zero_stage,
                         precision=args.precision, gradient_checkpointing=args.gradient_checkpointing,
                         micro_batch_tokens=args.micro_batch_tokens, offload_optimizer=args.offload_optimizer)


class ProductStep:
    """The learner's step: DeepSpeed engine + pipeline.learning.update.optimizer_step."""

    def __init__(self, model, args, device):
        from pipeline.learning.engine import make_deepspeed_engine

        self.cfg = learner_settings(args)
        self.engine = make_deepspeed_engine(model, self.cfg, device)
        self.max_len = args.completion_tokens

    def __call__(self, groups) -> float:
        from pipeline.learning.update import optimizer_step

        metrics = optimizer_step(self.engine, groups, [1.0] * len(groups), self.cfg, temperature=1.0,
                                 max_completion_length=self.max_len)
        return float(metrics["loss"])


class ReferenceStep:
    """A plain-PyTorch GRPO step with the same micro-batches, precision and checkpointing."""

    def __init__(self, model, args, device):
        import torch

        self.torch = torch
        self.device = device
        self.model = model.to(device).train()
        if args.gradient_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), eps=1e-8,
                                           weight_decay=0.0)
        self.bf16 = args.precision == "bf16"
        self.rows_per_micro = max(1, args.micro_batch_tokens // (args.prompt_tokens + args.completion_tokens))
        vocab = model.get_output_embeddings().weight.shape[0]
        self.chunk = max(1, (64 << 20) // (4 * vocab))  # 64 MiB of float32 logits, as the product
        self.P = args.prompt_tokens

    def _token_logps(self, h, targets):
        logits = self.model.get_output_embeddings()(h).float()
        return self.torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    def __call__(self, groups) -> float:
        torch = self.torch
        checkpoint = torch.utils.checkpoint.checkpoint
        seqs = torch.tensor([g.prompt_ids + c for g in groups for c in g.completion_ids], device=self.device)
        old = torch.tensor([lq for g in groups for lq in g.sampler_logps], device=self.device)
        rewards = torch.tensor([g.rewards for g in groups], device=self.device)
        adv = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)
        n, total = len(seqs), 0.0
        for start in range(0, n, self.rows_per_micro):
            ids = seqs[start:start + self.rows_per_micro]
            k, C = len(ids), ids.shape[1] - self.P
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                hidden = self.model.model(input_ids=ids[:, :-1]).last_hidden_state[:, self.P - 1:]
                h, targets = hidden.reshape(k * C, -1), ids[:, self.P:].reshape(-1)
                lp = torch.cat([checkpoint(self._token_logps, hc, tc, use_reentrant=False)
                                for hc, tc in zip(h.split(self.chunk), targets.split(self.chunk))]).view(k, C)
            ratio = torch.exp(lp - old[start:start + k])
            a = adv[start:start + k, None]
            surrogate = torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            loss = -surrogate.mean(-1).sum() / n
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def worker(args) -> dict:
    """One side, in this process: build, warm up, time `--steps` steps; a JSON record."""
    import torch

    from pipeline.devices import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args.shape, args.precision)
    params = sum(p.numel() for p in model.parameters())
    groups = make_groups(args, model.get_output_embeddings().weight.shape[0])
    step = (ProductStep if args.worker == "product" else ReferenceStep)(model, args, device)

    def timed() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = step(groups)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, loss

    _, first_loss = timed()  # warm-up (and the loss at the shared initial weights)
    seconds = [timed()[0] for _ in range(args.steps)]
    tokens = sum(len(g.prompt_ids) + len(c) for g in groups for c in g.completion_ids)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"side": args.worker, "device": str(device), "gpu": torch.cuda.get_device_name(device)
            if device.type == "cuda" else None, "parameters": params, "tokens_per_step": tokens,
            "step_seconds": seconds, "tokens_per_s": tokens / statistics.median(seconds),
            "peak_memory_bytes": peak, "first_step_loss": first_loss}


def run_side(side: str, argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--worker", side], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        raise SystemExit(f"{side} step failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="tiny", help="model shape (default tiny)")
    p.add_argument("--groups", type=int, help="prompt groups per step (default: the shape's)")
    p.add_argument("--group-size", type=int, help="sequences per group (default: the shape's)")
    p.add_argument("--prompt-tokens", type=int, help="prompt tokens per sequence (default: the shape's)")
    p.add_argument("--completion-tokens", type=int, help="completion tokens per sequence (default: the shape's)")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="learner.precision for both sides (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="learner.gradient_checkpointing for both sides (default: on for qwen2-0.5b, else off)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="learner.micro_batch_tokens for both sides (default 16384)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3],
                   help="the product's learner.zero_stage (default 1; one process, so no partitioning)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side after one warm-up (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="alternate product/reference this many times (default 1)")
    p.add_argument("--product-only", action="store_true",
                   help="time the product's step alone (to compare settings); no ratio, no targets")
    p.add_argument("--offload-optimizer", action="store_true",
                   help="the product's learner.offload_optimizer (optimizer state in CPU memory)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--json", type=Path, help="also write the records and ratios to this file")
    p.add_argument("--worker", choices=["product", "reference"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    groups, size, prompt, completion = SHAPES[args.shape][1]
    args.groups = args.groups or groups
    args.group_size = args.group_size or size
    args.prompt_tokens = args.prompt_tokens or prompt
    args.completion_tokens = args.completion_tokens or completion
    if args.precision is None or args.gradient_checkpointing is None:
        import torch

        gpu = args.device != "cpu" and torch.cuda.is_available()
        args.precision = args.precision or ("bf16" if gpu else "fp32")
        if args.gradient_checkpointing is None:
            args.gradient_checkpointing = args.shape == "qwen2-0.5b"
    if args.precision == "bf16" and args.zero_stage == 0:
        p.error("--precision bf16 needs --zero-stage >= 1 (DeepSpeed's bf16 optimizer)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    argv += ["--precision", args.precision,
             "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing"]
    print(f"shape {args.shape}: {SHAPES[args.shape][0]}")
    print(f"batch: {args.groups} groups x {args.group_size} x ({args.prompt_tokens} + {args.completion_tokens}) "
          f"tokens; precision {args.precision}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
          f"micro-batch {args.micro_batch_tokens} tokens, product ZeRO stage {args.zero_stage}"
          f"{', optimizer offloaded' if args.offload_optimizer else ''}", flush=True)
    records = []
    for r in range(args.rounds):
        for side in ("product",) if args.product_only else ("product", "reference"):
            rec = run_side(side, argv)
            records.append(rec)
            print(f"  round {r + 1} {side:9s}: {rec['tokens_per_s']:10.0f} tokens/s, peak "
                  f"{rec['peak_memory_bytes'] / 2**30:6.2f} GiB, step "
                  f"{statistics.median(rec['step_seconds']):.3f} s, first-step loss {rec['first_step_loss']:+.6f}",
                  flush=True)
    if args.product_only:
        return 0
    speed = {s: statistics.median(r["tokens_per_s"] for r in records if r["side"] == s) for s in ("product", "reference")}
    peak = {s: max(r["peak_memory_bytes"] for r in records if r["side"] == s) for s in ("product", "reference")}
    ratio = speed["product"] / speed["reference"]
    on_gpu = records[0]["device"].startswith("cuda")
    where = records[0]["gpu"] or "CPU"
    print(f"\ndevice: {where}; {records[0]['parameters'] / 1e6:.1f}M parameters, {records[0]['tokens_per_step']} "
          f"tokens per step")
    print(f"{'':10s} {'tokens/s':>10s} {'peak GiB':>9s}")
    for side in ("product", "reference"):
        print(f"{side:10s} {speed[side]:10.0f} {peak[side] / 2**30:9.2f}")
    print(f"ratio product/reference: tokens/s {ratio:.2f}x (target >= {SPEED_TARGET}), "
          f"peak memory {peak['product'] / peak['reference']:.2f}x")
    missed = []
    if ratio < SPEED_TARGET:
        missed.append(f"tokens/s ratio {ratio:.2f} < {SPEED_TARGET}")
    if on_gpu and args.shape == "qwen2-0.5b" and peak["product"] > GPU_MEMORY_TARGET_GIB * 2**30:
        missed.append(f"peak GPU memory {peak['product'] / 2**30:.1f} GiB > {GPU_MEMORY_TARGET_GIB}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
                                         "records": records, "tokens_per_s": speed, "peak_memory_bytes": peak,
                                         "ratio": ratio, "missed": missed}, indent=1))
    print("targets met" if not missed else "targets missed: " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
