"""The delay study's first claim, decided with an interval: pure arithmetic on the cells' records.

The paper's first claim: under a large max delay a loss keeps its accuracy, i.e. its
degradation, (Best at max delay 0 − Last at the large delay) / Best at max delay 0, is under
3 %. One seed decides nothing, so each loss's degradation gets a 95 % interval over seeds.

The method: a seed is one independent replicate of the whole experiment (its two cells,
max delay 0 and the large delay, trained and evaluated with that seed's draws), so the
spread of the per-seed degradations holds every source of noise at once: training, sampling
and the evaluations' own draws. The interval is Student's t over seeds, mean ± t(n−1) · s/√n.

Why not a bootstrap over held-out problems: the cells record each evaluation's accuracy, not
which problems it solved, and treating two evaluations as independent binomials would be
wrong the other way: every cell is evaluated on the same held-out problems, so a model's
Best and Last share the problems' difficulty, and their difference is far less noisy than two
independent draws (on the toy, the two seeds' degradations differ by 0-1.8 points, where
independent binomials over its 200 problems give each one a standard deviation of about 7.6). And why not a bootstrap over
seeds: with 2–3 seeds it has only 3–10 distinct resamples. The t interval is exact for
normal per-seed values and honest about how few seeds there are (t(1) = 12.7, t(2) = 4.3).

Each loss's interval and verdict rest on its own seeds. Beside them, the between-seed spread
pooled over the losses at one delay (the same noise sources act on each loss's cells, and
three losses' seeds give three times the degrees of freedom of one); pooling assumes every
loss varies as much between seeds, so it is shown, never used instead: where the two verdicts
differ, the pooled one rests on that assumption. The difference between two losses'
degradations, paired by seed, uses its own spread.

At matched data age (`lag_matched`): a run at max delay D trains at version v on data about
τ̄ versions old (τ̄: the cell's mean staleness used), so a loss that learns exactly as well per
step of fresh data, only τ̄ steps late, scores at v what the max-delay-0 run scored at v − τ̄.
The degradation at matched age compares Last at D with the max-delay-0 curve (linearly
interpolated between its evaluations) at Last's versions minus τ̄: what remains is what the
delay costs beyond lag. The paper's degradation minus this one is the share that is lag.
`seeds_to_decide` says how many seeds the interval would need to exclude the bar if the mean
and the between-seed spread stayed as measured.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

CLAIM_PCT = 3.0
"""The paper's first claim: degradation under 3 % at the largest max delay."""

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 97.5 % quantile for 1..30 degrees of freedom (beyond: the normal's 1.96)."""


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96


def _cell(records: list[dict], loss: str, delay: int, seed: int) -> Optional[dict]:
    return next((r for r in records if r["loss"] == loss and r["max_delay"] == delay and r["seed"] == seed), None)


def paired_seeds(records: list[dict], loss: str, delay: int, base_delay: int = 0) -> list[int]:
    """Seeds with both cells of `loss`: max delay `base_delay` and `delay`."""
    return sorted({r["seed"] for r in records if r["loss"] == loss and r["max_delay"] == delay
                   and _cell(records, loss, base_delay, r["seed"]) is not None})


def degradation_pct(best0: float, last: float) -> float:
    """(Best at max delay 0 − Last at the large delay) / Best at max delay 0, in %."""
    return 100.0 * (best0 - last) / best0 if best0 > 0 else float("nan")


def pooled_spread(groups: list[list[float]]) -> tuple[float, int]:
    """The between-seed standard deviation pooled over groups (each loss's per-seed values at one
    delay), and its degrees of freedom: sum of squares about each group's mean / sum of (n − 1)."""
    df = sum(len(g) - 1 for g in groups if len(g) > 1)
    if df == 0:
        return float("nan"), 0
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups if len(g) > 1)
    return math.sqrt(ss / df), df


def t_interval(values: list[float], spread: Optional[tuple[float, int]] = None) -> tuple[float, float]:
    """95 % Student's t interval of the mean, from the values' own spread or a pooled
    (sd, degrees of freedom); NaNs without a spread."""
    sd, df = spread or ((statistics.stdev(values), len(values) - 1) if len(values) > 1 else (float("nan"), 0))
    if df == 0:
        return float("nan"), float("nan")
    mean, half = statistics.fmean(values), t975(df) * sd / math.sqrt(len(values))
    return mean - half, mean + half


def seeds_to_decide(per_seed: list[float], bar: float = CLAIM_PCT,
                    spread: Optional[tuple[float, int]] = None) -> Optional[float]:
    """The fewest seeds whose t interval would exclude `bar` with the measured mean and spread
    (pooled (sd, df), whose degrees of freedom grow with each seed added, else the values' own);
    None with fewer than two seeds, inf when the mean is on the bar."""
    if len(per_seed) < 2:
        return None
    n0 = len(per_seed)
    sd, df0 = spread or (statistics.stdev(per_seed), n0 - 1)
    mean = statistics.fmean(per_seed)
    if mean == bar:
        return math.inf
    n = n0
    while t975(df0 + n - n0) * sd / math.sqrt(n) >= abs(mean - bar):
        n += 1
        if n > 10_000:
            return math.inf
    return n


def verdict(low: float, high: float, bar: float = CLAIM_PCT) -> str:
    """holds: the whole interval is under the bar; fails: all of it above; else undecided."""
    if math.isnan(low):
        return "undecided"
    return "holds" if high < bar else "fails" if low > bar else "undecided"


def accuracy_at(curve: list[list[float]], version: float) -> float:
    """A cell's held-out accuracy at `version`, linearly interpolated between its evaluations
    ([version, accuracy] pairs, by version); the first or last evaluation outside them."""
    if version <= curve[0][0]:
        return curve[0][1]
    for (v0, a0), (v1, a1) in zip(curve, curve[1:]):
        if version <= v1:
            return a0 + (a1 - a0) * (version - v0) / (v1 - v0)
    return curve[-1][1]


def matched_age_accuracy(base: dict, cell: dict) -> float:
    """What the max-delay-0 cell `base` scored at the versions `cell`'s Last averages (its last
    `evaluations_averaged` evaluations), each less `cell`'s mean staleness used."""
    averaged = cell.get("evaluations_averaged", 1)
    return statistics.fmean(accuracy_at(base["eval_curve"], v - cell["mean_staleness_used"])
                            for v, _ in cell["eval_curve"][-averaged:])


def _per_seed(records: list[dict], loss: str, delay: int, base_delay: int, seeds: list[int],
              matched: bool = False) -> list[float]:
    """Per seed, the degradation (`degradation_pct`): against Best at `base_delay`, or with
    `matched`, against the `base_delay` curve at matched data age (`matched_age_accuracy`)."""
    out = []
    for s in seeds:
        base, cell = _cell(records, loss, base_delay, s), _cell(records, loss, delay, s)
        reference = matched_age_accuracy(base, cell) if matched else base["best_accuracy"]
        out.append(degradation_pct(reference, cell["last_accuracy"]))
    return out


def degradation(records: list[dict], loss: str, delay: int, base_delay: int = 0,
                spread: Optional[tuple[float, int]] = None, matched: bool = False) -> Optional[dict]:
    """A loss's degradation from `base_delay` to `delay` (with `matched`: at matched data age):
    per seed, mean, the 95 % interval on its own seeds, the verdict on the 3 % bar and the seeds
    that would decide it; beside them the same with the pooled `spread`, if given."""
    seeds = paired_seeds(records, loss, delay, base_delay)
    if not seeds:
        return None
    per_seed = _per_seed(records, loss, delay, base_delay, seeds, matched)
    low, high = t_interval(per_seed)
    out = {"loss": loss, "max_delay": delay, "seeds": seeds, "per_seed_pct": per_seed,
           "mean_pct": statistics.fmean(per_seed), "ci95_pct": [low, high], "verdict": verdict(low, high),
           "seeds_to_decide": seeds_to_decide(per_seed)}
    if matched:
        out["mean_staleness"] = [_cell(records, loss, delay, s)["mean_staleness_used"] for s in seeds]
    if spread:
        pooled_low, pooled_high = t_interval(per_seed, spread)
        out |= {"spread_pct": list(spread), "ci95_pooled_pct": [pooled_low, pooled_high],
                "verdict_pooled": verdict(pooled_low, pooled_high),
                "seeds_to_decide_pooled": seeds_to_decide(per_seed, spread=spread)}
    return out


def difference(records: list[dict], loss_a: str, loss_b: str, delay: int, base_delay: int = 0,
               matched: bool = False) -> Optional[dict]:
    """loss_a's degradation minus loss_b's (with `matched`: at matched data age), paired by seed
    (the seeds both have), with its interval."""
    seeds = sorted(set(paired_seeds(records, loss_a, delay, base_delay)) &
                   set(paired_seeds(records, loss_b, delay, base_delay)))
    if not seeds:
        return None
    per_seed = [a - b for a, b in zip(_per_seed(records, loss_a, delay, base_delay, seeds, matched),
                                      _per_seed(records, loss_b, delay, base_delay, seeds, matched))]
    low, high = t_interval(per_seed)
    shown = "undecided" if math.isnan(low) or low <= 0 <= high else \
        f"{loss_a} degrades less" if high < 0 else f"{loss_a} degrades more"
    return {"losses": [loss_a, loss_b], "max_delay": delay, "seeds": seeds, "per_seed_pct": per_seed,
            "mean_pct": statistics.fmean(per_seed), "ci95_pct": [low, high], "verdict": shown,
            "seeds_to_decide": seeds_to_decide(per_seed, bar=0.0)}


def _fmt(x: Optional[float]) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:+.1f}"


def _need(n: Optional[float]) -> str:
    return "–" if n is None else "more than 10,000" if n == math.inf else str(int(n))


def _interval(ci: list[float]) -> str:
    return f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _degradation_row(v: dict) -> str:
    pooled = f" | {_interval(v['ci95_pooled_pct'])} {v['verdict_pooled']}" if "ci95_pooled_pct" in v else " | –"
    return (f"| {v['loss']} | {v['max_delay']} | {len(v['seeds'])} | {', '.join(_fmt(x) for x in v['per_seed_pct'])} "
            f"| {_fmt(v['mean_pct'])} | {_interval(v['ci95_pct'])} | {v['verdict']} | {_need(v['seeds_to_decide'])}"
            f"{pooled} |")


def _difference_row(v: dict) -> str:
    a, b = v["losses"]
    return (f"| {a} − {b} | {v['max_delay']} | {len(v['seeds'])} | {', '.join(_fmt(x) for x in v['per_seed_pct'])} "
            f"| {_fmt(v['mean_pct'])} | {_interval(v['ci95_pct'])} | {v['verdict']} | {_need(v['seeds_to_decide'])} |")


def _matched_row(v: dict, paper: Optional[dict]) -> str:
    lag = "–" if paper is None else _fmt(paper["mean_pct"] - v["mean_pct"])
    return (f"| {v['loss']} | {v['max_delay']} | {len(v['seeds'])} | {', '.join(f'{t:.1f}' for t in v['mean_staleness'])} "
            f"| {', '.join(_fmt(x) for x in v['per_seed_pct'])} | {_fmt(v['mean_pct'])} | {_interval(v['ci95_pct'])} "
            f"| {v['verdict']} | {lag} |")


DIFFERENCE_HEAD = ["| losses | max delay | seeds | per seed | mean | 95 % interval | verdict | seeds to decide |",
                   "|---|---|---|---|---|---|---|---|"]


def verdict_lines(records: list[dict], losses: list[str], delays: list[int]) -> tuple[list[str], dict]:
    """The report's section on the first claim, and the same as data (delay_verdict.json)."""
    base, large = delays[0], [d for d in delays if d > delays[0]]
    data: dict = {"bar_pct": CLAIM_PCT, "base_delay": base, "degradation": [], "differences": [],
                  "matched_age": [], "matched_age_differences": []}
    pairs = [(a, b) for a, b in (("gepo", "gspo"), ("gepo", "grpo")) if a in losses and b in losses]
    can_match = all("eval_curve" in r and "mean_staleness_used" in r for r in records)
    for d in large:
        groups = [_per_seed(records, loss, d, base, paired_seeds(records, loss, d, base)) for loss in losses]
        spread = pooled_spread(groups)
        data["degradation"] += [v for loss in losses if (v := degradation(records, loss, d, base,
                                                                          spread if spread[1] else None))]
        data["differences"] += [v for a, b in pairs if (v := difference(records, a, b, d, base))]
        if can_match:
            data["matched_age"] += [v for loss in losses if (v := degradation(records, loss, d, base, matched=True))]
            data["matched_age_differences"] += [v for a, b in pairs
                                                if (v := difference(records, a, b, d, base, matched=True))]
    if not data["degradation"]:
        return [], data
    lines = ["## The first claim, with an interval", "",
             f"Degradation = (Best at max delay {base} − Last at the larger delay) / Best at max delay {base}, "
             f"in % of that Best, per seed; the paper's claim for GEPO: under {CLAIM_PCT:g} %. Interval: 95 %, "
             "Student's t over that loss's own seeds (each seed is an independent replicate of training and "
             "evaluation; lab/study_verdict.py says why not a bootstrap). Verdict: holds if the whole interval is "
             "under the bar, fails if all of it is above, else undecided. Seeds to decide: the fewest seeds whose "
             "interval would exclude the bar if the mean and the between-seed spread stayed as measured. Beside "
             "it, the interval with the between-seed spread pooled over the losses at that delay: shown, not used "
             "instead (it assumes every loss varies as much between seeds).", "",
             "| loss | max delay | seeds | per seed (%) | mean (%) | 95 % interval, own seeds | verdict "
             "| seeds to decide | pooled over losses |",
             "|---|---|---|---|---|---|---|---|---|", *map(_degradation_row, data["degradation"])]
    if data["differences"]:
        lines += ["", "Difference of two losses' degradations, paired by seed (points of %; negative: the first "
                      "loss loses less to delay). Seeds to decide: for the interval to exclude 0.", "",
                  *DIFFERENCE_HEAD, *map(_difference_row, data["differences"])]
    if data["matched_age"]:
        paper = {(v["loss"], v["max_delay"]): v for v in data["degradation"]}
        lines += ["", "## The same at matched data age", "",
                  f"A cell at a larger max delay trains on data τ̄ versions old on average (τ̄: its mean staleness "
                  f"used), so a loss that learned exactly as well per step of fresh data, only τ̄ steps late, would "
                  f"score what the max-delay-{base} cell of its seed scored τ̄ versions earlier. Degradation at "
                  f"matched age = (max delay {base} at Last's versions − τ̄, interpolated between its evaluations, "
                  f"− Last) / the same, in %: what the delay costs beyond lag. Lag: the paper's degradation above "
                  f"minus this one (points of %).", "",
                  "| loss | max delay | seeds | τ̄ per seed | per seed (%) | mean (%) | 95 % interval, own seeds "
                  "| verdict | lag |",
                  "|---|---|---|---|---|---|---|---|---|",
                  *[_matched_row(v, paper.get((v["loss"], v["max_delay"]))) for v in data["matched_age"]]]
        if data["matched_age_differences"]:
            lines += ["", "Difference at matched age, paired by seed:", "", *DIFFERENCE_HEAD,
                      *map(_difference_row, data["matched_age_differences"])]
    return lines, data
