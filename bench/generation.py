"""Generation speed of each installed backend, side by side: completion tokens per second.

    python bench/generation.py --shape tiny|20m|smollm2|qwen2-0.5b [--backends hf,vllm]
        [--prompts N] [--group-size G] [--prompt-tokens P] [--new-tokens C]
        [--precision fp32|bf16] [--threads T] [--rounds R] [--device auto|cpu|cuda] [--json FILE]

Every backend samples the same batch from the same random-init model through the
sampler's own engines (`pipeline.sampling.generation.make_generation_engine`): N prompts of P random tokens,
G completions each, C new tokens (a random-init model almost never ends early; tokens are
counted as generated). `smollm2` is the real SmolLM2-135M-Instruct instead, asked the
smollm2 config's questions through its chat template (P is then the prompts' own length,
about 47 tokens): completions end at EOS, and only generated tokens are counted. Each backend runs in its own fresh process (vLLM changes the
process's thread settings), one warm-up batch then `--rounds` timed batches; the engine's
start-up is reported separately and not counted. The last line gives each backend's
tokens/s relative to `hf`.

Shapes:
- tiny: the built-in demo model (Llama, hidden 64, 4 layers, 4 heads of 32, 21-token vocabulary);
- 20m: Qwen2 architecture, hidden 320, 6 layers, 5 heads of 64, vocabulary 32,000 (~19M parameters);
- smollm2: SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads of 64, vocabulary 49,152), real weights;
- qwen2-0.5b: Qwen2-0.5B's shape (494M parameters, vocabulary 151,936), for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (description, default batch: prompts, group size, prompt tokens, new tokens)
SHAPES = {
    "tiny": ("built-in demo model (hidden 64, 4 layers, 4 heads of 32)", (64, 8, 8, 8)),
    "20m": ("Qwen2 architecture, hidden 320, 6 layers, vocabulary 32,000 (~19M parameters)", (16, 8, 64, 128)),
    "smollm2": ("SmolLM2-135M-Instruct, real weights; the smollm2 config's questions", (64, 8, 47, 16)),
    "qwen2-0.5b": ("Qwen2-0.5B's shape, random init (494M parameters, vocabulary 151,936)", (32, 8, 256, 256)),
}


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer of `vocab_size` made-up tokens (prompts are given as ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"])}
    vocab.update({f"t{i}": i for i in range(len(vocab), vocab_size)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
                                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def save_model(shape: str, path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer

    torch.manual_seed(0)
    if shape == "smollm2":
        from pipeline.models import resolve_model

        shutil.copytree(resolve_model("smollm2-135m-instruct", ROOT / ".heterorl" / "models"), path)
        return
    if shape == "tiny":
        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer, ModelSize())
    else:
        hidden, layers, heads, kv, inter, vocab = ((320, 6, 5, 5, 1280, 32000) if shape == "20m"
                                                    else (896, 24, 14, 2, 4864, 151936))
        tokenizer = word_tokenizer(vocab)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def worker(args) -> dict:
    """One backend: start its engine on the saved model, one warm-up batch, timed batches."""
    import random

    import torch

    from pipeline.devices import resolve_device
    from pipeline.sampling.generation import SamplingSettings, make_generation_engine

    torch.set_num_threads(args.threads)
    prompts, group, prompt_tokens, new_tokens = batch_of(args)
    device = resolve_device(args.device)
    engine = make_generation_engine(args.worker, SamplingSettings(1.0, 1.0, 0, new_tokens), device, precision=args.precision,
                         kv_cache_gib=args.kv_cache_gib or kv_cache_for_batch(args))
    started = time.perf_counter()
    engine.install(engine.prepare(Path(args.model_dir)))
    startup_s = time.perf_counter() - started
    vocab = len(engine.tokenizer)
    rng = random.Random(0)
    batch = [[1] + [rng.randrange(4, vocab) for _ in range(prompt_tokens - 1)] for _ in range(prompts)]
    if args.shape == "smollm2":
        from pipeline.tasks import make_task

        task = make_task("arithmetic", digits=2, ops="+-", style="question")
        batch = [task.encode_prompt(task.train_problem(i), engine.tokenizer) for i in range(prompts)]
    engine.sample(batch, group_size=group, seed=0)  # warm-up
    seconds, tokens = [], []
    for r in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        groups = engine.sample(batch, group_size=group, seed=r + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        tokens.append(sum(len(c) for g in groups for c in g.completion_ids))
    engine.close()
    return {"backend": args.worker, "device": str(device), "startup_s": round(startup_s, 2),
            "tokens": sum(tokens), "seconds": round(sum(seconds), 3),
            "tokens_per_s": round(sum(tokens) / sum(seconds), 1)}


def kv_cache_for_batch(args) -> float:
    """GiB of KV cache for every sequence of the batch at once (so vLLM never preempts), at least 1."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    prompts, group, prompt_tokens, new_tokens = batch_of(args)
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * (2 if args.precision == "bf16" else 4)
    return max(1.0, 1.5 * prompts * group * (prompt_tokens + new_tokens) * per_token / (1 << 30))


def batch_of(args) -> tuple[int, int, int, int]:
    defaults = SHAPES[args.shape][1]
    return (args.prompts or defaults[0], args.group_size or defaults[1], args.prompt_tokens or defaults[2],
            args.new_tokens or defaults[3])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="tiny", help="model shape (default tiny)")
    p.add_argument("--backends", default=None,
                   help="comma-separated, from hf,vllm (default: every installed one)")
    p.add_argument("--prompts", type=int, help="prompts per batch (default: the shape's)")
    p.add_argument("--group-size", type=int, help="completions per prompt (default: the shape's)")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default: the shape's)")
    p.add_argument("--new-tokens", type=int, help="new tokens per completion (default: the shape's)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="weights (default fp32)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.add_argument("--rounds", type=int, default=3, help="timed batches per backend (default 3)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="vLLM's KV cache in GiB (default: enough for the whole batch at once, at least 1)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--json", type=Path, help="also write the records and ratios to this file")
    p.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from pipeline.sampling.generation import vllm_installed

    backends = args.backends.split(",") if args.backends else ["hf"] + (["vllm"] if vllm_installed() else [])
    prompts, group, prompt_tokens, new_tokens = batch_of(args)
    print(f"shape {args.shape}: {SHAPES[args.shape][0]}; {prompts} prompts x {group} completions, "
          f"{prompt_tokens} prompt + {new_tokens} new tokens, {args.precision}, {args.threads} threads, "
          f"{args.rounds} timed batches", flush=True)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(args.shape, Path(tmp) / "model")
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        for backend in backends:
            copy = Path(tmp) / backend  # vLLM's engine rewrites a tied head in its own copy
            subprocess.run(["cp", "-r", str(Path(tmp) / "model"), str(copy)], check=True)
            out = subprocess.run([sys.executable, __file__, *forwarded, "--worker", backend, "--model-dir", str(copy)],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{backend}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            record = json.loads(out.stdout.strip().splitlines()[-1])
            records.append(record)
            print(f"{backend:5s} on {record['device']}: {record['tokens_per_s']:>10,.1f} tokens/s "
                  f"({record['tokens']} tokens in {record['seconds']}s; engine start {record['startup_s']}s)",
                  flush=True)
    base = next((r for r in records if r["backend"] == "hf"), records[0])
    ratios = {r["backend"]: round(r["tokens_per_s"] / base["tokens_per_s"], 2) for r in records}
    print("tokens/s relative to " + base["backend"] + ": " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "records": records, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
