"""Where the servers are, and a one-line error when one cannot be reached.

Resolution order for each URL: the config file / `--set`, then the environment
(`KAFKA_BOOTSTRAP_SERVERS`, `REDIS_URL`, `AWS_ENDPOINT_URL`, ...; applied by
`load_config`), then a running local stack, which the `heterorl` commands look up in
`services.data_dir` and pass to `resolve_services`; this library never starts or reads
one itself. The product always speaks the Kafka, Redis and S3 protocols; only the
addresses differ.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Optional
from urllib.parse import urlparse

from pipeline.config import ENV_OVERRIDES, SECURITY_ENV_OVERRIDES, ServicesConfig, strip_password
from pipeline.errors import UserError

LOOPBACK = "127.0.0.1"


class ServiceUnavailable(UserError, RuntimeError):
    """A server that does not answer; the message names it, its URL and what to do."""

    retryable = True
    """Whether waiting may help (`pipeline.clients.retry.retry_call` retries only these)."""


class CredentialsRefused(ServiceUnavailable):
    """A server that answers but refuses the credentials: a mistake in the configuration, said in
    one line at once, never retried."""

    retryable = False


@dataclass(frozen=True)
class ServiceSecurity:
    """How the clients authenticate and encrypt: the `ServicesConfig` fields of the same names
    (documented there), turned into each client library's keyword arguments."""

    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: Optional[str] = None
    kafka_sasl_username: Optional[str] = None
    kafka_sasl_password: Optional[str] = field(default=None, repr=False)
    kafka_ssl_cafile: Optional[str] = None
    kafka_ssl_certfile: Optional[str] = None
    kafka_ssl_keyfile: Optional[str] = None
    kafka_ssl_check_hostname: bool = True
    redis_ssl_ca_certs: Optional[str] = None
    redis_ssl_certfile: Optional[str] = None
    redis_ssl_keyfile: Optional[str] = None
    s3_ca_file: Optional[str] = None
    s3_cert_check: bool = True

    @classmethod
    def from_config(cls, cfg: ServicesConfig) -> "ServiceSecurity":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    def kafka_kwargs(self) -> dict[str, Any]:
        """For KafkaProducer / KafkaConsumer / KafkaAdminClient (kafka-python)."""
        kwargs: dict[str, Any] = {"security_protocol": self.kafka_security_protocol}
        if self.kafka_security_protocol.startswith("SASL_"):
            kwargs.update(sasl_mechanism=self.kafka_sasl_mechanism, sasl_plain_username=self.kafka_sasl_username,
                          sasl_plain_password=self.kafka_sasl_password)
        if self.kafka_security_protocol in ("SSL", "SASL_SSL"):
            kwargs.update(ssl_cafile=self.kafka_ssl_cafile, ssl_certfile=self.kafka_ssl_certfile,
                          ssl_keyfile=self.kafka_ssl_keyfile, ssl_check_hostname=self.kafka_ssl_check_hostname)
        return kwargs

    def redis_kwargs(self, url: str) -> dict[str, Any]:
        """For redis-py's `from_url`: TLS files with a `rediss://` URL (user and password are
        in the URL); nothing for `redis://`."""
        if urlparse(url).scheme != "rediss":
            return {}
        files = {"ssl_ca_certs": self.redis_ssl_ca_certs, "ssl_certfile": self.redis_ssl_certfile,
                 "ssl_keyfile": self.redis_ssl_keyfile}
        return {"ssl_cert_reqs": "required", **{k: v for k, v in files.items() if v}}

    def s3_pool_kwargs(self, endpoint: str) -> dict[str, Any]:
        """For the urllib3 PoolManager of the MinIO client: certificate checks of an `https://`
        endpoint (the CA file, else $SSL_CERT_FILE, else certifi's, as MinIO does)."""
        if urlparse(endpoint).scheme != "https":
            return {}
        if not self.s3_cert_check:
            return {"cert_reqs": "CERT_NONE"}
        import certifi  # a dependency of minio

        return {"cert_reqs": "CERT_REQUIRED",
                "ca_certs": self.s3_ca_file or os.environ.get("SSL_CERT_FILE") or certifi.where()}


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
    security: ServiceSecurity = ServiceSecurity()

    def public(self) -> dict:
        """Everything but the secrets."""
        return {"kafka_bootstrap": self.kafka_bootstrap, "redis_url": strip_password(self.redis_url),
                "s3_endpoint": self.s3_endpoint, "bucket": self.bucket}


KAFKA_LOGIN_ENV = ("KAFKA_SECURITY_PROTOCOL", "KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD")


def services_env(services: Services) -> dict[str, str]:
    """The environment variables (config.ENV_OVERRIDES) that point a process at `services`, and its
    Kafka login where it has one (a gate's: SECURITY_ENV_OVERRIDES)."""
    env = {var: str(getattr(services, field)) for var, field in ENV_OVERRIDES.items()}
    if services.security.kafka_sasl_username:
        env.update({var: str(getattr(services.security, SECURITY_ENV_OVERRIDES[var])) for var in KAFKA_LOGIN_ENV})
    return env


def resolve_services(cfg: ServicesConfig, local_stack: Optional[Services] = None) -> Optional[Services]:
    """The configured servers, completed by `local_stack` (a running local stack's servers,
    if any); None if neither suffices.

    A URL that is configured always wins; the local stack fills in the rest (this is how
    an existing Kafka is combined with the local Redis and S3). S3 credentials, region and
    bucket go with the S3 endpoint they belong to.
    """
    configured = {"kafka_bootstrap": cfg.kafka_bootstrap, "redis_url": cfg.redis_url, "s3_endpoint": cfg.s3_endpoint}
    if all(configured.values()):
        return Services(cfg.kafka_bootstrap, cfg.redis_url, cfg.s3_endpoint, cfg.s3_access_key or "",
                        cfg.s3_secret_key or "", cfg.s3_region, cfg.bucket, security=ServiceSecurity.from_config(cfg))
    if local_stack is None:
        return None
    s, s3_from_config = local_stack, bool(cfg.s3_endpoint)
    return Services(
        cfg.kafka_bootstrap or s.kafka_bootstrap, cfg.redis_url or s.redis_url, cfg.s3_endpoint or s.s3_endpoint,
        (cfg.s3_access_key or "") if s3_from_config else s.s3_access_key,
        (cfg.s3_secret_key or "") if s3_from_config else s.s3_secret_key,
        cfg.s3_region if s3_from_config else s.s3_region,
        cfg.bucket if s3_from_config else s.bucket, from_local_stack=True,
        security=ServiceSecurity.from_config(cfg))


def require_services(cfg: ServicesConfig) -> Services:
    """The configured servers; a missing URL is a user-facing error.

    `heterorl` fills the config from the running local stack before a role starts, so a
    role never needs to know whether its servers are local.
    """
    services = resolve_services(cfg)
    if services is None:
        raise ServiceUnavailable(
            f"no servers configured (services.kafka_bootstrap, redis_url, s3_endpoint) and no local stack "
            f"found in {cfg.data_dir}/: run `heterorl up`, or set KAFKA_BOOTSTRAP_SERVERS, REDIS_URL and "
            "AWS_ENDPOINT_URL")
    return services


def free_port(taken: Optional[set[int]] = None) -> int:
    """A free loopback port, not in `taken` (which gets it added): ports picked together differ."""
    taken = set() if taken is None else taken
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port
    raise ServiceUnavailable("could not find a free loopback port")


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
