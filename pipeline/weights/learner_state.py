"""The learner's training state in safetensors and JSON: nothing is pickled, nothing unpickled.

A checkpoint's `learner_state/` holds what a restarted learner needs, beside the Hugging
Face weights, so that it continues exactly where the saved one stopped:

    learner_state/optimizer.safetensors   per parameter (by its name in the model):
                                          "<name>/fp32" the fp32 master weight,
                                          "<name>/exp_avg", "<name>/exp_avg_sq" AdamW's
                                          moments; "rng/cpu" (and "rng/cuda") the RNG state
    learner_state/state.json              {"format", "adam_step", "lr", "scheduler",
                                           "global_steps", "global_samples",
                                           "zero_stage", "precision", "world_size"}

Every tensor is the whole parameter's, gathered from the ZeRO partitions through
DeepSpeed's `safe_get_full_*` calls, so the state is the same whatever the ZeRO stage
or the number of learner processes, and a learner may resume with another of either.
Saving and loading are collective: every rank calls them; rank 0 writes.

Why not DeepSpeed's own checkpoint calls: they write `.pt` files, a pickle-based format,
and reading one back unpickles it, so anyone who can write to the bucket could run code
in the learner at its next restart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from pipeline.devices import one_cpu_thread
from pipeline.weights.store import LEARNER_STATE_DIR
from pipeline.learning.engine import begin_micro_batch

STATE_FORMAT = "heterorl-learner-state/1"
TENSORS_FILE = "optimizer.safetensors"
META_FILE = "state.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


class LearnerStateError(ValueError):
    """A learner state that cannot be used (wrong format, missing parameters)."""


def _zero(engine) -> bool:
    return engine.zero_optimization_stage() > 0


def _base_optimizer(engine):
    """The torch AdamW under DeepSpeed (over ZeRO's fp32 partitions, or the module's own parameters)."""
    return engine.optimizer.optimizer if _zero(engine) else engine.optimizer


def _full(engine, param, key: str | None) -> torch.Tensor:
    """A CPU copy of the whole fp32 master weight (key None) or optimizer moment of one parameter
    (collective under ZeRO); a copy even where the engine's own is a CPU fp32 tensor."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _zero(engine):
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    else:
        value = param.detach() if key is None else engine.optimizer.state[param][key]
    return value.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()


def _set_full(engine, param, key: str | None, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if _zero(engine):
        if key is None:
            safe_set_full_fp32_param(param, value.to(engine.device))
        else:
            safe_set_full_optimizer_state(param, value.to(engine.device), key)
    else:
        target = param.data if key is None else engine.optimizer.state[param][key]
        target.copy_(value.to(target.device, target.dtype))


def _adam_step(engine) -> int:
    steps = {int(state["step"]) for state in _base_optimizer(engine).state.values() if "step" in state}
    return steps.pop() if len(steps) == 1 else 0


def save_weights(engine, tokenizer, directory: Path, leader: bool = True) -> None:
    """The model as a Hugging Face directory (safetensors weights, config, tokenizer) that
    `transformers` loads as is; under ZeRO-3 the partitions are gathered first. Every rank
    must call this; rank 0 writes."""
    weights = capture_weights(engine, leader)
    if leader:
        write_model_dir(engine.module, tokenizer, weights, directory)


def capture_weights(engine, leader: bool = True) -> dict[str, torch.Tensor] | None:
    """The model's state dict as CPU copies that the next step does not change (rank 0; None
    elsewhere), for `write_model_dir` to write later, on another thread. Tensors tied in the
    model (tied embeddings) stay one tensor here, so the directory stores them once. Every rank
    must call this (under ZeRO-3 the partitions are gathered)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if not leader:
            return None
        copies: dict[tuple, torch.Tensor] = {}
        return {name: copies.setdefault(id_of(t), t.detach().to("cpu", copy=True))
                for name, t in engine.module.state_dict().items()}


def id_of(tensor: torch.Tensor) -> tuple:
    """The same memory seen the same way: a tied parameter under two names. (Distinct parameters
    may share one storage: ZeRO flattens them into one buffer.)"""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def write_model_dir(module, tokenizer, weights: dict[str, torch.Tensor], directory: Path) -> None:
    """What `save_weights` writes, from weights `capture_weights` took: `module` gives only its
    config and which tensors are tied, so it may go on training meanwhile."""
    module.save_pretrained(directory, state_dict=dict(weights), safe_serialization=True)
    tokenizer.save_pretrained(directory)


@dataclass
class Capture:
    """One save of the learner taken in memory (`capture`), so that writing it to disk is left to
    the publisher's thread and the optimizer step waits only for the copies."""

    module: Any
    """The model, for its config and which tensors are tied (it goes on training meanwhile)."""
    tokenizer: Any
    weights: dict[str, torch.Tensor]
    learner_state: Optional[tuple[dict[str, torch.Tensor], dict]] = None

    def write(self, directory: Path) -> None:
        """The model directory, with `learner_state/` when the capture holds one."""
        write_model_dir(self.module, self.tokenizer, self.weights, directory)
        if self.learner_state is not None:
            write_learner_state(*self.learner_state, Path(directory) / LEARNER_STATE_DIR)


def capture(engine, tokenizer, *, state: bool, leader: bool = True) -> Optional[Capture]:
    """The weights, and the learner state if `state`, as in-memory copies (rank 0; None
    elsewhere). Every rank must call this."""
    on_cpu = next(engine.module.parameters()).device.type == "cpu"
    with one_cpu_thread(on_cpu):  # copies beside a sampler on the same cores
        weights = capture_weights(engine, leader)
        learner_state = capture_learner_state(engine, leader) if state else None
    return Capture(engine.module, tokenizer, weights, learner_state) if leader else None


def save_learner_state(engine, directory: Path, leader: bool = True) -> None:
    """Write `directory` (rank 0 only; every rank must call this)."""
    captured = capture_learner_state(engine, leader)
    if leader:
        write_learner_state(*captured, directory)


def capture_learner_state(engine, leader: bool = True) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(tensors, metadata) of the learner state as CPU copies the next step does not change (rank
    0; None elsewhere), for `write_learner_state`. Every rank must call this."""
    tensors: dict[str, torch.Tensor] = {}
    stepped = _adam_step(engine) > 0
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        tensors[f"{name}/fp32"] = _full(engine, param, None)
        if stepped:
            for key in MOMENTS:
                tensors[f"{name}/{key}"] = _full(engine, param, key)
    if not leader:
        return None
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {"format": STATE_FORMAT, "adam_step": _adam_step(engine),
            "lr": [group["lr"] for group in engine.optimizer.param_groups], "scheduler": scheduler,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "zero_stage": engine.zero_optimization_stage(), "precision": "bf16" if engine.bfloat16_enabled() else "fp32",
            "world_size": engine.world_size}
    return tensors, json.loads(json.dumps(meta))  # a copy: the scheduler's state lives on


def write_learner_state(tensors: dict[str, torch.Tensor], meta: dict, directory: Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / TENSORS_FILE))
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))


def load_learner_state(engine, directory: Path) -> dict:
    """Restore what `save_learner_state` wrote into a freshly made engine (every rank calls
    this); returns the metadata. Raises LearnerStateError if it does not fit the model."""
    directory = Path(directory)
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != STATE_FORMAT:
        raise LearnerStateError(f"{directory / META_FILE}: format {meta.get('format')!r} is not {STATE_FORMAT}")
    tensors = load_file(str(directory / TENSORS_FILE))  # safetensors: plain arrays, no code
    names = [name for name, param in engine.module.named_parameters() if param.requires_grad]
    missing = [n for n in names if f"{n}/fp32" not in tensors]
    if missing:
        raise LearnerStateError(f"{directory / TENSORS_FILE} lacks {len(missing)} parameters of the model "
                                f"(first: {missing[0]})")
    if meta["adam_step"] > 0:
        _materialize_optimizer_state(engine)
    params = dict(engine.module.named_parameters())
    for name in names:
        _set_full(engine, params[name], None, tensors[f"{name}/fp32"])
        if meta["adam_step"] > 0:
            for key in MOMENTS:
                _set_full(engine, params[name], key, tensors[f"{name}/{key}"])
    for state in _base_optimizer(engine).state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(meta["adam_step"])) if torch.is_tensor(state["step"]) \
                else meta["adam_step"]
    for group, lr in zip(engine.optimizer.param_groups, meta["lr"]):
        group["lr"] = lr
    if meta["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return meta


def _materialize_optimizer_state(engine) -> None:
    """AdamW creates its state at the first step: take one that changes nothing (zero
    gradients, learning rate 0), so that the saved moments have somewhere to go."""
    lrs = [group["lr"] for group in engine.optimizer.param_groups]
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    token = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
    begin_micro_batch(engine)
    out = engine.module(input_ids=token, use_cache=False)
    engine.backward(out.logits.float().sum() * 0.0, scale_wrt_gas=False)
    engine.step()
    for group, lr in zip(engine.optimizer.param_groups, lrs):
        group["lr"] = lr
