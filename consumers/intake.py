"""The learner's intake: everything between a Kafka message and a batch it may train on.

One object, `Intake`, behind two calls the learner makes: `offer(record, version)` for each
message of the rollout topic (and `offer_verdict` for each of the verdicts topic, with
validators), and `next_batch(version)` once per message, which hands out a batch when one is
full and checked. Behind them, in the order a message meets them:

  1. the seal (`pipeline.trust.RolloutVerifier` against the root-signed key registry, re-read
     every `security.registry_refresh_s`): a forged or unsigned message is dead-lettered to
     `<run>.dead` with its reason; what a valid signature vouches for and is wrong strikes
     its key (`pipeline.trust.StrikePolicy`), and a quarantined key's groups are refused;
  2. admission (`pipeline.learning.admission`): a poison message is dead-lettered, a second
     copy of a rollout id ignored, staleness τ = learner version − rollout version decides
     drop or keep, every verdict counted;
  3. the content checks (`consumers.screening.GroupScreen`): rewards re-scored as each group
     comes, log-probs as the screen plans (none for the run's own samplers; probation, every
     fresh group and the drawn versions' stale groups for any other key), the stale ones when
     the batch is full, the fresh ones by the step itself (`FreshCheck`). A group that fails is
     withdrawn and its key struck, and the batch fills again;
  4. with validators (`validators.enabled`), the checks are theirs: a kept group waits for a
     signed verdict (`pipeline.trust.verdicts`), which lets it into the batch or refuses it.

The learner does the I/O of the loop (polling, training, publishing); the intake's own is
the dead-letter topic and recording quarantines in Redis.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from consumers.screening import UNVERIFIABLE, GroupScreen
from pipeline.weights.follower import PastPolicies
from pipeline.config import HeteroConfig
from pipeline.learning.admission import Admission, Admitted, PendingGroup, Verdicts
from pipeline.learning.update import FreshCheck, StepRefused
from pipeline.models import DTYPES
from pipeline.records.metrics import StageClock
from pipeline.runtime import make_task_from_config
from pipeline.clients.topics import RawRecord
from pipeline.trust import Quarantine, Rejected, RolloutVerifier, StrikePolicy, trusted_sampler
from pipeline.trust.keyring import JoinDesk, RegistryFollower, load_learner_key, load_root_public
from pipeline.trust.verdicts import GroupVerdict, VerdictVerifier, group_digest
from pipeline.wire.rollout import Rollout, RolloutDecodeError

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """A full batch whose checks have passed, but for those its step makes (`fresh_check`)."""

    groups: list[PendingGroup]
    fresh_check: Optional[FreshCheck]

    @property
    def rollouts(self) -> list[Rollout]:
        return [g.rollout for g in self.groups]

    @property
    def weights(self) -> list[float]:
        return [g.decision.weight for g in self.groups]


class Intake:
    """Seal, admission, checks and verdicts for one learner (docstring of the module)."""

    @classmethod
    def open(cls, cfg: HeteroConfig, admission: Admission, *, state, store, keys, tokenizer,
             policy: Callable[[], Optional[torch.nn.Module]], model_dir: Path, work_dir: Path, device,
             reach: int, clock: StageClock, dead_letter: Callable[[RawRecord, str], None], fresh_in_step: bool,
             screen: Optional[GroupScreen] = None, admits_joins: bool = True) -> "Intake":
        """A learner's intake: the key registry it follows (`state`, the run's Redis; `keys`, its
        key files), its checks (`screen`, else the task's verifier and `PastPolicies` of `store`,
        on `device` in the learner's precision, keeping the `reach` newest versions where it
        re-scores stale groups itself; `policy`: its weights now, None where not whole on this rank;
        `admits_joins`: this process decides volunteers' join requests, the leader's rank)."""
        sec = cfg.security
        # Without required signatures, signed rollouts are still checked if the root key is there.
        root = load_root_public(keys) if sec.require_signatures or keys.root_public.exists() else None
        learner_key = load_learner_key(keys) if root is not None and keys.learner_key.exists() else None
        registry = None if root is None else RegistryFollower(state.client, cfg.run.name, root,
                                                              sec.registry_refresh_s, log,
                                                              None if learner_key is None else learner_key.public)
        rescores = sec.check_logprobs and not cfg.validators.enabled
        budget = PastPolicies.budget(sec, reach) | ({} if rescores else {"keep_last": 0})
        past = PastPolicies(store, work_dir, model_dir, dtype=DTYPES[cfg.learner.precision], device=device,
                            attention=cfg.model.attention, **budget)
        screen = screen or GroupScreen(sec, make_task_from_config(cfg), tokenizer, cfg.sampler.temperature, policy,
                                       past)
        intake = cls(cfg, admission, screen, state=state, registry=registry, dead_letter=dead_letter, clock=clock,
                     fresh_in_step=fresh_in_step)
        if learner_key is not None and admits_joins:  # volunteers' join requests (heterorl join)
            intake.desk = JoinDesk(state.client, cfg.run.name, root, learner_key, sec.key_lifetime_days, log)
        screen.trusted, intake.past = intake.trusted, past
        return intake

    def __init__(self, cfg: HeteroConfig, admission: Admission, screen: GroupScreen, *, state,
                 registry: Optional[RegistryFollower], dead_letter: Callable[[RawRecord, str], None],
                 clock: StageClock, fresh_in_step: bool):
        """`state`: the run's Redis (quarantines are recorded there); `registry`: the signed key
        registry (None: no root key, signed messages are refused); `dead_letter(record, reason)`:
        sets a message aside; `clock`: where `intake` and `screen` seconds go; `fresh_in_step`:
        the step checks fresh groups itself (else they are re-scored with the current weights)."""
        self.cfg, self.admission, self.screen, self.state = cfg, admission, screen, state
        self.registry, self.dead_letter, self.clock, self.fresh_in_step = registry, dead_letter, clock, fresh_in_step
        sec = cfg.security
        self.validated = cfg.validators.enabled
        self.verifier = RolloutVerifier(cfg.run.name, None, sec.require_signatures)
        self.strikes = StrikePolicy(sec.strikes_to_quarantine, [
            Quarantine(k, str(q.get("sampler_id", "")), str(q.get("reason", "")),
                       float(q["at"]) if isinstance(q.get("at"), (int, float)) else 0.0, list(q.get("strikes") or []))
            for k, q in state.quarantines().items()])
        self.by_key = {name: Counter() for name in ("groups", "fresh", "judged", "fresh_judged")}
        """Per key: signed messages read, those of staleness 0 (a quarantine records how many it
        took); with validators, groups whose verdict was applied, and those of staleness 0 when read."""
        self.judged_by: Counter = Counter()
        """Per sampler id (as the group's seal names it), groups judged and not yet reported (`report_judged`): the
        fleet's pacing counts each sampler's groups sent against these (`RunState.count_judged`)."""
        self.verdict_verifier = VerdictVerifier(cfg.run.name, None) if self.validated else None
        self.verdicts: dict[str, dict[str, GroupVerdict]] = {}
        """Valid verdicts whose group has not been decided yet: rollout id -> SHA-256 of the message
        they judged -> the first such verdict (a verbatim copy of a group, elsewhere in the topic,
        is the same bytes: its verdict holds for the original too)."""
        self.awaiting_at: dict[str, str] = {}
        """Rollout id of each group waiting for its verdict -> SHA-256 of its message."""
        self.verdict_counts: Counter = Counter()
        self.desk: Optional[JoinDesk] = None
        """Admits volunteers (`heterorl join`) under the run's invites; None: not this process."""
        self.version = 0
        self.past: Optional[PastPolicies] = None
        """The versions stale groups are re-scored with (`keep` the ones the learner publishes)."""
        self.read_to: dict[int, int] = {}
        """Per partition of the rollout topic, the next offset: every message before it was offered
        (the learner sets where it starts reading)."""
        self.refresh_registry()

    # ---- trust ------------------------------------------------------------------------
    def trusted(self, rollout: Rollout) -> bool:
        """A group of one of the run's own samplers (`security.trust_local_samplers`)."""
        return trusted_sampler(self.verifier.registry, rollout.key_id, self.cfg.security.trust_local_samplers)

    def all_trusted(self) -> bool:
        """Whether no group can come from an untrusted sampler now: signatures required, local
        samplers trusted, and every active sampler key in the registry the run's own."""
        registry, sec = self.verifier.registry, self.cfg.security
        if not (sec.require_signatures and sec.trust_local_samplers and registry is not None):
            return False
        return all(registry.is_local(k) for k, e in registry.keys.items()
                   if e.role == "sampler" and e.status == "active")

    def keep(self, version: int, tensors: Callable[[], dict]) -> None:
        """Keep a version the learner publishes for the checks of stale groups claiming it, where
        some sampler key is not the run's own (`tensors()`: its weights, as samplers get them,
        copied once more by `PastPolicies.keep` within its memory budget). While every key is the
        run's own, nothing is kept, and what was kept before (and the re-scoring model) is freed."""
        if self.past is None:
            return
        if self.all_trusted():
            self.past.release()
        elif self.past.keep_last:
            self.past.keep(version, tensors())

    def refresh_registry(self) -> None:
        """Re-read the signed key registry every `security.registry_refresh_s`: a revoked key's
        groups waiting in the batch are dropped, its later messages rejected."""
        if self.registry is None:
            return
        old = self.verifier.registry
        joined = self.desk is not None and self.registry.due() and self.desk.serve(old, set(self.strikes.quarantined))
        registry = self.registry.refresh(force=joined)
        if registry is None:
            return
        self.verifier.registry = registry
        if self.verdict_verifier is not None:
            self.verdict_verifier.registry = registry
        revoked = {k for k, e in registry.keys.items() if e.status == "revoked"}
        if old is not None and revoked - {k for k, e in old.keys.items() if e.status == "revoked"}:
            n = self.admission.withdraw(lambda g: g.rollout.key_id not in revoked, lambda g: "revoked_key")
            log.warning("key(s) %s revoked: %d of their groups dropped from the batch", ", ".join(sorted(revoked)), n)

    # ---- a message of the rollout topic ---------------------------------------------------
    def offer(self, record: RawRecord, version: int, topic: str) -> None:
        """Check the seal, then admit; a kept group's content is checked before it may be used."""
        self.version = version
        self.read_to[record.partition] = record.offset + 1
        self.refresh_registry()
        now, where = time.time(), f"{topic}[{record.partition}]@{record.offset}"
        try:
            with self.clock.stage("intake"):
                rollout = self.verifier.check(record.value, now)
        except RolloutDecodeError:
            admitted = self.admission.admit_message(record.partition, record.offset, record.value, version, now)
        except Rejected as e:
            self.admission.reject(record.partition, record.offset, e.code, e.reason)
            if e.sampler_id:  # judged, by the id it names (a forged one can only undercount that id's backlog)
                self.judged_by[e.sampler_id] += 1
            if e.attributable:
                self.strike(e.key_id, e.sampler_id, e.code, e.reason)
            self.dead_letter(record, f"rejected: {e.reason}")
            return
        else:
            admitted = self.admit_signed(rollout, record, now)
        if admitted.verdict == "malformed":
            self.dead_letter(record, admitted.reason)
        elif admitted.verdict == "duplicate":
            log.warning("ignoring a second copy of rollout %s at %s", admitted.rollout.rollout_id, where)

    def admit_signed(self, rollout: Rollout, record: RawRecord, now: float) -> Admitted:
        """Admission of a group whose seal holds (or that needs none), then its content checks."""
        key_id, version = rollout.key_id, self.version
        self.by_key["groups"][key_id] += 1
        self.judged_by[rollout.sampler_id] += 1
        self.by_key["fresh"][key_id] += rollout.policy_version == version
        if self.strikes.is_quarantined(key_id):
            return self.admission.refuse(rollout, record.partition, record.offset, version, "quarantined")
        if rollout.policy_version > version:
            self.strike(key_id, rollout.sampler_id, "future_version",
                        f"claims policy v{rollout.policy_version}, the learner is at v{version}")
        admitted = self.admission.admit_rollout(rollout, record.partition, record.offset, version, now,
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
                failures = self.screen.check(rollout, version - rollout.policy_version, fresh_in_step=self.fresh_in_step)
            self.refuse_failed(rollout, failures)
        return admitted

    def refuse_failed(self, rollout: Rollout, failures: list[tuple[str, str]]) -> None:
        """Withdraw a group that failed a check and strike its key (not for an unverifiable one)."""
        if not failures:
            return
        self.admission.withdraw(lambda g: g.rollout.rollout_id != rollout.rollout_id,
                                lambda g: f"failed_check:{failures[0][0]}")
        for kind, detail in failures:
            if kind != UNVERIFIABLE:
                self.strike(rollout.key_id, rollout.sampler_id, kind, detail)

    def strike(self, key_id: str, sampler_id: str, kind: str, detail: str) -> None:
        """A failure of a key's data; at the strike policy's limit the key is quarantined, its
        groups in the batch dropped (counted) and the verdict recorded in Redis for status."""
        if not key_id or self.strikes.is_quarantined(key_id):
            return
        quarantine = self.strikes.strike(key_id, sampler_id, kind, detail, time.time())
        log.warning("strike against sampler %s (key %s): %s: %s", sampler_id, key_id, kind, detail)
        if quarantine is None:
            return
        dropped = self.admission.withdraw(lambda g: g.rollout.key_id != key_id, lambda g: "quarantined")
        self.state.record_quarantine(key_id, {**asdict(quarantine), "dropped_in_flight": dropped,
                                              "groups_seen": self.by_key["groups"][key_id],
                                              "fresh_groups_seen": self.by_key["fresh"][key_id],
                                              "groups_judged": self.by_key["judged"][key_id],
                                              "fresh_groups_judged": self.by_key["fresh_judged"][key_id],
                                              "learner_version": self.version})
        log.error("quarantined sampler %s (key %s): %s; %d of its groups dropped from the batch", sampler_id,
                  key_id, quarantine.reason, dropped)

    # ---- batches ------------------------------------------------------------------------
    def next_batch(self, version: int, *, last: bool = False) -> Optional[Batch]:
        """A batch once `groups_per_step` groups wait (with `last`, whatever waits), its stale
        groups' log-probs checked; None while it is not full, or when a check refused some of its
        groups (withdrawn and struck: the rest wait for the batch to fill again; with `last`, the
        rest are checked again at once)."""
        self.version = version
        groups = self.admission.take_batch(time.time(), last=last)
        if not groups:
            return None
        with self.clock.stage("screen"):
            failures, in_step = self.screen.check_batch(
                [(g.rollout, g.staleness) for g in groups], fresh_in_step=self.fresh_in_step,
                still_pending=[g.rollout.rollout_id for g in self.admission.pending])
        if not failures:
            threshold = self.cfg.security.logprob_threshold
            return Batch(groups, FreshCheck(tuple(in_step), threshold) if in_step else None)
        self.put_back(groups, failures)
        return self.next_batch(version, last=last) if last else None

    def refused(self, batch: Batch, refused: StepRefused) -> None:
        """The step refused `batch` (a fresh group failed the check its forward passes made):
        the failed groups are withdrawn and struck, the rest wait again."""
        failures = {batch.groups[i].rollout.rollout_id: [self.screen.record_fresh(batch.groups[i].rollout, gap)]
                    for i, gap in refused.gaps.items() if i in refused.failed}
        for i, gap in refused.gaps.items():
            if i not in refused.failed:
                self.screen.record_fresh(batch.groups[i].rollout, gap)
        self.put_back(batch.groups, failures)

    def put_back(self, groups: list[PendingGroup], failures: dict[str, list[tuple[str, str]]]) -> None:
        self.admission.put_back(groups)
        for rollout_id, failed in failures.items():
            rollout = next(g.rollout for g in groups if g.rollout.rollout_id == rollout_id)
            self.refuse_failed(rollout, failed)

    def trained(self, batch: Batch, fresh_gaps: dict[int, float], version: int) -> None:
        """After the step on `batch` made `version`: its fresh groups' checks recorded; with
        validators, the groups still waiting for a verdict judged again at the new version."""
        for i, gap in fresh_gaps.items():
            self.screen.record_fresh(batch.groups[i].rollout, gap)
        self.version = version
        if self.validated:
            self.expire_awaiting()

    # ---- verdicts (validators.enabled) ----------------------------------------------------
    def offer_verdict(self, record: RawRecord, version: int, topic: str) -> None:
        """A message of the verdicts topic: a valid verdict lets its group into the batch or
        refuses it (now, or when the group arrives); a forged one is refused."""
        self.version = version
        where = f"{topic}[{record.partition}]@{record.offset}"
        with self.clock.stage("intake"):
            try:
                verdict = self.verdict_verifier.check(record.value, time.time())
            except Rejected as e:
                self.verdict_counts[f"refused:{e.code}"] += 1
                log.warning("refused the verdict at %s: %s", where, e.reason)
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
            log.warning("refused verdict %s:%d on group %s: it is about other content (%s@%d)",
                        other.validator_key_id, other.seq, rollout_id, other.partition, other.offset)
        by_digest.clear()
        if verdict is None:
            return
        del self.verdicts[rollout_id]
        del self.awaiting_at[rollout_id]
        self.by_key["judged"][group.rollout.key_id] += 1
        self.by_key["fresh_judged"][group.rollout.key_id] += group.staleness == 0
        if verdict.passed:
            self.verdict_counts["passed"] += 1
            self.admission.release(rollout_id, self.version, time.time(), verdict.ref)
            return
        self.verdict_counts[f"failed:{verdict.failure}"] += 1
        self.admission.refuse_awaiting(rollout_id, f"failed_verdict:{verdict.failure}")
        if verdict.strikes:
            self.strike(group.rollout.key_id, group.rollout.sampler_id, verdict.failure,
                        f"{verdict.detail} (verdict {verdict.ref} of validator {verdict.validator_id})")

    def expire_awaiting(self) -> None:
        """After a step: waiting groups past the staleness rule are dropped, as in the batch."""
        if self.admission.awaiting:
            self.admission.expire_awaiting(self.version, time.time())
        self.awaiting_at = {k: v for k, v in self.awaiting_at.items() if k in self.admission.awaiting}
        # verdicts that came before groups read and decided since (or never to be read: a message
        # behind the learner's position) are moot
        self.verdicts = {k: v for k, v in self.verdicts.items()
                         if k in self.admission.awaiting or any(
                             x.offset >= self.read_to.get(x.partition, 0) for x in v.values())}

    def give_up_waiting(self) -> None:
        """Draining: the groups still without a verdict are dropped as `no_verdict`."""
        for rollout_id in list(self.admission.awaiting):
            self.admission.refuse_awaiting(rollout_id, "no_verdict")

    # ---- what the learner reports -----------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Groups in the batch being filled or waiting for their verdicts."""
        return len(self.admission.pending) + len(self.admission.awaiting)

    def report_judged(self, send: Callable[[dict[str, int]], None]) -> None:
        """`send` what `judged_by` holds, then forget what was sent (a send that raises loses nothing)."""
        judged = dict(self.judged_by)
        send(judged)
        self.judged_by.subtract(judged)
        self.judged_by = +self.judged_by  # drop the zeros

    def resume_offsets(self) -> dict[int, int]:
        """Where a learner resumed from a checkpoint taken now reads on: the next offset per
        partition, or the earliest group still waiting for its verdict (so none is lost with a
        restart; the groups judged after it are known from the update log and ignored)."""
        offsets = dict(self.read_to)
        for group in self.admission.awaiting.values():
            offsets[group.partition] = min(offsets.get(group.partition, group.offset), group.offset)
        return offsets

    def take_verdicts(self) -> Verdicts:
        return self.admission.take_verdicts()

    def summary(self) -> dict:
        """The intake's part of the learner's summary: counters, checks, verdicts, quarantines."""
        return {**self.admission.counters.as_dict(), "checks": self.screen.summary(),
                **({"verdicts": dict(self.verdict_counts)} if self.validated else {}),
                "quarantined": {k: asdict(q) for k, q in self.strikes.quarantined.items()}}
