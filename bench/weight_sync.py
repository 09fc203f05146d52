"""What a policy version costs on the wire: full copies against deltas, side by side in one run.

    python bench/weight_sync.py --shape smollm2|qwen2-0.5b|tiny [--lrs 1e-6,1e-5,5e-4] [--steps 2]
        [--groups 2] [--group-size 4] [--max-new-tokens 24] [--links 100:50,1000:0 | --no-links]
        [--out DIR]

1. **Rollouts.** The base model samples `--groups` prompt groups with the product's sampler
   code (`pipeline.models.sample_groups`: real tokens, real log-probs). `smollm2` (the real
   SmolLM2-135M-Instruct) answers the `smollm2` config's arithmetic problems, scored by the
   task's verifier; only groups whose rewards differ are kept (others carry no gradient).
   `qwen2-0.5b` is Qwen2-0.5B's shape with random weights (494 M parameters), which solves
   nothing: its prompts are random token ids and a completion's reward is 1 when its mean
   log-prob is above the group's median, a stand-in signal so that every group has a gradient.
2. **Learner steps.** For each learning rate, a fresh DeepSpeed engine of the product's
   learner (`pipeline.learning.engine.make_deepspeed_engine`, `pipeline.learning.update.optimizer_step`, loss gepo, bf16
   with fp32 master weights, no warm-up) takes `--steps` steps on those groups. After each
   step the policy is saved as the learner saves it (`save_weights`) and encoded against
   the version before with the product's codec (`pipeline.weights.codec`), in bf16 (the
   published weights) and in fp32 (the master weights: what `learner.policy_dtype: fp32`
   would send). Printed: bytes per version beside the full bf16 and fp32 copies, the share
   of elements that changed, encode time on the learner, decode + verify time.
3. **Time to new weights.** A local stack (real S3) behind `infra.fault_proxy` with the
   bandwidth and latency of each `--links` entry (Mbit/s:ms). The learner publishes the base
   as a keyframe and the first lr-1e-6 step twice: as a full copy and as a delta
   (`PolicyWriter`). A sampler holding the base fetches each through the proxy
   (`fetch_policy`: download, rebuild, every tensor's sha256 checked) and loads it into the
   `hf` engine. Printed: seconds from the start of the download to the weights in the engine.
4. **Upload per step.** What a bf16 learner uploaded per step before issue 22 (its bf16
   weights and the fp32 optimizer state, every step: 14 bytes per parameter; 16 for an fp32
   learner) against now (a delta every step plus the recovery state every
   `learner.state_every_steps`, 10).

Targets (issue 22), at lr 1e-6 on `smollm2` and `qwen2-0.5b`: a delta <= 2 % of the full
bf16 copy; time to new weights over 100 Mbit/s with 50 ms latency <= 10 s at qwen2-0.5b;
every reconstruction bit-exact. Exit status 1 if a target is missed. `--out DIR` writes
the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DELTA_TARGET = 0.02
TIME_TARGET_S = 10.0
TARGET_LR = 1e-6
STATE_EVERY_STEPS = 10
"""`learner.state_every_steps`' default."""


def build(shape: str):
    """(model, tokenizer) of the shape."""
    from bench.learner import build_model
    from pipeline.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct", ROOT / ".heterorl" / "models")) \
        if shape in ("smollm2", "qwen2-0.5b") else None
    if shape == "tiny":
        from pipeline.models.tiny import build_tokenizer
        tokenizer = build_tokenizer()
    return build_model(shape, "bf16"), tokenizer  # its learner trains in bf16 (below)


def rollouts(shape: str, model, tokenizer, args) -> list:
    """Informative prompt groups sampled from the model itself (see the module's docstring)."""
    import random

    import torch

    from pipeline.config import load_config
    from heterorl.config_files import builtin_config
    from pipeline.models import decode_completion, sample_groups
    from pipeline.wire.rollout import Rollout
    from pipeline.runtime import make_task_from_config

    model.eval()
    groups, tried = [], 0
    task = make_task_from_config(load_config(builtin_config("smollm2"))) if shape == "smollm2" else None
    rng = random.Random(0)
    while len(groups) < args.groups and tried < 40 * args.groups:
        batch = list(range(tried, tried + 8))
        tried += len(batch)
        if task is not None:
            problems = [task.train_problem(i) for i in batch]
            prompts = [task.encode_prompt(p, tokenizer) for p in problems]
        else:
            problems = [None] * len(batch)
            vocab = model.get_input_embeddings().num_embeddings
            prompts = [[rng.randrange(min(1000, vocab // 2), min(40000, vocab)) for _ in range(16)] for _ in batch]
        with torch.no_grad():
            sampled = sample_groups(model, tokenizer, prompts, group_size=args.group_size, temperature=1.0,
                                    max_new_tokens=args.max_new_tokens, seed=tried)
        for i, (problem, group) in zip(batch, zip(problems, sampled)):
            if task is not None:
                rewards = [task.reward(problem, decode_completion(tokenizer, c)) for c in group.completion_ids]
            else:  # the likelier half of the group's completions (by mean log-prob) is "right"
                means = [sum(lp) / len(lp) for lp in group.sampler_logps]
                median = statistics.median(means)
                rewards = [float(m > median) for m in means]
            if len(set(rewards)) > 1 and len(groups) < args.groups:
                groups.append(Rollout(prompt_id=f"p{i}", task="bench", sampler_id="bench", policy_version=0,
                                      prompt_ids=group.prompt_ids, completion_ids=group.completion_ids,
                                      sampler_logps=group.sampler_logps, rewards=rewards))
    if len(groups) < args.groups:
        raise SystemExit(f"only {len(groups)} of {args.groups} sampled groups had differing rewards")
    model.train()
    return groups


def policy_weights(engine, tokenizer, work: Path) -> tuple[dict, dict]:
    """(bf16 weights as published, fp32 master weights) of the engine now."""
    from pipeline.weights.learner_state import _full, save_weights
    from pipeline.weights.policy import read_weights

    target = work / "snapshot"
    save_weights(engine, tokenizer, target)
    published = read_weights(target)
    shutil.rmtree(target)
    masters = {name: _full(engine, p, None) for name, p in engine.module.named_parameters()}
    return published, {"masters": masters}


def encode_measure(old: dict, new: dict) -> dict:
    """Bytes, changed share and times of one delta; raises if the rebuild is not bit-exact."""
    import torch

    from pipeline.weights.codec import apply_delta, bits, encode_delta

    nbytes, changed, elements, enc_s, dec_s = 0, 0, 0, 0.0, 0.0
    for name, tensors in new.items():
        started = time.perf_counter()
        delta = encode_delta(old[name], tensors)
        enc_s += time.perf_counter() - started
        started = time.perf_counter()
        rebuilt = apply_delta(old[name], delta)  # checks each tensor's sha256
        dec_s += time.perf_counter() - started
        nbytes += delta.nbytes
        for key, t in tensors.items():
            if not torch.equal(bits_t := torch.from_numpy(bits(rebuilt[key])), torch.from_numpy(bits(t))):
                raise SystemExit(f"{key}: the rebuilt tensor is not bit-exact")
            changed += int((torch.from_numpy(bits(old[name][key])) != bits_t).sum())
            elements += t.numel()
    return {"bytes": nbytes, "changed_share": changed / max(1, elements), "encode_s": enc_s, "decode_verify_s": dec_s}


def train_and_measure(model, tokenizer, groups, lr: float, args, work: Path, rounding: str = "dithered") -> dict:
    """`--steps` learner steps at `lr` (bf16 weights from their masters by `rounding`:
    `learner.half_rounding`); per step, the bf16 and fp32 deltas."""
    import copy

    import torch

    from pipeline.config import LearnerConfig
    from pipeline.learning.engine import make_deepspeed_engine
    from pipeline.devices import resolve_device
    from pipeline.learning.update import optimizer_step

    lcfg = LearnerConfig(loss_type="gepo", lr=lr, lr_warmup_steps=0, precision="bf16", zero_stage=1,
                         micro_batch_tokens=4096, gradient_checkpointing=args.shape == "qwen2-0.5b",
                         half_rounding=rounding)
    engine = make_deepspeed_engine(copy.deepcopy(model), lcfg, resolve_device("cpu"))
    bf16, fp32 = policy_weights(engine, tokenizer, work)
    steps, kept = [], None
    for _ in range(args.steps):
        started = time.perf_counter()
        optimizer_step(engine, groups, [1.0] * len(groups), lcfg, temperature=1.0,
                       max_completion_length=args.max_new_tokens)
        step_s = time.perf_counter() - started
        new_bf16, new_fp32 = policy_weights(engine, tokenizer, work)
        steps.append({"step_s": step_s, "bf16": encode_measure(bf16, new_bf16), "fp32": encode_measure(fp32, new_fp32)})
        print(f"  {rounding} lr {lr:g} step {len(steps)}: {step_s:.1f}s; bf16 delta {steps[-1]['bf16']['bytes'] / 1e6:.2f} MB "
              f"encoded in {steps[-1]['bf16']['encode_s']:.1f}s; fp32 delta {steps[-1]['fp32']['bytes'] / 1e6:.1f} MB",
              flush=True)
        bf16, fp32 = new_bf16, new_fp32
        kept = kept or new_bf16
    del engine
    return {"lr": lr, "rounding": rounding, "steps": steps, "first_bf16": kept}


def link_times(model, tokenizer, first_step: dict, args, work: Path) -> list[dict]:
    """Seconds from download start to weights in the hf engine, full copy vs delta, per link."""
    import torch

    from infra.fault_proxy import FaultProxy, FaultSpec, Route
    from infra.local_stack import start_stack, stack_services, stop_stack
    from pipeline.weights.store import CheckpointStore, connect_s3
    from pipeline.sampling.generation import HfEngine, SamplingSettings
    from pipeline.weights.policy import KeyframeRule, PolicyWriter, write_weights, fetch_policy

    base_dir = work / "base"
    model.save_pretrained(base_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(base_dir)
    step_dir = work / "step1"
    shutil.copytree(base_dir, step_dir)
    for f in step_dir.glob("*.safetensors"):
        f.unlink()
    write_weights(first_step, step_dir)
    stack = start_stack(work / "stack", kafka_storage="memory")
    results = []
    try:
        services = stack_services(stack)
        client = connect_s3(services)
        bf16 = torch.bfloat16
        with_delta = PolicyWriter(CheckpointStore(client, services.bucket, "bench-delta"), KeyframeRule(10), bf16)
        with_delta.write(0, base_dir)
        with_delta.write(1, step_dir, parent_version=0)
        full = PolicyWriter(CheckpointStore(client, services.bucket, "bench-full"), KeyframeRule(1), bf16)
        full.write(0, base_dir)
        full.write(1, step_dir, parent_version=0)
        assert with_delta.published[-1]["kind"] == "delta" and full.published[-1]["kind"] == "keyframe"
        # The sampler's copy of v0, as a fetch left it.
        held, _, _ = fetch_policy(CheckpointStore(client, services.bucket, "bench-delta"),
                                  f"bench-delta/v0/manifest.json", work / "held-v0")
        s3_port = int(services.s3_endpoint.rsplit(":", 1)[1])
        for link in args.links:
            mbit, latency = (float(x) for x in link.split(":"))
            spec = FaultSpec(latency_ms=latency, bandwidth_bytes_per_s=mbit * 1e6 / 8)
            proxy = FaultProxy([Route("s3", 0, "127.0.0.1", s3_port)], spec).start()
            try:
                far = connect_s3(replace(services, s3_endpoint=f"http://{proxy.address('s3')}"))
                row = {"link": f"{mbit:g} Mbit/s, {latency:g} ms"}
                for label, run, have in (("full", "bench-full", None), ("delta", "bench-delta", (0, held))):
                    engine = HfEngine(SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8), torch.device("cpu"),
                                      "bf16")
                    dest = work / f"fetched-{label}"
                    started = time.perf_counter()
                    path, _, report = fetch_policy(CheckpointStore(far, services.bucket, run),
                                                   f"{run}/v1/manifest.json", dest, have=have, expect_version=1,
                                                   work_dir=work)
                    fetched_s = time.perf_counter() - started
                    engine.install(engine.prepare(path))
                    row[label] = {"seconds": time.perf_counter() - started, "download_rebuild_s": fetched_s,
                                  "bytes": report.bytes_downloaded}
                    engine.close()
                    shutil.rmtree(dest, ignore_errors=True)
                results.append(row)
            finally:
                proxy.stop()
    finally:
        stop_stack(work / "stack", wipe=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2", choices=["tiny", "smollm2", "qwen2-0.5b"],
                        help="the model (default smollm2, the real SmolLM2-135M-Instruct)")
    parser.add_argument("--lrs", default="1e-6,1e-5,5e-4", help="learning rates, comma-separated")
    parser.add_argument("--half-rounding", default="dithered",
                        help="learner.half_rounding of the bf16 learner, comma-separated to compare: dithered "
                             "(default), nearest")
    parser.add_argument("--steps", type=int, default=2, help="learner steps per learning rate (default 2)")
    parser.add_argument("--groups", type=int, default=2, help="prompt groups per step (default 2)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="completion length cap (default 24)")
    parser.add_argument("--links", default="100:50,1000:0",
                        help="links for the time to new weights, Mbit/s:latency-ms, comma-separated")
    parser.add_argument("--no-links", action="store_true", help="skip the time-to-new-weights part")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    parser.add_argument("--out", type=Path, help="write the numbers to DIR/weight_sync_<shape>.json")
    args = parser.parse_args(argv)
    args.links = [] if args.no_links else [x for x in args.links.split(",") if x]
    lrs = [float(x) for x in args.lrs.split(",")]

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = build(args.shape)
    params = sum(p.numel() for p in model.parameters())
    print(f"weight_sync: {args.shape}, {params / 1e6:.1f} M parameters, {args.steps} step(s) per lr, "
          f"{args.groups} groups x {args.group_size} completions")
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        groups = rollouts(args.shape, model, tokenizer, args)
        print(f"rollouts: {len(groups)} informative groups in {time.perf_counter() - started:.0f}s", flush=True)
        runs = [train_and_measure(model, tokenizer, groups, lr, args, work, rounding)
                for rounding in args.half_rounding.split(",") for lr in lrs]
        full_bf16 = sum(t.numel() * 2 for tensors in runs[0]["first_bf16"].values() for t in tensors.values())
        full_fp32 = 2 * full_bf16
        print(f"\nbytes per version (full bf16 {full_bf16 / 1e6:.1f} MB, full fp32 {full_fp32 / 1e6:.1f} MB):")
        print(f"{'rounding':>9} {'lr':>8} {'step s':>7} {'bf16 delta MB':>14} {'% of bf16':>10} {'changed':>8} {'encode s':>9} "
              f"{'decode+verify s':>16} {'fp32 delta MB':>14} {'% of fp32':>10}")
        table = []
        for run in runs:
            s = run["steps"]
            worst = max(x["bf16"]["bytes"] for x in s)
            row = {"lr": run["lr"], "half_rounding": run["rounding"], "step_s": statistics.mean(x["step_s"] for x in s),
                   "bf16_delta_bytes": [x["bf16"]["bytes"] for x in s], "bf16_share_max": worst / full_bf16,
                   "bf16_changed_share": [x["bf16"]["changed_share"] for x in s],
                   "encode_s": statistics.mean(x["bf16"]["encode_s"] for x in s),
                   "decode_verify_s": statistics.mean(x["bf16"]["decode_verify_s"] for x in s),
                   "fp32_delta_bytes": [x["fp32"]["bytes"] for x in s],
                   "fp32_share_max": max(x["fp32"]["bytes"] for x in s) / full_fp32}
            table.append(row)
            print(f"{run['rounding']:>9} {run['lr']:>8.0e} {row['step_s']:>7.1f} {worst / 1e6:>14.2f} {100 * row['bf16_share_max']:>9.2f}% "
                  f"{100 * max(row['bf16_changed_share']):>7.2f}% {row['encode_s']:>9.2f} "
                  f"{row['decode_verify_s']:>16.2f} {max(row['fp32_delta_bytes']) / 1e6:>14.2f} "
                  f"{100 * row['fp32_share_max']:>9.1f}%")
        target_run = next((r for r in runs if r["lr"] == TARGET_LR), runs[0])
        state = params * 2 + params * 12  # bf16 weights + fp32 masters and both Adam moments
        before = state  # until issue 22: all of it, every step
        delta_now = max(x["bf16"]["bytes"] for x in target_run["steps"])
        after = delta_now + state / STATE_EVERY_STEPS
        print(f"\nlearner upload per step at lr {target_run['lr']:g}, bf16 learner: before {before / 1e9:.2f} GB (bf16 "
              f"weights + fp32 optimizer state, every step); now {after / 1e9:.3f} GB (delta {delta_now / 1e6:.1f} MB + recovery state "
              f"{state / 1e9:.2f} GB / {STATE_EVERY_STEPS} steps): {before / after:.1f}x less")
        links = link_times(model, tokenizer, target_run["first_bf16"], args, work) if args.links else []
        if links:
            print("\ntime to new weights in the sampler's hf engine (download + rebuild + sha256 + load):")
            for row in links:
                print(f"  {row['link']:>20}: full bf16 {row['full']['seconds']:6.1f}s ({row['full']['bytes'] / 1e6:.1f} MB)"
                      f"   delta {row['delta']['seconds']:6.1f}s ({row['delta']['bytes'] / 1e6:.2f} MB)"
                      f"   {row['full']['seconds'] / row['delta']['seconds']:.1f}x faster")
    failures = []
    share = max(r["bf16_share_max"] for r in table if r["lr"] == TARGET_LR) if TARGET_LR in lrs else None
    if share is not None and args.shape != "tiny" and share > DELTA_TARGET:
        failures.append(f"a delta at lr {TARGET_LR:g} is {100 * share:.2f}% of the full bf16 copy (> 2%)")
    slow = [r for r in links if r["link"].startswith("100 ")]
    if args.shape == "qwen2-0.5b" and slow and slow[0]["delta"]["seconds"] > TIME_TARGET_S:
        failures.append(f"new weights took {slow[0]['delta']['seconds']:.1f}s over 100 Mbit/s (> 10 s)")
    print("\nevery reconstruction bit-exact: yes (checked tensor by tensor)")
    print("targets: " + ("met" if not failures else "MISSED: " + "; ".join(failures)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"weight_sync_{args.shape}.json").write_text(json.dumps(
            {"shape": args.shape, "parameters": params, "full_bf16_bytes": full_bf16, "full_fp32_bytes": full_fp32,
             "lrs": table, "upload_per_step": {"before": before, "after": after}, "links": links,
             "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
