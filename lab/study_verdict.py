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

The between-seed spread is pooled over the losses at one delay (the same noise sources act
on each loss's cells, and three losses' seeds give three times the degrees of freedom of one:
with two seeds a single loss's spread rests on one difference, and two seeds that happen to
agree would claim certainty). The difference between two losses' degradations, paired by seed,
uses its own spread. Pooling assumes every loss varies as much between seeds; so each loss's
row also gives the interval from its own seeds alone, and where the two verdicts differ the
decision rests on that assumption.
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


def _per_seed(records: list[dict], loss: str, delay: int, base_delay: int, seeds: list[int]) -> list[float]:
    return [degradation_pct(_cell(records, loss, base_delay, s)["best_accuracy"],
                            _cell(records, loss, delay, s)["last_accuracy"]) for s in seeds]


def degradation(records: list[dict], loss: str, delay: int, base_delay: int = 0,
                spread: Optional[tuple[float, int]] = None) -> Optional[dict]:
    """A loss's degradation from `base_delay` to `delay`: per seed, mean, 95 % interval (with the
    pooled `spread` if given), the verdict on the 3 % bar, and the seeds that would decide it."""
    seeds = paired_seeds(records, loss, delay, base_delay)
    if not seeds:
        return None
    per_seed = _per_seed(records, loss, delay, base_delay, seeds)
    low, high = t_interval(per_seed, spread)
    own_low, own_high = t_interval(per_seed)
    return {"loss": loss, "max_delay": delay, "seeds": seeds, "per_seed_pct": per_seed,
            "mean_pct": statistics.fmean(per_seed), "ci95_pct": [low, high],
            "spread_pct": list(spread) if spread else None, "verdict": verdict(low, high),
            "seeds_to_decide": seeds_to_decide(per_seed, spread=spread),
            "ci95_own_spread_pct": [own_low, own_high], "verdict_own_spread": verdict(own_low, own_high)}


def difference(records: list[dict], loss_a: str, loss_b: str, delay: int, base_delay: int = 0) -> Optional[dict]:
    """loss_a's degradation minus loss_b's, paired by seed (the seeds both have), with its interval."""
    seeds = sorted(set(paired_seeds(records, loss_a, delay, base_delay)) &
                   set(paired_seeds(records, loss_b, delay, base_delay)))
    if not seeds:
        return None
    per_seed = [a - b for a, b in zip(_per_seed(records, loss_a, delay, base_delay, seeds),
                                      _per_seed(records, loss_b, delay, base_delay, seeds))]
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


def verdict_lines(records: list[dict], losses: list[str], delays: list[int]) -> tuple[list[str], dict]:
    """The report's section on the first claim, and the same as data (delay_study.json's `verdict`)."""
    base, large = delays[0], [d for d in delays if d > delays[0]]
    data: dict = {"bar_pct": CLAIM_PCT, "base_delay": base, "degradation": [], "differences": []}
    rows, diff_rows = [], []
    for d in large:
        groups = [_per_seed(records, loss, d, base, paired_seeds(records, loss, d, base)) for loss in losses]
        spread = pooled_spread(groups)
        for loss in losses:
            if v := degradation(records, loss, d, base, spread if spread[1] else None):
                data["degradation"].append(v)
                rows.append(f"| {loss} | {d} | {len(v['seeds'])} | {', '.join(_fmt(x) for x in v['per_seed_pct'])} "
                            f"| {_fmt(v['mean_pct'])} | [{_fmt(v['ci95_pct'][0])}, {_fmt(v['ci95_pct'][1])}] "
                            f"| {v['verdict']} | {_need(v['seeds_to_decide'])} "
                            f"| [{_fmt(v['ci95_own_spread_pct'][0])}, {_fmt(v['ci95_own_spread_pct'][1])}] "
                            f"{v['verdict_own_spread']} |")
        for a, b in (("gepo", "gspo"), ("gepo", "grpo")):
            if a in losses and b in losses and (v := difference(records, a, b, d, base)):
                data["differences"].append(v)
                diff_rows.append(f"| {a} − {b} | {d} | {len(v['seeds'])} | "
                                 f"{', '.join(_fmt(x) for x in v['per_seed_pct'])} | {_fmt(v['mean_pct'])} | "
                                 f"[{_fmt(v['ci95_pct'][0])}, {_fmt(v['ci95_pct'][1])}] | {v['verdict']} | "
                                 f"{_need(v['seeds_to_decide'])} |")
    if not rows:
        return [], data
    lines = ["## The first claim, with an interval", "",
             f"Degradation = (Best at max delay {base} − Last at the larger delay) / Best at max delay {base}, "
             f"in % of that Best, per seed; the paper's claim for GEPO: under {CLAIM_PCT:g} %. Interval: 95 %, "
             "Student's t over seeds (each seed is an independent replicate of training and evaluation; "
             "lab/study_verdict.py says why not a bootstrap), with the between-seed spread pooled over "
             "the losses at that delay. Verdict: holds if the whole interval is under "
             "the bar, fails if all of it is above, else undecided. Seeds to decide: the fewest seeds whose "
             "interval would exclude the bar if the mean and the between-seed spread stayed as measured. "
             "Own seeds only: the same interval from that loss's seeds alone, without pooling (where its "
             "verdict differs, the decision rests on the losses varying alike between seeds).", "",
             "| loss | max delay | seeds | per seed (%) | mean (%) | 95 % interval | verdict | seeds to decide "
             "| own seeds only |",
             "|---|---|---|---|---|---|---|---|---|", *rows]
    if diff_rows:
        lines += ["", "Difference of two losses' degradations, paired by seed (points of %; negative: the first "
                      "loss loses less to delay). Seeds to decide: for the interval to exclude 0.", "",
                  "| losses | max delay | seeds | per seed | mean | 95 % interval | verdict | seeds to decide |",
                  "|---|---|---|---|---|---|---|---|", *diff_rows]
    return lines, data
