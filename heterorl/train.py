"""`heterorl train`: the main job, one command from nothing to a trained policy and a report.

  1. servers: the configured ones, else the running local stack, else start one;
  2. the base model (the builtin one is warmed up once and cached);
  3. one learner and `train.num_samplers` samplers as separate processes, each with its
     own log in RUN_DIR/logs/, with live progress read from RUN_DIR/metrics.jsonl; under
     `train.fast_start` the samplers load v0 from the base model's files and the base
     model's held-out accuracy is measured beside them (a GPU) or after training (a shared
     CPU: `base_evaluation_when`), else before they start; under
     `train.weights_by_shared_memory` each version reaches them through /dev/shm;
  4. once the learner has published its last version: stop the samplers, evaluate the
     final checkpoint (downloaded from S3 and verified like any sampler would);
  5. summary.json and a PNG plot, then stop whatever this command started.

The run name is `run.name` plus a timestamp, so repeated runs on one stack never mix
their topics, checkpoints or versions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from heterorl.keys import provision_local
from heterorl.processes import IDLE, Processes, RunFailed, child_env
from heterorl.report import plot_run
from heterorl.stack import as_role, services_for_run
from heterorl.wandb_log import WandbLogger
from pipeline.config import HeteroConfig, dump_config
from pipeline.sampling.generation import check_backend_available
from pipeline.trust.keyring import init_keys, key_paths
from pipeline.errors import UserError
from pipeline.records.metrics import MetricsTail, MetricsWriter, read_metrics
from pipeline.models.sources import classify
from pipeline.weights.same_host import base_digest
from pipeline.devices import cpu_kind, resolve_device
from pipeline.runtime import (connect_run, evaluate_base, evaluate_published, evaluation_completions,
                              make_task_from_config,
                              resolve_base_model, setup_logging, with_machine_precision)


def completion_bar(desc: str, total: int) -> tqdm:
    """One evaluation's bar, in completions decoded (the base model's, and the evaluator's)."""
    return tqdm(total=total, desc=desc, unit="completion", dynamic_ncols=True, file=sys.stderr)


@contextlib.contextmanager
def evaluation_bar(desc: str, total: int):
    """A progress bar for one held-out evaluation, in the style of the `train` bar: yields the
    `progress` callback evaluation calls with completions decoded; the bar appears on the first
    call (a reused evaluation shows none) and closes at the end."""
    state = {"bar": None, "done": 0.0}

    def progress(completions: float) -> None:
        if state["bar"] is None:
            state["bar"] = completion_bar(desc, total)
        state["done"] += completions
        state["bar"].update(min(total, round(state["done"])) - state["bar"].n)
    try:
        yield progress
    finally:
        if state["bar"] is not None:
            state["bar"].close()


def watch(cfg: HeteroConfig, procs: Processes, run_dir: Path, on_tick=None) -> None:
    """Show live progress until the learner exits; RunFailed if it or every sampler fails.
    `on_tick`, if given, is called every half second (the W&B logger's poll)."""
    learner_records = MetricsTail(run_dir / "metrics.jsonl", "learner")
    started = time.monotonic()
    bar = tqdm(total=cfg.learner.max_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    try:
        while True:
            records = learner_records.new_records()
            if records:
                r = records[-1]
                bar.update(r["step"] - bar.n)
                bar.set_postfix_str(
                    f"v{r['policy_version']} train-acc {r['reward_mean']:.2f} stale {r['staleness_mean']:.1f}"
                    f"/{r['staleness_max']} kept {r['groups_used']} dropped {r['groups_dropped']} "
                    f"{r['groups_per_s']:.1f} groups/s")
            code = procs.procs["learner"].poll()
            if code is not None:
                if code != 0:
                    raise procs.failure("learner", f"learner exited with code {code}")
                return
            samplers = [n for n in procs.procs if n.startswith("sampler")]
            if samplers and not any(procs.alive(n) for n in samplers):
                raise procs.failure(samplers[0], "every sampler exited")
            if time.monotonic() - started > cfg.train.timeout_s:
                raise RunFailed(f"run exceeded train.timeout_s={cfg.train.timeout_s:.0f}s")
            if on_tick is not None:
                on_tick()
            time.sleep(0.5)
    finally:
        bar.close()


def follow_evaluator(evaluator: subprocess.Popen, state, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the evaluator to score the versions it still holds, with a
    bar for each evaluation it reports (`RunState.report_evaluation`); whether it exited."""
    deadline = time.monotonic() + timeout_s
    finished = state.evaluation_progress()  # an evaluation that ended before training did gets no bar
    shown, bar = None, None

    def show(p: Optional[dict]) -> None:
        nonlocal shown, bar
        if p is not None and p != finished and (p["version"], p["total"]) != shown:
            if bar is not None:
                bar.close()
            shown = (p["version"], p["total"])
            bar = completion_bar(f"v{p['version']} eval", p["total"])
        if bar is not None and p is not None and (p["version"], p["total"]) == shown:
            bar.update(p["done"] - bar.n)
    try:
        while evaluator.poll() is None and time.monotonic() < deadline:
            show(state.evaluation_progress())
            time.sleep(0.5)
        show(state.evaluation_progress())  # its last report, made just before it exited
    finally:
        if bar is not None:
            bar.close()
    return evaluator.poll() is not None


SAMPLER_NICE, EVALUATOR_NICE = 10, 19
"""CPU priorities below the learner's under `train.cpu_sharing: priority` (the evaluator's also under `split`)."""


EVALUATION_S = 600
"""The longest one evaluation held back to the end of training (`eval.after_training`) is waited for."""


def cpu_budgets(cfg: HeteroConfig, cores: int, on_gpu: bool = False) -> dict[str, tuple[int, int]]:
    """Role -> (torch threads, nice) of the processes `train` starts on a machine of `cores`
    cores, by `train.cpu_sharing` (its docstring says why each). With the model on a GPU
    (`on_gpu`) the roles compute there and mostly wait on it: the configured threads, at equal
    priority, and nobody yields (`cpu_sharing` is about a model on the CPU)."""
    sharing, samplers = ("none" if on_gpu else cfg.train.cpu_sharing), cfg.train.num_samplers
    if sharing == "yield":
        return {"learner": (cores, 0), "sampler": (cores, 0), "evaluator": (cores, IDLE)}
    if sharing == "priority":
        return {"learner": (cores, 0), "sampler": (cores, SAMPLER_NICE), "evaluator": (cores, EVALUATOR_NICE)}
    if sharing == "split":
        sampler_threads = cfg.sampler.torch_threads
        return {"learner": (max(1, cores - samplers * sampler_threads), 0), "sampler": (sampler_threads, 0),
                "evaluator": (cfg.eval.torch_threads, EVALUATOR_NICE)}
    return {"learner": (cfg.learner.torch_threads, 0), "sampler": (cfg.sampler.torch_threads, 0),
            "evaluator": (cfg.eval.torch_threads, 0)}


SHARED_MEMORY = Path("/dev/shm")


def shared_memory_dir(run_name: str) -> Optional[Path]:
    """Where the run's learner writes each version for its samplers here (`train.weights_by_shared_memory`):
    a directory of its own in /dev/shm; None where there is no /dev/shm this process may write to."""
    if not (SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)):
        return None
    return SHARED_MEMORY / f"heterorl-{run_name}-{os.getpid()}"


def roles_config(cfg: HeteroConfig, budgets: dict[str, tuple[int, int]], yields: bool,
                 local_v0: Optional[str] = None, host_copies: Optional[Path] = None) -> HeteroConfig:
    """The config the roles `train` starts run on: each its threads (`cpu_budgets`), and when
    the samplers yield to the learner (`train.cpu_sharing: yield` on a CPU) they also wait for
    its next version, having nothing to overlap with (unless not every version is published,
    `learner.sync_every` > 1, or a simulated refresh delay makes their groups stale on
    purpose, `sampler.delays.refresh`), and the evaluator scores after training. With validators
    started (`train.num_validators`) the learner uses their verdicts. `local_v0`: the base model's
    digest, with which the samplers load v0 from its files (`sampler.local_v0_sha256`);
    `host_copies`: where the learner's publisher writes each version for the samplers to take
    (`learner.host_copies_dir`, `sampler.host_copies_dir`)."""
    copies = None if host_copies is None else str(host_copies)
    waits = yields and cfg.why_no_waiting_for_each_version() is None
    return cfg.model_copy(update={
        "validators": cfg.validators.model_copy(update={"enabled": cfg.validators.enabled
                                                        or cfg.train.num_validators > 0}),
        "learner": cfg.learner.model_copy(update={"torch_threads": budgets["learner"][0], "host_copies_dir": copies}),
        "sampler": cfg.sampler.model_copy(update={"torch_threads": budgets["sampler"][0],
                                                  "yield_to_learner": yields,
                                                  "wait_for_next_version": waits,
                                                  "local_v0_sha256": local_v0, "host_copies_dir": copies}),
        "eval": cfg.eval.model_copy(update={"torch_threads": budgets["evaluator"][0], "after_training": yields})})


def run_train(cfg: HeteroConfig, out: Optional[Path] = None, keep_stack: bool = False) -> int:
    log = setup_logging("train")
    wall_start = time.time()
    run_name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_name, "rollout_topic": None})})
    task = make_task_from_config(cfg)  # a bad dataset or verifier fails here, before any server starts
    classify(cfg.model.base)  # and so does a model.base that names nothing
    check_backend_available(cfg.sampler.backend)  # and so does a generation engine that is not installed
    run_dir = Path(out or cfg.train.out_dir or f"runs/{run_name}")
    if (run_dir / "metrics.jsonl").exists():
        raise UserError(f"run directory {run_dir} already holds a run; choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    wandb_run = WandbLogger(cfg, run_dir, run_name) if cfg.wandb.enabled else None  # no login: one line, at once

    with services_for_run(cfg, keep=keep_stack) as (cfg, services, started_stack):
        init_keys(key_paths(cfg))  # the learner's key signs, samplers pin its public half
        handles = connect_run(cfg)
        sampler_ids = [f"{run_name}-s{i}" for i in range(cfg.train.num_samplers)]
        validator_ids = [f"{run_name}-v{i}" for i in range(cfg.train.num_validators)]
        provision_local(cfg, handles.state.client, sampler_ids, validator_ids)
        t0 = time.time()
        base = resolve_base_model(cfg)
        log.info("base model %s ready in %.1fs", base, time.time() - t0)
        metrics = MetricsWriter(run_dir, tb_subdir="tb")
        here, precision = with_machine_precision(cfg, resolve_device(cfg.model.device))
        log.info("%s", precision)
        on_gpu = resolve_device(cfg.model.device).type == "cuda"
        budgets = cpu_budgets(cfg, os.cpu_count() or 1, on_gpu=on_gpu)
        base_s = []

        def evaluate_base_model() -> None:
            started = time.time()
            torch.set_num_threads(max(1, os.cpu_count() or 1))
            with evaluation_bar("base eval", evaluation_completions(here, task)) as progress:
                before = evaluate_base(here, base, task, progress)  # stored beside the model after its first time
            base_s.append(time.time() - started)
            metrics.write("eval", 0, {"policy_version": 0, **before})
            log.info("held-out accuracy before: sampled %.3f, greedy %.3f",
                     before["accuracy_sampled"], before["accuracy_greedy"])

        when = base_evaluation_when(cfg, on_gpu)
        if when == "first":
            evaluate_base_model()
        else:
            log.info("fast start: samplers load v0 from the base model's files; its held-out evaluation runs %s",
                     "beside the roles" if when == "beside" else "after training (the roles share this CPU)")
        train_started, train_ended = _run_roles(
            cfg, run_dir, services, handles, sampler_ids, validator_ids, budgets, on_gpu=on_gpu,
            on_tick=wandb_run.poll if wandb_run else None,
            local_v0=base_digest(base) if cfg.train.fast_start else None,
            host_copies=shared_memory_dir(run_name) if cfg.train.weights_by_shared_memory else None,
            base_evaluation=None if when == "first" else (when, evaluate_base_model))
        final_started = time.time()
        version = _score_last_version(here, task, run_dir, handles, metrics)
        metrics.close()
        summary = _summary(cfg, run_dir, version, handles, services, wall_start,
                           local_stack_kept=keep_stack or not started_stack)
        summary["precision"], summary["cpu"], summary["base_evaluation"] = precision, cpu_kind(), when
        summary["cpu_sharing"] = {"policy": "none" if on_gpu else cfg.train.cpu_sharing,
                                  **{role: {"threads": t, "nice": n} for role, (t, n) in budgets.items()}}
        summary["seconds"] = {"before_training": round(train_started - wall_start, 1),
                              "base_evaluation": round(base_s[0], 1),
                              "training": round(train_ended - train_started, 1),
                              "after_training": round(time.time() - train_ended, 1),
                              "final_evaluation": round(time.time() - final_started, 1)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(run_dir)
    if wandb_run is not None:
        wandb_run.finish(summary, run_dir / "report.png")
    print(f"\nrun {run_name}: held-out accuracy {summary['eval_accuracy_before']:.3f} -> "
          f"{summary['eval_accuracy_after']:.3f} (greedy {summary['eval_greedy_before']:.3f} -> "
          f"{summary['eval_greedy_after']:.3f}), policy v{version} at {summary['final_checkpoint']}, "
          f"{summary['groups_used']} groups used / {summary['groups_dropped']} dropped, "
          f"{summary['wall_seconds']:.0f}s\nreport: {run_dir}/summary.json, {run_dir}/report.png")
    return 0


class InBackground(threading.Thread):
    """`work` on a thread of its own; `result()` waits for it to end and raises what it raised."""

    def __init__(self, work: Callable[[], None], name: str):
        super().__init__(name=name, daemon=True)
        self.work, self.error = work, None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - raised again by result(), in the caller's thread
            self.error = e

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def base_evaluation_when(cfg: HeteroConfig, on_gpu: bool) -> str:
    """When `train` evaluates the base model on the held-out split: `first`, before the roles start
    (`train.fast_start` off); under `train.fast_start`, `beside` them, on a thread of this process
    while they start and train (on a GPU, or with `train.cpu_sharing: none`: start-up is mostly
    waiting, which the evaluation fills), or `after` the learner's last step, on a CPU the roles
    share, where an evaluation beside them would take the cores they start and train on."""
    if not cfg.train.fast_start:
        return "first"
    return "beside" if on_gpu or cfg.train.cpu_sharing == "none" else "after"


def _run_roles(cfg: HeteroConfig, run_dir: Path, services, handles, sampler_ids: list[str], validator_ids: list[str],
               budgets: dict, *, on_gpu: bool, on_tick=None, local_v0: Optional[str] = None,
               host_copies: Optional[Path] = None,
               base_evaluation: Optional[tuple[str, Callable[[], None]]] = None) -> tuple[float, float]:
    """Start the learner, samplers, validators and evaluator as processes of their own, watch them until
    the learner's last step, let the evaluator finish, stop them all. Returns when training started and ended.
    `local_v0`: the base model's digest, for samplers to load v0 from its files (`sampler.local_v0_sha256`);
    `host_copies`: the directory the learner writes each version into for the samplers
    (`roles_config`), removed once they stop.
    `base_evaluation`: (when, how) this process evaluates the base model while they run
    (`base_evaluation_when`: `beside` them on a thread, or `after` the learner's last step); the
    evaluator then leaves v0 to it."""
    log = logging.getLogger("train")  # the logger run_train set up
    run_name = cfg.run.name
    yields = cfg.train.cpu_sharing == "yield" and not on_gpu
    child_config = run_dir / "config.yaml"
    child_config.write_text(dump_config(roles_config(cfg, budgets, yields, local_v0, host_copies)))
    procs = Processes(run_dir, child_env(services))
    data_dir = cfg.services.data_dir
    try:
        common = ["--config", str(child_config), "--data-dir", data_dir]
        train_started = time.time()
        procs.start("learner", ["learner", *common, "--out", str(run_dir)],
                    env=child_env(as_role(services, data_dir, "learner")), nice=budgets["learner"][1])
        sampler_env = child_env(as_role(services, data_dir, "sampler"))
        for i, sampler_id in enumerate(sampler_ids):
            procs.start(f"sampler-{i}", ["sampler", *common, "--id", sampler_id], env=sampler_env,
                        nice=budgets["sampler"][1])
        validator_env = child_env(as_role(services, data_dir, "validator"))
        for i, validator_id in enumerate(validator_ids):
            procs.start(f"validator-{i}", ["validator", *common, "--id", validator_id], env=validator_env,
                        nice=budgets["sampler"][1])
        if cfg.eval.every:
            procs.start("evaluator", ["evaluator", *common, "--out", str(run_dir),
                                      *(["--without-v0"] if base_evaluation is not None else [])],
                        nice=budgets["evaluator"][1])
        log.info("run %s: learner + %d samplers%s started, logs in %s/logs/; cores shared by %s: %s", run_name,
                 cfg.train.num_samplers, f" + {len(validator_ids)} validators" if validator_ids else "", run_dir,
                 "none (the model is on a GPU)" if on_gpu else cfg.train.cpu_sharing,
                 ", ".join(f"{role} {threads} thread(s) at {'idle priority' if nice == IDLE else f'nice {nice}'}"
                           for role, (threads, nice) in budgets.items()))
        when, evaluate_base_model = base_evaluation or (None, None)
        beside = InBackground(evaluate_base_model, "base-evaluation") if when == "beside" else None
        if beside is not None:
            beside.start()
        watch(cfg, procs, run_dir, on_tick=on_tick)
        train_ended = time.time()
        procs.stop([n for n in procs.procs if n.startswith("sampler")])
        if beside is not None:
            beside.result()
        elif when == "after":
            evaluate_base_model()
        if "evaluator" in procs.procs:  # it exits once it has scored the last version (and any it held back)
            if not follow_evaluator(procs.procs["evaluator"], handles.state, timeout_s=300 + (
                    EVALUATION_S * cfg.learner.max_steps // cfg.eval.every if yields else 0)):
                procs.stop(["evaluator"])
    finally:
        procs.stop()
        if host_copies is not None:
            shutil.rmtree(host_copies, ignore_errors=True)
    return train_started, train_ended


def _score_last_version(here, task, run_dir: Path, handles, metrics: MetricsWriter) -> int:
    """The learner's last version (its summary says which; the pointer is anybody's with write
    access to Redis), scored on the held-out set unless the evaluator already did."""
    version = int(json.loads((run_dir / "learner_summary.json").read_text())["final_policy_version"])
    manifest_key = handles.store.manifest_key(version)
    scored = {r["policy_version"] for r in read_metrics(run_dir / "metrics.jsonl", "eval")}
    if version not in scored:
        with evaluation_bar(f"v{version} eval", evaluation_completions(here, task)) as progress:
            after = evaluate_published(here, handles.store, manifest_key, run_dir / "final_policy", task,
                                       progress=progress)
        metrics.write("eval", version, {"policy_version": version, **after})
    return version


def _summary(cfg: HeteroConfig, run_dir: Path, version: int, handles, services, wall_start: float,
             local_stack_kept: bool) -> dict:
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    evals = sorted(read_metrics(run_dir / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
    before, after = evals[0], evals[-1]
    return {
        "run": cfg.run.name, "loss_type": cfg.learner.loss_type,
        "eval_accuracy_before": before["accuracy_sampled"], "eval_accuracy_after": after["accuracy_sampled"],
        "eval_best_accuracy": max(r["accuracy_sampled"] for r in evals),
        "eval_last_accuracy": after["accuracy_sampled"], "eval_versions": [r["policy_version"] for r in evals],
        "eval_greedy_before": before["accuracy_greedy"], "eval_greedy_after": after["accuracy_greedy"],
        "eval_metric": f"mean exact-match over {cfg.eval.n_samples} samples per held-out problem "
                       f"at temperature {cfg.sampler.temperature}",
        "final_policy_version": version, "final_checkpoint": handles.store.uri(version),
        "rollout_topic": cfg.run.topic, "groups_consumed": learner["groups_consumed"],
        "groups_used": learner["groups_used"], "groups_dropped": learner["groups_dropped"],
        "malformed": learner["malformed"],
        "max_staleness_used": learner["max_staleness_used"],
        "mean_staleness_used": learner["mean_staleness_used"],
        "num_samplers": cfg.train.num_samplers, "sampler_stats": handles.state.sampler_stats(),
        "wall_seconds": round(time.time() - wall_start, 1),
        "services": services.public(), "local_stack_kept": local_stack_kept,
    }
