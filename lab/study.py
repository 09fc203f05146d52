"""`heterorl study delay`: loss × max-delay grid, each cell a real pipeline run.

Every cell is `heterorl train` on the study config (built-in `study`: delay model on,
evaluator on) with the cell's loss, max delay and seed, on one shared local stack. Then:

- DIR/delay_study.json: one record per (loss, max_delay, seed);
- DIR/delay_study.md: the paper-shaped table (rows loss, columns max delay, Best / Last),
  best-to-last gap per loss, GEPO's degradation from delay 0 to the largest delay;
- DIR/delay_verdict.json: the first claim per loss, with a 95 % interval over seeds
  (lab/study_verdict.py), also a section of delay_study.md;
- DIR/accuracy_curves.png, DIR/iw_variance_vs_kl.png, DIR/staleness_histogram.png.

Cells already finished in DIR with the same config and overrides (recorded in each cell's
cell.json) are not run again, so an interrupted study resumes where it stopped. The
analysis section of delay_study.md (below its marker) is kept when the report is rewritten.
`--report-only` runs nothing and reports the finished cells in DIR, a grid's missing cells
shown as "–": for cells run apart (other machines, other sessions) and gathered into
DIR/cells/.

A finished cell's run keeps, in S3, only what a user takes home from it: v0 (the base
model, which `heterorl replay` starts from) and its final policy with the versions that
policy's delta chain needs; its other versions and its recovery states are deleted
(`retire_run`), unless `keep_checkpoints`. A real model's cell otherwise leaves gigabytes
behind (6.6–12 GiB for a 100-step SmolLM2-135M cell), and a grid of them fills a disk. A
failed cell's run is deleted whole (`discard_run`): the next study runs that cell again from
its start, under a new run name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Optional

import yaml
from minio.deleteobjects import DeleteObject
from minio.error import MinioException

from heterorl.processes import run_supervisor
from heterorl.stack import services_for_run
from lab.study_verdict import accuracy_at, paired_seeds, verdict_lines
from pipeline.clients.services import ServiceUnavailable, Services
from pipeline.weights.store import NETWORK_ERRORS, CheckpointStore, connect_s3
from pipeline.config import ConfigError, config_from_text, load_config
from pipeline.records.metrics import read_metrics
from pipeline.weights.policy import prune_policies
from pipeline.weights.recovery import recovery_store

QUICK_STEPS = 50
QUICK = {"losses": "gepo,grpo", "steps": QUICK_STEPS,
         "overrides": [f"learner.max_steps={QUICK_STEPS}", "eval.every=10"]}
"""`--quick`: a small grid of shorter runs (max delays: `quick_max_delays`)."""


def quick_max_delays(grid: list[int], steps: int = QUICK["steps"]) -> list[int]:
    """The config grid's smallest max delay and its largest one below `steps` (a larger one
    could never bind in a run that short)."""
    reachable = [d for d in grid if d < steps] or [min(grid)]
    return sorted({min(grid), max(reachable)})


def _cell_settings(spec: dict) -> Optional[dict]:
    """What a cell runs with: its config file's values with its `--set` overrides applied and
    validated (no environment), so comments, layout, where the file lies and how a value is
    written do not matter, nor whether it came from the file or from `--set` (a config frozen
    at a pilot's rate reuses the pilot's cells). None if the record no longer validates."""
    try:
        return config_from_text(spec["config_text"], "recorded in cell.json", spec["overrides"],
                                env={}).model_dump(mode="json")
    except (ConfigError, KeyError, TypeError):
        return None


def _same_cell(recorded: dict, spec: dict) -> bool:
    """Same loss, max delay and seed, and the same settings (`_cell_settings`)."""
    settings = _cell_settings(recorded)
    return all(recorded.get(k) == spec[k] for k in ("loss", "max_delay", "seed")) and \
        settings is not None and settings == _cell_settings(spec)


def _cell_name(loss: str, max_delay: int, seed: int) -> str:
    return f"{loss}-d{max_delay}-s{seed}"


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _cell_record(cell_dir: Path, loss: str, max_delay: int, seed: int) -> dict:
    summary = json.loads((cell_dir / "summary.json").read_text())
    learner = json.loads((cell_dir / "learner_summary.json").read_text())
    steps = read_metrics(cell_dir / "metrics.jsonl", "learner")
    evals = sorted(read_metrics(cell_dir / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
    tokens, sequences = sum(s.get("completion_tokens", 0) for s in steps), sum(s.get("sequences", 0) for s in steps)
    return {
        "loss": loss, "max_delay": max_delay, "seed": seed, "run": summary["run"], "steps": len(steps),
        "accuracy_at_start": evals[0]["accuracy_sampled"], "best_accuracy": max(e["accuracy_sampled"] for e in evals),
        "last_accuracy": evals[-1]["accuracy_sampled"],
        "eval_curve": [[e["policy_version"], e["accuracy_sampled"]] for e in evals],
        "max_staleness_used": learner["max_staleness_used"], "mean_staleness_used": learner["mean_staleness_used"],
        "staleness_histogram": learner["staleness_histogram"],
        "mean_completion_tokens": tokens / sequences if sequences else None,
        "groups_used": learner["groups_used"], "groups_dropped": learner["groups_dropped"],
        "mean_learner_sampler_kl": _mean([s.get("kl") for s in steps]),
        "mean_iw_variance": _mean([s.get("iw_var") for s in steps]),
        "mean_clip_fraction": _mean([s.get("clip_frac") for s in steps]),
        "clip_fraction_per_step": [s.get("clip_frac") for s in steps],
        "kl_iw_var_per_step": [[s.get("kl"), s.get("iw_var")] for s in steps],
        # every step's batch under all three weight families (Theorem 1 like for like)
        "weight_variances_per_step": [[s.get("kl"), s.get("var_token_ratio"), s.get("var_sequence_ratio"),
                                       s.get("var_group_weight")] for s in steps],
        "wall_seconds": summary["wall_seconds"],
        "eval_samples": evals[0].get("n_samples", None) or _eval_setting(cell_dir, "n_samples"),
        "eval_problems": evals[0].get("n_problems", None) or _eval_setting(cell_dir, "problems"),
        "groups_generated": sum(s.get("generated", 0) for s in summary.get("sampler_stats", {}).values()),
        "sampler_stalls": sum(s.get("stalls_behind", 0) for s in summary.get("sampler_stats", {}).values()),
        "forced_refreshes": sum(s.get("forced_refreshes", 0) for s in summary.get("sampler_stats", {}).values()),
    }


def _eval_setting(cell_dir: Path, key: str):
    """eval.n_samples / the number of held-out problems, from the cell's saved config."""
    cfg = yaml.safe_load((cell_dir / "config.yaml").read_text())
    if key == "problems":
        return cfg["eval"]["problems"] or cfg["task"]["eval_size"]
    return cfg["eval"][key]


def _cells(records: list[dict], loss: str, d: int) -> list[dict]:
    return [r for r in records if r["loss"] == loss and r["max_delay"] == d]


def _gap(r: dict) -> float:
    """A cell's best-to-last gap in points."""
    return 100 * (r["best_accuracy"] - r["last_accuracy"])


def _spread(values: list[float], scale: float = 1.0) -> str:
    """Mean (times `scale`), with the range over seeds when there are several."""
    if not values:
        return "–"
    text = f"{scale * statistics.fmean(values):.1f}"
    return text + (f" ({scale * min(values):.1f}–{scale * max(values):.1f})" if len(values) > 1 else "")


def _table(records: list[dict], losses: list[str], delays: list[int]) -> list[str]:
    def cell(loss, d, key):
        return _spread([r[key] for r in _cells(records, loss, d)], 100)

    head = "| loss | " + " | ".join(f"delay {d} Best | delay {d} Last" for d in delays) + " |"
    rule = "|---|" + "---|---|" * len(delays)
    rows = [f"| {loss} | " + " | ".join(f"{cell(loss, d, 'best_accuracy')} | {cell(loss, d, 'last_accuracy')}"
                                        for d in delays) + " |" for loss in losses]
    return [head, rule, *rows]


def claims(records: list[dict], delays: list[int]) -> dict:
    """The paper's two claims on these records (None where a cell is missing):

    - `gepo_drop_pct`: GEPO's Last at the largest max delay below its Best at max delay 0,
      in % of that Best (the paper: under 3 %), on the seeds with both cells;
    - `gap_reduction_pct`: how much smaller GEPO's best-to-last gap is than GSPO's at the
      largest max delay, in % (the paper: 85 %, 1.8 vs 12.0 points)."""
    first, last = delays[0], delays[-1]
    seeds = paired_seeds(records, "gepo", last, first)
    best0 = [r["best_accuracy"] for r in _cells(records, "gepo", first) if r["seed"] in seeds]
    last_far = [r["last_accuracy"] for r in _cells(records, "gepo", last) if r["seed"] in seeds]
    gepo_gap = [_gap(r) for r in _cells(records, "gepo", last)]
    gspo_gap = [_gap(r) for r in _cells(records, "gspo", last)]
    out: dict = {"first_delay": first, "last_delay": last, "gepo_drop_pct": None, "gap_reduction_pct": None,
                 "gepo_gap": _mean(gepo_gap), "gspo_gap": _mean(gspo_gap), "gepo_drop_seeds": seeds,
                 "gepo_unpaired_seeds": len(_cells(records, "gepo", first)) + len(_cells(records, "gepo", last))
                 > 2 * len(seeds)}
    if best0 and last_far and statistics.fmean(best0) > 0:
        out["gepo_drop_pct"] = 100 * (statistics.fmean(best0) - statistics.fmean(last_far)) / statistics.fmean(best0)
    if gepo_gap and gspo_gap and statistics.fmean(gspo_gap) >= MIN_TESTABLE_GAP:
        out["gap_reduction_pct"] = 100 * (1 - statistics.fmean(gepo_gap) / statistics.fmean(gspo_gap))
    return out


SMOOTHING = 3
"""Evaluations averaged in the report's noise-robust view of Best and Last."""
MIN_TESTABLE_GAP = 1.0
"""GSPO's best-to-last gap (points) below which the second claim is not tested: GEPO's gap
being "85 % smaller" than a gap of a few hundredths of a point says nothing (the paper's
GSPO gap is 12 points)."""


def _smoothed(r: dict, window: int = SMOOTHING) -> dict:
    """The cell with Best / Last taken on the moving average of `window` consecutive evaluations
    (Best: the highest average, Last: the final one); as it is with fewer evaluations."""
    ys = [y for _, y in r["eval_curve"]]
    if len(ys) < window or window == 1:
        return r
    averages = [statistics.fmean(ys[i:i + window]) for i in range(len(ys) - window + 1)]
    return {**r, "best_accuracy": max(averages), "last_accuracy": averages[-1], "evaluations_averaged": window}


def kl_quantiles(r: dict) -> Optional[dict]:
    """p50, p95 and max over a cell's steps of the per-token learner–sampler KL (its mean is
    ruled by a few spikes); None for a cell without steps."""
    kls = sorted(k for k, _ in r["kl_iw_var_per_step"] if k is not None)
    if not kls:
        return None
    p95 = statistics.quantiles(kls, n=20, method="inclusive")[-1] if len(kls) > 1 else kls[0]
    return {"p50": statistics.median(kls), "p95": p95, "max": kls[-1]}


def _kl_columns(r: dict) -> str:
    q = kl_quantiles(r)
    return " | ".join(f"{q[k]:.2e}" for k in ("p50", "p95", "max")) if q else "– | – | –"


def _fraction(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.3f}"


def late_slope(r: dict, fraction: float = 0.25) -> Optional[float]:
    """Least-squares slope of held-out accuracy over the last `fraction` of the run, in points
    per 100 steps: near 0 is a plateau, clearly below 0 a collapse, above 0 still learning."""
    curve = r["eval_curve"]
    start = curve[-1][0] * (1 - fraction) if curve else 0
    return slope_per_100_steps([p for p in curve if p[0] >= start], min_points=3)


def last_quarter_share(r: dict, fraction: float = 0.25) -> Optional[float]:
    """The share of a run's gain (last evaluation − first) made over its last `fraction` of
    versions, evaluations linearly interpolated between: a curve whose last quarter adds at most
    20 % of its gain has flattened. None without a gain to share."""
    curve = r["eval_curve"]
    if len(curve) < 2 or curve[-1][1] <= curve[0][1]:
        return None
    end = curve[-1][0]
    return (curve[-1][1] - accuracy_at(curve, end - fraction * (end - curve[0][0]))) / (curve[-1][1] - curve[0][1])


def slope_per_100_steps(curve: list[list[float]], min_points: int) -> Optional[float]:
    """Least-squares slope of (step, accuracy) points, in accuracy points per 100 steps; None
    with fewer than `min_points` points."""
    if len(curve) < min_points:
        return None
    xs, ys = zip(*[(x, 100 * y) for x, y in curve])
    return 100 * statistics.linear_regression(xs, ys).slope


def _gap_table(records: list[dict], losses: list[str], delays: list[int], heading: str = "##") -> list[str]:
    lines = [f"{heading} Best-to-last gap (points; mean over seeds, range in brackets)", "",
             "| loss | " + " | ".join(f"max delay {d}" for d in delays) + " | mean |",
             "|---|" + "---|" * (len(delays) + 1)]
    for loss in losses:
        cols = [_spread([_gap(r) for r in _cells(records, loss, d)]) for d in delays]
        every = [_gap(r) for r in records if r["loss"] == loss]
        lines.append(f"| {loss} | " + " | ".join(cols) + (f" | {statistics.fmean(every):.1f} |" if every else " | – |"))
    return lines


def _bars(c: dict) -> list[str]:
    """The paper's two bars, as sentences (see `claims`)."""
    lines = []
    if c["gepo_drop_pct"] is not None:
        # Over several seeds the mean is no verdict: the interval over them decides (the next section).
        several = len(c.get("gepo_drop_seeds") or []) > 1
        said = ((f"{'under' if c['gepo_drop_pct'] < 3 else 'above'} the bar on the mean of the seeds; the verdict, "
                 "with its interval over them, is the next section's") if several
                else 'holds' if c['gepo_drop_pct'] < 3 else 'does not hold')
        lines.append(f"- GEPO's Last at max delay {c['last_delay']} is {c['gepo_drop_pct']:.1f} % below its Best "
                     f"at max delay {c['first_delay']} (bar: under 3 %): {said}" +
                     (f" (on seed{'s' * (len(c['gepo_drop_seeds']) > 1)} {', '.join(map(str, c['gepo_drop_seeds']))}: "
                      "the seeds with both cells)."
                      if c.get("gepo_unpaired_seeds") else "."))
    if c["gap_reduction_pct"] is not None:
        lines.append(f"- GEPO's best-to-last gap at max delay {c['last_delay']} is {c['gepo_gap']:.1f} points, "
                     f"GSPO's {c['gspo_gap']:.1f}: {c['gap_reduction_pct']:.0f} % smaller (bar: at least 85 %): "
                     f"{'holds' if c['gap_reduction_pct'] >= 85 else 'does not hold'}.")
    elif c["gspo_gap"] is not None:
        lines.append(f"- GSPO's best-to-last gap at max delay {c['last_delay']} is {c['gspo_gap']:.1f} points "
                     f"(under {MIN_TESTABLE_GAP:.0f}): there is no gap for GEPO to be 85 % smaller than; the bar "
                     "cannot be tested.")
    return lines


ANALYSIS_MARKER = "<!-- analysis: written by a person, kept when the report is regenerated -->"


def write_report(out: Path, records: list[dict], losses: list[str], delays: list[int], command: str,
                 averaged: int = 1) -> None:
    """delay_study.md / .json, delay_verdict.json and the plots; `averaged` > 1: Best and Last
    are each the mean of that many consecutive evaluations (`study.evaluations_averaged`)."""
    records = [_smoothed(r, averaged) for r in records]
    (out / "delay_study.json").write_text(json.dumps(records, indent=1))
    md_path = out / "delay_study.md"
    old = md_path.read_text() if md_path.exists() else ""
    analysis = old[old.index(ANALYSIS_MARKER):] if ANALYSIS_MARKER in old else ""
    starts = [r["accuracy_at_start"] for r in records]
    start = f"{100 * _mean(starts):.1f} %" + (
        f"; {100 * min(starts):.1f}–{100 * max(starts):.1f} % on the seeds' own evaluation draws"
        if max(starts) - min(starts) >= 5e-4 else "")
    seeds = sorted({r["seed"] for r in records})
    lines = [
        "# Delay study", "", f"Command: `{command}`", "",
        f"Held-out accuracy (mean exact match over {int(records[0]['eval_samples'])} samples per problem, "
        f"{int(records[0]['eval_problems'])} problems, in %); every cell starts from the same base model "
        f"({start}). " + (f"Best = the highest mean of {averaged} consecutive evaluations, Last = the mean of "
                   f"the final {averaged} (`study.evaluations_averaged`). " if averaged > 1 else
                   "Best = highest evaluated version, Last = the final version. ") +
        f"Seeds: {', '.join(map(str, seeds))}" + (" (mean, and the range over seeds in brackets)."
                                                  if len(seeds) > 1 else "."), "",
        *_table(records, losses, delays), "",
        *_gap_table(records, losses, delays)]
    lines += ["", "## Staleness actually used, completion length, KL, importance-weight variance, sampler waste", "",
              "IW variance is each loss's own weight: per token for grpo, per sequence for gspo and gepo. "
              "Late slope: the least-squares slope of held-out accuracy over the last quarter of the run, in "
              "points per 100 steps (about 0: a plateau; clearly negative: a collapse). Last quarter: the share "
              "of the run's gain (last evaluation − first) made over its last quarter of versions, evaluations "
              "linearly interpolated (at most 20 %: the curve has flattened).", "",
              "KL: the per-token learner–sampler KL of each step's batch (k3), its median, 95th percentile and "
              "maximum over the run's steps. Clip: the mean over steps of the fraction clipped (tokens for grpo, "
              "sequences for gspo and gepo).", "",
              "| loss | max delay | seed | steps | max τ used | mean τ used | mean completion tokens | groups used "
              "| dropped | generated | sampler stalls | forced refreshes | KL p50 | KL p95 | KL max | clip | mean IW var "
              "| late slope | last quarter | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (losses.index(r["loss"]), r["max_delay"], r["seed"])):
        tokens = r.get("mean_completion_tokens")
        lines.append(f"| {r['loss']} | {r['max_delay']} | {r['seed']} | {r.get('steps', '–')} | "
                     f"{r['max_staleness_used']} | {r['mean_staleness_used']:.2f} | "
                     f"{'–' if tokens is None else f'{tokens:.1f}'} | {r['groups_used']} | {r['groups_dropped']} | "
                     f"{r['groups_generated']} | {r['sampler_stalls']} | {r['forced_refreshes']} | "
                     f"{_kl_columns(r)} | {_fraction(r.get('mean_clip_fraction'))} | {r['mean_iw_variance']:.2e} | "
                     f"{'–' if (slope := late_slope(r)) is None else f'{slope:+.1f}'} | "
                     f"{'–' if (share := last_quarter_share(r)) is None else f'{100 * share:.0f} %'} | "
                     f"{r['wall_seconds']} |")
    if "gepo" in losses and len(delays) > 1:
        paired = paired_seeds(records, "gepo", delays[-1], delays[0])
        first = [r["last_accuracy"] for r in _cells(records, "gepo", delays[0]) if r["seed"] in paired]
        last = [r["last_accuracy"] for r in _cells(records, "gepo", delays[-1]) if r["seed"] in paired]
        if first and last:
            lines += ["", f"GEPO degradation (Last) from max delay {delays[0]} to {delays[-1]}: "
                          f"{100 * (statistics.fmean(first) - statistics.fmean(last)):.1f} points."]
        lines += ["", "## The paper's bars, computed", "",
                  *(_bars(claims(records, delays)) or [f"- Not yet computable: they need GEPO's cells at max delays "
                                                       f"{delays[0]} and {delays[-1]}."])]
        first_claim, first_claim_data = verdict_lines(records, losses, delays)
        (out / "delay_verdict.json").write_text(json.dumps(first_claim_data, indent=1))
        lines += ["", *first_claim] if first_claim else []
        if averaged == 1:  # single evaluations: the same again on a moving average
            smoothed = [_smoothed(r) for r in records]
            lines += ["", f"## The same on a {SMOOTHING}-evaluation moving average", "",
                      f"A single evaluation is noisy, and Best is the largest of many, so it is biased upward. "
                      f"Here each cell's curve is first averaged over {SMOOTHING} consecutive evaluations: Best is "
                      f"the highest average, Last the average of the final {SMOOTHING}.", "",
                      *_gap_table(smoothed, losses, delays, "###"), "", *_bars(claims(smoothed, delays))]
    lines += ["", "Plots: `accuracy_curves.png`, `kl_and_iw_variance.png`, `iw_variance_vs_kl.png` (each loss's "
                  "own weight), `weight_families_vs_kl.png` (Theorem 1: all three weights on the same batches), "
                  "`staleness_histogram.png`.", ""]
    md_path.write_text("\n".join(lines) + "\n" + (analysis or f"{ANALYSIS_MARKER}\n"))
    _plots(out, records, losses, delays)


def _plots(out: Path, records: list[dict], losses: list[str], delays: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {loss: f"C{i}" for i, loss in enumerate(losses)}
    fig, axes = plt.subplots(1, len(delays), figsize=(4.5 * len(delays), 4), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], delays):
        for r in records:
            if r["max_delay"] == d:
                xs, ys = zip(*r["eval_curve"])
                ax.plot(xs, ys, "o-", color=colors[r["loss"]], label=f"{r['loss']} (seed {r['seed']})")
        ax.set_title(f"max delay {d}")
        ax.set_xlabel("learner step")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("held-out accuracy (sampled)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_curves.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for loss in losses:
        pts = [(k, v) for r in records if r["loss"] == loss for k, v in r["kl_iw_var_per_step"]
               if k is not None and v is not None and k > 0 and v > 0]
        if pts:
            ax.scatter(*zip(*pts), s=8, alpha=0.5, color=colors[loss], label=loss)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("learner–sampler KL (k3, per token)")
    ax.set_ylabel("importance-weight variance")
    ax.set_title("importance-weight variance vs KL, per learner step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "iw_variance_vs_kl.png", dpi=100)
    plt.close(fig)

    # KL and the loss's own IW variance over training, one panel row per quantity, one column per max delay
    fig, axes = plt.subplots(2, len(delays), figsize=(4.5 * len(delays), 6.5), sharex=True, squeeze=False)
    for col, d in enumerate(delays):
        for r in records:
            if r["max_delay"] == d:
                for row, idx in ((0, 0), (1, 1)):
                    ys = [p[idx] for p in r["kl_iw_var_per_step"]]
                    axes[row][col].plot(range(1, len(ys) + 1), [y if y and y > 0 else None for y in ys],
                                        color=colors[r["loss"]], lw=0.8, alpha=0.8, label=f"{r['loss']} s{r['seed']}")
        axes[0][col].set_title(f"max delay {d}")
        axes[1][col].set_xlabel("learner step")
        for row in (0, 1):
            axes[row][col].set_yscale("log")
    axes[0][0].set_ylabel("learner–sampler KL (k3, per token)")
    axes[1][0].set_ylabel("IW variance (the loss's own weight)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "kl_and_iw_variance.png", dpi=100)
    plt.close(fig)

    # Theorem 1 like for like: the three weight families on the same batches, against KL
    far = [r for r in records if r["max_delay"] == delays[-1] and r.get("weight_variances_per_step")]
    if far:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for idx, (name, color) in enumerate((("token ratio p_t/q_t (GRPO)", "C2"),
                                             ("sequence ratio p̄/q̄ (GSPO)", "C1"),
                                             ("group weight p̄/Ê_q[q] (GEPO)", "C0")), start=1):
            pts = [(p[0], p[idx]) for r in far for p in r["weight_variances_per_step"]
                   if p[0] is not None and p[idx] is not None and p[0] > 0 and p[idx] > 0]
            if pts:
                ax.scatter(*zip(*pts), s=6, alpha=0.4, color=color, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("learner–sampler KL (k3, per token)")
        ax.set_ylabel("variance of the weight")
        ax.set_title(f"three weights on the same batches\n(max delay {delays[-1]}, every loss and seed)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "weight_families_vs_kl.png", dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in delays:
        hist: dict[int, int] = {}
        for r in records:
            if r["max_delay"] == d:
                for t, n in r["staleness_histogram"].items():
                    hist[int(t)] = hist.get(int(t), 0) + n
        if hist:
            xs = sorted(hist)
            ax.step(xs, [hist[x] for x in xs], where="mid", label=f"max delay {d}")
    ax.set_xlabel("staleness τ of used groups (steps)")
    ax.set_ylabel("groups")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "staleness_histogram.png", dpi=100)
    plt.close(fig)


def stored_bytes(store: CheckpointStore) -> int:
    """Bytes a run holds in S3: its policy versions and recovery states."""
    return sum(obj.size or 0 for obj in store.client.list_objects(store.bucket, prefix=f"{store.run}/", recursive=True))


def retire_run(store: CheckpointStore, final: int) -> int:
    """Delete what a finished run no longer needs: every policy version but v0 and `final`
    (with the versions its delta chain rests on), and every recovery state. Returns the
    bytes freed."""
    before = stored_bytes(store)
    prune_policies(store, current=final, keep_from=final)
    states = recovery_store(store)
    states.prune(keep_last=0, current=max(states.list_versions(), default=0))
    return before - stored_bytes(store)


def discard_run(store: CheckpointStore) -> int:
    """Delete every object of a run, v0 and the parts of an upload left without a manifest
    included (a failed cell's: the next `heterorl study` runs the cell again from its start,
    under a new run name). Returns the bytes freed."""
    objects = list(store.client.list_objects(store.bucket, prefix=f"{store.run}/", recursive=True))
    for error in store.client.remove_objects(store.bucket, (DeleteObject(obj.object_name) for obj in objects)):
        print(f"  could not delete s3://{store.bucket}/{error.name} ({error.code})", file=sys.stderr)
    return sum(obj.size or 0 for obj in objects) - stored_bytes(store)


def _retire_cell_run(cell_dir: Path, services: Services) -> None:
    """Delete from S3 what a cell's run no longer needs, and say what that freed: a cell that
    wrote its summary keeps v0 and its final policy (`retire_run`); one that failed before it,
    nothing (`discard_run`; a max-delay-16 SmolLM2 cell holds ~9 GB while it trains), its run
    named in the config its `heterorl train` wrote."""
    if (cell_dir / "summary.json").exists():
        summary = json.loads((cell_dir / "summary.json").read_text())
        run, final = summary["run"], summary["final_policy_version"]
    else:
        try:
            run, final = yaml.safe_load((cell_dir / "config.yaml").read_text())["run"]["name"], None
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            return  # it failed before naming a run: nothing of it is in S3
    try:
        store = CheckpointStore(connect_s3(services), services.bucket, run)
        freed = discard_run(store) if final is None else retire_run(store, final)
    except (ServiceUnavailable, MinioException, *NETWORK_ERRORS) as e:
        print(f"  could not delete {run}'s checkpoints from S3 ({e})", file=sys.stderr)
        return
    kept = f"deleted {run}" if final is None else f"kept v0 and v{final} of {run}"
    print(f"  {kept}, freed {freed / 1e9:.2f} GB (--keep-checkpoints keeps every version)", file=sys.stderr)


def run_delay_study(config: Path, losses: list[str], delays: list[int], seeds: list[int], out: Path,
                    overrides: list[str], data_dir: str, command: str, keep_checkpoints: bool = False,
                    report_only: bool = False) -> int:
    """Run the grid's unfinished cells and write the report; `report_only`: start nothing, and
    report the cells already finished in `out` (cells run apart and gathered there)."""
    cfg = load_config(config, [*overrides, f"services.data_dir={data_dir}"])  # a bad config fails before anything starts
    for loss in losses:
        load_config(config, [*overrides, f"learner.loss_type={loss}"])
    out.mkdir(parents=True, exist_ok=True)
    records = []
    stack = contextlib.nullcontext((cfg, None, False)) if report_only else services_for_run(cfg)
    with stack as (_, services, _started):  # every cell is a `heterorl train` on this stack
        cells = [(loss, d, seed) for seed in seeds for d in delays for loss in losses]
        config_text = Path(config).read_text()
        for i, (loss, d, seed) in enumerate(cells, 1):
            cell_dir = out / "cells" / _cell_name(loss, d, seed)
            spec = {"config": str(config), "config_text": config_text, "loss": loss, "max_delay": d,
                    "seed": seed, "overrides": overrides}
            done = (cell_dir / "summary.json").exists() and (cell_dir / "cell.json").exists() and \
                _same_cell(json.loads((cell_dir / "cell.json").read_text()), spec)
            if not done and report_only:
                print(f"[{i}/{len(cells)}] {loss}, max delay {d}, seed {seed}: not run (--report-only)",
                      file=sys.stderr)
                continue
            if not done:  # never reuse a cell made with other settings
                if records:  # what is finished is reported before this cell starts
                    write_report(out, records, losses, delays, command, cfg.study.evaluations_averaged)
                print(f"[{i}/{len(cells)}] {loss}, max delay {d}, seed {seed}", file=sys.stderr)
                if cell_dir.exists():
                    shutil.rmtree(cell_dir)
                cmd = [sys.executable, "-m", "heterorl", "train", "--config", str(config), "--out", str(cell_dir),
                       "--data-dir", data_dir, "--set", f"learner.loss_type={loss}",
                       "--set", f"learner.max_delay_steps={d}", "--set", f"run.seed={seed}",
                       "--set", f"sampler.delays.seed={seed}", "--set", f"run.name=study-{loss}-d{d}-s{seed}"]
                for o in overrides:
                    cmd += ["--set", o]
                returncode = run_supervisor(cmd, env=dict(os.environ))
                (cell_dir / "cell.json").write_text(json.dumps(spec, indent=1))
                if returncode != 0:
                    print(f"heterorl study: cell {_cell_name(loss, d, seed)} failed (exit {returncode}); "
                          f"logs in {cell_dir}/logs/", file=sys.stderr)
                if not keep_checkpoints:
                    _retire_cell_run(cell_dir, services)
                if returncode != 0:
                    return 1
            records.append(_cell_record(cell_dir, loss, d, seed))
    if not records:  # only --report-only gets here without a finished cell
        print(f"heterorl study: no finished cell of this grid in {out}/cells/ to report", file=sys.stderr)
        return 1
    write_report(out, records, losses, delays, command, cfg.study.evaluations_averaged)
    print(f"delay study: {out}/delay_study.md, {out}/delay_study.json")
    return 0
