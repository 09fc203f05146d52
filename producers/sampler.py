"""Sampler: generate prompt groups with the newest policy it has, publish them to Kafka.

Run: `heterorl sampler --config configs/demo.yaml` (any number, on any machine that can
reach the three servers; start or stop them at any time).

The loop, top to bottom:
  1. announce: take a lease in Redis (id, host, version, rate), renewed by heartbeats;
  2. wait for a published policy version, download its checkpoint from S3, verify it;
  3. repeat: if Redis shows a newer version, fetch + verify + swap weights in place;
     claim the next prompts of the shared stream; sample G completions per prompt,
     recording the sampler's token log-probs; score them with the task's verifier;
     publish one message per prompt group, tagged with the policy version used.

A checkpoint that fails verification is refused and the sampler keeps generating with
the weights it has; nothing received is ever unpickled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

from pipeline.config import HeteroConfig
from pipeline.runtime import connect_run, make_task_from_config, setup_logging, touch_heartbeat_file


def score_groups(task, tokenizer, problems, groups, *, sampler_id: str, policy_version: int, sampling: dict) -> list:
    """One Rollout per prompt group: rewards from the task's verifier on the decoded completions."""
    from pipeline.model import decode_completion
    from pipeline.rollout import Rollout

    return [Rollout(prompt_id=problem.problem_id, task=task.name, sampler_id=sampler_id,
                    policy_version=policy_version, prompt_ids=group.prompt_ids,
                    completion_ids=group.completion_ids, sampler_logps=group.sampler_logps,
                    rewards=[task.reward(problem, decode_completion(tokenizer, c)) for c in group.completion_ids],
                    sampling=sampling)
            for problem, group in zip(problems, groups)]


def new_sampler_id() -> str:
    return f"{socket.gethostname()[:24]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def sampler_seed(run_seed: int, sampler_id: str) -> int:
    """Each sampler gets its own random stream (the reference gave all the same seed)."""
    digest = hashlib.sha256(f"{run_seed}:{sampler_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


class _StopFlag:
    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_):
        self.stop = True


class PolicyHolder:
    """The weights a sampler generates with, and how it moves to a newer version."""

    def __init__(self, store, work_dir: Path, log):
        self.store = store
        self.work_dir = work_dir
        self.log = log
        self.version: Optional[int] = None
        self.model = None
        self.tokenizer = None
        self.refused: set[str] = set()

    def update(self, version: Optional[int], manifest_key: Optional[str]) -> bool:
        """Load `version` if it is newer than ours; False (keep current weights) on failure."""
        import urllib3
        from minio.error import S3Error

        from pipeline.checkpoints import CheckpointNotFound, CorruptCheckpointError
        from pipeline.model import load_policy

        if version is None or manifest_key is None or (self.version is not None and version <= self.version):
            return False
        if manifest_key in self.refused:
            return False
        target = self.work_dir / f"v{version}"
        try:
            path, _ = self.store.fetch(manifest_key, target)
        except CorruptCheckpointError as e:
            self.refused.add(manifest_key)
            self.log.error("%s; keeping policy v%s", e, self.version)
            return False
        except CheckpointNotFound as e:  # pruned between the Redis read and the fetch
            self.log.warning("%s; will pick up a newer version", e)
            return False
        except (S3Error, urllib3.exceptions.HTTPError, OSError) as e:  # the network, not the data
            self.log.warning("could not download policy v%d (%s: %s); keeping v%s and retrying",
                             version, type(e).__name__, str(e).splitlines()[0][:160], self.version)
            return False
        model, tokenizer = load_policy(path)
        old = self.version
        self.model, self.tokenizer, self.version = model, tokenizer, version
        if old is not None:
            shutil.rmtree(self.work_dir / f"v{old}", ignore_errors=True)
        self.log.info("policy v%d loaded (was v%s)", version, old)
        return True


def run_sampler(cfg: HeteroConfig, sampler_id: Optional[str] = None) -> int:
    import torch

    from pipeline.kafka_io import RolloutSink, ensure_topic
    from pipeline.model import sample_groups

    sampler_id = sampler_id or new_sampler_id()
    log = setup_logging(f"sampler {sampler_id}")
    torch.set_num_threads(cfg.sampler.torch_threads)
    scfg = cfg.sampler
    handles = connect_run(cfg)
    state, store = handles.state, handles.store
    task = make_task_from_config(cfg)
    ensure_topic(handles.services.kafka_bootstrap, cfg.run.topic, cfg.run.topic_partitions)
    sink = RolloutSink(handles.services.kafka_bootstrap, cfg.run.topic)
    work_dir = Path(cfg.services.data_dir) / "samplers" / sampler_id
    work_dir.mkdir(parents=True, exist_ok=True)
    policy = PolicyHolder(store, work_dir, log)
    stop = _StopFlag()
    seed = sampler_seed(cfg.run.seed, sampler_id)
    sampling = {"temperature": scfg.temperature, "top_p": scfg.top_p, "top_k": scfg.top_k,
                "max_new_tokens": scfg.max_new_tokens}
    started = time.time()
    published = 0
    acked_up_to: dict[int, int] = {}  # partition -> 1 + highest offset acknowledged to us
    paused_s = 0.0
    last_heartbeat = last_poll = 0.0
    last_wait_log = time.monotonic()

    def heartbeat() -> None:
        minutes = max((time.time() - started) / 60, 1e-9)
        state.renew_sampler_lease(sampler_id, {
            "host": socket.gethostname(), "pid": os.getpid(), "policy_version": policy.version,
            "groups": published, "rollouts_per_min": round(published / minutes, 2), "started_at": started,
            "paused_s": round(paused_s, 1),
        }, scfg.lease_ttl_s)
        touch_heartbeat_file()

    log.info("sampler %s started (topic %s, seed %d)", sampler_id, cfg.run.topic, seed)
    try:
        while not stop.stop:
            now = time.monotonic()
            if now - last_heartbeat >= scfg.heartbeat_interval_s:
                heartbeat()
                last_heartbeat = now
            if now - last_poll >= scfg.weight_poll_interval_s or policy.model is None:
                policy.update(*state.policy())
                last_poll = now
            if policy.model is None:
                if time.monotonic() - last_wait_log > 5:
                    log.info("waiting for the learner to publish a policy version (Redis %s)",
                             handles.services.redis_url)
                    last_wait_log = time.monotonic()
                time.sleep(0.5)
                continue

            if scfg.max_backlog_groups is not None and acked_up_to:
                read = state.learner_offsets()
                backlog = sum(max(0, end - read.get(p, 0)) for p, end in acked_up_to.items())
                if backlog > scfg.max_backlog_groups:  # the learner is behind: wait, don't waste compute
                    time.sleep(0.05)
                    paused_s += 0.05
                    continue

            indices = state.claim_prompts(scfg.prompts_per_batch)
            problems = [task.train_problem(i) for i in indices]
            version = policy.version
            groups = sample_groups(
                policy.model, policy.tokenizer, [p.prompt for p in problems], group_size=scfg.group_size,
                temperature=scfg.temperature, top_p=scfg.top_p, top_k=scfg.top_k,
                max_new_tokens=scfg.max_new_tokens, seed=seed + indices[0])
            rollouts = score_groups(task, policy.tokenizer, problems, groups, sampler_id=sampler_id,
                                    policy_version=version, sampling=sampling)
            for partition, offset in sink.send_many(rollouts):
                acked_up_to[partition] = max(acked_up_to.get(partition, 0), offset + 1)
            published += len(rollouts)
            if scfg.max_groups is not None and published >= scfg.max_groups:
                log.info("published %d groups (sampler.max_groups); stopping", published)
                break
    finally:
        sink.close()
        state.release_sampler_lease(sampler_id)
        shutil.rmtree(work_dir, ignore_errors=True)
        log.info("sampler %s stopped after %d groups", sampler_id, published)
    return 0
