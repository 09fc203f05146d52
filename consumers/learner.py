"""Learner: consume prompt groups, enforce the max delay, step DeepSpeed, publish weights.

Run: `heterorl learner --config demo [--out RUN_DIR]` (exactly one per run).

`Learner.run` is the loop, and each of its steps is a method:
  - `resume`: start from the newest recovery state in S3 (its weights, optimizer and
    LR-schedule state, and the Kafka offsets stored with it), or from the base model; publish
    those weights if they need a version (the base as v0; after a kill, a version above every
    published one, since the versions published after the state were lost); write a rewind
    marker to the update log (steps logged after that state were lost with the learner that
    made them);
  - `take`: read the rollout topic by explicit partition assignment and offer each message
    to the intake (`consumers.intake.Intake`: the seal, admission, the content checks and
    the validators' verdicts), which hands out a batch once `groups_per_step` checked groups
    wait;
  - `train`: one loss and one DeepSpeed step on the batch (whose fresh groups the step's own
    forward passes check: a failure refuses the step, nothing changes). The version is the
    number of steps taken; the step's entry goes to the update log (`<run>.updates` and
    RUN_DIR/updates.jsonl), which replay and the chaos audit read;
  - `save_checkpoint`: every `sync_every` steps the policy is copied into a shared buffer for
    the publisher process (`pipeline.weights.publisher`: a keyframe or a delta in
    `learner.policy_dtype`, S3 files → signed manifest → version in Redis), and every
    `state_every_steps` steps or `state_every_s` seconds the recovery state (weights,
    optimizer, the consumed offsets). A restarted learner resumes from the newest recovery
    state, so every group is used in at most one update;
  - on SIGUSR1, once `drain_due` (the topic is read to its end): `drain` trains the last,
    smaller batch, publishes and the learner exits 0, so the chaos audit finds every
    message accounted for.

Staleness is decided when a group is taken into the batch. The version only changes
at a step, and a batch is trained the moment it is full, so τ at decision is τ at use:
no group past the limit is ever used.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from kafka.errors import KafkaError

from consumers.intake import Batch, Intake
from consumers.learner_checkpoints import Checkpoints
from consumers.learner_ranks import LearnerRank, open_rank_link, spawn_ranks, start_engine
from consumers.recorder import LearnerLogs, StepRecorder
from consumers.screening import GroupScreen
from pipeline.config import HeteroConfig, dump_config
from pipeline.learning.admission import Admission, RolloutLimits
from pipeline.learning.engine import Ranks, can_discard_gradients, leave_process_group
from pipeline.devices import resolve_device
from pipeline.learning.rank_link import SAVE, START, STOP, TRAIN
from pipeline.learning.update import StepRefused, optimizer_step
from pipeline.models import generation_eos_ids, tokenizer_fingerprint
from pipeline.records.metrics import MetricsWriter, StageClock
from pipeline.records.update_log import dead_letter_topic, read_update_log, rewind_entry, updates_topic
from pipeline.runtime import (connect_run, resolve_base_model, setup_logging, touch_heartbeat_file,
                              learner_numerics, with_machine_precision)
from pipeline.clients.topics import RawRecord, TopicReader, ensure_topic
from pipeline.clients.run_functions import ensure_loaded
from pipeline.clients.retry import retry_call
from pipeline.clients.services import ServiceUnavailable
from pipeline.trust.keyring import key_paths, load_learner_key
from pipeline.trust.verdicts import verdicts_topic
from pipeline.weights.publisher import start_publisher
from pipeline.weights.recovery import RecoverySchedule, ResumePoint, resume_point
from pipeline.wire.rollout import encode_rollout
from pipeline.wire.signing import SignatureError
from pipeline.weights.store import MalformedPointer, PolicyPointer


def judged_rollout_ids(bootstrap: str, topic: str, up_to_step: int, trusted, log, security=None) -> set[str]:
    """Rollout ids the update log records as judged by steps <= `up_to_step`: a resumed learner
    starts with these, so a copy that reaches the log after the checkpoint is still a duplicate.
    Only entries `trusted` (the learner's public key) signed count; the others are said and left."""
    update_log = read_update_log(bootstrap, topic, trusted, timeout_s=60.0, security=security)
    if update_log is None:
        return set()
    if update_log.refused:
        log.warning("the update log %s holds %d record(s) this learner did not sign or sent again, not used: %s",
                    updates_topic(topic), len(update_log.refused), update_log.refused_by_reason())
    return {g.rollout_id for e in update_log.entries if e.step <= up_to_step
            for g in (*e.used, *e.dropped, *e.duplicates)}


VERDICT_WAIT_POLL_S = 0.02
"""How long the learner waits for rollouts in one poll while groups wait for their verdicts
(`learner.poll_timeout_s` otherwise): the verdicts are read between polls, and a batch one
verdict short should not wait a whole poll (measured: 11 % of the learner's time at 64
samplers with a 1 s poll)."""
VERDICT_POLLS = 16
"""Polls of the verdicts topic at most per turn of the loop (each up to 64 verdicts)."""

BUSY_FOR_S = 600.0
"""How long samplers yielding to the learner wait at most for one `busy` stretch (a learner that
dies in one is not waited for longer)."""


def outside_optimizer_share(seconds: dict) -> Optional[float]:
    """Of the learner's busy time (its stages: intake, screen, train, snapshot, and any wait for
    the publisher; not waiting for data, not the publisher's own work), the share spent outside
    the optimizer step."""
    busy = sum(v for k, v in seconds.items() if k.startswith("time_"))
    return round(1 - seconds.get("time_train_s", 0.0) / busy, 4) if busy else None


class DrainRequest:
    """SIGUSR1 asks the learner to read the topic to its end, train what it kept
    (the last batch may be smaller), publish a final checkpoint and exit 0."""

    def __init__(self):
        self.requested = False
        self.requested_at = 0.0
        """time.monotonic() of the request."""
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, *_):
        if not self.requested:
            self.requested_at = time.monotonic()
        self.requested = True

    def due(self, intake: Intake, sources: list[tuple[Optional[TopicReader], str]], verdict_wait_s: float,
            broker: str, log) -> bool:
        """Whether a drain was requested and every message of `sources` has been read (a broker
        too busy to say is asked again at the next poll). Groups still waiting for a verdict are
        waited for `verdict_wait_s`, then dropped as `no_verdict`."""
        if not self.requested:
            return False
        if intake.admission.awaiting:
            if time.monotonic() - self.requested_at < verdict_wait_s:
                return False
            intake.give_up_waiting()
            log.warning("draining: dropped the groups still without a verdict after %.0fs", verdict_wait_s)
        for source, what in sources:  # every verdict written before the drain is read first, then the topic
            try:
                if source is not None and source.lag() > 0:
                    return False
            except KafkaError as e:
                log.warning("draining: Kafka at %s did not say where %s end (%s); asking again",
                            broker, what, type(e).__name__)
                return False
        return True


def own_pointer_version(state, signer, log) -> Optional[int]:
    """The version the policy pointer names, if this run's learner wrote it (signed with its key
    `signer`, where signatures are on); a pointer anybody else wrote, or that is no pointer, is said
    once and left out (the versions in the bucket still keep the numbering), and the publisher sets
    the pointer again with the first version."""
    try:
        pointer = PolicyPointer(state).read_verified(None if signer is None else signer.public)
    except (MalformedPointer, SignatureError) as e:
        log.error("ignoring the policy pointer: %s; it is set again with the next version", e)
        return None
    return None if pointer is None else pointer.version


def ensure_run_topics(cfg: HeteroConfig, bootstrap: str, security) -> None:
    """The rollout topic, the update log, the dead letters and, with validators, the verdicts."""
    topic = cfg.run.topic
    for name, partitions in [(topic, cfg.run.topic_partitions), (updates_topic(topic), 1),
                             (dead_letter_topic(topic), 1)] + cfg.validators.enabled * [(verdicts_topic(topic), 1)]:
        ensure_topic(bootstrap, name, partitions, retention_ms=cfg.run.topic_retention_ms, security=security)


def open_source(bootstrap: str, topic: str, offsets: dict[int, int], security, give_up_s: float, log) -> TopicReader:
    """A reader of `topic` from `offsets`, waiting out a broker that does not answer (a restart, a
    network partition) for up to `give_up_s` (`learner.idle_timeout_s`)."""
    return retry_call(lambda: TopicReader(bootstrap, topic, start_offsets=offsets, security=security),
                      retry_on=(ServiceUnavailable,), first_s=1.0, max_s=15.0, give_up_after_s=give_up_s,
                      on_retry=lambda error, wait_s, _: log.warning("%s; retrying in %.1fs", error, wait_s))


def _write_once(path: Path, text: str) -> None:
    """Write a file other processes may be reading, only if absent, atomically."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


@dataclass
class LearnerParts:
    """What a learner is built with beyond its config; `heterorl loadtest` passes modeled ones."""

    step: Callable[..., dict] = optimizer_step
    """The optimizer step, with `pipeline.learning.update.optimizer_step`'s signature."""
    screen: Optional[GroupScreen] = None
    """The content checks (default: `GroupScreen` with the task's verifier and the policy's versions)."""
    limits: Optional[RolloutLimits] = None
    """What a group must fit (default: the model's vocabulary and positions, the sampling settings)."""


class Learner:
    """One learner process (rank 0 of several): `run()` is the loop, each of its steps a method below."""

    def __init__(self, cfg: HeteroConfig, run_dir: Optional[Path] = None, parts: LearnerParts = LearnerParts()):
        self.log = setup_logging("learner")
        self.drain_request = DrainRequest()  # first: a drain request during the start must not kill the process
        self.ranks, self.parts = Ranks.from_env(), parts
        self.device = resolve_device(cfg.model.device, self.ranks.local_rank)
        self.cfg, self.precision = with_machine_precision(cfg, self.device)
        self.lcfg = self.cfg.learner
        # absolute: the publisher process, which writes the recovery states there, runs elsewhere
        self.run_dir = Path(run_dir or self.cfg.train.out_dir or f"runs/{self.cfg.run.name}").resolve()
        self.topic = self.cfg.run.topic
        # The version (what staleness is measured against) is the step, unless a killed learner's
        # published versions were lost: the resumed one then skips their numbers.
        self.version = self.step = 0
        self.last_record_at = self.last_wait_log = self.last_step_at = time.monotonic()
        self.stage_totals: Counter = Counter()  # seconds of each stage over the run
        # Where each step's time goes: intake (decode, signature, admission), screen (rewards, and
        # drawn stale groups' log-probs), train (the optimizer step, with the fresh groups' check),
        # snapshot (copying the weights for the publisher), publish_wait (for a free buffer).
        self.clock = StageClock()

    def run(self) -> int:
        """Train until `learner.max_steps` (or a drain); 3 if no rollout came for `learner.idle_timeout_s`."""
        self.resume()
        try:
            while self.step < self.lcfg.max_steps:
                # groups waiting for verdicts: back soon to read them (a batch may be one verdict short)
                records = self.source.poll(VERDICT_WAIT_POLL_S if self.admission.awaiting else self.lcfg.poll_timeout_s)
                touch_heartbeat_file()
                self.publisher.check()
                self.intake.refresh_registry()
                self.read_verdicts()
                if records:
                    self.last_record_at = time.monotonic()
                    self.take(records, self.intake.offer, self.topic)
                    self.checkpoints.publish_if_starved(self.version, self.step, time.monotonic() - self.last_step_at)
                elif self.drain_request.due(self.intake, [(self.verdict_source, "the verdicts"), (self.source, "the topic")],
                                            self.cfg.validators.verdict_wait_s, self.bootstrap, self.log):
                    self.drain()
                    break
                elif self.waited_out():
                    return 3
            self.publisher.close()  # raises if a checkpoint could not be published
        finally:
            self.close()
        self.write_summary()
        if self.ranks.leader:  # `heterorl join` refuses to join a run that ended
            self.state.report_learner({"ended_at": time.time(), "final_version": self.version})
        return 0

    # ---- resume ---------------------------------------------------------------------
    def resume(self) -> None:
        """Connect, load the policy to start from (newest checkpoint, or the base as v0), open the logs."""
        torch.set_num_threads(self.lcfg.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_once(self.run_dir / "config.yaml", dump_config(self.cfg))
        self.keys = key_paths(self.cfg)
        self.handles = connect_run(self.cfg)
        if self.cfg.security.require_signatures or self.keys.learner_key.exists():
            self.handles.store.signer = load_learner_key(self.keys)  # signs manifests and the policy pointer
        self.state, self.bootstrap = self.handles.state, self.handles.services.kafka_bootstrap
        self.kafka_security = self.handles.services.security
        ensure_run_topics(self.cfg, self.bootstrap, self.kafka_security)
        ensure_loaded(self.state.client)  # the functions samplers write through (pipeline/clients/run_functions.py)
        self.state.register_run(self.topic)
        self.work_dir = Path(tempfile.mkdtemp(prefix=".learner-", dir=self.run_dir))
        self.link = open_rank_link(self.device, self.ranks, self.lcfg)
        start = self.load_policy()
        self.open_logs()
        self.open_intake(start.offsets)
        self.checkpoints = Checkpoints(
            self.publisher, self.recovery, self.intake, engine=self.engine, tokenizer=self.tokenizer,
            work_dir=self.work_dir, lcfg=self.lcfg, clock=self.clock, link=self.link,
            keeps_versions=not self.ranks_share_weights, published_version=None if start.must_publish else self.version,
            log=self.log)
        if start.must_publish:  # only now, so samplers do not run ahead of a learner still starting
            if self.link is not None:
                self.link.send(SAVE, {"state": False, "policy": True})
            self.checkpoints.publish(self.version, {"offsets": start.offsets, "step": self.step,
                                                    "policy_version": self.version},
                                     parent_version=None if start.manifest_key is None else start.state_version,
                                     keyframe=True)  # a new chain, never skipped (v0 is what replays start from)
            self.log.info("publishing %s as policy v%d", start.what, self.version)
        self.last_record_at = self.last_wait_log = self.last_step_at = time.monotonic()  # the idle clock starts now
        self.log.info("%s; learner on %s, topic %s, loss %s, max_delay_steps %d, %d steps to go; %d process(es) "
                      "on %s, %s, ZeRO stage %d", self.precision, self.bootstrap, self.topic, self.lcfg.loss_type,
                      self.lcfg.max_delay_steps, self.lcfg.max_steps - self.step, self.ranks.world_size,
                      self.device, self.lcfg.precision, self.lcfg.zero_stage)

    def load_policy(self) -> ResumePoint:
        """The newest recovery state (or the base model) in the engine, under a version never
        published before, and the publisher started."""
        store = self.handles.store
        start = resume_point(store, lambda: resolve_base_model(self.cfg), self.work_dir,
                             own_pointer_version(self.state, store.signer, self.log),
                             on_skip=lambda step, e: self.log.error("cannot resume from the recovery state of step "
                                                                    "%d (%s); trying the one before it", step, e))
        self.log.info("starting from %s at offsets %s", start.what, start.offsets)
        self.step, self.version = start.step, start.version
        if self.link is not None:  # the other ranks start from the same weights and state
            self.link.send(START, {"base": str(start.model_dir) if start.manifest_key is None else None,
                                   "manifest_key": start.manifest_key})
        self.engine, self.tokenizer = start_engine(self.cfg, start.model_dir, self.device, self.ranks, self.log,
                                                   resuming=start.manifest_key is not None)
        model = self.engine.module
        self.limits = self.parts.limits or RolloutLimits.of_model(
            model, self.tokenizer, generation_eos_ids(start.model_dir, self.tokenizer), self.cfg.sampler)
        self.start_dir, self.start_version = start.model_dir, self.version
        self.publisher = start_publisher(self.cfg, store, model, start.model_dir, self.work_dir,
                                         signer_key=self.keys.learner_key if store.signer is not None else None,
                                         keep_within=self.lcfg.reach_steps)
        self.state.report_learner({"step": self.step, "policy_version": self.version,  # not a dead learner's
                                   "ended_at": None})
        self.recovery = RecoverySchedule(self.lcfg.state_every_steps, self.lcfg.state_every_s, self.step,
                                         time.monotonic())
        return start

    def open_logs(self) -> None:
        self.logs = LearnerLogs(self.bootstrap, self.topic, self.run_dir, self.lcfg.network_retry_s, self.log,
                                self.kafka_security, signer=self.handles.store.signer)
        self.attempt = uuid.uuid4().hex[:12]
        # Steps logged after the checkpoint we start from were lost with the learner that made them.
        self.logs.publish_entry(rewind_entry(self.step, self.lcfg.loss_type, self.attempt, self.topic, self.version))
        self.metrics = MetricsWriter(self.run_dir)

    def open_intake(self, offsets: dict[int, int]) -> None:
        """The rollout topic from `offsets`, and the intake with its checks (`consumers.intake`)."""
        signer = self.handles.store.signer
        judged = judged_rollout_ids(self.bootstrap, self.topic, self.step, None if signer is None else signer.public,
                                    self.log, self.kafka_security) if self.step else set()
        self.admission = Admission(self.lcfg, self.limits, judged)
        self.ranks_share_weights = self.ranks.world_size > 1 and self.lcfg.zero_stage == 3
        # Groups of staleness 0 are checked by the step's own forward passes, unless the engine
        # cannot take a step back when one fails (ZeRO stage 2): then by a pass of their own.
        self.intake = Intake.open(
            self.cfg, self.admission, state=self.state, store=self.handles.store, keys=self.keys,
            tokenizer=self.tokenizer, policy=(lambda: None) if self.ranks_share_weights else (lambda: self.engine.module),
            model_dir=self.start_dir, work_dir=self.work_dir, device=self.device,
            reach=self.lcfg.reach_versions, clock=self.clock, dead_letter=self.logs.dead_letter,
            fresh_in_step=can_discard_gradients(self.engine), screen=self.parts.screen, admits_joins=self.ranks.leader)
        self.recorder = StepRecorder(self.run_dir, self.metrics, self.admission, loss_type=self.lcfg.loss_type,
                                     topic=self.topic, vocab_size=self.limits.vocab_size,
                                     tokenizer_sha=tokenizer_fingerprint(self.tokenizer), attempt=self.attempt,
                                     publish=self.logs.send_entry, signer=self.handles.store.signer,
                                     numerics=learner_numerics(self.cfg, self.device))
        self.source = open_source(self.bootstrap, self.topic, offsets, self.kafka_security, self.lcfg.idle_timeout_s,
                                  self.log)
        self.intake.read_to = self.source.positions()
        self.swept_at = 0.0
        self.verdict_source = (open_source(self.bootstrap, verdicts_topic(self.topic), {}, self.kafka_security,
                                           self.lcfg.idle_timeout_s, self.log)  # every verdict from the start
                               if self.cfg.validators.enabled else None)

    # ---- take and train -------------------------------------------------------------
    def take(self, records: list[RawRecord], offer, topic: str) -> None:
        """Offer each message in order, training whenever a batch is full; report what was judged."""
        with self.state.learner_busy_while(BUSY_FOR_S):  # samplers that yield to the learner pause
            for record in records:
                offer(record, self.version, topic)
                if self.train_ready():
                    self.report_position()
                if self.step >= self.lcfg.max_steps:
                    break
        self.report_position()

    def read_verdicts(self) -> None:
        """The validators' verdicts published since the last read, each offered to the intake."""
        if self.verdict_source is None:
            return
        for _ in range(VERDICT_POLLS):  # a full poll may leave more behind it
            records = self.verdict_source.poll(0.0)
            if records:
                self.take(records, self.intake.offer_verdict, verdicts_topic(self.topic))
            if len(records) < self.verdict_source.max_records:
                return

    def report_position(self) -> None:
        """What the learner judged, of whom, and has not read yet (samplers pace on these); and, every
        heartbeat interval, the claims of samplers gone re-issued (the samplers sweep too, but one that
        takes the sweep's turn need not)."""
        self.intake.report_judged(self.state.count_judged)
        self.state.report_learner_offsets(self.intake.read_to, self.source.unread(self.intake.read_to),
                                          self.intake.waiting)
        if time.monotonic() - self.swept_at >= self.cfg.sampler.heartbeat_interval_s:
            self.swept_at = time.monotonic()
            self.state.reissue_expired_claims()

    def train_ready(self, last: bool = False, save: bool = True) -> bool:
        """Train the intake's next batch if one is full (`last`: whatever waits); whether a step was
        taken. A step its fresh groups refuse changes nothing: the intake withdraws them."""
        while (batch := self.intake.next_batch(self.version, last=last)) is not None:
            try:
                self.train(batch, save=save)
                return True
            except StepRefused as refused:
                self.intake.refused(batch, refused)
                if not last:
                    return False
        return False

    def train(self, batch: Batch, save: bool = True) -> None:
        """One optimizer step on whole groups (every rank its share), logged; a checkpoint
        every `sync_every` steps. StepRefused (nothing changed) if a group of its fresh check fails."""
        check = batch.fresh_check
        if self.link is not None:
            self.link.send(TRAIN, {"groups": [encode_rollout(r) for r in batch.rollouts], "weights": batch.weights,
                                   "fresh_check": None if check is None else list(check.groups),
                                   "threshold": self.cfg.security.logprob_threshold})
        with self.clock.stage("train"):
            step_metrics = self.parts.step(self.engine, batch.rollouts, batch.weights, self.lcfg,
                                           temperature=self.cfg.sampler.temperature,
                                           max_completion_length=self.cfg.sampler.max_new_tokens, ranks=self.ranks,
                                           fresh_check=check, on_policy_version=self.version)
        self.version += 1
        self.step += 1
        self.last_step_at = time.monotonic()
        self.intake.trained(batch, step_metrics.pop("fresh_gaps", {}), self.version)
        stages = self.take_stage_seconds()
        values = self.recorder.record(self.version, batch.groups, {**step_metrics, **stages}, step=self.step)
        self.state.report_learner({"step": self.step, "policy_version": self.version})
        self.state.report_learner_stats(self.admission.counters.as_dict())  # not for samplers' eyes
        self.state.count_used(Counter(r.sampler_id for r in batch.rollouts))  # a volunteer's "used" (heterorl join)
        self.log.info("step %d (v%d) loss %.4f reward %.3f staleness %.1f/%d used %d dropped %d", self.step,
                      self.version, values["loss"], values["reward_mean"], values["staleness_mean"],
                      values["staleness_max"], values["groups_used"], values["groups_dropped"])
        if save:  # after the update log holds the step (nothing may build on a step it lacks)
            self.checkpoints.save_due(self.version, self.step, final=self.step >= self.lcfg.max_steps)

    def take_stage_seconds(self) -> dict[str, float]:
        """The stages' seconds since the last call (this process's and the publisher's), added to the run's."""
        self.stage_totals.update(stages := {**self.clock.take(), **self.publisher.take_seconds()})
        return stages

    # ---- drain ----------------------------------------------------------------------
    def drain(self) -> None:
        """Train the last, smaller batch and publish, so every message read is accounted for."""
        self.train_ready(last=True, save=False)  # rechecked: time passed while winding down; saved below
        tail = self.admission.take_verdicts()
        if tail or not self.checkpoints.saved_everything(self.version, self.step):
            self.checkpoints.save(self.version, self.step, tail, final=True)
        self.log.info("drained: every message of %s up to offsets %s is accounted for", self.topic,
                      self.intake.read_to)

    # ---- waiting, the end -----------------------------------------------------------
    def waited_out(self) -> bool:
        """Whether no rollout came for `learner.idle_timeout_s` (said), else say every 5 s what it waits for."""
        idle_s = time.monotonic() - self.last_record_at
        if idle_s > self.lcfg.idle_timeout_s:
            self.log.error("no rollout for %.0fs on topic %s at %s (learner.idle_timeout_s); giving up", idle_s,
                           self.topic, self.bootstrap)
            return True
        if time.monotonic() - self.last_wait_log > 5:
            self.log.info("waiting for rollouts on %s at %s: %d/%d groups in batch, %d live samplers", self.topic,
                          self.bootstrap, len(self.admission.pending), self.lcfg.groups_per_step,
                          len(self.state.live_samplers()))
            self.last_wait_log = time.monotonic()
        return False

    def close(self) -> None:
        if self.link is not None:
            self.link.send(STOP)
            leave_process_group(together=True)  # with the other ranks, which leave on STOP
        if not self.publisher.closed:  # an error path: still publish what was handed over
            try:
                self.publisher.close()
            except Exception as e:  # noqa: BLE001 - the original error matters more
                self.log.error("%s", e)
        for part in (self.source, self.verdict_source, self.logs, self.metrics):
            if part is not None:
                part.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def write_summary(self) -> None:
        self.take_stage_seconds()  # the last save's
        summary = {"final_policy_version": self.version, "start_policy_version": self.start_version,
                   "final_step": self.step, "publishing": self.publisher.upload_bytes,
                   "versions_skipped": self.publisher.skipped, "final_checkpoint": self.handles.store.uri(self.version),
                   "rollout_topic": self.topic, "offsets": {str(p): o for p, o in self.intake.read_to.items()},
                   **self.intake.summary(), "precision": self.precision, "outside_optimizer_share":
                   outside_optimizer_share(self.stage_totals), "seconds": {k: round(v, 1) for k, v in
                                                                           sorted(self.stage_totals.items())}}
        (self.run_dir / "learner_summary.json").write_text(json.dumps(summary, indent=2))
        self.log.info("done: policy v%d at %s", self.version, summary["final_checkpoint"])


def run_learner(cfg: HeteroConfig, run_dir: Optional[Path] = None, parts: LearnerParts = LearnerParts()) -> int:
    """The learner: rank 0 of `learner.num_processes` (it starts the others itself unless a
    launcher set WORLD_SIZE), or, under a launcher, whichever rank this process is."""
    if "WORLD_SIZE" not in os.environ and cfg.learner.num_processes > 1:
        children = spawn_ranks(cfg, cfg.learner.num_processes)
        try:
            return Learner(cfg, run_dir, parts).run()
        finally:
            for child in children:
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
    if Ranks.from_env().leader:
        return Learner(cfg, run_dir, parts).run()
    return LearnerRank(cfg).run()
