"""What else uses the CPU while the learner takes its optimizer steps, in a `heterorl train` run.

    python bench/cpu_beside_steps.py [--config smollm2] [--steps 12] [--set KEY=VALUE ...] --out DIR

Runs `heterorl train` (no evaluator: `eval.every=null`) and, every quarter second, reads the CPU
time of every process it started (the learner and its publisher, the samplers, the local
servers and gates; `/proc/PID/stat`). Afterwards it splits each process's CPU seconds between
the learner's optimizer steps (each step's `time_train_s` before its record in metrics.jsonl)
and the rest of the run from the first step to the last, and prints, per process, the cores it
used on average inside the steps and outside them. A learner step running beside other work is
slower (its OpenMP threads wait for a core); this says whose.

Every 2 s it also reads each thread's context switches and run-queue wait
(`/proc/PID/task/TID/status`, `schedstat`) and prints, for the threads that woke most often
from the first timed step to the last, their wake-ups per second (voluntary switches), how
often they were preempted (involuntary switches) and how long they waited for a core: each
wake-up on a core the learner's threads are computing on preempts one of them, and the other
then waits at its next OpenMP barrier. Writes DIR/cpu_beside_steps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> dict[int, str]:
    """PID -> a short name (the role, or the program) of `root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    named, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv if w]
        named[pid] = name_of(words)
    return named


def name_of(argv: list[str]) -> str:
    if "heterorl" in argv:
        after = argv[argv.index("heterorl") + 1:]
        return after[0] if after else "heterorl"
    text = " ".join(argv)
    for known in ("publisher", "localbucket", "kafka_gate", "redis_gate", "tansu", "redis-server", "valkey"):
        if known in text:
            return known
    return Path(argv[0]).name if argv else "?"


def thread_counts(named: dict[int, str]) -> dict[str, tuple[int, int, float]]:
    """"name pid thread tid" -> (voluntary switches, involuntary switches, seconds waited for a
    core) of every thread of the processes in `named`."""
    counts = {}
    for pid, name in named.items():
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            task = Path(f"/proc/{pid}/task/{tid}")
            try:
                status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
                waited_ns = int((task / "schedstat").read_text().split()[1])
                comm = (task / "comm").read_text().strip()
            except (OSError, IndexError, ValueError):
                continue
            counts[f"{name} {pid} {comm} {tid}"] = (int(status["voluntary_ctxt_switches"]),
                                                    int(status["nonvoluntary_ctxt_switches"]), waited_ns / 1e9)
    return counts


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="run config: a built-in name or a file")
    parser.add_argument("--steps", type=int, default=12, help="learner steps")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the run and cpu_beside_steps.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "heterorl", "train", "--config", args.config, "--out", str(out / "run"),
           "--set", f"learner.max_steps={args.steps}", "--set", "eval.every=null", "--set", "eval.problems=8",
           "--set", "eval.n_samples=1"]
    for o in args.overrides:
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    samples: list[tuple[float, dict[str, float]]] = []  # (time, "name pid" -> CPU seconds so far)
    threads: list[tuple[float, dict]] = []  # (time, `thread_counts`), every 2 s
    while proc.poll() is None:
        now, seen = time.time(), {}
        named = process_tree(proc.pid)
        for pid, name in named.items():
            try:
                seen[f"{name} {pid}"] = cpu_seconds(pid)
            except OSError:
                pass
        samples.append((now, seen))
        if len(samples) % 8 == 1:
            threads.append((now, thread_counts(named)))
        time.sleep(0.25)
    if proc.returncode != 0:
        print(f"heterorl train exited with {proc.returncode}", file=sys.stderr)
        return proc.returncode

    from pipeline.records.metrics import read_metrics

    steps = read_metrics(out / "run" / "metrics.jsonl", "learner")[1:]  # the first step's start is start-up
    inside = [(r["time"] - r["time_train_s"], r["time"]) for r in steps]
    span = (inside[0][0], steps[-1]["time"])
    used = {"inside": {}, "outside": {}}
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if t1 <= span[0] or t0 >= span[1]:
            continue
        overlap = sum(max(0.0, min(t1, e) - max(t0, s)) for s, e in inside) / (t1 - t0)
        for key, seconds in b.items():
            delta = seconds - a.get(key, seconds)
            used["inside"][key] = used["inside"].get(key, 0.0) + delta * overlap
            used["outside"][key] = used["outside"].get(key, 0.0) + delta * (1 - overlap)
    inside_s = sum(e - s for s, e in inside)
    outside_s = span[1] - span[0] - inside_s
    rows = sorted(used["inside"], key=lambda k: -used["inside"][k])
    print(f"\n{len(steps)} optimizer steps, {inside_s:.1f} s in all; {outside_s:.1f} s between them "
          f"(first to last step); cores used on average:")
    print(f"{'process':32s} {'in the steps':>13s} {'between':>9s}")
    for key in rows:
        a, b = used["inside"][key] / inside_s, used["outside"][key] / max(outside_s, 1e-9)
        if a >= 0.005 or b >= 0.005:
            print(f"{key:32s} {a:13.3f} {b:9.3f}")
    wakeups = thread_wakeups(threads, span)
    (out / "cpu_beside_steps.json").write_text(json.dumps({
        "config": args.config, "steps": args.steps, "overrides": args.overrides, "cores": os.cpu_count(),
        "inside_s": inside_s, "outside_s": outside_s,
        "cores_inside": {k: used["inside"][k] / inside_s for k in rows},
        "cores_outside": {k: used["outside"][k] / max(outside_s, 1e-9) for k in rows},
        "threads_first_to_last_step": wakeups}, indent=2))
    print(f"\nwrote {out / 'cpu_beside_steps.json'}")
    return 0


def thread_wakeups(threads: list[tuple[float, dict]], span: tuple[float, float], top: int = 15) -> dict:
    """Each thread's wake-ups and preemptions per second and seconds waited for a core, between
    the thread snapshots nearest inside `span` (printed for the `top` that woke most often)."""
    within = [(t, c) for t, c in threads if span[0] <= t <= span[1]]
    if len(within) < 2:
        print("\n(the run was too short for two thread snapshots between its first and last step)")
        return {}
    (t0, a), (t1, b) = within[0], within[-1]
    seconds = t1 - t0
    rates = {key: {"wakeups_per_s": (v[0] - a[key][0]) / seconds, "preempted_per_s": (v[1] - a[key][1]) / seconds,
                   "waited_for_a_core_s": v[2] - a[key][2]} for key, v in b.items() if key in a}
    ranked = sorted(rates, key=lambda k: -rates[k]["wakeups_per_s"])
    print(f"\nthreads that woke most often, over {seconds:.0f} s from the first timed step to the last:")
    print(f"{'process pid thread tid':60s} {'wake-ups/s':>10s} {'preempted/s':>11s} {'waited s':>9s}")
    for key in ranked[:top]:
        r = rates[key]
        print(f"{key[:60]:60s} {r['wakeups_per_s']:10.1f} {r['preempted_per_s']:11.1f} {r['waited_for_a_core_s']:9.1f}")
    total = sum(r["wakeups_per_s"] for r in rates.values())
    print(f"{'all threads of the run':60s} {total:10.1f}")
    return {"seconds": seconds, "threads": {k: rates[k] for k in ranked}}


if __name__ == "__main__":
    sys.exit(main())
