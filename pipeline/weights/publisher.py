"""Publishing in a process of its own, so that training never waits on encoding, the disk or
the network, and never shares an interpreter lock with them.

The learner copies each policy version it publishes into one of `SLOTS` shared-memory
buffers (`SnapshotSlots`: memory the learner and the publisher both map; pinned, and filled
by non-blocking copies, where the model is on a GPU) and hands the buffer's number to
`BackgroundPublisher`'s child process (`python -m pipeline.weights.publisher`, at a lower CPU
priority than training). The child copies the buffer out, hands it back, and publishes, in
order of submission:

1. the policy (`PolicyWriter`: a keyframe or a delta against the version it published
   last; files, then the signed manifest), then the version in Redis (the signed pointer),
   then pruning of policies no reachable version needs. When versions arrive faster than
   they can be published, a version still waiting when a newer one comes is skipped
   (counted): samplers only ever want the newest. A version handed over as a keyframe (the
   first, the base model as v0; the last of a run) is never skipped. While no job waits, the
   child reads the pointer back every `pointer_check_s` and sets it again if anybody else
   moved it (a rollback or a forgery, which samplers refuse);
2. a recovery state (every `learner.state_every_s`): its directory, written by a thread of
   the learner from the copies the learner took (`pipeline.weights.learner_state.Capture`),
   uploaded by the child, then older states pruned.

Learner and child speak JSON lines over the child's stdin and stdout; nothing is pickled. An
error in the child stops it; the next `take_slot`, `submit_*`, `check` or `close` raises it, so
a broken store is never silently ignored. So does a thread of either side that dies (a reply
that is not a message, a slot that cannot be copied out): a slot it would have handed back
never comes, and the learner would otherwise wait for it forever.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline.devices import one_cpu_thread
from pipeline.weights.learner_state import Capture
from pipeline.weights.store import MalformedPointer, Pointer, PolicyPointer

log = logging.getLogger("publisher")

SLOTS = 2
"""Shared-memory buffers of one policy version each: the learner fills one while the
publisher copies the other out."""

PUBLISHER_NICE = 10
"""How much lower the publisher process runs than training (Linux nice): encoding and
uploading a version take CPU the optimizer step should not have to share evenly."""

ALIGN = 64


# ---- the buffers ------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorPlace:
    """Where one published tensor lives in a slot."""

    file: str
    """The weights file of the model directory that stores it."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


def slot_layout(model_dir: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                dtypes: Optional[dict[str, torch.dtype]] = None) -> list[TensorPlace]:
    """The tensors samplers get, as `model_dir`'s weights files store them (tied weights once),
    packed one after another: floating-point ones in `dtype`, others (`dtypes`) as they are."""
    from safetensors import safe_open

    from pipeline.weights.policy import weights_files

    places, offset = [], 0
    for file in weights_files(model_dir):
        with safe_open(str(Path(model_dir) / file), framework="pt") as f:
            names = list(f.keys())
        for name in names:
            if name not in shapes:
                raise ValueError(f"{model_dir / file} stores {name}, which the model being trained does not have")
            own = (dtypes or {}).get(name, dtype)
            place = TensorPlace(file, name, str(own).removeprefix("torch."), tuple(shapes[name]), offset)
            places.append(place)
            offset += -(-place.nbytes // ALIGN) * ALIGN
    return places


class SnapshotSlots:
    """`SLOTS` buffers in memory both processes map (a memfd on Linux, passed to the child by
    its descriptor), each laid out as `places` says. Pinned where the learner's model is on a
    GPU, so that its copies into them do not block."""

    def __init__(self, places: list[TensorPlace], count: int = SLOTS, pin: bool = False,
                 fds: Optional[list[int]] = None):
        self.places = places
        self.size = max(ALIGN, max((p.offset + p.nbytes for p in places), default=0))
        self.owner = fds is None
        self.fds = fds if fds is not None else [self._new_fd(i) for i in range(count)]
        self.buffers = [torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=self.size, dtype=torch.uint8)
                        for fd in self.fds]
        self.pinned = False
        if pin and torch.cuda.is_available():
            try:
                for buf in self.buffers:
                    # cudaHostRegisterDefault: page-locked, so device-to-host copies run asynchronously
                    status = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), self.size, 0)
                    if int(status) != 0:
                        raise RuntimeError(f"cudaHostRegister returned {status}")
                self.pinned = True
            except Exception as e:  # noqa: BLE001 - an unpinned buffer still works, with blocking copies
                log.warning("could not pin the snapshot buffers (%s); copies into them will block", e)

    def _new_fd(self, index: int) -> int:
        fd = os.memfd_create(f"heterorl-snapshot-{index}", 0)  # inheritable: passed to the publisher
        os.set_inheritable(fd, True)
        os.ftruncate(fd, self.size)
        return fd

    def views(self, slot: int) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of `slot` by weights file, as views of its buffer."""
        buf, out = self.buffers[slot], {}
        for p in self.places:
            view = buf[p.offset:p.offset + p.nbytes].view(getattr(torch, p.dtype)).view(p.shape)
            out.setdefault(p.file, {})[p.name] = view
        return out

    def close(self) -> None:
        if self.pinned:
            for buf in self.buffers:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            self.pinned = False
        self.buffers = []
        if self.owner:
            for fd in self.fds:
                os.close(fd)


def copy_weights_into(module, views: Optional[dict[str, dict[str, torch.Tensor]]], zero3: bool = False) -> None:
    """Copy `module`'s weights into a slot's `views` (cast to each view's dtype; without
    blocking where the slot is pinned and the model on a GPU; on one thread on a CPU:
    `pipeline.devices.one_cpu_thread`). Under ZeRO stage 3 every rank
    must call this (the partitions are gathered); ranks without a slot pass None."""
    import deepspeed

    params = list(module.parameters())
    on_cpu = bool(params) and params[0].device.type == "cpu"  # one thread: beside a sampler on the same cores
    with deepspeed.zero.GatheredParameters(params, enabled=zero3), torch.no_grad(), one_cpu_thread(on_cpu):
        if views is None:
            return
        state = module.state_dict()
        for tensors in views.values():
            for name, view in tensors.items():
                source = state[name].detach()
                if source.dtype != view.dtype:
                    source = source.to(view.dtype)  # on the source's device: the copy moves half the bytes
                view.copy_(source, non_blocking=source.device.type == "cuda")


# ---- the learner's side -----------------------------------------------------------------

@dataclass
class PublishTarget:
    """Where and how the child process publishes (sent to it as JSON)."""

    config: str
    """The run's config as JSON (services, with their credentials: it travels in the child's
    environment only)."""
    bucket: str
    prefix: str
    """The policy store's prefix in the bucket (the run's name, or a replay's target)."""
    template: str
    """A directory of the model: its config and tokenizer files, and its weights files' layout."""
    work_dir: str
    dtype: str
    """The dtype samplers get."""
    keyframe_every: int
    signer_key: Optional[str] = None
    """The learner's private key file: manifests and the pointer are signed with it."""
    announce: bool = True
    """Set the policy pointer in Redis after each version (a replay's checkpoints announce nothing)."""
    recovery: bool = True
    """Recovery states go to `<prefix>/state/`."""
    keep_last: int = 3
    keep_within: int = 0
    """Policies kept: the newest `keep_last` and every version within `keep_within` of the newest."""
    keyframe_keep_s: float = 0.0
    """And every version from a keyframe until this long after the next keyframe (`held_keyframe`)."""
    host_copies: Optional[str] = None
    """Also write each version whole there before the pointer names it, for samplers on this host
    (`learner.host_copies_dir`; `pipeline.weights.same_host.HostCopies`)."""
    places: list[dict] = field(default_factory=list)
    pointer_check_s: float = 5.0
    """With `announce`, while no job waits, how often the child reads the pointer back: one that
    anybody else moved since it set it (a rollback, a forgery: samplers refuse both, and would
    wait for a version nobody announces again) is set again to the newest version published."""


CONFIG_ENV = "HETERORL_PUBLISHER_TARGET"


def start_publisher(cfg, store, module, model_dir: Path, work_dir: Path, *, signer_key: Optional[Path] = None,
                    announce: bool = True, recovery: bool = True, keep_within: int = 0) -> "BackgroundPublisher":
    """The publisher process of a learner (or a replay) training `module`, publishing to `store`
    in `learner.policy_dtype`, with buffers laid out as `model_dir`'s weights files."""
    from pipeline.weights.same_host import policy_dtype

    lcfg = cfg.learner
    dtype = policy_dtype(lcfg)
    state = module.state_dict()
    places = slot_layout(model_dir, {k: tuple(t.shape) for k, t in state.items()}, dtype,
                         {k: t.dtype for k, t in state.items() if not t.is_floating_point()})
    # absolute: the publisher process does not run in this process's directory
    target = PublishTarget(cfg.model_dump_json(), store.bucket, store.run, str(Path(model_dir).resolve()),
                           str(Path(work_dir).resolve()), str(dtype).removeprefix("torch."), lcfg.keyframe_every,
                           signer_key=None if signer_key is None else str(Path(signer_key).resolve()), announce=announce,
                           recovery=recovery, keep_last=lcfg.keep_checkpoints, keep_within=keep_within,
                           keyframe_keep_s=lcfg.keyframe_keep_s,
                           host_copies=lcfg.host_copies_dir if announce else None)  # for samplers following the pointer
    on_gpu = next(module.parameters()).device.type == "cuda"
    return BackgroundPublisher(target, places, on_gpu=on_gpu)


@dataclass
class _Pending:
    kind: str  # "policy" or "state"
    message: dict
    event: Any = None
    capture: Optional[Capture] = None
    directory: Optional[Path] = None


class BackgroundPublisher:
    """The learner's handle on its publisher process: `submit_policy` (a copy of the weights into
    a free slot), `submit_state` (a recovery state), `close` (wait for everything)."""

    def __init__(self, target: PublishTarget, places: list, *, on_gpu: bool = False):
        self.target = target
        self.slots = SnapshotSlots(places, pin=on_gpu)
        self.target.places = [asdict(p) for p in places]
        self._free = queue.Queue()
        for i in range(len(self.slots.buffers)):
            self._free.put(i)
        self._outbox: "queue.Queue[Optional[_Pending]]" = queue.Queue()
        self._error: Optional[str] = None
        self._lock = threading.Lock()
        self._seconds: Counter = Counter()
        self._done = threading.Condition()
        self._submitted = self._finished = 0
        self.published: list[int] = []
        self.skipped: list[int] = []
        """Versions not published because a newer one came while they waited."""
        self.upload_bytes: list[dict] = []
        """Per snapshot: step, policy bytes and recovery-state bytes uploaded."""
        self.closed = False
        env = {**os.environ, CONFIG_ENV: json.dumps({**asdict(target), "slot_fds": self.slots.fds})}
        self.child = subprocess.Popen([sys.executable, "-m", "pipeline.weights.publisher"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=self.slots.fds,
                                      cwd=str(Path(__file__).resolve().parents[2]), preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._guarded, args=("reply reader", self._read),
                                        name="publisher-replies", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._guarded, args=("sender", self._send),
                                        name="publisher-sender", daemon=True)
        self._sender.start()

    def _guarded(self, name: str, work) -> None:
        """Run `work`, the loop of the thread called `name`; if it raises, the learner's next call
        raises naming it (`the publisher's reply reader died: JSONDecodeError: ...`). A thread that
        died silently would leave `take_slot` waiting forever for a slot nobody hands back."""
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            log.error("the publisher's %s died", name, exc_info=True)
            self._fail(f"the publisher's {name} died: {type(e).__name__}: {e}")

    # -- submitting --
    def take_slot(self) -> int:
        """A free slot, waiting for the publisher to hand one back (the wait is the learner's
        `time_publish_wait_s`); raises as soon as the publisher failed, which would never hand
        one back."""
        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                continue

    def submit_policy(self, slot: int, version: int, extra: dict, *, parent_version: Optional[int],
                      keyframe: bool = False) -> None:
        """Publish the weights copied into `slot` (copies possibly still in flight on the GPU:
        they are waited for on a thread, not here) as `version`."""
        event = None
        if self.slots.pinned and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
        self._queue(_Pending("policy", {"op": "policy", "slot": slot, "version": version, "extra": extra,
                                        "parent_version": parent_version, "keyframe": keyframe}, event=event))

    def submit_state(self, step: int, capture: Capture, directory: Path, extra: dict) -> None:
        """Write the recovery state of `step` from `capture` into `directory` (on a thread) and upload it.
        The publisher process runs in another directory: a relative `directory` is resolved here."""
        directory = Path(directory).resolve()
        self._queue(_Pending("state", {"op": "state", "step": step, "directory": str(directory), "extra": extra},
                             capture=capture, directory=directory))

    def _queue(self, item: _Pending) -> None:
        self._raise_if_failed()
        with self._done:
            self._submitted += 1
        self._outbox.put(item)

    def _send(self) -> None:
        """In submission order: wait for a policy's copies, write a state's files, then tell the child."""
        while True:
            item = self._outbox.get()
            if item is None:
                self._write({"op": "close"})
                return
            try:
                if item.event is not None:
                    item.event.synchronize()
                if item.capture is not None:
                    started = time.perf_counter()
                    item.capture.write(item.directory)
                    self._count({"write": time.perf_counter() - started})
                self._write(item.message)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._fail(f"{type(e).__name__}: {e}")
                return

    def _write(self, message: dict) -> None:
        try:
            self.child.stdin.write((json.dumps(message) + "\n").encode())
            self.child.stdin.flush()
        except (BrokenPipeError, ValueError):  # the child is gone: its reason comes from _read
            self._fail("the publisher process stopped")

    # -- replies --
    def _read(self) -> None:
        for line in self.child.stdout:
            reply = json.loads(line)
            op = reply["op"]
            if op == "slot_free":
                self._free.put(int(reply["slot"]))
            elif op == "done":
                self._count(reply.get("seconds", {}))
                with self._lock:
                    if reply.get("version") is not None:
                        (self.skipped if reply.get("skipped") else self.published).append(int(reply["version"]))
                    if reply.get("sent"):
                        self.upload_bytes.append(reply["sent"])
                with self._done:
                    self._finished += 1
                    self._done.notify_all()
            elif op == "error":
                self._fail(reply["message"])
        code = self.child.wait()
        if code != 0 and self._error is None:
            self._fail(f"the publisher process exited with code {code}")
        with self._done:
            self._done.notify_all()

    def _fail(self, message: str) -> None:
        with self._done:
            self._error = self._error or message
            self._done.notify_all()

    def _count(self, seconds: dict) -> None:
        with self._lock:
            for stage, value in seconds.items():
                self._seconds[stage] += float(value)

    def take_seconds(self) -> dict[str, float]:
        """Seconds the publisher spent since the last call, by stage, as `background_<stage>_s`:
        `write` (a recovery state to disk, on the learner's thread), `copy` (a slot copied out),
        `policy` (encode, upload, announce, prune), `state` (a recovery state uploaded)."""
        with self._lock:
            seconds, self._seconds = self._seconds, Counter()
        return {f"background_{stage}_s": value for stage, value in sorted(seconds.items())}

    def check(self) -> None:
        """Raise now if the publisher has failed (the learner asks every turn of its loop, so a
        broken store or a publisher that could not start stops the run at once)."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"checkpoint publishing failed: {self._error}")

    def close(self, timeout_s: float = 300.0) -> None:
        """Wait for every submitted snapshot to be published, then stop the child."""
        if self.closed:
            self._raise_if_failed()
            return
        self.closed = True
        deadline = time.monotonic() + timeout_s
        with self._done:
            while self._finished < self._submitted and self._error is None and time.monotonic() < deadline:
                self._done.wait(timeout=0.5)
        finished = self._finished >= self._submitted
        self._outbox.put(None)
        try:
            self.child.wait(timeout=max(1.0, deadline - time.monotonic()) if finished else 5.0)
        except subprocess.TimeoutExpired:
            self.child.kill()
        self.slots.close()
        self._raise_if_failed()
        if not finished:
            raise RuntimeError(f"checkpoint publishing did not finish within {timeout_s:.0f}s")


def _die_with_parent() -> None:
    """Linux: the publisher is killed with the learner, however the learner dies, so that a
    killed learner's last version can never be published after a restarted one chose its
    version numbers (a version whose manifest was not written yet does not exist)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# ---- the child process ------------------------------------------------------------------

class _ChildError(Exception):
    """A failure of the publisher process, said to the learner as it is."""


class _Child:
    """The publisher process: a reader thread copies each slot out and hands it back at once; the
    main thread publishes what was read, in order."""

    def __init__(self, spec: dict):
        from pipeline.config import HeteroConfig
        from pipeline.weights.recovery import recovery_store
        from pipeline.weights.store import CheckpointStore, connect_s3
        from pipeline.weights.policy import KeyframeRule, PolicyWriter
        from pipeline.weights.same_host import HostCopies
        from pipeline.clients.run_state import RunState, connect_redis
        from pipeline.clients.services import require_services
        from pipeline.wire.signing import read_key_file

        self.spec = spec
        cfg = HeteroConfig.model_validate_json(spec["config"])
        services = require_services(cfg.services)
        self.services = services
        signer = read_key_file(Path(spec["signer_key"])) if spec.get("signer_key") else None
        store = CheckpointStore(connect_s3(services, timeout_s=cfg.services.connect_timeout_s), spec["bucket"],
                                spec["prefix"], signer=signer)
        self.store = store
        self.run_state = (RunState(connect_redis(services.redis_url, timeout_s=cfg.services.connect_timeout_s,
                                                 security=services.security), cfg.run.name)
                          if spec.get("announce") else None)
        self.recovery = recovery_store(store) if spec.get("recovery") else None
        self.policies = PolicyWriter(store, KeyframeRule(spec["keyframe_every"]), dtype=getattr(torch, spec["dtype"]),
                                        work_dir=Path(spec["work_dir"]))
        places = [TensorPlace(**{**p, "shape": tuple(p["shape"])}) for p in spec["places"]]
        self.slots = SnapshotSlots(places, fds=spec["slot_fds"])
        self.template = Path(spec["template"])
        self.host_copies = HostCopies(Path(spec["host_copies"]), self.template) if spec.get("host_copies") else None
        self.jobs: list[dict] = []
        self.cond = threading.Condition()
        self.out_lock = threading.Lock()
        self.published: list[int] = []
        self.pointer: Optional[Pointer] = None
        """The pointer as this process last set it."""
        # Replies go to the learner through the original stdout; anything a library prints goes to stderr.
        self.replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def reply(self, message: dict) -> None:
        with self.out_lock:
            self.replies.write(json.dumps(message) + "\n")
            self.replies.flush()

    def read(self) -> None:
        """The reader thread (`read_messages`). If it fails (a line that is no message, a slot that
        cannot be copied out), the learner is told at once and this process stops: the learner
        would wait forever for a slot nobody hands back, and this process for jobs nobody reads."""
        try:
            self.read_messages()
        except Exception as e:  # noqa: BLE001 - said to the learner, which stops the run with it
            log.exception("reading the learner's messages failed")
            self.stop(str(e) if isinstance(e, _ChildError)
                      else f"reading the learner's messages failed: {type(e).__name__}: {e}")

    def stop(self, message: str) -> None:
        """Say `message` to the learner as an error, and have the main thread exit with code 1 once
        the job it is on is done, before any other job."""
        try:
            self.reply({"op": "error", "message": message})
        finally:  # also when the learner is gone and the reply cannot be written
            with self.cond:
                self.jobs.insert(0, {"op": "close", "code": 1})
                self.cond.notify()

    def read_messages(self) -> None:
        """stdin, line by line: a policy's slot is copied out and handed back at once; a policy
        still waiting when a newer one comes is skipped."""
        for line in sys.stdin:
            message = json.loads(line)
            if message["op"] == "policy":
                started = time.perf_counter()
                try:
                    message["weights"] = {file: {k: t.clone() for k, t in tensors.items()}
                                          for file, tensors in self.slots.views(message["slot"]).items()}
                except Exception as e:
                    raise _ChildError(f"copying slot {message['slot']} failed: {type(e).__name__}: {e}") from e
                self.reply({"op": "slot_free", "slot": message["slot"]})
                message["copy_s"] = time.perf_counter() - started
            with self.cond:
                if message["op"] == "policy":
                    for waiting in [j for j in self.jobs if j["op"] == "policy" and not j.get("keyframe")]:
                        self.jobs.remove(waiting)
                        self.reply({"op": "done", "version": waiting["version"], "skipped": True,
                                    "seconds": {"copy": waiting["copy_s"]}})
                self.jobs.append(message)
                self.cond.notify()
            if message["op"] == "close":
                return
        with self.cond:  # the learner is gone: finish what was handed over
            self.jobs.append({"op": "close"})
            self.cond.notify()

    def run(self) -> int:
        threading.Thread(target=self.read, name="slots", daemon=True).start()
        while True:
            with self.cond:
                if not self.jobs:
                    self.cond.wait(timeout=self.spec["pointer_check_s"])
                job = self.jobs.pop(0) if self.jobs else None
            if job is None:
                self.restore_pointer()
                continue
            if job["op"] == "close":
                if not job.get("code"):
                    self.restore_pointer()  # the run's last version stays announced (the evaluator scores it)
                if self.host_copies is not None:
                    self.host_copies.close()
                return job.get("code", 0)
            try:
                self.reply(self.publish_policy(job) if job["op"] == "policy" else self.save_state(job))
            except Exception as e:  # noqa: BLE001 - the learner raises it at its next submit
                log.exception("publishing failed")
                self.reply({"op": "error", "message": self.failure(e)})
                return 1

    def failure(self, error: Exception) -> str:
        """`error` in one line, naming the server it came from when it came from one (a store
        that drops the connection says nothing more: its own log says why, a full disk for one)."""
        import redis
        import urllib3
        from minio.error import MinioException

        from pipeline.config import strip_password

        said = f"{type(error).__name__}: {error}"
        if isinstance(error, (MinioException, urllib3.exceptions.HTTPError)):
            return f"S3 at {self.services.s3_endpoint} (bucket {self.spec['bucket']!r}): {said}"
        if isinstance(error, redis.exceptions.RedisError):
            return f"Redis at {strip_password(self.services.redis_url)}: {said}"
        return said

    def publish_policy(self, job: dict) -> dict:
        from pipeline.weights.policy import held_keyframe, prune_policies

        started = time.perf_counter()
        version = job["version"]
        tensors = {name: t for file in job.pop("weights").values() for name, t in file.items()}
        key = self.policies.write(version, self.template, job["extra"], parent_version=job["parent_version"],
                                    keyframe=job["keyframe"], tensors=tensors)
        if self.host_copies is not None:  # before the pointer names the version: samplers here find it
            self.host_copies.put(version, tensors)
        if self.run_state is not None:
            self.pointer = PolicyPointer(self.run_state).set(version, key, signer=self.store.signer)
        last = self.policies.published[-1]
        log.info("published v%d as a %s (%.2f MB, %.1f%% of a full copy%s) in %.1fs", version, last["kind"],
                 last["bytes"] / 1e6, 100 * last["bytes"] / max(1, last["full_bytes"]),
                 f"; its bridge from the version before {last['bridge_bytes'] / 1e6:.2f} MB" if last["bridge_bytes"]
                 else "", time.perf_counter() - started)
        self.published.append(version)
        keep_last, keep_within = self.spec["keep_last"], self.spec["keep_within"]
        keep_from = min(version - keep_within, self.published[-keep_last] if len(self.published) >= keep_last else 0)
        held = held_keyframe(self.policies.published, time.time(), self.spec["keyframe_keep_s"])
        keep_from = keep_from if held is None else min(keep_from, held)
        prune_policies(self.store, current=version, keep_from=keep_from)
        return {"op": "done", "version": version, "seconds": {"copy": job["copy_s"],
                                                              "policy": time.perf_counter() - started},
                "sent": {"step": job["extra"].get("step"), "policy_bytes": last["bytes"], "state_bytes": 0}}

    def restore_pointer(self) -> None:
        """Set the pointer again if anybody else moved it since this process set it
        (`PublishTarget.pointer_check_s`). Redis not answering is logged, and checked again later."""
        import redis

        if self.run_state is None or self.pointer is None:
            return
        pointer = PolicyPointer(self.run_state)
        try:
            try:
                found = pointer.read()
                named = "nothing" if found is None else f"v{found.version} ({found.manifest_key})"
            except MalformedPointer as e:  # a hash with fields missing, a string, a list...: set it again
                found, named = None, f"no pointer ({e})"
            if found == self.pointer:
                return
            self.pointer = pointer.set(self.pointer.version, self.pointer.manifest_key, signer=self.store.signer)
        except redis.exceptions.RedisError as e:
            log.warning("could not check the policy pointer (%s); checking again in %.0fs", self.failure(e),
                        self.spec["pointer_check_s"])
            return
        log.warning("the policy pointer named %s, not v%d as published: set it again", named, self.pointer.version)

    def save_state(self, job: dict) -> dict:
        from pipeline.weights.recovery import save_recovery_state

        started = time.perf_counter()
        directory = Path(job["directory"])
        try:
            if self.recovery is not None:
                save_recovery_state(self.recovery, job["step"], directory, job["extra"])
            nbytes = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("saved the recovery state of step %d (%.1f MB) in %.1fs", job["step"], nbytes / 1e6,
                 time.perf_counter() - started)
        return {"op": "done", "seconds": {"state": time.perf_counter() - started},
                "sent": {"step": job["extra"].get("step"), "policy_bytes": 0, "state_bytes": nbytes}}


def main() -> int:
    spec = json.loads(os.environ.pop(CONFIG_ENV))
    # The learner's log format (pipeline.runtime.setup_logging, whose imports this process does not need).
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s publisher[{os.getpid()}] %(levelname)s %(message)s")
    for noisy in ("urllib3",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        os.nice(PUBLISHER_NICE)
    except OSError:
        pass
    torch.set_num_threads(1)
    try:
        child = _Child(spec)
    except Exception as e:  # noqa: BLE001 - said to the learner in one line, which stops the run with it
        log.exception("cannot start publishing")
        os.write(1, (json.dumps({"op": "error", "message": f"cannot start publishing: {type(e).__name__}: {e}"})
                     + "\n").encode())
        os._exit(1)
    code = child.run()
    # Leave at once: everything is published and said; an interpreter shutdown with torch's
    # threads (the buffers were copied out on one) can abort in C++ teardown.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
