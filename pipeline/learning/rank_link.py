"""Commands from the learner's rank 0 to its other ranks.

Rank 0 alone reads Kafka, judges staleness and keeps the update log; the other ranks
only train. Before each collective step rank 0 tells them what comes: where the policy
starts (START), the groups of the next step (TRAIN), a checkpoint save they must join
(SAVE), or the end (STOP). A command is a broadcast of a small header, then of the
payload's bytes (msgpack; rollouts in their own wire format), over a gloo group of its
own, so that it works whether the training collectives run on gloo or NCCL. Nothing is
pickled.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

START, TRAIN, SAVE, STOP = 1, 2, 3, 4
NAMES = {START: "start", TRAIN: "train", SAVE: "save", STOP: "stop"}


class RankLink:
    """Rank 0 sends, the others receive; every rank must create it at the same point."""

    def __init__(self, timeout_s: float):
        """`timeout_s`: how long a rank waits for the next command (rank 0 may wait for
        rollouts that long) before it gives up."""
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def send(self, command: int, payload: Any = None) -> None:
        data = msgpack.packb(payload, use_bin_type=True)
        dist.broadcast(torch.tensor([command, len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> tuple[int, Any]:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        data = torch.empty(int(header[1]), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        return int(header[0]), msgpack.unpackb(data.numpy().tobytes(), raw=False)
