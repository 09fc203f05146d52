"""The real Redis server through infra.fault_proxy: a partition looks like timeouts, then heals."""

from __future__ import annotations

import time
import uuid
from urllib.parse import urlparse, urlunparse

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from infra.fault_proxy import FaultProxy, FaultSpec, Route

pytestmark = pytest.mark.integration


def _through(url: str, proxy_address: str) -> str:
    """The same Redis URL (credentials, db) with host:port replaced by the proxy's."""
    parsed = urlparse(url)
    userinfo = parsed.netloc.rpartition("@")[0]
    return urlunparse(parsed._replace(netloc=f"{userinfo}@{proxy_address}" if userinfo else proxy_address))


def test_redis_through_the_proxy_times_out_in_a_blackhole_and_recovers(local_stack):
    target = urlparse(local_stack.redis_url)
    proxy = FaultProxy([Route("redis", 0, target.hostname, target.port)], FaultSpec(latency_ms=5)).start()
    # No retries: redis-py >= 6 retries timeouts by default, which would hide the timeout
    # (or push it past the window); a sampler's own retry policy sits on top of this.
    client = redis.Redis.from_url(_through(local_stack.redis_url, proxy.address("redis")),
                                  socket_timeout=0.5, socket_connect_timeout=0.5,
                                  retry=Retry(NoBackoff(), 0))
    key = f"fault-proxy-{uuid.uuid4().hex[:8]}"
    try:
        assert client.set(key, b"value")
        assert client.get(key) == b"value"

        window_s = 2.0
        proxy.blackhole(window_s)
        window_end = time.monotonic() + window_s
        with pytest.raises(redis.exceptions.TimeoutError):
            client.get(key)  # on the existing connection
        with pytest.raises(redis.exceptions.TimeoutError):
            client.get(key)  # redis-py reconnected: a new connection hangs as well
        assert time.monotonic() < window_end, "the timeouts must have happened inside the window"

        time.sleep(window_end - time.monotonic() + 0.2)
        assert client.get(key) == b"value"
        stats = proxy.stats()["redis"]
        assert stats["blackholed_windows"] == 1
        assert stats["bytes_dropped"] > 0
        assert stats["connections_accepted"] == 3
    finally:
        client.delete(key)
        client.close()
        proxy.stop()
