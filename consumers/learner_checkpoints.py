"""The learner's weights going out: each policy version handed to its publisher process, and the
recovery state every so often (`Checkpoints`).

A version is copied into a free buffer the publisher process shares (`pipeline.weights.publisher`:
a keyframe or a delta, S3 files, then the signed manifest, then the pointer in Redis) and is kept
where the learner runs for its stale checks (`Intake.keep`); a recovery state is the weights with
the optimizer and LR state and the offsets consumed, written on a thread and uploaded by the same
process. Every rank takes part in a save (`pipeline.learning.rank_link.SAVE`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from consumers.intake import Intake
from pipeline.learning.admission import Verdicts
from pipeline.learning.rank_link import SAVE, RankLink
from pipeline.records.metrics import StageClock
from pipeline.weights.learner_state import capture
from pipeline.weights.publisher import BackgroundPublisher, copy_weights_into
from pipeline.weights.recovery import RecoverySchedule

STARVED_PUBLISH_S = 5.0
"""A version the learner made but has not published (between `learner.sync_every` steps) is
published once groups have kept coming for this long without filling a batch: its samplers may
hold a version whose groups cannot be used (their checkpoint altered in the bucket before a
validator read it: every verdict `unverifiable`), and only a newer version lets them go on."""


class Checkpoints:
    """`publish` a version, `save` a version and/or a recovery state, `publish_if_starved`;
    `published_version` is the newest version handed to the publisher (None: none yet)."""

    def __init__(self, publisher: BackgroundPublisher, recovery: RecoverySchedule, intake: Intake, *, engine,
                 tokenizer, work_dir: Path, lcfg, clock: StageClock, link: Optional[RankLink],
                 keeps_versions: bool, published_version: Optional[int], log):
        """`keeps_versions`: whether the intake keeps each version's bytes for its stale checks (not
        where the ranks share the weights: ZeRO-3 over several processes)."""
        self.publisher, self.recovery, self.intake = publisher, recovery, intake
        self.engine, self.tokenizer, self.work_dir = engine, tokenizer, work_dir
        self.lcfg, self.clock, self.link, self.log = lcfg, clock, link, log
        self.keeps_versions, self.published_version = keeps_versions, published_version

    def save(self, version: int, step: int, tail_verdicts: Optional[Verdicts] = None, *, policy: bool = True,
             state: bool = True, final: bool = False) -> None:
        """Hand the publisher the policy of `version` and, for a recovery state, the learner state
        after `step`. `final`: the run's last version, a keyframe (it stands alone: a user takes it
        home)."""
        policy = policy and self.published_version != version
        extra = {"offsets": self.intake.resume_offsets(), "step": step, "policy_version": version,
                 "loss_type": self.lcfg.loss_type}
        if tail_verdicts:  # verdicts since the last step (no step logs them) travel with the final state
            extra["tail_verdicts"] = {k: [asdict(x) for x in v] for k, v in vars(tail_verdicts).items() if v}
        if self.link is not None:  # gathering the weights and the optimizer state takes every rank
            self.link.send(SAVE, {"state": state, "policy": policy})
        if policy:
            self.publish(version, extra, parent_version=self.published_version, keyframe=final)
        if state:
            with self.clock.stage("snapshot"):
                captured = capture(self.engine, self.tokenizer, state=True)
            directory = Path(tempfile.mkdtemp(prefix=f"s{step}-", dir=self.work_dir))
            self.publisher.submit_state(step, captured, directory, extra)
            self.recovery.written(step, time.monotonic())

    def save_due(self, version: int, step: int, final: bool) -> None:
        """After a step: the policy every `learner.sync_every` steps, the recovery state when due."""
        state_due = final or self.recovery.due(step, time.monotonic())
        if state_due or step % self.lcfg.sync_every == 0:
            self.save(version, step, policy=final or step % self.lcfg.sync_every == 0, state=state_due, final=final)

    def publish_if_starved(self, version: int, step: int, waited_s: float) -> None:
        """Publish the version made since the last one published once groups have come for
        `STARVED_PUBLISH_S` without a step (said in the log)."""
        if self.published_version == version or waited_s < STARVED_PUBLISH_S:
            return
        self.log.warning("groups have come for %.0fs without filling a batch: publishing v%d now, before "
                         "learner.sync_every = %d steps, so samplers can move on", waited_s, version,
                         self.lcfg.sync_every)
        self.save(version, step, policy=True, state=False)

    def publish(self, version: int, extra: dict, parent_version: Optional[int], keyframe: bool = False) -> None:
        """Copy the weights into a free buffer of the publisher (kept for stale checks too), hand it over."""
        with self.clock.stage("publish_wait"):
            slot = self.publisher.take_slot()
        with self.clock.stage("snapshot"):
            views = self.publisher.slots.views(slot)
            copy_weights_into(self.engine.module, views, zero3=self.lcfg.zero_stage == 3)
            if self.keeps_versions:  # the slot's bytes are the version samplers get: one copy of them kept
                self.intake.keep(version, lambda: {name: view for tensors in views.values()
                                                   for name, view in tensors.items()})
        self.publisher.submit_policy(slot, version, extra, parent_version=parent_version, keyframe=keyframe)
        self.published_version = version

    def saved_everything(self, version: int, step: int) -> bool:
        """Whether `version` is handed over and the recovery state is of `step`."""
        return self.published_version == version and self.recovery.last_step == step
