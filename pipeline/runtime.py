"""What every role does first: find the servers, open the clients, find the base model.

Kept in one place so the sampler, the learner, the evaluator and `train` connect the
same way and fail with the same one-line errors.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers.utils import logging as hf_logging

from pipeline.weights.store import CheckpointNotFound, CheckpointStore, Manifest, connect_s3
from pipeline.weights.policy import fetch_policy
from pipeline.weights.recovery import latest_state, recovery_store
from pipeline.config import HeteroConfig
from pipeline.devices import resolve_device, resolve_precision
from pipeline.trust.keyring import trusted_learner
from pipeline.models import DTYPES, attention_kernel, evaluate_policy, load_policy, resolve_model
from pipeline.models.cache import INFO_FILE, is_complete
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import Services, check_reachable, require_services
from pipeline.wire.signing import SigningKey
from pipeline.tasks import make_task


@dataclass
class RunHandles:
    services: Services
    state: RunState
    store: CheckpointStore


def connect_run(cfg: HeteroConfig, signer: Optional[SigningKey] = None) -> RunHandles:
    """Resolve the services, check each answers, open Redis and S3 clients for this run.

    With `security.require_signatures` the store reads only manifests signed by the learner
    key it pins (`security.learner_public_key`); `signer` (the learner's key) signs what it
    publishes."""
    services = require_services(cfg.services)
    check_reachable(services, timeout_s=cfg.services.connect_timeout_s)
    trusted = trusted_learner(cfg)
    redis_client = connect_redis(services.redis_url, timeout_s=cfg.services.connect_timeout_s,
                                 security=services.security)
    s3 = connect_s3(services, timeout_s=cfg.services.connect_timeout_s)
    return RunHandles(services, RunState(redis_client, cfg.run.name),
                      CheckpointStore(s3, services.bucket, cfg.run.name, signer=signer, trusted=trusted))


def with_machine_precision(cfg: HeteroConfig, device) -> tuple[HeteroConfig, str]:
    """`cfg` with `precision: auto` (learner and sampler) replaced by what this machine does
    fastest (`pipeline.devices.machine_precision`), and a line saying what was chosen and why.
    Every role calls it once at its start, on its own machine, so the rest of the code sees
    `fp32` or `bf16` only.

    `auto` picks what learns, not only what is fast: bf16 only where the learner and the
    sampler then compute the same bits for the same tokens, which `model.attention: auto`
    (eager in bf16) gives; with `model.attention: sdpa` their bf16 log-probs disagree (on-policy
    KL 2.8e-3 on SmolLM2-135M, docs/learner.md "Half precision"), so `auto` keeps fp32."""
    learner, why_learner = _learning_precision(cfg, cfg.learner.precision, device)
    sampler, why_sampler = _learning_precision(cfg, cfg.sampler.precision, device)
    cfg = cfg.model_copy(update={"learner": with_bf16_stage(cfg.learner.model_copy(update={"precision": learner})),
                                 "sampler": cfg.sampler.model_copy(update={"precision": sampler})})
    reasons = sorted({why for why in (why_learner, why_sampler) if why != "as configured"})
    line = f"precision: learner {learner}, sampling {sampler}" + (f" ({'; '.join(reasons)})" if reasons else "")
    return cfg, line


def with_bf16_stage(learner):
    """`learner` (a LearnerConfig) at ZeRO stage 1 where bf16 runs at stage 0: DeepSpeed keeps
    bf16's fp32 master weights in its ZeRO optimizer (one process: the same step)."""
    if learner.precision == "bf16" and learner.zero_stage == 0:
        return learner.model_copy(update={"zero_stage": 1})
    return learner


def learner_attention(cfg: HeteroConfig) -> str:
    """The attention kernel a learner (or a replay) loads its model with: it loads in fp32 and
    DeepSpeed casts it to `learner.precision`, whose kernel it then runs (`model.attention`)."""
    return attention_kernel(DTYPES[cfg.learner.precision], cfg.model.attention)


NUMERIC_SETTINGS = {"precision": "learner.precision", "half_rounding": "learner.half_rounding",
                    "attention": "model.attention", "torch_threads": "learner.torch_threads",
                    "zero_stage": "learner.zero_stage", "micro_batch_tokens": "learner.micro_batch_tokens"}
"""What decides a learner step's bits besides its data and weights, by the config key that sets
it: a replay takes each from the run it replays (`adopt_numerics`). The precision is the one
chosen (`with_machine_precision`), the attention the kernel run (`learner_attention`)."""
NUMERIC_FACTS = ("machine", "torch")
"""What decides them too but no config sets: the machine (its CPU kind or GPU) and torch's version."""


def learner_numerics(cfg: HeteroConfig, device) -> dict:
    """The numerics of a learner (or replay) with `cfg`, its precision already chosen, on `device`:
    `NUMERIC_SETTINGS` and `NUMERIC_FACTS`, written into every update-log entry."""
    from pipeline.devices import cpu_kind

    settings = {name: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
                for name, key in NUMERIC_SETTINGS.items()}
    settings["attention"] = learner_attention(cfg)  # the kernel run, not the setting (`auto`)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_kind()
    return {**settings, "machine": machine, "torch": torch.__version__}


def adopt_numerics(cfg: HeteroConfig, recorded: dict, mine: dict, chosen: set[str]) -> tuple[HeteroConfig, list[str],
                                                                                             list[str]]:
    """`cfg` with each of `NUMERIC_SETTINGS` as the `recorded` run had it, unless the user
    `chosen` its key (`--set`); (the new cfg, what was taken "key value (was …)", what still
    differs "what: recorded … here …"). `mine`: `learner_numerics` of `cfg` here. A replay whose
    differences are not empty will not reproduce the original's bits."""
    taken, differs, updates = [], [], {}
    for name, key in NUMERIC_SETTINGS.items():
        if name not in recorded or recorded[name] == mine.get(name):
            continue
        if key in chosen:
            differs.append(f"{key}: recorded {recorded[name]}, here {mine.get(name)} (set here)")
            continue
        section, field_name = key.split(".")
        updates.setdefault(section, {})[field_name] = recorded[name]
        taken.append(f"{key} {recorded[name]} (was {mine.get(name)})")
    for name in NUMERIC_FACTS:
        if name in recorded and recorded[name] != mine.get(name):
            differs.append(f"{name}: recorded {recorded[name]}, here {mine.get(name)}")
    for section, fields in updates.items():
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})
    # a recorded bf16 beside a ZeRO stage the user set to 0: the stage bf16 needs, as everywhere
    return cfg.model_copy(update={"learner": with_bf16_stage(cfg.learner)}), taken, differs


def _learning_precision(cfg: HeteroConfig, setting: str, device) -> tuple[str, str]:
    """`resolve_precision`, with `auto` kept at fp32 where bf16 would not learn like it."""
    chosen, why = resolve_precision(setting, device)
    if setting != "auto" or chosen != "bf16":
        return chosen, why
    if cfg.model.attention == "sdpa":
        return "fp32", (f"{why}, but model.attention=sdpa gives the sampler's and the learner's bf16 "
                        "log-probs different bits")
    kernel = attention_kernel(torch.bfloat16, cfg.model.attention)
    return chosen, (f"{why}; {kernel} attention gives the learner's and a PyTorch sampler's log-probs the same bits "
                    "(vLLM runs kernels of its own: mismatch_* in the metrics)")


def base_model_settings(cfg: HeteroConfig) -> dict:
    """The builtin model's settings (pipeline.models.tiny.BaseModelSettings), from the config."""
    m, t = cfg.model, cfg.task
    # The generated tasks' held-out splits depend on neither seed nor eval_size: leave them out
    # of the cache key, so runs that differ only in those share a base model.
    if t.name == "arithmetic":
        task_settings = {"digits": t.digits, "ops": t.ops}
    elif t.name == "scratchpad_sum":
        task_settings = {"terms": t.terms, "digits": t.digits}
    else:
        task_settings = t.task_settings()
    return {
        "task": t.name,
        "task_settings": task_settings,
        "size": {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads, "head_dim": m.head_dim,
                 "intermediate_size": m.intermediate_size, "max_positions": m.max_positions},
        "warmup_steps": m.warmup_steps, "warmup_batch_size": m.warmup_batch_size, "warmup_lr": m.warmup_lr,
        "warmup_check_every": m.warmup_check_every,
        "warmup_target_accuracy": m.warmup_target_accuracy, "warmup_label_smoothing": m.warmup_label_smoothing,
        "seed": m.seed,
    }


def resolve_base_model(cfg: HeteroConfig) -> Path:
    """The local model directory `model.base` names (pipeline.models.sources): a built-in
    model, a GGUF file or a Hub model made once into `<data_dir>/models`, or your directory."""
    def tiny(cache_dir: Path) -> Path:
        from pipeline.models.tiny import ensure_base_model

        return ensure_base_model(cache_dir, base_model_settings(cfg))

    return resolve_model(cfg.model.base, Path(cfg.services.data_dir) / "models", tiny)


def make_task_from_config(cfg: HeteroConfig):
    return make_task(cfg.task.name, **cfg.task.task_settings())


def evaluate_checkpoint(cfg: HeteroConfig, model_dir: Path, task, progress=None) -> dict:
    """Held-out accuracy of one model directory: sampled (eval.n_samples per problem) and greedy,
    at the samplers' precision (`sampler.precision`), as the policy is used. The model's memory
    goes back to the system afterwards (`heterorl train` then sits beside its processes)."""
    device = resolve_device(cfg.model.device)
    cfg, _ = with_machine_precision(cfg, device)  # `auto`, for commands that evaluate before any role starts
    model, tokenizer = load_policy(model_dir, device, DTYPES[cfg.sampler.precision], cfg.model.attention)
    try:
        return evaluate_model(cfg, model, tokenizer, task, progress)
    finally:
        del model
        release_memory()


BASE_EVALUATION_VERSION = 1
"""Part of every stored base evaluation's key: raise it when evaluation itself changes."""


def evaluate_base(cfg: HeteroConfig, model_dir: Path, task, progress=None) -> dict:
    """evaluate_checkpoint for a run's base model, computed once and kept beside it.

    A model from the model cache (`<data_dir>/models/<name>`, finished, its info file written
    last; a rebuilt one has a new info file) never changes, and evaluation is seeded
    (`run.seed`), so the same model, task, evaluation and sampling settings and seed give the
    same numbers: they are stored in
    `<data_dir>/models/evaluations/<model>-<key>.json` and reused, which spares each cell of a
    study the same minutes-long evaluation of the same base model. Any other directory, or any
    with `eval.reuse_base` off, is evaluated afresh. `progress`: as `evaluate_policy`'s, called
    only when it evaluates."""
    cache = (Path(cfg.services.data_dir) / "models").resolve()
    if not (cfg.eval.reuse_base and is_complete(model_dir) and model_dir.resolve().parent == cache):
        return evaluate_checkpoint(cfg, model_dir, task, progress)
    cfg, _ = with_machine_precision(cfg, resolve_device(cfg.model.device))
    s = cfg.sampler
    key = hashlib.sha256(json.dumps({
        "version": BASE_EVALUATION_VERSION, "model": (model_dir / INFO_FILE).read_text(),
        "task": cfg.task.model_dump(mode="json"),
        "task_settings": task.settings(),  # with the data files' sha256, if any
        "eval": cfg.eval.model_dump(mode="json", exclude={"every", "torch_threads", "after_training", "reuse_base"}),
        "sampling": [s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.precision], "seed": cfg.run.seed,
        "device": str(resolve_device(cfg.model.device))}, sort_keys=True, default=str).encode()).hexdigest()[:16]
    stored = model_dir.parent / "evaluations" / f"{model_dir.name}-{key}.json"
    if stored.is_file():
        logging.getLogger("heterorl.runtime").info("held-out accuracy of %s: reused from %s", model_dir.name, stored)
        return json.loads(stored.read_text())
    result = evaluate_checkpoint(cfg, model_dir, task, progress)
    stored.parent.mkdir(exist_ok=True)
    tmp = stored.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, stored)
    return result


def release_memory() -> None:
    """Give freed memory back to the system: glibc keeps a process's freed heap for reuse, so
    after a SmolLM2 evaluation an idle supervisor held 3.3 GB; `malloc_trim` returns it. On a
    GPU, PyTorch's allocator likewise keeps freed blocks: after its 6 s base evaluation each
    `heterorl train` supervisor held 3.7 GiB of an H200 while its cell ran
    (docs/results/smollm2_study/gpu_h200_partial/); `empty_cache` returns them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def evaluate_published(cfg: HeteroConfig, store: CheckpointStore, manifest_key: str, work_dir: Path, task,
                       version: Optional[int] = None, progress=None) -> dict:
    """Held-out accuracy of a published version: downloaded (every sha256 verified like a
    sampler's, and refused if its manifest is not of `version`), scored, and deleted again."""
    model_dir, _, _ = fetch_policy(store, manifest_key, work_dir, expect_version=version)
    try:
        return evaluate_checkpoint(cfg, model_dir, task, progress)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def evaluate_final_state(cfg: HeteroConfig, store: CheckpointStore, work_dir: Path, task) -> tuple[dict, Manifest]:
    """Held-out accuracy of the learner's newest recovery state (its own weights, whole: no
    chain of deltas to rebuild) and that state's manifest (the offsets and last verdicts an
    audit needs). CheckpointNotFound if the run wrote none."""
    states = recovery_store(store)
    state = latest_state(states)
    if state is None:
        raise CheckpointNotFound(f"run {store.run} has no recovery state in s3://{store.bucket}/{states.run}/")
    model_dir, _ = states.fetch(state.key, work_dir)
    try:
        return evaluate_checkpoint(cfg, model_dir, task), state
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def evaluate_model(cfg: HeteroConfig, model, tokenizer, task, progress=None) -> dict:
    """evaluate_checkpoint for a model already in memory (replay scores its own weights)."""
    problems = held_out_problems(cfg, task)
    return evaluate_policy(model, tokenizer, task, problems, n_samples=cfg.eval.n_samples,
                           temperature=cfg.sampler.temperature, greedy=cfg.eval.greedy,
                           max_new_tokens=cfg.sampler.max_new_tokens, seed=cfg.run.seed,
                           top_p=cfg.sampler.top_p, top_k=cfg.sampler.top_k, progress=progress)


def touch_heartbeat_file() -> None:
    """Liveness for container health checks (infra/Dockerfile): touch $HETERORL_HEARTBEAT_FILE."""
    path = os.environ.get("HETERORL_HEARTBEAT_FILE")
    if path:
        Path(path).touch()


def setup_logging(role: str, verbose: bool = False) -> logging.Logger:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("kafka", "urllib3", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()  # one bar per weight reload would drown the log
    return logging.getLogger(role)


def held_out_problems(cfg: HeteroConfig, task) -> list:
    """The held-out problems an evaluation scores: the first `eval.problems` (all if unset)."""
    return task.eval_problems()[: cfg.eval.problems] if cfg.eval.problems else task.eval_problems()


def evaluation_completions(cfg: HeteroConfig, task) -> int:
    """How many completions one held-out evaluation decodes (a progress bar's total)."""
    return len(held_out_problems(cfg, task)) * (cfg.eval.n_samples + (1 if cfg.eval.greedy else 0))

