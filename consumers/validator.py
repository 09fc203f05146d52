"""Validator: check samplers' groups beside the learner and publish signed verdicts.

Run: `heterorl validator --config demo [--id ID]` (any number, on any machine that reaches
the three servers; start or stop them at any time). Its key must be registered with the role
`validator` (`heterorl keys add ID --role validator`). The learner uses the verdicts when
`validators.enabled` is on (docs/security.md, "Validators").

`Validator.run` repeats `Validator.turn`, which reads top to bottom:
  1. heartbeat: renew this validator's lease in Redis;
  2. hold its share of the rollout topic's partitions (`PartitionShare`: the partitions divided
     among the live validators): leases in Redis it renews, taken from where the verdicts of
     their last holder end (`validator_offsets`), so a killed validator's partitions pass to
     the others within `validators.lease_s` and no group is left without a verdict;
  3. read the next groups of those partitions and judge each one with the learner's own checks:
     the seal (`pipeline.trust.RolloutVerifier` against the root-signed key registry), the
     prompt and every reward re-scored with the task's verifier, and the log-probs re-scored
     with the version the group claims, fetched and verified through the weight path
     (`consumers.screening`: probation, the secret draw of stale groups, the thresholds);
  4. publish one verdict per group (`pipeline.trust.verdicts`), signed with its key, to
     `<topic>.verdicts` (retried through a broker error for up to `validators.network_retry_s`);
     once the broker acknowledged them, record in Redis where each partition's verdicts end.

A message whose seal does not hold gets no verdict: the learner checks seals itself and
dead-letters it. Groups are judged at least once (a new holder may judge again the last
groups of a killed one); the learner uses the first valid verdict on each group.
"""

from __future__ import annotations

import math
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import redis
import torch

from consumers.screening import GroupScreen
from pipeline.weights.follower import PastPolicies
from pipeline.weights.store import CheckpointNotFound, CorruptCheckpointError, MalformedPointer, PolicyPointer
from pipeline.config import HeteroConfig
from pipeline.clients.topics import RawRecord, TopicWriter, TopicReader, ensure_topic
from pipeline.trust.keyring import (RegistryFollower, key_paths, load_learner_public, load_root_public,
                                    load_validator_key)
from pipeline.models import load_policy
from pipeline.wire.rollout import Rollout, RolloutDecodeError
from pipeline.runtime import (connect_run, make_task_from_config, resolve_base_model, setup_logging,
                              touch_heartbeat_file)
from pipeline.trust import Rejected, RolloutVerifier, trusted_sampler
from pipeline.trust.verdicts import GroupVerdict, group_digest, seal_verdict, verdicts_topic


@dataclass(frozen=True)
class PartitionShare:
    """Which partitions a validator should hold, decided from who holds what. No I/O."""

    partitions: tuple[int, ...]
    me: str

    def plan(self, holders: dict[int, Optional[str]], live_validators: int) -> tuple[list[int], list[int]]:
        """(partitions to take, partitions to let go): each validator holds at most its fair
        share, ceil(partitions / live validators); it takes free ones up to it and lets go of
        those above it (the highest first), so a newcomer finds some free soon."""
        share = math.ceil(len(self.partitions) / max(1, live_validators))
        mine = [p for p in self.partitions if holders.get(p) == self.me]
        free = [p for p in self.partitions if holders.get(p) is None]
        if len(mine) > share:
            return [], mine[share:]
        return free[:share - len(mine)], []


class Validator:
    """One validator process: `run()` repeats `turn()`, whose steps are the methods below."""

    def __init__(self, cfg: HeteroConfig, validator_id: str):
        self.cfg, self.vcfg, self.validator_id = cfg, cfg.validators, validator_id
        self.log = setup_logging(f"validator {validator_id}")
        self.stopping = False
        self.held: dict[int, int] = {}
        """Partition held -> the next offset whose verdict is not yet acknowledged."""
        self.counts: Counter = Counter()
        self.refused_pointer: Optional[str] = None
        """Why the policy pointer was last refused (said once per reason, counted in `refused_pointers`)."""
        self.started = time.time()
        self.last_heartbeat = -math.inf
        self.check_s = 0.0
        """Seconds spent judging groups (the rest: waiting for groups, I/O)."""

    def run(self) -> int:
        """Judge groups until stopped (SIGTERM/SIGINT)."""
        self.start()
        try:
            while not self.stopping:
                try:
                    self.turn()
                except redis.RedisError as e:
                    self.log.warning("Redis unreachable (%s); retrying in 1s", type(e).__name__)
                    time.sleep(1.0)
        finally:
            self.close()
        return 0

    def turn(self) -> None:
        touch_heartbeat_file()
        self.heartbeat_if_due()
        self.hold_partitions()
        if not self.held:
            time.sleep(self.vcfg.poll_timeout_s)
            return
        records = self.source.poll(self.vcfg.poll_timeout_s)
        if records:
            self.judge(records)

    # ---- start ------------------------------------------------------------------------
    def start(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        torch.set_num_threads(self.vcfg.torch_threads)
        self.key = load_validator_key(key_paths(self.cfg), self.validator_id, self.vcfg.validator_key)
        self.next_seq = time.time_ns() // 1000  # increasing across restarts of this key, too
        self.handles = connect_run(self.cfg)
        self.state = self.handles.state
        bootstrap, security = self.handles.services.kafka_bootstrap, self.handles.services.security
        topic = self.cfg.run.topic
        for name, partitions in ((topic, self.cfg.run.topic_partitions), (verdicts_topic(topic), 1)):
            # idempotent: a validator may start before the learner has made the run's topics
            ensure_topic(bootstrap, name, partitions, retention_ms=self.cfg.run.topic_retention_ms, security=security)
        self.source = TopicReader(bootstrap, topic, security=security)
        self.source.assign({})
        self.share = PartitionShare(tuple(self.source.all_partitions), self.validator_id)
        self.sink = TopicWriter(bootstrap, verdicts_topic(topic), security=security)
        paths = key_paths(self.cfg)
        self.registry_follower = RegistryFollower(self.state.client, self.cfg.run.name, load_root_public(paths),
                                                  self.cfg.security.registry_refresh_s, self.log,
                                                  load_learner_public(paths) if paths.learner_public.exists() else None)
        self.verifier = RolloutVerifier(self.cfg.run.name, None, self.cfg.security.require_signatures)
        self.refresh_registry()
        self.learner_version = 0
        """The newest version the learner is known to have published (monotonic, each one's signed
        manifest verified: a pointer rolled back or forged in Redis moves nothing)."""
        self.published: set[int] = set()
        self.screen = self.make_screen()
        self.screen.checked_versions = {}
        self.log.info("validator %s started: key %s, topic %s (%d partitions), verdicts to %s", self.validator_id,
                      self.key.key_id, topic, len(self.share.partitions), verdicts_topic(topic))

    def make_screen(self) -> GroupScreen:
        """The learner's checks, with the base model's tokenizer and the published versions (the
        one a group claims, fetched and verified through the weight path, loaded on one scratch
        model: `PastPolicies`)."""
        model_dir = resolve_base_model(self.cfg)
        _, tokenizer = load_policy(model_dir)
        self.work_dir = Path(tempfile.mkdtemp(prefix=f".validator-{self.validator_id}-",
                                              dir=self.cfg.services.data_dir))
        # the versions it downloads are kept (those within the learner's reach), so each is
        # downloaded once, and one altered in S3 after it took it is still checked
        self.past = PastPolicies(self.handles.store, self.work_dir, model_dir, attention=self.cfg.model.attention,
                                 keep_downloads=True,
                                 **PastPolicies.budget(self.cfg.security, self.cfg.learner.reach_versions))
        return GroupScreen(self.cfg.security, make_task_from_config(self.cfg), tokenizer,
                           self.cfg.sampler.temperature, lambda: self.past.get(self.learner_version), self.past,
                           trusted=lambda r: trusted_sampler(self.verifier.registry, r.key_id,
                                                             self.cfg.security.trust_local_samplers))

    def _stop(self, *_) -> None:
        self.stopping = True

    def heartbeat_if_due(self) -> None:
        if time.monotonic() - self.last_heartbeat < self.vcfg.lease_s / 3:
            return
        self.last_heartbeat = time.monotonic()
        self.state.renew_validator_lease(self.validator_id, {"key_id": self.key.key_id, "groups": self.counts["judged"],
                                                              "judging_s": round(self.check_s, 3),
                                                              "started_at": self.started}, self.vcfg.lease_s)
        self.refresh_registry()

    def refresh_registry(self, force: bool = False) -> None:
        registry = self.registry_follower.refresh(force)
        if registry is not None:
            self.verifier.registry = registry

    # ---- partitions -------------------------------------------------------------------
    def hold_partitions(self) -> None:
        """Renew the leases held, take free partitions up to this validator's share, let go of
        any above it; re-read the topic from where each new partition's verdicts end."""
        lost = [p for p in self.held if not self.state.hold_partition(p, self.validator_id, self.vcfg.lease_s)]
        for p in lost:  # it ran out (a long pause): another holder judges from where it ended
            self.log.warning("lost the lease of partition %d; its next holder goes on from there", p)
            del self.held[p]
        take, let_go = self.share.plan(self.state.partition_holders(list(self.share.partitions)),
                                       len(self.state.live_validators()))
        for p in let_go:
            self.state.let_go_partition(p, self.validator_id)
            del self.held[p]
        taken = [p for p in take if self.state.hold_partition(p, self.validator_id, self.vcfg.lease_s)]
        if taken or lost or let_go:
            ends = self.state.validator_offsets()
            for p in taken:
                self.held[p] = ends.get(p, 0)
            self.source.assign(dict(self.held))
            self.log.info("holding partition(s) %s of %s (took %s, let go of %s, lost %s)", sorted(self.held),
                          self.cfg.run.topic, taken, let_go, lost)

    # ---- judge ------------------------------------------------------------------------
    def judge(self, records: list[RawRecord]) -> None:
        """One verdict per group read (none for a message whose seal fails), sent and
        acknowledged, then each partition's progress recorded."""
        started = time.monotonic()
        version, manifest_key = self.pointer_hint()
        if version is not None and manifest_key:
            self.is_published(version, manifest_key)
        verdicts: list[GroupVerdict] = []
        judged: list[tuple[RawRecord, Rollout]] = []
        for record in records:
            if record.partition not in self.held:
                continue  # let go of since the poll
            rollout = self.open(record)
            if rollout is None:
                continue
            if not self.is_published(rollout.policy_version):
                verdicts.append(self.verdict(record, rollout, (
                    "unverifiable", f"v{rollout.policy_version} is not a published version")))
                continue
            try:
                failures = self.screen.check(rollout, self.staleness(rollout))
            except Exception as e:  # noqa: BLE001 - a group the checks cannot read must not stop the validator
                failures = [self.unreadable(rollout, e)]
            if failures:
                verdicts.append(self.verdict(record, rollout, failures[0]))
            else:
                judged.append((record, rollout))
        for record, rollout, failure in self.check_logprobs(judged):
            verdicts.append(self.verdict(record, rollout, failure))
        self.check_s += time.monotonic() - started
        sealed = [seal_verdict(v, self.key) for v in verdicts]
        self.sink.retrying(lambda: self.sink.send_raw_many(sealed), self.vcfg.network_retry_s, self.log)
        self.counts["judged"] += len(verdicts)
        self.counts["failed"] += sum(not v.passed for v in verdicts)
        for record in records:
            if record.partition in self.held:
                self.held[record.partition] = record.offset + 1
        for p, offset in self.held.items():
            self.state.record_validator_offset(p, offset, self.validator_id)

    def staleness(self, rollout: Rollout) -> int:
        return max(0, self.learner_version - rollout.policy_version)

    def check_logprobs(self, judged: list[tuple[RawRecord, Rollout]]):
        """(record, group, its failure or None) for each group, the planned log-prob checks done in
        batched passes; if a batch cannot be checked (a group the model cannot read), group by group."""
        try:
            failures, _ = self.screen.check_batch([(r, self.staleness(r)) for _, r in judged], fresh_in_step=False)
            return [(record, r, (failures.get(r.rollout_id) or [None])[0]) for record, r in judged]
        except Exception:  # noqa: BLE001 - find the group that breaks the batch
            if len(judged) == 1:
                raise
        out = []
        for record, rollout in judged:
            try:
                out += self.check_logprobs([(record, rollout)])
            except Exception as e:  # noqa: BLE001
                out.append((record, rollout, self.unreadable(rollout, e)))
        return out

    def unreadable(self, rollout: Rollout, error: Exception) -> tuple[str, str]:
        """A failing verdict that strikes nobody: the checks could not read the group (the learner
        refuses such a group as malformed itself, so the verdict is only for the record)."""
        self.counts["unreadable"] += 1
        self.log.warning("group %s of %s cannot be checked (%s: %s)", rollout.rollout_id, rollout.sampler_id,
                         type(error).__name__, error)
        return ("unverifiable", f"the checks cannot read it ({type(error).__name__})")

    def open(self, record: RawRecord) -> Optional[Rollout]:
        """The group, if its seal holds and it is not from the future; else None (no verdict)."""
        try:
            try:
                rollout = self.verifier.check(record.value, time.time())
            except Rejected as e:
                if e.code not in ("unknown_key", "expired_key", "revoked_key"):
                    raise
                self.refresh_registry(force=True)  # a key added (or renewed) since the last read
                rollout = self.verifier.check(record.value, time.time())
        except (Rejected, RolloutDecodeError) as e:
            self.counts[f"no_verdict:{getattr(e, 'code', 'malformed')}"] += 1
            return None
        return rollout

    def pointer_hint(self) -> tuple[Optional[int], Optional[str]]:
        """The version and manifest the policy pointer names: a hint of what is published (each
        version is still read from its signed manifest). A pointer that is no pointer is no hint:
        said once per reason, counted in `refused_pointers`, and judging goes on."""
        try:
            pointer = PolicyPointer(self.state).read()
        except MalformedPointer as e:
            if str(e) != self.refused_pointer:
                self.refused_pointer = str(e)
                self.counts["refused_pointers"] += 1
                self.log.warning("ignoring the policy pointer: %s", e)
            return None, None
        return (None, None) if pointer is None else (pointer.version, pointer.manifest_key)

    def is_published(self, version: int, manifest_key: Optional[str] = None) -> bool:
        """Whether the learner published `version` (its manifest reads and carries the learner's
        signature); the known newest version rises with it. A group may claim a version the policy
        pointer does not show yet: the pointer is written a moment after the manifest."""
        if version in self.published:
            return True
        try:
            manifest = self.handles.store.read_manifest(manifest_key or self.handles.store.manifest_key(version))
        except (CheckpointNotFound, CorruptCheckpointError):
            return False
        if manifest.version != version:
            return False
        self.published.add(version)
        self.learner_version = max(self.learner_version, version)
        return True

    def verdict(self, record: RawRecord, rollout: Rollout, failure: Optional[tuple[str, str]]) -> GroupVerdict:
        version = self.screen.checked_versions.pop(rollout.rollout_id, None)
        checks = (("rewards",) if self.cfg.security.rescore_rewards else ()) + (("logprobs",) if version is not None
                                                                                else ())
        self.next_seq += 1
        return GroupVerdict(run=self.cfg.run.name, rollout_id=rollout.rollout_id, partition=record.partition,
                            offset=record.offset, group_digest=group_digest(record.value),
                            sampler_id=rollout.sampler_id, key_id=rollout.key_id, passed=failure is None,
                            failure=failure[0] if failure else "", detail=failure[1] if failure else "",
                            checks=checks, version_used=version, validator_id=self.validator_id,
                            validator_key_id=self.key.key_id, seq=self.next_seq)

    # ---- stop -------------------------------------------------------------------------
    def close(self) -> None:
        """Leases let go (the others take the partitions at once), lease released, totals logged."""
        try:
            for p in list(self.held):
                self.state.let_go_partition(p, self.validator_id)
            self.state.record_validator_stats(self.validator_id, {**self.counts, "judging_s": round(self.check_s, 1),
                                                                  "checks": self.screen.summary()})
            self.state.release_validator_lease(self.validator_id)
        except redis.RedisError as e:
            self.log.warning("could not let go of the leases in Redis (%s): they run out in %.0fs",
                             type(e).__name__, self.vcfg.lease_s)
        self.sink.close()
        self.source.close()
        if getattr(self, "work_dir", None) is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        self.log.info("validator %s stopped after %d verdicts (%s; checks: %s), %.1fs judging", self.validator_id,
                      self.counts["judged"], ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())),
                      ", ".join(f"{k} {v}" for k, v in sorted(self.screen.counts.items())), self.check_s)


def run_validator(cfg: HeteroConfig, validator_id: str) -> int:
    return Validator(cfg, validator_id).run()
