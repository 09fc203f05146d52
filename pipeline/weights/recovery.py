"""The learner's recovery state in S3: what only a restarted learner reads.

A recovery state is the learner's model directory in its own precision (the weights as
`transformers` saves them) with `learner_state/` beside it (fp32 master weights, AdamW's
moments, RNG and LR schedule: `pipeline.weights.learner_state`), and, in its signed manifest's
`extra`, the Kafka offsets consumed, the optimizer step, the policy version the weights
carry and the verdicts reached after the last step. It lives under its own prefix,
`<run>/state/s<step>/`, apart from the policy versions samplers read (`<run>/v<version>/`),
and is written every `learner.state_every_steps` steps or `learner.state_every_s` seconds,
whichever comes first, and at the end of a run.

A learner killed between two recovery states resumes from the newest complete one (a state
without its manifest does not exist) and re-reads Kafka from its offsets. Policy versions it
had published after that state are never reused: `resume_version` gives the resumed
weights a version above every published one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from typing import Callable

from pipeline.weights.store import CheckpointNotFound, CheckpointStore, CorruptCheckpointError, Manifest

STATE_PREFIX = "state"
STATE_LABEL = "s"
KEEP_STATES = 2
"""Recovery states kept: the newest, and the one before it while the newest is uploaded."""


def recovery_store(policies: CheckpointStore) -> CheckpointStore:
    """The store of a run's recovery states, beside its policy store (same client, keys and trust)."""
    return CheckpointStore(policies.client, policies.bucket, f"{policies.run}/{STATE_PREFIX}",
                           signer=policies.signer, trusted=policies.trusted, label=STATE_LABEL)


def latest_state(store: CheckpointStore) -> Optional[Manifest]:
    """The newest complete recovery state, or None (a run that never wrote one)."""
    for step in reversed(store.list_versions()):
        try:
            return store.read_manifest(store.manifest_key(step))
        except CheckpointNotFound:  # pruned between the listing and the read
            continue
    return None


def fetch_newest_state(store: CheckpointStore, work_dir: Path,
                       on_skip: Optional[Callable[[int, Exception], None]] = None) -> Optional[tuple[Path, Manifest]]:
    """The newest recovery state that downloads whole (every file as its manifest says), in a
    directory under `work_dir`, with its manifest; the one before it when the newest cannot be
    had (its files gone or altered while its manifest still reads: `on_skip(step, error)` is
    told); None for a run that never wrote one. CorruptCheckpointError if none of those it wrote
    can be had (starting over from the base model would silently undo the run)."""
    steps = store.list_versions()
    for step in reversed(steps):
        try:
            manifest = store.read_manifest(store.manifest_key(step))
            model_dir, _ = store.fetch(manifest.key, Path(work_dir) / f"resume-s{manifest.version}",
                                       learner_state=True)
            return model_dir, manifest
        except (CheckpointNotFound, CorruptCheckpointError) as e:
            if on_skip is not None:
                on_skip(step, e)
    if steps:
        raise CorruptCheckpointError(f"none of the recovery states of steps {steps} in s3://{store.bucket}/"
                                     f"{store.run}/ can be downloaded whole")
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a learner starts: the newest recovery state, or the base model as v0."""

    model_dir: Path
    step: int
    """Optimizer steps behind these weights."""
    state_version: int
    """The version these weights were published as (0: the base model)."""
    version: int
    """The version the learner carries on as (`resume_version`)."""
    must_publish: bool
    offsets: dict[int, int]
    """Where to read the rollout topic from (empty: its start)."""
    manifest_key: Optional[str] = None
    """The recovery state's manifest (None: the base model)."""

    @property
    def what(self) -> str:
        return ("the base model" if self.manifest_key is None
                else f"the weights of step {self.step} (v{self.state_version})")


def resume_point(store: CheckpointStore, base: Callable[[], Path], work_dir: Path, pointer: Optional[int],
                 on_skip: Optional[Callable[[int, Exception], None]] = None) -> ResumePoint:
    """From the newest recovery state of the run whose policies are in `store` (fetched into
    `work_dir`), else from `base()`; `pointer`: the version the policy pointer names."""
    found = fetch_newest_state(recovery_store(store), work_dir, on_skip=on_skip)
    published = store.list_versions() + [-1 if pointer is None else pointer]
    if found is None:
        version, must_publish = resume_version(0, published)
        return ResumePoint(base(), 0, 0, version, must_publish, {})
    model_dir, state = found
    state_version = int(state.extra["policy_version"])
    version, must_publish = resume_version(state_version, published)
    return ResumePoint(model_dir, state.version, state_version, version, must_publish,
                       {int(p): int(o) for p, o in state.extra.get("offsets", {}).items()}, state.key)


def resume_version(state_version: int, published: list[int]) -> tuple[int, bool]:
    """The version a learner resuming with weights of `state_version` continues as, given the
    versions already `published`, and whether it must publish its weights under it.

    Every version is published once: when nothing newer than `state_version` was published,
    the learner carries on as `state_version` (publishing it if it never was); when a killed
    learner had published newer versions, their weights are lost, so the resumed weights get
    the next unused number (their manifest names `state_version` as the parent)."""
    newest = max(published, default=-1)
    if newest == state_version:
        return state_version, False
    return max(newest + 1, state_version), True


@dataclass
class RecoverySchedule:
    """When the learner writes its recovery state: every `every_steps` steps (0: never by
    steps) or `every_s` seconds (None: never by time), whichever comes first, counted from
    the last one written; never twice for one step."""

    every_steps: int
    every_s: Optional[float]
    last_step: int = 0
    last_at: float = 0.0

    def due(self, step: int, now: float) -> bool:
        if step <= self.last_step:
            return False
        return (self.every_steps > 0 and step - self.last_step >= self.every_steps) or \
            (self.every_s is not None and now - self.last_at >= self.every_s)

    def written(self, step: int, now: float) -> None:
        self.last_step, self.last_at = step, now


def save_recovery_state(store: CheckpointStore, step: int, snapshot: Path, extra: dict) -> str:
    """Upload `snapshot` (weights + learner_state/) as the recovery state of `step`, then prune.
    Raises FileNotFoundError for a snapshot without files: an empty state would be taken for the newest
    one and no learner could resume from it."""
    if not Path(snapshot).is_dir() or not any(p.is_file() for p in Path(snapshot).rglob("*")):
        raise FileNotFoundError(f"the recovery state of step {step} has no files in {snapshot}: nothing uploaded")
    key = store.upload(step, snapshot, extra)
    store.prune(KEEP_STATES, current=step)
    return key
