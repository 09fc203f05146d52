"""The same learner and sampler, synchronous vs asynchronous: steps per minute, or held-out
accuracy against wall-clock minutes.

    python bench/async_vs_sync.py [--config demo] [--steps 20] [--samplers 1]
    python bench/async_vs_sync.py --config smollm2 --steps 60 --eval-every 20 --out DIR

(a) synchronous: one process alternates — sample `groups_per_step` prompt groups with
    the current weights, then one optimizer step on them (the classic RL loop, no
    staleness, no servers, no checks of samplers). Measured twice: with one torch thread
    (the per-process budget the asynchronous processes get) and with every core for both
    phases.
(b) asynchronous: `heterorl train` — a learner process and sampler process(es) on the
    local stack, sampling and learning overlapping, rollouts through Kafka, weights
    through S3, with the learner's checks of every group.

Both use the same config (model, task, batch, loss, precisions) and start from the same base
model, side by side in one run, because this machine is noisy.

Without `--eval-every`: steps per minute between the first and the last optimizer step of
each (start-up, model warm-up and evaluation excluded), and their ratio.

With `--eval-every K` (the accuracy race): both score the held-out split (`eval.*` of the
config) before the first step, every K steps and after the last; the asynchronous run as
`heterorl train` evaluates, the synchronous loop (every core) inline. Each evaluation is
placed at the minute its version was made, counted from the end of the evaluation before
training, without the minutes spent evaluating: the loop's own are subtracted from its clock,
and the product on a shared CPU evaluates after training (`eval.after_training`), so neither
clock holds any. Prints both curves, the ratio of minutes to the last version, and where each
run's minutes went; writes DIR/accuracy_vs_time.json and .png.
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
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class GpuUtilization:
    """nvidia-smi's utilization of GPU 0, sampled every second on a thread while the block runs
    (nothing where there is no nvidia-smi); `mean(windows)` over the (start, end) wall-clock
    windows given."""

    def __init__(self, every_s: float = 1.0):
        import shutil
        import threading

        self.samples: list[tuple[float, float]] = []
        self.every_s, self.stop = every_s, threading.Event()
        self.tool = shutil.which("nvidia-smi")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                out = subprocess.run([self.tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "--id=0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.time(), float(out.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> "GpuUtilization":
        if self.tool:
            self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def mean(self, windows: list[tuple[float, float]]) -> Optional[dict]:
        """Mean utilization (%) of the samples inside `windows`, and their count; None without samples."""
        inside = [u for t, u in self.samples if any(a <= t <= b for a, b in windows)]
        if not inside:
            return None
        return {"mean_percent": round(sum(inside) / len(inside), 1), "samples": len(inside),
                "samples_at_most_12_percent": sum(u <= 12 for u in inside)}


def steps_per_minute(step_times: list[float]) -> float:
    if len(step_times) < 2:
        raise ValueError("need at least two steps to measure a rate")
    return 60.0 * (len(step_times) - 1) / (step_times[-1] - step_times[0])


def run_sync(cfg, steps: int, threads: int, eval_every: Optional[int] = None) -> dict:
    """The synchronous loop: `times` of each step; with `eval_every`, `evals` (step, seconds since
    the clock started, accuracies) and the seconds spent generating, training and evaluating."""
    import torch

    from pipeline.learning.engine import make_deepspeed_engine
    from pipeline.devices import resolve_device
    from pipeline.records.metrics import StageClock
    from pipeline.models import DTYPES, load_policy, sample_groups
    from pipeline.runtime import (evaluate_model, learner_attention, make_task_from_config, resolve_base_model,
                                  with_machine_precision)
    from pipeline.learning.update import optimizer_step
    from producers.sampler import score_groups

    torch.set_num_threads(threads)
    cfg, precision = with_machine_precision(cfg, resolve_device(cfg.model.device))
    print(f"  sync: {precision}", file=sys.stderr)
    torch.manual_seed(cfg.run.seed)
    task = make_task_from_config(cfg)
    base = resolve_base_model(cfg)
    clock, evals = StageClock(), []
    if eval_every:
        model, tokenizer = load_policy(base, dtype=DTYPES[cfg.sampler.precision], attention=cfg.model.attention)
        evals.append({"step": 0, "minutes": 0.0, **evaluate_model(cfg, model, tokenizer, task)})
        del model
    started = time.time()
    model, tokenizer = load_policy(base, attention=learner_attention(cfg))
    engine = make_deepspeed_engine(model, cfg.learner, resolve_device(cfg.model.device))
    s, lcfg = cfg.sampler, cfg.learner
    times, index, evaluating_s = [], 0, 0.0
    windows, window_start = [], time.time()  # wall-clock stretches of learning (evaluations excluded)
    for step in range(steps):
        groups = []
        with clock.stage("generate"):
            while len(groups) < lcfg.groups_per_step:
                problems = [task.train_problem(index + k) for k in range(s.prompts_per_batch)]
                index += s.prompts_per_batch
                with torch.no_grad():
                    sampled = sample_groups(engine.module, tokenizer,
                                            [task.encode_prompt(p, tokenizer) for p in problems],
                                            group_size=s.group_size, temperature=s.temperature, top_p=s.top_p,
                                            top_k=s.top_k, max_new_tokens=s.max_new_tokens, seed=cfg.run.seed + index)
                groups += score_groups(task, tokenizer, problems, sampled, sampler_id="sync", policy_version=step,
                                       sampling={"temperature": s.temperature})
        groups = groups[: lcfg.groups_per_step]
        with clock.stage("train"):
            result = optimizer_step(engine, groups, [1.0] * len(groups), lcfg,
                                    temperature=s.temperature, max_completion_length=s.max_new_tokens)
        times.append(time.time())
        print(f"  sync step {step + 1}/{steps} loss {result['loss']:.4f} reward {result['reward_mean']:.3f}",
              file=sys.stderr)
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            # minutes of learning: the loop's own evaluations so far are not counted (the product,
            # sharing a CPU, evaluates after training; with a GPU, beside it on its own cores)
            made_at = (time.time() - started - evaluating_s) / 60
            evaluation_started = time.time()
            windows.append((window_start, evaluation_started))
            with clock.stage("evaluate"):
                evals.append({"step": step + 1, "minutes": made_at, **evaluate_model(cfg, engine.module, tokenizer, task)})
            evaluating_s += time.time() - evaluation_started
            window_start = time.time()
            print(f"  sync v{step + 1}: held-out accuracy {evals[-1]['accuracy_sampled']:.3f} "
                  f"(greedy {evals[-1]['accuracy_greedy']:.3f}) at {made_at:.1f} min", file=sys.stderr)
    windows.append((window_start, time.time()))
    return {"times": times, "evals": evals, "seconds": clock.take(), "wall_s": time.time() - started,
            "training_windows": windows}


def run_async(config: str, steps: int, samplers: int, overrides: list[str], out: Path,
              eval_every: Optional[int] = None) -> dict:
    """`heterorl train`: `times` of each step; with `eval_every`, `evals` as in run_sync and where
    the learner's and the samplers' time went."""
    from pipeline.records.metrics import read_metrics

    cmd = [sys.executable, "-m", "heterorl", "train", "--config", config, "--out", str(out),
           "--set", f"learner.max_steps={steps}", "--set", f"train.num_samplers={samplers}"]
    cmd += ["--set", f"eval.every={eval_every}"] if eval_every else ["--set", "eval.problems=8", "--set",
                                                                     "eval.n_samples=1", "--set", "eval.every=null"]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, cwd=ROOT, check=True)
    learner = read_metrics(out / "metrics.jsonl", "learner")
    result = {"times": [r["time"] for r in learner], "evals": [], "seconds": {}}
    if not eval_every:
        return result
    evals = sorted(read_metrics(out / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
    started = evals[0]["time"]  # the evaluation before training ends as the processes start
    made = {r["step"]: r["time"] for r in learner}
    result["evals"] = [{"step": r["policy_version"], "minutes": (made.get(r["policy_version"], started) - started) / 60,
                        **{k: v for k, v in r.items() if k.startswith(("accuracy", "mean_", "truncated"))}}
                       for r in evals]
    for r in learner:  # the learner's own stages (its log: where each step's time went)
        for key, value in r.items():
            if key.startswith("time_"):
                result["seconds"][key] = result["seconds"].get(key, 0.0) + value
    summary = json.loads((out / "summary.json").read_text())
    stats = summary.get("sampler_stats") or {}
    for key in ("paused_backlog_s", "paused_spool_full_s", "stalled_behind_s", "generate_s"):
        values = [float(v[key]) for v in stats.values() if isinstance(v, dict) and key in v]
        if values:
            result["seconds"][f"samplers_{key}_mean"] = sum(values) / len(values)
    result["wall_s"] = learner[-1]["time"] - started
    result["training_windows"] = [(started, learner[-1]["time"])]
    result["summary"] = {k: summary[k] for k in ("groups_used", "groups_dropped", "mean_staleness_used",
                                                 "max_staleness_used") if k in summary}
    learner_summary = json.loads((out / "learner_summary.json").read_text())
    result["summary"]["outside_optimizer_share"] = learner_summary.get("outside_optimizer_share")
    return result


def plot_race(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, result), color in zip(results.items(), ("tab:blue", "tab:orange")):
        evals = result["evals"]
        ax.plot([e["minutes"] for e in evals], [e["accuracy_sampled"] for e in evals], "o-", color=color,
                label=f"{name}: sampled")
        ax.plot([e["minutes"] for e in evals], [e["accuracy_greedy"] for e in evals], "s--", color=color,
                alpha=0.6, label=f"{name}: greedy")
    ax.set_xlabel("wall-clock minutes since training started")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("held-out accuracy against wall-clock time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def race(args, cfg, cores: int) -> dict:
    """The accuracy race: both modes, their curves and where their minutes went."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with GpuUtilization() as gpu:
        asynchronous = run_async(args.config, args.steps, args.samplers, args.overrides, out / "async",
                                 eval_every=args.eval_every)
        synchronous = run_sync(cfg, args.steps, cores, eval_every=args.eval_every)
    samplers = f"{args.samplers} sampler{'s' if args.samplers != 1 else ''}"
    results = {f"asynchronous ({samplers})": asynchronous, f"synchronous ({cores} threads)": synchronous}
    for name, result in results.items():
        result["gpu_utilization"] = gpu.mean(result.pop("training_windows", []))
        util = result["gpu_utilization"]
        print(f"\n{name}: {len(result['times'])} steps in {result['wall_s'] / 60:.1f} min" +
              (f", GPU {util['mean_percent']:.0f} % busy while training ({util['samples']} samples, "
               f"{util['samples_at_most_12_percent']} at <= 12 %)" if util else ""))
        print("  step  minutes  sampled  greedy")
        for e in result["evals"]:
            print(f"  {e['step']:4d}  {e['minutes']:7.1f}  {e['accuracy_sampled']:7.3f}  {e['accuracy_greedy']:6.3f}")
        print("  where the time went (s): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(result["seconds"].items())))
        if result.get("summary", {}).get("outside_optimizer_share") is not None:
            print(f"  the learner's busy time outside the optimizer step: "
                  f"{100 * result['summary']['outside_optimizer_share']:.1f} %")
    (a_last, *_), (s_last, *_) = (r["evals"][::-1] for r in (asynchronous, synchronous))
    if a_last["step"] == s_last["step"] and s_last["minutes"] > 0:
        print(f"\nat v{a_last['step']}: {a_last['minutes']:.1f} min against {s_last['minutes']:.1f} "
              f"(ratio {a_last['minutes'] / s_last['minutes']:.2f}x), held-out sampled accuracy "
              f"{a_last['accuracy_sampled']:.3f} against {s_last['accuracy_sampled']:.3f} "
              f"(difference {a_last['accuracy_sampled'] - s_last['accuracy_sampled']:+.3f})")
    plot_race(results, out / "accuracy_vs_time.png")
    report = {"config": args.config, "steps": args.steps, "eval_every": args.eval_every, "cores": cores,
              "overrides": args.overrides, **{name: {k: v for k, v in r.items() if k != "times"}
                                               for name, r in results.items()}}
    (out / "accuracy_vs_time.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out / 'accuracy_vs_time.json'} and {out / 'accuracy_vs_time.png'}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo", help="run config both modes use: a built-in name or a file")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in each mode")
    parser.add_argument("--samplers", type=int, default=1, help="sampler processes in the asynchronous mode")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to both modes (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--eval-every", type=int, metavar="K",
                        help="the accuracy race: held-out accuracy every K steps against wall-clock minutes "
                             "(needs --out)")
    parser.add_argument("--out", metavar="DIR", help="the accuracy race's runs, JSON and PNG")
    args = parser.parse_args()
    if args.eval_every and not args.out:
        parser.error("--eval-every needs --out DIR")

    from heterorl.config_files import config_path
    from pipeline.config import load_config

    args.config = str(config_path(args.config).resolve())
    cfg = load_config(args.config, args.overrides)
    cores = os.cpu_count() or 1
    if args.eval_every:
        race(args, cfg, cores)
        return 0
    print(f"machine: {cores} cores. async: 1 learner + {args.samplers} sampler process(es), 1 torch thread "
          f"each, plus the local servers. sync: 1 process, 1 thread, then {cores} threads", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        async_rate = steps_per_minute(run_async(args.config, args.steps, args.samplers, args.overrides,
                                                Path(tmp) / "run")["times"])
    sync_one = steps_per_minute(run_sync(cfg, args.steps, 1)["times"])
    sync_all = steps_per_minute(run_sync(cfg, args.steps, cores)["times"])
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
