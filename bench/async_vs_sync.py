"""Steps per minute: the same learner and sampler, synchronous vs asynchronous.

    python bench/async_vs_sync.py [--config demo] [--steps 20] [--samplers 1]

(a) synchronous: one process alternates — sample `groups_per_step` prompt groups with
    the current weights, then one optimizer step on them (the classic RL loop, no
    staleness, no servers). Measured twice: with one torch thread (the per-process
    budget the asynchronous processes get) and with every core for both phases.
(b) asynchronous: `heterorl train` — a learner process and sampler process(es) on the
    local stack, sampling and learning overlapping, rollouts through Kafka, weights
    through S3, one torch thread per process.

Both use the same config (model, task, batch, loss) and start from the same base model.
Steps per minute are measured between the first and the last optimizer step of each
(start-up, model warm-up and evaluation excluded), side by side in one run, because
this machine is noisy. Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def steps_per_minute(step_times: list[float]) -> float:
    if len(step_times) < 2:
        raise ValueError("need at least two steps to measure a rate")
    return 60.0 * (len(step_times) - 1) / (step_times[-1] - step_times[0])


def run_sync(cfg, steps: int, threads: int) -> list[float]:
    import torch

    from pipeline.engine import make_engine, resolve_device
    from pipeline.models import load_policy, sample_groups
    from pipeline.runtime import make_task_from_config, resolve_base_model
    from pipeline.update import optimizer_step
    from producers.sampler import score_groups

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.run.seed)
    task = make_task_from_config(cfg)
    model, tokenizer = load_policy(resolve_base_model(cfg))
    engine = make_engine(model, cfg.learner, resolve_device(cfg.model.device))
    s, lcfg = cfg.sampler, cfg.learner
    times, index = [], 0
    for step in range(steps):
        groups = []
        while len(groups) < lcfg.groups_per_step:
            problems = [task.train_problem(index + k) for k in range(s.prompts_per_batch)]
            index += s.prompts_per_batch
            with torch.no_grad():
                sampled = sample_groups(engine.module, tokenizer, [task.encode_prompt(p, tokenizer) for p in problems],
                                        group_size=s.group_size, temperature=s.temperature, top_p=s.top_p,
                                        top_k=s.top_k, max_new_tokens=s.max_new_tokens, seed=cfg.run.seed + index)
            groups += score_groups(task, tokenizer, problems, sampled, sampler_id="sync", policy_version=step,
                                   sampling={"temperature": s.temperature})
        groups = groups[: lcfg.groups_per_step]
        result = optimizer_step(engine, groups, [1.0] * len(groups), lcfg,
                                temperature=s.temperature, max_completion_length=s.max_new_tokens)
        times.append(time.time())
        print(f"  sync step {step + 1}/{steps} loss {result['loss']:.4f}", file=sys.stderr)
    return times


def run_async(config: str, steps: int, samplers: int, overrides: list[str], out: Path) -> list[float]:
    from pipeline.metrics import read_metrics

    cmd = [sys.executable, "-m", "heterorl", "train", "--config", config, "--out", str(out),
           "--set", f"learner.max_steps={steps}", "--set", f"train.num_samplers={samplers}",
           "--set", "eval.problems=8", "--set", "eval.n_samples=1"]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return [r["time"] for r in read_metrics(out / "metrics.jsonl", "learner")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo", help="run config both modes use: a built-in name or a file")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in each mode")
    parser.add_argument("--samplers", type=int, default=1, help="sampler processes in the asynchronous mode")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to both modes (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args()

    from heterorl.config_files import config_path
    from pipeline.config import load_config

    args.config = str(config_path(args.config).resolve())
    cfg = load_config(args.config, args.overrides)
    cores = os.cpu_count() or 1
    print(f"machine: {cores} cores. async: 1 learner + {args.samplers} sampler process(es), 1 torch thread "
          f"each, plus the local servers. sync: 1 process, 1 thread, then {cores} threads", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        async_rate = steps_per_minute(run_async(args.config, args.steps, args.samplers, args.overrides,
                                                Path(tmp) / "run"))
    sync_one = steps_per_minute(run_sync(cfg, args.steps, 1))
    sync_all = steps_per_minute(run_sync(cfg, args.steps, cores))
    result = {"steps": args.steps, "groups_per_step": cfg.learner.groups_per_step, "samplers": args.samplers,
              "cores": cores, "async_steps_per_min": round(async_rate, 2),
              "sync_1_thread_steps_per_min": round(sync_one, 2),
              f"sync_{cores}_threads_steps_per_min": round(sync_all, 2),
              "async_over_sync_1_thread": round(async_rate / sync_one, 3),
              f"async_over_sync_{cores}_threads": round(async_rate / sync_all, 3)}
    print(f"\nasynchronous ({args.samplers} sampler(s), 1 thread/process): {async_rate:7.2f} steps/min")
    print(f"synchronous, 1 thread                      : {sync_one:7.2f} steps/min   "
          f"ratio async/sync {async_rate / sync_one:.2f}x")
    print(f"synchronous, {cores} threads                     : {sync_all:7.2f} steps/min   "
          f"ratio async/sync {async_rate / sync_all:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
