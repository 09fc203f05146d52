"""Per-token learner–sampler KL of SmolLM2-135M-Instruct against the staleness of the data,
one series per learning rate: the KL half of the smollm2_study pilot, from every learner step
recorded so far (the unfinished GPU cells beside this file, and the two CPU probes one folder
up). Writes kl_by_staleness.md, .json and .png here.

    .venv/bin/python docs/results/smollm2_study/gpu_h200_partial/kl_by_staleness.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline.records.metrics import read_metrics  # noqa: E402

HERE = Path(__file__).resolve().parent
BINS = [(0, 0), (1, 2), (3, 5), (6, 10), (11, 15), (16, 24)]
SERIES = {  # label: (metrics file, learning rate, where it ran)
    "lr 1e-5, gepo (H200)": (HERE / "lr-1e-05/gepo-d32/cells/gepo-d32-s0/metrics.jsonl", 1e-5, "H200"),
    "lr 3e-6, gepo (H200)": (HERE / "lr-3e-06/gepo-d32/cells/gepo-d32-s0/metrics.jsonl", 3e-6, "H200"),
    "lr 1e-6, gepo (H200)": (HERE / "lr-1e-06/gepo-d32/cells/gepo-d32-s0/metrics.jsonl", 1e-6, "H200"),
    "lr 1e-6, gspo (H200)": (HERE / "lr-1e-06/gspo-d32/cells/gspo-d32-s0/metrics.jsonl", 1e-6, "H200"),
    "lr 1e-6, grpo (H200)": (HERE / "lr-1e-06/grpo-d32/cells/grpo-d32-s0/metrics.jsonl", 1e-6, "H200"),
    "lr 1e-5, gepo (CPU, first 4 steps)": (HERE.parent / "first_steps/metrics.jsonl", 1e-5, "CPU"),
    "lr 1e-6, gepo (CPU probe, 12 steps)": (HERE.parent / "probe_lr1e-6/metrics.jsonl", 1e-6, "CPU"),
}


def by_staleness(steps: list[dict]) -> dict[str, dict]:
    """Median KL (and the number of steps) per staleness bin; staleness is the step's mean."""
    out = {}
    for lo, hi in BINS:
        kls = [s["kl"] for s in steps if lo <= round(s["staleness_mean"]) <= hi]
        if kls:
            out[f"{lo}-{hi}" if hi > lo else f"{lo}"] = {"kl_p50": statistics.median(kls), "steps": len(kls)}
    return out


def main() -> None:
    table = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (path, lr, where) in SERIES.items():
        steps = read_metrics(path, "learner")
        table[label] = {"lr": lr, "where": where, "steps": len(steps), "by_staleness": by_staleness(steps),
                        "mean_clip_fraction": statistics.fmean(s["clip_frac"] for s in steps)}
        pts = [(s["staleness_mean"], s["kl"]) for s in steps if s["staleness_mean"] > 0 and s["kl"] > 0]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=label,
                   marker="o" if where == "H200" else "x")
    ax.axhspan(1e-3 / 3, 3e-3, color="grey", alpha=0.15, label="paper's regime (KL ~1e-3, x3 either way)")
    ax.set_yscale("log")
    ax.set_xlabel("staleness of the step's data (learner versions)")
    ax.set_ylabel("per-token learner-sampler KL")
    ax.set_title("SmolLM2-135M-Instruct, smollm2_study settings: KL against staleness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "kl_by_staleness.png", dpi=120)
    (HERE / "kl_by_staleness.json").write_text(json.dumps(table, indent=1))
    heads = [f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in BINS]
    lines = ["| series | steps | " + " | ".join(f"staleness {h}" for h in heads) + " | clip fraction |",
             "|---" * (len(heads) + 3) + "|"]
    for label, row in table.items():
        cells = [f"{row['by_staleness'][h]['kl_p50']:.1e} ({row['by_staleness'][h]['steps']})"
                 if h in row["by_staleness"] else "–" for h in heads]
        lines.append(f"| {label} | {row['steps']} | " + " | ".join(cells) + f" | {row['mean_clip_fraction']:.3f} |")
    (HERE / "kl_by_staleness.md").write_text("Median per-token KL (steps in the bin)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
