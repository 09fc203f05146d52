"""`heterorl loadtest`: one local stack, then one measured case per row.

A case (N samplers of a fleet profile, asynchronous or lock-step) is a fresh run on the
shared stack: its own topic, Redis keys, S3 prefix and sampler keys. The rig starts the
modeled learner (`lab.loadtest.learner`) and N simulated samplers in worker processes
(`lab.loadtest.worker`), waits for `loadtest.warmup_steps` steps and `loadtest.warmup_s`, measures
for `loadtest.measure_s` (snapshots of Redis, the broker's link, the workers' links and the
learner's records at both ends, a Redis latency probe in between), then stops the samplers
(they flush their spools), drains the learner and audits the topic (`pipeline.records.audit`):
every group produced is used, dropped or pending, none used twice.

The samplers reach Redis and S3 through their own links, the learner directly; every
process reaches the broker directly (a Kafka client follows the one address the broker
advertises, so a per-sampler Kafka link is not possible; one shared proxy route in front of
the broker was tried and became the rig's own bottleneck at 256 samplers). The broker's
MB/s are the sizes of the messages it received in the window, read back from the topic.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kafka.errors import KafkaError
from redis.exceptions import RedisError
from tqdm import tqdm

from heterorl.keys import provision_local
from heterorl.processes import RunFailed
from lab.loadtest.fleet import assign_classes, expected_groups_per_s, lockstep_quotas
from lab.loadtest.report import case_row, failed_row, write_report
from infra.local_stack import stack_services, start_stack, stop_stack
from pipeline.records.audit import audit_topic
from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3
from pipeline.config import HeteroConfig
from pipeline.errors import UserError
from pipeline.clients.topics import read_topic
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.runtime import resolve_base_model, setup_logging
from pipeline.clients.services import Services
from pipeline.records.update_log import read_entries_file
from pipeline.weights.recovery import latest_state, recovery_store
from pipeline.trust.keyring import trusted_learner

FIRST_STEP_TIMEOUT_S = 600.0
WARMUP_STEPS_WITHIN_S = 90.0
"""A slow fleet (one sampler) makes no start-up burst: its warm-up steps are not waited for longer."""
PROBE_EVERY_S = 0.02


@dataclass(frozen=True)
class Case:
    samplers: int
    fleet: str
    mode: str  # "async" | "sync"
    validators: int = 0
    """Modeled validators checking the groups instead of the learner (`lab.loadtest.validator`)."""

    @property
    def label(self) -> str:
        return f"{self.mode}-{self.fleet}-n{self.samplers}" + (f"-v{self.validators}" if self.validators else "")


def services_update(services: Services) -> dict:
    """ServicesConfig fields that point a role process at `services`."""
    return {"kafka_bootstrap": services.kafka_bootstrap, "redis_url": services.redis_url,
            "s3_endpoint": services.s3_endpoint, "s3_access_key": services.s3_access_key,
            "s3_secret_key": services.s3_secret_key, "s3_region": services.s3_region, "bucket": services.bucket}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of this machine since boot (/proc/stat)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def message_bytes(bootstrap: str, topic: str, t0: float, t1: float) -> int:
    """Bytes (values and headers) of the messages the broker appended to `topic` in [t0, t1]."""
    return sum(len(r.value) + sum(len(k) + len(v) for k, v in r.headers)
               for r in read_topic(bootstrap, topic, timeout_s=120) if t0 * 1000 <= r.timestamp_ms <= t1 * 1000)


class RedisProbe:
    """Round trips of one PING, every PROBE_EVERY_S, from a direct client: Redis's latency under load."""

    def __init__(self, url: str):
        self.client = connect_redis(url)
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(PROBE_EVERY_S):
            started = time.perf_counter()
            try:
                self.client.ping()
            except Exception:  # noqa: BLE001 - a failed probe is a very slow one
                self.latencies.append(float("inf"))
                continue
            self.latencies.append(time.perf_counter() - started)

    def __enter__(self) -> "RedisProbe":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()


class Rig:
    """The local stack, and the cases run on it."""

    def __init__(self, cfg: HeteroConfig, out: Path, log):
        self.cfg, self.out, self.log = cfg, out, log
        self.data_dir = out / "data"
        self.stack = start_stack(self.data_dir, kafka_storage=cfg.loadtest.broker_storage)
        self.admin = stack_services(self.stack)
        self.admin_redis = connect_redis(self.stack.redis_url)
        self.s3 = connect_s3(self.admin)
        self.bootstrap = self.stack.kafka_bootstrap

    def close(self, keep_stack: bool = False) -> None:
        if not keep_stack:
            stop_stack(self.data_dir)

    def role_config(self, cfg: HeteroConfig, role: str) -> HeteroConfig:
        services = stack_services(self.stack, role)
        return cfg.model_copy(update={"services": cfg.services.model_copy(update={
            **services_update(services), "kafka_bootstrap": self.bootstrap})})

    # ---- one case --------------------------------------------------------------------
    def run_case(self, case: Case) -> dict:
        lt = self.cfg.loadtest
        case_dir = self.out / case.label
        case_dir.mkdir(parents=True, exist_ok=False)
        name = f"{self.cfg.run.name}-{case.label}-{time.strftime('%H%M%S')}"
        learner_update = {"max_steps": 10**9, "idle_timeout_s": max(600.0, self.cfg.learner.idle_timeout_s)}
        if case.mode == "sync":
            learner_update["max_delay_steps"] = 0  # lock-step: every group is of the current version
        run_update = {"name": name, "rollout_topic": None}
        if case.validators > self.cfg.run.topic_partitions:  # a partition each, so that every one works
            run_update["topic_partitions"] = case.validators
        cfg = self.cfg.model_copy(update={
            "run": self.cfg.run.model_copy(update=run_update),
            "learner": self.cfg.learner.model_copy(update=learner_update),
            "validators": self.cfg.validators.model_copy(update={"enabled": case.validators > 0})})
        ids = [f"{case.mode[0]}{case.samplers}-{i:04d}" for i in range(case.samplers)]
        validator_ids = [f"{case.mode[0]}{case.samplers}-v{i}" for i in range(case.validators)]
        classes = assign_classes(lt.fleets[case.fleet], case.samplers)
        quotas = lockstep_quotas(cfg.learner.groups_per_step, case.samplers)
        provision_local(cfg, self.admin_redis, ids, validator_ids, local=False)  # they stand for remote samplers

        learner_cfg = case_dir / "learner.json"
        learner_cfg.write_text(self.role_config(cfg, "learner").model_dump_json())
        procs: dict[str, subprocess.Popen] = {}
        logs = case_dir / "logs"
        logs.mkdir()

        def start(proc_name: str, module: str, *args: str) -> None:
            with open(logs / f"{proc_name}.log", "ab") as f:
                procs[proc_name] = subprocess.Popen([sys.executable, "-m", module, *args], stdout=f,
                                                    stderr=subprocess.STDOUT, start_new_session=True,
                                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})

        state = RunState(self.admin_redis, name)
        try:
            start("learner", "lab.loadtest.learner", str(learner_cfg), str(case_dir))
            validator_cfg = case_dir / "validator.json"
            validator_cfg.write_text(self.role_config(cfg, "validator").model_dump_json())
            for validator_id in validator_ids:
                start(f"validator-{validator_id}", "lab.loadtest.validator", str(validator_cfg), validator_id)
            sampler_cfg = json.loads(self.role_config(cfg, "sampler").model_dump_json())
            workers = []
            per = lt.samplers_per_process
            for w, first in enumerate(range(0, case.samplers, per)):
                spec = {"config": sampler_cfg, "mode": case.mode, "seed": cfg.run.seed + w,
                        "stats_path": str(case_dir / f"worker{w}.stats.json"),
                        "samplers": [{"id": ids[i], "class": classes[i].model_dump(), "quota": quotas[i]}
                                     for i in range(first, min(first + per, case.samplers))]}
                (case_dir / f"worker{w}.json").write_text(json.dumps(spec))
                start(f"worker{w}", "lab.loadtest.worker", str(case_dir / f"worker{w}.json"))
                workers.append(f"worker{w}")
            self._wait_for_steps(case_dir, procs, 1)
            self._wait_for_steps(case_dir, procs, lt.warmup_steps, within_s=WARMUP_STEPS_WITHIN_S, required=False)
            self._sleep(lt.warmup_s, procs, f"{case.label} warm-up")
            before = self._snapshot(case_dir, procs, workers, state)
            with RedisProbe(self.stack.redis_url) as probe:
                self._sleep(lt.measure_s, procs, f"{case.label} measuring")
            after = self._snapshot(case_dir, procs, workers, state)
            latencies = list(probe.latencies)
            ended = self._stop(procs, workers)
            store = CheckpointStore(self.s3, self.admin.bucket, name)
            final = latest_state(recovery_store(store))
            produced_bytes = message_bytes(self.bootstrap, cfg.run.topic, before["time"], after["time"])
            audit = audit_topic(self.bootstrap, cfg.run.topic, final.extra if final else {}, trusted_learner(cfg),
                                {**state.expired_samplers(within_s=10**9), **state.sampler_stats()})
            verdict_latency = (verdict_latencies_s(self.bootstrap, cfg.run.topic, before["time"], after["time"])
                               if case.validators else [])
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        measurement = {"case": {"samplers": case.samplers, "fleet": case.fleet, "mode": case.mode, "run": name,
                                "validators": case.validators},
                       "verdict_latency_s": verdict_latency,
                       "before": before, "after": after, "redis_probe_s": latencies, "audit": audit,
                       "exit_codes": ended, "broker_bytes_in_window": produced_bytes,
                       "updates": [asdict(e) for e in read_entries_file(case_dir / "updates.jsonl")],
                       "metrics": [json.loads(line) for line in (case_dir / "metrics.jsonl").read_text().splitlines()
                                   if line.strip()],
                       "supply_groups_per_s": expected_groups_per_s(lt.fleets[case.fleet], case.samplers, lt,
                                                                     cfg.sampler.group_size),
                       "classes": [c.name for c in classes]}
        (case_dir / "measurement.json").write_text(json.dumps(measurement))
        row = case_row(measurement, cfg)
        (case_dir / "row.json").write_text(json.dumps(row, indent=1))
        return row

    def _wait_for_steps(self, case_dir: Path, procs: dict, steps: int, within_s: float = FIRST_STEP_TIMEOUT_S,
                        required: bool = True) -> None:
        """Until the learner took `steps` steps; after `within_s`, a failure if `required`."""
        deadline = time.monotonic() + within_s
        metrics = case_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"kind": "learner"') >= steps):
            self._check_alive(procs)
            if time.monotonic() > deadline:
                if not required:
                    return
                raise RunFailed(f"fewer than {steps} learner steps within {within_s:.0f}s (logs in {case_dir / 'logs'})")
            time.sleep(0.5)

    def _sleep(self, seconds: float, procs: dict, what: str) -> None:
        end = time.monotonic() + seconds
        with tqdm(total=int(seconds), desc=what, unit="s", file=sys.stderr, disable=None, leave=False) as bar:
            while (left := end - time.monotonic()) > 0:
                self._check_alive(procs)
                time.sleep(min(1.0, left))
                bar.n = int(seconds - max(0.0, end - time.monotonic()))
                bar.refresh()

    @staticmethod
    def _check_alive(procs: dict) -> None:
        for proc_name, p in procs.items():
            if p.poll() is not None:
                raise RunFailed(f"{proc_name} exited with {p.returncode} during the case (see its log)")

    def _snapshot(self, case_dir: Path, procs: dict, workers: list[str], state: RunState) -> dict:
        info = self.admin_redis.info("stats")
        commands = {k.removeprefix("cmdstat_"): v["calls"] for k, v in self.admin_redis.info("commandstats").items()}
        workers_stats = {}
        for w in workers:
            path = case_dir / f"{w}.stats.json"
            workers_stats[w] = json.loads(path.read_text()) if path.exists() else {}
        busy, total = machine_busy()
        judging = {v: float(info.get("judging_s", 0)) for v, info in state.live_validators().items()}
        return {"time": time.time(), "redis_commands": info["total_commands_processed"], "redis_by_command": commands,
                "validators_judging_s": judging,
                "workers": workers_stats,
                "policy_version": PolicyPointer(state).version(),
                "learner_offsets": sum(state.learner_offsets().values()),
                "cpu_s": {n: cpu_seconds(p.pid) for n, p in procs.items()},
                "rss_mb": {n: rss_mb(p.pid) for n, p in procs.items()},
                "machine_busy": busy, "machine_total": total}

    def _stop(self, procs: dict, workers: list[str]) -> dict:
        """Samplers first (they flush their spools), then the learner's drain (the validators
        judge what it still reads), then the validators."""
        for w in workers:
            procs[w].send_signal(signal.SIGTERM)
        codes = {}
        for w in workers:
            try:
                codes[w] = procs[w].wait(timeout=120)
            except subprocess.TimeoutExpired:
                procs[w].kill()
                codes[w] = "killed"
        procs["learner"].send_signal(signal.SIGUSR1)
        try:
            codes["learner"] = procs["learner"].wait(timeout=300)
        except subprocess.TimeoutExpired:
            procs["learner"].kill()
            codes["learner"] = "killed"
        for name in [n for n in procs if n.startswith("validator-")]:
            procs[name].send_signal(signal.SIGTERM)
            try:
                codes[name] = procs[name].wait(timeout=60)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                codes[name] = "killed"
        return codes


def verdict_latencies_s(bootstrap: str, topic: str, t0: float, t1: float) -> list[float]:
    """Seconds from each group's arrival at the broker to its first verdict's, for the verdicts
    appended in [t0, t1] (broker timestamps of both messages)."""
    from pipeline.trust.verdicts import verdicts_topic

    arrived = {(r.partition, r.offset): r.timestamp_ms for r in read_topic(bootstrap, topic, timeout_s=120)}
    first: dict[tuple[int, int], int] = {}
    for r in read_topic(bootstrap, verdicts_topic(topic), timeout_s=120):
        try:
            verdict = json.loads(r.value)
            where = (int(verdict["partition"]), int(verdict["offset"]))
        except (ValueError, KeyError, TypeError):
            continue
        if where in arrived and where not in first and t0 * 1000 <= r.timestamp_ms <= t1 * 1000:
            first[where] = r.timestamp_ms
    return sorted((ms - arrived[where]) / 1000 for where, ms in first.items())


def run_loadtest(cfg: HeteroConfig, out: Path, samplers: Optional[list[int]] = None, compare: bool = True,
                 keep_stack: bool = False, validators: int = 0) -> int:
    log = setup_logging("loadtest")
    logging.getLogger("infra.fault_proxy").setLevel(logging.ERROR)
    out = Path(out)
    if (out / "loadtest.json").exists():
        raise UserError(f"{out} already holds a load test (loadtest.json); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    lt = cfg.loadtest
    counts = samplers or lt.samplers
    base = resolve_base_model(cfg).resolve()  # the weights published: this model's, from the usual cache
    cfg = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"base": str(base)}),
        "services": cfg.services.model_copy(update={"data_dir": str(out / "data")})})
    cases = [Case(n, lt.fleet, "async", validators) for n in counts]
    if compare:
        for fleet in lt.compare_fleets:
            for mode in ("async", "sync"):
                case = Case(lt.compare_samplers, fleet, mode)
                if case not in cases:
                    cases.append(case)
    rig = Rig(cfg, out, log)
    rows: dict[Case, dict] = {}
    try:
        for case in cases:
            log.info("case %s: %d samplers of the %s fleet, %s", case.label, case.samplers, case.fleet, case.mode)
            started = machine_busy()
            try:
                rows[case] = rig.run_case(case)
            except (RunFailed, KafkaError, RedisError, TimeoutError) as e:  # this machine could not hold the case
                log.error("case %s failed: %s: %s", case.label, type(e).__name__, e)
                rows[case] = failed_row(case, f"{type(e).__name__}: {e}", started, machine_busy())
                continue
            r = rows[case]
            log.info("case %s: %.2f groups/s, %.1f steps/min, learner utilization %.2f, staleness p50/p95/max "
                     "%s/%s/%s, dropped %.3f, Redis %.1f commands/sampler/s; lost %d, used twice %d; bottleneck: %s",
                     case.label, r["groups_per_s"], r["steps_per_min"], r["learner_utilization"],
                     r["staleness_p50"], r["staleness_p95"], r["staleness_max"], r["dropped_share"],
                     r["redis_commands_per_sampler_per_s"], r["lost"], r["used_twice"], r["bottleneck"])
    finally:
        rig.close(keep_stack)
    report = write_report(out, cfg, [rows[c] for c in cases if c.mode == "async" and c.fleet == lt.fleet
                                     and c.samplers in counts],
                          {c: rows[c] for c in cases if c.samplers == lt.compare_samplers and c.fleet in lt.compare_fleets}
                          if compare else {})
    print(report["table"])
    print(f"wrote {out / 'loadtest.json'} and {out / 'loadtest.png'}")
    bad = [r for r in report["rows"] if r.get("lost") or r.get("used_twice")]
    return 1 if bad else 0
