"""Sampler: generate prompt groups with the newest policy it has, publish them to Kafka.

Run: `heterorl sampler --config configs/demo.yaml` (any number, on any machine that can
reach the three servers; start or stop them at any time).

The loop, top to bottom:
  1. announce: take a lease in Redis (id, host, version, rate), renewed by heartbeats;
  2. wait for a published policy version, download its checkpoint from S3, verify it;
  3. repeat: if Redis shows a newer version (and the simulated refresh delay, if any,
     has run out), download + verify it on a background thread while generating with
     the current weights, and swap it in between batches once ready; hold back while too far
     behind to produce usable data, or while the learner's backlog is over its bound;
     claim the next prompts of the shared stream; sample G completions per prompt,
     recording the sampler's token log-probs; score them with the task's verifier;
     publish one message per prompt group, tagged with the policy version used (after
     the simulated transit delay, if any).

A checkpoint that fails verification is refused and the sampler keeps generating with
the weights it has; nothing received is ever unpickled. Simulated WAN delays:
docs/delays.md.
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
from pipeline.rollout import Rollout
from pipeline.runtime import connect_run, make_task_from_config, setup_logging, touch_heartbeat_file


def score_groups(task, tokenizer, problems, groups, *, sampler_id: str, policy_version: int, sampling: dict) -> list:
    """One Rollout per prompt group: rewards from the task's verifier on the decoded completions."""
    from pipeline.model import decode_completion

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
    """The weights a sampler generates with, and how it moves to a newer version.

    Downloads run on a background thread (`request`), so a slow or failing link never
    stalls generation: the loop keeps sampling with the weights it has and swaps the new
    ones in between batches (`swap_if_ready`). `update` is the blocking form, for the
    first load.
    """

    def __init__(self, store, work_dir: Path, log):
        import threading

        self.store = store
        self.work_dir = work_dir
        self.log = log
        self.version: Optional[int] = None
        self.model = None
        self.tokenizer = None
        self.refused: set[str] = set()
        self.downloading: Optional[int] = None
        """Version being downloaded, if any."""
        self._ready: Optional[tuple] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def request(self, version: Optional[int], manifest_key: Optional[str], forced: bool = False) -> None:
        """Start downloading `version` in the background if it is newer than ours and nothing is in flight."""
        import threading

        if version is None or manifest_key is None or (self.version is not None and version <= self.version):
            return
        if manifest_key in self.refused or self.downloading is not None or self._ready is not None:
            return
        self.downloading = version
        self._thread = threading.Thread(target=self._download, args=(version, manifest_key, forced),
                                        name=f"download-v{version}", daemon=True)
        self._thread.start()

    def _download(self, version: int, manifest_key: str, forced: bool) -> None:
        import urllib3
        from minio.error import S3Error

        from pipeline.checkpoints import CheckpointNotFound, CorruptCheckpointError
        from pipeline.model import load_policy
        from pipeline.services import ServiceUnavailable

        try:
            path, _ = self.store.fetch(manifest_key, self.work_dir / f"v{version}")
            model, tokenizer = load_policy(path)
            with self._lock:
                self._ready = (version, model, tokenizer, forced)
        except CorruptCheckpointError as e:
            self.refused.add(manifest_key)
            self.log.error("%s; keeping policy v%s", e, self.version)
        except CheckpointNotFound as e:  # pruned between the Redis read and the fetch
            self.log.warning("%s; will pick up a newer version", e)
        except (S3Error, urllib3.exceptions.HTTPError, OSError, ServiceUnavailable) as e:  # the network
            self.log.warning("could not download policy v%d (%s: %s); keeping v%s and retrying",
                             version, type(e).__name__, str(e).splitlines()[0][:160], self.version)
        finally:
            self.downloading = None

    def swap_if_ready(self) -> Optional[bool]:
        """Load a finished download; returns its `forced` flag, or None if nothing was ready."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        version, model, tokenizer, forced = ready
        old = self.version
        self.model, self.tokenizer, self.version = model, tokenizer, version
        if old is not None:
            shutil.rmtree(self.work_dir / f"v{old}", ignore_errors=True)
        self.log.info("policy v%d loaded (was v%s)", version, old)
        return forced

    def update(self, version: Optional[int], manifest_key: Optional[str]) -> bool:
        """Blocking: load `version` if it is newer than ours; False (keep current weights) on failure."""
        self.request(version, manifest_key)
        if self._thread is not None:
            self._thread.join()
        return self.swap_if_ready() is not None


class Outbox:
    """Finished groups held for their simulated transit delay, then published in order."""

    def __init__(self, sink, transit):
        self.sink = sink
        self.transit = transit  # DelayStream: seconds each group travels (0 when the delay model is off)
        self.held: list[tuple[float, Rollout]] = []
        self.acked_up_to: dict[int, int] = {}  # partition -> 1 + highest offset acknowledged to us
        self.published = 0

    def add(self, rollouts: list[Rollout]) -> None:
        now = time.monotonic()
        self.held += [(now + self.transit.draw(), r) for r in rollouts]
        self.flush()

    def flush(self, everything: bool = False) -> None:
        now = time.monotonic()
        due = [r for t, r in self.held if everything or t <= now]
        if not due:
            return
        acks = self.sink.send_many(due)  # raises before anything is forgotten
        self.held = [(t, r) for t, r in self.held if not (everything or t <= now)]
        for partition, offset in acks:
            self.acked_up_to[partition] = max(self.acked_up_to.get(partition, 0), offset + 1)
        self.published += len(due)


def run_sampler(cfg: HeteroConfig, sampler_id: Optional[str] = None) -> int:
    import torch

    from pipeline.delays import RefreshGate, too_far_behind, transit_stream
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
    outbox = Outbox(RolloutSink(handles.services.kafka_bootstrap, cfg.run.topic), transit_stream(scfg.delays, sampler_id))
    gate = RefreshGate(scfg.delays, sampler_id)
    work_dir = Path(cfg.services.data_dir) / "samplers" / sampler_id
    work_dir.mkdir(parents=True, exist_ok=True)
    policy = PolicyHolder(store, work_dir, log)
    stop = _StopFlag()
    seed = sampler_seed(cfg.run.seed, sampler_id)
    sampling = {"temperature": scfg.temperature, "top_p": scfg.top_p, "top_k": scfg.top_k,
                "max_new_tokens": scfg.max_new_tokens}
    started = time.time()
    generated = 0
    newest = None
    waited = {"paused_backlog_s": 0.0, "stalled_behind_s": 0.0, "stalls_behind": 0}
    stalled = False
    last_heartbeat = last_poll = 0.0
    last_wait_log = time.monotonic()

    def heartbeat() -> None:
        minutes = max((time.time() - started) / 60, 1e-9)
        state.renew_sampler_lease(sampler_id, {
            "host": socket.gethostname(), "pid": os.getpid(), "policy_version": policy.version,
            "groups": outbox.published, "rollouts_per_min": round(outbox.published / minutes, 2),
            "versions_behind": (newest - policy.version) if newest is not None and policy.version is not None else None,
            "downloading": policy.downloading,
            "started_at": started, "held_in_transit": len(outbox.held),
            **{k: round(v, 1) for k, v in waited.items()}, **gate.stats,
        }, scfg.lease_ttl_s)
        touch_heartbeat_file()

    def behind() -> bool:
        return too_far_behind(newest, policy.version, backlog(), cfg.learner.groups_per_step,
                              cfg.learner.max_delay_steps)

    def refresh() -> None:
        """Load a newer policy once the (simulated) refresh delay allows it."""
        nonlocal newest
        newest, manifest_key = state.policy()
        if newest is None or (policy.version is not None and newest <= policy.version):
            return
        # A delay counted in learner steps can only run out if the learner keeps getting
        # data; a sampler already too far behind to give it any refreshes now.
        allowed = gate.should_load(policy.version, newest)
        forced = not allowed and scfg.delays.unit == "steps" and behind()
        if allowed or forced:
            policy.request(newest, manifest_key, forced=forced)

    def wait(reason: str, seconds: float = 0.05) -> None:
        time.sleep(seconds)
        waited[reason] += seconds

    def backlog() -> int:
        """Groups the learner has not read yet: in the topic (as of our last acknowledgement)
        and still held in simulated transit here."""
        read = state.learner_offsets()
        return len(outbox.held) + sum(max(0, end - read.get(p, 0)) for p, end in outbox.acked_up_to.items())

    log.info("sampler %s started (topic %s, seed %d, delays: refresh %s, transit %s)", sampler_id,
             cfg.run.topic, seed, scfg.delays.refresh.kind, scfg.delays.transit.kind)
    try:
        while not stop.stop:
            now = time.monotonic()
            if now - last_heartbeat >= scfg.heartbeat_interval_s:
                heartbeat()
                last_heartbeat = now
            if now - last_poll >= scfg.weight_poll_interval_s or policy.model is None:
                refresh()
                last_poll = now
            forced = policy.swap_if_ready()
            if forced is not None:
                gate.loaded(forced=forced)
            outbox.flush()
            if policy.model is None:
                if time.monotonic() - last_wait_log > 5:
                    log.info("waiting for the learner to publish a policy version (Redis %s)",
                             handles.services.redis_url)
                    last_wait_log = time.monotonic()
                time.sleep(0.5)
                continue
            if behind():  # don't waste compute on data that will be dropped: wait for a refresh
                waited["stalls_behind"] += not stalled  # episodes, not polls
                stalled = True
                wait("stalled_behind_s", 0.05)
                continue
            stalled = False
            if scfg.max_backlog_groups is not None and backlog() > scfg.max_backlog_groups:
                wait("paused_backlog_s")  # the learner is behind: don't waste compute
                continue

            indices = state.claim_prompts(sampler_id, scfg.prompts_per_batch)
            problems = [task.train_problem(i) for i in indices]
            groups = sample_groups(
                policy.model, policy.tokenizer, [p.prompt for p in problems], group_size=scfg.group_size,
                temperature=scfg.temperature, top_p=scfg.top_p, top_k=scfg.top_k,
                max_new_tokens=scfg.max_new_tokens, seed=seed + indices[0])
            outbox.add(score_groups(task, policy.tokenizer, problems, groups, sampler_id=sampler_id,
                                    policy_version=policy.version, sampling=sampling))
            state.complete_prompts(sampler_id, indices)
            generated += len(groups)
            if scfg.max_groups is not None and generated >= scfg.max_groups:
                log.info("generated %d groups (sampler.max_groups); stopping", generated)
                break
    finally:
        outbox.flush(everything=True)  # nothing generated is lost, held or not
        outbox.sink.close()
        state.record_sampler_stats(sampler_id, {"generated": generated, "published": outbox.published,
                                                **{k: round(v, 1) for k, v in waited.items()}, **gate.stats})
        state.release_sampler_lease(sampler_id)
        shutil.rmtree(work_dir, ignore_errors=True)
        log.info("sampler %s stopped after %d groups (%s, refreshes %s)", sampler_id, outbox.published,
                 ", ".join(f"{k} {v:.1f}" for k, v in waited.items()), gate.stats)
    return 0
