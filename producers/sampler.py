"""Sampler: generate prompt groups with the newest policy it has, publish them to Kafka.

Run: `heterorl sampler --config configs/demo.yaml` (any number, on any machine that can
reach the three servers; start or stop them at any time).

The loop, top to bottom:
  1. announce: take a lease in Redis (id, host, version, rate), renewed by heartbeats;
  2. wait for a published policy version, download its checkpoint from S3, verify it;
  3. repeat: if Redis shows a newer version (and the simulated refresh delay, if any,
     has run out), download + verify it on a background thread while generating with
     the current weights, and swap it in between batches once ready; hold back while too far
     behind to produce usable data, or while the learner's backlog is over its bound;
     claim the next prompts of the shared stream; sample G completions per prompt,
     recording the sampler's token log-probs; score them with the task's verifier;
     publish one message per prompt group, tagged with the policy version used (after
     the simulated transit delay, if any), through an on-disk spool that keeps every
     group until the broker acknowledged it (a broker outage or a crash loses nothing).

Prompts are claimed in Redis (`RunState.claim_prompts`) and marked done once their
groups are durably spooled; the claims of a sampler whose lease expired are re-issued to
the others. Every server call has a timeout; an unreachable broker or Redis is retried
with backoff, logged every time, while generation goes on as far as it can.

A checkpoint that fails verification is refused and the sampler keeps generating with
the weights it has; nothing received is ever unpickled. Simulated WAN delays:
docs/delays.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

from pipeline.config import HeteroConfig
from pipeline.rollout import Rollout
from pipeline.runtime import connect_run, make_task_from_config, setup_logging, touch_heartbeat_file
from pipeline.services import Backoff


def score_groups(task, tokenizer, problems, groups, *, sampler_id: str, policy_version: int, sampling: dict) -> list:
    """One Rollout per prompt group: rewards from the task's verifier on the decoded completions."""
    from pipeline.model import decode_completion

    return [Rollout(prompt_id=problem.problem_id, task=task.name, sampler_id=sampler_id,
                    policy_version=policy_version, prompt_ids=group.prompt_ids,
                    completion_ids=group.completion_ids, sampler_logps=group.sampler_logps,
                    rewards=[task.reward(problem, decode_completion(tokenizer, c)) for c in group.completion_ids],
                    sampling=sampling)
            for problem, group in zip(problems, groups)]


def new_sampler_id() -> str:
    return f"{socket.gethostname()[:24]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def sampler_seed(run_seed: int, sampler_id: str) -> int:
    """Each sampler gets its own random stream (the reference gave all the same seed)."""
    digest = hashlib.sha256(f"{run_seed}:{sampler_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _StopFlag:
    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_):
        self.stop = True


class PolicyHolder:
    """The weights a sampler generates with, and how it moves to a newer version.

    Downloads run on a background thread (`request`), so a slow or failing link never
    stalls generation: the loop keeps sampling with the weights it has and swaps the new
    ones in between batches (`swap_if_ready`). `update` is the blocking form, for the
    first load.
    """

    def __init__(self, store, work_dir: Path, log):
        import threading

        self.store = store
        self.work_dir = work_dir
        self.log = log
        self.version: Optional[int] = None
        self.model = None
        self.tokenizer = None
        self.refused: set[str] = set()
        self.downloading: Optional[int] = None
        """Version being downloaded, if any."""
        self._ready: Optional[tuple] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def request(self, version: Optional[int], manifest_key: Optional[str], forced: bool = False) -> None:
        """Start downloading `version` in the background if it is newer than ours and nothing is in flight."""
        import threading

        if version is None or manifest_key is None or (self.version is not None and version <= self.version):
            return
        if manifest_key in self.refused or self.downloading is not None or self._ready is not None:
            return
        self.downloading = version
        self._thread = threading.Thread(target=self._download, args=(version, manifest_key, forced),
                                        name=f"download-v{version}", daemon=True)
        self._thread.start()

    def _download(self, version: int, manifest_key: str, forced: bool) -> None:
        import urllib3
        from minio.error import S3Error

        from pipeline.checkpoints import CheckpointNotFound, CorruptCheckpointError
        from pipeline.model import load_policy
        from pipeline.services import ServiceUnavailable

        try:
            path, _ = self.store.fetch(manifest_key, self.work_dir / f"v{version}")
            model, tokenizer = load_policy(path)
            with self._lock:
                self._ready = (version, model, tokenizer, forced)
        except CorruptCheckpointError as e:
            self.refused.add(manifest_key)
            self.log.error("%s; keeping policy v%s", e, self.version)
        except CheckpointNotFound as e:  # pruned between the Redis read and the fetch
            self.log.warning("%s; will pick up a newer version", e)
        except (S3Error, urllib3.exceptions.HTTPError, OSError, ServiceUnavailable) as e:  # the network
            self.log.warning("could not download policy v%d (%s: %s); keeping v%s and retrying",
                             version, type(e).__name__, str(e).splitlines()[0][:160], self.version)
        except Exception as e:  # noqa: BLE001 - verified bytes that do not load: never retry them
            self.refused.add(manifest_key)
            self.log.error("policy v%d does not load (%s: %s); keeping v%s", version, type(e).__name__,
                           str(e).splitlines()[0][:160] if str(e) else "", self.version)
        finally:
            self.downloading = None

    def swap_if_ready(self) -> Optional[bool]:
        """Load a finished download; returns its `forced` flag, or None if nothing was ready."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        version, model, tokenizer, forced = ready
        old = self.version
        self.model, self.tokenizer, self.version = model, tokenizer, version
        if old is not None:
            shutil.rmtree(self.work_dir / f"v{old}", ignore_errors=True)
        self.log.info("policy v%d loaded (was v%s)", version, old)
        return forced

    def update(self, version: Optional[int], manifest_key: Optional[str]) -> bool:
        """Blocking: load `version` if it is newer than ours; False (keep current weights) on failure."""
        self.request(version, manifest_key)
        if self._thread is not None:
            self._thread.join()
        return self.swap_if_ready() is not None


class Outbox:
    """Finished groups on their way to the broker: simulated transit, then the on-disk spool.

    A group is appended to the spool (fsynced) once its transit delay is over and leaves it
    only when the broker acknowledged it, so a broker outage or a crash loses nothing; while
    the broker is unreachable, generation goes on and groups wait in the spool, and those
    that grew too stale meanwhile are discarded at the source (counted).
    """

    def __init__(self, spool, make_sink, transit, retry_max_s: float, log, broker: str):
        self.spool = spool
        self.make_sink = make_sink  # () -> RolloutSink; raises ServiceUnavailable while unreachable
        self.sink = None
        self.transit = transit  # DelayStream: seconds each group travels (0 when the delay model is off)
        self.held: list[tuple[float, Rollout]] = []
        self.acked_up_to: dict[int, int] = {}  # partition -> 1 + highest offset acknowledged to us
        self.published = 0
        self.discarded_at_source = 0
        self.spooled_ids: list[str] = []
        """Rollout ids durably spooled whose prompt claims are not yet marked done."""
        self.backoff = Backoff(retry_max_s)
        self.log, self.broker = log, broker

    def add(self, rollouts: list[Rollout]) -> None:
        now = time.monotonic()
        self.held += [(now + self.transit.draw(), r) for r in rollouts]

    def spool_due(self, everything: bool = False) -> bool:
        """Move groups whose transit is over into the spool; False if the spool is full."""
        now = time.monotonic()
        while self.held and (everything or self.held[0][0] <= now):
            if not self.spool.append(self.held[0][1]):
                return False
            self.spooled_ids.append(self.held.pop(0)[1].rollout_id)
        return True

    def deliver(self, is_stale) -> None:
        """Send what the spool holds, in order, unless the broker is in its retry backoff."""
        if not self.spool.pending() or not self.backoff.ready():
            return
        from pipeline.services import ServiceUnavailable

        if self.sink is None:
            try:
                self.sink = self.make_sink()
            except ServiceUnavailable as e:
                self._failed(str(e))
                return
        delivered = self.spool.flush_to(self, is_stale=is_stale, on_discarded=self._discarded)
        if self.spool.last_error:
            self._failed(self.spool.last_error)
        elif delivered or not self.spool.pending():
            if self.backoff.failures:
                self.log.info("broker %s reachable again: spool flushed", self.broker)
            self.backoff.succeeded()

    def send_many(self, rollouts: list[Rollout]) -> list[tuple[int, int]]:
        """The spool's sink: the producer, with the acknowledgements recorded for the backlog."""
        acks = self.sink.send_many(rollouts)
        for partition, offset in acks:
            self.acked_up_to[partition] = max(self.acked_up_to.get(partition, 0), offset + 1)
        self.published += len(rollouts)
        return acks

    def _discarded(self, rollouts: list[Rollout]) -> None:
        self.discarded_at_source += len(rollouts)
        self.log.warning("discarded %d spooled groups already past the learner's max delay (versions %s)",
                         len(rollouts), sorted({r.policy_version for r in rollouts}))

    def _failed(self, error: str) -> None:
        if self.sink is not None:  # a fresh producer next time: a failed one may be stuck for good
            try:
                self.sink.producer.close(timeout=1.0)
            except Exception:  # noqa: BLE001 - it is being replaced because it misbehaves
                pass
            self.sink = None
        wait = self.backoff.failed()
        self.log.warning("broker %s unreachable (%s): %d groups spooled, retrying in %.1fs", self.broker,
                         error.splitlines()[0][:160], self.spool.pending(), wait)

    def waiting(self) -> int:
        return len(self.held) + self.spool.pending()

    def close(self, timeout_s: float) -> None:
        """Last delivery attempt (within `timeout_s`); what is left stays spooled for the next start."""
        self.spool_due(everything=True)
        deadline = time.monotonic() + timeout_s
        while self.spool.pending() and time.monotonic() < deadline:
            self.backoff.next_try = 0.0
            self.deliver(is_stale=None)
            if self.spool.pending():
                time.sleep(0.5)
        if self.sink is not None:
            try:
                self.sink.close()
            except Exception as e:  # noqa: BLE001 - the broker may be gone; the spool keeps the data
                self.log.warning("closing the producer: %s", e)
        self.spool.close()


def _connect_retrying(cfg: HeteroConfig, log, give_up_s: float = 300.0):
    """The servers, and the topic, with backoff: a sampler started during an outage waits
    for the link (saying so) instead of exiting; after `give_up_s` the error stands."""
    from pipeline.kafka_io import ensure_topic
    from pipeline.services import ServiceUnavailable

    backoff, deadline = Backoff(cfg.sampler.retry_max_backoff_s), time.monotonic() + give_up_s
    while True:
        try:
            handles = connect_run(cfg)
            ensure_topic(handles.services.kafka_bootstrap, cfg.run.topic, cfg.run.topic_partitions,
                         retention_ms=cfg.run.topic_retention_ms)
            return handles
        except ServiceUnavailable as e:
            if time.monotonic() > deadline:
                raise
            log.warning("%s; retrying in %.1fs", e, backoff.failed())
            time.sleep(max(0.0, backoff.next_try - time.monotonic()))


def run_sampler(cfg: HeteroConfig, sampler_id: Optional[str] = None) -> int:
    import redis
    import torch

    from pipeline.delays import RefreshGate, too_far_behind, transit_stream
    from pipeline.kafka_io import RolloutSink
    from pipeline.model import sample_groups
    from pipeline.spool import RolloutSpool

    sampler_id = sampler_id or new_sampler_id()
    log = setup_logging(f"sampler {sampler_id}")
    torch.set_num_threads(cfg.sampler.torch_threads)
    scfg = cfg.sampler
    handles = _connect_retrying(cfg, log)
    state, store = handles.state, handles.store
    task = make_task_from_config(cfg)
    bootstrap = handles.services.kafka_bootstrap
    spool_dir = Path(scfg.spool_dir or Path(cfg.services.data_dir) / "spool" / sampler_id)
    spool = RolloutSpool(spool_dir, max_bytes=int(scfg.spool_max_mb * 1024 * 1024), max_groups=scfg.spool_max_groups)
    if spool.pending():
        log.info("recovered %d spooled groups from %s", spool.pending(), spool_dir)
    outbox = Outbox(spool, lambda: RolloutSink(bootstrap, cfg.run.topic, send_timeout_s=scfg.send_timeout_s,
                                               connect_timeout_s=scfg.send_timeout_s),
                    transit_stream(scfg.delays, sampler_id), scfg.retry_max_backoff_s, log, bootstrap)
    gate = RefreshGate(scfg.delays, sampler_id)
    work_dir = Path(cfg.services.data_dir) / "samplers" / sampler_id
    work_dir.mkdir(parents=True, exist_ok=True)
    policy = PolicyHolder(store, work_dir, log)
    stop = _StopFlag()
    seed = sampler_seed(cfg.run.seed, sampler_id)
    sampling = {"temperature": scfg.temperature, "top_p": scfg.top_p, "top_k": scfg.top_k,
                "max_new_tokens": scfg.max_new_tokens}
    started = time.time()
    generated = 0
    newest = None
    waited = {"paused_backlog_s": 0.0, "paused_spool_full_s": 0.0, "paused_redis_s": 0.0,
              "stalled_behind_s": 0.0, "stalls_behind": 0}
    stalled = False
    last_heartbeat = last_poll = 0.0
    last_wait_log = time.monotonic()
    redis_backoff = Backoff(scfg.retry_max_backoff_s)

    def totals() -> dict:
        return {"generated": generated, "published": outbox.published, "spooled": spool.pending(),
                "discarded_at_source": outbox.discarded_at_source,
                "paused_s": round(sum(v for k, v in waited.items() if k.endswith("_s")), 1),
                **{k: round(v, 1) for k, v in waited.items()}, **gate.stats}

    def heartbeat() -> None:
        minutes = max((time.time() - started) / 60, 1e-9)
        state.renew_sampler_lease(sampler_id, {
            "host": socket.gethostname(), "pid": os.getpid(), "policy_version": policy.version,
            "groups": outbox.published, "rollouts_per_min": round(outbox.published / minutes, 2),
            "versions_behind": (newest - policy.version) if newest is not None and policy.version is not None else None,
            "downloading": policy.downloading, "started_at": started, "held_in_transit": len(outbox.held),
            **totals(),
        }, scfg.lease_ttl_s)
        state.reissue_expired_claims()  # any live sampler hands back the claims of dead ones
        touch_heartbeat_file()

    def behind() -> bool:
        return too_far_behind(newest, policy.version, backlog(), cfg.learner.groups_per_step,
                              cfg.learner.max_delay_steps)

    def too_stale(rollout: Rollout) -> bool:
        """Judged at the source with the newest version we know: the learner would drop it."""
        return newest is not None and newest - rollout.policy_version > cfg.learner.max_delay_steps

    def refresh() -> None:
        """Load a newer policy once the (simulated) refresh delay allows it."""
        nonlocal newest
        newest, manifest_key = state.policy()
        if newest is None or (policy.version is not None and newest <= policy.version):
            return
        # A delay counted in learner steps can only run out if the learner keeps getting
        # data; a sampler already too far behind to give it any refreshes now.
        allowed = gate.should_load(policy.version, newest)
        forced = not allowed and scfg.delays.unit == "steps" and behind()
        if allowed or forced:
            policy.request(newest, manifest_key, forced=forced)

    def wait(reason: str, seconds: float = 0.05) -> None:
        time.sleep(seconds)
        waited[reason] += seconds

    def backlog() -> int:
        """Groups the learner has not read yet: in the topic (as of our last acknowledgement),
        in simulated transit and in the spool here."""
        read = state.learner_offsets()
        return outbox.waiting() + sum(max(0, end - read.get(p, 0)) for p, end in outbox.acked_up_to.items())

    claim_of: dict[str, int] = {}  # rollout id -> prompt index, until the claim is marked done

    def confirm_claims() -> None:
        """Prompts whose groups are safely on disk are done: nobody needs to redo them."""
        if outbox.spooled_ids:
            state.complete_prompts(sampler_id, [claim_of[r] for r in outbox.spooled_ids if r in claim_of])
            for r in outbox.spooled_ids:
                claim_of.pop(r, None)
            outbox.spooled_ids.clear()

    def generate() -> None:
        nonlocal generated
        indices = state.claim_prompts(sampler_id, scfg.prompts_per_batch)
        problems = [task.train_problem(i) for i in indices]
        groups = sample_groups(
            policy.model, policy.tokenizer, [p.prompt for p in problems], group_size=scfg.group_size,
            temperature=scfg.temperature, top_p=scfg.top_p, top_k=scfg.top_k,
            max_new_tokens=scfg.max_new_tokens, seed=seed + indices[0])
        rollouts = score_groups(task, policy.tokenizer, problems, groups, sampler_id=sampler_id,
                                policy_version=policy.version, sampling=sampling)
        claim_of.update((r.rollout_id, i) for r, i in zip(rollouts, indices))
        outbox.add(rollouts)
        generated += len(groups)

    def step() -> bool:
        """One turn of the loop; False once sampler.max_groups is reached."""
        nonlocal last_heartbeat, last_poll, last_wait_log, stalled
        now = time.monotonic()
        if now - last_heartbeat >= scfg.heartbeat_interval_s:
            heartbeat()
            last_heartbeat = now
        if now - last_poll >= scfg.weight_poll_interval_s or policy.model is None:
            refresh()
            last_poll = now
        forced = policy.swap_if_ready()
        if forced is not None:
            gate.loaded(forced=forced)
        spool_has_room = outbox.spool_due()
        confirm_claims()
        outbox.deliver(too_stale)
        if policy.model is None:
            if time.monotonic() - last_wait_log > 5:
                log.info("waiting for a policy version: %s (Redis %s)", f"downloading v{policy.downloading}"
                         if policy.downloading is not None else "none published yet", handles.services.redis_url)
                last_wait_log = time.monotonic()
            time.sleep(0.5)
            return True
        if not spool_has_room:
            wait("paused_spool_full_s", 0.5)  # the broker has been away long: nowhere to put more
            return True
        if behind():  # don't waste compute on data that will be dropped: wait for a refresh
            waited["stalls_behind"] += not stalled  # episodes, not polls
            stalled = True
            wait("stalled_behind_s", 0.05)
            return True
        stalled = False
        if scfg.max_backlog_groups is not None and backlog() > scfg.max_backlog_groups:
            wait("paused_backlog_s")  # the learner is behind: don't waste compute
            return True
        generate()
        if scfg.max_groups is not None and generated >= scfg.max_groups:
            log.info("generated %d groups (sampler.max_groups); stopping", generated)
            return False
        return True

    log.info("sampler %s started (topic %s, seed %d, spool %s, delays: refresh %s, transit %s)", sampler_id,
             cfg.run.topic, seed, spool_dir, scfg.delays.refresh.kind, scfg.delays.transit.kind)
    try:
        while not stop.stop:
            try:
                if not redis_backoff.ready():
                    outbox.spool_due()
                    outbox.deliver(too_stale)
                    wait("paused_redis_s", 0.2)
                    continue
                if not step():
                    break
                if redis_backoff.failures:
                    log.info("Redis %s reachable again", handles.services.redis_url)
                redis_backoff.succeeded()
            except redis.RedisError as e:  # claims and versions live there: wait for it
                log.warning("Redis %s unreachable (%s); retrying in %.1fs, %d groups waiting to be sent",
                            handles.services.redis_url, type(e).__name__, redis_backoff.failed(), outbox.waiting())
    finally:
        outbox.close(timeout_s=scfg.send_timeout_s)
        try:
            confirm_claims()
            state.record_sampler_stats(sampler_id, totals())
            state.release_sampler_lease(sampler_id)
        except redis.RedisError as e:
            log.warning("could not record the final stats in Redis: %s", e)
        shutil.rmtree(work_dir, ignore_errors=True)
        if not spool.pending():
            shutil.rmtree(spool_dir, ignore_errors=True)
        log.info("sampler %s stopped after %d groups (%s)", sampler_id, outbox.published,
                 ", ".join(f"{k} {v}" for k, v in totals().items()))
    return 0
