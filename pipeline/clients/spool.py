"""A bounded, fsynced, on-disk spool for finished prompt groups (broker outages).

A sampler cut off from Kafka keeps generating: each finished group is appended here
and survives a crash of the sampler or the machine; when the link returns the spool is
flushed to the broker in append order. Groups that became too stale while they waited
are dropped at the source (`discard_stale`) and counted, instead of being shipped to a
learner that would drop them anyway.

Delivery is at-least-once, never lost: a record leaves the spool only after the broker
acknowledged it (`commit` after `send_many` returned). A send that fails part-way may
have delivered a prefix that is sent again later, and a crash between the broker's
acknowledgement and `commit` re-sends the acknowledged batch after a restart. The
duplicates carry the same `rollout_id`, and the learner ignores a second copy.

On disk, in `directory`:

- `000001.spool`, `000002.spool`, ...: append-only segment files. Each record is
  `u32 little-endian payload length | u32 little-endian crc32(payload) | payload`,
  the payload being `pipeline.wire.rollout.encode_rollout` bytes (the Kafka message value).
  Every append is flushed and fsynced before `append` returns.
- `committed`: JSON `{"segment": S, "offset": O}`, the position of the first record not
  yet delivered. It is replaced atomically (write a temporary file, fsync, rename, fsync
  the directory); segments below S are fully delivered and deleted.
- `NNNNNN.spool.tmp`: a segment being rewritten by `discard_stale` (see there).
- `lock`: held with flock while the spool is open, so two processes never share it.

Opening a spool recovers it: reading starts at the committed position; a torn or
corrupt record (a crash mid-append) and everything after it in that segment is
truncated and counted in `torn_records`; opening never raises because of one. A missing
or unreadable `committed` file means "nothing is known to be delivered": every segment
present is replayed (duplicates, not losses).

Bounds: at most `max_groups` pending records and `max_bytes` pending record bytes
(headers included). A full spool refuses the append (`append` returns False, counted in
`refused_full`); the caller must pause generating and flush. The only exception is a
single group larger than `max_bytes` arriving at an empty spool: it is accepted, so a
sampler can never be blocked forever. Delivered records stay on disk until their whole
segment is delivered, so the directory holds at most about `max_bytes + segment_bytes`.

Thread-safety: none. One thread (the sampler loop) owns a spool and makes every call;
another thread or process must not touch it (the lock file enforces the process part).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Protocol

from kafka.errors import KafkaError

from pipeline.errors import UserError
from pipeline.wire.rollout import Rollout, decode_rollout, encode_rollout
from pipeline.clients.services import ServiceUnavailable

log = logging.getLogger(__name__)

RECORD_HEADER = struct.Struct("<II")
"""Payload length, then crc32 of the payload; both unsigned 32-bit little-endian."""

SEGMENT_SUFFIX = ".spool"
REWRITE_SUFFIX = ".tmp"
POINTER_NAME = "committed"
LOCK_NAME = "lock"
DEFAULT_SEGMENT_BYTES = 16 * 1024 * 1024

DELIVERY_ERRORS: tuple[type[BaseException], ...] = (KafkaError, ServiceUnavailable, OSError)
"""What `flush_to` treats as "the broker is unreachable": it stops and keeps the rest.
Anything else (a bug) propagates."""


class SpoolLockedError(UserError, RuntimeError):
    """Another process has this spool directory open (two samplers given the same `--id` or spool_dir)."""


class SpoolCorruptError(RuntimeError):
    """A pending record that passed recovery no longer matches its checksum (the disk changed under us)."""


class RolloutSender(Protocol):
    """What `flush_to` needs from a sink (`pipeline.clients.topics.TopicWriter` is one)."""

    def send_many(self, rollouts: list[Rollout]) -> list[tuple[int, int]]: ...


@dataclass(frozen=True)
class SpoolPosition:
    """A byte position in a segment file."""

    segment: int
    offset: int


@dataclass(frozen=True)
class _RecordRef:
    """Where one pending record lies; `size` counts its header."""

    segment: int
    offset: int
    size: int


# --- files -------------------------------------------------------------------------------


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"{segment:06d}{SEGMENT_SUFFIX}"


def _rewrite_path(directory: Path, segment: int) -> Path:
    return directory / f"{segment:06d}{SEGMENT_SUFFIX}{REWRITE_SUFFIX}"


def _numbered(directory: Path, suffix: str) -> list[int]:
    """Segment numbers of the files named `<digits><suffix>`, ascending."""
    numbers = []
    for path in directory.iterdir():
        stem = path.name[:-len(suffix)] if path.name.endswith(suffix) else ""
        if stem.isdigit():
            numbers.append(int(stem))
    return sorted(numbers)


def list_segments(directory: Path) -> list[int]:
    return _numbered(directory, SEGMENT_SUFFIX)


def _fsync_dir(directory: Path) -> None:
    """Make created, renamed and deleted names durable (a file's fsync does not)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_pointer(directory: Path) -> Optional[SpoolPosition]:
    """The committed position, or None if there is none or it cannot be trusted."""
    path = directory / POINTER_NAME
    try:
        fields = json.loads(path.read_text())
        position = SpoolPosition(int(fields["segment"]), int(fields["offset"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("spool %s: unreadable %s (%s); replaying every segment", directory, POINTER_NAME, e)
        return None
    return position if position.segment >= 1 and position.offset >= 0 else None


def write_pointer(directory: Path, position: SpoolPosition) -> None:
    """Replace the committed position atomically: a crash leaves the old or the new one."""
    tmp = directory / (POINTER_NAME + REWRITE_SUFFIX)
    _write_durably(tmp, json.dumps({"segment": position.segment, "offset": position.offset}).encode())
    os.replace(tmp, directory / POINTER_NAME)
    _fsync_dir(directory)


def _delete_segments_below(directory: Path, segment: int) -> None:
    """Delivered segments; a crash before this runs is finished by the next open."""
    for number in list_segments(directory):
        if number < segment:
            segment_path(directory, number).unlink(missing_ok=True)


# --- records -----------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """One on-disk record: header + payload."""
    return RECORD_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def scan_records(data: bytes, start: int, segment: int) -> tuple[list[_RecordRef], int]:
    """The complete, intact records of a segment's bytes from `start`, and where they end.

    The scan stops at the first record that is cut short, fails its checksum or claims
    an empty payload (a zero-filled tail after a crash reads as length 0, crc 0).
    """
    refs: list[_RecordRef] = []
    position = start
    while position + RECORD_HEADER.size <= len(data):
        length, crc = RECORD_HEADER.unpack_from(data, position)
        body_start = position + RECORD_HEADER.size
        body_end = body_start + length
        if length == 0 or body_end > len(data) or zlib.crc32(data[body_start:body_end]) != crc:
            break
        refs.append(_RecordRef(segment, position, RECORD_HEADER.size + length))
        position = body_end
    return refs, position


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def _publish_rewritten_segment(directory: Path, segment: int) -> None:
    """Give a rewritten segment its real name (after the pointer already names it)."""
    os.replace(_rewrite_path(directory, segment), segment_path(directory, segment))
    _fsync_dir(directory)


# --- the spool ---------------------------------------------------------------------------


class RolloutSpool:
    """Finished groups waiting for the broker, in append order, on disk.

    Counters in `stats()` count since this object opened the directory; `pending` is
    what is on disk (including what a previous process left).
    """

    def __init__(self, directory: Path, max_bytes: int, max_groups: int, *,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES):
        if max_bytes < 1 or max_groups < 1 or segment_bytes < 1:
            raise ValueError("max_bytes, max_groups and segment_bytes must be positive")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.max_groups = max_groups
        self.segment_bytes = segment_bytes
        self.last_error: Optional[str] = None
        """Why the latest `flush_to` stopped early ("KafkaTimeoutError: ..."), None if it did not."""
        self.counters = {"appended": 0, "delivered": 0, "discarded_stale": 0, "refused_full": 0,
                         "torn_records": 0}
        self._refs: deque[_RecordRef] = deque()
        self._pending_bytes = 0
        self._tail_segment = 1
        self._tail_size = 0
        self._tail_file: Optional[BinaryIO] = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = self._lock()
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # --- opening ---

    def _lock(self) -> BinaryIO:
        lock_file = open(self.directory / LOCK_NAME, "ab")
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise SpoolLockedError(f"spool {self.directory} is open in another process") from None
        return lock_file

    def _recover(self) -> None:
        """Rebuild the pending index from the committed position; truncate torn tails."""
        pointer = read_pointer(self.directory)
        self._settle_rewrites(pointer)
        segments = list_segments(self.directory)
        start = pointer or SpoolPosition(segments[0] if segments else 1, 0)
        segments = [s for s in segments if s >= start.segment]
        if not segments:
            self._create_segment(start.segment)
            segments, start = [start.segment], SpoolPosition(start.segment, 0)
        for segment in segments:
            self._recover_segment(segment, start.offset if segment == start.segment else 0)
        self._tail_segment = segments[-1]
        self._tail_size = segment_path(self.directory, self._tail_segment).stat().st_size
        head = self._head_position()
        if head != pointer:
            write_pointer(self.directory, head)
        _delete_segments_below(self.directory, head.segment)
        self._tail_file = open(segment_path(self.directory, self._tail_segment), "ab")

    def _settle_rewrites(self, pointer: Optional[SpoolPosition]) -> None:
        """Finish a rewrite whose pointer switch happened; drop any other (it never counted)."""
        for number in _numbered(self.directory, SEGMENT_SUFFIX + REWRITE_SUFFIX):
            if pointer is not None and number == pointer.segment and not segment_path(self.directory, number).exists():
                _publish_rewritten_segment(self.directory, number)
            else:
                _rewrite_path(self.directory, number).unlink()
        (self.directory / (POINTER_NAME + REWRITE_SUFFIX)).unlink(missing_ok=True)

    def _recover_segment(self, segment: int, start: int) -> None:
        path = segment_path(self.directory, segment)
        data = path.read_bytes()
        if start > len(data):  # the file shrank under the pointer: nothing of it is pending
            self.counters["torn_records"] += 1
            log.warning("spool %s: committed offset %d is past the end of %s (%d bytes)",
                        self.directory, start, path.name, len(data))
            start = len(data)
        refs, end = scan_records(data, start, segment)
        if end < len(data):
            self.counters["torn_records"] += 1
            log.warning("spool %s: truncated a torn record at %s:%d (%d bytes dropped, %d intact records kept)",
                        self.directory, path.name, end, len(data) - end, len(refs))
            _truncate(path, end)
        self._refs.extend(refs)
        self._pending_bytes += sum(r.size for r in refs)

    def _head_position(self) -> SpoolPosition:
        """Where the first pending record starts; the end of the log when none is pending."""
        if self._refs:
            return SpoolPosition(self._refs[0].segment, self._refs[0].offset)
        return SpoolPosition(self._tail_segment, self._tail_size)

    def _create_segment(self, segment: int) -> None:
        segment_path(self.directory, segment).touch()
        _fsync_dir(self.directory)

    # --- writing ---

    def append(self, rollout: Rollout) -> bool:
        """Store one finished group durably; False (and counted) when the spool is full.

        Raises `RolloutDecodeError` for a group the learner could not decode (e.g. a NaN
        reward), before writing anything: such a record would block the spool's head.
        """
        payload = encode_rollout(rollout)
        decode_rollout(payload)
        record = frame(payload)
        if self._is_full_for(len(record)):
            self.counters["refused_full"] += 1
            return False
        if self._tail_size > 0 and self._tail_size + len(record) > self.segment_bytes:
            self._start_new_segment()
        self._write_to_tail(record)
        self._refs.append(_RecordRef(self._tail_segment, self._tail_size, len(record)))
        self._tail_size += len(record)
        self._pending_bytes += len(record)
        self.counters["appended"] += 1
        return True

    def _is_full_for(self, record_bytes: int) -> bool:
        if not self._refs:
            return False  # an empty spool takes any one group, so nothing can block forever
        return len(self._refs) + 1 > self.max_groups or self._pending_bytes + record_bytes > self.max_bytes

    def _start_new_segment(self) -> None:
        self._tail_file.close()
        self._tail_segment += 1
        self._create_segment(self._tail_segment)
        self._tail_file = open(segment_path(self.directory, self._tail_segment), "ab")
        self._tail_size = 0

    def _write_to_tail(self, record: bytes) -> None:
        """Write, flush and fsync; on failure (disk full) cut the partial record off again."""
        try:
            self._tail_file.write(record)
            self._tail_file.flush()
            os.fsync(self._tail_file.fileno())
        except OSError:
            self._tail_file.close()
            _truncate(segment_path(self.directory, self._tail_segment), self._tail_size)
            self._tail_file = open(segment_path(self.directory, self._tail_segment), "ab")
            raise

    # --- reading ---

    def pending(self) -> int:
        return len(self._refs)

    def pending_bytes(self) -> int:
        """On-disk bytes of the pending records, headers included (what `max_bytes` bounds)."""
        return self._pending_bytes

    def peek(self, n: int) -> list[Rollout]:
        """The oldest `n` pending groups (fewer if fewer are pending), in append order."""
        return [decode_rollout(payload) for payload in self._read_payloads(list(islice(self._refs, max(0, n))))]

    def _read_payloads(self, refs: list[_RecordRef]) -> list[bytes]:
        payloads: list[bytes] = []
        open_segment, handle = None, None
        try:
            for ref in refs:
                if ref.segment != open_segment:
                    if handle is not None:
                        handle.close()
                    handle = open(segment_path(self.directory, ref.segment), "rb")
                    open_segment = ref.segment
                handle.seek(ref.offset)
                payloads.append(self._checked_payload(handle.read(ref.size), ref))
        finally:
            if handle is not None:
                handle.close()
        return payloads

    def _checked_payload(self, record: bytes, ref: _RecordRef) -> bytes:
        payload = record[RECORD_HEADER.size:]
        intact = len(record) == ref.size and RECORD_HEADER.unpack_from(record, 0) == (len(payload), zlib.crc32(payload))
        if not intact:
            where = f"{segment_path(self.directory, ref.segment).name}:{ref.offset}"
            raise SpoolCorruptError(f"spool {self.directory}: the record at {where} changed on disk "
                                    "since it was written")
        return payload

    # --- delivering ---

    def commit(self, n: int) -> None:
        """Mark the oldest `n` pending groups delivered (the broker acknowledged them)."""
        if n < 0 or n > len(self._refs):
            raise ValueError(f"cannot commit {n} records, {len(self._refs)} are pending")
        if n == 0:
            return
        for _ in range(n):
            self._pending_bytes -= self._refs.popleft().size
        position = self._head_position()
        write_pointer(self.directory, position)
        self.counters["delivered"] += n
        _delete_segments_below(self.directory, position.segment)

    def discard_stale(self, is_stale: Callable[[Rollout], bool]) -> list[Rollout]:
        """Remove the pending groups `is_stale` picks; return them (oldest first) to be counted.

        The others keep their order. The survivors are copied byte for byte into a new
        segment (`NNNNNN.spool.tmp`, fsynced), then the committed pointer is switched to
        it, which is the moment the discard happens; a crash before that leaves the spool
        as it was, a crash after it is finished by the next open.
        """
        refs = list(self._refs)
        payloads = self._read_payloads(refs)
        rollouts = [decode_rollout(p) for p in payloads]
        stale_flags = [bool(is_stale(r)) for r in rollouts]
        if not any(stale_flags):
            return []
        kept = [(ref, payload) for ref, payload, stale in zip(refs, payloads, stale_flags) if not stale]
        self._replace_pending_with(kept)
        stale = [r for r, flag in zip(rollouts, stale_flags) if flag]
        self.counters["discarded_stale"] += len(stale)
        return stale

    def _replace_pending_with(self, kept: list[tuple[_RecordRef, bytes]]) -> None:
        new_segment = self._tail_segment + 1
        records = [frame(payload) for _, payload in kept]
        _write_durably(_rewrite_path(self.directory, new_segment), b"".join(records))
        write_pointer(self.directory, SpoolPosition(new_segment, 0))
        _publish_rewritten_segment(self.directory, new_segment)
        self._tail_file.close()
        _delete_segments_below(self.directory, new_segment)
        self._refs.clear()
        offset = 0
        for record in records:
            self._refs.append(_RecordRef(new_segment, offset, len(record)))
            offset += len(record)
        self._pending_bytes = offset
        self._tail_segment, self._tail_size = new_segment, offset
        self._tail_file = open(segment_path(self.directory, new_segment), "ab")

    def flush_to(self, sink: RolloutSender, batch: int = 32,
                 is_stale: Optional[Callable[[Rollout], bool]] = None,
                 on_discarded: Optional[Callable[[list[Rollout]], None]] = None) -> int:
        """Send everything pending to `sink` in order, `batch` groups per `send_many`.

        First drops the stale groups (if `is_stale` is given; they go to `on_discarded`,
        e.g. to release their prompt claims). Stops at the first `DELIVERY_ERRORS`
        failure without raising: the failed batch and the rest stay pending, `last_error`
        says why. Returns how many groups were delivered (and committed) by this call.
        """
        if batch < 1:
            raise ValueError("batch must be positive")
        self.last_error = None
        if is_stale is not None:
            stale = self.discard_stale(is_stale)
            if stale and on_discarded is not None:
                on_discarded(stale)
        delivered = 0
        while self._refs:
            rollouts = self.peek(batch)
            try:
                sink.send_many(rollouts)
            except DELIVERY_ERRORS as e:
                self.last_error = f"{type(e).__name__}: {e}"
                break
            self.commit(len(rollouts))
            delivered += len(rollouts)
        return delivered

    # --- reporting and closing ---

    def stats(self) -> dict[str, int]:
        return {**self.counters, "pending": self.pending(), "pending_bytes": self.pending_bytes()}

    def close(self) -> None:
        """Release the files; everything appended is already durable."""
        if self._tail_file is not None:
            self._tail_file.close()
            self._tail_file = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> "RolloutSpool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
