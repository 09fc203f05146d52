"""Redis: the current policy version, its manifest, sampler leases and learner progress.

Keys (all under `heterorl:<run>:`):
- `policy`            hash {version, manifest_key, updated_at}: written in one HSET
                      *after* the checkpoint's manifest is in S3, so a reader that sees a
                      version can always fetch it.
- `sampler:<id>`      hash {host, policy_version, groups, rollouts_per_min, started_at,
                      heartbeat_at}, with a TTL renewed by each heartbeat (the lease).
- `learner`           hash of the learner's latest progress (step, groups used/dropped).
- `sampler_stats`     hash sampler id -> JSON totals written when a sampler stops.
- `meta`              hash {rollout_topic, started_at} written by the learner; the run is
                      also listed in the global sorted set `heterorl:runs` (by start time).
- `prompt_cursor`     counter: samplers claim the next prompt indices with INCRBY, so
                      any number of samplers share one prompt stream without overlap.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import redis

from pipeline.services import ServiceUnavailable


def _prefix(run: str) -> str:
    return f"heterorl:{run}:"


def connect_redis(url: str, timeout_s: float = 10.0) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  decode_responses=True, retry_on_timeout=True)
    try:
        client.ping()
    except redis.RedisError as e:
        raise ServiceUnavailable(f"cannot reach Redis at {url} ({e}): start it or fix the URL") from None
    return client


RUNS_KEY = "heterorl:runs"


def latest_run(client: redis.Redis) -> Optional[str]:
    """The most recently started run on these servers, if any."""
    newest = client.zrevrange(RUNS_KEY, 0, 0)
    return newest[0] if newest else None


class RunState:
    """The run's shared state in Redis."""

    def __init__(self, client: redis.Redis, run: str):
        self.client = client
        self.run = run
        self.prefix = _prefix(run)

    # ---- run registry ----------------------------------------------------------------
    def register_run(self, rollout_topic: str) -> None:
        now = time.time()
        self.client.hsetnx(self.prefix + "meta", "started_at", now)
        self.client.hset(self.prefix + "meta", "rollout_topic", rollout_topic)
        self.client.zadd(RUNS_KEY, {self.run: now})

    def meta(self) -> dict:
        return self.client.hgetall(self.prefix + "meta")

    # ---- policy version ------------------------------------------------------------
    def policy(self) -> tuple[Optional[int], Optional[str]]:
        """(version, manifest_key) of the newest published policy, or (None, None)."""
        data = self.client.hgetall(self.prefix + "policy")
        if not data:
            return None, None
        return int(data["version"]), data["manifest_key"]

    def policy_version(self) -> Optional[int]:
        raw = self.client.hget(self.prefix + "policy", "version")
        return None if raw is None else int(raw)

    def publish_policy(self, version: int, manifest_key: str) -> None:
        """Make `version` current; call only once its manifest is in S3."""
        self.client.hset(self.prefix + "policy", mapping={
            "version": version, "manifest_key": manifest_key, "updated_at": time.time()})

    # ---- sampler leases --------------------------------------------------------------
    def renew_sampler_lease(self, sampler_id: str, info: dict, ttl_s: float) -> None:
        key = f"{self.prefix}sampler:{sampler_id}"
        pipe = self.client.pipeline()
        pipe.hset(key, mapping={**{k: str(v) for k, v in info.items()}, "heartbeat_at": time.time()})
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def release_sampler_lease(self, sampler_id: str) -> None:
        self.client.delete(f"{self.prefix}sampler:{sampler_id}")

    def record_sampler_stats(self, sampler_id: str, stats: dict) -> None:
        """A stopping sampler's totals (generated, published, waits, refreshes), kept for the run."""
        self.client.hset(self.prefix + "sampler_stats", sampler_id, json.dumps(stats))

    def sampler_stats(self) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.client.hgetall(self.prefix + "sampler_stats").items()}

    def live_samplers(self) -> dict[str, dict]:
        """Samplers whose lease has not expired."""
        out = {}
        for key in self.client.scan_iter(match=f"{self.prefix}sampler:*", count=100):
            data = self.client.hgetall(key)
            if data:
                out[key[len(self.prefix) + len("sampler:"):]] = data
        return out

    # ---- prompt stream ---------------------------------------------------------------
    def claim_prompts(self, count: int) -> list[int]:
        """The next `count` indices of the task's train stream, for this caller alone."""
        end = int(self.client.incrby(self.prefix + "prompt_cursor", count))
        return list(range(end - count, end))

    # ---- learner progress ------------------------------------------------------------
    def report_learner(self, progress: dict) -> None:
        """Every value is stored as JSON, so readers get numbers, null and maps back."""
        self.client.hset(self.prefix + "learner", mapping={k: json.dumps(v) for k, v in progress.items()})

    def learner_progress(self) -> dict:
        return {k: json.loads(v) for k, v in self.client.hgetall(self.prefix + "learner").items()}

    def report_learner_offsets(self, offsets: dict[int, int]) -> None:
        """Next offset the learner will read, per partition (samplers derive their backlog)."""
        self.report_learner({"offsets": {str(p): o for p, o in offsets.items()}})

    def learner_offsets(self) -> dict[int, int]:
        raw = self.client.hget(self.prefix + "learner", "offsets")
        return {int(p): int(o) for p, o in json.loads(raw).items()} if raw else {}
