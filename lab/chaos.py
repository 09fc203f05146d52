"""`heterorl chaos`: train through seeded faults, then prove by audit that no data was lost.

  1. a durable local stack in OUT/data whose broker advertises the fault proxy's port,
     so every Kafka client (samplers and learner alike: Kafka clients connect to the
     address the broker advertises) crosses the proxy; the samplers reach Redis and S3
     through it too, the learner directly;
  2. the base model's held-out accuracy; one learner and N samplers as processes;
  3. a seeded schedule (`chaos_schedule`): latency, jitter and connection resets on the
     samplers' links all along; samplers killed (SIGKILL) and restarted, added and
     removed; the learner killed once and restarted; the broker restarted once; the
     samplers cut off from everything for `partition_s` seconds; the newest delta
     object corrupted in S3; a sampler killed while it downloads weights (its S3 link
     slowed to 20 kB/s until it is); the learner killed once it has published versions
     after its last recovery state (those are lost, never reused);
  4. at the end: samplers stopped (they flush their spools), the learner drained
     (SIGUSR1: read to the end of the log, train the rest, publish), held-out accuracy of
     the final checkpoint, and the audit (`pipeline.records.audit`) written to OUT/audit.json;
  5. with `--validators K` (the checks done by validators, docs/security.md "Validators"):
     K validators beside the learner, reaching the servers through the proxy like the
     samplers, the rollout topic with a partition each, and one more fault: a validator
     killed (SIGKILL) mid-run and restarted later; its partitions pass to the others.

Exit status 1 if the audit finds a lost or twice-used rollout.
"""

from __future__ import annotations

import io
import os
import json
import logging
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from heterorl.keys import provision_local
from heterorl.processes import Processes, child_env
from infra.fault_proxy import FaultProxy, FaultSpec, Route
from infra.local_stack import restart_service, stack_services, start_stack, stop_stack
from pipeline.records.audit import audit_topic
from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3, current as current_pointer
from pipeline.config import HeteroConfig, dump_config
from pipeline.errors import UserError
from pipeline.clients.topics import read_topic
from pipeline.trust.keyring import init_keys, key_paths, trusted_learner
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.runtime import (evaluate_base, evaluate_final_state, make_task_from_config, resolve_base_model,
                              setup_logging)
from pipeline.clients.services import LOOPBACK, Services, free_port
from pipeline.records.update_log import UpdateEntry, updates_topic, verified_control_record
from pipeline.weights.policy import DELTA_FILE
from pipeline.weights.recovery import latest_state, recovery_store

SAMPLER_LINK_FAULTS = {"latency_ms": 20.0, "jitter_ms": 10.0, "reset_probability_per_s": 1 / 60}
"""Background faults on every sampler connection: 20±10 ms each way, a reset a minute."""


@dataclass(frozen=True)
class ChaosEvent:
    at_s: float
    kind: str
    """kill_sampler | add_sampler | remove_sampler | kill_learner | restart_broker | partition |
    corrupt_delta | kill_sampler_mid_download | kill_validator"""


def chaos_schedule(seed: int, duration_s: float, partition_s: float = 30.0,
                   validators: int = 0) -> list[ChaosEvent]:
    """The faults of one run, reproducible from `seed`: the one-off faults at fixed fractions
    of the run (so they never overlap), sampler churn at seeded random times between them;
    with validators, one of them killed at 40 % of the run."""
    rng = random.Random(seed)
    events = [ChaosEvent(0.20 * duration_s, "partition"),
              ChaosEvent(0.20 * duration_s + partition_s + 0.10 * duration_s, "kill_learner"),
              ChaosEvent(0.62 * duration_s, "corrupt_delta"),
              ChaosEvent(0.70 * duration_s, "restart_broker"),
              ChaosEvent(0.88 * duration_s, "kill_sampler_mid_download")]
    # One of each churn kind in its own stretch of the run (so a removal always finds a
    # sampler to remove), then more at random times.
    for kind, (lo, hi) in (("add_sampler", (0.05, 0.18)), ("kill_sampler", (0.45, 0.55)),
                           ("remove_sampler", (0.75, 0.85))):
        events.append(ChaosEvent(rng.uniform(lo, hi) * duration_s, kind))
    for _ in range(max(0, int(duration_s / 60) - 3)):
        events.append(ChaosEvent(rng.uniform(0.05, 0.85) * duration_s,
                                 rng.choice(["kill_sampler", "add_sampler", "remove_sampler"])))
    if validators:
        events.append(ChaosEvent(0.40 * duration_s, "kill_validator"))
    return sorted(events, key=lambda e: e.at_s)


class ChaosRun:
    """The processes and servers of one chaos run, and the faults applied to them."""

    def __init__(self, cfg: HeteroConfig, out: Path, samplers: int, partition_s: float, log, validators: int = 0):
        self.cfg, self.out, self.log, self.partition_s = cfg, out, log, partition_s
        self.data_dir = out / "data"
        # The proxy listens first: the broker advertises it and is probed through it.
        taken: set[int] = set()
        ports = {name: free_port(taken) for name in ("kafka", "redis", "s3", "proxy-kafka")}
        self.proxy = FaultProxy([
            Route("kafka", ports["proxy-kafka"], "127.0.0.1", ports["kafka"]),
            Route("redis", 0, "127.0.0.1", ports["redis"]),
            Route("s3", 0, "127.0.0.1", ports["s3"]),
        ], seed=cfg.run.seed).start()
        self.stack = start_stack(self.data_dir, kafka_port=ports["kafka"], redis_port=ports["redis"],
                                 s3_port=ports["s3"], kafka_advertised=self.proxy.address("kafka"))
        init_keys(key_paths(cfg))
        self.admin_redis = connect_redis(self.stack.redis_url)
        self.sampler_ids: set[str] = set()
        self.sampler_spec = FaultSpec(**SAMPLER_LINK_FAULTS)
        self.proxy.set_spec(self.sampler_spec, routes=["redis", "s3"])
        self.faults: dict[str, int] = {}
        self.procs = Processes(out, child_env(self._services(redis=stack_services(self.stack, "learner").redis_url,
                                                             s3=self.stack.s3_endpoint)))
        sampler_redis = stack_services(self.stack, "sampler").redis_url  # the sampler's own Redis user
        self.sampler_env = child_env(self._services(
            redis=sampler_redis.replace(f"{LOOPBACK}:{self.stack.port('redis')}", self.proxy.address("redis")),
            s3=f"http://{self.proxy.address('s3')}"))
        admin = stack_services(self.stack)
        self.policies = CheckpointStore(connect_s3(admin), admin.bucket, cfg.run.name)
        self.states = recovery_store(self.policies)
        self.run_state = RunState(self.admin_redis, cfg.run.name)
        self.learner_kills: list[dict] = []
        self.corrupted: list[int] = []
        self.config_path = out / "config.yaml"
        self.config_path.write_text(dump_config(cfg))
        validator_redis = stack_services(self.stack, "validator").redis_url
        self.validator_env = child_env(self._services(
            redis=validator_redis.replace(f"{LOOPBACK}:{self.stack.port('redis')}", self.proxy.address("redis")),
            s3=f"http://{self.proxy.address('s3')}"))
        self.validator_ids = [f"{cfg.run.name}-v{i}" for i in range(validators)]
        if validators:
            provision_local(cfg, self.admin_redis, [], self.validator_ids)
        self.slots = list(range(samplers))  # sampler slots alive; each has a stable spool
        self.incarnation: dict[int, int] = {}
        self.next_slot = samplers

    def _services(self, redis: str, s3: str) -> Services:
        """The stack's servers (credentials, bucket) with these Redis and S3 URLs, and Kafka
        through the proxy."""
        return replace(stack_services(self.stack), kafka_bootstrap=self.proxy.address("kafka"),
                       redis_url=redis, s3_endpoint=s3)

    def count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    # ---- processes -------------------------------------------------------------------
    def start_learner(self) -> None:
        self.procs.start("learner", ["learner", "--config", str(self.config_path), "--out", str(self.out)])

    def start_sampler(self, slot: int) -> None:
        n = self.incarnation.get(slot, -1) + 1
        self.incarnation[slot] = n
        name = f"sampler-{slot}"
        spool = self.data_dir / "spool" / f"slot{slot}"
        sampler_id = f"{self.cfg.run.name}-s{slot}-r{n}"
        provision_local(self.cfg, self.admin_redis, [sampler_id])
        self.sampler_ids.add(sampler_id)
        self.procs.start(name, ["sampler", "--config", str(self.config_path), "--id",
                                sampler_id, "--set", f"sampler.spool_dir={spool}"],
                         env=self.sampler_env)

    def start_validator(self, index: int) -> None:
        self.procs.start(f"validator-{index}", ["validator", "--config", str(self.config_path), "--id",
                                                 self.validator_ids[index]], env=self.validator_env)

    def sampler_alive(self, slot: int) -> bool:
        return self.procs.alive(f"sampler-{slot}")

    # ---- faults ----------------------------------------------------------------------
    def apply(self, event: ChaosEvent, rng: random.Random) -> None:
        self.log.info("chaos at %.0fs: %s", event.at_s, event.kind)
        if event.kind == "partition":
            self.proxy.blackhole(self.partition_s, routes=["kafka", "redis", "s3"])
        elif event.kind == "kill_learner":
            self.kill_learner_between_states()
        elif event.kind == "corrupt_delta":
            if not self.corrupt_newest_delta():
                return
        elif event.kind == "kill_sampler_mid_download":
            if not self.kill_sampler_mid_download():
                return
        elif event.kind == "restart_broker":
            restart_service(self.data_dir, "kafka")
        elif event.kind == "kill_sampler":
            alive = [s for s in self.slots if self.sampler_alive(s)]
            if not alive:
                return
            slot = rng.choice(alive)
            self.procs.kill(f"sampler-{slot}")
            time.sleep(rng.uniform(2.0, 8.0))
            self.start_sampler(slot)  # same spool: what it had not sent goes out now
        elif event.kind == "add_sampler":
            slot, self.next_slot = self.next_slot, self.next_slot + 1
            self.slots.append(slot)
            self.start_sampler(slot)
        elif event.kind == "kill_validator":
            index = rng.randrange(len(self.validator_ids))
            self.procs.kill(f"validator-{index}")  # its leases run out; the others take its partitions
            time.sleep(self.cfg.validators.lease_s * 2)
            self.start_validator(index)
        elif event.kind == "remove_sampler":
            alive = [s for s in self.slots if self.sampler_alive(s)]
            if len(alive) <= 1:
                return
            slot = rng.choice(alive)
            self.procs.stop([f"sampler-{slot}"], grace_s=60.0)
            self.slots.remove(slot)
        self.count(event.kind)

    def kill_learner_between_states(self, wait_s: float = 60.0) -> None:
        """SIGKILL the learner once it has published a version after its newest recovery state
        (or after `wait_s`), then restart it; the newest version published before is recorded."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            state = latest_state(self.states)
            newest = max(self.policies.list_versions(), default=0)
            if state is not None and newest > int(state.extra.get("policy_version", 0)):
                break
            time.sleep(0.5)
        self.procs.kill("learner")
        self.learner_kills.append({"newest_published": max(self.policies.list_versions(), default=0),
                                   "state_step": None if state is None else state.version,
                                   "state_version": 0 if state is None else int(state.extra.get("policy_version", 0))})
        time.sleep(2.0)
        self.start_learner()

    def corrupt_newest_delta(self, tries: int = 20, wait_s: float = 30.0) -> bool:
        """Freeze the learner and its publisher process (SIGSTOP to its process group) while the
        version the policy pointer names is a delta,
        overwrite that delta's payload in S3 with other bytes (its signed manifest stays),
        restart a sampler (a fresh one must rebuild that version from its keyframe), and wait
        until a sampler reports the version refused; then let the learner go on."""
        learner = self.procs.procs["learner"]
        corrupted = None
        try:
            for _ in range(tries):
                os.killpg(learner.pid, signal.SIGSTOP)  # the learner's session: its publisher too
                version, key = current_pointer(self.run_state)
                manifest = self.policies.read_manifest(key) if key else None
                if manifest is not None and (manifest.extra.get("weights") or {}).get("kind") == "delta":
                    junk = random.Random(version).randbytes(next(f["size"] for f in manifest.files
                                                                 if f["path"] == DELTA_FILE))
                    self.policies.client.put_object(self.policies.bucket, self.policies.version_prefix(version)
                                                    + DELTA_FILE, io.BytesIO(junk), len(junk))
                    corrupted = version
                    break
                os.killpg(learner.pid, signal.SIGCONT)
                deadline = time.monotonic() + 10.0
                while current_pointer(self.run_state)[0] == version and time.monotonic() < deadline:
                    time.sleep(0.2)
            if corrupted is None:
                self.log.warning("chaos: the learner published no delta to corrupt (every version a keyframe)")
                return False
            self.corrupted.append(corrupted)
            alive = [slot for slot in self.slots if self.sampler_alive(slot)]
            if alive:
                self.procs.kill(f"sampler-{alive[0]}")
                self.start_sampler(alive[0])
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if any(int(info.get("refused_checkpoints") or 0) for info in self.run_state.live_samplers().values()):
                    break
                time.sleep(0.5)
            else:
                self.log.warning("chaos: no sampler reported refusing the corrupted v%d within %.0fs", corrupted,
                                 wait_s)
            return True
        finally:
            os.killpg(learner.pid, signal.SIGCONT)

    def kill_sampler_mid_download(self, wait_s: float = 40.0) -> bool:
        """Slow the samplers' S3 link to 20 kB/s, SIGKILL the first sampler seen downloading,
        restore the link and restart it (a fresh process: nothing half-downloaded is loaded)."""
        self.proxy.set_spec(replace(self.sampler_spec, bandwidth_bytes_per_s=20_000), routes=["s3"])
        try:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                for sampler_id, info in self.run_state.live_samplers().items():
                    slot = int(sampler_id.rsplit("-s", 1)[1].split("-r")[0])
                    if info.get("downloading") is not None and slot in self.slots and self.sampler_alive(slot):
                        self.procs.kill(f"sampler-{slot}")
                        self.log.info("chaos: killed %s while it downloaded v%s", sampler_id, info["downloading"])
                        self.proxy.set_spec(self.sampler_spec, routes=["s3"])
                        self.start_sampler(slot)
                        return True
                time.sleep(0.25)
            self.log.warning("chaos: no sampler was seen downloading within %.0fs", wait_s)
            return False
        finally:
            self.proxy.set_spec(self.sampler_spec, routes=["s3"])

    def stop(self) -> None:
        self.procs.stop()
        self.proxy.stop()
        stop_stack(self.data_dir)


def weight_path_audit(bootstrap: str, topic: str, learner_kills: list[dict], corrupted: list[int],
                      reports: dict, trusted) -> dict:
    """What the weight path went through: each learner kill beside the version its successor
    resumed as (the update log's rewind markers, in order, each the learner's, signed by `trusted`;
    the first is the run's start), and what the samplers refused."""
    records = read_topic(bootstrap, updates_topic(topic), timeout_s=30.0)
    first_of_each: dict[str, UpdateEntry] = {}  # a learner process's rewind, once (a re-sent copy is not a kill)
    for r in records:
        entry = UpdateEntry.from_dict(verified_control_record(r.value, trusted, "update-log record"))
        if entry.kind == "rewind":
            first_of_each.setdefault(entry.attempt or str(r.offset), entry)
    rewinds = list(first_of_each.values())
    kills = [{**kill, "resumed_at_step": r.step, "resumed_as_version": r.policy_version}
             for kill, r in zip(learner_kills, rewinds[1:])]
    return {
        "learner_kills": kills,
        # Carrying on as the newest version is right only when that version is the state's own
        # weights (nothing was published after the state); any other number at or below it is reused.
        "versions_reused": sum(k["resumed_as_version"] < k["newest_published"]
                               or (k["resumed_as_version"] == k["newest_published"] != k["state_version"])
                               for k in kills)
        + max(0, len(learner_kills) - len(rewinds[1:])),  # a kill without a rewind is not accounted for
        "corrupted_deltas": corrupted,
        "sampler_refused_checkpoints": sum(int(r.get("refused_checkpoints", 0)) for r in reports.values()),
        "sampler_refused_delta_paths": sum(int(r.get("refused_delta_paths", 0)) for r in reports.values()),
        "sampler_weights_bytes": sum(int(r.get("weights_bytes_downloaded", 0)) for r in reports.values()),
    }


def run_chaos(cfg: HeteroConfig, out: Path, minutes: float, samplers: int, partition_s: float = 30.0,
              keep_stack: bool = False, validators: int = 0) -> int:
    log = setup_logging("chaos")
    logging.getLogger("infra.fault_proxy").setLevel(logging.ERROR)  # its refusals are counted in its stats
    out = Path(out)
    if (out / "audit.json").exists():
        raise UserError(f"{out} already holds a chaos run (audit.json); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    duration_s = minutes * 60
    run_name = f"{cfg.run.name}-chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    # The base model comes from the usual cache (services.data_dir/models); the servers and
    # their data live in OUT/data, so the run's record stays with its audit.
    base = resolve_base_model(cfg).resolve()
    cfg = cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"name": run_name, "rollout_topic": None}),
        "model": cfg.model.model_copy(update={"base": str(base)}),
        # Its own stack, whose addresses every process gets from its environment.
        "services": cfg.services.model_copy(update={"data_dir": str(out / "data"), "kafka_bootstrap": None,
                                                    "redis_url": None, "s3_endpoint": None}),
        "learner": cfg.learner.model_copy(update={"max_steps": 10**9, "idle_timeout_s": max(600.0, 4 * partition_s)}),
        "validators": cfg.validators.model_copy(update={"enabled": validators > 0}),
    })
    if validators > cfg.run.topic_partitions:  # one partition each, so that every validator works
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"topic_partitions": validators})})
    schedule = chaos_schedule(cfg.run.seed, duration_s, partition_s, validators)
    (out / "schedule.json").write_text(json.dumps([asdict(e) for e in schedule], indent=1))
    started = time.time()
    run: Optional[ChaosRun] = None
    try:
        run = ChaosRun(cfg, out, samplers, partition_s, log, validators)
        s = run.stack
        services = stack_services(s)
        state = RunState(connect_redis(s.redis_url), run_name)
        store = CheckpointStore(connect_s3(services), s.bucket, run_name)
        task = make_task_from_config(cfg)
        before = evaluate_base(cfg, base, task)
        log.info("held-out accuracy before: %.3f", before["accuracy_sampled"])
        run.start_learner()
        for index in range(validators):
            run.start_validator(index)
        for slot in run.slots:
            run.start_sampler(slot)
        rng = random.Random(cfg.run.seed + 1)
        t0 = time.monotonic()
        pending_events = list(schedule)
        bar = tqdm(total=int(duration_s), desc="chaos", unit="s", file=sys.stderr, disable=None, mininterval=2)
        while time.monotonic() - t0 < duration_s:
            elapsed = time.monotonic() - t0
            while pending_events and pending_events[0].at_s <= elapsed:
                run.apply(pending_events.pop(0), rng)
            learner = run.procs.procs["learner"]
            if learner.poll() is not None:
                raise run.procs.failure("learner", f"learner exited with {learner.returncode}")
            for slot in run.slots:  # a sampler that died by itself is a finding, not a fault
                p = run.procs.procs.get(f"sampler-{slot}")
                if p is not None and p.poll() not in (None, 0, -signal.SIGKILL):
                    raise run.procs.failure(f"sampler-{slot}", f"sampler-{slot} exited with {p.returncode}")
            bar.update(int(time.monotonic() - t0) - bar.n)
            bar.set_postfix_str(f"v{PolicyPointer(state).version()} samplers {sum(map(run.sampler_alive, run.slots))} "
                                f"faults {sum(run.faults.values())}")
            time.sleep(0.5)
        bar.close()

        log.info("stopping samplers (they flush their spools), then draining the learner")
        run.procs.stop([f"sampler-{slot}" for slot in run.slots], grace_s=120.0)
        learner = run.procs.procs["learner"]
        learner.send_signal(signal.SIGUSR1)
        drain_started = time.monotonic()
        while learner.poll() is None:
            if time.monotonic() - drain_started > 600:
                raise run.procs.failure("learner", "the learner did not finish draining within 600s")
            try:
                learner.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.info("waiting for the learner to read the rest of %s (policy v%s)", cfg.run.topic,
                         PolicyPointer(state).version())
        if learner.returncode != 0:
            raise run.procs.failure("learner", f"learner exited with {learner.returncode} while draining")
        version, _ = current_pointer(state)
        # The learner's last weights (and the offsets and verdicts it reached), from its final
        # recovery state: whole, whatever an attacker did to the chain of deltas before them.
        after, final_state = evaluate_final_state(cfg, store, out / "final_weights", task)
        reports = {**{k: v for k, v in state.expired_samplers(within_s=10**9).items()}, **state.sampler_stats()}
        audit = audit_topic(s.kafka_bootstrap, cfg.run.topic, final_state.extra, trusted_learner(cfg), reports,
                            honest_sampler_ids=run.sampler_ids)
        weights = weight_path_audit(s.kafka_bootstrap, cfg.run.topic, run.learner_kills, run.corrupted, reports,
                                    trusted_learner(cfg))
        proxy_stats = run.proxy.stats()
        audit = {
            "run": run_name, "minutes": minutes, "samplers": samplers, "validators": validators, "seed": cfg.run.seed,
            "faults": {**run.faults, "connection_resets": sum(r["connections_reset"] for r in proxy_stats.values()),
                       "blackholed_windows": max(r["blackholed_windows"] for r in proxy_stats.values())},
            **audit,
            "claims": state.claim_stats(),
            "weight_path": weights,
            "final_policy_version": version,
            "eval_accuracy_before": before["accuracy_sampled"], "eval_accuracy_after": after["accuracy_sampled"],
            "eval_greedy_before": before["accuracy_greedy"], "eval_greedy_after": after["accuracy_greedy"],
            "wall_seconds": round(time.time() - started, 1),
            "schedule": [asdict(e) for e in schedule],
        }
        (out / "audit.json").write_text(json.dumps(audit, indent=2))
        ok = (audit["lost"] == 0 and audit["used_twice"] == 0 and audit["unaccounted_count"] == 0
              and audit["forged_used_in_updates"] == 0 and weights["versions_reused"] == 0
              and not (validators and audit["used_without_verdict"]))  # with validators: no group used unchecked
        print(f"\nchaos {run_name}: {sum(run.faults.values())} scheduled faults {run.faults}, "
              f"{audit['faults']['connection_resets']} connection resets; produced {audit['produced']}, "
              f"used {audit['used_in_updates']}, dropped {audit['dropped_stale']}, dead-lettered "
              f"{audit['dead_lettered']}, duplicates {audit['duplicates_ignored']}, pending {audit['pending_at_end']}"
              f" -> lost {audit['lost']}, used twice {audit['used_twice']}, "
              + (f"used without a verdict {audit['used_without_verdict']}, " if validators else "") + f"forged used "
              f"{audit['forged_used_in_updates']}, versions reused {weights['versions_reused']}, delta paths "
              f"refused {weights['sampler_refused_delta_paths']}; policy v{version}; held-out accuracy "
              f"{before['accuracy_sampled']:.3f} -> {after['accuracy_sampled']:.3f}\naudit: {out}/audit.json")
        return 0 if ok else 1
    finally:
        if run is None:
            pass
        elif keep_stack:
            run.procs.stop()
            run.proxy.stop()
        else:
            run.stop()
