"""Side-by-side comparison of run directories (`heterorl train`, `heterorl replay`).

Why: the question after two runs is "which loss did better, and at what cost in
stability": final and best held-out accuracy next to the mean KL and importance-weight
variance the learner saw, and how many groups each run used and dropped. Everything is
read from files a run leaves behind (metrics.jsonl, summary.json, config.yaml), and any
field a run lacks (a run still going, an older format, a replay) shows as "-" instead
of failing the whole comparison.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import UserError
from pipeline.records.metrics import read_metrics

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"

COLUMNS = [  # (row key, table header)
    ("run", "run"),
    ("loss", "loss"),
    ("final_accuracy", "final acc"),
    ("best_accuracy", "best acc"),
    ("final_greedy", "final greedy"),
    ("mean_kl", "mean KL"),
    ("iw_var", "IW var"),
    ("groups_used", "used"),
    ("groups_dropped", "dropped"),
    ("steps", "steps"),
    ("final_checkpoint", "final checkpoint"),
]
MISSING = "-"


class CompareError(UserError, ValueError):
    """A directory that cannot be compared; the message is one line."""


# ----------------------------------------------------------------------------- reading a run


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise CompareError(f"{run_dir} is not a directory")
    if not (run_dir / METRICS_FILE).is_file() and not (run_dir / SUMMARY_FILE).is_file():
        raise CompareError(f"{run_dir} has no {METRICS_FILE} (not a run directory)")


def _summary(run_dir: Path) -> dict:
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompareError(f"{path} is not valid JSON ({type(e).__name__} at line {getattr(e, 'lineno', '?')})") \
            from None
    return summary if isinstance(summary, dict) else {}


def _loss_type(run_dir: Path, summary: dict) -> Optional[str]:
    """The summary's loss type; older or unfinished runs only have it in config.yaml."""
    if summary.get("loss_type"):
        return str(summary["loss_type"])
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None
    learner = config.get("learner") if isinstance(config, dict) else None
    loss = learner.get("loss_type") if isinstance(learner, dict) else None
    return str(loss) if loss else None


def _finite(value: Any) -> Optional[float]:
    """A number that can be averaged or plotted, else None (NaN, missing, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def learner_records(run_dir: Path) -> list[dict]:
    """Learner records by step; a step logged twice (a learner that redid it after a crash) counts once, the last."""
    by_step = {r["step"]: r for r in read_metrics(run_dir / METRICS_FILE, "learner") if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def eval_records(run_dir: Path) -> list[dict]:
    """Eval records by policy version, the last one written per version winning."""
    by_version = {r["policy_version"]: r for r in read_metrics(run_dir / METRICS_FILE, "eval")
                  if "policy_version" in r}
    return [by_version[v] for v in sorted(by_version)]


def run_name(run_dir: Path, summary: dict) -> str:
    return str(summary.get("run") or run_dir.name)


# ----------------------------------------------------------------------------- one row per run


def _mean(values: list[Any]) -> Optional[float]:
    finite = [v for v in map(_finite, values) if v is not None]
    return math.fsum(finite) / len(finite) if finite else None


def _last_finite(records: list[dict], key: str) -> Optional[float]:
    """The value of `key` in the last record, if that record has a finite one."""
    return _finite(records[-1].get(key)) if records else None


def _first_present(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def compare_row(run_dir: Path) -> dict:
    """The comparison figures of one run directory; None where the run does not say."""
    run_dir = Path(run_dir)
    _check_run_dir(run_dir)
    summary = _summary(run_dir)
    learner, evals = learner_records(run_dir), eval_records(run_dir)
    sampled = [v for v in (_finite(r.get("accuracy_sampled")) for r in evals) if v is not None]
    last_learner = learner[-1] if learner else {}
    return {
        "run": run_name(run_dir, summary),
        "loss": _loss_type(run_dir, summary),
        "final_accuracy": _first_present(_last_finite(evals, "accuracy_sampled"),
                                         _finite(summary.get("eval_last_accuracy"))),
        "best_accuracy": _first_present(max(sampled) if sampled else None,
                                        _finite(summary.get("eval_best_accuracy"))),
        "final_greedy": _first_present(_last_finite(evals, "accuracy_greedy"),
                                       _finite(summary.get("eval_greedy_after"))),
        "mean_kl": _mean([r.get("kl") for r in learner]),
        "iw_var": _mean([r.get("iw_var") for r in learner]),
        "groups_used": _first_present(last_learner.get("groups_used"), summary.get("groups_used")),
        "groups_dropped": _first_present(last_learner.get("groups_dropped"), summary.get("groups_dropped")),
        "steps": _first_present(last_learner.get("step"), summary.get("final_policy_version")),
        "final_checkpoint": summary.get("final_checkpoint"),
    }


def compare_runs(run_dirs: list[Path]) -> list[dict]:
    """One row per run directory, in the order given (keys: see COLUMNS)."""
    return [compare_row(Path(d)) for d in run_dirs]


# ----------------------------------------------------------------------------- table


def format_value(value: Any) -> str:
    """Text for one cell: floats with 3 decimals (a tiny non-zero one in 3 significant digits), None as "-"."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        if not math.isfinite(value):
            return MISSING
        text = f"{value:.3f}"
        return f"{value:.2e}" if value != 0 and float(text) == 0 else text
    return str(value)


def format_table(rows: list[dict]) -> str:
    """An aligned text table with a header row: text columns left-aligned, numbers right-aligned."""
    cells = [[header for _, header in COLUMNS]] + [[format_value(row.get(key)) for key, _ in COLUMNS] for row in rows]
    numeric = [all(_is_number(row.get(key)) for row in rows if row.get(key) is not None) and
               any(row.get(key) is not None for row in rows) for key, _ in COLUMNS]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(line, widths, numeric)).rstrip()
             for line in cells]
    return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------- plot


def _rolling_mean(values: list[float], window: int) -> list[float]:
    return [math.fsum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def plot_comparison(run_dirs: list[Path], out_png: Path) -> Path:
    """One PNG: held-out accuracy (sampled) vs policy version, smoothed training reward and
    learner–sampler KL vs step. (Replays of one recording share the reward curve by
    construction: it is the recorded groups' reward; accuracy and KL are what differ.)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = compare_runs(run_dirs)  # validates every directory before anything is drawn
    fig, (ax_acc, ax_reward, ax_kl) = plt.subplots(1, 3, figsize=(17, 4.5))
    for run_dir, row in zip(map(Path, run_dirs), rows):
        label = f"{row['run']} ({row['loss'] or MISSING})"
        evals = [r for r in eval_records(run_dir) if _finite(r.get("accuracy_sampled")) is not None]
        line, = ax_acc.plot([r["policy_version"] for r in evals], [r["accuracy_sampled"] for r in evals], "o-",
                            label=label)
        learner = [r for r in learner_records(run_dir) if _finite(r.get("reward_mean")) is not None]
        window = max(1, len(learner) // 10)
        ax_reward.plot([r["step"] for r in learner], _rolling_mean([r["reward_mean"] for r in learner], window),
                       color=line.get_color(), label=f"{label}, {window}-step mean")
        kl = [r for r in learner if _finite(r.get("kl")) is not None]
        ax_kl.plot([r["step"] for r in kl], _rolling_mean([r["kl"] for r in kl], max(1, len(kl) // 10)),
                   color=line.get_color(), label=label)
    ax_acc.set_xlabel("policy version")
    ax_acc.set_ylabel("held-out accuracy (sampled)")
    ax_acc.set_ylim(0, 1)
    ax_acc.set_title("held-out accuracy")
    ax_acc.legend(loc="lower right", fontsize="small")
    ax_reward.set_xlabel("learner step")
    ax_reward.set_ylabel("training reward (rolling mean)")
    ax_reward.set_title("training reward")
    ax_reward.legend(loc="best", fontsize="small")
    ax_kl.set_xlabel("learner step")
    ax_kl.set_ylabel("KL(learner ‖ sampler), rolling mean")
    ax_kl.set_title("learner–sampler KL")
    ax_kl.legend(loc="best", fontsize="small")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
