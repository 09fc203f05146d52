"""The learner's other processes: ranks 1..N-1 of a learner of `learner.num_processes`.

Rank 0 (`consumers.learner.Learner`) reads Kafka, decides, and sends each rank what to do
over `pipeline.learning.rank_link`: start from these weights, train on these groups, join a
save, stop. A rank of its own (`LearnerRank`) trains its share of every step and takes part
in every collective a save needs (gathering ZeRO-3 partitions, the optimizer state).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from pipeline.config import HeteroConfig
from pipeline.learning.engine import Ranks, init_distributed, leave_process_group, make_deepspeed_engine
from pipeline.devices import resolve_device
from pipeline.learning.rank_link import NAMES, SAVE, START, STOP, TRAIN, RankLink
from pipeline.learning.update import FreshCheck, StepRefused, optimizer_step
from pipeline.models import load_policy
from pipeline.runtime import connect_run, learner_attention, setup_logging, with_machine_precision
from pipeline.weights.store import LEARNER_STATE_DIR
from pipeline.clients.services import free_port
from pipeline.weights.learner_state import capture, load_learner_state
from pipeline.weights.publisher import copy_weights_into
from pipeline.weights.recovery import recovery_store
from pipeline.wire.rollout import decode_rollout


def start_engine(cfg: HeteroConfig, model_dir: Path, device, ranks: Ranks, log, *, resuming: bool):
    """(DeepSpeed engine, tokenizer) from a model directory (the base model, or the checkpoint
    a learner resumes from), with its learner state if it has one."""
    # DeepSpeed moves it to model.device and casts it to the learner's precision, whose kernel it runs
    model, tokenizer = load_policy(model_dir, attention=learner_attention(cfg))
    engine = make_deepspeed_engine(model, cfg.learner, device, ranks)
    if (model_dir / LEARNER_STATE_DIR).is_dir():
        # AdamW moments, LR schedule and step count, so the resumed run continues exactly.
        load_learner_state(engine, model_dir / LEARNER_STATE_DIR)
    elif resuming:
        log.warning("checkpoint %s has no learner state: continuing with a fresh optimizer", model_dir.name)
    return engine, tokenizer


def open_rank_link(device, ranks: Ranks, lcfg) -> Optional[RankLink]:
    """The command channel from rank 0 to the others (None for a single process)."""
    if ranks.world_size == 1:
        return None
    init_distributed(device, ranks)
    # Rank 0 may wait for rollouts up to learner.idle_timeout_s between two commands.
    return RankLink(timeout_s=lcfg.idle_timeout_s + 600)


class LearnerRank:
    """A learner process of rank > 0: trains its share of each step rank 0 sends and joins
    its checkpoint saves; it reads no Kafka and writes no log of its own."""

    def __init__(self, cfg: HeteroConfig):
        self.ranks = Ranks.from_env()
        self.log = setup_logging(f"learner r{self.ranks.rank}")
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a drain is rank 0's to do
        self.device = resolve_device(cfg.model.device, self.ranks.local_rank)
        self.cfg, _ = with_machine_precision(cfg, self.device)
        self.lcfg = self.cfg.learner

    def run(self) -> int:
        torch.set_num_threads(self.lcfg.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        link = open_rank_link(self.device, self.ranks, self.lcfg)
        command, start = link.receive()
        if command != START:
            raise RuntimeError(f"rank {self.ranks.rank} expected start from rank 0, got {NAMES.get(command)}")
        with tempfile.TemporaryDirectory(prefix=f".learner-r{self.ranks.rank}-") as work:
            if start["base"] is not None:
                model_dir = Path(start["base"])
            else:  # the recovery state rank 0 resumes from, fetched and verified here too
                model_dir, _ = recovery_store(connect_run(self.cfg).store).fetch(
                    start["manifest_key"], Path(work) / "resume", learner_state=True)
            engine, tokenizer = start_engine(self.cfg, model_dir, self.device, self.ranks, self.log,
                                             resuming=start["base"] is None)
            self.log.info("rank %d of %d ready on %s", self.ranks.rank, self.ranks.world_size, self.device)
            while True:
                command, payload = link.receive()
                if command == TRAIN:
                    check = payload.get("fresh_check")
                    try:
                        optimizer_step(engine, [decode_rollout(g) for g in payload["groups"]], payload["weights"],
                                       self.lcfg, temperature=self.cfg.sampler.temperature,
                                       max_completion_length=self.cfg.sampler.max_new_tokens, ranks=self.ranks,
                                       fresh_check=None if check is None else FreshCheck(tuple(check),
                                                                                         payload["threshold"]))
                    except StepRefused:
                        # optimizer_step has already discarded this rank's gradients; rank 0 saw
                        # the same all-reduced log-probs, refused the same step and reports it
                        continue
                elif command == SAVE:
                    if payload.get("policy"):
                        copy_weights_into(engine.module, None, zero3=engine.zero_optimization_stage() == 3)
                    if payload["state"]:
                        capture(engine, tokenizer, state=True, leader=False)
                elif command == STOP:
                    leave_process_group(together=True)  # with rank 0, which leaves after sending STOP
                    return 0


def spawn_ranks(cfg: HeteroConfig, world_size: int) -> list[subprocess.Popen]:
    """Ranks 1..N-1 of a learner started without a launcher, as child processes of rank 0
    (this process becomes rank 0). They get the whole config, services included, in their
    environment, and end when rank 0 does."""
    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE=str(world_size))
    children = []
    for rank in range(1, world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), RANK_CONFIG_ENV: cfg.model_dump_json()}
        children.append(subprocess.Popen([sys.executable, "-c", "from consumers.learner_ranks import run_rank; "
                                          "run_rank()"], env=env, preexec_fn=_die_with_parent))
    return children


RANK_CONFIG_ENV = "HETERORL_LEARNER_CONFIG"
"""A spawned rank's config (JSON, secrets included: it lives only in that process's environment)."""


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when rank 0 dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_rank() -> None:
    """Entry point of a rank spawned by `spawn_ranks`."""
    sys.exit(LearnerRank(HeteroConfig.model_validate_json(os.environ[RANK_CONFIG_ENV])).run())
