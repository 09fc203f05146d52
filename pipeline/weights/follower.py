"""Following the learner's versions: a role that generates with the newest policy
(`PolicyFollower`: the sampler's weights, downloaded and verified in the background, swapped
in between batches), and the learner's or a validator's past versions, which stale groups are
re-scored with (`PastPolicies`). Both fetch through `pipeline.weights.policy.fetch_policy`
(every tensor checked against the learner's signed manifest); the pointer they follow is
`pipeline.weights.store.PolicyPointer`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import urllib3
from minio.error import S3Error

from pipeline.clients.services import ServiceUnavailable
from pipeline.models import load_policy, load_weights_into
from pipeline.weights.store import CheckpointNotFound, CheckpointStore, CorruptCheckpointError
from pipeline.weights.policy import fetch_policy, read_weights

log = logging.getLogger(__name__)

ENGINE_COPY_SUFFIX = ".engine"
"""Suffix of the directory an engine that rewrites files loads from, beside the verified one."""


class PolicyFollower:
    """The weights a role generates with, and how it moves to the newest version.

    Downloads run on a background thread (`request`), so a slow or failing link never
    stalls generation: the loop keeps sampling with the weights it has and swaps the new
    ones in between batches (`swap_if_ready`). `update` is the blocking form, for the
    first load.
    """

    def __init__(self, store, work_dir: Path, log, engine: Any):
        self.store = store
        self.engine = engine
        self.work_dir = work_dir
        self.log = log
        self.version: Optional[int] = None
        self.last_load_s: Optional[float] = None
        """Seconds the newest version took from verified files to weights in use (`prepare` + `install`)."""
        self.refused: set[str] = set()
        self.fallbacks = 0
        """Delta paths refused (a tampered delta, a copy that does not fit) before the keyframe path worked."""
        self.bytes_downloaded = 0
        self.downloading: Optional[int] = None
        """Version being downloaded, if any."""
        self._ready: Optional[tuple] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def request(self, version: Optional[int], manifest_key: Optional[str], forced: bool = False) -> None:
        """Start downloading `version` in the background if it is newer than ours and nothing is in flight."""
        if version is None or manifest_key is None or (self.version is not None and version <= self.version):
            return
        if manifest_key in self.refused or self.downloading is not None or self._ready is not None:
            return
        self.downloading = version
        have = None if self.version is None else (self.version, self.work_dir / f"v{self.version}")
        self._thread = threading.Thread(target=self._download, args=(version, manifest_key, forced, have),
                                        name=f"download-v{version}", daemon=True)
        self._thread.start()

    def _download(self, version: int, manifest_key: str, forced: bool, have: Optional[tuple[int, Path]]) -> None:
        try:
            started = time.perf_counter()
            # From the deltas after our version, or the newest keyframe: every tensor's sha256 checked.
            path, _, report = fetch_policy(self.store, manifest_key, self.work_dir / f"v{version}", have=have,
                                           expect_version=version, work_dir=self.work_dir)
            self.bytes_downloaded += report.bytes_downloaded
            for reason in report.refused:
                self.fallbacks += 1
                self.log.error("refused the delta path to v%d (%s); took the keyframe path", version, reason)
            self.log.info("policy v%d rebuilt from %s (%.2f MB) in %.2fs", version,
                          "+".join(f"v{v}" for v in report.path) or "our copy", report.bytes_downloaded / 1e6,
                          time.perf_counter() - started)
            started = time.perf_counter()
            prepared = self.engine.prepare(path)
            with self._lock:
                self._ready = (version, prepared, time.perf_counter() - started, forced)
        except CorruptCheckpointError as e:
            self.refused.add(manifest_key)
            self.log.error("%s; keeping policy v%s", e, self.version)
        except CheckpointNotFound as e:  # pruned between the Redis read and the fetch
            self.log.warning("%s; will pick up a newer version", e)
        except (S3Error, urllib3.exceptions.HTTPError, OSError, ServiceUnavailable) as e:  # the network
            self.log.warning("could not download policy v%d (%s: %s); keeping v%s and retrying",
                             version, type(e).__name__, str(e).splitlines()[0][:160], self.version)
        except Exception as e:  # noqa: BLE001 - verified bytes that do not load: never retry them
            self.refused.add(manifest_key)
            self.log.error("policy v%d does not load (%s: %s); keeping v%s", version, type(e).__name__,
                           str(e).splitlines()[0][:160] if str(e) else "", self.version)
        finally:
            self.downloading = None

    def swap_if_ready(self) -> Optional[bool]:
        """Load a finished download; returns its `forced` flag, or None if nothing was ready."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        version, prepared, prepare_s, forced = ready
        old = self.version
        started = time.perf_counter()
        self.engine.install(prepared)
        install_s = time.perf_counter() - started
        self.version, self.last_load_s = version, prepare_s + install_s
        if old is not None:
            shutil.rmtree(self.work_dir / f"v{old}", ignore_errors=True)
            shutil.rmtree(self.work_dir / f"v{old}{ENGINE_COPY_SUFFIX}", ignore_errors=True)
        self.log.info("policy v%d loaded into the %s engine in %.3fs (%.3fs preparing, %.3fs swapping in; was v%s)",
                      version, self.engine.backend, self.last_load_s, prepare_s, install_s, old)
        return forced

    @property
    def loaded(self) -> bool:
        return self.version is not None

    def update(self, version: Optional[int], manifest_key: Optional[str]) -> bool:
        """Blocking: load `version` if it is newer than ours; False (keep current weights) on failure."""
        self.request(version, manifest_key)
        if self._thread is not None:
            self._thread.join()
        return self.swap_if_ready() is not None


class PastPolicies:
    """The versions stale groups are re-scored with, run on one model (`scratch`) on the
    checker's device and in its precision, loaded with whichever version is asked for.

    The learner hands over each version it publishes (`keep`: its own weights as samplers get
    them, copied on its device; the newest `keep_last`), so re-scoring with one of those is a
    copy into `scratch`, with nothing rebuilt or hashed: the learner made those bytes. Any other
    version (made before a restart; every version, for a validator) is downloaded from S3 and
    verified like a sampler's."""

    def __init__(self, store: CheckpointStore, work_dir: Path, model_dir: Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", keep_last: int = 0):
        """`model_dir`: a directory of this model (its architecture; the weights are replaced);
        `dtype` and `device`: where re-scoring computes; `keep_last`: versions `keep` holds."""
        self.store, self.work_dir, self.model_dir = store, work_dir, model_dir
        self.dtype, self.device, self.keep_last = dtype, torch.device(device), keep_last
        self.scratch: Optional[torch.nn.Module] = None
        self.loaded: Optional[int] = None
        """The version `scratch` holds."""
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        """Version -> its tensors by name, on `device` (the newest `keep_last` handed to `keep`)."""

    def keep(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Hold a copy of `tensors` (a published version, as samplers get it) on this device."""
        if self.keep_last <= 0:
            return
        with torch.no_grad():
            self.kept[version] = {name: t.detach().to(self.device, copy=True) for name, t in tensors.items()}
        for old in sorted(self.kept)[:-self.keep_last]:
            del self.kept[old]

    def get(self, version: int) -> Optional[torch.nn.Module]:
        """The policy of `version`, or None if it can no longer be had (gone from S3, or altered there)."""
        if self.loaded == version:
            return self.scratch
        weights = self.kept.get(version)
        if weights is None:
            downloaded = self._download(version)
            if downloaded is None:
                return None
            weights = {name: t for tensors in downloaded.values() for name, t in tensors.items()}
        self._load(version, weights)
        return self.scratch

    def _download(self, version: int) -> Optional[dict[str, dict[str, torch.Tensor]]]:
        target = self.work_dir / f"check-v{version}"
        try:
            model_dir, _, _ = fetch_policy(self.store, self.store.manifest_key(version), target, expect_version=version)
            return read_weights(model_dir)
        except CheckpointNotFound:
            return None
        except CorruptCheckpointError as e:  # altered in S3 since the learner published it
            log.error("cannot re-score groups of v%d: %s", version, e)
            return None
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def _load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if self.scratch is None:
            self.scratch, _ = load_policy(self.model_dir, device=self.device, dtype=self.dtype)
            for p in self.scratch.parameters():
                p.requires_grad_(False)
            self.scratch.eval()
        self.loaded = None
        with torch.no_grad():
            load_weights_into(self.scratch, weights)
        self.loaded = version
