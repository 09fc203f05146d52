"""The learner's DeepSpeed engine: ZeRO stage, ranks (the device and precision: `pipeline.devices`).

DeepSpeed is imported here and nowhere else, after pointing it at the CPU accelerator
when the model runs on the CPU, so `heterorl --help` stays instant and the rest of the
code never sees distributed set-up. One process sets up a private rendezvous; under a
launcher (`torchrun`, `deepspeed`, or `heterorl learner` starting its own ranks) the
usual RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables are used.

Gradient accumulation is ours (`pipeline.learning.update.optimizer_step`): the number of
micro-batches changes from step to step, so DeepSpeed runs with
`managed_gradient_accumulation: false` (backward only accumulates; `step()` reduces across
ranks and updates).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from dataclasses import dataclass

import torch

from pipeline.config import LearnerConfig
from pipeline.clients.services import free_port


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's data-parallel processes."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def leader(self) -> bool:
        """Rank 0 reads Kafka, keeps the update log and publishes checkpoints."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "Ranks":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                   int(os.environ.get("WORLD_SIZE", 1)))


# ---- DeepSpeed ---------------------------------------------------------------------------------

def deepspeed_config(cfg: LearnerConfig, world_size: int) -> dict:
    """The DeepSpeed configuration of a learner with these settings."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    ds = {
        "train_batch_size": world_size,  # bookkeeping only: our micro-batches are accumulated by hand
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "betas": [0.9, 0.99], "eps": 1e-8, "torch_adam": True}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW also with the optimizer offloaded: no op to build
        "bf16": {"enabled": cfg.precision == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.lr_warmup_steps > 0:
        # Linear from lr/warmup to lr: step k (0-based) uses lr·(k+1)/warmup, so none is wasted at 0.
        ds["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": cfg.lr / (cfg.lr_warmup_steps + 1), "warmup_max_lr": cfg.lr,
            "warmup_num_steps": cfg.lr_warmup_steps, "warmup_type": "linear"}}
    return ds


def init_distributed(device: torch.device, ranks: Ranks) -> None:
    """Point DeepSpeed at the device's accelerator and join the learner's process group."""
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized() and ranks.world_size == 1:
        # One process: a private rendezvous on a free port. An inherited MASTER_PORT (say,
        # from a parent that ran a learner itself) would collide with the parent's.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
    import deepspeed

    if device.type == "cpu":
        # DeepSpeed JIT-compiles a shared-memory all-reduce kernel whenever it sets up
        # communication on the CPU (about 40 s and a C++ compiler on first use). With None
        # it all-reduces through torch.distributed (gloo) instead.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", verbose=False)
        atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    """At exit: NCCL warns of leaked resources when a process group is never destroyed."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def begin_micro_batch(engine) -> None:
    """What DeepSpeed's own `engine.forward` does before a forward pass, for ours, which calls
    the model's decoder and LM head directly: tell the ZeRO optimizer a new micro-batch
    starts, so that its gradients add to those of the previous ones (ZeRO-3 overwrites them
    otherwise)."""
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):
        engine.optimizer.clear_backward_seen_flag()


def can_discard_gradients(engine) -> bool:
    """Whether `discard_gradients` can undo this engine's accumulated gradients: ZeRO stages 0,
    1 and 3 (tests/unit/test_update.py). Stage 2 reduces them into partition buffers it does not
    let go of short of a step."""
    return engine.zero_optimization_stage() != 2


def discard_gradients(engine) -> None:
    """Drop every gradient accumulated since the last step, as if no backward pass had run: what
    DeepSpeed itself does when it skips a step (an fp16 overflow). Every rank calls it."""
    stage = engine.zero_optimization_stage()
    if stage == 0:
        engine.zero_grad()
        return
    if stage == 2:
        raise RuntimeError("ZeRO stage 2 cannot discard accumulated gradients (can_discard_gradients)")
    optimizer = engine.optimizer
    optimizer.zero_grad(set_to_none=True)
    if stage == 1:
        optimizer.micro_step_id = -1  # as `step()` leaves it (stage 3's zero_grad resets its own)
    offloaded = getattr(optimizer, "offload_optimizer" if stage == 3 else "cpu_offload", False)
    if offloaded:
        optimizer.reset_cpu_buffers()
    elif stage == 3:
        optimizer.averaged_gradients = {}
    else:
        optimizer._release_preflattened_grad_buffers()
        for key in optimizer.averaged_gradients.keys():
            optimizer.averaged_gradients[key] = None
            optimizer.all_grad_tensors[key] = None


def make_deepspeed_engine(model, cfg: LearnerConfig, device: torch.device, ranks: Ranks = Ranks()):
    """A DeepSpeed engine for `model` on `device` with AdamW, the configured ZeRO stage,
    precision, gradient checkpointing and optimizer offload."""
    init_distributed(device, ranks)
    import deepspeed

    if cfg.gradient_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(cfg, ranks.world_size))
    engine.train()
    return engine
