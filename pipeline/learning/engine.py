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
import gc
import importlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

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
        # Linear from lr/(warmup+1) to lr, none at 0: DeepSpeed sets the first value when it builds the
        # scheduler and again at the first step's end, so steps 0 and 1 (0-based) use lr/(warmup+1)
        # and step k after them lr·k/(warmup+1) (bench/trl_lane.py's `warmup_factor` mirrors it).
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
        atexit.register(leave_process_group)


def leave_process_group(together: bool = False) -> None:
    """Destroy the process group (NCCL warns of leaked resources when one is never destroyed; at
    exit this runs by itself). `together`: the learner's coordinated end (rank 0 sent STOP, the
    others received it): under gloo the ranks first meet, for at most a minute, so that none
    tears its connections down while another still has work in flight on them (a rank that left
    first could end the other with SIGABRT, "terminate called without an active exception").
    A rank ending on an error does not wait for the others."""
    if not torch.distributed.is_initialized():
        return
    if together and torch.distributed.get_backend() == "gloo" and torch.distributed.get_world_size() > 1:
        try:
            torch.distributed.monitored_barrier(timeout=timedelta(seconds=60))
        except RuntimeError:  # a rank that ended first (say, killed): leave without it
            pass
    gc.collect()  # work objects that still hold tensors go while the interpreter is whole
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
    if cfg.precision == "bf16" and cfg.half_rounding == "dithered":
        engine.heterorl_half_rounding = DitheredRounding(engine)
    return engine



DITHER_BLOCK = 1 << 22
"""Weights per block of dithering thresholds: each block's come from a generator seeded with
its position, so a weight's threshold depends on its place in the model, not on the ranks."""


class DitheredRounding:
    """How a bf16 learner's weights (what its forward computes with and what it publishes)
    follow their fp32 masters after each optimizer step (`learner.half_rounding: dithered`).

    DeepSpeed rounds each master to the nearest bf16, which keeps a weight where it is until its
    master has moved half a bf16 step (2^-9 of its size) away. At a learning rate of 2e-6 Adam
    moves SmolLM2-135M's masters by about 1e-6 a step: after 10 steps 3 % of the bf16 weights had
    changed at all, and their mean change was 1/16 of the masters' (docs/results/precision/), so
    the policy that samples and learns barely moves. Here each weight has a fixed threshold t in
    [0, 1) of a bf16 step, drawn once from a seed and its position, and its master rounds up
    (away from zero) when the master's fraction of a step reaches 1 - t: over the weights the bf16
    copy moves as the masters do (the same mean change to 4 digits in that test), yet a weight
    still changes only when its master crosses its own threshold, so successive versions differ
    in about as few weights as under rounding to nearest and their deltas stay small. The
    rounding is a function of the masters alone: a replay, a resumed learner or another rank
    computes the same bits. Each rank rounds the flat fp32 partition it holds: under ZeRO 1 and 2
    a weight's threshold follows its place in the model, under ZeRO 3 (whose partitions are
    slices of every weight) its place in the rank's partition, so a ZeRO-3 replay needs the same
    number of ranks. Thresholds are kept in host memory on a CPU and drawn again each step on a
    GPU."""

    def __init__(self, engine):
        self.optimizer = engine.optimizer
        self.kept: dict[tuple, torch.Tensor] = {}
        """Thresholds by (flat tensor, block), kept where they are drawn on the CPU."""

    def thresholds(self, key: tuple, block: int, device: torch.device) -> torch.Tensor:
        """The int32 thresholds (in [0, 2^16)) of block `block` (DITHER_BLOCK weights) of the flat
        tensor `key` names."""
        if (key, block) in self.kept:
            return self.kept[key, block]
        seed = HALF_ROUNDING_SEED
        for part in (*key, block):
            seed = (seed * 1_000_003 + part) % 2**63
        drawn = torch.randint(0, 1 << 16, (DITHER_BLOCK,), dtype=torch.int32, device=device,
                              generator=torch.Generator(device=device).manual_seed(seed))
        if device.type == "cpu":
            self.kept[key, block] = drawn
        return drawn

    def round_into(self, target: torch.Tensor, master: torch.Tensor, key: tuple, start: int) -> None:
        """`target` (bf16) = `master` (fp32, the weights start.. of the flat tensor `key` names)
        dithered, a block of DITHER_BLOCK weights at a time (no second copy of the partition)."""
        bits = master.detach().view(torch.int32)
        done = 0
        while done < bits.numel():
            block, offset = divmod(start + done, DITHER_BLOCK)
            count = min(DITHER_BLOCK - offset, bits.numel() - done)
            part = bits[done:done + count]
            # bf16 is the upper half of an fp32's bits: adding the threshold to the lower half and
            # truncating rounds the magnitude up by one bf16 step (a carry into the exponent where
            # due) exactly when the fraction of a step reaches 1 - t.
            rounded = (part + self.thresholds(key, block, bits.device)[offset:offset + count])
            rounded = rounded.bitwise_and_(-(1 << 16)).view(torch.float32)
            value = part.view(torch.float32)
            target[done:done + count].copy_(torch.where(value.isnan(), value, rounded))  # a NaN stays one
            done += count

    @torch.no_grad()
    def __call__(self) -> None:
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import all_gather_dp_groups

        opt = self.optimizer
        if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO 3: partitions gathered where used
            rank, world = dist.get_rank(), dist.get_world_size()
            for group, (bit16, fp32) in enumerate(zip(opt.fp16_partitioned_groups_flat,
                                                      opt.fp32_partitioned_groups_flat)):
                if bit16 is not None and fp32.numel() == bit16.numel():  # (else swapped out: DeepSpeed's rounding)
                    self.round_into(bit16, fp32, (3, group, rank, world), 0)
            persistent = opt.persistent_parameters
            if persistent:  # the small weights DeepSpeed keeps gathered: gathered again from the new partitions
                persistent[0].partition(persistent)
                persistent[0].all_gather(persistent)
            return
        for group, (bit16_partitions, fp32_partition) in enumerate(
                zip(opt.parallel_partitioned_bit16_groups, opt.single_partition_of_fp32_groups)):
            rank = dist.get_rank(group=opt.real_dp_process_group[group])
            self.round_into(bit16_partitions[rank], fp32_partition, (group,), rank * fp32_partition.numel())
        if dist.get_world_size() > 1:
            all_gather_dp_groups(groups_flat=opt.bit16_groups_flat,
                                 partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                                 dp_process_group=opt.real_dp_process_group,
                                 start_alignment_factor=opt.nccl_start_alignment_factor,
                                 allgather_bucket_size=opt.allgather_bucket_size)


HALF_ROUNDING_SEED = 0x5EEDB16
"""Seeds the thresholds of `DitheredRounding` (with the flat group and block)."""


def round_half_weights(engine) -> None:
    """After `engine.step()`: the bf16 weights from their masters as `learner.half_rounding`
    says (nothing to do for fp32, or for `nearest`, which DeepSpeed's step has done)."""
    rounding = getattr(engine, "heterorl_half_rounding", None)
    if rounding is not None:
        rounding()
