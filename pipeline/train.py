"""`heterorl train`: the main job, one command from nothing to a trained policy and a report.

  1. servers: the configured ones, else the running local stack, else start one;
  2. the base model (the builtin one is warmed up once and cached) and its held-out
     accuracy;
  3. one learner and `train.num_samplers` samplers as separate processes, each with its
     own log in RUN_DIR/logs/, with live progress read from RUN_DIR/metrics.jsonl;
  4. once the learner has published its last version: stop the samplers, evaluate the
     final checkpoint (downloaded from S3 and verified like any sampler would);
  5. summary.json and a PNG plot, then stop whatever this command started.

The run name is `run.name` plus a timestamp, so repeated runs on one stack never mix
their topics, checkpoints or versions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.config import HeteroConfig, dump_config
from pipeline.runtime import (connect_run, evaluate_checkpoint, make_task_from_config, resolve_base_model,
                              setup_logging)


def _child_env(services) -> dict:
    from pipeline.services import services_env

    return {**os.environ, **services_env(services), "PYTHONUNBUFFERED": "1"}


class Processes:
    """The child processes of a run: started with their own logs, stopped on every exit path."""

    def __init__(self, run_dir: Path, env: dict):
        self.run_dir = run_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], env: Optional[dict] = None) -> None:
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pipeline", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env or self.env, start_new_session=True)
        log.close()

    def stop(self, names: Optional[list[str]] = None, grace_s: float = 20.0) -> None:
        targets = [n for n in (names or list(self.procs)) if self.procs[n].poll() is None]
        for n in targets:
            self.procs[n].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for n in targets:
            try:
                self.procs[n].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(n)

    def kill(self, name: str) -> None:
        """SIGKILL the process and everything it started (a crash, as far as it can tell)."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def wait(self, name: str, timeout_s: float) -> None:
        """Let one process finish by itself; stop it if it has not within timeout_s."""
        try:
            self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop([name])

    def log_tail(self, name: str, lines: int = 5) -> str:
        text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])


def _watch(cfg: HeteroConfig, procs: Processes, run_dir: Path, log) -> None:
    """Show live progress until the learner exits; raise if it or every sampler fails."""
    from tqdm import tqdm

    from pipeline.metrics import MetricsTail

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
                    raise RuntimeError(f"learner exited with code {code}; last lines of "
                                       f"{run_dir}/logs/learner.log:\n{procs.log_tail('learner')}")
                return
            samplers = [n for n in procs.procs if n.startswith("sampler")]
            if samplers and all(procs.procs[n].poll() is not None for n in samplers):
                raise RuntimeError(f"every sampler exited; last lines of {run_dir}/logs/{samplers[0]}.log:\n"
                                   f"{procs.log_tail(samplers[0])}")
            if time.monotonic() - started > cfg.train.timeout_s:
                raise RuntimeError(f"run exceeded train.timeout_s={cfg.train.timeout_s:.0f}s")
            time.sleep(0.5)
    finally:
        bar.close()


def run_train(cfg: HeteroConfig, out: Optional[Path] = None, keep_stack: bool = False,
              config_path: Optional[str] = None) -> int:
    from infra.local_stack import start_stack, stop_stack
    import torch

    from pipeline.metrics import MetricsWriter, read_metrics
    from pipeline.report import plot_run
    from pipeline.services import resolve_services

    log = setup_logging("train")
    wall_start = time.time()
    run_name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_name, "rollout_topic": None})})
    run_dir = Path(out or cfg.train.out_dir or f"runs/{run_name}")
    if (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {run_dir} already holds a run; choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)

    started_stack = False
    services = resolve_services(cfg.services)
    if services is None:
        log.info("no servers configured: starting the local stack in %s/", cfg.services.data_dir)
        ports = cfg.services.local_stack
        start_stack(cfg.services.data_dir, kafka_port=ports.kafka_port, redis_port=ports.redis_port,
                    s3_port=ports.s3_port, external_kafka=cfg.services.kafka_bootstrap)
        started_stack = True
        services = resolve_services(cfg.services)
    procs: Optional[Processes] = None
    try:
        handles = connect_run(cfg)
        task = make_task_from_config(cfg)
        t0 = time.time()
        base = resolve_base_model(cfg)
        log.info("base model %s ready in %.1fs", base, time.time() - t0)
        metrics = MetricsWriter(run_dir, tb_subdir="tb")
        torch.set_num_threads(max(1, os.cpu_count() or 1))  # nothing else runs yet
        before = evaluate_checkpoint(cfg, base, task)
        metrics.write("eval", 0, {"policy_version": 0, **before})
        log.info("held-out accuracy before: sampled %.3f, greedy %.3f",
                 before["accuracy_sampled"], before["accuracy_greedy"])

        child_config = run_dir / "config.yaml"
        child_config.write_text(dump_config(cfg))
        procs = Processes(run_dir, _child_env(services))
        common = ["--config", str(child_config), "--data-dir", cfg.services.data_dir]
        procs.start("learner", ["learner", *common, "--out", str(run_dir)])
        for i in range(cfg.train.num_samplers):
            procs.start(f"sampler-{i}", ["sampler", *common, "--id", f"{run_name}-s{i}"])
        if cfg.eval.every:
            procs.start("evaluator", ["evaluator", *common, "--out", str(run_dir)])
        log.info("run %s: learner + %d samplers started, logs in %s/logs/", run_name,
                 cfg.train.num_samplers, run_dir)
        _watch(cfg, procs, run_dir, log)
        procs.stop([n for n in procs.procs if n.startswith("sampler")])
        if "evaluator" in procs.procs:  # it exits once it has scored the last version
            procs.wait("evaluator", timeout_s=300)

        learner_summary = json.loads((run_dir / "learner_summary.json").read_text())
        version, manifest_key = handles.state.policy()
        scored = {r["policy_version"]: r for r in read_metrics(run_dir / "metrics.jsonl", "eval")}
        if version not in scored:
            final_dir, _ = handles.store.fetch(manifest_key, run_dir / "final_policy")
            metrics.write("eval", version, {"policy_version": version, **evaluate_checkpoint(cfg, final_dir, task)})
            shutil.rmtree(final_dir, ignore_errors=True)
        metrics.close()
        evals = sorted(read_metrics(run_dir / "metrics.jsonl", "eval"), key=lambda r: r["policy_version"])
        after = evals[-1]
        summary = {
            "run": run_name, "loss_type": cfg.learner.loss_type,
            "eval_accuracy_before": before["accuracy_sampled"], "eval_accuracy_after": after["accuracy_sampled"],
            "eval_best_accuracy": max(r["accuracy_sampled"] for r in evals),
            "eval_last_accuracy": after["accuracy_sampled"], "eval_versions": [r["policy_version"] for r in evals],
            "eval_greedy_before": before["accuracy_greedy"], "eval_greedy_after": after["accuracy_greedy"],
            "eval_metric": f"mean exact-match over {cfg.eval.n_samples} samples per held-out problem "
                           f"at temperature {cfg.sampler.temperature}",
            "final_policy_version": version, "final_checkpoint": handles.store.uri(version),
            "rollout_topic": cfg.run.topic, "groups_consumed": learner_summary["groups_consumed"],
            "groups_used": learner_summary["groups_used"], "groups_dropped": learner_summary["groups_dropped"],
            "malformed": learner_summary["malformed"],
            "max_staleness_used": learner_summary["max_staleness_used"],
            "mean_staleness_used": learner_summary["mean_staleness_used"],
            "num_samplers": cfg.train.num_samplers, "sampler_stats": handles.state.sampler_stats(),
            "wall_seconds": round(time.time() - wall_start, 1),
            "services": services.public(), "local_stack_kept": bool(keep_stack or not started_stack),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_run(run_dir)
        print(f"\nrun {run_name}: held-out accuracy {before['accuracy_sampled']:.3f} -> "
              f"{after['accuracy_sampled']:.3f} (greedy {before['accuracy_greedy']:.3f} -> "
              f"{after['accuracy_greedy']:.3f}), policy v{version} at {summary['final_checkpoint']}, "
              f"{summary['groups_used']} groups used / {summary['groups_dropped']} dropped, "
              f"{summary['wall_seconds']:.0f}s\nreport: {run_dir}/summary.json, {run_dir}/report.png")
        return 0
    except RuntimeError as e:
        print(f"heterorl train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if procs is not None:
            procs.stop()
        if started_stack and not keep_stack:
            stop_stack(cfg.services.data_dir)
        elif started_stack:
            print(f"local stack left running in {cfg.services.data_dir}/ (`heterorl status --json`, "
                  f"`heterorl down`)", file=sys.stderr)
