"""Sampler: generate prompt groups with the newest policy it has, publish them to Kafka.

Run: `heterorl sampler --config demo` (any number, on any machine that can reach the
three servers; start or stop them at any time).

`Sampler.run` repeats `Sampler.turn`, which reads top to bottom:
  1. heartbeat: renew this sampler's lease in Redis (id, host, version, rate);
  2. read the run once (`RunState.sampler_view`: newest policy, learner position);
  3. refresh weights: if a newer version is published (and the simulated refresh delay,
     if any, has run out), download + verify it on a background thread while generating
     with the current weights;
  4. swap: put a finished download into the running generation engine between batches
     (`pipeline.sampling.generation`: the `hf` loop or vLLM, whose engine is reloaded in place);
  5. pump the outbox: groups whose simulated transit is over go to the on-disk spool,
     which keeps every group until the broker acknowledged it (a broker outage or a crash
     loses nothing), and the spool is sent on;
  6. pause for a named reason (`pipeline.sampling.pacing`: no policy yet, spool full, too far
     behind, learner backlog), or generate: claim the next prompts of the shared stream,
     sample G completions per prompt recording the sampler's token log-probs, score them
     with the task's verifier, and hand one group per prompt, tagged with the policy
     version used, to the outbox.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import redis
import torch

from pipeline.config import HeteroConfig, strip_password
from pipeline.sampling.delays import RefreshGate, stream_key, transit_stream
from pipeline.devices import resolve_device
from pipeline.clients.topics import TopicWriter, ensure_topic
from pipeline.trust.keyring import key_paths, load_sampler_key
from pipeline.clients.run_functions import sampler_token
from pipeline.sampling.generation import PolicyEngine, SamplingSettings, make_generation_engine, pick_backend
from pipeline.weights.follower import PolicyFollower
from pipeline.weights.same_host import lay_out_local_v0, policy_dtype
from pipeline.models import decode_completion
from pipeline.sampling.pacing import Pacing, Pauses, StepPeriod
from pipeline.clients.run_state import RunView
from pipeline.clients.retry import Backoff, retry_call
from pipeline.wire.rollout import Rollout
from pipeline.runtime import (connect_run, make_task_from_config, resolve_base_model, setup_logging,
                              touch_heartbeat_file, with_machine_precision)
from pipeline.clients.services import ServiceUnavailable
from pipeline.wire.signing import KeyFileError, SignatureError, SigningKey
from pipeline.clients.run_state import MalformedPointer
from pipeline.weights.store import CorruptCheckpointError, PolicyPointer, verify_pointer
from pipeline.clients.spool import RolloutSpool


def score_groups(task, tokenizer, problems, groups, *, sampler_id: str, policy_version: int, sampling: dict) -> list:
    """One Rollout per prompt group: rewards from the task's verifier on the decoded completions."""
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


class StopRequest:
    """SIGTERM or SIGINT: finish the turn, send what can be sent, release the lease."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_):
        self.requested = True


class Outbox:
    """Finished groups on their way to the broker: simulated transit, then the on-disk spool.

    A group is appended to the spool (fsynced) once its transit delay is over and leaves it
    only when the broker acknowledged it, so a broker outage or a crash loses nothing; while
    the broker is unreachable, generation goes on and groups wait in the spool, and those
    that grew too stale meanwhile are discarded at the source (counted).
    """

    def __init__(self, spool, make_sink, transit, retry_max_s: float, log, broker: str):
        self.spool = spool
        self.make_sink = make_sink  # () -> TopicWriter; raises ServiceUnavailable while unreachable
        self.sink = None
        self.transit = transit  # DelayStream: seconds each group travels (0 when the delay model is off)
        self.held: list[tuple[float, Rollout]] = []
        self.acked_up_to: dict[int, int] = {}  # partition -> 1 + highest offset acknowledged to us
        self.published = 0
        self.discarded_at_source = 0
        self.spooled_ids: list[str] = []
        """Rollout ids durably spooled whose prompt claims are not yet marked done."""
        self.claim_of: dict[str, int] = {}
        """Rollout id -> the prompt index it was claimed for, until the claim is marked done."""
        self.discards_reported = 0
        """Of `discarded_at_source`, how many the fleet was told of (claim_stats)."""
        self.backoff = Backoff(retry_max_s)
        self.log, self.broker = log, broker

    @classmethod
    def open(cls, cfg: HeteroConfig, sampler_id: str, spool_dir: Path, services, signer, stamp, log) -> "Outbox":
        """The sampler's outbox: its spool in `spool_dir` (what an earlier run left there is sent
        first) and a producer made when first needed, sealing each group with `signer`."""
        scfg, bootstrap = cfg.sampler, services.kafka_bootstrap
        spool = RolloutSpool(spool_dir, max_bytes=int(scfg.spool_max_mb * 1024 * 1024), max_groups=scfg.spool_max_groups)
        if spool.pending():
            log.info("recovered %d spooled groups from %s", spool.pending(), spool_dir)
        return cls(spool, lambda: TopicWriter(bootstrap, cfg.run.topic, send_timeout_s=scfg.send_timeout_s,
                                              connect_timeout_s=scfg.send_timeout_s, signer=signer, stamp=stamp,
                                              security=services.security),
                   transit_stream(scfg.delays, stream_key(cfg.run.name, sampler_id)), scfg.retry_max_backoff_s, log,
                   bootstrap)

    def add(self, rollouts: list[Rollout], claims: list[int]) -> None:
        """Groups made for the prompts claimed as `claims` (one index each, in order)."""
        now = time.monotonic()
        self.held += [(now + self.transit.draw(), r) for r in rollouts]
        self.claim_of.update((r.rollout_id, i) for r, i in zip(rollouts, claims))

    def confirm_claims(self, state, sampler_id: str) -> None:
        """Prompts whose groups are safely on disk are done: nobody needs to redo them. Then the
        groups discarded from the spool since the last call are reported, so the fleet's backlog
        drops them: after their completions, as the run functions count a sampler's discards
        only against what it completed (a group spooled and discarded within one turn was
        otherwise never subtracted, and at a small max delay the fleet paced itself to a halt)."""
        if self.spooled_ids:
            state.complete_prompts(sampler_id, [self.claim_of[r] for r in self.spooled_ids if r in self.claim_of])
            for r in self.spooled_ids:
                self.claim_of.pop(r, None)
            self.spooled_ids.clear()
        discarded = self.discarded_at_source - self.discards_reported
        if discarded:
            state.note_discarded_at_source(sampler_id, discarded)
            self.discards_reported += discarded

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
        self.backoff.succeeded()  # try at once, then on a fresh jittered backoff
        while self.spool.pending() and time.monotonic() < deadline:
            self.deliver(is_stale=None)
            if self.spool.pending():
                time.sleep(max(0.05, min(self.backoff.next_try, deadline) - time.monotonic()))
        if self.sink is not None:
            try:
                self.sink.close()
            except Exception as e:  # noqa: BLE001 - the broker may be gone; the spool keeps the data
                self.log.warning("closing the producer: %s", e)
        self.spool.close()


YIELD_POLL_S = 0.02
"""How often a sampler yielding to the learner looks whether it may go on (`sampler.yield_to_learner`)."""


def make_sampler_engine(cfg: HeteroConfig) -> tuple[HeteroConfig, str, PolicyEngine]:
    """The generation engine of `sampler.backend` on `model.device`, with `cfg` as the machine's
    precision resolves it (`precision: auto`) and the line that says what it chose and why."""
    torch.set_num_threads(cfg.sampler.torch_threads)
    device = resolve_device(cfg.model.device)
    cfg, precision = with_machine_precision(cfg, device)
    scfg = cfg.sampler
    sampling = SamplingSettings(scfg.temperature, scfg.top_p, scfg.top_k, scfg.max_new_tokens)
    return cfg, precision, make_generation_engine(
        pick_backend(scfg.backend, device, sampling), sampling, device, precision=scfg.precision,
        attention=cfg.model.attention, kv_cache_gib=scfg.vllm_kv_cache_gib, max_model_len=scfg.vllm_max_model_len,
        gpu_memory_utilization=scfg.vllm_gpu_memory_utilization)


def sampler_signing_key(cfg: HeteroConfig, sampler_id: str, log) -> Optional[SigningKey]:
    """The sampler's key (HETERORL_SAMPLER_KEY, security.sampler_key or the keys folder); None
    only when signatures are not required and no key is there."""
    try:
        key = load_sampler_key(key_paths(cfg), sampler_id, cfg.security.sampler_key)
    except KeyFileError:
        if cfg.security.require_signatures:
            raise
        log.warning("no sampler key: rollouts go out unsigned (security.require_signatures is off)")
        return None
    log.info("signing rollouts with key %s", key.key_id)
    return key


def id_token(run: str, sampler_id: str, signer: Optional[SigningKey]) -> str:
    """The secret this sampler holds its id with in Redis: its lease, claims and stats are written only
    with it (`pipeline.clients.run_functions`); derived from its key, so its restarts have it too."""
    return sampler_token(run, sampler_id, None if signer is None else signer.seed_b64().encode())


def connect_sampler(cfg: HeteroConfig, log, give_up_s: float = 300.0):
    """The servers and the topic, retried: a sampler started during an outage waits for the
    link (saying so) instead of exiting; after `give_up_s` the error stands."""
    def connect():
        handles = connect_run(cfg)
        ensure_topic(handles.services.kafka_bootstrap, cfg.run.topic, cfg.run.topic_partitions,
                     security=handles.services.security, retention_ms=cfg.run.topic_retention_ms)
        return handles

    return retry_call(connect, retry_on=(ServiceUnavailable,), first_s=0.5, max_s=cfg.sampler.retry_max_backoff_s,
                      give_up_after_s=give_up_s, on_retry=lambda e, wait, _: log.warning("%s; retrying in %.1fs", e, wait))


@dataclass
class SamplerParts:
    """What a sampler is built with beyond its config; `heterorl loadtest` passes modeled ones."""

    engine: Optional[PolicyEngine] = None
    """The generation engine (default: `sampler.backend` on `model.device`)."""
    stop: Any = None
    """What `run()` checks to stop (`.requested`; default: SIGTERM/SIGINT)."""
    on_connect: Optional[Callable[[Any], None]] = None
    """Called with the run's handles once connected (the rig counts the Redis commands sent)."""
    policy: Optional[PolicyFollower] = None
    """A follower already fetching the first policy (`fetch_first_policy`); default: a new one."""


def sampler_log_role(sampler_id: str) -> str:
    return f"sampler {sampler_id}"


def sampler_work_dir(cfg: HeteroConfig, sampler_id: str) -> Path:
    """Where a sampler's policies are downloaded to (removed when it stops)."""
    return Path(cfg.services.data_dir) / "samplers" / sampler_id


def pointer_problem(run: str, view: RunView, current: Optional[int], trusted) -> Optional[str]:
    """Why a policy pointer newer or older than `current` must not be followed: it moved back (a
    rollback), or the learner key `trusted` did not sign it; None: follow it."""
    if current is not None and view.newest_version < current:
        return f"it moved back from v{current} to v{view.newest_version} (a rollback)"
    if trusted is not None:
        try:
            verify_pointer(run, view.newest_version, view.manifest_key, view.updated_at, view.signature, trusted)
        except SignatureError as e:
            return e.reason
    return None


def fetch_first_policy(cfg: HeteroConfig, sampler_id: str) -> Optional[PolicyFollower]:
    """A follower already downloading the run's newest policy (its pointer checked as every
    sampler checks it), for a sampler not started yet: `heterorl join` starts it while the
    learner admits the host. On a slow link the first keyframe is most of a volunteer's wait
    (docs/deployment.md); the admission, the sampler's imports, its engine and its connections
    had put 15 s before it in `heterorl wan`. None (the sampler starts its own) where nothing
    is published, the pointer is refused, or the servers do not answer."""
    log = setup_logging(sampler_log_role(sampler_id))
    try:
        handles = connect_run(cfg)
        with handles.state.client:  # the pointer is all this reads from Redis
            pointer = PolicyPointer(handles.state).read_verified(handles.store.trusted)
        if pointer is None:
            return None
        work_dir = sampler_work_dir(cfg, sampler_id)
        work_dir.mkdir(parents=True, exist_ok=True)
    except (ServiceUnavailable, redis.RedisError, SignatureError, MalformedPointer, OSError) as e:
        log.warning("not fetching a policy before the sampler starts: %s", getattr(e, "reason", e))
        return None
    follower = PolicyFollower(handles.store, work_dir, log)
    follower.request(pointer.version, pointer.manifest_key)
    return follower


def new_follower(cfg: HeteroConfig, handles, work_dir: Path, engine: PolicyEngine, log) -> PolicyFollower:
    """The sampler's follower (taking versions from the learner's copies on this host where
    `sampler.host_copies_dir` names them), with v0 already loaded from the base model's files
    where `sampler.local_v0_sha256` says so and the run has published nothing past v0; a base
    that hashes otherwise is refused, and v0 comes through S3 like any other version."""
    follower = PolicyFollower(handles.store, work_dir, log, engine, host_copies=cfg.sampler.host_copies_dir)
    if cfg.sampler.local_v0_sha256 is None:
        return follower
    published = PolicyPointer(handles.state).version()  # unverified: a forged one only sends us to S3
    if published is not None and published > 0:
        log.info("the run is at v%d already: not loading v0 from local files", published)
        return follower
    try:
        copy = lay_out_local_v0(resolve_base_model(cfg), work_dir / "v0", policy_dtype(cfg.learner),
                                cfg.sampler.local_v0_sha256)
    except CorruptCheckpointError as e:
        log.error("%s; taking v0 from the learner through S3", e)
        return follower
    follower.adopt_local(0, copy)
    return follower


class Sampler:
    """One sampler process: `run()` repeats `turn()`, whose steps are the methods below."""

    def __init__(self, cfg: HeteroConfig, sampler_id: Optional[str] = None, parts: SamplerParts = SamplerParts()):
        self.cfg, self.scfg, self.parts = cfg, cfg.sampler, parts
        self.precision = f"precision: sampling {self.scfg.precision}"
        """What `make_sampler_engine` chose for `sampler.precision` and why (logged at the start)."""
        self.sampler_id = sampler_id or new_sampler_id()
        self.log = setup_logging(sampler_log_role(self.sampler_id))
        self.seed = sampler_seed(cfg.run.seed, self.sampler_id)
        self.sampling = {"temperature": self.scfg.temperature, "top_p": self.scfg.top_p, "top_k": self.scfg.top_k,
                         "max_new_tokens": self.scfg.max_new_tokens}
        self.pacing = Pacing(cfg.learner.groups_per_step, cfg.learner.max_delay_steps, self.scfg.max_backlog_groups,
                             wait_for_next_version=self.scfg.wait_for_next_version,
                             margin_steps=self.scfg.pacing_margin_steps)
        self.gate = RefreshGate(self.scfg.delays, stream_key(cfg.run.name, self.sampler_id))
        self.redis_backoff = Backoff(self.scfg.retry_max_backoff_s)
        self.view = RunView(None, None, {})
        self.policy_read_at = self.last_heartbeat = 0.0
        self.last_wait_log = time.monotonic()
        self.started, self.generated = time.time(), 0
        self.generate_s = 0.0
        """Seconds spent in the engine's sample() (the rest of a sampler's time: pauses, loads, I/O)."""
        self.pauses = Pauses()
        self.step_period = StepPeriod()
        self.last_batch_s: Optional[float] = None
        """Seconds the last batch took to generate (a group generated now is overtaken for that long)."""
        self.verifier_errors_logged = 0
        self.refused_pointer: Optional[tuple] = None
        self.refused_pointers = 0

    def run(self) -> int:
        """Generate until stopped (SIGTERM/SIGINT) or `sampler.max_groups`; Redis outages are waited out."""
        self.start()
        try:
            while not self.stop.requested:
                if not self.redis_backoff.ready():  # claims and versions live there: wait for it
                    self.pump_outbox()
                    self.pause("redis")
                    continue
                try:
                    if not self.turn():
                        break
                    if self.redis_backoff.failures:
                        self.log.info("Redis %s reachable again", self.redis_url)
                    self.redis_backoff.succeeded()
                except redis.RedisError as e:
                    self.log.warning("Redis %s unreachable (%s); retrying in %.1fs, %d groups waiting to be sent",
                                     self.redis_url, type(e).__name__, self.redis_backoff.failed(),
                                     self.outbox.waiting())
        finally:
            self.close()
        return 0

    def turn(self) -> bool:
        """Heartbeat, refresh weights, swap, pump the outbox, then pause (for a named reason) or
        generate. False once `sampler.max_groups` groups were generated."""
        self.heartbeat_if_due()
        view, policy_polled = self.read_view()  # the turn's one Redis read for pacing
        if policy_polled:
            self.refresh_weights(view)
        self.swap_weights()
        spool_has_room = self.pump_outbox()
        self.outbox.confirm_claims(self.state, self.sampler_id)
        backlog = self.backlog(view)
        overtaken = self.step_period.steps_during(self.last_batch_s, time.monotonic())  # steps a batch takes
        reason = self.pacing.pause_reason(has_policy=self.policy.loaded, spool_has_room=spool_has_room,
                                          newest=view.version_at_use, current=self.policy.version,
                                          backlog=backlog, generating_steps=overtaken,
                                          learner_version=view.learner_version)
        if reason is not None:
            self.pause(reason)
            return True
        limit = self.pacing.in_flight_limit(view.version_at_use, self.policy.version, backlog - view.in_flight,
                                            overtaken)
        if not self.generate(limit):  # the fleet claimed the room first
            self.pause("behind")
            return True
        self.pauses.generated()
        if self.scfg.max_groups is not None and self.generated >= self.scfg.max_groups:
            self.log.info("generated %d groups (sampler.max_groups); stopping", self.generated)
            return False
        return True

    # ---- start ----------------------------------------------------------------------
    def start(self) -> None:
        """Connect (waiting out an outage), recover the spool, announce the sampler."""
        if self.parts.engine is None:  # a missing engine fails here, before any server is waited for
            self.cfg, self.precision, engine = make_sampler_engine(self.cfg)
            self.scfg = self.cfg.sampler
        else:
            engine = self.parts.engine
        self.signer = sampler_signing_key(self.cfg, self.sampler_id, self.log)
        self.next_seq = time.time_ns() // 1000  # increasing across restarts of this key, too
        self.handles = connect_sampler(self.cfg, self.log)
        if self.parts.on_connect is not None:
            self.parts.on_connect(self.handles)
        self.state, self.redis_url = self.handles.state, strip_password(self.handles.services.redis_url)  # for logs
        self.state.hold_as(self.sampler_id, id_token(self.cfg.run.name, self.sampler_id, self.signer))
        self.task = make_task_from_config(self.cfg)
        self.spool_dir = Path(self.scfg.spool_dir or Path(self.cfg.services.data_dir) / "spool" / self.sampler_id)
        self.outbox = Outbox.open(self.cfg, self.sampler_id, self.spool_dir, self.handles.services, self.signer,
                                  self.stamp, self.log)
        self.work_dir = sampler_work_dir(self.cfg, self.sampler_id)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.policy = self.parts.policy or new_follower(self.cfg, self.handles, self.work_dir, engine, self.log)
        self.policy.attach(engine)
        self.stop = self.parts.stop or StopRequest()  # from here on, a stop sends what it can and releases the lease
        self.log.info("sampler %s started: %s backend, %s, %s (topic %s, seed %d, spool %s, delays: refresh %s, transit %s)",
                      self.sampler_id, engine.backend, self.precision, engine.device, self.cfg.run.topic, self.seed,
                      self.spool_dir, self.scfg.delays.refresh.kind, self.scfg.delays.transit.kind)

    # ---- the steps of a turn --------------------------------------------------------
    def heartbeat_if_due(self) -> None:
        """Renew the lease (with this sampler's numbers); hand back the claims of dead samplers."""
        now = time.monotonic()
        if now - self.last_heartbeat < self.scfg.heartbeat_interval_s:
            return
        minutes = max((time.time() - self.started) / 60, 1e-9)
        newest, current = self.view.newest_version, self.policy.version
        self.state.renew_sampler_lease(self.sampler_id, {
            "host": socket.gethostname(), "pid": os.getpid(), "policy_version": current,
            "groups": self.outbox.published, "rollouts_per_min": round(self.outbox.published / minutes, 2),
            "versions_behind": (newest - current) if newest is not None and current is not None else None,
            "downloading": self.policy.downloading, "started_at": self.started,
            "backend": self.policy.engine.backend, "weight_load_s": self.policy.last_load_s,
            "held_in_transit": len(self.outbox.held), **self.totals(),
        }, self.scfg.lease_ttl_s)
        if self.state.claim_sweep_due(self.scfg.heartbeat_interval_s):  # one live sampler per interval
            self.state.reissue_expired_claims()  # hands back the claims of dead ones
        touch_heartbeat_file()
        self.last_heartbeat = now  # only once it succeeded: after a Redis error the next turn tries again

    def read_view(self) -> tuple[RunView, bool]:
        """(the run as this turn sees it, whether a new policy pointer was read): the learner's
        position every turn, the newest policy every `weight_poll_interval_s` (every turn until a
        policy is loaded), both in one round trip."""
        now = time.monotonic()
        poll_policy = (now - self.policy_read_at >= self.scfg.weight_poll_interval_s or not self.policy.loaded
                       or self.pauses.last == "next_version")  # the learner's next version is all it waits for
        view = self.state.sampler_view(poll_policy, self.scfg.prompts_per_batch, self.scfg.lease_ttl_s)
        if view.pointer_error is not None:  # nothing new is published: keep what we knew, say why once
            self.refuse_pointer(view, view.pointer_error)
        polled = poll_policy and view.pointer_error is None  # a bad pointer is no news: the known one stays
        if polled:
            self.policy_read_at = now
            self.step_period.observe(view.newest_version, now)
        else:
            view = replace(view, newest_version=self.view.newest_version, manifest_key=self.view.manifest_key,
                           updated_at=self.view.updated_at, signature=self.view.signature)
        self.view = view
        return view, polled

    def refresh_weights(self, view: RunView) -> None:
        """Start downloading a newer policy once the (simulated) refresh delay allows it (a pointer
        refused keeps the weights: `pointer_problem`); one too far behind first takes a version near
        enough (`Pacing.catch_up_to`; not with a simulated delay, nor before a batch is timed)."""
        newest, current = view.newest_version, self.policy.version
        if newest is None or (current is not None and newest == current):
            return
        problem = pointer_problem(self.cfg.run.name, view, current, self.handles.store.trusted)
        if problem is not None:
            self.refuse_pointer(view, problem)
            return
        # A delay counted in learner steps can only run out if the learner keeps getting
        # data; a sampler already too far behind to give it any refreshes now.
        backlog = self.backlog(view)
        allowed = self.gate.should_load(current, newest)
        forced = not allowed and self.scfg.delays.unit == "steps" and self.pacing.behind(newest, current, backlog)
        if not (allowed or forced):
            return
        target, key = newest, view.manifest_key
        if self.scfg.delays.refresh.kind == "none" and self.last_batch_s is not None:  # docs/weights.md
            seen, ahead_s = self.step_period, self.last_batch_s + (self.policy.last_download_s or 0.0)
            overtaken = seen.steps_during(ahead_s, time.monotonic())  # while it downloads, then generates
            on_the_way = self.pacing.catch_up_to(view.version_at_use, current, backlog, overtaken, seen.versions())
            target, key = self.policy.on_the_way(on_the_way, newest, view.manifest_key)
        self.policy.request(target, key, forced=forced)

    def refuse_pointer(self, view: RunView, why: str) -> None:
        """Say once per pointer why it is not followed (`refused_pointers`); the weights stay."""
        seen = (view.newest_version, view.manifest_key, view.signature, why)
        if seen != self.refused_pointer:
            self.refused_pointer = seen
            self.refused_pointers += 1
            named = "" if view.newest_version is None else f" to v{view.newest_version}"
            self.log.error("refused the policy pointer%s: %s; keeping policy v%s", named, why, self.policy.version)

    def swap_weights(self) -> None:
        """Load a finished download between batches."""
        forced = self.policy.swap_if_ready()
        if forced is not None:
            self.gate.loaded(forced=forced)

    def pump_outbox(self) -> bool:
        """Spool groups whose transit is over and send what the spool holds (no Redis: this also
        runs while Redis is away); False if the spool is full."""
        spool_has_room = self.outbox.spool_due()
        self.outbox.deliver(lambda r: self.pacing.too_stale(self.view.version_at_use, r.policy_version))
        return spool_has_room

    def pause(self, reason: str) -> None:
        """Sleep one pause of this kind, counted in the stats."""
        if reason == "no_policy" and time.monotonic() - self.last_wait_log > 5:
            self.log.info("waiting for a policy version: %s (Redis %s)", f"downloading v{self.policy.downloading}"
                          if self.policy.downloading is not None else "none published yet", self.redis_url)
            self.last_wait_log = time.monotonic()
        time.sleep(self.pauses.next(reason))

    def between_forward_passes(self) -> None:
        """What the engine calls between its forward passes (the `hf` backend, every token): keep
        the lease (a batch may outlast it), and with `sampler.yield_to_learner` wait while the
        learner admits, checks and trains a batch, or until asked to stop. Redis trouble ends
        the wait; the turn's own Redis calls will say so."""
        started = time.perf_counter()
        try:
            self.heartbeat_if_due()
            while self.scfg.yield_to_learner and not self.stop.requested and self.state.learner_busy():
                self.heartbeat_if_due()
                time.sleep(YIELD_POLL_S)
        except redis.RedisError:
            pass
        waited = time.perf_counter() - started
        if waited > YIELD_POLL_S:
            self.pauses.yielded(waited)

    def generate(self, in_flight_limit: Optional[int] = None) -> bool:
        """Claim prompts, sample G completions each, score them, hand the groups to the outbox.
        With `in_flight_limit`, claim only within the fleet's room under the max delay (False: no room)."""
        indices = self.state.claim_prompts(self.sampler_id, self.scfg.prompts_per_batch,
                                           in_flight_limit=in_flight_limit, allowance=self.scfg.prompts_per_batch)
        if not indices:
            return False
        problems = [self.task.train_problem(i) for i in indices]
        engine = self.policy.engine
        started = time.perf_counter()
        yielded_before = self.pauses.yielded_s
        groups = engine.sample([self.task.encode_prompt(p, engine.tokenizer) for p in problems],
                               group_size=self.scfg.group_size, seed=self.seed + indices[0],
                               pause=self.between_forward_passes)
        self.last_batch_s = time.perf_counter() - started - (self.pauses.yielded_s - yielded_before)
        self.generate_s += self.last_batch_s
        rollouts = self.make_rollouts(problems, groups)
        self.note_verifier_errors()
        self.outbox.add(rollouts, indices)
        self.generated += len(groups)
        return True

    # ---- helpers --------------------------------------------------------------------
    def make_rollouts(self, problems, groups) -> list[Rollout]:
        """The groups as rollouts: scored, stamped with the policy version, and with the run, key
        id and next sequence number that the signature covers."""
        rollouts = score_groups(self.task, self.policy.engine.tokenizer, problems, groups, sampler_id=self.sampler_id,
                                policy_version=self.policy.version, sampling=self.sampling)
        if self.signer is not None:
            for r in rollouts:
                self.stamp(r)
        return rollouts

    def stamp(self, rollout: Rollout) -> None:
        """The run, this sampler's key id and its next sequence number (all signed)."""
        rollout.run, rollout.key_id, rollout.seq = self.cfg.run.name, self.signer.key_id, self.next_seq
        self.next_seq += 1

    def note_verifier_errors(self) -> None:
        """A verifier that raised scored that completion 0 (the task counts it); say so in the log."""
        errors = getattr(self.task, "verifier_errors", 0)
        if errors > self.verifier_errors_logged:
            self.log.warning("the verifier failed on %d more completion(s), scored 0 (%d in all); last error: %s",
                             errors - self.verifier_errors_logged, errors, self.task.last_verifier_error)
            self.verifier_errors_logged = errors

    def backlog(self, view: RunView) -> int:
        return self.pacing.backlog(self.outbox.spool.pending(), self.outbox.acked_up_to, view.learner_offsets,
                                   view.learner_unread, view.in_flight, view.unjudged, view.learner_pending)

    def totals(self) -> dict:
        return {"policy_version": self.policy.version, "generated": self.generated, "published": self.outbox.published,
                "generate_s": round(self.generate_s, 1),
                "verifier_errors": getattr(self.task, "verifier_errors", 0),
                "refused_pointers": self.refused_pointers, **self.policy.stats(self.started),
                "spooled": self.outbox.spool.pending(), "discarded_at_source": self.outbox.discarded_at_source,
                **self.pauses.totals(), **self.gate.stats}

    def close(self) -> None:
        """Last delivery attempt, final stats, lease released; the spool keeps what was not sent."""
        self.outbox.close(timeout_s=self.scfg.send_timeout_s)
        try:
            self.outbox.confirm_claims(self.state, self.sampler_id)
            self.state.record_sampler_stats(self.sampler_id, self.totals())
            self.state.release_sampler_lease(self.sampler_id)
        except redis.RedisError as e:
            self.log.warning("could not record the final stats in Redis: %s", e)
        self.policy.engine.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)
        if not self.outbox.spool.pending():
            shutil.rmtree(self.spool_dir, ignore_errors=True)
        self.log.info("sampler %s stopped after %d groups (%s)", self.sampler_id, self.outbox.published,
                      ", ".join(f"{k} {v}" for k, v in self.totals().items()))


def run_sampler(cfg: HeteroConfig, sampler_id: Optional[str] = None, policy: Optional[PolicyFollower] = None) -> int:
    """`policy`: a follower already fetching the first policy (`fetch_first_policy`)."""
    return Sampler(cfg, sampler_id, SamplerParts(policy=policy)).run()
