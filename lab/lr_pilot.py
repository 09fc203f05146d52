"""`heterorl study pilot`: does a learning rate give the paper's regime on this model?

Policy drift per step grows roughly with the square of the learning rate, and so does the
learner–sampler KL of delayed data; learning per step grows with the rate. For each rate the
pilot runs two cells of `heterorl study delay` (one loss, one seed): max delay 0, to measure
how fast the model learns with fresh data, and the largest max delay of the config's grid, to
measure the KL delayed data has. Then:

- DIR/pilot.json: one record per rate (`trade_off`), and the verdict (`choose`);
- DIR/pilot.md: the table and the verdict in words;
- DIR/pilot.png: learning per 100 steps against the KL at the largest delay, one point per rate;
- DIR/lr-<rate>/: each rate's two cells, a study directory of their own (finished cells are
  reused, so an interrupted pilot resumes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from lab.study import kl_quantiles, run_delay_study, slope_per_100_steps


@dataclass(frozen=True)
class PilotBar:
    """What a rate must show to be the study's rate (the study's bar, as defaults)."""

    kl_target: float = 1e-3
    """Median per-token KL at the largest max delay the study aims at ..."""
    kl_tolerance: float = 3.0
    """... within this factor either way."""
    gain_points: float = 10.0
    """Held-out points a delay-0 run must gain ..."""
    affordable_steps: int = 1000
    """... within this many steps (what one grid cell can run on this machine)."""

    @property
    def kl_band(self) -> tuple[float, float]:
        """The delayed KL a rate must have: the target, within the tolerance either way."""
        return self.kl_target / self.kl_tolerance, self.kl_target * self.kl_tolerance


def learning_per_100_steps(curve: list[list[float]]) -> Optional[float]:
    """Least-squares slope of held-out accuracy over the whole run, in points per 100 steps."""
    return slope_per_100_steps(curve, min_points=2)


def trade_off(lr: float, fresh: dict, delayed: dict) -> dict:
    """One rate's numbers from its two cells' records (`lab.study` records)."""
    kl = kl_quantiles(delayed) or {"p50": None, "p95": None, "max": None}
    slope = learning_per_100_steps(fresh["eval_curve"])
    return {
        "lr": lr, "steps": fresh["steps"], "largest_delay": delayed["max_delay"],
        "learning_per_100_steps": slope,
        "gain_points": 100 * (fresh["best_accuracy"] - fresh["accuracy_at_start"]),
        "kl_p50_delayed": kl["p50"], "kl_p95_delayed": kl["p95"], "kl_max_delayed": kl["max"],
        "kl_p50_fresh": (kl_quantiles(fresh) or {}).get("p50"),
        "mean_staleness_delayed": delayed["mean_staleness_used"],
        "seconds_per_step_fresh": fresh["wall_seconds"] / max(fresh["steps"], 1),
        "accuracy_curve_fresh": fresh["eval_curve"],
    }


def _steps_to_gain(row: dict, bar: PilotBar) -> Optional[float]:
    """Steps a max-delay-0 run needs to gain `bar.gain_points`, projected from its slope."""
    slope = row["learning_per_100_steps"]
    return 100 * bar.gain_points / slope if slope and slope > 0 else None


def shortfalls(row: dict, bar: PilotBar = PilotBar()) -> list[str]:
    """What keeps a rate from the bar, in words (empty: it qualifies)."""
    low, high = bar.kl_band
    kl, steps = row["kl_p50_delayed"], _steps_to_gain(row, bar)
    out = []
    if kl is None:
        out.append("no delayed KL measured")
    elif kl > high:
        out.append("delayed KL above the target")
    elif kl < low:
        out.append("delayed KL below the target")
    if steps is None or steps > bar.affordable_steps:
        out.append(f"learns under {bar.gain_points:g} points in {bar.affordable_steps} steps")
    return out


def choose(rows: list[dict], bar: PilotBar = PilotBar()) -> dict:
    """The verdict: the rates whose delayed KL is near the target and whose fresh runs gain
    `bar.gain_points` within `bar.affordable_steps` (projected from the measured slope), and
    of those the one that learned fastest with fresh data, or None."""
    fitting = [r for r in rows if not shortfalls(r, bar)]
    chosen = max(fitting, key=lambda r: r["learning_per_100_steps"])["lr"] if fitting else None
    return {"bar": asdict(bar), "qualifying_lrs": sorted(r["lr"] for r in fitting), "chosen_lr": chosen}


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def write_pilot_report(out: Path, rows: list[dict], loss: str, command: str, bar: PilotBar = PilotBar()) -> dict:
    verdict = choose(rows, bar)
    (out / "pilot.json").write_text(json.dumps({"loss": loss, "command": command, "trade_off": rows,
                                                **verdict}, indent=1))
    lines = ["# Learning-rate pilot", "", f"Command: `{command}`", "",
             f"Loss {loss}; per rate, one run at max delay 0 (learning with fresh data) and one at the largest "
             "max delay (the KL delayed data has). Learning per 100 steps: the least-squares slope of held-out "
             "accuracy over the whole max-delay-0 run. KL: per-token learner–sampler KL of each step's batch, "
             "median and 95th percentile over steps.", "",
             "| lr | steps | learning per 100 steps (points) | Best − start at delay 0 (points) "
             f"| steps to gain {bar.gain_points:g} points (projected) | KL p50 at delay 0 | largest delay | mean τ used "
             "| KL p50 there | KL p95 there | s per step | meets the bar |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["lr"]):
        lines.append(f"| {r['lr']:g} | {r['steps']} | {_fmt(r['learning_per_100_steps'], '+.1f')} | "
                     f"{r['gain_points']:+.1f} | {_fmt(_steps_to_gain(r, bar), '.0f')} | "
                     f"{_fmt(r['kl_p50_fresh'], '.1e')} | {r['largest_delay']} | {r['mean_staleness_delayed']:.1f} | "
                     f"{_fmt(r['kl_p50_delayed'], '.1e')} | {_fmt(r['kl_p95_delayed'], '.1e')} | "
                     f"{r['seconds_per_step_fresh']:.1f} | {'; '.join(shortfalls(r, bar)) or 'yes'} |")
    low, high = bar.kl_band
    lines += ["", f"The bar: a median KL at the largest max delay within {low:.1e}–{high:.1e} (around "
                  f"{bar.kl_target:.0e}), and a max-delay-0 run that gains {bar.gain_points:g} points within "
                  f"{bar.affordable_steps} steps (projected from its slope).", ""]
    if verdict["chosen_lr"] is None:
        lines.append("No rate meets both (the last column says what each misses).")
    else:
        lines.append(f"Rates that meet both: {', '.join(f'{x:g}' for x in verdict['qualifying_lrs'])}; the "
                     f"study uses {verdict['chosen_lr']:g} (the fastest to learn).")
    (out / "pilot.md").write_text("\n".join(lines) + "\n\nPlot: `pilot.png`.\n")
    _plot(out, rows, bar)
    return verdict


def _plot(out: Path, rows: list[dict], bar: PilotBar) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.axvspan(*bar.kl_band, color="C2", alpha=0.15,
               label=f"target KL (around {bar.kl_target:.0e})")
    ax.axhline(100 * bar.gain_points / bar.affordable_steps, color="C3", ls="--", lw=1,
               label=f"{bar.gain_points:g} points in {bar.affordable_steps} steps")
    for r in rows:
        if r["kl_p50_delayed"] is None or r["learning_per_100_steps"] is None:
            continue
        ax.errorbar([r["kl_p50_delayed"]], [r["learning_per_100_steps"]], fmt="o", color="C0",
                    xerr=[[0], [max(r["kl_p95_delayed"] - r["kl_p50_delayed"], 0)]], capsize=3)
        ax.annotate(f"lr {r['lr']:g}", (r["kl_p50_delayed"], r["learning_per_100_steps"]),
                    textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"learner–sampler KL at max delay {rows[0]['largest_delay'] if rows else '?'} "
                  "(median over steps; bar to p95)")
    ax.set_ylabel("held-out points per 100 steps at max delay 0")
    ax.set_title("learning-rate pilot: learning speed vs delayed KL")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pilot.png", dpi=100)
    plt.close(fig)


def run_lr_pilot(config: Path, lrs: list[float], loss: str, largest_delay: int, seed: int, out: Path,
                 overrides: list[str], data_dir: str, command: str, keep_checkpoints: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for lr in sorted(set(lrs), reverse=True):
        cells = out / f"lr-{lr:g}"
        status = run_delay_study(config, [loss], [0, largest_delay], [seed], cells,
                                 [*overrides, f"learner.lr={lr:g}"], data_dir, command, keep_checkpoints)
        if status != 0:
            return status
        records = json.loads((cells / "delay_study.json").read_text())
        by_delay = {r["max_delay"]: r for r in records}
        rows.append(trade_off(lr, by_delay[0], by_delay[largest_delay]))
        verdict = write_pilot_report(out, rows, loss, command)
    print(f"pilot: {out}/pilot.md (chosen lr: {verdict['chosen_lr']})")
    return 0
