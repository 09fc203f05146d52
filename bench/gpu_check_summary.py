"""The GPU check's answers, one line each, from what its race wrote.

    python bench/gpu_check_summary.py RACE_DIR

RACE_DIR is `bench/async_vs_sync.py --out`'s folder (accuracy_vs_time.json, and the product's run
in async/). Prints: (1) the race, the product's minutes to its last version against the plain
loop's; (2) the learner's share of its busy time outside its optimizer step; (3) the GPU's
utilization while each side trained (nvidia-smi, sampled every second); (4) the on-policy
learner-sampler mismatch in the precision `precision: auto` picked (`mismatch_*` of the learner's
metrics, groups sampled by its own version); (5) whether the publisher kept up
(`versions_skipped` in learner_summary.json); (6) whether the samplers kept the learner fed: its
share of time waiting for rollouts, and each sampler's time per batch. `bench/gpu_check.sh`
ends with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_digest import feeding_line, mismatch_line, prompts_per_batch, publisher_line  # noqa: E402


def summary_lines(race_dir: Path) -> list[str]:
    race = json.loads((race_dir / "accuracy_vs_time.json").read_text())
    product = next(v for k, v in race.items() if k.startswith("asynchronous"))
    loop = next(v for k, v in race.items() if k.startswith("synchronous"))
    a, s = product["evals"][-1], loop["evals"][-1]
    ratio = f" ({a['minutes'] / s['minutes']:.2f}x)" if s["minutes"] > 0 and a["step"] == s["step"] else ""
    lines = [f"1 race: the product reached v{a['step']} in {a['minutes']:.1f} min, the plain loop v{s['step']} in "
             f"{s['minutes']:.1f} min{ratio}; held-out sampled accuracy {a['accuracy_sampled']:.3f} against "
             f"{s['accuracy_sampled']:.3f}"]
    if all(lane.get(k) is not None for lane in (product, loop) for k in ("first_step_s", "steady_steps_per_min")):
        # each lane's clock from its command's start
        lines[0] += (f"; first step after {product['first_step_s']:.1f} s against {loop['first_step_s']:.1f} s, "
                     f"steady {product['steady_steps_per_min']:.1f} steps/min against "
                     f"{loop['steady_steps_per_min']:.1f} ({product['steady_steps_per_min'] / loop['steady_steps_per_min']:.2f}x)")
    share = product.get("summary", {}).get("outside_optimizer_share")
    lines.append("2 the learner's busy time outside its optimizer step: "
                 + (f"{100 * share:.1f} %" if share is not None else "not recorded"))

    def gpu(result: dict) -> str:
        u = result.get("gpu_utilization")
        return (f"{u['mean_percent']:.0f} % busy on average ({u['samples']} samples, "
                f"{u['samples_at_most_12_percent']} at <= 12 %)" if u else "no nvidia-smi samples")

    lines.append(f"3 GPU utilization while training: the product {gpu(product)}; the plain loop {gpu(loop)}")
    run = race_dir / "async"
    from pipeline.records.metrics import read_metrics

    steps = read_metrics(run / "metrics.jsonl", "learner")
    summary = json.loads((run / "summary.json").read_text())
    learner = json.loads((run / "learner_summary.json").read_text())
    lines.append("4 " + mismatch_line(steps, summary.get("precision", ""), learner.get("staleness_histogram")))
    lines.append("5 " + publisher_line(learner))
    lines.append("6 " + feeding_line(steps, summary.get("sampler_stats") or {}, prompts_per_batch(run)))
    return lines


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    race_dir = Path(sys.argv[1])
    if not (race_dir / "accuracy_vs_time.json").is_file() or not (race_dir / "async" / "learner_summary.json").is_file():
        print(f"gpu_check_summary: {race_dir} holds no finished race (accuracy_vs_time.json, "
              "async/learner_summary.json)", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(race_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
