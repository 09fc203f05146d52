"""How `heterorl train`'s roles should share one machine's cores: each `train.cpu_sharing`
policy run side by side, steps per minute compared.

    python bench/cpu_sharing.py [--config smollm2] [--steps 8] [--policies yield,priority,split]
                                [--set KEY=VALUE ...] [--out DIR]

Each policy is one `heterorl train --config C --set train.cpu_sharing=P` of `--steps` steps
with no evaluator, back to back, on the same stack settings. Printed per policy, from the
run's metrics: the time between learner steps (median over the steps after the first two,
which wait for the first policy and the first batch), the optimizer step alone (median), the
learner's stage seconds, and the staleness of what it trained on; then each policy's step
period over the best one's. The default `--set security.probation_groups=8` ends the key's
probation (its groups checked one by one as they come) within the first step, so the steady
state is measured; docs/performance.md has a run of this and the choice it made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = ("yield", "priority", "split", "none")


def run_policy(config: str, policy: str, steps: int, overrides: list[str], out: Path) -> dict:
    from pipeline.records.metrics import read_metrics

    cmd = [sys.executable, "-m", "heterorl", "train", "--config", config, "--out", str(out),
           "--set", f"learner.max_steps={steps}", "--set", f"train.cpu_sharing={policy}",
           "--set", "eval.every=null", "--set", "eval.problems=8", "--set", "eval.n_samples=1"]
    for o in overrides:
        cmd += ["--set", o]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps_ = read_metrics(out / "metrics.jsonl", "learner")
    steady = steps_[2:] if len(steps_) > 3 else steps_
    gaps = [b["time"] - a["time"] for a, b in zip(steady, steady[1:])]
    learner = json.loads((out / "learner_summary.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return {"policy": policy, "step_period_s": statistics.median(gaps),
            "optimizer_step_s": statistics.median(r["time_train_s"] for r in steady),
            "screen_s_per_step": statistics.mean(r.get("time_screen_s", 0.0) for r in steady),
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in steady),
            "outside_optimizer_share": learner.get("outside_optimizer_share"),
            "cpu_sharing": summary.get("cpu_sharing"), "cpu": summary.get("cpu"),
            "precision": summary.get("precision")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="run config: a built-in name or a file")
    parser.add_argument("--steps", type=int, default=8, help="learner steps per policy")
    parser.add_argument("--policies", default="yield,priority,split",
                        help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                        help="config override for every run (repeatable; default security.probation_groups=8)")
    parser.add_argument("--out", metavar="DIR", help="keep the runs and write DIR/cpu_sharing.json")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown} (known: {', '.join(POLICIES)})")
    if args.steps < 5:
        parser.error("--steps must be at least 5 (the first two are not measured)")
    overrides = args.overrides if args.overrides is not None else ["security.probation_groups=8"]
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-cpu-sharing-"))
    rows = []
    for policy in policies:
        print(f"running {policy} ({args.steps} steps) ...", file=sys.stderr, flush=True)
        rows.append(run_policy(args.config, policy, args.steps, overrides, root / policy))
    best = min(r["step_period_s"] for r in rows)
    print(f"\n{rows[0]['cpu']}; {rows[0]['precision']}")
    print(f"config {args.config}, {args.steps} steps per policy, overrides {overrides}")
    print("policy     step every  optimizer step  screen/step  staleness  outside optimizer  vs best")
    for r in rows:
        print(f"{r['policy']:9s}  {r['step_period_s']:8.1f}s  {r['optimizer_step_s']:12.1f}s  {r['screen_s_per_step']:9.1f}s"
              f"  {r['staleness_mean']:9.2f}  {100 * (r['outside_optimizer_share'] or 0):15.1f} %  "
              f"{r['step_period_s'] / best:6.2f}x")
    if args.out:
        (root / "cpu_sharing.json").write_text(json.dumps({"config": args.config, "steps": args.steps,
                                                           "overrides": overrides, "rows": rows}, indent=2))
        print(f"wrote {root / 'cpu_sharing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
