"""Metrics a user can plot: one JSON line per record, mirrored to TensorBoard.

Every record carries a `kind` ("learner", "eval", ...) so several processes can append
to one run's `metrics.jsonl` and readers can split them again.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional


class StageClock:
    """Wall and CPU seconds a process spent in each named stage since the last `take()`: where a
    learner step's time went (`time_train_s`, `time_screen_s`, ... in its metrics record) and how
    much of it was computation on this thread (`cpu_train_s`, ...; waiting, sleeping and other
    threads' work are not)."""

    def __init__(self):
        self._seconds: Counter = Counter()
        self._cpu_seconds: Counter = Counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - started
            self._cpu_seconds[name] += time.thread_time() - cpu_started

    def take(self) -> dict[str, float]:
        """`{"time_<stage>_s": wall seconds, "cpu_<stage>_s": CPU seconds}` since the last call, and start again."""
        out = {f"time_{name}_s": seconds for name, seconds in sorted(self._seconds.items())}
        out |= {f"cpu_{name}_s": seconds for name, seconds in sorted(self._cpu_seconds.items())}
        self._seconds.clear()
        self._cpu_seconds.clear()
        return out


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True, tb_subdir: str = "tb"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / tb_subdir))

    def write(self, kind: str, step: int, values: dict) -> dict:
        record = {"kind": kind, "step": int(step), "time": time.time(), **values}
        line = json.dumps(record, default=float)
        # One write() of a whole line with O_APPEND keeps concurrent writers' lines intact.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class MetricsTail:
    """New records of a growing metrics.jsonl, reading each byte once (for live progress)."""

    def __init__(self, path: Path, kind: Optional[str] = None):
        self.path = Path(path)
        self.kind = kind
        self.offset = 0

    def new_records(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for next time
        self.offset += len(complete)
        records = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        return [r for r in records if self.kind is None or r.get("kind") == self.kind]


def read_metrics(path: Path, kind: Optional[str] = None) -> list[dict]:
    return list(iter_metrics(path, kind))


def iter_metrics(path: Path, kind: Optional[str] = None) -> Iterator[dict]:
    path = Path(path)
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            if kind is None or record.get("kind") == kind:
                yield record
