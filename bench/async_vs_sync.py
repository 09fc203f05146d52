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
model, one after the other in one run, because this machine is noisy. Each runs as a command
of its own, and its clock starts when the bench starts that command: imports, model loading,
the base evaluation and the servers' start are all counted (`lane_clock`).

Every lane reports:
- `first_step_s`: seconds from its command's start to its first optimizer step;
- `to_last_step_min`: minutes from its command's start to its last step (the wall time to
  version N, start-up included);
- `steady_steps_per_min`: steps per minute from its first step to its last (start-up left out).
Minutes a lane spends evaluating are counted in none: the loop evaluates inline (v0 before its
first step, subtracted), the product beside training on a GPU and after it on a shared CPU
(`eval.after_training`; the base model too: `heterorl train`'s fast start). Every lane's v0 is
placed at its command's start.

Without `--eval-every`: those figures for the product and the loop (one thread, every core),
and their ratios.

With `--eval-every K` (the accuracy race): both score the held-out split (`eval.*` of the
config) before the first step, every K steps and after the last, each evaluation placed at
the minute (since its command's start) its version was made. `--target-accuracy A` adds the
wall time to the first held-out sampled accuracy of at least A. Prints both curves, the ratios,
and where each run's minutes went; writes DIR/accuracy_vs_time.json and .png. `--trl` adds a
third lane: TRL's GRPOTrainer on the same model, prompts, reward, batch, schedule, precision
and threads (bench/trl_lane.py says what is the same and what differs; `pip install -e
'.[bench-trl]'`). The product evaluates its base model afresh (`eval.reuse_base=false`), as
the loop does.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def steps_per_minute(step_times: list[float], pauses: list[tuple[float, float]] = ()) -> float:
    """Steps per minute from the first step to the last, without the `pauses` (start, end) between."""
    if len(step_times) < 2:
        raise ValueError("need at least two steps to measure a rate")
    return 60.0 * (len(step_times) - 1) / (step_times[-1] - step_times[0] - paused_before(step_times[-1], pauses,
                                                                                       since=step_times[0]))


def paused_before(t: float, pauses: list[tuple[float, float]], since: float = float("-inf")) -> float:
    """Seconds of the `pauses` (start, end) that fall between `since` and `t`."""
    return sum(max(0.0, min(end, t) - max(start, since)) for start, end in pauses)


def lane_clock(launched: float, step_times: list[float], evals: list[dict], pauses: list[tuple[float, float]] = (),
               target_accuracy: Optional[float] = None) -> dict:
    """One lane's clock, started at its command's start (`launched`, Unix seconds), as the module
    docstring says: time to its first step, minutes to its last, its steady rate, each evaluation's
    minute (`evals[i]["time"]`: when its version was made; without its `pauses`, the lane's own
    evaluations; v0 at minute 0, the base model being there from the start) and, given `target_accuracy`, the minutes to the first
    evaluation whose sampled accuracy reaches it (None: never)."""
    def minutes(t: float) -> float:
        return (t - launched - paused_before(t, pauses)) / 60

    placed = [{**{k: v for k, v in e.items() if k != "time"},
               "minutes": round(minutes(e["time"]), 3) if e["step"] else 0.0} for e in evals]
    clock = {"first_step_s": round(minutes(step_times[0]) * 60, 2), "to_last_step_min": round(minutes(step_times[-1]), 3),
             "steady_steps_per_min": round(steps_per_minute(step_times, pauses), 3) if len(step_times) > 1 else None,
             "evals": placed}
    if target_accuracy is not None:
        reached = [e["minutes"] for e in placed if e["accuracy_sampled"] >= target_accuracy]
        clock["to_target_min"] = reached[0] if reached else None
    return clock


def run_sync(cfg, steps: int, threads: int, eval_every: Optional[int] = None) -> dict:
    """The synchronous loop, in this process: `times` of each step (Unix seconds); with
    `eval_every`, `evals` (step, `time` its version was made, accuracies), the `pauses` its
    evaluations after the first step took, and the seconds spent generating, training and
    evaluating. `race_sync` runs it as a command of its own, so that its clock counts its start."""
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
    clock, evals, pauses = StageClock(), [], []
    if eval_every:  # v0's evaluation is a pause of the clock, as every evaluation is
        model, tokenizer = load_policy(base, dtype=DTYPES[cfg.sampler.precision], attention=cfg.model.attention)
        started = time.time()
        evals.append({"step": 0, **evaluate_model(cfg, model, tokenizer, task), "time": started})
        pauses.append((started, time.time()))
        del model
    model, tokenizer = load_policy(base, attention=learner_attention(cfg))
    engine = make_deepspeed_engine(model, cfg.learner, resolve_device(cfg.model.device))
    s, lcfg = cfg.sampler, cfg.learner
    times, index, completion_tokens = [], 0, 0.0
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
        completion_tokens += result["completion_tokens"]
        print(f"  sync step {step + 1}/{steps} loss {result['loss']:.4f} reward {result['reward_mean']:.3f}",
              file=sys.stderr)
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            # the loop's own evaluations are a pause of its clock (the product, sharing a CPU,
            # evaluates after training; with a GPU, beside it on its own cores)
            with clock.stage("evaluate"):
                evals.append({"step": step + 1, "time": times[-1], **evaluate_model(cfg, engine.module, tokenizer, task)})
            pauses.append((times[-1], time.time()))
            print(f"  sync v{step + 1}: held-out accuracy {evals[-1]['accuracy_sampled']:.3f} "
                  f"(greedy {evals[-1]['accuracy_greedy']:.3f})", file=sys.stderr)
    return {"times": times, "evals": evals, "pauses": pauses, "seconds": clock.take(),
            "completion_tokens": completion_tokens}


def training_windows(times: list[float], pauses: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The wall-clock stretches from the first step to the last, without the `pauses`."""
    windows, start = [], times[0]
    for pause_start, pause_end in pauses:
        if pause_start >= start:
            windows.append((start, pause_start))
            start = pause_end
    return windows + [(start, times[-1])] if start < times[-1] else windows


def race_lane(script: list[str], config: str, steps: int, threads: int, overrides: list[str], result_file: Path,
              eval_every: Optional[int] = None) -> tuple[float, dict]:
    """A lane run as a command of its own (`script`: the program and its first arguments), which
    writes its result to `result_file` in `run_sync`'s shape: (the moment it was started, that
    result, with its `training_windows`)."""
    cmd = [sys.executable, *script, "--config", config, "--steps", str(steps), "--threads", str(threads),
           "--result", str(result_file)]
    cmd += ["--eval-every", str(eval_every)] if eval_every else []
    for o in overrides:
        cmd += ["--set", o]
    launched = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads(result_file.read_text())
    result["training_windows"] = training_windows(result["times"], result["pauses"])
    return launched, result


def race_sync(config: str, steps: int, threads: int, overrides: list[str], result_file: Path,
              eval_every: Optional[int] = None) -> tuple[float, dict]:
    """The loop as a command of its own (this script's `--lane sync`)."""
    return race_lane([str(Path(__file__).resolve()), "--lane", "sync"], config, steps, threads, overrides,
                     result_file, eval_every)


def race_trl(config: str, steps: int, threads: int, overrides: list[str], result_file: Path,
             eval_every: Optional[int] = None) -> tuple[float, dict]:
    """TRL's GRPOTrainer as a command of its own (bench/trl_lane.py)."""
    return race_lane([str(Path(__file__).resolve().parent / "trl_lane.py")], config, steps, threads, overrides,
                     result_file, eval_every)


def run_async(config: str, steps: int, samplers: int, overrides: list[str], out: Path,
              eval_every: Optional[int] = None) -> tuple[float, dict]:
    """`heterorl train`: (the moment its command was started, its result: `times` of each step;
    with `eval_every`, `evals` as in run_sync and where the learner's and the samplers' time went)."""
    from pipeline.records.metrics import read_metrics

    cmd = [sys.executable, "-m", "heterorl", "train", "--config", config, "--out", str(out),
           "--set", f"learner.max_steps={steps}", "--set", f"train.num_samplers={samplers}"]
    cmd += ["--set", f"eval.every={eval_every}", "--set", "eval.reuse_base=false"] if eval_every else [
        "--set", "eval.problems=8", "--set", "eval.n_samples=1", "--set", "eval.every=null"]
    for o in overrides:
        cmd += ["--set", o]
    launched = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True)
    learner = read_metrics(out / "metrics.jsonl", "learner")
    result = {"times": [r["time"] for r in learner], "evals": [], "pauses": [], "seconds": {},
              "completion_tokens": sum(r.get("completion_tokens", 0.0) for r in learner)}
    if not eval_every:
        return launched, result
    evals = sorted(read_metrics(out / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
    made = {r["step"]: r["time"] for r in learner}  # v0: at minute 0 (`lane_clock`)
    result["evals"] = [{"step": r["policy_version"], "time": made.get(r["policy_version"], r["time"]),
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
    result["training_windows"] = training_windows(result["times"], [])
    result["summary"] = {k: summary[k] for k in ("groups_used", "groups_dropped", "mean_staleness_used",
                                                 "max_staleness_used") if k in summary}
    learner_summary = json.loads((out / "learner_summary.json").read_text())
    result["summary"]["outside_optimizer_share"] = learner_summary.get("outside_optimizer_share")
    return launched, result


def plot_race(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, result), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green")):
        evals = result["evals"]
        ax.plot([e["minutes"] for e in evals], [e["accuracy_sampled"] for e in evals], "o-", color=color,
                label=f"{name}: sampled")
        ax.plot([e["minutes"] for e in evals], [e["accuracy_greedy"] for e in evals], "s--", color=color,
                alpha=0.6, label=f"{name}: greedy")
    ax.set_xlabel("wall-clock minutes since its command started")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("held-out accuracy against wall-clock time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_clocks(results: dict) -> None:
    """Each lane's clock, then the product's against each loop's."""
    print(f"\n{'lane':34s} {'first step s':>12s} {'to last min':>12s} {'steady steps/min':>17s}")
    for name, r in results.items():
        rate = f"{r['steady_steps_per_min']:17.2f}" if r["steady_steps_per_min"] is not None else f"{'-':>17s}"
        print(f"{name:34s} {r['first_step_s']:12.1f} {r['to_last_step_min']:12.2f} {rate}")
    (product_name, product), *loops = results.items()
    for name, loop in loops:
        rates = (product["steady_steps_per_min"], loop["steady_steps_per_min"])
        print(f"{product_name} against {name}: {product['to_last_step_min'] / loop['to_last_step_min']:.2f}x its "
              f"minutes to the last step, {product['first_step_s'] / loop['first_step_s']:.2f}x its time to the "
              f"first step" + (f", {rates[0] / rates[1]:.2f}x its steady rate" if None not in rates else ""))


def race(args, cores: int) -> dict:
    """The accuracy race: both lanes, their clocks, curves and where their minutes went."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with GpuUtilization() as gpu:
        lanes = [run_async(args.config, args.steps, args.samplers, args.overrides, out / "async",
                           eval_every=args.eval_every),
                 race_sync(args.config, args.steps, cores, args.overrides, out / "sync.json", args.eval_every)]
        if args.trl:
            lanes.append(race_trl(args.config, args.steps, cores, args.overrides, out / "trl.json", args.eval_every))
    samplers = f"{args.samplers} sampler{'s' if args.samplers != 1 else ''}"
    names = [f"asynchronous ({samplers})", f"synchronous ({cores} threads)", f"TRL GRPOTrainer ({cores} threads)"]
    results = {}
    for name, (launched, result) in zip(names, lanes):
        result["gpu_utilization"] = gpu.mean(result.pop("training_windows", []))
        results[name] = {**result, **lane_clock(launched, result["times"], result["evals"], result["pauses"],
                                                args.target_accuracy)}
    for name, result in results.items():
        util = result["gpu_utilization"]
        print(f"\n{name}: {len(result['times'])} steps, {result['to_last_step_min']:.1f} min from its command's start" +
              (f", GPU {util['mean_percent']:.0f} % busy while training ({util['samples']} samples, "
               f"{util['samples_at_most_12_percent']} at <= 12 %)" if util else ""))
        print("  step  minutes  sampled  greedy")
        for e in result["evals"]:
            print(f"  {e['step']:4d}  {e['minutes']:7.1f}  {e['accuracy_sampled']:7.3f}  {e['accuracy_greedy']:6.3f}")
        if args.target_accuracy is not None:
            reached = result["to_target_min"]
            print(f"  held-out sampled accuracy {args.target_accuracy} reached "
                  + (f"at {reached:.1f} min" if reached is not None else "never"))
        print("  where the time went (s): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(result["seconds"].items())))
        train_s = result["seconds"].get("time_train_s")
        if train_s and result.get("completion_tokens"):
            print(f"  optimizer steps: {train_s:.0f} s for {result['completion_tokens']:.0f} completion tokens, "
                  f"{1000 * train_s / result['completion_tokens']:.2f} s per 1,000")
        if result.get("summary", {}).get("outside_optimizer_share") is not None:
            print(f"  the learner's busy time outside the optimizer step: "
                  f"{100 * result['summary']['outside_optimizer_share']:.1f} %")
    print_clocks(results)
    (product_name, product), *others = results.items()
    for name, other in others:  # the product's last evaluation against each other lane's
        a_last, s_last = product["evals"][-1], other["evals"][-1]
        if a_last["step"] == s_last["step"] and s_last["minutes"] > 0:
            print(f"\nat v{a_last['step']}: {a_last['minutes']:.1f} min against {name}'s {s_last['minutes']:.1f} "
                  f"(ratio {a_last['minutes'] / s_last['minutes']:.2f}x), held-out sampled accuracy "
                  f"{a_last['accuracy_sampled']:.3f} against {s_last['accuracy_sampled']:.3f} "
                  f"(difference {a_last['accuracy_sampled'] - s_last['accuracy_sampled']:+.3f})")
    plot_race(results, out / "accuracy_vs_time.png")
    report = {"config": args.config, "steps": args.steps, "eval_every": args.eval_every, "cores": cores,
              "overrides": args.overrides, "target_accuracy": args.target_accuracy,
              **{name: {k: v for k, v in r.items() if k not in ("times", "pauses")} for name, r in results.items()}}
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
    parser.add_argument("--target-accuracy", type=float, metavar="A",
                        help="in the race, also the minutes to the first held-out sampled accuracy >= A")
    parser.add_argument("--out", metavar="DIR", help="the accuracy race's runs, JSON and PNG")
    parser.add_argument("--trl", action="store_true",
                        help="in the race, a third lane: TRL's GRPOTrainer on the same model, prompts, reward, batch, "
                             "schedule, precision and threads (bench/trl_lane.py; pip install -e '.[bench-trl]')")
    parser.add_argument("--lane", choices=["sync"],
                        help="internal: run only the plain loop in this process and write its result to --result "
                             "(the bench starts each lane as a command of its own)")
    parser.add_argument("--threads", type=int, default=1, help="with --lane sync: torch threads of the loop")
    parser.add_argument("--result", metavar="FILE", help="with --lane sync: where the loop's result goes (JSON)")
    args = parser.parse_args()
    if args.eval_every and not args.out and not args.lane:
        parser.error("--eval-every needs --out DIR")
    if args.lane and not args.result:
        parser.error("--lane sync needs --result FILE")
    if args.trl and not args.eval_every:
        parser.error("--trl races TRL's GRPOTrainer in the accuracy race: give --eval-every K and --out DIR")
    if args.trl and importlib.util.find_spec("trl") is None:
        parser.error("--trl needs trl: pip install -e '.[bench-trl]'")

    from heterorl.config_files import config_path
    from pipeline.config import load_config

    args.config = str(config_path(args.config).resolve())
    if args.lane:
        result = run_sync(load_config(args.config, args.overrides), args.steps, args.threads, args.eval_every)
        Path(args.result).write_text(json.dumps(result))
        return 0
    cores = os.cpu_count() or 1
    if args.eval_every:
        race(args, cores)
        return 0
    print(f"machine: {cores} cores. async: 1 learner + {args.samplers} sampler process(es), 1 torch thread "
          f"each, plus the local servers. sync: 1 process, 1 thread, then {cores} threads", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        lanes = {f"asynchronous ({args.samplers} sampler(s))":
                 run_async(args.config, args.steps, args.samplers, args.overrides, Path(tmp) / "run"),
                 "synchronous, 1 thread": race_sync(args.config, args.steps, 1, args.overrides, Path(tmp) / "s1.json"),
                 f"synchronous, {cores} threads":
                 race_sync(args.config, args.steps, cores, args.overrides, Path(tmp) / "sN.json")}
    results = {name: lane_clock(launched, r["times"], [], r["pauses"]) for name, (launched, r) in lanes.items()}
    print_clocks(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "groups_per_step": load_config(
            args.config, args.overrides).learner.groups_per_step, "samplers": args.samplers, "cores": cores,
            "lanes": {name: {k: v for k, v in r.items() if k != "evals"} for name, r in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
