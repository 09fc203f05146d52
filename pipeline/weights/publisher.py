"""Publishing on a thread, so training never waits on the disk or the network.

The learner hands over one snapshot per save: its weights (and learner state, when a
recovery state is due) copied in memory (`pipeline.weights.learner_state.Capture`), or a
directory already written. `BackgroundPublisher`, on a thread of its own at a lower CPU
priority than training (`PUBLISHER_NICE`), publishes, in order of submission:

1. the policy (`PolicyPublisher`: a keyframe or a delta; files, then the signed manifest),
   then the version in Redis, then pruning of policies no reachable version needs;
2. the recovery state (`pipeline.weights.recovery`: a capture is written to its directory
   first), then pruning of older states.

An upload error stops the publisher and is re-raised by the next `submit` or by `close`,
so a broken store is never silently ignored.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.servers.checkpoints import CheckpointStore
from pipeline.weights.learner_state import Capture
from pipeline.weights.policy import PolicyPublisher, prune_policies
from pipeline.weights.recovery import save_recovery_state

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """One save of the learner, as handed to the publisher."""

    directory: Path
    extra: dict
    """What both manifests carry (offsets, step, tail verdicts)."""
    version: Optional[int] = None
    """Publish the policy as this version (None: not this time)."""
    parent_version: Optional[int] = None
    state_step: Optional[int] = None
    """Write the recovery state of this step (None: not this time)."""
    keyframe: bool = False
    """Publish the policy as a full copy whatever the keyframe rule says."""
    cleanup: bool = True
    capture: Optional[Capture] = None
    """The save as copied in memory (None: `directory` is already written). Its policy is
    published from memory, laid out as `template`'s files, with `template`'s other files; the
    directory is written from it only for a recovery state."""
    template: Optional[Path] = None
    """A directory of the same model (config, tokenizer, the layout of its weights files)."""


PUBLISHER_NICE = 10
"""How much lower the publisher's thread runs than training (Linux nice; per thread there): writing,
encoding and uploading a version take CPU the optimizer step should not have to share evenly."""


class BackgroundPublisher:
    """Publishes snapshots on a thread, one at a time, in order."""

    def __init__(self, policies: PolicyPublisher, run_state=None, *, recovery: Optional[CheckpointStore] = None,
                 keep_last: int = 3, keep_within: int = 0):
        """`run_state` None: publish to S3 only (a replay announces no version in Redis).
        `keep_last` / `keep_within`: policies kept are the newest `keep_last` and every version
        within `keep_within` of the newest (the ones the learner's stale checks may re-score),
        each with the chain it needs."""
        self.policies = policies
        self.run_state = run_state
        self.recovery = recovery
        self.keep_last, self.keep_within = keep_last, keep_within
        # Each entry is a full snapshot on disk; a short queue makes training wait
        # rather than pile them up when the store is slow.
        self._queue: "queue.Queue" = queue.Queue(maxsize=2)
        self._error: Optional[BaseException] = None
        self.closed = False
        self.published: list[int] = []
        self._seconds: Counter = Counter()
        self._seconds_lock = threading.Lock()
        self.upload_bytes: list[dict] = []
        """Per snapshot: step, policy bytes and recovery-state bytes uploaded."""
        self._thread = threading.Thread(target=self._work, name="checkpoint-publisher", daemon=True)
        self._thread.start()

    @property
    def store(self) -> CheckpointStore:
        return self.policies.store

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISHER_NICE)
        except (AttributeError, OSError):  # not Linux, or not permitted: the same priority as training
            pass
        while True:
            item: Optional[Snapshot] = self._queue.get()
            if item is None:
                return
            try:
                self._publish(item)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
                return
            finally:
                if item.cleanup:
                    shutil.rmtree(item.directory, ignore_errors=True)

    def _publish(self, item: Snapshot) -> None:
        sent = {"step": item.extra.get("step"), "policy_bytes": 0, "state_bytes": 0}
        if item.capture is not None and item.state_step is not None:
            started = time.perf_counter()
            item.capture.write(item.directory)
            self._count("write", started)
        if item.version is not None:
            started = time.perf_counter()
            in_memory = item.capture is not None
            key = self.policies.publish(item.version, item.template if in_memory else item.directory, item.extra,
                                        parent_version=item.parent_version, keyframe=item.keyframe,
                                        tensors=item.capture.weights if in_memory else None)
            if self.run_state is not None:
                self.run_state.publish_policy(item.version, key, signer=self.store.signer)
            last = self.policies.published[-1]
            sent["policy_bytes"] = last["bytes"]
            log.info("published v%d as a %s (%.2f MB, %.1f%% of a full copy) in %.1fs", item.version, last["kind"],
                     last["bytes"] / 1e6, 100 * last["bytes"] / max(1, last["full_bytes"]),
                     time.perf_counter() - started)
            self.published.append(item.version)
            self._count("policy", started)
            keep_from = min(item.version - self.keep_within,
                            self.published[-self.keep_last] if len(self.published) >= self.keep_last else 0)
            prune_policies(self.store, current=item.version, keep_from=keep_from)
        if item.state_step is not None and self.recovery is not None:
            started = time.perf_counter()
            save_recovery_state(self.recovery, item.state_step, item.directory, item.extra)
            sent["state_bytes"] = sum(p.stat().st_size for p in item.directory.rglob("*") if p.is_file())
            log.info("saved the recovery state of step %d (%.1f MB) in %.1fs", item.state_step,
                     sent["state_bytes"] / 1e6, time.perf_counter() - started)
            self._count("state", started)
        self.upload_bytes.append(sent)

    def _count(self, stage: str, started: float) -> None:
        with self._seconds_lock:
            self._seconds[stage] += time.perf_counter() - started

    def take_seconds(self) -> dict[str, float]:
        """Seconds the thread spent since the last call, by stage, as `background_<stage>_s`:
        `write` (a capture to disk), `policy` (encode, upload, announce, prune), `state`."""
        with self._seconds_lock:
            seconds, self._seconds = self._seconds, Counter()
        return {f"background_{stage}_s": value for stage, value in sorted(seconds.items())}

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"checkpoint publishing failed: {self._error}") from self._error

    def submit(self, snapshot: Snapshot) -> None:
        self._raise_if_failed()
        self._queue.put(snapshot)

    def close(self, timeout_s: float = 300.0) -> None:
        """Wait for every submitted snapshot to be published."""
        self.closed = True
        if self._thread.is_alive():
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"checkpoint publishing did not finish within {timeout_s:.0f}s")
        self._raise_if_failed()
