"""Learner: consume prompt groups, enforce the max delay, step DeepSpeed, publish weights.

Run: `heterorl learner --config configs/demo.yaml [--out RUN_DIR]` (exactly one per run).

The loop, top to bottom:
  1. start from the newest checkpoint in Redis/S3 (resuming at the Kafka offsets stored
     with it), or publish the base model as version 0;
  2. read the rollout topic by explicit partition assignment;
  3. for each message: decode and validate (a poison message — undecodable, wrong schema
     version, non-finite or positive log-probs, over the length limits — is counted and
     copied to the dead-letter topic `<run>.dead` with the reason in a header); a
     second copy of a rollout id already judged is ignored and counted; staleness
     τ = learner version − rollout version; drop or reweight past `max_delay_steps` /
     `max_delay_seconds` (every drop counted);
  4. once `groups_per_step` whole groups are kept: one loss, one DeepSpeed step; the
     version is the number of steps taken; the step's entry goes to the update log
     (`<run>.updates` and RUN_DIR/updates.jsonl: which offsets were used, dropped,
     set aside), which replay and the chaos audit read;
  5. every `sync_every` steps save the weights (and, beside them, the optimizer and
     LR-schedule state) and hand them to the background publisher (S3 files → manifest
     with the consumed offsets → version in Redis). A restarted learner resumes from
     the newest checkpoint with its state and offsets, so every group is used in at most
     one update.
  6. on SIGUSR1 (drain): read to the end of the topic, train the last (smaller) batch,
     publish, exit 0 — the chaos run's audit then finds every message accounted for.

Staleness is decided when a group is taken into the batch. The version only changes
at a step, and a batch is trained the moment it is full, so τ at decision is τ at use:
no group past the limit is ever used.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.config import HeteroConfig, dump_config
from pipeline.rollout import Rollout, RolloutDecodeError, decode_rollout
from pipeline.staleness import StalenessCounter, StalenessDecision, decide_staleness
from pipeline.runtime import connect_run, resolve_base_model, setup_logging, touch_heartbeat_file
from pipeline.update_log import (DroppedGroup, DuplicateGroup, SkippedMessage, UpdateEntry, UsedGroup, append_entry,
                                 dead_letter_topic, read_entries_kafka, rewind_entry, updates_topic)


@dataclass
class PendingGroup:
    """A group admitted into the batch being filled, with what its admission decided."""

    rollout: Rollout
    partition: int
    offset: int
    staleness: int
    age_s: float
    decision: StalenessDecision


@dataclass
class LearnerCounters:
    groups_consumed: int = 0
    """Every message read, whatever happened to it."""
    malformed: int = 0
    duplicates: int = 0
    """Second copies of a rollout id already judged (producer retries), ignored."""
    staleness: StalenessCounter = field(default_factory=StalenessCounter)
    """Final verdict of every decodable group: fresh / reweighted (used), or dropped by reason."""
    staleness_used: list = field(default_factory=list)

    def as_dict(self) -> dict:
        used = self.staleness_used
        counts = self.staleness.counts
        return {"groups_consumed": self.groups_consumed, "groups_used": self.staleness.kept,
                "groups_dropped": self.staleness.dropped, "groups_reweighted": self.staleness.reweighted,
                "malformed": self.malformed, "duplicates_ignored": self.duplicates,
                "dropped_by_reason": {r: counts[r] for r in ("too_stale_steps", "too_old_seconds") if counts[r]},
                "max_staleness_used": max(used) if used else None,
                "mean_staleness_used": (sum(used) / len(used)) if used else None,
                "staleness_histogram": {str(t): n for t, n in sorted(Counter(used).items())}}


def check_usable(rollout: Rollout, version: int, vocab_size: int, temperature: float,
                 max_new_tokens: int, max_positions: int) -> None:
    """What decoding cannot know: the rollout must fit this learner's model, limits and version."""
    if rollout.policy_version > version:
        raise RolloutDecodeError(f"policy_version {rollout.policy_version} is newer than the learner's {version} "
                                 "(another run on this topic, or a reset Redis)")
    if abs(float(rollout.sampling.get("temperature", -1)) - temperature) > 1e-6:
        raise RolloutDecodeError(f"sampled at temperature {rollout.sampling.get('temperature')}, "
                                 f"learner expects sampler.temperature={temperature}")
    ids = rollout.token_ids()
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise RolloutDecodeError(f"token id outside the model's vocabulary of {vocab_size}")
    longest = max(len(c) for c in rollout.completion_ids)
    if longest > max_new_tokens:
        raise RolloutDecodeError(f"completion of {longest} tokens exceeds sampler.max_new_tokens={max_new_tokens}")
    if len(rollout.prompt_ids) + longest > max_positions:
        raise RolloutDecodeError(f"prompt + completion of {len(rollout.prompt_ids) + longest} tokens exceeds the "
                                 f"model's {max_positions} positions")


def _start_policy(handles, work_dir: Path, base_model: Path, log):
    """(model dir, version, Kafka offsets) to start from: the newest checkpoint, or the base as v0."""
    version, manifest_key = handles.state.policy()
    if version is None:
        return base_model, 0, {}
    path, manifest = handles.store.fetch(manifest_key, work_dir / f"resume-v{version}", learner_state=True)
    offsets = {int(p): int(o) for p, o in manifest.extra.get("offsets", {}).items()}
    log.info("resuming from policy v%d at offsets %s", version, offsets)
    return path, version, offsets


def judged_rollout_ids(bootstrap: str, topic: str, up_to_step: int) -> set[str]:
    """Rollout ids the update log records as judged by steps <= `up_to_step`.

    A resumed learner starts with these, so a copy that reaches the log after the
    checkpoint is still recognised as a duplicate.
    """
    entries = read_entries_kafka(bootstrap, topic, timeout_s=60.0) or []
    return {g.rollout_id for e in entries if e.step <= up_to_step for g in (*e.used, *e.dropped, *e.duplicates)}


class _DrainRequest:
    """SIGUSR1 asks the learner to read the topic to its end, train what it kept
    (the last batch may be smaller), publish a final checkpoint and exit 0."""

    def __init__(self):
        import signal

        self.requested = False
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, *_):
        self.requested = True


def _write_once(path: Path, text: str) -> None:
    """Write a file other processes may be reading, only if absent, atomically."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def run_learner(cfg: HeteroConfig, run_dir: Optional[Path] = None) -> int:
    import torch

    from pipeline.checkpoints import LEARNER_STATE_DIR, BackgroundPublisher
    from pipeline.engine import make_engine
    from pipeline.kafka_io import RolloutSink, RolloutSource, ensure_topic
    from pipeline.metrics import MetricsWriter
    from pipeline.model import load_policy, tokenizer_fingerprint
    from pipeline.update import optimizer_step

    log = setup_logging("learner")
    drain = _DrainRequest()  # first: a drain request during the start must not kill the process
    lcfg, scfg = cfg.learner, cfg.sampler
    torch.set_num_threads(lcfg.torch_threads)
    torch.manual_seed(cfg.run.seed)
    run_dir = Path(run_dir or cfg.train.out_dir or f"runs/{cfg.run.name}")
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_once(run_dir / "config.yaml", dump_config(cfg))
    handles = connect_run(cfg)
    bootstrap = handles.services.kafka_bootstrap
    ensure_topic(bootstrap, cfg.run.topic, cfg.run.topic_partitions, retention_ms=cfg.run.topic_retention_ms)
    ensure_topic(bootstrap, updates_topic(cfg.run.topic), 1, retention_ms=cfg.run.topic_retention_ms)
    ensure_topic(bootstrap, dead_letter_topic(cfg.run.topic), 1, retention_ms=cfg.run.topic_retention_ms)
    handles.state.register_run(cfg.run.topic)
    work_dir = Path(tempfile.mkdtemp(prefix=".learner-", dir=run_dir))

    base_model = resolve_base_model(cfg) if handles.state.policy_version() is None else None
    model_dir, version, offsets = _start_policy(handles, work_dir, base_model, log)
    model, tokenizer = load_policy(model_dir)
    vocab_size = model.get_input_embeddings().num_embeddings
    max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    tokenizer_sha = tokenizer_fingerprint(tokenizer)
    seen_ids = judged_rollout_ids(bootstrap, cfg.run.topic, version) if version > 0 else set()
    engine = make_engine(model, lcfg)
    if (model_dir / LEARNER_STATE_DIR).is_dir():
        # AdamW moments, LR schedule and step count, so the resumed run continues exactly.
        engine.load_checkpoint(str(model_dir / LEARNER_STATE_DIR), tag="state", load_module_strict=True)
    elif version > 0:
        log.warning("checkpoint v%d has no learner state: continuing with a fresh optimizer", version)
    if base_model is not None:
        # Published only once the engine is ready, so samplers do not run ahead of a
        # learner that is still starting.
        handles.state.publish_policy(0, handles.store.publish(0, base_model, extra={"offsets": {}, "step": 0}))
        log.info("published base model %s as policy v0", base_model)
    publisher = BackgroundPublisher(handles.store, handles.state, lcfg.keep_checkpoints)
    source = RolloutSource(bootstrap, cfg.run.topic, start_offsets=offsets)
    def send_retrying(sink, value: bytes, **kwargs) -> None:
        """The update log must hold a step before anything builds on it: retry through an
        outage, with backoff, for up to learner.network_retry_s, saying so each time."""
        from kafka.errors import KafkaError

        from pipeline.services import Backoff

        deadline, backoff = time.monotonic() + lcfg.network_retry_s, Backoff(max_s=30.0, first_s=1.0)
        while True:
            try:
                sink.send_raw(value, **kwargs)
                return
            except KafkaError as e:
                wait = backoff.failed()
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("writing to %s on Kafka at %s failed (%s); retrying in %.0fs", sink.topic, bootstrap,
                            type(e).__name__, wait)
                time.sleep(wait)

    update_log = RolloutSink(bootstrap, updates_topic(cfg.run.topic))
    # Steps logged after the checkpoint we start from were lost with the learner that made them.
    attempt = uuid.uuid4().hex[:12]
    start_marker = rewind_entry(version, lcfg.loss_type, attempt, cfg.run.topic)
    send_retrying(update_log, start_marker.to_json().encode(), key=str(version).encode())
    append_entry(run_dir, start_marker)
    dead_letters = RolloutSink(bootstrap, dead_letter_topic(cfg.run.topic))
    judged: dict[str, list] = {"dropped": [], "malformed": [], "duplicates": []}  # since the last step
    next_offsets = source.positions()
    metrics = MetricsWriter(run_dir)
    counters = LearnerCounters()
    pending: list[PendingGroup] = []
    start_version = saved_version = version
    last_record_at = last_wait_log = step_started = time.monotonic()
    consumed_at_last_step = 0

    def decide(staleness: int, age_s: float) -> StalenessDecision:
        return decide_staleness(
            staleness, age_s, max_delay_steps=lcfg.max_delay_steps,
            max_delay_seconds=lcfg.max_delay_seconds, stale_policy=lcfg.stale_policy,
            reweight_decay=lcfg.reweight_decay, reweight_max_extra_steps=lcfg.reweight_max_extra_steps)

    def drop(group: PendingGroup) -> None:
        counters.staleness.record(group.decision)
        judged["dropped"].append(DroppedGroup(group.partition, group.offset, group.rollout.rollout_id,
                                              group.rollout.policy_version, group.staleness,
                                              group.decision.reason, group.age_s))

    def admit(record) -> None:
        """Decode, validate, deduplicate and judge one message; a kept group joins `pending`."""
        try:
            rollout = decode_rollout(record.value)
            check_usable(rollout, version, vocab_size, scfg.temperature, scfg.max_new_tokens, max_positions)
        except RolloutDecodeError as e:
            counters.malformed += 1
            judged["malformed"].append(SkippedMessage(record.partition, record.offset, e.reason))
            send_retrying(dead_letters, record.value, headers=[
                ("reason", e.reason.encode()), ("source_topic", cfg.run.topic.encode()),
                ("source_partition", str(record.partition).encode()), ("source_offset", str(record.offset).encode()),
                *[(k, v) for k, v in record.headers if k not in ("reason",)]])
            log.warning("dead-lettered malformed message at %s[%d]@%d to %s: %s", cfg.run.topic,
                        record.partition, record.offset, dead_letter_topic(cfg.run.topic), e.reason)
            return
        if rollout.rollout_id in seen_ids:
            counters.duplicates += 1
            judged["duplicates"].append(DuplicateGroup(record.partition, record.offset, rollout.rollout_id))
            log.warning("ignoring a second copy of rollout %s at %s[%d]@%d", rollout.rollout_id,
                        cfg.run.topic, record.partition, record.offset)
            return
        seen_ids.add(rollout.rollout_id)
        staleness, age_s = version - rollout.policy_version, time.time() - rollout.created_at
        group = PendingGroup(rollout, record.partition, record.offset, staleness, age_s, decide(staleness, age_s))
        if group.decision.keep:
            pending.append(group)
        else:
            drop(group)

    def recheck_pending() -> None:
        """Judge the waiting groups again at use: a wall-clock limit may have passed meanwhile."""
        still = []
        for group in pending:
            age_s = time.time() - group.rollout.created_at
            group = PendingGroup(group.rollout, group.partition, group.offset, group.staleness, age_s,
                                 decide(group.staleness, age_s))
            if group.decision.keep:
                still.append(group)
            else:
                drop(group)
        pending[:] = still

    def train_step(batch: list[PendingGroup]) -> None:
        nonlocal version, consumed_at_last_step, step_started
        for group in batch:
            counters.staleness.record(group.decision)
        step_metrics = optimizer_step(engine, [g.rollout for g in batch], [g.decision.weight for g in batch], lcfg,
                                      temperature=scfg.temperature, max_completion_length=scfg.max_new_tokens)
        version += 1
        entry = UpdateEntry(
            step=version, policy_version=version, loss_type=lcfg.loss_type, time=time.time(),
            used=[UsedGroup(g.partition, g.offset, g.rollout.rollout_id, g.rollout.policy_version, g.staleness,
                            g.decision.weight, g.age_s) for g in batch],
            dropped=judged["dropped"], malformed=judged["malformed"], duplicates=judged["duplicates"],
            vocab_size=vocab_size, tokenizer_sha=tokenizer_sha, attempt=attempt, topic=cfg.run.topic)
        send_retrying(update_log, entry.to_json().encode(), key=str(version).encode())
        append_entry(run_dir, entry)
        judged.update(dropped=[], malformed=[], duplicates=[])
        staleness = [g.staleness for g in batch]
        counters.staleness_used.extend(staleness)
        progress = counters.as_dict()
        elapsed = time.monotonic() - step_started
        values = {
            "policy_version": version, **step_metrics,
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            **{k: progress[k] for k in ("groups_used", "groups_dropped", "groups_reweighted", "groups_consumed",
                                        "malformed", "duplicates_ignored")},
            "groups_per_s": (counters.groups_consumed - consumed_at_last_step) / max(elapsed, 1e-9),
            "step_seconds": elapsed,
        }
        metrics.write("learner", version, values)
        handles.state.report_learner({"step": version, **progress})
        log.info("step %d loss %.4f reward %.3f staleness %.1f/%d used %d dropped %d", version, values["loss"],
                 values["reward_mean"], values["staleness_mean"], values["staleness_max"],
                 values["groups_used"], values["groups_dropped"])
        consumed_at_last_step, step_started = counters.groups_consumed, time.monotonic()
        if version % lcfg.sync_every == 0 or version >= lcfg.max_steps:
            save_checkpoint()

    def save_checkpoint(tail_verdicts: Optional[dict] = None) -> None:
        nonlocal saved_version
        # A fresh directory each time: the publisher may still be uploading (then deleting)
        # an earlier snapshot of this same version.
        snapshot = Path(tempfile.mkdtemp(prefix=f"v{version}-", dir=work_dir))
        engine.module.save_pretrained(snapshot, safe_serialization=True)
        tokenizer.save_pretrained(snapshot)
        engine.save_checkpoint(str(snapshot / LEARNER_STATE_DIR), tag="state", save_latest=False)
        extra = {"offsets": dict(next_offsets), "step": version, "loss_type": lcfg.loss_type}
        if tail_verdicts:
            extra["tail_verdicts"] = tail_verdicts
        publisher.submit(version, snapshot, extra)
        saved_version = version

    def drained() -> bool:
        """After SIGUSR1: everything in the topic has been read, so finish up."""
        if not drain.requested or source.lag() > 0:
            return False
        recheck_pending()  # the wall-clock limit may have passed while the run wound down
        if pending:  # a last, smaller batch: no kept group is left unused
            batch = pending[:]
            pending.clear()
            train_step(batch)
        tail = {k: [asdict(x) for x in v] for k, v in judged.items() if v}
        if tail or saved_version != version:
            # Verdicts since the last step (no step logs them) travel with the final checkpoint.
            save_checkpoint(tail)
        log.info("drained: every message of %s up to offsets %s is accounted for", cfg.run.topic, next_offsets)
        return True

    log.info("learner on %s, topic %s, loss %s, max_delay_steps %d, %d steps to go",
             bootstrap, cfg.run.topic, lcfg.loss_type, lcfg.max_delay_steps, lcfg.max_steps - version)
    try:
        while version < lcfg.max_steps:
            records = source.poll(lcfg.poll_timeout_s)
            touch_heartbeat_file()
            if not records and drained():
                break
            if not records:
                idle = time.monotonic() - last_record_at
                if idle > lcfg.idle_timeout_s:
                    log.error("no rollout for %.0fs on topic %s at %s (learner.idle_timeout_s); giving up",
                              idle, cfg.run.topic, bootstrap)
                    return 3
                if time.monotonic() - last_wait_log > 5:
                    log.info("waiting for rollouts on %s at %s: %d/%d groups in batch, %d live samplers",
                             cfg.run.topic, bootstrap, len(pending), lcfg.groups_per_step,
                             len(handles.state.live_samplers()))
                    last_wait_log = time.monotonic()
                continue
            last_record_at = time.monotonic()
            read_up_to = dict(next_offsets)
            for record in records:
                read_up_to[record.partition] = max(read_up_to.get(record.partition, 0), record.offset + 1)
            handles.state.report_learner_offsets(read_up_to)  # samplers pace themselves on it
            for record in records:
                # Offsets advance as each message is handled, so a checkpoint taken at a step
                # stores exactly what was used or dropped before it.
                next_offsets[record.partition] = record.offset + 1
                counters.groups_consumed += 1
                admit(record)
                if len(pending) >= lcfg.groups_per_step:
                    recheck_pending()
                    if len(pending) >= lcfg.groups_per_step:  # else some grew too old: keep filling
                        batch = pending[:]
                        pending.clear()
                        train_step(batch)
                if version >= lcfg.max_steps:
                    break
        publisher.close()  # raises if a checkpoint could not be published
    finally:
        if not publisher.closed:  # an error path: still publish what was handed over
            try:
                publisher.close()
            except Exception as e:  # noqa: BLE001 - the original error matters more
                log.error("%s", e)
        source.close()
        update_log.close()
        dead_letters.close()
        metrics.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    summary = {"final_policy_version": version, "start_policy_version": start_version,
               "final_checkpoint": handles.store.uri(version), "rollout_topic": cfg.run.topic,
               "offsets": {str(p): o for p, o in next_offsets.items()}, **counters.as_dict()}
    (run_dir / "learner_summary.json").write_text(json.dumps(summary, indent=2))
    log.info("done: policy v%d at %s", version, summary["final_checkpoint"])
    return 0
