"""A run's picture: training reward and held-out accuracy over steps, staleness, drops, and
the learner-sampler mismatch on groups the learner's own version sampled."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.records.metrics import read_metrics


def plot_run(run_dir: Path, out_name: str = "report.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    learner = read_metrics(run_dir / "metrics.jsonl", "learner")
    evals = sorted(read_metrics(run_dir / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
    fig, (ax_acc, ax_stale, ax_mismatch) = plt.subplots(1, 3, figsize=(17, 4.5))
    if learner:
        steps = [r["step"] for r in learner]
        ax_acc.plot(steps, [r["reward_mean"] for r in learner], color="tab:blue", alpha=0.35,
                    label="training reward (per step)")
        window = max(1, len(learner) // 10)
        smooth = [sum(r["reward_mean"] for r in learner[max(0, i - window + 1): i + 1])
                  / len(learner[max(0, i - window + 1): i + 1]) for i in range(len(learner))]
        ax_acc.plot(steps, smooth, color="tab:blue", label=f"training reward ({window}-step mean)")
        ax_stale.plot(steps, [r["staleness_mean"] for r in learner], label="mean staleness used")
        ax_stale.plot(steps, [r["staleness_max"] for r in learner], label="max staleness used")
        ax_drop = ax_stale.twinx()
        ax_drop.plot(steps, [r["groups_dropped"] for r in learner], color="tab:red", linestyle="--",
                     label="groups dropped (cumulative)")
        ax_drop.set_ylabel("groups dropped")
        ax_drop.legend(loc="upper right")
    on_policy = [r for r in learner if "mismatch_kl_median" in r]
    if on_policy:
        mismatch_steps = [r["step"] for r in on_policy]
        # A symlog axis: bf16 with matching kernels gives exactly 0, which a log axis cannot show.
        ax_mismatch.plot(mismatch_steps, [r["mismatch_kl_median"] for r in on_policy], "o-", markersize=3,
                         label="KL per token, median")
        ax_mismatch.plot(mismatch_steps, [r["mismatch_kl_p99"] for r in on_policy], "^-", markersize=3,
                         label="KL per token, p99")
        ax_mismatch.set_yscale("symlog", linthresh=1e-6)
        ax_mismatch.set_ylim(bottom=0)
        ax_share = ax_mismatch.twinx()
        ax_share.plot(mismatch_steps, [r["mismatch_share_over_0.1"] for r in on_policy], color="tab:red",
                      linestyle="--", label="share of tokens with |Δ log-prob| > 0.1")
        ax_share.set_ylim(0, max(0.05, max(r["mismatch_share_over_0.1"] for r in on_policy) * 1.2))
        ax_share.legend(loc="upper right", fontsize=8)
        ax_mismatch.legend(loc="upper left", fontsize=8)
    else:
        ax_mismatch.text(0.5, 0.5, "no group sampled by the learner's own version", ha="center", va="center",
                         transform=ax_mismatch.transAxes)
    ax_mismatch.set_xlabel("learner step")
    ax_mismatch.set_title("learner-sampler mismatch, on-policy groups")
    if evals:
        ax_acc.plot([r["policy_version"] for r in evals], [r["accuracy_sampled"] for r in evals], "o-",
                    color="tab:green", label="held-out accuracy (sampled)")
        greedy = [r for r in evals if r.get("accuracy_greedy") == r.get("accuracy_greedy")]
        if greedy:
            ax_acc.plot([r["policy_version"] for r in greedy], [r["accuracy_greedy"] for r in greedy], "s--",
                        color="tab:olive", label="held-out accuracy (greedy)")
    ax_acc.set_xlabel("learner step (= policy version)")
    ax_acc.set_ylabel("accuracy / reward")
    ax_acc.set_ylim(0, 1)
    ax_acc.legend(loc="lower right")
    ax_acc.set_title("reward and held-out accuracy")
    ax_stale.set_xlabel("learner step")
    ax_stale.set_ylabel("staleness (steps)")
    ax_stale.legend(loc="upper left")
    ax_stale.set_title("staleness of used groups, drops")
    summary = run_dir / "summary.json"
    title = json.loads(summary.read_text()).get("run", run_dir.name) if summary.exists() else run_dir.name
    fig.suptitle(title)
    fig.tight_layout()
    path = run_dir / out_name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
