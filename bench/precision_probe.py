"""Where a sampler's and a learner's log-probs of the same tokens part, per precision and
attention kernel, on a real model (issue 64: in bf16 they disagreed on every token).

    python bench/precision_probe.py [--config smollm2] [--groups 4] [--tokens 16]

One process. The config's base model (SmolLM2-135M-Instruct for `smollm2`) samples `groups`
arithmetic prompts x 8 completions with the product's sampler path (`sample_groups`: a prefill,
then one token at a time against the KV cache, left-padded), recording its log-probs; then the
product's learner path (`completion_logprobs`: one pass over the distinct prompts, one over the
completions against their keys and values) scores the same tokens, with gradients as in
training: once with every group in one batch (as sampled) and once group by group (another
batch composition, as the learner's micro-batches are). Per precision (fp32, bf16) and
attention implementation (`sdpa`, the default of transformers; `eager`; and bf16 with the LM head in fp32, "bf16+head") it prints the
per-token |log-prob difference| (median, p99, share above 0.1) and the on-policy KL estimate
exp(r) - r - 1 with r = learner - sampler (median and mean per token), and the seconds each path
took. A second table follows the hidden states of one greedy completion layer by layer: the
sampler's path against one pass over prompt and completion together. A third runs the
learner's optimizer step (`optimizer_step` on a DeepSpeed engine, GEPO, lr 2e-6, ZeRO 1, as
`smollm2_plateau` trains) on the sampled groups in each of `SETTINGS` (fp32; bf16 with eager
attention and dithered rounding, what `auto` runs where bf16 is native; bf16 eager rounded to
nearest; bf16 sdpa rounded to nearest, what ran before), alternated `--step-rounds` times in one
process: each one's median step against fp32's (side by side, so the machine's noise hits all
alike), and how far the bf16 weights the forward uses have followed their fp32 masters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def mismatch(learner, sampler) -> dict:
    import math

    r = [float(lp) - s for row_l, row_s in zip(learner, sampler) for lp, s in zip(row_l, row_s)]
    diffs = sorted(abs(x) for x in r)
    k3 = sorted(math.expm1(x) - x for x in r)
    n = len(r)
    return {"tokens": n, "median_abs": statistics.median(diffs), "p99_abs": diffs[max(0, int(0.99 * n) - 1)],
            "share_over_0.1": sum(d > 0.1 for d in diffs) / n, "kl_median": statistics.median(k3), "kl_mean": sum(k3) / n}


class Fp32Head:
    """An LM head that computes the logits in fp32 from the hidden states (the learner and the
    sampler both call the model's head, so both get it)."""

    def __new__(cls, head):
        import torch

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = head.weight

            def forward(self, h):
                return torch.nn.functional.linear(h.float(), self.weight.float())

        return Head()


def probe(model_dir: Path, dtype, attention: str, prompts, groups_of: int, tokens: int, temperature: float,
          fp32_head: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models.decoding import sample_groups
    from pipeline.models.logprobs import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    model.eval()
    if fp32_head:
        model.lm_head = Fp32Head(model.lm_head)
    started = time.perf_counter()
    with torch.no_grad():
        groups = sample_groups(model, TOKENIZER, prompts, group_size=groups_of, temperature=temperature, top_p=0.95,
                               top_k=20, max_new_tokens=tokens, seed=0)
    sample_s = time.perf_counter() - started
    rows = [(g.prompt_ids, c, lp) for g in groups for c, lp in zip(g.completion_ids, g.sampler_logps)]
    started = time.perf_counter()
    together, _ = completion_logprobs(model, [p for p, _, _ in rows], [c for _, c, _ in rows], temperature)
    together.sum().backward()  # as in training: with gradients
    score_s = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    apart = []
    for g in groups:  # another batch composition: each group alone
        lp, _ = completion_logprobs(model, [g.prompt_ids] * len(g.completion_ids), g.completion_ids, temperature)
        apart += [lp[i, :len(c)].tolist() for i, c in enumerate(g.completion_ids)]
    sampled = [lp for _, _, lp in rows]
    return {"groups": groups, "one_batch": mismatch([together[i, :len(c)].tolist() for i, (_, c, _) in enumerate(rows)], sampled),
            "group_by_group": mismatch(apart, sampled), "sample_s": sample_s, "score_s": score_s}


def layers(model_dir: Path, dtype, attention: str, prompt: list[int], tokens: int) -> list[tuple[int, float]]:
    """Max relative difference, per layer, of the hidden states predicting each completion token:
    the sampler's path (prefill + cached steps) against one pass over prompt and completion."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, output_hidden_states=True)
        cache, chosen = out.past_key_values, []
        steps = [[h[0, -1].float()] for h in out.hidden_states]
        nxt = out.logits[0, -1].argmax()
        for _ in range(tokens - 1):
            chosen.append(int(nxt))
            out = model(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True, output_hidden_states=True)
            cache = out.past_key_values
            for layer, h in enumerate(out.hidden_states):
                steps[layer].append(h[0, -1].float())
            nxt = out.logits[0, -1].argmax()
        full = model(input_ids=torch.tensor([prompt + chosen]), output_hidden_states=True).hidden_states
    P, n = len(prompt), len(chosen)
    result = []
    for layer in range(len(full)):
        whole = full[layer][0, P - 1:P - 1 + n].float()
        cached = torch.stack(steps[layer][:n])
        result.append((layer, ((whole - cached).norm(dim=-1) / whole.norm(dim=-1)).max().item()))
    return result


SETTINGS = {"fp32 sdpa": ("fp32", "sdpa", "nearest"), "bf16 eager dithered": ("bf16", "eager", "dithered"),
            "bf16 eager nearest": ("bf16", "eager", "nearest"), "bf16 sdpa nearest": ("bf16", "sdpa", "nearest")}
"""The learner settings the step table compares: precision, `model.attention`, `learner.half_rounding`
(the second is what `auto` runs where bf16 is native; the last, what ran before)."""


def training_steps(model_dir: Path, groups, rounds: int, temperature: float, tokens: int) -> dict[str, dict]:
    """Per setting: the seconds of each of `rounds` optimizer steps (GEPO, lr 2e-6, ZeRO 1; the
    settings alternated, after one warm-up step each) and how far the weights the forward
    computes with (and the samplers get) have followed their fp32 masters since the start."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from pipeline.config import LearnerConfig
    from pipeline.learning.engine import make_deepspeed_engine
    from pipeline.learning.update import optimizer_step
    from pipeline.models import load_policy

    engines = {}
    for name, (precision, attention, rounding) in SETTINGS.items():
        cfg = LearnerConfig(loss_type="gepo", lr=2e-6, lr_warmup_steps=0, zero_stage=1, precision=precision,
                            half_rounding=rounding)
        model, _ = load_policy(model_dir, attention=attention)
        engine = make_deepspeed_engine(model.train(), cfg, torch.device("cpu"))
        engines[name] = (engine, cfg, {n: p.detach().float().clone() for n, p in engine.module.named_parameters()})
    weights = [1.0] * len(groups)
    result = {name: {"seconds": []} for name in SETTINGS}
    for round_ in range(rounds + 1):  # the first: warm-up, not timed
        for name, (engine, cfg, _) in engines.items():
            started = time.perf_counter()
            optimizer_step(engine, groups, weights, cfg, temperature=temperature, max_completion_length=tokens)
            if round_:
                result[name]["seconds"].append(time.perf_counter() - started)
    for name, (engine, _, start) in engines.items():
        used = masters = changed = total = 0.0
        for n, p in engine.module.named_parameters():
            now = p.detach().float()
            used += float((now - start[n]).abs().sum())
            masters += float((safe_get_full_fp32_param(p).float() - start[n]).abs().sum())
            changed += float((now != start[n]).sum())
            total += now.numel()
        result[name].update(follows=used / masters, changed=changed / total, mean_change=used / total)
    return result


TOKENIZER = None


def main() -> int:
    global TOKENIZER
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="smollm2", help="a built-in config or YAML naming model.base (default smollm2)")
    parser.add_argument("--groups", type=int, default=4, help="prompts sampled (default 4), 8 completions each")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per completion (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--step-rounds", type=int, default=5,
                        help="timed steps of the step table per setting, alternated (default 5; 0: no table)")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from heterorl.config_files import config_path
    from pipeline.config import load_config
    from pipeline.runtime import resolve_base_model

    torch.set_num_threads(args.threads)
    cfg = load_config(config_path(args.config), [])
    model_dir = resolve_base_model(cfg)
    TOKENIZER = AutoTokenizer.from_pretrained(model_dir)
    import random

    rng = random.Random(0)  # the smollm2 task's kind of question: a two-digit sum, through the chat template
    prompts = [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Reply with just the number."
               for _ in range(args.groups)]
    prompts = [TOKENIZER.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True) if isinstance(p, str) else p for p in prompts]
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    print(f"model {model_dir.name}, {args.groups} prompts x 8 completions of up to {args.tokens} tokens, T "
          f"{cfg.sampler.temperature}, torch {torch.__version__}, {args.threads} threads")
    print(f"{'precision':<10}{'attention':<10}{'batch':<16}{'tokens':>7}{'median |d|':>12}{'p99 |d|':>10}"
          f"{'>0.1':>7}{'KL median':>11}{'KL mean':>10}{'sample s':>10}{'score s':>9}")
    sampled = None
    for dtype, name, attention, head in ((torch.float32, "fp32", "sdpa", False), (torch.float32, "fp32", "eager", False),
                                         (torch.bfloat16, "bf16", "sdpa", False), (torch.bfloat16, "bf16", "eager", False),
                                         (torch.bfloat16, "bf16+head", "sdpa", True)):
        got = probe(model_dir, dtype, attention, prompts, 8, args.tokens, cfg.sampler.temperature, head)
        sampled = sampled or got["groups"]
        for batch in ("one_batch", "group_by_group"):
            m = got[batch]
            print(f"{name:<10}{attention:<10}{batch:<16}{m['tokens']:>7}{m['median_abs']:>12.2e}"
                  f"{m['p99_abs']:>10.2e}{m['share_over_0.1']:>7.3f}{m['kl_median']:>11.2e}{m['kl_mean']:>10.2e}"
                  + (f"{got['sample_s']:>10.1f}{got['score_s']:>9.1f}" if batch == "one_batch" else ""), flush=True)
    print("\nhidden states predicting each token: the sampler's path against one pass over prompt and completion "
          "(max relative difference)")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for attention in ("sdpa", "eager"):
            per_layer = layers(model_dir, dtype, attention, prompts[0], args.tokens)
            shown = [f"L{layer} {rel:.1e}" for layer, rel in per_layer if layer in (1, 2, 5, 10, 20, len(per_layer) - 1)]
            print(f"  {name} {attention:<6}" + "  ".join(shown), flush=True)
    if args.step_rounds:
        from pipeline.wire.rollout import Rollout

        rng = random.Random(1)
        groups = [Rollout(prompt_id=f"p{i}", task="probe", sampler_id="probe", policy_version=0,
                          prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, sampler_logps=g.sampler_logps,
                          rewards=[float(rng.random() < 0.5) for _ in g.completion_ids]) for i, g in enumerate(sampled)]
        steps = training_steps(model_dir, groups, args.step_rounds, cfg.sampler.temperature, args.tokens)
        fp32 = statistics.median(steps["fp32 sdpa"]["seconds"])
        print(f"\nthe learner's optimizer step (GEPO, lr 2e-6, ZeRO 1, {len(groups)} groups x 8, the completions "
              f"above), {args.step_rounds + 1} steps each, alternated (the first not timed); then how far the "
              "weights the forward uses have followed the fp32 masters: their mean change over the masters' "
              "(1 = as far), the share of weights changed at all, the mean |change|")
        for name, got in steps.items():
            median = statistics.median(got["seconds"])
            print(f"  {name:<20} step median {median:6.2f} s ({median / fp32:.2f}x fp32)  follows {got['follows']:6.3f}"
                  f"  changed {got['changed']:6.4f}  mean |change| {got['mean_change']:.3e}  "
                  + " ".join(f"{s:.2f}" for s in got["seconds"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
