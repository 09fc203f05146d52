"""The rig's numbers: one row per measured case, the named bottleneck, loadtest.json and the PNG.

Every rate is over the measured window [before, after] of a case (`rig.Rig._snapshot`):
- `groups_per_s`: groups the learner read and judged (its offsets in Redis);
- `steps_per_min`: learner steps ending in the window, between the first and the last;
- `learner_utilization`: the share of the window in optimizer steps (each step's
  `time_train_s`, ending at its record's time, clipped to the window);
- staleness and `dropped_share`: the groups of the update-log entries written in the window;
- Redis: the commands the samplers sent (counted by each sampler's client), per sampler
  per second, and the p50/p99 round trip of a probe client's PING (Redis's own latency);
- the broker's MB/s in (the messages appended to the topic in the window), and the bytes each sampler's link
  carried per published policy version (S3: the weights; Redis: everything else);
- the learner's CPU seconds per group judged, by stage (`cpu_<stage>_s` of its records) and
  for its whole process (the background publisher included);
- `lost` and `used_twice`: the audit of the whole case (`pipeline.records.audit`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from pipeline.config import HeteroConfig

STAGES = ("intake", "screen", "train", "snapshot")


def quantile(values: list[float], q: float) -> Optional[float]:
    """The q-quantile (nearest rank, no interpolation) of `values`; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def train_overlap(records: list[dict], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] spent in optimizer steps: each step ran for `time_train_s` up to its record."""
    total = 0.0
    for r in records:
        end, length = r["time"], r.get("time_train_s", 0.0)
        total += max(0.0, min(end, t1) - max(end - length, t0))
    return total


def steps_per_min(step_ends: list[float]) -> float:
    """Steps per minute from the times steps ended in a window: (k − 1) intervals over their span."""
    ends = sorted(step_ends)
    if len(ends) < 2:
        return 0.0
    return (len(ends) - 1) / (ends[-1] - ends[0]) * 60


def name_bottleneck(row: dict) -> str:
    """What limited this case first, from its row (no I/O; docs/loadtest.md gives the rules)."""
    if row["learner_utilization"] >= 0.9:
        return "learner: its optimizer step (the learner is busy; more samplers only wait)"
    shares = row["learner_wall_share"]
    if row["learner_utilization"] + sum(shares.get(s, 0.0) for s in STAGES if s != "train") >= 0.9:
        stage = max((s for s in STAGES if s != "train"), key=lambda s: shares.get(s, 0.0))
        return f"learner: its {stage} stage"
    if (row.get("validator_utilization") or 0.0) >= 0.9:
        return "validators: their checks (the learner waits for verdicts; add validators)"
    if row["machine_cpu_busy"] >= 0.9:
        return "this machine's CPU (the rig itself: the servers, the samplers' processes and the learner)"
    if row["redis_p99_ms"] is not None and row["redis_p99_ms"] >= 50:
        return "Redis: p99 latency over 50 ms"
    paused = row["sampler_paused_share"]
    if sum(paused.values()) < 0.1:
        return (f"fleet: too few samplers (they never pause: {row['fleet_generating_share']:.0%} of their time "
                f"generating, {row['fleet_loading_weights_share']:.0%} loading weights)")
    reason, share = max(paused.items(), key=lambda kv: kv[1])
    return f"pacing: the samplers pause ({reason}, {share:.0%} of their time) while the learner waits"


def _window(measurement: dict) -> tuple[float, float]:
    return measurement["before"]["time"], measurement["after"]["time"]


def _sampler_totals(snapshot: dict) -> dict[str, dict]:
    out = {}
    for worker in snapshot["workers"].values():
        out.update(worker.get("samplers", {}))
    return out


def case_row(m: dict, cfg: HeteroConfig) -> dict:
    """The report row of one measured case (`rig.Rig.run_case`'s measurement)."""
    t0, t1 = _window(m)
    window = t1 - t0
    n = m["case"]["samplers"]
    before, after = m["before"], m["after"]
    learner = [r for r in m["metrics"] if r.get("kind") == "learner"]
    inside = [r for r in learner if t0 < r["time"] <= t1]
    entries = [e for e in m["updates"] if t0 < e["time"] <= t1 and e.get("kind", "step") == "step"]
    used = [g["staleness"] for e in entries for g in e.get("used", [])]
    dropped = sum(len(e.get("dropped", [])) for e in entries)
    judged = max(0, after["learner_offsets"] - before["learner_offsets"])

    s0, s1 = _sampler_totals(before), _sampler_totals(after)

    def delta(key: str) -> float:
        return sum(float(s1.get(k, {}).get(key) or 0) - float(s0.get(k, {}).get(key) or 0) for k in s1)

    commands: dict[str, float] = {}
    for k, s in s1.items():
        for name, count in s.get("redis_commands", {}).items():
            commands[name] = commands.get(name, 0) + count - s0.get(k, {}).get("redis_commands", {}).get(name, 0)
    versions = max(0, (after["policy_version"] or 0) - (before["policy_version"] or 0))
    probe = [x for x in m["redis_probe_s"] if math.isfinite(x)]
    cpu = {s: sum(r.get(f"cpu_{s}_s", 0.0) for r in inside) / max(1, judged) for s in STAGES}
    learner_cpu = after["cpu_s"]["learner"] - before["cpu_s"]["learner"]
    workers_cpu = sum(after["cpu_s"][w] - before["cpu_s"].get(w, 0.0) for w in after["cpu_s"] if w != "learner")
    machine = (after["machine_busy"] - before["machine_busy"]) / max(1.0, after["machine_total"] - before["machine_total"])
    paused = {k.removesuffix("_s"): delta(k) / (n * window) for k in ("paused_backlog_s", "stalled_behind_s",
                                                                         "paused_spool_full_s", "paused_redis_s")}
    audit = m["audit"]
    row = {
        "samplers": n, "fleet": m["case"]["fleet"], "mode": m["case"]["mode"], "window_s": round(window, 1),
        "groups_per_s": judged / window,
        "groups_used_per_s": len(used) / window,
        "fleet_supply_groups_per_s": m["supply_groups_per_s"],
        "steps_per_min": steps_per_min([r["time"] for r in inside]),
        "learner_utilization": train_overlap(learner, t0, t1) / window,
        "staleness_p50": quantile(used, 0.5), "staleness_p95": quantile(used, 0.95),
        "staleness_max": max(used) if used else None,
        "dropped_share": dropped / (dropped + len(used)) if dropped + len(used) else 0.0,
        "redis_commands_per_sampler_per_s": sum(commands.values()) / (n * window),
        "redis_commands_per_sampler_per_s_by_command": {k: v / (n * window) for k, v in
                                                         sorted(commands.items(), key=lambda kv: -kv[1])},
        "redis_server_commands_per_s": (after["redis_commands"] - before["redis_commands"]) / window,
        "redis_p50_ms": 1000 * quantile(probe, 0.5) if probe else None,
        "redis_p99_ms": 1000 * quantile(probe, 0.99) if probe else None,
        "broker_in_mb_per_s": m["broker_bytes_in_window"] / window / 1e6,
        "policy_versions": versions,
        "link_bytes_per_sampler_per_version": ((delta("s3_bytes") + delta("redis_bytes")) / n / versions
                                               if versions else None),
        "weights_bytes_per_sampler_per_version": delta("s3_bytes") / n / versions if versions else None,
        "learner_cpu_s_per_group": {**cpu, "process": learner_cpu / max(1, judged)},
        "learner_wall_share": {s: sum(r.get(f"time_{s}_s", 0.0) for r in inside) / window for s in STAGES},
        "fleet_generating_share": delta("generating_s") / (n * window),
        "fleet_loading_weights_share": delta("loading_weights_s") / (n * window),
        "sampler_paused_share": paused,
        "machine_cpu_busy": machine,
        "workers_cpu_s_per_sampler_per_s": workers_cpu / (n * window),
        "rss_mb": {"learner": after["rss_mb"].get("learner", 0.0),
                   "samplers_per_sampler": sum(v for k, v in after["rss_mb"].items() if k != "learner") / n},
        "samplers_failed": sum(len(w.get("failed", {})) for w in after["workers"].values()),
        "samplers_that_published": sum(1 for s in s1.values() if (s.get("published") or 0) > 0),
        "produced": audit["produced"], "used": audit["used_in_updates"], "dropped": audit["dropped_stale"],
        "pending": audit["pending_at_end"], "dead_lettered": audit["dead_lettered"],
        "lost": audit["lost"], "used_twice": audit["used_twice"],
        "run": m["case"]["run"], "exit_codes": m["exit_codes"],
        "validators": m["case"].get("validators", 0),
    }
    if row["validators"]:
        latency = m.get("verdict_latency_s") or []
        judging = {v: after["validators_judging_s"].get(v, 0.0) - before.get("validators_judging_s", {}).get(v, 0.0)
                   for v in after.get("validators_judging_s", {})}
        row.update(verdict_latency_p50_s=quantile(latency, 0.5) if latency else None,
                   verdict_latency_p95_s=quantile(latency, 0.95) if latency else None,
                   validator_utilization=(sum(judging.values()) / (len(judging) * window)) if judging else None)
    row["bottleneck"] = name_bottleneck(row)
    return row


def failed_row(case, reason: str, cpu_before: tuple[float, float], cpu_after: tuple[float, float]) -> dict:
    """The row of a case this machine could not hold: why, and how busy its CPU was meanwhile."""
    busy = (cpu_after[0] - cpu_before[0]) / max(1.0, cpu_after[1] - cpu_before[1])
    return {"samplers": case.samplers, "fleet": case.fleet, "mode": case.mode, "failed": reason,
            "machine_cpu_busy": busy, **{k: None for k in ROW_NUMBERS},
            "bottleneck": f"failed: {reason}" + (" (this machine's CPU was saturated)" if busy >= 0.9 else "")}


ROW_NUMBERS = ("groups_per_s", "groups_used_per_s", "fleet_supply_groups_per_s", "steps_per_min",
               "learner_utilization", "staleness_p50", "staleness_p95", "staleness_max", "dropped_share",
               "redis_commands_per_sampler_per_s", "redis_p99_ms", "broker_in_mb_per_s", "lost", "used_twice")


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(rows: list[dict]) -> str:
    checked_by_validators = any(r.get("validators") for r in rows)
    head = ("samplers", "groups/s", "steps/min", "util", "stale p50/p95/max", "dropped", "redis cmd/smp/s",
            "redis p99 ms", "broker MB/s", "lost", "twice", "bottleneck") + (
        ("validators", "verdict p50/p95 s", "validator util") if checked_by_validators else ())
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        extra = ([str(r.get("validators") or 0),
                  f"{_fmt(r.get('verdict_latency_p50_s'))}/{_fmt(r.get('verdict_latency_p95_s'))}",
                  _fmt(r.get("validator_utilization"))] if checked_by_validators else [])
        lines.append(" | ".join([
            str(r["samplers"]), _fmt(r["groups_per_s"]), _fmt(r["steps_per_min"], 1), _fmt(r["learner_utilization"]),
            f"{_fmt(r['staleness_p50'])}/{_fmt(r['staleness_p95'])}/{_fmt(r['staleness_max'])}",
            _fmt(r["dropped_share"], 3), _fmt(r["redis_commands_per_sampler_per_s"]), _fmt(r["redis_p99_ms"], 1),
            _fmt(r["broker_in_mb_per_s"]), str(r["lost"]), str(r["used_twice"]), r["bottleneck"], *extra]))
    return "\n".join(lines)


def compare_entry(rows: dict, fleet: str) -> Optional[dict]:
    """Async against lock-step on one fleet, like with like: the lock-step learner checks the
    groups itself, so the async case is the one without validators."""
    a = next((r for c, r in rows.items() if c.fleet == fleet and c.mode == "async" and not c.validators), None)
    s = next((r for c, r in rows.items() if c.fleet == fleet and c.mode == "sync"), None)
    if a is None or s is None:
        return None
    return {"samplers": a["samplers"], "async_steps_per_min": a["steps_per_min"],
            "sync_steps_per_min": s["steps_per_min"],
            "ratio": a["steps_per_min"] / s["steps_per_min"] if a["steps_per_min"] and s["steps_per_min"] else None,
            "async_learner_utilization": a["learner_utilization"],
            "sync_learner_utilization": s["learner_utilization"], "async_bottleneck": a["bottleneck"]}


def write_report(out: Path, cfg: HeteroConfig, rows: list[dict], compare_rows: dict) -> dict:
    """loadtest.json (rows, fleet, async_vs_sync) and loadtest.png in `out`; returns the report."""
    lt = cfg.loadtest
    fleets = sorted({c.fleet for c in compare_rows})
    comparison = {f: compare_entry(compare_rows, f) for f in fleets}
    target = comparison.get(lt.fleet) or next((v for v in comparison.values() if v), None)
    table = format_table(rows)
    if comparison:
        table += "\n\nasync vs lock-step, steps/min:\n" + "\n".join(
            f"  {f}: {v['samplers']} samplers, async {_fmt(v['async_steps_per_min'])}, lock-step "
            f"{_fmt(v['sync_steps_per_min'])}, ratio {_fmt(v['ratio'])}" for f, v in comparison.items() if v)
    report = {
        "rows": rows,
        "fleet": {"profile": lt.fleet, "classes": [c.model_dump() for c in lt.fleets[lt.fleet]],
                  "profiles": {k: [c.model_dump() for c in v] for k, v in lt.fleets.items()}},
        "async_vs_sync": target["ratio"] if target else None,
        "async_vs_sync_by_fleet": comparison,
        "model": {"learner_step_s": lt.learner_step_s, "groups_per_step": cfg.learner.groups_per_step,
                  "max_delay_steps": cfg.learner.max_delay_steps, "group_size": cfg.sampler.group_size,
                  "max_new_tokens": cfg.sampler.max_new_tokens, "prompts_per_batch": cfg.sampler.prompts_per_batch,
                  **{k: v for k, v in lt.model_dump().items() if k not in ("fleets", "samplers")}},
        "table": table,
    }
    (out / "loadtest.json").write_text(json.dumps(report, indent=1, default=str))
    plot_report(report, out / "loadtest.png")
    return report


def _v(row: dict, key: str, scale: float = 1.0) -> float:
    """A row's number for a plot (NaN where the case has none)."""
    value = row.get(key)
    return float("nan") if value is None else value * scale


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    n = [r["samplers"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.plot(n, [_v(r, "groups_per_s") for r in rows], "o-", label="groups/s reaching the learner")
    ax.plot(n, [_v(r, "groups_used_per_s") for r in rows], "s--", label="groups/s used")
    ax.plot(n, [_v(r, "fleet_supply_groups_per_s") for r in rows], ":", color="grey", label="fleet could generate")
    ax.set_yscale("log")
    ax.set_title("throughput")
    ax.legend(fontsize=8)
    ax2 = ax.twinx()
    ax2.plot(n, [_v(r, "learner_utilization") for r in rows], "^-", color="tab:red", label="learner utilization")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("learner utilization", color="tab:red")
    ax = axes[0][1]
    for key, style in (("staleness_p50", "o-"), ("staleness_p95", "s-"), ("staleness_max", "^-")):
        ax.plot(n, [_v(r, key) for r in rows], style, label=key)
    ax.plot(n, [_v(r, "dropped_share", 10) for r in rows], "x:", label="dropped share x10")
    ax.set_title("staleness of the groups used (versions)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(n, [_v(r, "redis_commands_per_sampler_per_s") for r in rows], "o-", label="commands / sampler / s")
    ax.plot(n, [_v(r, "redis_p99_ms") for r in rows], "s--", label="probe p99 ms")
    ax.set_title("Redis")
    ax.legend(fontsize=8)
    for a in (axes[0][0], axes[0][1], axes[1][0]):
        a.set_xscale("log", base=2)
        a.set_xlabel("samplers")
    ax = axes[1][1]
    comparison = [(f, v) for f, v in report["async_vs_sync_by_fleet"].items() if v]
    if comparison:
        x = range(len(comparison))
        ax.bar([i - 0.2 for i in x], [_v(v, "async_steps_per_min") for _, v in comparison], 0.4, label="async")
        ax.bar([i + 0.2 for i in x], [_v(v, "sync_steps_per_min") for _, v in comparison], 0.4, label="lock-step")
        ax.set_xticks(list(x), [f"{f}\n{v['samplers']} samplers\n{_fmt(v['ratio'])}x" for f, v in comparison])
        ax.set_ylabel("learner steps / min")
        ax.legend(fontsize=8)
    ax.set_title("async vs lock-step")
    fig.suptitle("heterorl loadtest: one learner, one Redis, one broker on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
