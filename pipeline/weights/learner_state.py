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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.engine import begin_micro_batch

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
    """The whole fp32 master weight (key None) or optimizer moment of one parameter (collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _zero(engine):
        value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    else:
        value = param.detach() if key is None else engine.optimizer.state[param][key]
    return value.detach().float().cpu().contiguous()


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
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if leader:
            engine.module.save_pretrained(directory, safe_serialization=True)
            tokenizer.save_pretrained(directory)


def save_learner_state(engine, directory: Path, leader: bool = True) -> None:
    """Write `directory` (rank 0 only; every rank must call this)."""
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
        return
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / TENSORS_FILE))
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {"format": STATE_FORMAT, "adam_step": _adam_step(engine),
            "lr": [group["lr"] for group in engine.optimizer.param_groups], "scheduler": scheduler,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "zero_stage": engine.zero_optimization_stage(), "precision": "bf16" if engine.bfloat16_enabled() else "fp32",
            "world_size": engine.world_size}
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
