"""What one `heterorl train` run did, in a few lines: accuracies, step times, where the minutes went.

    python bench/run_digest.py RUN_DIR

Reads RUN_DIR/summary.json, learner_summary.json and metrics.jsonl (what `heterorl train`
writes) and prints the precision and CPU it ran with, held-out accuracy before and after
(sampled and greedy), the learner's step times (median and 90th percentile, and the time
between its first and last step), the per-stage seconds of the learner's steps and the share
of its busy time outside the optimizer step, the learner-sampler mismatch on the groups sampled
by the learner's own version (`mismatch_*` in its metrics), whether the publisher kept up
(`versions_skipped` in learner_summary.json), and the minutes before, during and after
training. `bench/gpu_check.sh` ends with it; it reads any run's directory.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mismatch_line(steps: list[dict], precision: str = "", staleness_histogram: dict | None = None) -> str:
    """The learner-sampler mismatch over the steps whose batch held groups sampled by the learner's
    own version: per-token KL (k3) median (the median of the steps'), p99 (the largest step's),
    and the token-weighted share of tokens whose log-probs differ by more than 0.1."""
    on_policy = [r for r in steps if "mismatch_kl_median" in r]
    what = precision.split("(")[0].strip().removeprefix("precision: ") or "precision not recorded"
    if not on_policy:
        fresh = (staleness_histogram or {}).get("0", 0)
        return f"on-policy mismatch ({what}): " + (
            f"not recorded, though {fresh} groups were used at staleness 0 (a run from before the learner "
            "wrote mismatch_* metrics)" if fresh else "no step held a group sampled by the learner's own version")
    tokens = [r.get("mismatch_tokens", 1.0) for r in on_policy]
    share = sum(r["mismatch_share_over_0.1"] * t for r, t in zip(on_policy, tokens)) / sum(tokens)
    return (f"on-policy mismatch ({what}): KL per token median {statistics.median(r['mismatch_kl_median'] for r in on_policy):.2e}, "
            f"p99 up to {max(r['mismatch_kl_p99'] for r in on_policy):.2e}, tokens with |log-prob gap| > 0.1: "
            f"{100 * share:.2f} %, over {len(on_policy)} of {len(steps)} steps ({sum(tokens):.0f} tokens)")


def publisher_line(learner: dict) -> str:
    """Whether the publisher kept up: the versions the learner made, and those skipped because a
    newer one overtook them while they waited (`versions_skipped`)."""
    skipped = learner.get("versions_skipped")
    if skipped is None:
        return "publisher: versions_skipped not recorded"
    made = learner.get("final_policy_version", 0) - learner.get("start_policy_version", 0)
    waited = learner.get("seconds", {}).get("time_publish_wait_s")
    verdict = "kept up" if not skipped else "fell behind"
    return (f"publisher: {verdict}, {len(skipped)} of {made} versions skipped"
            + (f" ({', '.join(f'v{v}' for v in skipped[:10])}{', ...' if len(skipped) > 10 else ''})" if skipped else "")
            + (f"; the learner waited {waited:.1f} s for it" if waited is not None else ""))


LEARNER_BUSY = ("time_train_s", "time_intake_s", "time_screen_s", "time_snapshot_s", "time_publish_wait_s")
"""The learner's stages in its metrics: what it does for a step (the rest of its time it waits for data)."""


def prompts_per_batch(run_dir: Path) -> int:
    """`sampler.prompts_per_batch` of the config `heterorl train` gave its roles (RUN_DIR/config.yaml)."""
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return int(config["sampler"]["prompts_per_batch"])


def feeding_line(steps: list[dict], sampler_stats: dict, prompts_per_batch: int) -> str:
    """Whether the samplers kept the learner fed: the share of the learner's time from its first
    step to its last spent waiting for rollouts (not in `LEARNER_BUSY`), and each sampler's mean
    time per batch of `prompts_per_batch` prompts (its `generate_s` over its batches)."""
    line = "the learner starved: too few steps to say"
    if len(steps) > 1:
        span = steps[-1]["time"] - steps[0]["time"]
        busy = sum(r.get(k, 0.0) for r in steps[1:] for k in LEARNER_BUSY)
        line = (f"the learner starved {100 * max(0.0, 1 - busy / span):.0f} % of the time from its first step to its "
                f"last (busy {busy:.1f} s of {span:.1f} s)")
    batches = []
    for sampler_id, stats in sorted(sampler_stats.items()):
        if isinstance(stats, dict) and stats.get("generated") and stats.get("generate_s") is not None:
            count = float(stats["generated"]) / prompts_per_batch
            batches.append(f"{sampler_id.rsplit('-', 1)[-1]} {float(stats['generate_s']) / count:.2f} s "
                           f"({count:.0f} batches)")
    return line + "; each sampler's time per batch: " + (", ".join(batches) if batches else "not recorded")


def digest(run_dir: Path) -> list[str]:
    from pipeline.records.metrics import read_metrics

    summary = json.loads((run_dir / "summary.json").read_text())
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    steps = read_metrics(run_dir / "metrics.jsonl", "learner")
    lines = [f"{summary.get('precision', '')}; CPU {summary.get('cpu', '?')}",
             f"held-out accuracy: sampled {summary['eval_accuracy_before']:.3f} -> {summary['eval_accuracy_after']:.3f}, "
             f"greedy {summary['eval_greedy_before']:.3f} -> {summary['eval_greedy_after']:.3f} "
             f"(best sampled {summary['eval_best_accuracy']:.3f}; versions scored {summary['eval_versions']})",
             f"loss {summary['loss_type']}, {len(steps)} steps, {summary['groups_used']} groups used, "
             f"{summary['groups_dropped']} dropped, staleness mean {summary['mean_staleness_used']:.2f} "
             f"max {summary['max_staleness_used']}"]
    if len(steps) > 1:
        gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
        lines.append(f"learner steps: every {statistics.median(gaps):.2f}s (median; p90 {quantile(gaps, 0.9):.2f}s), "
                     f"first to last {(steps[-1]['time'] - steps[0]['time']) / 60:.1f} min; optimizer step "
                     f"{statistics.median(r['time_train_s'] for r in steps if 'time_train_s' in r):.2f}s (median)")
    seconds = learner.get("seconds", {})
    if seconds:
        lines.append("learner stages (s): " + ", ".join(f"{k.removeprefix('time_').removesuffix('_s')} {v:.0f}"
                                                        for k, v in seconds.items() if k.startswith(("time_", "background_")))
                     + f"; outside the optimizer step: {100 * (learner.get('outside_optimizer_share') or 0):.1f} % "
                       "of its busy time")
    lines.append(feeding_line(steps, summary.get("sampler_stats") or {}, prompts_per_batch(run_dir)))
    lines.append(mismatch_line(steps, summary.get("precision", ""), learner.get("staleness_histogram")))
    lines.append(publisher_line(learner))
    phases = summary.get("seconds", {})
    if phases:
        lines.append("minutes: " + ", ".join(f"{k.replace('_', ' ')} {v / 60:.1f}" for k, v in phases.items())
                     + f"; the whole command {summary['wall_seconds'] / 60:.1f}")
    return lines


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    run_dir = Path(sys.argv[1])
    missing = [name for name in ("summary.json", "learner_summary.json", "metrics.jsonl") if not (run_dir / name).is_file()]
    if missing:
        print(f"run_digest: {run_dir} holds no finished `heterorl train` run (no {', '.join(missing)})", file=sys.stderr)
        return 2
    for line in digest(run_dir):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
