"""Evaluator: score published policy versions on the held-out split while training runs.

Run: `heterorl evaluator --config C --out RUN_DIR` (`heterorl train` starts one when
`eval.every` is set).

The loop: watch the policy pointer in Redis (checked against the learner's signature, as a
sampler checks it) for the newest version; once it has reached the next
multiple of `eval.every` (or is the learner's last, `learner.max_steps`) and is not before
`eval.start_version`, download
its checkpoint from S3 (verified like any sampler's), score it, and append an
`{"kind": "eval"}` record to RUN_DIR/metrics.jsonl. With `eval.after_training` a version
is downloaded when due but scored only once the last one is there: on a CPU whose cores
the learner needs, an evaluation beside training slows its step about twofold
(docs/performance.md). Versions already scored there (for
instance v0 by `train`; with `--without-v0`, v0 is left to `train`, which scores it while the
roles start) are skipped. It exits after scoring the last version. When it
falls behind it scores the newest eligible version and skips the ones in between, so
it never slows the run down by queueing work.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path
from typing import Optional

import torch
from redis.exceptions import RedisError

from pipeline.weights.store import CheckpointNotFound, CorruptCheckpointError, MalformedPointer, PolicyPointer
from pipeline.config import HeteroConfig
from pipeline.devices import resolve_device
from pipeline.records.metrics import MetricsWriter, read_metrics
from pipeline.runtime import (connect_run, evaluate_checkpoint, evaluation_completions, make_task_from_config,
                              setup_logging, with_machine_precision)
from pipeline.weights.policy import fetch_policy
from pipeline.wire.signing import SignatureError


def _due(version: int, scored: set[int], cfg: HeteroConfig) -> bool:
    """Due once it reaches the next multiple of eval.every past the newest scored version
    (published versions need not be exact multiples: see learner.sync_every), or is the last."""
    every = cfg.eval.every or 1
    newest_scored = max(scored, default=-1)
    if 0 < version < cfg.eval.start_version and version < cfg.learner.max_steps:
        return False
    return version > newest_scored and (version >= (newest_scored // every + 1) * every
                                        or version >= cfg.learner.max_steps)


def _reporter(state, version: int, total: int, every_s: float = 0.5):
    """A `progress` callback that reports the completions decoded to Redis, at most every
    `every_s` and at the end (`heterorl train` shows them while it waits for the evaluator)."""
    seen = {"done": 0.0, "at": 0.0}

    def report(done: int) -> None:
        try:
            state.report_evaluation(version, done, total)
        except RedisError:  # progress is for the eyes only: never worth an evaluation
            pass
        seen["at"] = time.monotonic()

    def progress(completions: float) -> None:
        seen["done"] += completions
        done = min(total, round(seen["done"]))
        if done >= total or time.monotonic() - seen["at"] >= every_s:
            report(done)
    report(0)
    return progress


def run_evaluator(cfg: HeteroConfig, run_dir: Optional[Path] = None, poll_s: float = 0.5,
                  without_v0: bool = False) -> int:
    """`without_v0`: v0 is scored by whoever started this evaluator (`heterorl train`, beside the
    roles' start-up), so it counts as scored here."""
    log = setup_logging("evaluator")
    torch.set_num_threads(cfg.eval.torch_threads)
    cfg, line = with_machine_precision(cfg, resolve_device(cfg.model.device))
    log.info("%s", line)
    run_dir = Path(run_dir or cfg.train.out_dir or f"runs/{cfg.run.name}")
    handles = connect_run(cfg)
    task = make_task_from_config(cfg)
    total = evaluation_completions(cfg, task)
    metrics = MetricsWriter(run_dir, tb_subdir="tb-eval")
    work_dir = run_dir / ".evaluator"
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    refused: set[str] = set()
    done = {int(r["policy_version"]) for r in read_metrics(run_dir / "metrics.jsonl", "eval")} | (
        {0} if without_v0 else set())
    log.info("evaluator for run %s on %s: every %s versions, %s problems x %d samples", cfg.run.name,
             resolve_device(cfg.model.device), cfg.eval.every or 1, cfg.eval.problems or cfg.task.eval_size,
             cfg.eval.n_samples)
    held: list[tuple[int, Path]] = []
    """Versions downloaded and waiting for the end of training (`eval.after_training`)."""
    try:
        while not stopping:
            try:  # the learner's signature, as a sampler checks it
                pointer = PolicyPointer(handles.state).read_verified(handles.store.trusted)
            except (SignatureError, MalformedPointer) as e:  # nothing new: said once, and wait
                if str(e) not in refused:
                    refused.add(str(e))
                    log.error("refused the policy pointer: %s; waiting for one the learner signed", e)
                time.sleep(poll_s)
                continue
            version, manifest_key = (None, None) if pointer is None else (pointer.version, pointer.manifest_key)
            if version is None or not _due(version, done | {v for v, _ in held}, cfg) or manifest_key in refused:
                time.sleep(poll_s)
                continue
            try:
                model_dir, _, _ = fetch_policy(handles.store, manifest_key, work_dir / f"v{version}",
                                               expect_version=version)
            except CheckpointNotFound:  # pruned meanwhile: a newer one is coming
                continue
            except CorruptCheckpointError as e:  # altered, or not the learner's: never scored
                refused.add(manifest_key)
                log.error("%s; not scoring v%d", e, version)
                continue
            held.append((version, model_dir))
            last = version >= cfg.learner.max_steps
            if cfg.eval.after_training and not last:
                log.info("v%d downloaded; scored once training ends (eval.after_training)", version)
                continue
            for version, model_dir in held:
                result = evaluate_checkpoint(cfg, model_dir, task, progress=_reporter(handles.state, version, total))
                shutil.rmtree(model_dir, ignore_errors=True)
                metrics.write("eval", version, {"policy_version": version, **result})
                done.add(version)
                log.info("v%d: held-out accuracy sampled %.3f greedy %.3f", version, result["accuracy_sampled"],
                         result["accuracy_greedy"])
            held.clear()
            if last:
                break
    finally:
        metrics.close()
        shutil.rmtree(work_dir, ignore_errors=True)
    return 0
