"""Files that hold a stack's secrets (its state, its servers' users and keys), shared between the
processes that edit them and the servers that read them: written whole and readable by their
owner alone, edited one process at a time; and how a server runs until it is told to stop.

Why one place: the stack's state, the Kafka gate's and the Redis gate's users and the S3
identities are all read by another process while they may be rewritten; a reader must never see
half a file, and two `heterorl invite`s at once must not lose one another's user.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


def write_private(path: str | Path, text: str) -> None:
    """Replace `path` with `text`: written to a 0600 file beside it, fsynced, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_private_json(path: str | Path, document: Any, **dump: Any) -> None:
    """`document` as JSON (with `json.dump`'s `dump` options), by `write_private`."""
    write_private(path, json.dumps(document, **dump) + "\n")


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold the lock of `path` (a 0600 `.NAME.lock` beside it) for a read-modify-write of it, between
    processes too."""
    path = Path(path)
    with open(os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def update_locked(path: str | Path, read: Callable[[Path], T], write: Callable[[Path, T], None],
                  change: Callable[[T], bool]) -> bool:
    """Read `path`, `change` what was read in place (True: it changed), and write it back if it did,
    all under the file's lock; whether it changed."""
    path = Path(path)
    with locked(path):
        value = read(path)
        if not change(value):
            return False
        write(path, value)
        return True


def serve_until_stopped(stop: Callable[[], None]) -> None:
    """Block until SIGINT or SIGTERM, then `stop()`: the main loop of a server process."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    stop()
