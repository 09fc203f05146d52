"""Where the servers are, and a one-line error when one cannot be reached.

Resolution order for each URL: the config file / `--set`, then the environment
(`KAFKA_BOOTSTRAP_SERVERS`, `REDIS_URL`, `AWS_ENDPOINT_URL`, ...; applied by
`load_config`), then the local stack recorded in `services.data_dir`. The product
always speaks the Kafka, Redis and S3 protocols; only the addresses differ.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from pipeline.config import ENV_OVERRIDES, ServicesConfig, strip_password


class ServiceUnavailable(RuntimeError):
    """A server that does not answer; the message names it, its URL and what to do."""


@dataclass(frozen=True)
class Services:
    kafka_bootstrap: str
    redis_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str
    bucket: str
    from_local_stack: bool = False

    def public(self) -> dict:
        """Everything but the secrets."""
        return {"kafka_bootstrap": self.kafka_bootstrap, "redis_url": strip_password(self.redis_url),
                "s3_endpoint": self.s3_endpoint, "bucket": self.bucket}


def services_env(services: Services) -> dict[str, str]:
    """The environment variables (config.ENV_OVERRIDES) that point a process at `services`."""
    return {var: str(getattr(services, field)) for var, field in ENV_OVERRIDES.items()}


def resolve_services(cfg: ServicesConfig) -> Optional[Services]:
    """The configured servers, completed by the running local stack; None if neither suffices.

    A URL that is configured always wins; the local stack fills in the rest (this is how
    an existing Kafka is combined with the local Redis and S3).
    """
    configured = {"kafka_bootstrap": cfg.kafka_bootstrap, "redis_url": cfg.redis_url, "s3_endpoint": cfg.s3_endpoint}
    if all(configured.values()):
        return Services(cfg.kafka_bootstrap, cfg.redis_url, cfg.s3_endpoint, cfg.s3_access_key or "",
                        cfg.s3_secret_key or "", cfg.s3_region, cfg.bucket)
    from infra.local_stack import load_stack

    state = load_stack(cfg.data_dir)
    if state is None:
        return None
    s3_from_config = bool(cfg.s3_endpoint)
    return Services(
        cfg.kafka_bootstrap or state.kafka_bootstrap, cfg.redis_url or state.redis_url,
        cfg.s3_endpoint or state.s3_endpoint,
        (cfg.s3_access_key or "") if s3_from_config else state.s3_access_key,
        (cfg.s3_secret_key or "") if s3_from_config else state.s3_secret_key,
        cfg.s3_region if s3_from_config else state.s3_region,
        cfg.bucket if s3_from_config else state.bucket, from_local_stack=True)


def require_services(cfg: ServicesConfig) -> Services:
    """Like resolve_services, but a missing stack is a user-facing error."""
    services = resolve_services(cfg)
    if services is None:
        raise ServiceUnavailable(
            f"no service URLs configured and no local stack running in {cfg.data_dir}/: "
            "run `heterorl up`, or set KAFKA_BOOTSTRAP_SERVERS, REDIS_URL and AWS_ENDPOINT_URL")
    return services


def _tcp_probe(host: str, port: int, timeout_s: float) -> Optional[str]:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def check_reachable(services: Services, timeout_s: float = 5.0) -> None:
    """Fail fast, naming the first server that refuses a TCP connection."""
    hint = "start it (`heterorl up` for the local stack) or fix the URL"
    for host_port in services.kafka_bootstrap.split(","):
        host, _, port = host_port.strip().rpartition(":")
        err = _tcp_probe(host or "localhost", int(port or 9092), timeout_s)
        if err is None:
            break
    else:
        raise ServiceUnavailable(f"cannot reach Kafka at {services.kafka_bootstrap} ({err}): {hint}")
    r = urlparse(services.redis_url)
    err = _tcp_probe(r.hostname or "localhost", r.port or 6379, timeout_s)
    if err:
        raise ServiceUnavailable(f"cannot reach Redis at {strip_password(services.redis_url)} ({err}): {hint}")
    s = urlparse(services.s3_endpoint)
    err = _tcp_probe(s.hostname or "localhost", s.port or (443 if s.scheme == "https" else 80), timeout_s)
    if err:
        raise ServiceUnavailable(f"cannot reach S3 at {services.s3_endpoint} ({err}): {hint}")


class Backoff:
    """Retry pacing for an unreachable server: doubling waits up to a bound, reset on success."""

    def __init__(self, max_s: float, first_s: float = 0.5):
        self.max_s, self.first_s = max_s, first_s
        self.failures = 0
        self.next_try = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def failed(self) -> float:
        self.failures += 1
        wait = min(self.max_s, self.first_s * 2 ** (self.failures - 1))
        self.next_try = time.monotonic() + wait
        return wait

    def succeeded(self) -> None:
        self.failures, self.next_try = 0, 0.0
