"""The learner's DeepSpeed engine, set up for one process (on CPU: gloo backend).

DeepSpeed is imported here and nowhere else, after pointing it at the CPU accelerator
when no GPU is present, so `heterorl --help` stays instant and the rest of the code
never sees distributed set-up.
"""

from __future__ import annotations

import logging
import os

from pipeline.config import LearnerConfig
from pipeline.services import free_port


def make_engine(model, cfg: LearnerConfig):
    """A DeepSpeed engine with AdamW and ZeRO stage `cfg.zero_stage`, one step per batch."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not torch.distributed.is_initialized() and os.environ.get("WORLD_SIZE", "1") == "1":
        # One process: a private rendezvous on a free port. An inherited MASTER_PORT (say,
        # from a parent that ran a learner itself) would collide with the parent's.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
    import importlib

    import deepspeed

    # (not `import deepspeed.comm.torch as m`: deepspeed.comm's attribute `torch` is PyTorch)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")

    if os.environ.get("WORLD_SIZE", "1") == "1":
        # DeepSpeed JIT-compiles a shared-memory all-reduce kernel whenever it sets up
        # communication (about 40 s and a C++ compiler on first use). One process never
        # all-reduces over shared memory, and DeepSpeed skips the kernel when it is None.
        ds_comm_torch.build_shm_op = lambda: None
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl",
                                   verbose=False)
    ds_config = {
        "train_batch_size": 1,  # one backward per optimizer step; the batch is whole groups
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                  "betas": [0.9, 0.99], "eps": 1e-8, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.lr_warmup_steps > 0:
        # Linear from lr/warmup to lr: step k (0-based) uses lr·(k+1)/warmup, so none is wasted at 0.
        ds_config["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": cfg.lr / (cfg.lr_warmup_steps + 1), "warmup_max_lr": cfg.lr,
            "warmup_num_steps": cfg.lr_warmup_steps, "warmup_type": "linear"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.train()
    return engine
