"""Groups per minute reaching the learner with 1, 2 and 3 samplers on this machine.

    python bench/scaling.py [--samplers 1,2,3] [--steps 100] [--skip 10] [--json FILE]

For each sampler count N this runs one real `heterorl train` (`python -m heterorl train`)
with `train.num_samplers=N`: one learner process and N sampler processes, every one of
them with ONE torch thread (`learner.torch_threads=1`, `sampler.torch_threads=1`), all
sharing this machine's cores with the local servers (Kafka-API broker, Redis, S3) and with
whatever else runs here. The output names the core count (`os.cpu_count()`).

What is measured: groups/min reaching the learner, from the learner's own records in
RUN_DIR/metrics.jsonl (`groups_consumed` is cumulative, `time` is when the step's record
was written): (groups_consumed[last] - groups_consumed[skip]) / (time[last] - time[skip])
* 60, over the steady part from step `--skip` to the last step (start-up, the base-model
evaluation and the first steps are excluded). Over the same window: steps/min, the mean
staleness of the groups used (mean of the per-step `staleness_mean`) and the groups
dropped as too stale.

Who set the pace: after each run its rollout topic is read back (the stack is still up).
"generated/min" counts the groups the samplers created (`created_at`) in the window;
"learner backlog" is the mean number of groups already generated but not yet read by the
learner at its step records; "sampler stalled s" is how long the samplers waited instead
of generating (their own totals, whole run). Even with no backlog limit a sampler waits
while a group generated now would arrive past `learner.max_delay_steps` (the backlog ahead
of it is too long), so a large backlog with stalled samplers means the learner, not the
samplers, set the pace; a backlog near zero means the learner waited for the samplers.
"active" is the number of samplers that published in the window: a run in which a
sampler stopped publishing (e.g. its Kafka producer failed) or logged broker errors is
marked "!" (exit status 1), because it measures fewer working samplers than it names.

Fairness:
  * `sampler.max_backlog_groups` is null by default (samplers never pause for the
    backlog limit), so the numbers show what the samplers can deliver rather than the
    throttle; pass `--backlog 128` to measure with the demo's throttle instead;
  * the base model is warmed up (and cached in DATA_DIR/models) once before any run, and
    one local stack serves every run, so neither is in any measurement;
  * `eval.every=null` (no evaluator process competes for the cores during training), and
    the before/after evaluation of `train` is cut to 8 problems (outside the window anyway);
  * the runs go one after another on a possibly shared machine, so the numbers are noisy:
    `--repeats` interleaves repeats (1,2,3,1,2,3,...) and reports medians.

The ratios printed are groups/min with N samplers / groups/min with the first count in
`--samplers` (1 by default). With N samplers + 1 learner on C cores nothing guarantees
scaling; the table reports whatever was measured.

Exit status: 0; 1 if a run failed (the last lines of its log are printed) or a row is
marked "!"; 130 on Ctrl-C (the running `train`, its learner and samplers, and the stack
are stopped first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOG_TAIL_LINES = 40


# ----------------------------------------------------------------------------------------
# child processes: started in their own session, stopped with everything they started


def _proc_start_ticks(pid: int) -> Optional[int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[19])  # field 22: start time


def _descendants(root: int) -> dict[int, int]:
    """pid -> start ticks of every live descendant of `root` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            ticks = _proc_start_ticks(child)
            if ticks is not None and child not in found:
                found[child] = ticks
                todo.append(child)
    return found


def stop_child(proc: subprocess.Popen, grace_s: float = 45.0) -> None:
    """Interrupt a `heterorl train` child so it stops its learner and samplers itself
    (they run in sessions of their own); SIGKILL whatever is left after `grace_s`."""
    if proc.poll() is not None:
        return
    family = _descendants(proc.pid)  # noted now: they are re-parented once train dies
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid, ticks in family.items():
        if _proc_start_ticks(pid) == ticks:  # the same process, not a recycled pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_logged(cmd: list[str], log_path: Path, timeout_s: Optional[float] = None) -> int:
    """Run `cmd` with stdout+stderr into `log_path`; stop it (and its children) on Ctrl-C."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_child(proc)
        with open(log_path, "a") as log:
            log.write(f"\nbench/scaling.py: stopped after {timeout_s:.0f}s (--timeout)\n")
        return 124
    except BaseException:
        stop_child(proc)
        raise


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class BenchError(RuntimeError):
    pass


def _check(rc: int, what: str, log_path: Path) -> None:
    if rc != 0:
        raise BenchError(f"{what} failed with exit code {rc}; last lines of {log_path}:\n{log_tail(log_path)}")


# ----------------------------------------------------------------------------------------
# measurement


def rollout_times(data_dir: Path, topic: str) -> list[tuple[float, str]]:
    """(`created_at`, sampler id) of every group in a run's rollout topic, read after the run
    while the stack is still up: when and by whom each group was generated, whether or not
    the learner read it."""
    import msgpack

    from infra.local_stack import load_stack
    from pipeline.clients.topics import read_topic

    stack = load_stack(data_dir)
    if stack is None:
        raise BenchError(f"the local stack in {data_dir} is no longer running")
    times = []
    for record in read_topic(stack.kafka_bootstrap, topic, timeout_s=30.0):
        try:
            msg = msgpack.unpackb(record.value, raw=False)
            times.append((float(msg["created_at"]), str(msg["sampler_id"])))
        except Exception:  # noqa: BLE001 - a malformed message is not a generated group
            continue
    return sorted(times)


def measure(run_dir: Path, skip: int, data_dir: Path) -> dict:
    """Rates over the steady part of one run, from the learner's metrics.jsonl records and
    the run's rollout topic."""
    from bisect import bisect_right

    from pipeline.records.metrics import read_metrics

    records = sorted(read_metrics(run_dir / "metrics.jsonl", "learner"), key=lambda r: r["step"])
    window = [r for r in records if r["step"] >= skip]
    if len(window) < 2:
        raise BenchError(f"only {len(window)} learner record(s) from step {skip} on in {run_dir}; "
                         f"raise --steps or lower --skip")
    first, last = window[0], window[-1]
    dt = last["time"] - first["time"]
    if dt <= 0:
        raise BenchError(f"learner records in {run_dir} do not advance in time")
    summary = json.loads((run_dir / "summary.json").read_text())
    groups = rollout_times(data_dir, summary["rollout_topic"])
    created = [t for t, _ in groups]
    generated_in_window = bisect_right(created, last["time"]) - bisect_right(created, first["time"])
    active = {sid for t, sid in groups if first["time"] < t <= last["time"]}
    # A sampler whose Kafka producer failed for good stops publishing (its groups stay in its
    # spool) while the run goes on with the others: such a run measures fewer working
    # samplers than it names, so it is found and flagged. Broker errors it recovered from
    # are only counted.
    stats = summary.get("sampler_stats", {})
    stuck = sorted(sid for sid, st in stats.items() if st.get("spooled", 0) > 0)
    broker_errors = {}
    for log in sorted((run_dir / "logs").glob("sampler-*.log")):
        bad = sum(1 for line in log.read_text(errors="replace").splitlines()
                  if "unreachable" in line or "Fatal Error" in line or "fatal error" in line)
        if bad:
            broker_errors[log.stem] = bad
    # Groups generated by the time of a step's record that the learner had not read yet.
    backlog = [max(0, bisect_right(created, r["time"]) - r["groups_consumed"]) for r in window]
    return {
        "window_steps": f"{first['step']}-{last['step']}",
        "window_s": round(dt, 2),
        "groups_per_min": 60.0 * (last["groups_consumed"] - first["groups_consumed"]) / dt,
        "used_per_min": 60.0 * (last["groups_used"] - first["groups_used"]) / dt,
        "steps_per_min": 60.0 * (last["step"] - first["step"]) / dt,
        "generated_per_min": 60.0 * generated_in_window / dt,
        "backlog_mean": statistics.fmean(backlog),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in window[1:]),
        "staleness_max": max(r["staleness_max"] for r in window[1:]),
        "dropped_in_window": last["groups_dropped"] - first["groups_dropped"],
        "dropped_total": records[-1]["groups_dropped"],
        "groups_consumed_total": records[-1]["groups_consumed"],
        "groups_in_topic": len(created),
        "samplers_active_in_window": len(active),
        "samplers_with_stats": len(stats),
        "samplers_ending_with_undelivered_groups": stuck,
        "sampler_logs_with_broker_errors": broker_errors,
        "sampler_stats": stats,
    }


def healthy(m: dict, samplers: int) -> bool:
    """Every sampler published in the window, reported its totals and delivered all it generated."""
    return (m["samplers_active_in_window"] == samplers and m["samplers_with_stats"] == samplers
            and not m["samplers_ending_with_undelivered_groups"])


def problems(m: dict, samplers: int) -> str:
    parts = []
    if m["samplers_active_in_window"] < samplers:
        parts.append(f"{samplers - m['samplers_active_in_window']} sampler(s) published nothing in the window")
    if m["samplers_with_stats"] < samplers:
        parts.append(f"{samplers - m['samplers_with_stats']} sampler(s) did not report their totals")
    if m["samplers_ending_with_undelivered_groups"]:
        parts.append(f"{len(m['samplers_ending_with_undelivered_groups'])} sampler(s) ended with groups they could "
                     f"not deliver to the broker")
    if m["sampler_logs_with_broker_errors"]:
        parts.append("broker errors logged: " + ", ".join(f"{k} x{v}" for k, v in
                                                          m["sampler_logs_with_broker_errors"].items()))
    return "; ".join(parts)


def _median_row(samplers: int, runs: list[dict]) -> dict:
    keys = ["groups_per_min", "used_per_min", "steps_per_min", "staleness_mean", "dropped_in_window",
            "generated_per_min", "backlog_mean"]
    row = {"samplers": samplers, **{k: statistics.median(r[k] for r in runs) for k in keys}}
    row["stalled_s"] = statistics.median(sum(st.get("stalled_behind_s", 0.0) + st.get("paused_backlog_s", 0.0)
                                             for st in r["sampler_stats"].values()) for r in runs)
    row["healthy"] = all(healthy(r, samplers) for r in runs)
    row["broker_errors"] = any(r["sampler_logs_with_broker_errors"] for r in runs)
    row["runs"] = runs
    return row


def print_table(rows: list[dict], base: int) -> None:
    head = (f"{'samplers':>8}  {'groups/min':>10}  {'ratio vs ' + str(base):>11}  {'used/min':>8}  {'steps/min':>9}  "
            f"{'mean staleness':>14}  {'dropped':>7}  {'generated/min':>13}  {'learner backlog':>15}  "
            f"{'sampler stalled s':>17}  {'active':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        active = min(x["samplers_active_in_window"] for x in r["runs"])
        flag = " !" if not r["healthy"] else " *" if r["broker_errors"] else ""
        print(f"{r['samplers']:>8}  {r['groups_per_min']:>10.1f}  {r['ratio']:>10.2f}x  {r['used_per_min']:>8.1f}  "
              f"{r['steps_per_min']:>9.2f}  "
              f"{r['staleness_mean']:>14.2f}  {r['dropped_in_window']:>7g}  {r['generated_per_min']:>13.1f}  "
              f"{r['backlog_mean']:>15.0f}  {r['stalled_s']:>17.1f}  {str(active) + '/' + str(r['samplers']):>6}"
              f"{flag}")


# ----------------------------------------------------------------------------------------


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo",
                        help="run config every run uses: a built-in name or a file (default demo)")
    parser.add_argument("--samplers", default="1,2,3",
                        help="comma-separated sampler counts, one run each, in this order; ratios are vs the "
                             "first (default 1,2,3)")
    parser.add_argument("--steps", type=int, default=100,
                        help="learner optimizer steps per run (learner.max_steps, default 100: the tiny model "
                             "takes 1-2 steps a second here, so this gives a window of about a minute)")
    parser.add_argument("--skip", type=int, default=10,
                        help="the steady window starts at this learner step (default 10): earlier steps "
                             "include start-up and the backlog built while the learner started; not measured")
    parser.add_argument("--backlog", default="null",
                        help="sampler.max_backlog_groups for every run (default null: samplers never pause "
                             "for a backlog limit, though they still wait while their groups would arrive "
                             "past learner.max_delay_steps; the demo config uses 128)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per sampler count, interleaved (1,2,3,1,2,3,...); a row is the median "
                             "(default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run (repeatable), e.g. --set learner.groups_per_step=32")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="local stack directory shared by all runs; the base model is cached in DIR/models "
                             "(default: a fresh one inside the work directory). Must not hold a running stack "
                             "that others use: the benchmark starts and stops its own")
    parser.add_argument("--work-dir", metavar="DIR",
                        help="keep run directories and logs here (default: a temporary directory, deleted "
                             "after a successful benchmark and kept after a failure)")
    parser.add_argument("--retries", type=int, default=2,
                        help="run again (up to this many times) a run that failed or in which a sampler stopped "
                             "publishing (default 2; the local Tansu broker sometimes fails a sampler's "
                             "producer for good); every retry is listed in the output and the JSON. With 0, "
                             "a failed run fails the benchmark and a degraded one is marked '!'")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds one training run may take before it is stopped and counted as failed "
                             "(default 1200)")
    parser.add_argument("--json", metavar="FILE", help="also write the table and every run's numbers as JSON")
    args = parser.parse_args()

    try:
        counts = [int(x) for x in args.samplers.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--samplers {args.samplers!r}: expected comma-separated integers such as 1,2,3")
    if not counts or min(counts) < 1:
        parser.error("--samplers needs at least one count, each >= 1")
    if args.steps < args.skip + 2:
        parser.error(f"--steps {args.steps} leaves no steady window after --skip {args.skip} (need >= skip + 2)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from heterorl.config_files import config_path
    from pipeline.config import ConfigError, load_config

    try:
        config = str(config_path(args.config).resolve())
    except ConfigError as e:
        parser.error(str(e))

    overrides = ["learner.torch_threads=1", "sampler.torch_threads=1", "eval.every=null",
                 "eval.problems=8", "eval.n_samples=1", f"sampler.max_backlog_groups={args.backlog}",
                 f"learner.max_steps={args.steps}", "learner.idle_timeout_s=120", *args.overrides]
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        parser.error(str(e))

    signal.signal(signal.SIGTERM, _interrupt)
    temp_work = args.work_dir is None
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-scaling-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir).resolve() if args.data_dir else work / "data"

    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    load = os.getloadavg()
    print(f"machine: os.cpu_count() = {cores} ({usable} usable by this process), load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; the machine may be shared, so the "
          f"numbers are noisy", flush=True)
    print(f"each process: 1 torch thread; N samplers + 1 learner (+ the local Kafka/Redis/S3 servers and "
          f"the `train` driver) share {usable} cores", flush=True)
    print(f"model: {cfg.model.base} (hidden {cfg.model.hidden_size}, {cfg.model.num_layers} layers); "
          f"{cfg.learner.groups_per_step} groups/step, {cfg.sampler.group_size} completions/group, "
          f"{cfg.sampler.prompts_per_batch} prompts per generate call, max_new_tokens {cfg.sampler.max_new_tokens}",
          flush=True)
    backlog_note = (f"null: samplers never pause for a backlog limit (they still wait while a group generated "
                    f"then would arrive past learner.max_delay_steps={cfg.learner.max_delay_steps}), so the rate "
                    f"shows what the samplers deliver unless the learner cannot keep up (see 'learner backlog')"
                    if cfg.sampler.max_backlog_groups is None else
                    f"{cfg.sampler.max_backlog_groups}: samplers pause while that many groups are unread, so "
                    f"the learner's pace can limit the rate")
    print(f"sampler.max_backlog_groups = {backlog_note}", flush=True)
    print(f"runs: samplers {counts} x {args.repeats}, {args.steps} steps each, measured from step {args.skip} "
          f"to step {args.steps}; work dir {work}", flush=True)

    py = sys.executable
    results: dict[int, list[dict]] = {n: [] for n in counts}
    retried: list[dict] = []
    stack_up = False
    ok = False
    wall_start = time.time()
    try:
        from infra.local_stack import load_stack

        if load_stack(data_dir) is not None:
            raise BenchError(f"a local stack is already running in {data_dir}; the benchmark starts and stops its "
                             f"own: choose another --data-dir (or stop that one with `heterorl down`)")
        t0 = time.time()
        print("warming up the base model (once, not measured) ...", flush=True)
        warm_log = work / "warmup.log"
        warm_code = ("import sys; from pipeline.config import load_config; from pipeline.runtime import "
                     "resolve_base_model; print(resolve_base_model(load_config(sys.argv[1], sys.argv[2:])))")
        _check(run_logged([py, "-c", warm_code, config, *overrides, f"services.data_dir={data_dir}"], warm_log,
                          args.timeout), "base model warm-up", warm_log)
        print(f"  base model ready in {time.time() - t0:.0f}s", flush=True)

        stack_log = work / "stack.log"
        stack_up = True  # from here on, `down` runs on every exit path
        _check(run_logged([py, "-m", "heterorl", "up", "--data-dir", str(data_dir)], stack_log, 300),
               "starting the local stack", stack_log)

        for rep in range(args.repeats):
            for n in counts:
                for attempt in range(args.retries + 1):
                    name = f"run{n}" if args.repeats == 1 else f"run{n}-r{rep + 1}"
                    name += f"-retry{attempt}" if attempt else ""
                    run_dir, log_path = work / name, work / f"{name}.log"
                    cmd = [py, "-m", "heterorl", "train", "--config", config, "--out", str(run_dir),
                           "--data-dir", str(data_dir), "--set", f"train.num_samplers={n}"]
                    for o in overrides:
                        cmd += ["--set", o]
                    print(f"{name}: {n} sampler(s) + 1 learner, {args.steps} steps ...", flush=True)
                    t0 = time.time()
                    rc = run_logged(cmd, log_path, args.timeout)
                    last_try = attempt == args.retries
                    if rc != 0 and not last_try:
                        print(f"  failed (exit code {rc}); last lines of {log_path}:\n{log_tail(log_path, 8)}\n"
                              f"  retrying (--retries)", flush=True)
                        retried.append({"run": name, "samplers": n, "reason": f"exit code {rc}"})
                        continue
                    _check(rc, f"{name} ({n} samplers)", log_path)
                    m = measure(run_dir, args.skip, data_dir)
                    m["wall_s"] = round(time.time() - t0, 1)
                    m["run"] = name
                    print(f"  {m['groups_per_min']:.1f} groups/min, {m['steps_per_min']:.2f} steps/min over steps "
                          f"{m['window_steps']} ({m['window_s']:.0f}s); {m['samplers_active_in_window']}/{n} "
                          f"samplers published in that window; run took {m['wall_s']:.0f}s", flush=True)
                    if problems(m, n):
                        print(f"  {'WARNING' if not healthy(m, n) else 'note'}: {problems(m, n)} "
                              f"(see {run_dir}/logs/)", flush=True)
                    if not healthy(m, n):
                        if not last_try:
                            retried.append({"run": name, "samplers": n, "reason": "a sampler stopped publishing"})
                            print("  retrying (--retries)", flush=True)
                            continue
                    results[n].append(m)
                    break
        ok = True
    except KeyboardInterrupt:
        print("\nbench/scaling.py: interrupted; stopping the runs and the stack", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"bench/scaling.py: error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        if stack_up:
            down_log = work / "stack.log"
            rc = run_logged([py, "-m", "heterorl", "down", "--data-dir", str(data_dir)], down_log, 120)
            if rc != 0:
                print(f"bench/scaling.py: `heterorl down --data-dir {data_dir}` failed ({rc}); last lines of "
                      f"{down_log}:\n{log_tail(down_log)}", file=sys.stderr)
        all_healthy = all(healthy(m, n) for n in counts for m in results[n])
        if temp_work and ok and all_healthy:
            shutil.rmtree(work, ignore_errors=True)
        elif temp_work:
            print(f"bench/scaling.py: logs and run directories kept in {work}", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    base = counts[0]
    rows = [_median_row(n, results[n]) for n in counts]
    base_rate = rows[0]["groups_per_min"]
    for r in rows:
        r["ratio"] = r["groups_per_min"] / base_rate if base_rate > 0 else float("nan")
    wall = time.time() - wall_start
    load = os.getloadavg()
    print(f"\ngroups/min reaching the learner (steps {args.skip}-{args.steps} of each run"
          f"{', median of ' + str(args.repeats) + ' runs' if args.repeats > 1 else ''}); "
          f"{usable} cores, 1 torch thread per process, max_backlog_groups={cfg.sampler.max_backlog_groups}")
    print_table(rows, base)
    print(f"groups/min: groups the learner read (used + dropped as too stale). ratio: groups/min with N samplers /"
          f" groups/min with {base}. used/min: groups it trained on.\n"
          f"mean staleness: of the groups used, in policy versions. dropped: groups too stale to use "
          f"(max_delay_steps={cfg.learner.max_delay_steps}) in the window.\n"
          f"generated/min: groups the samplers created in the same window (read back from the rollout topic). "
          f"learner backlog: mean groups generated but not yet read by the learner at its steps (large = the "
          f"learner set the pace, near 0 = the learner waited for the samplers).\n"
          f"sampler stalled s: seconds (whole run, all samplers together) the samplers waited instead of "
          f"generating, because groups generated then would arrive past max_delay_steps (or, with --backlog, "
          f"because of the backlog limit). active: samplers that published in the window.")
    for r in retried:
        print(f"retried: {r['run']} ({r['reason']})")
    unhealthy = [r["samplers"] for r in rows if not r["healthy"]]
    if unhealthy:
        print(f"! rows {unhealthy}: a sampler stopped publishing (its Kafka producer failed) during the run, so the "
              f"row measures fewer working samplers than it names (see the run logs; --retries N re-runs such runs)")
    if any(r["broker_errors"] and r["healthy"] for r in rows):
        print("* rows: a sampler logged broker errors and recovered (its retries cost it some time)")
    print(f"benchmark wall time {wall:.0f}s; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        out = {"cores": cores, "usable_cores": usable, "torch_threads_per_process": 1,
               "steps": args.steps, "window_from_step": args.skip, "repeats": args.repeats,
               "max_backlog_groups": cfg.sampler.max_backlog_groups, "config": args.config,
               "overrides": overrides, "groups_per_step": cfg.learner.groups_per_step,
               "baseline_samplers": base, "wall_s": round(wall, 1), "retried": retried,
               "rows": [{**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}} for r in rows]}
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 1 if unhealthy else 0


if __name__ == "__main__":
    sys.exit(main())
