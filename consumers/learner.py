"""Learner: consume prompt groups, enforce the max delay, step DeepSpeed, publish weights.

Run: `heterorl learner --config demo [--out RUN_DIR]` (exactly one per run).

`Learner.run` is the loop, and each of its steps is a method:
  - `resume`: start from the newest recovery state in S3 (its weights, optimizer and
    LR-schedule state, and the Kafka offsets stored with it), or from the base model; publish
    those weights if they need a version (the base as v0; after a kill, a version above every
    published one, since the versions published after the state were lost); write a rewind
    marker to the update log (steps logged after that state were lost with the learner that
    made them);
  - `take`: read the rollout topic by explicit partition assignment and `admit` each
    message (`pipeline.learning.admission`: a poison message is dead-lettered to `<run>.dead` with
    its reason in a header, a second copy of a rollout id is ignored, staleness
    τ = learner version − rollout version decides drop or keep, every verdict counted);
  - `train_ready`: once `groups_per_step` whole groups are kept, their log-prob checks
    (`consumers.screening`: stale groups re-scored, batched per version; fresh ones checked
    by the step's own forward passes), then one loss and one DeepSpeed step; a group that
    fails a check is withdrawn and its key struck, and the batch fills again. The version is
    the number of steps taken; the step's entry goes to the update log (`<run>.updates` and
    RUN_DIR/updates.jsonl), which replay and the chaos audit read;
  - `save_checkpoint`: every `sync_every` steps the policy (a keyframe or a delta, in
    `learner.policy_dtype`) and every `state_every_steps` steps or `state_every_s` seconds the
    recovery state (weights, optimizer, the consumed offsets) are copied in memory and handed
    to the background publisher, which writes, encodes and uploads them on its own thread
    (`pipeline.weights`: S3 files → signed manifest → version in Redis). A restarted learner
    resumes from the newest recovery state, so every group is used in at most one update;
  - on SIGUSR1, once `drain_due` (the topic is read to its end): `drain` trains the last,
    smaller batch, publishes and the learner exits 0, so the chaos audit finds every
    message accounted for.

Staleness is decided when a group is taken into the batch. The version only changes
at a step, and a batch is trained the moment it is full, so τ at decision is τ at use:
no group past the limit is ever used.
"""

from __future__ import annotations

import ctypes
import json
from collections import Counter
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from kafka.errors import KafkaError

from consumers.recorder import StepRecorder
from consumers.screening import UNVERIFIABLE, GroupScreen, PastPolicies
from pipeline.learning.admission import Admission, Admitted, PendingGroup, RolloutLimits, Verdicts
from pipeline.servers.checkpoints import LEARNER_STATE_DIR
from pipeline.config import HeteroConfig, dump_config
from pipeline.learning.engine import (Ranks, can_discard_gradients, init_distributed, machine_precision, make_engine,
                             resolve_device)
from pipeline.servers.kafka_io import RawRecord, RolloutSink, RolloutSource, ensure_topic
from pipeline.trust.keyring import RegistryFollower, key_paths, load_learner_key, load_root_public
from pipeline.weights.learner_state import capture, load_learner_state
from pipeline.records.metrics import MetricsWriter, StageClock
from pipeline.models import DTYPES, generation_eos_ids, load_policy, tokenizer_fingerprint
from pipeline.learning.rank_link import NAMES, SAVE, START, STOP, TRAIN, RankLink
from pipeline.servers.retry import retry_call
from pipeline.wire.rollout import Rollout, RolloutDecodeError, decode_rollout, encode_rollout
from pipeline.runtime import (connect_run, make_task_from_config, resolve_base_model, setup_logging,
                              touch_heartbeat_file, with_machine_precision)
from pipeline.trust import Quarantine, Rejected, RolloutVerifier, StrikePolicy
from pipeline.servers.services import ServiceUnavailable, free_port
from pipeline.learning.update import FreshCheck, StepRefused, optimizer_step
from pipeline.records.update_log import (UpdateEntry, append_entry, dead_letter_topic, read_entries_kafka, rewind_entry,
                                 updates_topic)
from pipeline.trust.verdicts import GroupVerdict, VerdictVerifier, group_digest, verdicts_topic
from pipeline.weights.policy import KeyframeRule, PolicyPublisher
from pipeline.weights.publisher import BackgroundPublisher, Snapshot
from pipeline.weights.recovery import RecoverySchedule, fetch_newest_state, recovery_store, resume_version


def judged_rollout_ids(bootstrap: str, topic: str, up_to_step: int, security=None) -> set[str]:
    """Rollout ids the update log records as judged by steps <= `up_to_step`.

    A resumed learner starts with these, so a copy that reaches the log after the
    checkpoint is still recognised as a duplicate.
    """
    entries = read_entries_kafka(bootstrap, topic, timeout_s=60.0, security=security) or []
    return {g.rollout_id for e in entries if e.step <= up_to_step for g in (*e.used, *e.dropped, *e.duplicates)}


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
    """Of the learner's busy time (its stages: intake, screen, train, snapshot; not waiting for
    data, not the publisher's thread), the share spent outside the optimizer step."""
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


def _write_once(path: Path, text: str) -> None:
    """Write a file other processes may be reading, only if absent, atomically."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def start_engine(cfg: HeteroConfig, model_dir: Path, device, ranks: Ranks, log, *, resuming: bool):
    """(DeepSpeed engine, tokenizer) from a model directory (the base model, or the checkpoint
    a learner resumes from), with its learner state if it has one."""
    model, tokenizer = load_policy(model_dir)  # DeepSpeed moves it to model.device
    engine = make_engine(model, cfg.learner, device, ranks)
    if (model_dir / LEARNER_STATE_DIR).is_dir():
        # AdamW moments, LR schedule and step count, so the resumed run continues exactly.
        load_learner_state(engine, model_dir / LEARNER_STATE_DIR)
    elif resuming:
        log.warning("checkpoint %s has no learner state: continuing with a fresh optimizer", model_dir.name)
    return engine, tokenizer


def open_rank_link(device, ranks: Ranks, lcfg) -> Optional[RankLink]:
    """The command channel from rank 0 to the others (None for a single process)."""
    if ranks.world_size == 1:
        return None
    init_distributed(device, ranks)
    # Rank 0 may wait for rollouts up to learner.idle_timeout_s between two commands.
    return RankLink(timeout_s=lcfg.idle_timeout_s + 600)


class Learner:
    """One learner process (rank 0 of several): `run()` is the loop, each of its steps a method below."""

    def __init__(self, cfg: HeteroConfig, run_dir: Optional[Path] = None):
        self.log = setup_logging("learner")
        self.drain_request = DrainRequest()  # first: a drain request during the start must not kill the process
        self.ranks = Ranks.from_env()
        self.device = resolve_device(cfg.model.device, self.ranks.local_rank)
        self.cfg, self.precision = with_machine_precision(cfg, self.device)
        self.lcfg = self.cfg.learner
        cfg = self.cfg
        self.run_dir = Path(run_dir or cfg.train.out_dir or f"runs/{cfg.run.name}")
        self.topic = cfg.run.topic
        self.version = 0
        """The policy version of the weights being trained (what staleness is measured against)."""
        self.step = 0
        """Optimizer steps behind those weights. Equal to the version unless a killed learner's
        published versions were lost: the resumed one then skips their numbers."""
        self.next_offsets: dict[int, int] = {}
        self.last_record_at = self.last_wait_log = time.monotonic()
        self.stage_totals: Counter = Counter()
        """Seconds of each stage over the run (the summary's `seconds`)."""
        self.validated = cfg.validators.enabled
        """Whether groups are checked by validators (their verdicts let groups in) rather than here."""
        self.clock = StageClock()
        """Where each step's time goes: intake (decode, signature, admission), screen (re-scoring
        rewards and stale groups' log-probs), train (the optimizer step, with the fresh groups'
        check), snapshot (copying the weights for the publisher)."""

    def run(self) -> int:
        """Train until `learner.max_steps` (or a drain); 3 if no rollout came for `learner.idle_timeout_s`."""
        self.resume()
        try:
            while self.step < self.lcfg.max_steps:
                # groups waiting for verdicts: back soon to read them (a batch may be one verdict short)
                records = self.source.poll(VERDICT_WAIT_POLL_S if self.admission.awaiting else self.lcfg.poll_timeout_s)
                touch_heartbeat_file()
                self.refresh_registry()
                self.read_verdicts()
                if records:
                    self.take(records)
                elif self.drain_due():
                    self.drain()
                    break
                elif self.idle_s() > self.lcfg.idle_timeout_s:
                    self.log.error("no rollout for %.0fs on topic %s at %s (learner.idle_timeout_s); giving up",
                                   self.idle_s(), self.topic, self.bootstrap)
                    return 3
                else:
                    self.report_waiting()
            self.publisher.close()  # raises if a checkpoint could not be published
        finally:
            self.close()
        self.write_summary()
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
        retention = self.cfg.run.topic_retention_ms
        self.kafka_security = self.handles.services.security
        topics = [(self.topic, self.cfg.run.topic_partitions), (updates_topic(self.topic), 1),
                  (dead_letter_topic(self.topic), 1)] + ([(verdicts_topic(self.topic), 1)] if self.validated else [])
        for topic, partitions in topics:
            ensure_topic(self.bootstrap, topic, partitions, retention_ms=retention, security=self.kafka_security)
        self.state.register_run(self.topic)
        self.work_dir = Path(tempfile.mkdtemp(prefix=".learner-", dir=self.run_dir))
        self.link = open_rank_link(self.device, self.ranks, self.lcfg)
        self._load_policy()
        self._open_logs()
        self._open_trust()
        self.last_record_at = self.last_wait_log = time.monotonic()  # the idle clock starts now
        self.log.info("%s", self.precision)
        self.log.info("learner on %s, topic %s, loss %s, max_delay_steps %d, %d steps to go; %d process(es) "
                      "on %s, %s, ZeRO stage %d", self.bootstrap, self.topic, self.lcfg.loss_type,
                      self.lcfg.max_delay_steps, self.lcfg.max_steps - self.step, self.ranks.world_size,
                      self.device, self.lcfg.precision, self.lcfg.zero_stage)

    def _load_policy(self) -> None:
        """Start from the newest recovery state (or the base model), under a version never published before."""
        store = self.handles.store
        self.states = recovery_store(store)
        def skipped(step: int, error: Exception) -> None:
            self.log.error("cannot resume from the recovery state of step %d (%s); trying the one before it", step,
                           error)

        found = fetch_newest_state(self.states, self.work_dir, on_skip=skipped)
        state = None if found is None else found[1]
        if state is None:
            model_dir, state_version, offsets = resolve_base_model(self.cfg), 0, {}
        else:
            model_dir = found[0]
            self.step, state_version = state.version, int(state.extra["policy_version"])
            offsets = {int(p): int(o) for p, o in state.extra.get("offsets", {}).items()}
            self.log.info("resuming from the recovery state of step %d (policy v%d) at offsets %s", self.step,
                          state_version, offsets)
        pointer, _ = self.state.policy()
        self.version, must_publish = resume_version(state_version, store.list_versions() + [-1 if pointer is None
                                                                                              else pointer])
        if self.link is not None:  # the other ranks start from the same weights and state
            self.link.send(START, {"base": None if state is not None else str(model_dir),
                                   "manifest_key": state.key if state is not None else None})
        self.engine, self.tokenizer = start_engine(self.cfg, model_dir, self.device, self.ranks, self.log,
                                                   resuming=state is not None)
        model = self.engine.module
        self.limits = RolloutLimits(
            vocab_size=model.get_input_embeddings().num_embeddings, temperature=self.cfg.sampler.temperature,
            max_new_tokens=self.cfg.sampler.max_new_tokens,
            max_positions=int(getattr(model.config, "max_position_embeddings", 1 << 30)),
            eos_ids=tuple(generation_eos_ids(model_dir, self.tokenizer)))
        dtype = None if self.lcfg.policy_dtype == "auto" else DTYPES[self.lcfg.policy_dtype]
        # Where this learner re-scores stale groups itself, it keeps the deltas of every version
        # a group within the max delay can claim, so that it needs no copy of each version
        # (consumers.screening.PastPolicies); otherwise none (at max delay 32 on SmolLM2 in fp32,
        # 33 deltas of 130-150 MB each; with the memory they pinned, the learner was killed for
        # lack of memory at step 40 on a 24 GiB machine).
        rescores = self.cfg.security.check_logprobs and not self.validated
        self.policies = PolicyPublisher(store, KeyframeRule(self.lcfg.keyframe_every),
                                        dtype=dtype or DTYPES[self.lcfg.precision], work_dir=self.work_dir,
                                        history=self.reach_steps() // self.lcfg.sync_every + 1 if rescores else 0)
        if must_publish:
            # Published only once the engine is ready, so samplers do not run ahead of a
            # learner that is still starting.
            self.state.publish_policy(self.version, self.policies.publish(
                self.version, model_dir, {"offsets": offsets, "step": self.step, "policy_version": self.version},
                parent_version=None if state is None else state_version), signer=store.signer)
            self.log.info("published %s as policy v%d", "the base model" if state is None else
                          f"the weights of step {self.step} (v{state_version})", self.version)
        self.start_dir, self.resumed = model_dir, state is not None
        self.start_version = self.published_version = self.version
        self.state.report_learner({"step": self.step, "policy_version": self.version})  # not a dead learner's
        self.recovery = RecoverySchedule(self.lcfg.state_every_steps, self.lcfg.state_every_s, self.step,
                                         time.monotonic())
        self.source = self.open_source(self.topic, offsets)
        self.next_offsets = self.source.positions()

    def _open_logs(self) -> None:
        self.publisher = BackgroundPublisher(self.policies, self.state, recovery=self.states,
                                             keep_last=self.lcfg.keep_checkpoints, keep_within=self.reach_steps())
        self.update_log = RolloutSink(self.bootstrap, updates_topic(self.topic), security=self.kafka_security)
        self.dead_letters = RolloutSink(self.bootstrap, dead_letter_topic(self.topic), security=self.kafka_security)
        judged = (judged_rollout_ids(self.bootstrap, self.topic, self.step, self.kafka_security)
                  if self.step > 0 else set())
        attempt = uuid.uuid4().hex[:12]
        # Steps logged after the checkpoint we start from were lost with the learner that made them.
        self.publish_entry(rewind_entry(self.step, self.lcfg.loss_type, attempt, self.topic, self.version))
        self.admission = Admission(self.lcfg, self.limits, judged)
        self.metrics = MetricsWriter(self.run_dir)
        self.recorder = StepRecorder(self.run_dir, self.metrics, self.admission, loss_type=self.lcfg.loss_type,
                                     topic=self.topic, vocab_size=self.limits.vocab_size,
                                     tokenizer_sha=tokenizer_fingerprint(self.tokenizer), attempt=attempt,
                                     publish=self.send_entry)

    def _open_trust(self) -> None:
        """The signature check (with the root-signed key registry), the strike policy (with the
        quarantines already recorded) and the content checks."""
        sec = self.cfg.security
        # Without required signatures, signed rollouts are still checked if the root key is there.
        self.root_public = (load_root_public(self.keys)
                            if sec.require_signatures or self.keys.root_public.exists() else None)
        self.verifier = RolloutVerifier(self.cfg.run.name, None, sec.require_signatures)
        self.strikes = StrikePolicy(sec.strikes_to_quarantine, [
            Quarantine(k, str(q.get("sampler_id", "")), str(q.get("reason", "")),
                       float(q["at"]) if isinstance(q.get("at"), (int, float)) else 0.0, list(q.get("strikes") or []))
            for k, q in self.state.quarantines().items()])
        self.groups_by_key: Counter = Counter()
        self.fresh_by_key: Counter = Counter()
        """Signed messages read per key, and those of staleness 0 (a quarantine records how many it took)."""
        self.judged_by_key: Counter = Counter()
        self.fresh_judged_by_key: Counter = Counter()
        """With validators: groups per key whose verdict was applied, and those of staleness 0 when
        read (groups are read ahead of their verdicts, so these count what the checks had seen)."""
        self.registry_follower = (None if self.root_public is None else
                                  RegistryFollower(self.state.client, self.cfg.run.name, self.root_public,
                                                   sec.registry_refresh_s, self.log))
        self.verdict_verifier = VerdictVerifier(self.cfg.run.name, None) if self.validated else None
        self.verdict_source = (self.open_source(verdicts_topic(self.topic), {})
                               if self.validated else None)  # every verdict from the start: a resumed learner too
        self.verdicts: dict[str, dict[str, GroupVerdict]] = {}
        """Valid verdicts whose group has not been decided yet: rollout id -> SHA-256 of the message
        they judged -> the first such verdict (a verbatim copy of a group, elsewhere in the topic,
        is the same bytes: its verdict holds for the original too)."""
        self.awaiting_at: dict[str, str] = {}
        """Rollout id of each group waiting for its verdict -> SHA-256 of its message."""
        self.verdict_counts: Counter = Counter()
        self.refresh_registry()
        self.ranks_share_weights = self.ranks.world_size > 1 and self.lcfg.zero_stage == 3
        # Groups of staleness 0 are checked by the step's own forward passes, unless the engine
        # cannot take a step back when one fails (ZeRO stage 2): then by a pass of their own.
        self.fresh_in_step = can_discard_gradients(self.engine)
        self.screen = GroupScreen(sec, make_task_from_config(self.cfg), self.tokenizer, self.cfg.sampler.temperature,
                                  (lambda: None) if self.ranks_share_weights else (lambda: self.engine.module),
                                  PastPolicies(self.handles.store, self.work_dir, self.start_dir,
                                               dtype=self.rescoring_dtype(), policies=self.policies))

    def open_source(self, topic: str, offsets: dict[int, int]) -> RolloutSource:
        """A reader of `topic` from `offsets`, waiting out a broker that does not answer (a
        restart, a network partition) for up to `learner.idle_timeout_s`."""
        def on_retry(error: BaseException, wait_s: float, _failures: int) -> None:
            self.log.warning("%s; retrying in %.1fs", error, wait_s)

        return retry_call(lambda: RolloutSource(self.bootstrap, topic, start_offsets=offsets,
                                                security=self.kafka_security),
                          retry_on=(ServiceUnavailable,), first_s=1.0, max_s=15.0,
                          give_up_after_s=self.lcfg.idle_timeout_s, on_retry=on_retry)

    def rescoring_dtype(self) -> torch.dtype:
        """What stale groups are re-scored in: the published policy's dtype where this machine
        is fast in it, else float32, which holds bf16 weights exactly."""
        published = self.policies.dtype
        fast = torch.bfloat16 if machine_precision(self.device)[0] == "bf16" else torch.float32
        return published if published in (fast, torch.float32) else torch.float32

    def reach_steps(self) -> int:
        """How many versions back a group may be and still be used (and so be re-scored)."""
        extra = (self.lcfg.reweight_max_extra_steps or 0) if self.lcfg.stale_policy == "reweight" else 0
        return self.lcfg.max_delay_steps + extra

    def refresh_registry(self) -> None:
        """Re-read the signed key registry every `security.registry_refresh_s`: a revoked key's
        groups waiting in the batch are dropped, its later messages rejected."""
        if self.registry_follower is None:
            return
        old = self.verifier.registry
        registry = self.registry_follower.refresh()
        if registry is None:
            return
        self.verifier.registry = registry
        if self.verdict_verifier is not None:
            self.verdict_verifier.registry = registry
        revoked = {k for k, e in registry.keys.items() if e.status == "revoked"}
        if old is not None and revoked - {k for k, e in old.keys.items() if e.status == "revoked"}:
            n = self.admission.withdraw(lambda g: g.rollout.key_id not in revoked, lambda g: "revoked_key")
            self.log.warning("key(s) %s revoked: %d of their groups dropped from the batch",
                             ", ".join(sorted(revoked)), n)

    # ---- admit ----------------------------------------------------------------------
    def take(self, records: list[RawRecord]) -> None:
        """Admit each message in order, training whenever a batch is full. Offsets advance
        message by message, so a checkpoint stores exactly what was judged before it.

        Samplers pace themselves on the offsets reported here (`sampler.max_backlog_groups`):
        what the learner has judged, after each step and after the records of a poll, not what
        it has polled. A poll holds up to 64 records, and at 8 groups a step those are 8 steps
        of data that a sampler would otherwise not count as waiting."""
        self.last_record_at = time.monotonic()
        with self.busy():
            for record in records:
                self.next_offsets[record.partition] = record.offset + 1
                self.admit(record)
                if self.train_ready():
                    self.report_position()
                if self.step >= self.lcfg.max_steps:
                    break
        self.report_position()

    @contextmanager
    def busy(self):
        """Say in Redis that the learner is on its critical path (admitting, checking, training),
        so samplers on its machine that yield to it pause (`sampler.yield_to_learner`)."""
        self.state.mark_learner_busy(BUSY_FOR_S)
        try:
            yield
        finally:
            self.state.mark_learner_busy(0)

    def report_position(self) -> None:
        """What the learner has judged, and how much of the topic it has not (samplers pace on both)."""
        self.state.report_learner_offsets(self.next_offsets, self.source.unread(self.next_offsets),
                                          len(self.admission.pending) + len(self.admission.awaiting))

    def admit(self, record: RawRecord) -> None:
        """Check the seal, then admit; a kept group's content is checked before it may be used."""
        self.refresh_registry()
        now, where = time.time(), f"{self.topic}[{record.partition}]@{record.offset}"
        try:
            with self.clock.stage("intake"):
                rollout = self.verifier.check(record.value, now)
        except RolloutDecodeError:
            admitted = self.admission.admit_message(record.partition, record.offset, record.value, self.version, now)
        except Rejected as e:
            admitted = self.admission.reject(record.partition, record.offset, e.code, e.reason)
            if e.attributable:
                self.strike(e.key_id, e.sampler_id, e.code, e.reason)
            self.dead_letter(record, f"rejected: {e.reason}", where)
            return
        else:
            admitted = self.admit_signed(rollout, record, now)
        if admitted.verdict == "malformed":
            self.dead_letter(record, admitted.reason, where)
        elif admitted.verdict == "duplicate":
            self.log.warning("ignoring a second copy of rollout %s at %s", admitted.rollout.rollout_id, where)

    def admit_signed(self, rollout: Rollout, record: RawRecord, now: float) -> Admitted:
        """Admission of a group whose seal holds (or that needs none), then its content checks."""
        key_id = rollout.key_id
        self.groups_by_key[key_id] += 1
        self.fresh_by_key[key_id] += rollout.policy_version == self.version
        if self.strikes.is_quarantined(key_id):
            return self.admission.refuse(rollout, record.partition, record.offset, self.version, "quarantined")
        if rollout.policy_version > self.version:
            self.strike(key_id, rollout.sampler_id, "future_version",
                        f"claims policy v{rollout.policy_version}, the learner is at v{self.version}")
        admitted = self.admission.admit_rollout(rollout, record.partition, record.offset, self.version, now,
                                                hold=self.validated)
        if admitted.verdict == "malformed":
            self.strike(key_id, rollout.sampler_id, "invalid", admitted.reason)
        elif admitted.verdict == "kept" and self.validated:  # it waits for its verdict
            self.awaiting_at[rollout.rollout_id] = group_digest(record.value)
            self.apply_verdict(rollout.rollout_id)
        elif self.validated:
            self.verdicts.pop(rollout.rollout_id, None)  # decided without one: its early verdict is moot
        elif admitted.verdict == "kept":
            with self.clock.stage("screen"):
                failures = self.screen.check(rollout, self.version - rollout.policy_version,
                                             fresh_in_step=self.fresh_in_step)
            if failures:
                self.admission.withdraw(lambda g: g.rollout.rollout_id != rollout.rollout_id,
                                        lambda g: f"failed_check:{failures[0][0]}")
                for kind, detail in failures:
                    if kind != UNVERIFIABLE:
                        self.strike(key_id, rollout.sampler_id, kind, detail)
        return admitted

    def strike(self, key_id: str, sampler_id: str, kind: str, detail: str) -> None:
        """A failure of a key's data; at the strike policy's limit the key is quarantined, its
        groups in the batch dropped (counted) and the verdict recorded in Redis for status."""
        if not key_id or self.strikes.is_quarantined(key_id):
            return
        quarantine = self.strikes.strike(key_id, sampler_id, kind, detail, time.time())
        self.log.warning("strike against sampler %s (key %s): %s: %s", sampler_id, key_id, kind, detail)
        if quarantine is None:
            return
        dropped = self.admission.withdraw(lambda g: g.rollout.key_id != key_id, lambda g: "quarantined")
        self.state.record_quarantine(key_id, {**asdict(quarantine), "dropped_in_flight": dropped,
                                              "groups_seen": self.groups_by_key[key_id],
                                              "fresh_groups_seen": self.fresh_by_key[key_id],
                                              "groups_judged": self.judged_by_key[key_id],
                                              "fresh_groups_judged": self.fresh_judged_by_key[key_id],
                                              "learner_version": self.version})
        self.log.error("quarantined sampler %s (key %s): %s; %d of its groups dropped from the batch", sampler_id,
                       key_id, quarantine.reason, dropped)

    # ---- verdicts (validators.enabled) --------------------------------------------------
    def read_verdicts(self) -> None:
        """The validators' verdicts published since the last read: each valid one lets its group
        into the batch or refuses it (now, or when the group arrives); a forged one is refused."""
        if self.verdict_source is None:
            return
        for _ in range(VERDICT_POLLS):  # a full poll may leave more behind it
            records = self.verdict_source.poll(0.0)
            if not records:
                return
            with self.busy():
                for record in records:
                    self.take_verdict(record)
                    if self.train_ready():  # at every verdict: a batch is never more than groups_per_step
                        self.report_position()
            if len(records) < self.verdict_source.max_records:
                return

    def take_verdict(self, record: RawRecord) -> None:
        where = f"{verdicts_topic(self.topic)}[{record.partition}]@{record.offset}"
        with self.clock.stage("intake"):
            try:
                verdict = self.verdict_verifier.check(record.value, time.time())
            except Rejected as e:
                self.verdict_counts[f"refused:{e.code}"] += 1
                self.log.warning("refused the verdict at %s: %s", where, e.reason)
                return
        self.verdict_counts["valid"] += 1
        if verdict.rollout_id in self.admission.seen_ids and verdict.rollout_id not in self.admission.awaiting:
            self.verdict_counts["group_already_decided"] += 1  # quarantined, dropped, or another verdict first
            return
        by_digest = self.verdicts.setdefault(verdict.rollout_id, {})
        if verdict.group_digest in by_digest:
            self.verdict_counts["not_first"] += 1  # another validator's (or a re-judged) verdict came first
            return
        by_digest[verdict.group_digest] = verdict
        self.apply_verdict(verdict.rollout_id)

    def apply_verdict(self, rollout_id: str) -> None:
        """Decide a waiting group once both it and its verdict are here: a passing verdict lets it
        into the batch (its staleness judged again now), a failing one refuses it and strikes its key."""
        group = self.admission.awaiting.get(rollout_id)
        if group is None or rollout_id not in self.verdicts:
            return
        by_digest = self.verdicts[rollout_id]
        verdict = by_digest.pop(self.awaiting_at[rollout_id], None)
        for other in by_digest.values():  # they vouch for other bytes under this id
            self.verdict_counts["refused:other_content"] += 1
            self.log.warning("refused verdict %s:%d on group %s: it is about other content (%s@%d)",
                             other.validator_key_id, other.seq, rollout_id, other.partition, other.offset)
        by_digest.clear()
        if verdict is None:
            return
        del self.verdicts[rollout_id]
        del self.awaiting_at[rollout_id]
        self.judged_by_key[group.rollout.key_id] += 1
        self.fresh_judged_by_key[group.rollout.key_id] += group.staleness == 0
        ref = f"{verdict.validator_key_id}:{verdict.seq}"
        if verdict.passed:
            self.verdict_counts["passed"] += 1
            self.admission.release(rollout_id, self.version, time.time(), ref)
            return
        self.verdict_counts[f"failed:{verdict.failure}"] += 1
        self.admission.refuse_awaiting(rollout_id, f"failed_verdict:{verdict.failure}")
        if verdict.strikes:
            self.strike(group.rollout.key_id, group.rollout.sampler_id, verdict.failure,
                        f"{verdict.detail} (verdict {ref} of validator {verdict.validator_id})")

    def expire_awaiting(self) -> None:
        """After a step: waiting groups past the staleness rule are dropped, as in the batch."""
        if self.admission.awaiting:
            self.admission.expire_awaiting(self.version, time.time())
        self.awaiting_at = {k: v for k, v in self.awaiting_at.items() if k in self.admission.awaiting}
        # verdicts that came before groups read and decided since (or never to be read: a message
        # behind the learner's position) are moot
        self.verdicts = {k: v for k, v in self.verdicts.items()
                         if k in self.admission.awaiting or any(
                             x.offset >= self.next_offsets.get(x.partition, 0) for x in v.values())}

    def dead_letter(self, record: RawRecord, reason: str, where: str) -> None:
        self.send_retrying(self.dead_letters, record.value, headers=[
            ("reason", reason.encode()), ("source_topic", self.topic.encode()),
            ("source_partition", str(record.partition).encode()), ("source_offset", str(record.offset).encode()),
            *[(k, v) for k, v in record.headers if k != "reason"]])
        self.log.warning("dead-lettered message at %s to %s: %s", where, dead_letter_topic(self.topic), reason)

    # ---- train a batch --------------------------------------------------------------
    def train_ready(self, last: bool = False, save: bool = True) -> bool:
        """Check and train the batch once `groups_per_step` groups wait (with `last`, whatever
        waits: the drain's batch, saved by the drain); whether a step was taken. A group that
        fails a check is withdrawn, its key struck, and the rest wait for the batch to fill again."""
        batch = self.admission.take_batch(time.time(), last=last)
        if not batch:
            return False
        with self.clock.stage("screen"):
            failures, in_step = self.screen.check_batch(
                [(g.rollout, g.staleness) for g in batch], fresh_in_step=self.fresh_in_step,
                still_pending=[g.rollout.rollout_id for g in self.admission.pending])
        if not failures:
            try:
                self.train(batch, FreshCheck(tuple(in_step), self.cfg.security.logprob_threshold) if in_step else None,
                           save=save)
                return True
            except StepRefused as refused:
                failures = {batch[i].rollout.rollout_id: [self.screen.record_fresh(batch[i].rollout, gap)]
                            for i, gap in refused.gaps.items() if i in refused.failed}
                for i, gap in refused.gaps.items():
                    if i not in refused.failed:
                        self.screen.record_fresh(batch[i].rollout, gap)
        self.admission.put_back(batch)
        for rollout_id, failed in failures.items():
            group = next(g for g in batch if g.rollout.rollout_id == rollout_id)
            self.admission.withdraw(lambda g: g.rollout.rollout_id != rollout_id,
                                    lambda g: f"failed_check:{failed[0][0]}")
            for kind, detail in failed:
                if kind != UNVERIFIABLE:
                    self.strike(group.rollout.key_id, group.rollout.sampler_id, kind, detail)
        return self.train_ready(last, save) if last else False

    def train(self, batch: list[PendingGroup], fresh_check: Optional[FreshCheck] = None, save: bool = True) -> None:
        """One optimizer step on whole groups (every rank its share), logged; a checkpoint
        every `sync_every` steps. StepRefused (nothing changed) if a group of `fresh_check` fails."""
        groups, weights = [g.rollout for g in batch], [g.decision.weight for g in batch]
        if self.link is not None:
            self.link.send(TRAIN, {"groups": [encode_rollout(r) for r in groups], "weights": weights,
                                   "fresh_check": None if fresh_check is None else list(fresh_check.groups),
                                   "threshold": self.cfg.security.logprob_threshold})
        with self.clock.stage("train"):
            step_metrics = self.optimize(groups, weights, fresh_check)
        for i, gap in step_metrics.pop("fresh_gaps", {}).items():
            self.screen.record_fresh(groups[i], gap)
        self.version += 1
        self.step += 1
        if self.validated:
            self.expire_awaiting()
        stages = {**self.clock.take(), **self.publisher.take_seconds()}
        self.stage_totals.update(stages)
        values = self.recorder.record(self.version, batch, {**step_metrics, **stages}, step=self.step)
        self.state.report_learner({"step": self.step, "policy_version": self.version,
                                   **self.admission.counters.as_dict()})
        self.log.info("step %d (v%d) loss %.4f reward %.3f staleness %.1f/%d used %d dropped %d", self.step,
                      self.version, values["loss"], values["reward_mean"], values["staleness_mean"], values["staleness_max"],
                      values["groups_used"], values["groups_dropped"])
        final = self.step >= self.lcfg.max_steps
        if not save:
            return
        state_due = final or self.recovery.due(self.step, time.monotonic())
        if state_due or self.step % self.lcfg.sync_every == 0:
            self.save_checkpoint(policy=final or self.step % self.lcfg.sync_every == 0, state=state_due, final=final)

    def optimize(self, groups: list[Rollout], weights: list[float], fresh_check: Optional[FreshCheck] = None) -> dict:
        """The optimizer step on this batch (every rank its share); its metrics. (`heterorl
        loadtest` models it by its time: `heterorl.loadtest.learner`.)"""
        return optimizer_step(self.engine, groups, weights, self.lcfg, temperature=self.cfg.sampler.temperature,
                              max_completion_length=self.cfg.sampler.max_new_tokens, ranks=self.ranks,
                              fresh_check=fresh_check)

    # ---- save a checkpoint ----------------------------------------------------------
    def save_checkpoint(self, tail_verdicts: Optional[Verdicts] = None, *, policy: bool = True,
                        state: bool = True, final: bool = False) -> None:
        """Snapshot the weights (and, for a recovery state, the learner state) and hand them to
        the background publisher: the policy as the current version, the state as this step's.
        `final`: the run's last version, a keyframe (it stands alone: a user takes it home)."""
        # A fresh directory each time: the publisher may still be uploading (then deleting)
        # an earlier snapshot of this same version.
        snapshot = Path(tempfile.mkdtemp(prefix=f"v{self.version}-", dir=self.work_dir))
        policy = policy and self.published_version != self.version
        if self.link is not None:  # gathering the weights and the optimizer state takes every rank
            self.link.send(SAVE, {"state": state})
        with self.clock.stage("snapshot"):  # copies in memory; the publisher's thread writes them
            captured = capture(self.engine, self.tokenizer, state=state)
        extra = {"offsets": self.resume_offsets(), "step": self.step, "policy_version": self.version,
                 "loss_type": self.lcfg.loss_type}
        if tail_verdicts:
            # Verdicts since the last step (no step logs them) travel with the final recovery state.
            extra["tail_verdicts"] = {k: [asdict(x) for x in v] for k, v in vars(tail_verdicts).items() if v}
        self.publisher.submit(Snapshot(snapshot, extra, version=self.version if policy else None,
                                       parent_version=self.published_version,
                                       state_step=self.step if state else None, keyframe=final, capture=captured,
                                       template=self.start_dir))
        if policy:
            self.published_version = self.version
        if state:
            self.recovery.written(self.step, time.monotonic())

    def resume_offsets(self) -> dict[int, int]:
        """Where a learner resumed from this checkpoint reads on: the next offset per partition,
        or the earliest group still waiting for its verdict (so none is lost with a restart;
        the groups judged after it are known from the update log and ignored)."""
        offsets = dict(self.next_offsets)
        for group in self.admission.awaiting.values():
            offsets[group.partition] = min(offsets.get(group.partition, group.offset), group.offset)
        return offsets

    # ---- drain ----------------------------------------------------------------------
    def drain_due(self) -> bool:
        """Whether a drain was requested (SIGUSR1) and every message of the topic has been read
        (a broker too busy to say is asked again at the next poll)."""
        if not self.drain_request.requested:
            return False
        if self.admission.awaiting and not self.verdicts_waited_out():
            return False
        try:
            if self.verdict_source is not None and self.verdict_source.lag() > 0:
                return False  # every verdict written before the drain is read (and forged ones refused)
        except KafkaError as e:
            self.log.warning("draining: Kafka at %s did not say where the verdicts end (%s); asking again",
                             self.bootstrap, type(e).__name__)
            return False
        try:
            return self.source.lag() == 0
        except KafkaError as e:
            self.log.warning("draining: Kafka at %s did not say where the topic ends (%s); asking again",
                             self.bootstrap, type(e).__name__)
            return False

    def verdicts_waited_out(self) -> bool:
        """Draining with groups still waiting for verdicts: whether `validators.verdict_wait_s`
        has passed since the drain began (they are then dropped as `no_verdict`)."""
        began = self.drain_request.requested_at
        if time.monotonic() - began < self.cfg.validators.verdict_wait_s:
            return False
        for rollout_id in list(self.admission.awaiting):
            self.admission.refuse_awaiting(rollout_id, "no_verdict")
        self.log.warning("draining: dropped the groups still without a verdict after %.0fs",
                         self.cfg.validators.verdict_wait_s)
        return True

    def drain(self) -> None:
        """Train the last, smaller batch and publish, so every message read is accounted for."""
        self.train_ready(last=True, save=False)  # rechecked: time passed while winding down; saved below
        tail = self.admission.take_verdicts()
        if tail or self.published_version != self.version or self.recovery.last_step != self.step:
            self.save_checkpoint(tail, final=True)
        self.log.info("drained: every message of %s up to offsets %s is accounted for", self.topic,
                      self.next_offsets)

    # ---- waiting, the logs, the end -------------------------------------------------
    def idle_s(self) -> float:
        return time.monotonic() - self.last_record_at

    def report_waiting(self) -> None:
        if time.monotonic() - self.last_wait_log > 5:
            self.log.info("waiting for rollouts on %s at %s: %d/%d groups in batch, %d live samplers", self.topic,
                          self.bootstrap, len(self.admission.pending), self.lcfg.groups_per_step,
                          len(self.state.live_samplers()))
            self.last_wait_log = time.monotonic()

    def send_entry(self, entry: UpdateEntry) -> None:
        """The update log must hold a step before anything builds on it."""
        self.send_retrying(self.update_log, entry.to_json().encode(), key=str(entry.step).encode())

    def publish_entry(self, entry: UpdateEntry) -> None:
        """An update-log entry of the learner's own (the rewind marker): Kafka, then the file."""
        self.send_entry(entry)
        append_entry(self.run_dir, entry)

    def send_retrying(self, sink: RolloutSink, value: bytes, **kwargs) -> None:
        """Retry a write through a broker outage, for up to learner.network_retry_s, saying so each time."""
        def on_retry(error: BaseException, wait_s: float, _failures: int) -> None:
            self.log.warning("writing to %s on Kafka at %s failed (%s); retrying in %.0fs", sink.topic,
                             self.bootstrap, type(error).__name__, wait_s)

        retry_call(lambda: sink.send_raw(value, **kwargs), retry_on=(KafkaError,), first_s=1.0, max_s=30.0,
                   give_up_after_s=self.lcfg.network_retry_s, on_retry=on_retry)

    def close(self) -> None:
        if self.link is not None:
            self.link.send(STOP)
        if not self.publisher.closed:  # an error path: still publish what was handed over
            try:
                self.publisher.close()
            except Exception as e:  # noqa: BLE001 - the original error matters more
                self.log.error("%s", e)
        self.source.close()
        if getattr(self, "verdict_source", None) is not None:
            self.verdict_source.close()
        self.update_log.close()
        self.dead_letters.close()
        self.metrics.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def write_summary(self) -> None:
        summary = {"final_policy_version": self.version, "start_policy_version": self.start_version,
                   "final_step": self.step, "publishing": self.publisher.upload_bytes,
                   "final_checkpoint": self.handles.store.uri(self.version), "rollout_topic": self.topic,
                   "offsets": {str(p): o for p, o in self.next_offsets.items()},
                   **self.admission.counters.as_dict(),
                   "checks": self.screen.summary(), "precision": self.precision,
                   **({"verdicts": dict(self.verdict_counts)} if self.validated else {}),
                   "seconds": {k: round(v, 1) for k, v in sorted(self.stage_totals.items())},
                   "outside_optimizer_share": outside_optimizer_share(self.stage_totals),
                   "quarantined": {k: asdict(q) for k, q in self.strikes.quarantined.items()}}
        (self.run_dir / "learner_summary.json").write_text(json.dumps(summary, indent=2))
        self.log.info("done: policy v%d at %s", self.version, summary["final_checkpoint"])


class LearnerRank:
    """A learner process of rank > 0: trains its share of each step rank 0 sends and joins
    its checkpoint saves; it reads no Kafka and writes no log of its own."""

    def __init__(self, cfg: HeteroConfig):
        self.ranks = Ranks.from_env()
        self.log = setup_logging(f"learner r{self.ranks.rank}")
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a drain is rank 0's to do
        self.device = resolve_device(cfg.model.device, self.ranks.local_rank)
        self.cfg, _ = with_machine_precision(cfg, self.device)
        self.lcfg = self.cfg.learner

    def run(self) -> int:
        torch.set_num_threads(self.lcfg.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        link = open_rank_link(self.device, self.ranks, self.lcfg)
        command, start = link.receive()
        if command != START:
            raise RuntimeError(f"rank {self.ranks.rank} expected start from rank 0, got {NAMES.get(command)}")
        with tempfile.TemporaryDirectory(prefix=f".learner-r{self.ranks.rank}-") as work:
            if start["base"] is not None:
                model_dir = Path(start["base"])
            else:  # the recovery state rank 0 resumes from, fetched and verified here too
                model_dir, _ = recovery_store(connect_run(self.cfg).store).fetch(
                    start["manifest_key"], Path(work) / "resume", learner_state=True)
            engine, tokenizer = start_engine(self.cfg, model_dir, self.device, self.ranks, self.log,
                                             resuming=start["base"] is None)
            self.log.info("rank %d of %d ready on %s", self.ranks.rank, self.ranks.world_size, self.device)
            while True:
                command, payload = link.receive()
                if command == TRAIN:
                    check = payload.get("fresh_check")
                    try:
                        optimizer_step(engine, [decode_rollout(g) for g in payload["groups"]], payload["weights"],
                                       self.lcfg, temperature=self.cfg.sampler.temperature,
                                       max_completion_length=self.cfg.sampler.max_new_tokens, ranks=self.ranks,
                                       fresh_check=None if check is None else FreshCheck(tuple(check),
                                                                                         payload["threshold"]))
                    except StepRefused:
                        # optimizer_step has already discarded this rank's gradients; rank 0 saw
                        # the same all-reduced log-probs, refused the same step and reports it
                        continue
                elif command == SAVE:
                    capture(engine, tokenizer, state=payload["state"], leader=False)
                elif command == STOP:
                    return 0


def spawn_ranks(cfg: HeteroConfig, world_size: int) -> list[subprocess.Popen]:
    """Ranks 1..N-1 of a learner started without a launcher, as child processes of rank 0
    (this process becomes rank 0). They get the whole config, services included, in their
    environment, and end when rank 0 does."""
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE=str(world_size))
    children = []
    for rank in range(1, world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), RANK_CONFIG_ENV: cfg.model_dump_json()}
        children.append(subprocess.Popen([sys.executable, "-c", "from consumers.learner import run_rank; run_rank()"],
                                         env=env, preexec_fn=_die_with_parent))
    return children


RANK_CONFIG_ENV = "HETERORL_LEARNER_CONFIG"
"""A spawned rank's config (JSON, secrets included: it lives only in that process's environment)."""


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when rank 0 dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_rank() -> None:
    """Entry point of a rank spawned by `spawn_ranks`."""
    sys.exit(LearnerRank(HeteroConfig.model_validate_json(os.environ[RANK_CONFIG_ENV])).run())


def run_learner(cfg: HeteroConfig, run_dir: Optional[Path] = None) -> int:
    """The learner: rank 0 of `learner.num_processes` (it starts the others itself unless a
    launcher set WORLD_SIZE), or, under a launcher, whichever rank this process is."""
    if "WORLD_SIZE" not in os.environ and cfg.learner.num_processes > 1:
        children = spawn_ranks(cfg, cfg.learner.num_processes)
        try:
            return Learner(cfg, run_dir).run()
        finally:
            for child in children:
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
    if Ranks.from_env().leader:
        return Learner(cfg, run_dir).run()
    return LearnerRank(cfg).run()
