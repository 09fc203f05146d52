"""Where the servers are, and a one-line error when one cannot be reached.

Resolution order for each URL: the config file / `--set`, then the environment
(`KAFKA_BOOTSTRAP_SERVERS`, `REDIS_URL`, `AWS_ENDPOINT_URL`, ...; applied by
`load_config`), then the local stack recorded in `services.data_dir`. The product
always speaks the Kafka, Redis and S3 protocols; only the addresses differ.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlparse

from pipeline.config import ServicesConfig


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
        return {"kafka_bootstrap": self.kafka_bootstrap, "redis_url": _strip_password(self.redis_url),
                "s3_endpoint": self.s3_endpoint, "bucket": self.bucket}


def _strip_password(url: str) -> str:
    p = urlparse(url)
    if p.password:
        return url.replace(f":{p.password}@", ":***@")
    return url


def _configured(cfg: ServicesConfig) -> bool:
    return bool(cfg.kafka_bootstrap and cfg.redis_url and cfg.s3_endpoint)


def resolve_services(cfg: ServicesConfig) -> Optional[Services]:
    """The configured servers, else the running local stack, else None."""
    if _configured(cfg):
        return Services(cfg.kafka_bootstrap, cfg.redis_url, cfg.s3_endpoint, cfg.s3_access_key or "",
                        cfg.s3_secret_key or "", cfg.s3_region, cfg.bucket)
    partial = [n for n in ("kafka_bootstrap", "redis_url", "s3_endpoint") if getattr(cfg, n)]
    if partial:
        missing = sorted({"kafka_bootstrap", "redis_url", "s3_endpoint"} - set(partial))
        raise ServiceUnavailable(
            f"services.{', services.'.join(missing)} not set while {', '.join(partial)} is: "
            "configure all three service URLs, or none to use the local stack")
    from infra.local_stack import load_stack

    state = load_stack(cfg.data_dir)
    if state is None:
        return None
    return Services(state.kafka_bootstrap, state.redis_url, state.s3_endpoint, state.s3_access_key,
                    state.s3_secret_key, state.s3_region, state.bucket, from_local_stack=True)


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
        raise ServiceUnavailable(f"cannot reach Redis at {_strip_password(services.redis_url)} ({err}): {hint}")
    s = urlparse(services.s3_endpoint)
    err = _tcp_probe(s.hostname or "localhost", s.port or (443 if s.scheme == "https" else 80), timeout_s)
    if err:
        raise ServiceUnavailable(f"cannot reach S3 at {services.s3_endpoint} ({err}): {hint}")
