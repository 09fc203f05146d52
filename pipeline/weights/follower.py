"""Following the learner's versions: a role that generates with the newest policy
(`PolicyFollower`: the sampler's weights, downloaded and verified in the background, swapped
in between batches), and the learner's or a validator's past versions, which stale groups are
re-scored with (`PastPolicies`). Both fetch through `pipeline.weights.policy.fetch_policy`
(every tensor checked against the learner's signed manifest); the pointer they follow is
`pipeline.weights.store.PolicyPointer`.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import urllib3
from minio.error import MinioException

from pipeline.clients.services import ServiceUnavailable
from pipeline.devices import out_of_memory
from pipeline.models import load_policy, load_weights_into
from pipeline.weights.store import (CheckpointNotFound, CheckpointStore, CorruptCheckpointError, DownloadCancelled,
                                    Transfer)
from pipeline.weights.policy import check_copy, fetch_policy, path_bytes, read_weights, restart_is_cheaper

log = logging.getLogger(__name__)

ENGINE_COPY_SUFFIX = ".engine"
"""Suffix of the directory an engine that rewrites files loads from, beside the verified one."""


class PolicyFollower:
    """The weights a role generates with, and how it moves to the newest version.

    Downloads run on a background thread (`request`), so a slow or failing link never
    stalls generation: the loop keeps sampling with the weights it has and swaps the new
    ones in between batches (`swap_if_ready`). `update` is the blocking form, for the
    first load.

    A follower may start before its engine exists (`engine` None): it downloads meanwhile, and
    what it downloaded is prepared for the engine once `attach` gives one: `heterorl join`
    fetches a volunteer's first policy this way while the learner admits the host and the
    sampler builds its engine (`producers.sampler.fetch_first_policy`).

    A first policy's download (a keyframe: minutes on a slow link) is given up for a newer
    version requested meanwhile whose path is fewer bytes than what is left of it
    (`restart_is_cheaper`; weighed on a thread of its own, as it reads that version's
    manifests): in practice, the learner's next keyframe. A download by a sampler holding a
    version (deltas, or a keyframe path where that is fewer bytes) is always finished.
    """

    def __init__(self, store, work_dir: Path, log, engine: Any = None, host_copies: Optional[Path] = None):
        self.store = store
        self.engine = None
        self._attached = threading.Event()
        self.work_dir = work_dir
        self.log = log
        self.host_copies = None if host_copies is None else Path(host_copies)
        """The learner's publisher's copies of each version, on this host (`sampler.host_copies_dir`):
        taken from there when there, checked as a download is (`pipeline.weights.same_host`)."""
        self.host_copies_taken = 0
        self.version: Optional[int] = None
        self.copy_dir: Optional[Path] = None
        """Where the verified copy of `version` is: the base of the next version's deltas."""
        self.last_load_s: Optional[float] = None
        """Seconds the newest version took from verified files to weights in use (`prepare` + `install`)."""
        self.refused: set[str] = set()
        self.fallbacks = 0
        """Delta paths refused (a tampered delta, a copy that does not fit) before the keyframe path worked."""
        self.bytes_downloaded = 0
        self.keyframe_bytes = 0
        """Of `bytes_downloaded`, the keyframes' (the first policy's, and any taken later); what
        arrived of a first download given up for a newer version is in `bytes_downloaded` only."""
        self.first_policy: Optional[tuple[int, int, float]] = None
        """(version, bytes downloaded for it, time.time() when it was swapped in) of the first version
        loaded: what follows it is what holding a version costs, per version (`per_version_bytes`)."""
        self.download_s = 0.0
        """Seconds spent downloading and verifying versions (the background thread's)."""
        self.last_download_s: Optional[float] = None
        """Seconds the last finished download took (a sampler catching up counts the steps a
        download takes from it: `producers.sampler.Sampler.refresh_weights`)."""
        self.downloading: Optional[int] = None
        """Version being downloaded, if any."""
        self.not_found: set[int] = set()
        """Versions whose download found a version on its path gone (pruned): not asked for again
        by a sampler catching up (`producers.sampler.Sampler.refresh_weights`)."""
        self.restarts = 0
        """First downloads given up for a newer version's shorter path."""
        self._transfer = Transfer()
        self._weighed: Optional[int] = None
        """The newest version weighed against the first download in flight (each is weighed once)."""
        self._weighing: Optional[threading.Thread] = None
        self._stopped = False
        """`stop` was called: nothing more is downloaded."""
        self._restart_with: Optional[tuple[int, str, int]] = None
        """(version, manifest key, its path's bytes) the download in flight gives way to."""
        self._ready: Optional[tuple] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Any) -> None:
        """The engine that loads the versions downloaded (one waiting for it is prepared now)."""
        self.engine = engine
        self._attached.set()

    def request(self, version: Optional[int], manifest_key: Optional[str], forced: bool = False) -> None:
        """Start downloading `version` in the background if it is newer than ours; while a first
        policy downloads, weigh giving it up for `version` instead (`_weigh_restart`)."""
        if version is None or manifest_key is None or (self.version is not None and version <= self.version):
            return
        if manifest_key in self.refused or self._ready is not None or self._stopped:
            return
        if self.downloading is not None:
            self._weigh_restart(version, manifest_key)
            return
        self.downloading, self._transfer = version, Transfer()
        # a copy gone (the publisher's on this host, pruned or removed as its learner ended): a path
        # from nothing, not a delta path refused for a base that is not there
        have = None if self.version is None or not self.copy_dir.is_dir() else (self.version, self.copy_dir)
        self._thread = threading.Thread(target=self._download, args=(version, manifest_key, forced, have),
                                        name=f"download-v{version}", daemon=True)
        self._thread.start()

    def on_the_way(self, version: int, newest: int, newest_key: str) -> tuple[int, str]:
        """(version, manifest key) to ask for on the way to `newest` (`Pacing.catch_up_to`'s
        `version`), or `newest`'s where that one was refused, or found pruned, or a newer one was
        (so, likely, it is too)."""
        key = self.store.manifest_key(version)
        if version >= newest or version <= max(self.not_found, default=-1) or key in self.refused:
            return newest, newest_key
        return version, key

    def _weigh_restart(self, version: int, manifest_key: str) -> None:
        """While a first policy downloads, start weighing giving it up for `version` (once per
        version, one at a time: `_weigh`)."""
        transfer, downloading = self._transfer, self.downloading
        if (self.version is not None or downloading is None or self._restart_with is not None
                or not transfer.planned or version <= max(downloading, self._weighed or -1)
                or (self._weighing is not None and self._weighing.is_alive())):
            return  # holding a version, a restart chosen, the path not known yet, weighed, or weighing
        self._weighed = version
        self._weighing = threading.Thread(target=self._weigh, args=(version, manifest_key, downloading, transfer),
                                          name=f"weigh-v{version}", daemon=True)
        self._weighing.start()

    def _weigh(self, version: int, manifest_key: str, downloading: int, transfer: Transfer) -> None:
        """Give the download of `downloading` up for `version` if that one's path (its manifests
        read here: a round trip or two each) is fewer bytes than what is left of it."""
        try:
            newer_bytes = path_bytes(self.store, manifest_key, version)
        except (CheckpointNotFound, CorruptCheckpointError, MinioException, urllib3.exceptions.HTTPError, OSError,
                ServiceUnavailable) as e:
            self.log.warning("could not weigh policy v%d against the download of v%d (%s); finishing that one",
                             version, downloading, str(e).splitlines()[0][:160])
            return
        with self._lock:  # the download may have ended, or another begun, during the reads
            if (self._transfer is transfer and self.downloading == downloading and self._restart_with is None
                    and not self._stopped and restart_is_cheaper(transfer.remaining, newer_bytes)):
                self._restart_with = (version, manifest_key, newer_bytes)
                transfer.cancel.set()

    def _download(self, version: int, manifest_key: str, forced: bool, have: Optional[tuple[int, Path]]) -> None:
        """Download, verify and prepare `version` (the thread `request` starts), again on the newer
        version `_weigh_restart` chose while it ran."""
        try:
            while version is not None:
                version, manifest_key = self._download_once(version, manifest_key, forced, have)
        finally:
            with self._lock:
                self.downloading, self._restart_with = None, None

    def _download_once(self, version: int, manifest_key: str, forced: bool,
                       have: Optional[tuple[int, Path]]) -> tuple[Optional[int], Optional[str]]:
        """One version's download; returns the version to download instead, or (None, None)."""
        transfer = self._transfer
        try:
            started = time.perf_counter()
            path = self._host_copy(version, manifest_key)
            if path is None:  # from the deltas after our version, or the newest keyframe: every tensor checked
                path, _, report = fetch_policy(self.store, manifest_key, self.work_dir / f"v{version}", have=have,
                                               expect_version=version, work_dir=self.work_dir, transfer=transfer)
                self.bytes_downloaded += report.bytes_downloaded
                self.keyframe_bytes += report.keyframe_bytes
                for reason in report.refused:
                    if have is not None and reason.endswith("its base holds []") and self._host_copy_gone(have[1]):
                        self.log.info("the learner's copy of v%d on this host was removed meanwhile; took the "
                                      "keyframe path to v%d", have[0], version)
                        continue
                    self.fallbacks += 1
                    self.log.error("refused the delta path to v%d (%s); took the keyframe path", version, reason)
                self.log.info("policy v%d rebuilt from %s (%.2f MB) in %.2fs", version,
                              "+".join(f"v{v}" for v in report.path) or "our copy", report.bytes_downloaded / 1e6,
                              time.perf_counter() - started)
            self.last_download_s = time.perf_counter() - started
            self.download_s += self.last_download_s
            self._attached.wait()  # a follower started before its engine: prepared once there is one
            if self._stopped:
                return None, None
            started = time.perf_counter()
            prepared = self.engine.prepare(path)
            with self._lock:
                self._ready = (version, prepared, time.perf_counter() - started, forced, path)
        except DownloadCancelled:  # overtaken or stopped: what arrived counts as downloaded
            self.bytes_downloaded += transfer.received
            self.download_s += time.perf_counter() - started
            with self._lock:
                if self._stopped:
                    return None, None
                (newer, newer_key, newer_bytes), self._restart_with = self._restart_with, None
                self._transfer, self.downloading = Transfer(), newer
            self.restarts += 1
            self.log.info("gave up the download of policy v%d at %.2f of %.2f MB: v%d takes %.2f MB, fewer than "
                          "the %.2f MB left", version, transfer.received / 1e6, transfer.planned / 1e6, newer,
                          newer_bytes / 1e6, transfer.remaining / 1e6)
            return newer, newer_key
        except CorruptCheckpointError as e:
            self.refused.add(manifest_key)
            self.log.error("%s; keeping policy v%s", e, self.version)
        except CheckpointNotFound as e:  # pruned between the Redis read and the fetch
            self.not_found.add(version)
            self.log.warning("%s; will pick up a newer version", e)
        except (MinioException, urllib3.exceptions.HTTPError, OSError, ServiceUnavailable) as e:  # the network
            self.log.warning("could not download policy v%d (%s: %s); keeping v%s and retrying",
                             version, type(e).__name__, str(e).splitlines()[0][:160], self.version)
        except Exception as e:  # noqa: BLE001 - verified bytes that do not load: never retry them
            if out_of_memory(e):  # this machine's fault, not the version's: never refuse for it
                self.log.warning("no memory to load policy v%d (%s); keeping v%s and retrying", version,
                                 out_of_memory(e), self.version)
            else:
                self.refused.add(manifest_key)
                self.log.error("policy v%d does not load (%s: %s); keeping v%s", version, type(e).__name__,
                               str(e).splitlines()[0][:160] if str(e) else "", self.version)
        return None, None

    def _host_copy(self, version: int, manifest_key: str) -> Optional[Path]:
        """The publisher's copy of `version` on this host, checked against the signed manifest
        (`check_copy`); None (download it) where there is none, or it does not check out."""
        if self.host_copies is None or not (self.host_copies / f"v{version}").is_dir():
            return None
        started = time.perf_counter()
        try:
            check_copy(self.store, manifest_key, self.host_copies / f"v{version}", expect_version=version)
        except CorruptCheckpointError as e:  # pruned meanwhile, half written, altered: downloaded instead
            self.log.warning("%s; downloading v%d", e, version)
            return None
        self.host_copies_taken += 1
        self.log.info("policy v%d checked in the learner's copy on this host (%s) in %.2fs", version,
                      self.host_copies, time.perf_counter() - started)
        return self.host_copies / f"v{version}"

    def _host_copy_gone(self, copy: Path) -> bool:
        """Whether `copy`, the base of a delta path refused for holding no weights files, was the
        publisher's copy on this host and is gone or emptied now (the publisher keeps the newest
        two and removes all as it closes): no fault of the version's. Any other refusal counts."""
        if self.host_copies is None or Path(copy).parent != self.host_copies:
            return False
        try:
            return not any(Path(copy).iterdir())
        except OSError:  # removed
            return True

    def stop(self, timeout_s: float = 60.0) -> None:
        """Give up the download in flight, if any, and wait for it to end (within its next 64 KiB
        block; reading manifests, within their reads): its directory may be removed then."""
        with self._lock:
            self._stopped = True
            self._transfer.cancel.set()
        self._attached.set()  # a download that finished waits for an engine no longer coming
        for thread in (self._thread, self._weighing):
            if thread is not None:
                thread.join(timeout_s)

    def swap_if_ready(self) -> Optional[bool]:
        """Load a finished download; returns its `forced` flag, or None if nothing was ready."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        version, prepared, prepare_s, forced, path = ready
        old, old_dir = self.version, self.copy_dir
        started = time.perf_counter()
        self.engine.install(prepared)
        install_s = time.perf_counter() - started
        self.version, self.copy_dir, self.last_load_s = version, Path(path), prepare_s + install_s
        if self.first_policy is None:
            self.first_policy = (version, self.bytes_downloaded, time.time())
        if old_dir is not None and old_dir.parent == self.work_dir:  # a host copy is the publisher's to remove
            shutil.rmtree(old_dir, ignore_errors=True)
            shutil.rmtree(old_dir.with_name(old_dir.name + ENGINE_COPY_SUFFIX), ignore_errors=True)
        self.log.info("policy v%d loaded into the %s engine in %.3fs (%.3fs preparing, %.3fs swapping in; was v%s)",
                      version, self.engine.backend, self.last_load_s, prepare_s, install_s, old)
        return forced

    def adopt_local(self, version: int, model_dir: Path) -> None:
        """Load `model_dir`, a copy of `version` this role made itself and checked (a sampler's v0
        from the base model's files: `pipeline.weights.same_host`), into the engine now. It stays
        in the work directory as `version`'s copy, the base later versions' deltas are applied to
        (each rebuilt tensor checked against the learner's signed sha256), so it must be there."""
        if Path(model_dir) != self.work_dir / f"v{version}":
            raise ValueError(f"a local copy of v{version} belongs in {self.work_dir / f'v{version}'}, not {model_dir}")
        started = time.perf_counter()
        self.engine.install(self.engine.prepare(model_dir))
        self.version, self.copy_dir, self.last_load_s = version, Path(model_dir), time.perf_counter() - started
        self.first_policy = (version, self.bytes_downloaded, time.time())
        self.log.info("policy v%d loaded from local files into the %s engine in %.3fs", version,
                      self.engine.backend, self.last_load_s)

    def stats(self, started: float) -> dict:
        """What following the learner cost, for the role's heartbeat (`started`: its time.time() at start)."""
        per_version = self.per_version_bytes()
        first_version, first_bytes, first_at = self.first_policy or (None, None, None)
        return {"refused_checkpoints": len(self.refused), "refused_delta_paths": self.fallbacks,
                "host_copies_taken": self.host_copies_taken,
                "first_downloads_restarted": self.restarts,
                "weights_bytes_downloaded": self.bytes_downloaded, "keyframe_bytes": self.keyframe_bytes,
                "first_policy_version": first_version, "first_policy_bytes": first_bytes,
                "first_policy_s": None if first_at is None else round(first_at - started, 1),
                "first_policy_at": first_at,
                "per_version_bytes": None if per_version is None else round(per_version),
                "weights_download_s": round(self.download_s, 1)}

    def per_version_bytes(self) -> Optional[float]:
        """Bytes downloaded per version advanced since the first version loaded (keyframes taken
        since included): what following the learner costs a sampler that holds a version."""
        if self.first_policy is None or self.version is None or self.version == self.first_policy[0]:
            return None
        return (self.bytes_downloaded - self.first_policy[1]) / (self.version - self.first_policy[0])

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

    The learner hands over each version it publishes (`keep`: its weights as samplers get them,
    the publisher's copy, copied once more here; the newest `keep_last`), so re-scoring with one
    of those is a copy into `scratch`, with nothing rebuilt or hashed: the learner made those
    bytes. They are kept on the device while `device_bytes` allows, then in pinned host memory
    while `host_bytes` does, else not at all; a version not kept (past those, older, made
    before a restart; for a validator, one it has not downloaded yet: `keep_downloads`) is
    downloaded from S3 and verified like a sampler's. `release` frees them all and `scratch` (the learner's keys all its own again)."""

    GIB = 1 << 30
    ALTERED_RETRY_S = 60.0
    """How long a version refused as altered is not downloaded again (`is_altered`): groups
    claiming it do not make the checker download it over and over."""
    SHARE = 0.25
    """Of the memory free at a keep, the share the kept versions may take where no budget is set
    (why: `security.keep_versions_gib`)."""

    def __init__(self, store: CheckpointStore, work_dir: Path, model_dir: Path, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", keep_last: int = 0, device_bytes: Optional[int] = None,
                 host_bytes: Optional[int] = None, attention: str = "auto", keep_downloads: bool = False):
        """`model_dir`: a directory of this model (its architecture; the weights are replaced);
        `dtype`, `device` and `attention` (`model.attention`): where and how re-scoring computes; `keep_last`: versions `keep` holds, in
        at most `device_bytes` on `device` then `host_bytes` of (pinned) host memory (None:
        `SHARE` of what is free at each keep; for `host_bytes`, on a device other than a GPU, 0:
        the device is host memory already); `keep_downloads`: also keep (within the same bounds)
        each version downloaded and verified here, as a validator does, whose versions nobody
        hands over: it re-scores them again without downloading them, and a version altered in
        S3 after it took it stays checkable."""
        self.store, self.work_dir, self.model_dir = store, work_dir, model_dir
        self.keep_downloads = keep_downloads
        self.altered: dict[int, float] = {}
        """Version -> when (time.monotonic()) its checkpoint in S3 was last refused as altered
        since the learner signed it (`is_altered`)."""
        self.dtype, self.device, self.keep_last, self.attention = dtype, torch.device(device), keep_last, attention
        self.device_bytes, self.host_bytes = device_bytes, host_bytes
        self.scratch: Optional[torch.nn.Module] = None
        self.loaded: Optional[int] = None
        """The version `scratch` holds."""
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        """Version -> its tensors by name (the newest `keep_last` handed to `keep` that fit)."""
        self.where: dict[int, str] = {}
        """Version kept -> "device" or "host"."""

    @classmethod
    def budget(cls, security, reach: int) -> dict:
        """`keep_last`, `device_bytes` and `host_bytes` from `security` (`security.keep_versions`,
        None: `reach`, and `keep_versions_gib` / `keep_versions_host_gib`, None: a share of what
        is free), for a checker whose groups may claim `reach` versions back."""
        gib = lambda x: None if x is None else int(x * cls.GIB)  # noqa: E731
        return {"keep_last": reach if security.keep_versions is None else security.keep_versions,
                "device_bytes": gib(security.keep_versions_gib), "host_bytes": gib(security.keep_versions_host_gib)}

    # ---- what is kept, where -------------------------------------------------------------
    def keep(self, version: int, tensors: dict[str, torch.Tensor]) -> Optional[str]:
        """Hold one copy of `tensors` (a published version, as samplers get it, in its dtype):
        on the device within its budget, else in host memory within its own, else not (said in
        the log). Returns where ("device", "host") or None. An out-of-memory error on the
        device puts it in host memory and lowers the device budget to what is in use."""
        if self.keep_last <= 0:
            return None
        held = len(self.kept)
        self._drop(version)
        while len(self.kept) >= self.keep_last:  # the oldest go first: their memory is the new one's
            self._drop(min(self.kept))
        if len(self.kept) < held:
            self._free_cache()  # what they took counts as free in `budgets` only once the cache lets it go
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        device_budget, host_budget = self.budgets()
        used = self.used()
        if used["device"] + need <= device_budget:
            try:
                return self._store(version, tensors, "device")
            except RuntimeError as e:
                error = out_of_memory(e)
                if error is None:
                    raise
            self._free_cache()  # the part copied is gone with the error
            self.device_bytes = used["device"]
            why = (f"out of memory copying it onto {self.device} ({error}); the device budget "
                   f"(security.keep_versions_gib) is now {self.size(used['device'])}, what the "
                   f"{self._count('device')} version(s) kept there take")
        else:
            why = (f"the device budget (security.keep_versions_gib{self._unset(self.device_bytes)}) of "
                   f"{self.size(device_budget)} holds "
                   f"{self._count('device')} version(s) in {self.size(used['device'])}")
        if used["host"] + need <= host_budget:
            try:
                where = self._store(version, tensors, "host")
            except RuntimeError as e:  # pinned memory refused
                why += f"; host memory refused it ({str(e).splitlines()[0][:120]})"
            else:
                log.info("kept policy v%d (%s) in host memory, not on %s: %s", version, self.size(need),
                         self.device, why)
                return where
        else:
            why += (f"; the host budget (security.keep_versions_host_gib{self._unset(self.host_bytes)}) of "
                    f"{self.size(host_budget)} holds "
                    f"{self._count('host')} version(s) in {self.size(used['host'])}")
        log.warning("not keeping policy v%d (%s) for re-scoring: %s; a check of its stale groups downloads it "
                    "from S3", version, self.size(need), why)
        return None

    def _unset(self, budget: Optional[int]) -> str:
        return f" unset: {self.SHARE:g} of the free memory" if budget is None else ""

    @classmethod
    def size(cls, nbytes: int) -> str:
        return f"{nbytes / cls.GIB:.2f} GiB" if nbytes >= cls.GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"

    def budgets(self) -> tuple[int, int]:
        """Bytes the kept versions may take on the device, then in host memory (the set budgets,
        else `SHARE` of what is free now, the kept versions counted as free)."""
        used = self.used()
        device = self.device_bytes
        if device is None:
            free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                    else self.host_available())
            device = int(self.SHARE * (free + used["device"]))
        host = self.host_bytes
        if host is None:
            host = int(self.SHARE * (self.host_available() + used["host"])) if self.device.type == "cuda" else 0
        return device, host

    def used(self) -> dict[str, int]:
        """Bytes the kept versions take, by where they are."""
        used = {"device": 0, "host": 0}
        for version, tensors in self.kept.items():
            used[self.where[version]] += sum(t.numel() * t.element_size() for t in tensors.values())
        return used

    def release(self) -> bool:
        """Free every kept version and `scratch` (every sampler key is the run's own again: no
        log-prob is re-scored); whether anything was held."""
        if not self.kept and self.scratch is None:
            return False
        count = len(self.kept)
        self.kept.clear()
        self.where.clear()
        self.scratch, self.loaded = None, None
        gc.collect()
        self._free_cache()
        log.info("released the %d kept version(s) and the re-scoring model: every sampler key is the run's own",
                 count)
        return True

    @staticmethod
    def host_available() -> int:
        """Bytes of host memory available now (MemAvailable)."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def _store(self, version: int, tensors: dict[str, torch.Tensor], where: str) -> str:
        """Copy `tensors` to `where`, one copy each (nothing left behind if it fails)."""
        on_device = where == "device"
        target = self.device if on_device else torch.device("cpu")
        pin = not on_device and self.device.type == "cuda"
        if not on_device and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the publisher's slot may still be filling (non-blocking copies)
        copies: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name, t in tensors.items():
                    copies[name] = self._allocate(t, target, pin, where)
                    # onto a GPU: ordered after the copies into the source on the same stream
                    copies[name].copy_(t.detach(), non_blocking=on_device and target.type == "cuda")
        except BaseException:
            copies.clear()  # the traceback keeps this frame: not its copies
            raise
        self.kept[version], self.where[version] = copies, where
        return where

    def _allocate(self, like: torch.Tensor, target: torch.device, pin: bool, where: str) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=target, pin_memory=pin)

    def _drop(self, version: int) -> None:
        self.kept.pop(version, None)
        self.where.pop(version, None)

    def _count(self, where: str) -> int:
        return sum(w == where for w in self.where.values())

    def _free_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- a version's model ---------------------------------------------------------------
    def is_altered(self, version: int) -> bool:
        """Whether `version`'s checkpoint in S3 was refused as altered since the learner signed
        it: groups claiming it cannot be checked, through no fault of theirs, and are not used,
        drawn for a check or not (`consumers.screening`). Looked at again (downloaded) at most
        every `ALTERED_RETRY_S`; a download that verifies ends it."""
        if version not in self.altered or version in self.kept:
            return False
        return self._refused_lately(version) or (self.get(version) is None and version in self.altered)

    def _refused_lately(self, version: int) -> bool:
        """Refused as altered less than `ALTERED_RETRY_S` ago: not downloaded again yet."""
        return time.monotonic() - self.altered.get(version, -math.inf) < self.ALTERED_RETRY_S

    def get(self, version: int) -> Optional[torch.nn.Module]:
        """The policy of `version`, or None if it can no longer be had (gone from S3, or altered
        there: not downloaded again within `ALTERED_RETRY_S` of its last refusal)."""
        if self.loaded == version:
            return self.scratch
        weights = self.kept.get(version)
        if weights is None:
            if self._refused_lately(version):
                return None
            downloaded = self._download(version)
            if downloaded is None:
                return None
            weights = {name: t for tensors in downloaded.values() for name, t in tensors.items()}
            if self.keep_downloads and (len(self.kept) < self.keep_last or version > min(self.kept, default=-1)):
                self.keep(version, weights)  # not an older one in place of a newer
        self._load(version, weights)
        return self.scratch

    def _download(self, version: int) -> Optional[dict[str, dict[str, torch.Tensor]]]:
        target = self.work_dir / f"check-v{version}"
        try:
            model_dir, _, _ = fetch_policy(self.store, self.store.manifest_key(version), target, expect_version=version)
            weights = read_weights(model_dir)
            self.altered.pop(version, None)
            return weights
        except CheckpointNotFound:
            return None
        except CorruptCheckpointError as e:  # altered in S3 since the learner published it
            if version not in self.altered:
                log.error("cannot re-score groups of v%d: %s; its groups are not used", version, e)
            self.altered[version] = time.monotonic()
            return None
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def _load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if self.scratch is None:
            self.scratch, _ = load_policy(self.model_dir, device=self.device, dtype=self.dtype, attention=self.attention)
            for p in self.scratch.parameters():
                p.requires_grad_(False)
            self.scratch.eval()
        self.loaded = None
        with torch.no_grad():
            load_weights_into(self.scratch, weights)
        self.loaded = version
