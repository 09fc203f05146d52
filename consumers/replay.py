"""Replay: train a fresh learner on a recorded rollout topic, with no sampler at all.

Run: `heterorl replay --source kafka://HOST:PORT/TOPIC|FILE.parquet --base s3://BUCKET/RUN/vN/|DIR
--out RUN_DIR [--config C] [--loss L] [--set key=value ...] [--exact-batches] [filters]`.

The question it answers: "what would another loss, clip range or max delay have done
with exactly this data?" The loop, top to bottom:
  1. load the record: every message of the topic and the original learner's update log
     (Kafka `<run>.updates`, or both from an exported Parquet file); refuse an unknown
     or empty topic, a source without update log, filters that keep nothing;
  2. fetch the base checkpoint and refuse it if its tokenizer or vocabulary is not the
     one the rollouts were recorded with;
  3. plan the batches. Every group keeps its *recorded* staleness and age (when the
     original learner judged it), and the replay's own staleness rule judges it again,
     so a stricter or looser max delay means what it says:
       - `--exact-batches`: the log's batches, step by step, in the same order (a group
         the replay's rule now drops leaves its batch; the original's drops stay dropped);
       - otherwise: groups in the order the original learner judged them, batched by
         `learner.groups_per_step`;
  4. train with the learner's own step (`pipeline.learning.update.optimizer_step`), writing
     metrics, an update log, checkpoints (local directory or S3) and, with `eval.every`,
     held-out accuracy records exactly like a training run;
  5. write summary.json, naming `final_checkpoint`.

With the original config, loss and seed and `--exact-batches`, the final weights equal
the original run's (tests/integration/test_replay.py checks max |Δ| < 1e-5).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from consumers.recorder import StepRecorder
from pipeline.learning.admission import Admission, PendingGroup
from pipeline.records.archive import ArchiveError, read_archive
from pipeline.weights.store import CheckpointNotFound, CheckpointStore, CorruptCheckpointError, connect_s3
from pipeline.config import HeteroConfig, dump_config
from pipeline.learning.engine import make_deepspeed_engine
from pipeline.devices import resolve_device
from pipeline.errors import UserError
from pipeline.clients.topics import read_topic, topic_partitions
from pipeline.weights.learner_state import save_weights
from pipeline.records.metrics import MetricsWriter
from pipeline.models import load_policy, tokenizer_fingerprint
from pipeline.wire.rollout import Rollout, RolloutDecodeError, decode_rollout
from pipeline.runtime import (adopt_numerics, evaluate_model, learner_attention, learner_numerics,
                              make_task_from_config, setup_logging, with_machine_precision)
from pipeline.clients.services import ServiceUnavailable, require_services
from pipeline.learning.update import optimizer_step
from pipeline.records.update_log import DroppedGroup, UpdateEntry, UsedGroup, read_update_log, updates_topic
from pipeline.trust.keyring import trusted_learner
from pipeline.wire.signing import PublicKey
from pipeline.weights.policy import CheckpointUrlError, fetch_published, parse_checkpoint_url
from pipeline.weights.publisher import copy_weights_into, start_publisher


class ReplayError(UserError, ValueError):
    """A replay that cannot start; the message is one line saying why."""


# ----------------------------------------------------------------------------------
# 1. The record
# ----------------------------------------------------------------------------------
@dataclass
class RecordedRun:
    """Messages of a rollout topic by (partition, offset), and its update log."""

    description: str
    topic: str
    messages: dict[tuple[int, int], list[bytes]]
    """Payloads by (partition, offset): usually one, two where the broker gave one offset to
    two messages (Tansu can, see pipeline/records/audit.py); the log's rollout id tells them apart."""
    update_log: list[UpdateEntry]
    refused_update_records: dict[str, int] = field(default_factory=dict)
    """Records of the update log the original learner did not sign (or sent again), by reason: not used."""
    decoded: dict[tuple[int, int], list[Rollout]] = field(default_factory=dict, repr=False)
    """Messages decoded so far: the filter check and the plan both ask for the logged groups."""

    def rollout(self, partition: int, offset: int, rollout_id: str) -> Optional[Rollout]:
        """The decodable message at (partition, offset) with this rollout id, if any."""
        cache, key = self.decoded, (partition, offset)
        if key not in cache:
            cache[key] = []
            for payload in self.messages.get(key, []):
                try:
                    cache[key].append(decode_rollout(payload))
                except RolloutDecodeError:
                    pass
        return next((r for r in cache[key] if r.rollout_id == rollout_id), None)


def load_record(source: str, trusted: Optional[PublicKey], timeout_s: float = 15.0) -> RecordedRun:
    """`kafka://BOOTSTRAP/TOPIC` or an exported `.parquet` file; of its update log, only the
    entries `trusted` (the original learner's public key; None where signatures are off) signed."""
    refused: dict[str, int] = {}
    if source.startswith("kafka://"):
        bootstrap, _, topic = source[len("kafka://"):].partition("/")
        if not bootstrap or not topic:
            raise ReplayError(f"--source {source}: expected kafka://HOST:PORT/TOPIC")
        try:
            if not topic_partitions(bootstrap, topic):
                raise ReplayError(f"topic {topic} does not exist on Kafka at {bootstrap}")
            records = read_topic(bootstrap, topic, timeout_s=timeout_s)
            update_log = read_update_log(bootstrap, topic, trusted, timeout_s=timeout_s)
        except ServiceUnavailable as e:
            raise ReplayError(str(e)) from None
        log = None if update_log is None else update_log.entries
        refused = {} if update_log is None else update_log.refused_by_reason()
        where = f"Kafka at {bootstrap}"
    else:
        try:
            archive = read_archive(Path(source), trusted)
        except ArchiveError as e:
            raise ReplayError(str(e)) from None
        topic, records, log, where = archive.topic, archive.records, archive.update_log, source
    if not records:
        raise ReplayError(f"topic {topic} on {where} is empty: nothing to replay")
    if not log:
        unsigned = f" (its records were refused: {refused}; a run recorded before signing is replayed with " \
                   "--set security.require_signatures=false)" if refused else ""
        raise ReplayError(f"topic {topic} on {where} has no update log ({updates_topic(topic)}){unsigned}: replay "
                          "takes each group's staleness from the original learner's log")
    messages: dict[tuple[int, int], list[bytes]] = {}
    for r in records:
        messages.setdefault((r.partition, r.offset), []).append(r.value)
    return RecordedRun(f"{topic} on {where}", topic, messages, log, refused)


# ----------------------------------------------------------------------------------
# 2. The base checkpoint
# ----------------------------------------------------------------------------------
def fetch_base(cfg: HeteroConfig, base: str, dest: Path) -> Path:
    """A local HF model directory for `base` (`s3://BUCKET/RUN/vN/`, a published version, or a local directory)."""
    if base.startswith("s3://"):
        try:
            parse_checkpoint_url(base)
            client = connect_s3(require_services(cfg.services), timeout_s=cfg.services.connect_timeout_s)
            # Unsigned reads: a replay also starts from its own `--checkpoints`, which no learner key
            # signs. Every file and tensor is still checked against the manifest (docs/weights.md).
            path, _, _ = fetch_published(client, base, dest)  # a keyframe, or rebuilt from its deltas
        except (CheckpointUrlError, ServiceUnavailable, CheckpointNotFound, CorruptCheckpointError) as e:
            raise ReplayError(f"--base {base}: {e}") from None
        return path
    path = Path(base)
    if not (path / "config.json").is_file():
        raise ReplayError(f"--base {base} is neither s3://BUCKET/RUN/vN/ nor a Hugging Face model directory")
    return path


def check_base_matches(log: list[UpdateEntry], tokenizer, vocab_size: int, base: str) -> None:
    """The rollouts' token ids must mean the same text to the base model."""
    recorded = next((e for e in log if e.tokenizer_sha), None)
    if recorded is None:
        return
    if recorded.vocab_size is not None and recorded.vocab_size != vocab_size:
        raise ReplayError(f"--base {base} has a vocabulary of {vocab_size} tokens, the rollouts were recorded "
                          f"with {recorded.vocab_size}")
    if recorded.tokenizer_sha != tokenizer_fingerprint(tokenizer):
        raise ReplayError(f"--base {base} has a different tokenizer from the one the rollouts were recorded with")


# ----------------------------------------------------------------------------------
# 3. The plan
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayFilter:
    """Which recorded groups take part: by creation time and by the policy version that sampled them."""

    from_time: Optional[float] = None
    to_time: Optional[float] = None
    from_version: Optional[int] = None
    to_version: Optional[int] = None

    def admits(self, rollout: Rollout) -> bool:
        t, v = rollout.created_at, rollout.policy_version
        return ((self.from_time is None or t >= self.from_time) and (self.to_time is None or t <= self.to_time)
                and (self.from_version is None or v >= self.from_version)
                and (self.to_version is None or v <= self.to_version))


class ReplayPlan:
    """Turns the record into batches. Each logged group is admitted with the staleness and
    age the original learner recorded, and the replay's own rule judges it: the learner's
    `Admission`, so both judge, batch and count alike."""

    def __init__(self, cfg: HeteroConfig, record: RecordedRun, flt: ReplayFilter, vocab_size: int):
        self.cfg, self.record, self.filter, self.vocab_size = cfg, record, flt, vocab_size
        self.admission = Admission(cfg.learner)
        self.filtered_out = 0
        """Groups outside the --from/--to filters."""
        self.unreadable = 0
        """Logged groups whose message no longer decodes or fits the base model."""
        self.dropped_by_original = 0
        """With --exact-batches: groups the original run dropped (they stay out of every batch)."""
        self.leftover = 0
        """Kept groups that did not fill a last batch."""

    def _admit(self, g: UsedGroup | DroppedGroup) -> None:
        rollout = self._recorded_rollout(g)
        if rollout is None:
            self.unreadable += 1
        elif not self.filter.admits(rollout):
            self.filtered_out += 1
        else:
            self.admission.admit_group(rollout, g.partition, g.offset, g.staleness, g.age_s)

    def _recorded_rollout(self, g: UsedGroup | DroppedGroup) -> Optional[Rollout]:
        """The message the log names, if it decodes and fits the base model's vocabulary."""
        rollout = self.record.rollout(g.partition, g.offset, g.rollout_id)
        return rollout if rollout is not None and max(rollout.token_ids()) < self.vocab_size else None

    def batches(self, exact: bool) -> Iterator[list[PendingGroup]]:
        """The batches to train, one at a time."""
        if exact:
            for entry in self.record.update_log:
                self.dropped_by_original += len(entry.dropped)
                for g in entry.used:
                    self._admit(g)
                batch = self.admission.take_batch(None, last=True)  # None: the recorded ages stand
                if batch:
                    yield batch
            return
        for entry in self.record.update_log:
            for g in sorted([*entry.used, *entry.dropped], key=lambda g: (g.partition, g.offset)):
                self._admit(g)
                batch = self.admission.take_batch(None)
                if batch:
                    yield batch
        self.leftover = len(self.admission.pending)


def planned_steps(record: RecordedRun, exact: bool, groups_per_step: int, max_steps: int) -> int:
    """Upper bound of the steps the plan can make (for the progress bar)."""
    if exact:
        return min(max_steps, sum(1 for e in record.update_log if e.used))
    groups = sum(len(e.used) + len(e.dropped) for e in record.update_log)
    return min(max_steps, groups // groups_per_step)


def parse_time(text: Optional[str]) -> Optional[float]:
    """Unix seconds, or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise ReplayError(f"time {text!r}: expected Unix seconds or ISO 8601 (2026-11-22T10:00:00)") from None
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)).timestamp()


def _check_filter_keeps_data(record: RecordedRun, flt: ReplayFilter) -> None:
    """One line before any training if the filters leave no group, naming what the topic holds."""
    logged = {(g.partition, g.offset, g.rollout_id) for e in record.update_log for g in (*e.used, *e.dropped)}
    times, versions, kept = [], [], 0
    for key in logged:
        rollout = record.rollout(*key)
        if rollout is None:
            continue
        times.append(rollout.created_at)
        versions.append(rollout.policy_version)
        kept += flt.admits(rollout)
    if kept:
        return
    if not times:
        raise ReplayError(f"{record.description}: the update log names no decodable group")

    def iso(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")

    raise ReplayError(f"no recorded group matches the filters (time {flt.from_time}..{flt.to_time}, "
                      f"version {flt.from_version}..{flt.to_version}); {record.description} holds groups created "
                      f"{iso(min(times))}..{iso(max(times))} by policy versions {min(versions)}..{max(versions)}")


# ----------------------------------------------------------------------------------
# 4.-5. The run
# ----------------------------------------------------------------------------------
class CheckpointSink:
    """Replay checkpoints: local `RUN_DIR/checkpoints/vN` directories, or an S3 prefix (published
    as the learner publishes, by a publisher process, unsigned and announced nowhere)."""

    def __init__(self, cfg: HeteroConfig, run_dir: Path, target: Optional[str], model_dir: Path, module):
        """`model_dir`: the base model's directory (its files' layout); `module`: the model trained."""
        self.keep = cfg.learner.keep_checkpoints
        self.local_root = run_dir / "checkpoints"
        self.publisher = None
        if target:
            bucket, _, prefix = target[len("s3://"):].partition("/")
            if not target.startswith("s3://") or not bucket or not prefix.strip("/"):
                raise ReplayError(f"--checkpoints {target}: expected s3://BUCKET/PREFIX")
            client = connect_s3(require_services(cfg.services), timeout_s=cfg.services.connect_timeout_s)
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            self.store = CheckpointStore(client, bucket, prefix.strip("/"))
            work_dir = run_dir / ".publisher"
            work_dir.mkdir(parents=True, exist_ok=True)
            self.publisher = start_publisher(cfg, self.store, module, model_dir, work_dir, announce=False,
                                             recovery=False)

    def save(self, version: int, engine, tokenizer, work_dir: Path) -> None:
        if self.publisher is not None:
            slot = self.publisher.take_slot()
            copy_weights_into(engine.module, self.publisher.slots.views(slot), zero3=engine.zero_optimization_stage() == 3)
            self.publisher.submit_policy(slot, version, {"step": version, "replay": True},
                                         parent_version=version - 1 if version > 0 else None)
            return
        target = self.local_root / f"v{version}"
        save_weights(engine, tokenizer, target)
        saved = sorted((p for p in self.local_root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
        for old in saved[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def uri(self, version: int) -> str:
        if self.publisher is not None:
            return self.store.uri(version)
        return str((self.local_root / f"v{version}").resolve())

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            shutil.rmtree(self.publisher.target.work_dir, ignore_errors=True)


class Replay:
    """One replay: `run()` is the loop; bookkeeping is the learner's (`Admission`, `StepRecorder`)."""

    def __init__(self, cfg: HeteroConfig, source: str, base: str, out_dir: Path, *, exact_batches: bool = False,
                 flt: ReplayFilter = ReplayFilter(), checkpoints: Optional[str] = None, progress: bool = True,
                 chosen: frozenset[str] = frozenset()):
        """`chosen`: the config keys the user set for this replay (`--set`): kept even where the
        recorded run's numerics differ (`adopt_numerics`)."""
        self.log = setup_logging("replay")
        self.chosen, self.numerics_taken, self.numerics_differ = chosen, [], []
        self.cfg, self.lcfg = cfg, cfg.learner
        self.source, self.base, self.out_dir = source, base, Path(out_dir)
        self.exact_batches, self.filter, self.checkpoints, self.progress = exact_batches, flt, checkpoints, progress
        self.work_dir = self.out_dir / ".replay"
        self.version = 0
        self.evals: list[dict] = []

    def run(self) -> dict:
        """Train on the record; returns the summary (also written to OUT/summary.json)."""
        started = time.monotonic()
        self.prepare()
        bar = tqdm(total=planned_steps(self.record, self.exact_batches, self.lcfg.groups_per_step,
                                       self.lcfg.max_steps),
                   desc="replay", unit="step", disable=None if self.progress else True)  # None: TTY only
        try:
            self.evaluate_if_due()
            for batch in self.plan.batches(self.exact_batches):
                if self.version >= self.lcfg.max_steps:
                    break
                step_metrics = self.train(batch)
                bar.update(1)
                bar.set_postfix(loss=f"{step_metrics['loss']:.3f}", reward=f"{step_metrics['reward_mean']:.2f}")
            if self.version == 0:
                raise ReplayError(f"no batch could be formed from {self.record.description} with these filters "
                                  "and staleness rules")
            self.finish()
        finally:
            bar.close()
            self.metrics.close()
            if getattr(self, "sink", None) is not None and self.sink.publisher is not None \
                    and not self.sink.publisher.closed:  # an error path: the publisher process ends too
                try:
                    self.sink.publisher.close(timeout_s=30)
                except RuntimeError as e:  # the original error matters more
                    self.log.error("%s", e)
            shutil.rmtree(self.work_dir, ignore_errors=True)
        summary = self.summary(time.monotonic() - started)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.log.info("done: %d steps, final checkpoint %s", self.version, summary["final_checkpoint"])
        return summary

    def prepare(self) -> None:
        """The record, the base model (checked against it), the engine, the plan and the outputs."""
        self.record = load_record(self.source, trusted_learner(self.cfg))
        if self.record.refused_update_records:
            self.log.warning("update log %s: records not signed by the original learner's key, not used: %s",
                             updates_topic(self.record.topic), self.record.refused_update_records)
        _check_filter_keeps_data(self.record, self.filter)
        if (self.out_dir / "metrics.jsonl").exists():
            raise ReplayError(f"--out {self.out_dir} already holds a run (metrics.jsonl): choose a new directory")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.numerics = learner_numerics(self.cfg, resolve_device(self.cfg.model.device))
        self.take_recorded_numerics()
        base_dir = fetch_base(self.cfg, self.base, self.work_dir / "base")
        torch.set_num_threads(self.lcfg.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        # DeepSpeed moves it to model.device and casts it to the learner's precision, whose kernel it runs
        model, self.tokenizer = load_policy(base_dir, attention=learner_attention(self.cfg))
        vocab_size = model.get_input_embeddings().num_embeddings
        check_base_matches(self.record.update_log, self.tokenizer, vocab_size, self.base)
        (self.out_dir / "config.yaml").write_text(dump_config(self.cfg))
        self.engine = make_deepspeed_engine(model, self.lcfg, resolve_device(self.cfg.model.device))
        self.sink = CheckpointSink(self.cfg, self.out_dir, self.checkpoints, base_dir, self.engine.module)
        self.plan = ReplayPlan(self.cfg, self.record, self.filter, vocab_size)
        self.metrics = MetricsWriter(self.out_dir)
        self.recorder = StepRecorder(self.out_dir, self.metrics, self.plan.admission, loss_type=self.lcfg.loss_type,
                                     topic=self.record.topic, vocab_size=vocab_size,
                                     tokenizer_sha=tokenizer_fingerprint(self.tokenizer),
                                     numerics=self.numerics)
        self.task = make_task_from_config(self.cfg) if self.cfg.eval.every else None
        self.log.info("replaying %s from %s with loss %s, %s batches, on %s", self.record.description, self.base,
                      self.lcfg.loss_type, "the original" if self.exact_batches
                      else f"{self.lcfg.groups_per_step}-group", self.engine.device)

    def take_recorded_numerics(self) -> None:
        """The recorded run's numerics (its update log's), in place of this config's where the
        user did not set them; each setting taken, and what still differs, said before the replay
        starts: a replay that differs will not end at the original's bits."""
        recorded = [e.numerics for e in self.record.update_log if e.numerics]
        if not recorded:
            self.log.warning("the update log records no numerics (a learner before they were recorded): "
                             "this replay's precision, threads and kernels are its config's, unchecked")
            return
        self.cfg, self.numerics_taken, self.numerics_differ = adopt_numerics(
            self.cfg, recorded[-1], self.numerics, self.chosen)
        self.lcfg = self.cfg.learner
        self.numerics = learner_numerics(self.cfg, resolve_device(self.cfg.model.device))
        if any(n != recorded[-1] for n in recorded):
            self.numerics_differ.append("the recorded steps themselves ran with different numerics (a learner "
                                        "restarted elsewhere): the replay takes its last steps'")
        if self.numerics_taken:
            self.log.info("taking the recorded run's numerics: %s", ", ".join(self.numerics_taken))
        if self.numerics_differ:
            self.log.warning("this replay will not reproduce the original's bits: %s", "; ".join(self.numerics_differ))

    def train(self, batch: list[PendingGroup]) -> dict:
        """The learner's step on one planned batch, logged; a checkpoint and an evaluation when due."""
        step_metrics = optimizer_step(self.engine, [g.rollout for g in batch], [g.decision.weight for g in batch],
                                      self.lcfg, temperature=self.cfg.sampler.temperature,
                                      max_completion_length=self.cfg.sampler.max_new_tokens,
                                      on_policy_version=self.version)
        self.version += 1
        self.recorder.record(self.version, batch, step_metrics)
        if self.version % self.lcfg.sync_every == 0:
            self.sink.save(self.version, self.engine, self.tokenizer, self.work_dir)
        self.evaluate_if_due()
        return step_metrics

    def evaluate_if_due(self) -> None:
        """With eval.every: held-out accuracy at v0 and every k steps."""
        if self.task is not None and self.version % self.cfg.eval.every == 0:
            self.evaluate()

    def evaluate(self) -> None:
        """Held-out accuracy of the weights being trained, recorded like a training run's."""
        result = evaluate_model(self.cfg, self.engine.module, self.tokenizer, self.task)
        self.engine.module.train()
        self.metrics.write("eval", self.version, {"policy_version": self.version, **result})
        self.evals.append({"policy_version": self.version, **result})

    def finish(self) -> None:
        """The final checkpoint and evaluation, unless the last step made them already."""
        if self.version % self.lcfg.sync_every:
            self.sink.save(self.version, self.engine, self.tokenizer, self.work_dir)
        if self.task is not None and self.evals[-1]["policy_version"] != self.version:
            self.evaluate()
        self.sink.close()

    def summary(self, wall_seconds: float) -> dict:
        plan, counts = self.plan, self.plan.admission.counters
        used = counts.staleness_used
        summary = {
            "run": self.out_dir.name, "kind": "replay", "source": self.source, "base": self.base,
            "loss_type": self.lcfg.loss_type, "exact_batches": self.exact_batches,
            "filters": {k: v for k, v in vars(self.filter).items() if v is not None},
            "final_policy_version": self.version, "final_checkpoint": self.sink.uri(self.version),
            "groups_used": counts.staleness.kept,
            # with --exact-batches the original's drops stay dropped: they count here too
            "groups_dropped": counts.staleness.dropped + plan.dropped_by_original,
            "groups_reweighted": counts.staleness.reweighted, "dropped_by_original": plan.dropped_by_original,
            "filtered_out": plan.filtered_out, "unreadable": plan.unreadable, "leftover": plan.leftover,
            "mean_staleness_used": sum(used) / len(used), "max_staleness_used": max(used),
            "wall_seconds": wall_seconds,
            "numerics": self.numerics,
            "numerics_taken": self.numerics_taken, "numerics_differ": self.numerics_differ,
        }
        if self.evals:
            first, last = self.evals[0], self.evals[-1]
            summary.update(eval_accuracy_before=first["accuracy_sampled"],
                           eval_accuracy_after=last["accuracy_sampled"],
                           eval_best_accuracy=max(e["accuracy_sampled"] for e in self.evals),
                           eval_last_accuracy=last["accuracy_sampled"],
                           eval_greedy_before=first.get("accuracy_greedy"),
                           eval_greedy_after=last.get("accuracy_greedy"))
        return summary


def run_replay(cfg: HeteroConfig, source: str, base: str, out_dir: Path, *, exact_batches: bool = False,
               flt: ReplayFilter = ReplayFilter(), checkpoints: Optional[str] = None,
               progress: bool = True, chosen: frozenset[str] = frozenset()) -> dict:
    cfg, line = with_machine_precision(cfg, resolve_device(cfg.model.device))
    setup_logging("replay").info("%s", line)
    return Replay(cfg, source, base, out_dir, exact_batches=exact_batches, flt=flt, checkpoints=checkpoints,
                  progress=progress, chosen=chosen).run()
