"""Authorizing Kafka gate: SCRAM logins and per-user topic grants in front of a broker that has none.

What it is: a small Kafka-protocol proxy. Clients that are not the operator's own processes
(volunteer samplers joining by an invite, validators) connect to the gate instead of the
broker; the gate authenticates each connection with SASL SCRAM-SHA-256, decodes every request
with kafka-python's own protocol classes, forwards what the user's grant allows to the broker
over its own connection (one upstream connection per client connection) and answers the rest
itself with an authorization error. The operator's processes keep using the broker's own port
on loopback.

Why: the local stack's broker, Tansu 0.6 (``infra/local_stack.py``), enforces no ACLs and
knows no SASL: anyone who reaches its port can delete topics, create 10,000-partition topics,
produce 9 MB records anywhere or write to the learner's control topics.

The users file (``--users FILE``; mode 0600, a file others may read is refused; written by
``write_users``/``add_user``/``remove_user`` as tmp + rename; the gate re-reads it when its
inode, mtime, size or mode changes, checked every second and on each new connection)::

    {
      "version": 1,
      "users": {
        "sampler-7f3a": {
          "scram_sha_256": {"salt": "<base64>", "iterations": 4096,
                            "stored_key": "<base64>", "server_key": "<base64>"},
          "grant": {"produce": ["run.rollouts"], "fetch": [], "describe": null,
                    "max_record_bytes": 8388608}
        }
      }
    }

Only SCRAM verifiers are stored (RFC 5802: salt, iteration count, StoredKey = H(HMAC(
SaltedPassword, "Client Key")), ServerKey = HMAC(SaltedPassword, "Server Key")), never a
password. ``describe`` null or absent means produce | fetch. Topic names are exact. A user
whose entry is malformed is skipped (logged); a file that is missing or not valid JSON leaves
the gate with no users at all (fail closed: every connection is closed, every login fails,
until the file is fixed). A user who disappears from the file, or whose verifier changes, has
every open connection closed within 2 s; a changed grant applies to the next request.

What each api key gets (after login; before it only ApiVersions, SaslHandshake and
SaslAuthenticate are accepted, anything else closes the connection):

=====================  =========  ===========================================================
api key                versions   the gate
=====================  =========  ===========================================================
ApiVersions (18)       0-4        answers itself: the broker's ranges, cut to the keys below
                                  and to the versions here
SaslHandshake (17)     0-1        SCRAM-SHA-256 only; v0: raw tokens follow, v1: tokens in
SaslAuthenticate (36)  0-2        SaslAuthenticate (kafka-python 3.0.12 sends SaslHandshake v1,
                                  then SaslAuthenticate v2; ``sasl_handshake_max=0`` offers v0
                                  only, and kafka-python then sends raw tokens)
Metadata (3)           4-12       topics outside ``describe`` are taken out of the request and
                                  answered TOPIC_AUTHORIZATION_FAILED; an all-topics request
                                  answers only described topics; auto-creation forced off
                                  (1-3 cannot say it: a topic named would be created);
                                  every broker's host/port rewritten to the gate's advertised
                                  address (a single-broker cluster: all point at the gate)
Produce (0)            3-9        every topic in ``produce``, no transactional id; per
                                  partition the record data at most max_record_bytes + 64 KiB,
                                  magic-2 batches, codec none/gzip/zstd (lz4 and snappy refused),
                                  every record value (decompressed, streamed one record at a
                                  time) at most max_record_bytes; decompressed data per
                                  request at most 4 x (max_record_bytes + 64 KiB) and 200,000
                                  records. Refused partitions get their own error code
                                  (29, 10 MESSAGE_TOO_LARGE, 18 RECORD_LIST_TOO_LARGE, 76, 87,
                                  53), allowed partitions of the same request still go to the
                                  broker; acks=0 requests get no answer either way
InitProducerId (22)    0-5        only without a transactional id (idempotent producers)
Fetch (1)              4-12       every topic in ``fetch`` (else the whole request is refused,
                                  29 on each partition); consumer fetches only; fetch sessions
                                  are turned off (session 0, epoch -1) since an incremental
                                  fetch names partitions the gate cannot see
ListOffsets (2)        1-9        every topic in ``fetch``, else refused (29 per partition)
anything else                     refused: an error response where the response has a
                                  top-level error code or per-topic results (CreateTopics,
                                  DeleteTopics, CreatePartitions, DeleteRecords, FindCoordinator
                                  v4+: 29/31), otherwise the connection is closed
=====================  =========  ===========================================================

Versions are capped where a newer one names topics by id (Fetch 13+) or carries broker
addresses the gate would have to rewrite (Produce 10+). A request frame larger than the
user's max_record_bytes + 1 MiB (``max_frame_bytes`` overrides it; 64 KiB before login) is
refused from its 4-byte size, before its body is read, and the connection closed. Refusals
are counted per user and reason (``stats()``) and logged once per connection and kind.
At most ``max_connections`` (1024) connections are open at once, ``max_unauthenticated`` (64)
of them not logged in yet (others are closed at once), and ``max_user_connections`` (32) of one
user (the next login fails): so one user makes the gate hold at most 32 x (its request cap + 64
answers read ahead).

Running it::

    python -m infra.kafka_gate --listen 0.0.0.0:19092 --broker 127.0.0.1:9092 \\
        --users /srv/heterorl/kafka-users.json --advertise gate.example.org:19092

    from infra.kafka_gate import KafkaGate, KafkaGrant, add_user
    add_user(path, "sampler-7f3a", password, KafkaGrant(produce=frozenset({"run.rollouts"})))
    gate = KafkaGate(listen=("127.0.0.1", 0), broker=("127.0.0.1", 9092), users_file=path)
    gate.start(); print(gate.address); ...; gate.stop()

Clients (kafka-python): ``security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
sasl_plain_username=..., sasl_plain_password=...`` and the gate's address as bootstrap. SCRAM
keeps the password off the wire, but the traffic itself is plaintext: put TLS in front of the
gate for untrusted networks. What kafka-python 3.0.12 does with the gate's answers:

* a wrong password: every bootstrap attempt fails with SaslAuthenticationFailedError (logged,
  with the gate's message); the client retries until ``bootstrap_timeout_ms`` and then raises
  KafkaTimeoutError("Unable to bootstrap ...");
* ``KafkaAdminClient.create_topics``/``delete_topics``: refused on the client already
  (IncompatibleBrokerVersion), as the gate does not offer those APIs; a client that sends
  them anyway gets TOPIC_AUTHORIZATION_FAILED per topic;
* it drops bytes that arrive together with the end of the stream, so after an answer that
  ends a connection the gate waits up to 2 s for the client to close first.

Run the gate as a process of its own (the CLI): in one process with a busy Python client the
two contend for the GIL (measured: 1,000 x 10 KB acks=all produce took about 1.8 times as long in-process
as with the gate in its own process). One broker only: every broker in Metadata is the gate.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import fnmatch
import gzip
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import struct
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional, Sequence

# Importing these modules defines kafka-python's classes for every API (REQUEST_CLASSES finds
# them), the admin APIs' included: the gate decodes refused requests to answer them.
import kafka.protocol.admin  # noqa: F401
from kafka.protocol.api_header import ResponseClassRegistry
from kafka.protocol.api_message import ApiMessage
from kafka.protocol.consumer import FetchResponse, ListOffsetsResponse
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataResponse
from kafka.protocol.producer import InitProducerIdResponse, ProduceResponse
from kafka.protocol.sasl import SaslAuthenticateResponse, SaslHandshakeResponse
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import decode_varint

from infra.private_files import serve_until_stopped, update_locked, write_private_json
from pipeline.errors import UserError

log = logging.getLogger(__name__)

SCRAM_MECHANISM = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096
MIN_ITERATIONS = 4096  # RFC 7677's floor
MAX_ITERATIONS = 1_000_000  # kafka-python refuses a server-first message above this
USERS_FILE_VERSION = 1
DEFAULT_MAX_RECORD_BYTES = 1 << 20
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")

USERS_POLL_S = 1.0  # revocation within 2 s: a poll period plus the close
AUTH_TIMEOUT_S = 10.0  # a connection that has not logged in by then is closed
AUTH_FAILURE_DELAY_S = 0.2  # slows password guessing on one connection
CLOSE_LINGER_S = 2.0  # after an error answer that ends a connection: wait this long for the client to close
PRE_AUTH_MAX_FRAME = 64 * 1024
FRAME_SLACK = 1 << 20  # default request cap: max_record_bytes + this
BATCH_SLACK = 64 * 1024  # a partition's record data may exceed max_record_bytes by this (headers, keys)
DECOMPRESSION_FACTOR = 4  # decompressed bytes per Produce: at most this x (max_record_bytes + BATCH_SLACK)
MAX_RECORDS_CHECKED = 200_000  # records parsed per Produce (CPU: tiny records in a compressed batch)
UPSTREAM_MAX_FRAME = 512 << 20  # the broker is trusted; this only catches a desynchronised stream
MAX_PENDING_REPLIES = 64  # requests read ahead of their answers, per connection
MAX_USER_CONNECTIONS = 32  # logged-in connections of one user at once: its share of the gate's memory
MAX_UNAUTHENTICATED = 64  # connections not logged in yet, at once
INLINE_PRODUCE_BYTES = 256 * 1024  # larger Produce requests are always checked on a worker thread

# Kafka error codes the gate answers with.
NONE = 0
INVALID_RECORD = 87
MESSAGE_TOO_LARGE = 10
RECORD_LIST_TOO_LARGE = 18
TOPIC_AUTHORIZATION_FAILED = 29
CLUSTER_AUTHORIZATION_FAILED = 31
UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
UNSUPPORTED_VERSION = 35
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
SASL_AUTHENTICATION_FAILED = 58
UNSUPPORTED_COMPRESSION_TYPE = 76

PRODUCE, FETCH, LIST_OFFSETS, METADATA = 0, 1, 2, 3
SASL_HANDSHAKE, API_VERSIONS, INIT_PRODUCER_ID, SASL_AUTHENTICATE = 17, 18, 22, 36


class GateError(UserError, RuntimeError):
    """A gate or users-file operation failed; the message is one user-facing line."""


# --------------------------------------------------------------------------- users and grants


@dataclass(frozen=True)
class KafkaGrant:
    """What one user may do through the gate. Topics are names or fnmatch globs (``*.rollouts``);
    ``describe`` None: produce | fetch. ``everything``: every request the gate forwards, the admin
    ones (``ADMIN_VERSIONS``: create or delete topics...) included, unfiltered (the operator's own
    learner and admin on another machine); the gate still rewrites the broker's address to its own."""

    produce: frozenset[str] = frozenset()
    fetch: frozenset[str] = frozenset()
    describe: frozenset[str] | None = None
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    everything: bool = False

    @property
    def describable(self) -> frozenset[str]:
        return self.describe if self.describe is not None else self.produce | self.fetch

    def may(self, what: str, topic: Optional[str]) -> bool:
        """Whether the grant names `topic` among its `what` (produce, fetch, describe) topics."""
        if self.everything:
            return True
        patterns = self.describable if what == "describe" else getattr(self, what)
        return topic is not None and any(fnmatch.fnmatchcase(topic, p) for p in patterns)

    def to_json(self) -> dict[str, Any]:
        return {"produce": sorted(self.produce), "fetch": sorted(self.fetch),
                "describe": None if self.describe is None else sorted(self.describe),
                "max_record_bytes": self.max_record_bytes, "everything": self.everything}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "KafkaGrant":
        def topics(key: str) -> frozenset[str]:
            value = d.get(key) or []
            if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
                raise ValueError(f"grant.{key} must be a list of topic names")
            return frozenset(value)

        limit = d.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise ValueError("grant.max_record_bytes must be a positive integer")
        everything = d.get("everything", False)
        if not isinstance(everything, bool):
            raise ValueError("grant.everything must be true or false")
        return cls(produce=topics("produce"), fetch=topics("fetch"),
                   describe=None if d.get("describe") is None else topics("describe"), max_record_bytes=limit,
                   everything=everything)


@dataclass(frozen=True)
class ScramVerifier:
    """What the server keeps of a password (RFC 5802 section 3)."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def to_json(self) -> dict[str, Any]:
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        return {"salt": b64(self.salt), "iterations": self.iterations,
                "stored_key": b64(self.stored_key), "server_key": b64(self.server_key)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ScramVerifier":
        try:
            salt, stored, server = (base64.b64decode(d[k], validate=True)
                                    for k in ("salt", "stored_key", "server_key"))
        except (KeyError, TypeError, ValueError):
            raise ValueError("scram_sha_256 needs base64 salt, stored_key and server_key") from None
        iterations = d.get("iterations")
        if not isinstance(iterations, int) or not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"scram_sha_256.iterations must be an integer in [{MIN_ITERATIONS}, {MAX_ITERATIONS}]")
        if len(stored) != 32 or len(server) != 32 or not salt:
            raise ValueError("scram_sha_256 keys must be 32 bytes (SHA-256) and the salt non-empty")
        return cls(salt, iterations, stored, server)


@dataclass(frozen=True)
class GateUser:
    name: str
    verifier: ScramVerifier
    grant: KafkaGrant


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = DEFAULT_ITERATIONS) -> dict:
    """The users-file ``scram_sha_256`` entry for ``password`` (JSON-ready; the password is not in it)."""
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise GateError(f"SCRAM iterations must be in [{MIN_ITERATIONS}, {MAX_ITERATIONS}], not {iterations}")
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    stored_key = hashlib.sha256(_hmac(salted, b"Client Key")).digest()
    return ScramVerifier(salt, iterations, stored_key, _hmac(salted, b"Server Key")).to_json()


def parse_users(doc: Any) -> tuple[dict[str, GateUser], list[str]]:
    """Users of a users-file document, and one line per entry that was skipped as malformed.
    Raises ValueError when the document as a whole is not a users file."""
    if (not isinstance(doc, dict) or doc.get("version") != USERS_FILE_VERSION
            or not isinstance(doc.get("users"), dict)):
        raise ValueError(f'not a users file: expected {{"version": {USERS_FILE_VERSION}, "users": {{...}}}}')
    users, problems = {}, []
    for name, entry in doc["users"].items():
        try:
            if not USER_NAME.fullmatch(name):
                raise ValueError("the name must match " + USER_NAME.pattern)
            if not isinstance(entry, dict):
                raise ValueError("the entry must be an object")
            users[name] = GateUser(name, ScramVerifier.from_json(entry.get("scram_sha_256") or {}),
                                   KafkaGrant.from_json(entry.get("grant") or {}))
        except ValueError as exc:
            problems.append(f"user {name!r}: {exc}")
    return users, problems


def read_users(path: str | Path) -> dict[str, GateUser]:
    """The valid users of a users file (malformed entries are logged and skipped). GateError if
    the file is missing, readable by others (it holds verifiers, which can be attacked offline;
    as infra/redis_gate.py) or not a users file."""
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if mode & 0o077:
                raise GateError(f"the Kafka gate's users file {path} has mode {mode & 0o777:o}; run chmod 600 {path}")
            users, problems = parse_users(json.loads(fh.read()))
    except (OSError, ValueError) as exc:
        raise GateError(f"cannot read the Kafka gate's users file {path}: {exc}") from None
    for problem in problems:
        log.error("kafka gate users file %s: skipped %s", path, problem)
    return users


def _entry(value: Any) -> dict:
    """A users-file entry from what callers hand ``write_users``: an entry dict or a GateUser."""
    if isinstance(value, GateUser):
        return {"scram_sha_256": value.verifier.to_json(), "grant": value.grant.to_json()}
    entry = dict(value)
    if isinstance(entry.get("grant"), KafkaGrant):
        entry["grant"] = entry["grant"].to_json()
    return entry


def write_users(path: str | Path, users: Mapping[str, Any]) -> None:
    """Write a users file (mode 0600) as tmp + rename, so the gate never reads half of one.
    ``users``: name -> {"scram_sha_256": ..., "grant": KafkaGrant or its JSON} (or a GateUser)."""
    path = Path(path)
    doc = {"version": USERS_FILE_VERSION, "users": {name: _entry(v) for name, v in sorted(users.items())}}
    _, problems = parse_users(doc)
    if problems:
        raise GateError(f"refusing to write {path}: {problems[0]}")
    write_private_json(path, doc, indent=1)


def _raw_users(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        parse_users(doc)
    except (OSError, ValueError) as exc:
        raise GateError(f"cannot update the Kafka gate's users file {path}: {exc}") from None
    return dict(doc["users"])


def add_user(path: str | Path, name: str, password: str, grant: KafkaGrant,
             iterations: int = DEFAULT_ITERATIONS) -> None:
    """Add ``name`` (or replace it: a new password closes its open connections) to the users file."""
    if not USER_NAME.fullmatch(name):
        raise GateError(f"Kafka gate user name {name!r} must match {USER_NAME.pattern}")
    entry = {"scram_sha_256": scram_verifier(password, iterations=iterations), "grant": grant.to_json()}
    update_locked(path, _raw_users, write_users, lambda users: users.update({name: entry}) or True)


def remove_user(path: str | Path, name: str) -> bool:
    """Remove ``name`` from the users file; the gate closes its connections. False: it was not there."""
    return update_locked(path, _raw_users, write_users, lambda users: users.pop(name, None) is not None)


# --------------------------------------------------------------------------- SCRAM (server side)


class ScramError(Exception):
    """A SCRAM exchange failed; the message is safe to send to the client."""


def _scram_attrs(text: str) -> list[tuple[str, str]]:
    attrs = []
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError("malformed SCRAM message")
        attrs.append((part[0], part[2:]))
    return attrs


def _saslname(value: str) -> str:
    """RFC 5802 saslname: ',' and '=' arrive as '=2C' and '=3D'; any other '=' is an error."""
    if re.search(r"=(?!2C|3D)", value):
        raise ScramError("malformed user name")
    return value.replace("=2C", ",").replace("=3D", "=")


class ScramServer:
    """The server's half of one SCRAM-SHA-256 exchange (RFC 5802, RFC 7677): two steps.

    ``lookup(name)`` gives a user's verifier or None. An unknown user gets a made-up salt
    (the same one each time, from ``fake_secret``) and fails only at the proof, so the
    exchange does not tell which names exist.
    """

    def __init__(self, lookup: Callable[[str], Optional[ScramVerifier]], fake_secret: bytes,
                 server_nonce: str | None = None):
        self._lookup, self._fake_secret = lookup, fake_secret
        self._server_nonce = server_nonce or base64.b64encode(secrets.token_bytes(18)).decode()
        self._state = "first"
        self._verifier: Optional[ScramVerifier] = None
        self.username: str | None = None
        self.authenticated = False

    @property
    def done(self) -> bool:
        return self._state == "done"

    def step(self, message: bytes) -> bytes:
        """The answer to the client's next message. Raises ScramError on any failure."""
        try:
            text = message.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("malformed SCRAM message") from None
        if self._state == "first":
            return self._first(text).encode()
        if self._state == "final":
            return self._final(text).encode()
        raise ScramError("the SCRAM exchange is already over")

    def _first(self, text: str) -> str:
        # gs2-header: "n,," (no channel binding) or "y,," (client could but thinks we cannot);
        # "p=" asks for channel binding, which a plaintext listener cannot offer.
        parts = text.split(",", 2)
        if len(parts) != 3 or parts[0] not in ("n", "y"):
            raise ScramError("channel binding is not supported; expected a gs2 header 'n,,'")
        self._gs2_header = f"{parts[0]},{parts[1]},"
        self._client_first_bare = parts[2]
        attrs = _scram_attrs(parts[2])
        if len(attrs) < 2 or attrs[0][0] != "n" or attrs[1][0] != "r" or not attrs[1][1]:
            raise ScramError("malformed client-first message")
        if any(key == "m" for key, _ in attrs[2:]):
            raise ScramError("mandatory SCRAM extensions are not supported")
        self.username = _saslname(attrs[0][1])
        authzid = parts[1]
        if authzid and authzid != f"a={attrs[0][1]}":
            raise ScramError("authorization as another user is not supported")
        self._verifier = self._lookup(self.username)
        salt, iterations = ((self._verifier.salt, self._verifier.iterations) if self._verifier
                            else (_hmac(self._fake_secret, self.username.encode())[:16], DEFAULT_ITERATIONS))
        self._nonce = attrs[1][1] + self._server_nonce
        self._server_first = f"r={self._nonce},s={base64.b64encode(salt).decode()},i={iterations}"
        self._state = "final"
        return self._server_first

    def _final(self, text: str) -> str:
        self._state = "done"
        without_proof, sep, proof_b64 = text.rpartition(",p=")
        if not sep:
            raise ScramError("malformed client-final message")
        attrs = dict(_scram_attrs(without_proof))
        if attrs.get("c") != base64.b64encode(self._gs2_header.encode()).decode():
            raise ScramError("channel binding data does not match the gs2 header")
        if attrs.get("r") != self._nonce:
            raise ScramError("nonce mismatch")
        try:
            proof = base64.b64decode(proof_b64, validate=True)
        except ValueError:
            raise ScramError("malformed client proof") from None
        auth_message = f"{self._client_first_bare},{self._server_first},{without_proof}".encode()
        verifier = self._verifier
        if verifier is None or len(proof) != len(verifier.stored_key):
            raise ScramError("authentication failed")
        client_key = bytes(a ^ b for a, b in zip(proof, _hmac(verifier.stored_key, auth_message)))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), verifier.stored_key):
            raise ScramError("authentication failed")
        self.authenticated = True
        return "v=" + base64.b64encode(_hmac(verifier.server_key, auth_message)).decode()

    @property
    def verifier(self) -> Optional[ScramVerifier]:
        return self._verifier


# --------------------------------------------------------------------------- protocol helpers


def _request_classes() -> dict[int, type[ApiMessage]]:
    """Api key -> kafka-python's request class, for every API it defines."""
    found: dict[int, type[ApiMessage]] = {}
    stack = list(ApiMessage.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(cls, "_class_version", None) is None and cls.type == "request":
            found[cls.API_KEY] = cls
    return found


REQUEST_CLASSES = _request_classes()


def _clamp(key: int, low: int, high: int) -> tuple[int, int]:
    """A version range cut to what kafka-python's classes can decode and encode for ``key``."""
    cls = REQUEST_CLASSES[key]
    return max(low, cls.valid_versions[0]), min(high, cls.valid_versions[1])


# Forwarded to the broker (cut further to the broker's own ranges). Why these caps: Produce
# 3+ carries magic-2 batches only and 10+ responses may carry broker addresses; Fetch 13+
# names topics by id, which a grant cannot check; Metadata 0 reads [] as "all topics", and
# before 4 a request cannot say "do not create the topics I name" (from 4 on the gate says it).
FORWARDED_VERSIONS = {
    PRODUCE: _clamp(PRODUCE, 3, 9),
    FETCH: _clamp(FETCH, 4, 12),
    LIST_OFFSETS: _clamp(LIST_OFFSETS, 1, 9),
    METADATA: _clamp(METADATA, 4, 12),
    INIT_PRODUCER_ID: _clamp(INIT_PRODUCER_ID, 0, 5),
}
# Forwarded for a grant of `everything` only (responses that carry no broker address).
ADMIN_VERSIONS = {key: _clamp(key, 0, high) for key, high in (
    (19, 7),   # CreateTopics
    (20, 6),   # DeleteTopics
    (21, 2),   # DeleteRecords
    (32, 4),   # DescribeConfigs
    (33, 2),   # AlterConfigs
    (37, 3),   # CreatePartitions
) if key in REQUEST_CLASSES}
# Answered by the gate itself.
GATE_VERSIONS = {
    API_VERSIONS: _clamp(API_VERSIONS, 0, 4),
    SASL_HANDSHAKE: _clamp(SASL_HANDSHAKE, 0, 1),
    SASL_AUTHENTICATE: _clamp(SASL_AUTHENTICATE, 0, 2),
}


def api_name(key: int) -> str:
    cls = REQUEST_CLASSES.get(key)
    return cls.name.removesuffix("Request") if cls is not None else f"api key {key}"


def frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def _encode_reply(response: ApiMessage, correlation_id: int) -> bytes:
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True))


def _item(container: Any, field_name: str, **values: Any) -> Any:
    """A new element of ``container``'s struct-array field (kafka-python's generated class)."""
    return container.fields[field_name].data_class(**values)


def api_versions_payload(version: int, correlation_id: int, broker: Mapping[int, tuple[int, int]],
                         sasl_handshake_max: int = GATE_VERSIONS[SASL_HANDSHAKE][1]) -> bytes:
    """The gate's ApiVersions answer: its own APIs, plus the forwarded ones cut to the broker's ranges.
    ``sasl_handshake_max`` 0 makes clients use the raw-token flow (SaslHandshake v0)."""
    ranges = dict(GATE_VERSIONS)
    ranges[SASL_HANDSHAKE] = (0, sasl_handshake_max)
    for key, (low, high) in {**FORWARDED_VERSIONS, **ADMIN_VERSIONS}.items():
        if key in broker:
            low, high = max(low, broker[key][0]), min(high, broker[key][1])
            if low <= high:
                ranges[key] = (low, high)
    if version > GATE_VERSIONS[API_VERSIONS][1]:
        # A newer client: answer v0 with UNSUPPORTED_VERSION and our range; it retries lower.
        low, high = GATE_VERSIONS[API_VERSIONS]
        keys = [_item(ApiVersionsResponse, "api_keys", api_key=API_VERSIONS, min_version=low, max_version=high)]
        return _encode_reply(ApiVersionsResponse[0](error_code=UNSUPPORTED_VERSION, api_keys=keys), correlation_id)
    keys = [_item(ApiVersionsResponse, "api_keys", api_key=k, min_version=lo, max_version=hi)
            for k, (lo, hi) in sorted(ranges.items())]
    return _encode_reply(ApiVersionsResponse[version](error_code=NONE, api_keys=keys, throttle_time_ms=0),
                         correlation_id)


def parse_api_versions(payload: bytes) -> dict[int, tuple[int, int]]:
    """The broker's ApiVersions v0 answer (payload after the size) as api key -> (min, max)."""
    response = ApiVersionsResponse.decode(payload, version=0, header=True)
    if response.error_code:
        raise GateError(f"the broker answered ApiVersions with error {response.error_code}")
    return {k.api_key: (k.min_version, k.max_version) for k in response.api_keys}


def _peek_header(payload: bytes) -> tuple[int, int, int]:
    """(api key, api version, correlation id): the fixed start of every request header."""
    if len(payload) < 8:
        raise ValueError("request shorter than its header")
    return struct.unpack_from(">hhi", payload)


# --------------------------------------------------------------------------- decisions


@dataclass
class Plan:
    """What the gate does with one request (made by ``authorize``; carried out by a connection)."""

    reply: bytes | None = None  # the gate answers with this (payload, no size prefix)
    forward: bytes | None = None  # the payload sent to the broker (the request, possibly rewritten)
    transform: Callable[[bytes], bytes] | None = None  # rewrites the broker's answer
    expect_response: bool = True
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (kind, one-line detail)
    close: str | None = None  # close the connection (after ``reply`` if any), for this reason

    @classmethod
    def refuse(cls, reply: bytes, kind: str, detail: str) -> "Plan":
        """The gate answers (with an error) instead of the broker."""
        return cls(reply=reply, refusals=[(kind, detail)])


def refusal_payload(request: ApiMessage, error: int, message: str | None = None) -> bytes | None:
    """An error answer to a refused request, or None where kafka-python's response class has no
    simple place for one (the caller then closes the connection)."""
    version = request.API_VERSION
    response_cls = ResponseClassRegistry.get_response_class(request.header)
    if response_cls is None:
        return None
    response = response_cls()
    mirror = _MIRRORS.get(request.API_KEY)
    fields = response_cls.fields
    try:
        if mirror is not None:
            mirror(request, response, error, message)
        elif "error_code" in fields and fields["error_code"].for_version_q(version):
            response.error_code = error
            if "error_message" in fields and fields["error_message"].for_version_q(version):
                response.error_message = message
        else:
            return None
        return _encode_reply(response, request.header.correlation_id)
    except Exception as exc:  # a class the gate cannot fill: closing is the answer
        log.debug("kafka gate: no error response for %s v%d (%s)", request.name, version, exc)
        return None


def _mirror_create_topics(request: Any, response: Any, error: int, message: str | None) -> None:
    response.topics = [_item(response, "topics", name=t.name, error_code=error, error_message=message)
                       for t in request.topics]


def _mirror_delete_topics(request: Any, response: Any, error: int, message: str | None) -> None:
    names = request.topic_names if request.API_VERSION <= 5 else [t.name for t in request.topics]
    ids = [None] * len(names) if request.API_VERSION <= 5 else [t.topic_id for t in request.topics]
    response.responses = [_item(response, "responses", name=n, error_code=error,
                                **({"topic_id": i} if i is not None else {})) for n, i in zip(names, ids)]


def _mirror_create_partitions(request: Any, response: Any, error: int, message: str | None) -> None:
    response.results = [_item(response, "results", name=t.name, error_code=error, error_message=message)
                        for t in request.topics]


def _mirror_delete_records(request: Any, response: Any, error: int, message: str | None) -> None:
    topic_cls = response.fields["topics"].data_class
    response.topics = [_item(response, "topics", name=t.name, partitions=[
        _item(topic_cls, "partitions", partition_index=p.partition_index, low_watermark=-1, error_code=error)
        for p in t.partitions]) for t in request.topics]


def _mirror_find_coordinator(request: Any, response: Any, error: int, message: str | None) -> None:
    if request.API_VERSION < 4:
        response.error_code, response.node_id, response.host, response.port = error, -1, "", -1
        if request.API_VERSION >= 1:
            response.error_message = message
        return
    response.coordinators = [_item(response, "coordinators", key=k, node_id=-1, host="", port=-1,
                                   error_code=error, error_message=message) for k in request.coordinator_keys]


_MIRRORS: dict[int, Callable[[Any, Any, int, Optional[str]], None]] = {
    19: _mirror_create_topics, 20: _mirror_delete_topics, 21: _mirror_delete_records,
    37: _mirror_create_partitions, 10: _mirror_find_coordinator,
}


def decode_request(payload: bytes) -> ApiMessage:
    """The request in ``payload`` (header included), decoded by kafka-python's class for its key."""
    key, version, _ = _peek_header(payload)
    cls = REQUEST_CLASSES.get(key)
    if cls is None or not cls.valid_versions[0] <= version <= cls.valid_versions[1]:
        raise ValueError(f"{api_name(key)} v{version} is not a request this gate can decode")
    return cls.decode(payload, version=version, header=True)


def _reencode(request: ApiMessage) -> bytes:
    header = request.header
    request.with_header(correlation_id=header.correlation_id, client_id=header.client_id)
    return bytes(request.encode(header=True))


def authorize(payload: bytes, grant: KafkaGrant, advertised: tuple[str, int]) -> Plan:
    """The plan for one request of a logged-in user (ApiVersions and SASL are the connection's)."""
    key, version, _ = _peek_header(payload)
    allowed = FORWARDED_VERSIONS.get(key) or (ADMIN_VERSIONS.get(key) if grant.everything else None)
    try:
        request = decode_request(payload)
    except Exception as exc:  # noqa: BLE001 - any decode failure of a stranger's bytes
        reason = ("unsupported_version" if allowed and not allowed[0] <= version <= allowed[1]
                  else "malformed" if allowed else f"api:{api_name(key)}")
        return Plan(refusals=[(reason, f"{api_name(key)} v{version}: {exc}")], close=reason)
    if allowed is None:
        error = TOPIC_AUTHORIZATION_FAILED if key in (19, 20, 21, 37) else CLUSTER_AUTHORIZATION_FAILED
        reply = refusal_payload(request, error, "not allowed through the Kafka gate")
        return Plan(reply=reply, refusals=[(f"api:{api_name(key)}", f"{api_name(key)} v{version}")],
                    close=None if reply is not None else f"api:{api_name(key)}")
    if not allowed[0] <= version <= allowed[1]:
        return Plan(refusals=[("unsupported_version", f"{api_name(key)} v{version}")], close="unsupported_version")
    if key == METADATA:
        return plan_metadata(request, grant, advertised)
    if grant.everything:
        return Plan(forward=payload, expect_response=key != PRODUCE or request.acks != 0)
    if key == PRODUCE:
        return plan_produce(request, payload, grant)
    if key == FETCH:
        return plan_fetch(request, payload, grant)
    if key == LIST_OFFSETS:
        return plan_list_offsets(request, payload, grant)
    return plan_init_producer_id(request, payload)


def plan_metadata(request: Any, grant: KafkaGrant, advertised: tuple[str, int]) -> Plan:
    refused_names: list[str] = []
    refused_ids: list[Any] = []
    if request.topics is not None:
        kept = []
        for topic in request.topics:
            if topic.name is not None and grant.may("describe", topic.name):
                kept.append(topic)
            elif topic.name is not None:
                refused_names.append(topic.name)
            else:  # asked by topic id: the grant names topics, so an id cannot be checked
                refused_ids.append(topic.topic_id)
        request.topics = kept
    if request.API_VERSION >= 4 and not grant.everything:
        request.allow_auto_topic_creation = False
    denied = sorted(refused_names) + (["<topics by id>"] if refused_ids else [])
    refusals = [("describe_denied", f"metadata of {', '.join(denied)}")] if denied else []
    return Plan(forward=_reencode(request), refusals=refusals,
                transform=_metadata_rewriter(request.API_VERSION, grant, refused_names, refused_ids, advertised))


def _metadata_rewriter(version: int, grant: KafkaGrant, refused_names: list[str],
                       refused_ids: list[Any], advertised: tuple[str, int]) -> Callable[[bytes], bytes]:
    def rewrite(payload: bytes) -> bytes:
        response = MetadataResponse.decode(payload, version=version, header=True)
        # Clients open every later connection to the addresses listed here: all must be the gate.
        for broker in response.brokers:
            broker.host, broker.port = advertised
        topics = [t for t in response.topics if grant.may("describe", t.name)]
        for name in refused_names:
            topics.append(_item(response, "topics", error_code=TOPIC_AUTHORIZATION_FAILED, name=name, partitions=[]))
        for topic_id in refused_ids:  # names are nullable from v12 on
            topics.append(_item(response, "topics", error_code=TOPIC_AUTHORIZATION_FAILED,
                                name=None if version >= 12 else "", topic_id=topic_id, partitions=[]))
        response.topics = topics
        return _encode_reply(response, response.header.correlation_id)

    return rewrite


def plan_fetch(request: Any, payload: bytes, grant: KafkaGrant) -> Plan:
    names = {t.topic for t in request.topics} | {t.topic for t in (request.forgotten_topics_data or [])}
    denied = sorted(n for n in names if not grant.may("fetch", n))
    if denied or request.replica_id != -1:
        response = FetchResponse[request.API_VERSION](
            throttle_time_ms=0, error_code=NONE, session_id=0,
            responses=[_item(FetchResponse, "responses", topic=t.topic, partitions=[
                _item(FetchResponse.fields["responses"].data_class, "partitions", partition_index=p.partition,
                      error_code=TOPIC_AUTHORIZATION_FAILED, high_watermark=-1, aborted_transactions=None,
                      records=None)
                for p in t.partitions]) for t in request.topics])
        detail = f"fetch from {', '.join(denied)}" if denied else f"replica fetch (replica id {request.replica_id})"
        return Plan.refuse(_encode_reply(response, request.header.correlation_id), "fetch_denied", detail)
    if request.API_VERSION >= 7 and (request.session_id, request.session_epoch) != (0, -1):
        # A fetch session lets a later request name no partitions at all; without sessions every
        # fetch lists (and the gate checks) every partition it reads.
        request.session_id, request.session_epoch = 0, -1
        return Plan(forward=_reencode(request))
    return Plan(forward=payload)


def plan_list_offsets(request: Any, payload: bytes, grant: KafkaGrant) -> Plan:
    denied = sorted(n for n in {t.name for t in request.topics} if not grant.may("fetch", n))
    if denied or request.replica_id != -1:
        topic_cls = ListOffsetsResponse.fields["topics"].data_class
        response = ListOffsetsResponse[request.API_VERSION](throttle_time_ms=0, topics=[
            _item(ListOffsetsResponse, "topics", name=t.name, partitions=[
                _item(topic_cls, "partitions", partition_index=p.partition_index,
                      error_code=TOPIC_AUTHORIZATION_FAILED) for p in t.partitions]) for t in request.topics])
        detail = f"list offsets of {', '.join(denied)}" if denied else "list offsets as a replica"
        return Plan.refuse(_encode_reply(response, request.header.correlation_id), "fetch_denied", detail)
    return Plan(forward=payload)


def plan_init_producer_id(request: Any, payload: bytes) -> Plan:
    if request.transactional_id is None:
        return Plan(forward=payload)
    response = InitProducerIdResponse[request.API_VERSION](throttle_time_ms=0, producer_id=-1, producer_epoch=-1,
                                                            error_code=TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    return Plan.refuse(_encode_reply(response, request.header.correlation_id), "transactions",
                       "transactional producer id")


@dataclass
class _Budget:
    """What one Produce may still cost the check: decompressed bytes and parsed records."""

    bytes_left: int
    records_left: int = MAX_RECORDS_CHECKED


def plan_produce(request: Any, payload: bytes, grant: KafkaGrant) -> Plan:
    """Forward the partitions the grant allows; answer the others with their own error codes."""
    budget = _Budget(DECOMPRESSION_FACTOR * (grant.max_record_bytes + BATCH_SLACK))
    refused: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
    kinds: dict[str, str] = {}
    kept_topics = []
    for topic in request.topic_data:
        kept = []
        for part in topic.partition_data:
            problem = _produce_problem(request, topic.name, part.records, grant, budget)
            if problem is None:
                kept.append(part)
                continue
            code, kind, message = problem
            refused[topic.name].append((part.index, code, message))
            kinds.setdefault(kind, message)
        if kept:
            topic.partition_data = kept
            kept_topics.append(topic)
    refusals = list(kinds.items())
    expect = request.acks != 0
    if not refused:
        return Plan(forward=payload, expect_response=expect)
    if not kept_topics:
        reply = _produce_reply(request.API_VERSION, request.header.correlation_id, refused) if expect else None
        return Plan(reply=reply, expect_response=expect, refusals=refusals)
    request.topic_data = kept_topics
    merge = _produce_merger(request.API_VERSION, refused) if expect else None
    return Plan(forward=_reencode(request), transform=merge, expect_response=expect, refusals=refusals)


def _produce_problem(request: Any, topic: str, records: Optional[bytes], grant: KafkaGrant,
                     budget: _Budget) -> Optional[tuple[int, str, str]]:
    """(error code, refusal kind, message) for one partition of a Produce, or None: allowed."""
    if not grant.may("produce", topic):
        return TOPIC_AUTHORIZATION_FAILED, "produce_denied", f"not allowed to produce to {topic}"
    if request.transactional_id is not None:
        return TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "transactions", "transactional produce is not allowed"
    return check_records(records, grant.max_record_bytes, budget)


def _produce_reply(version: int, correlation_id: int, refused: Mapping[str, list[tuple[int, int, str]]]) -> bytes:
    response = ProduceResponse[version](throttle_time_ms=0, responses=_produce_entries(refused))
    return _encode_reply(response, correlation_id)


def _produce_entries(refused: Mapping[str, list[tuple[int, int, str]]]) -> list[Any]:
    topic_cls = ProduceResponse.fields["responses"].data_class
    return [_item(ProduceResponse, "responses", name=name, partition_responses=[
        _item(topic_cls, "partition_responses", index=index, error_code=code, base_offset=-1,
              error_message=f"{message} (Kafka gate)") for index, code, message in parts])
        for name, parts in refused.items()]


def _produce_merger(version: int, refused: Mapping[str, list[tuple[int, int, str]]]) -> Callable[[bytes], bytes]:
    def merge(payload: bytes) -> bytes:
        response = ProduceResponse.decode(payload, version=version, header=True)
        response.responses = list(response.responses) + _produce_entries(refused)
        return _encode_reply(response, response.header.correlation_id)

    return merge


# --------------------------------------------------------------------------- record checks

_BATCH_HEADER = DefaultRecordBatch.HEADER_STRUCT
_LOG_OVERHEAD = 12  # base offset (8) + length (4): what precedes a batch's length-counted bytes
_MAGIC_OFFSET = 16


def _decompressed(codec: int, data: bytes) -> Optional[BinaryIO]:
    """A reader of ``data`` decompressed, read on demand (never all at once); None: codec not here."""
    if codec == DefaultRecordBatch.CODEC_GZIP:
        return gzip.GzipFile(fileobj=io.BytesIO(data))
    if codec == DefaultRecordBatch.CODEC_ZSTD:
        try:
            import zstandard
        except ImportError:
            return None
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    return None  # lz4 (not a dependency) and snappy (xerial framing): no bounded reader here


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise ValueError("compressed records end early")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_varint(stream: BinaryIO) -> tuple[int, bytes]:
    raw = bytearray()
    while True:
        byte = stream.read(1)
        if not byte:
            raise ValueError("compressed records end early")
        raw += byte
        if not byte[0] & 0x80:
            return decode_varint(raw, 0)[0], bytes(raw)
        if len(raw) >= 5:
            raise ValueError("record length varint too long")


def _batches(records: bytes) -> Iterator[memoryview]:
    """Each record batch in a partition's record data (length-prefixed, as in Kafka's log)."""
    view, pos = memoryview(records), 0
    while pos < len(view):
        if len(view) - pos < _LOG_OVERHEAD:
            raise ValueError("trailing bytes after the last record batch")
        (length,) = struct.unpack_from(">i", view, pos + 8)
        end = pos + _LOG_OVERHEAD + length
        if length < _BATCH_HEADER.size - _LOG_OVERHEAD or end > len(view):
            raise ValueError("record batch length out of range")
        yield view[pos:end]
        pos = end


def check_records(records: Optional[bytes], max_record_bytes: int, budget: _Budget) -> Optional[tuple[int, str, str]]:
    """(error code, refusal kind, message) if a partition's record data breaks the limits, else None.

    Compressed batches are decompressed one record at a time: whatever the compression ratio,
    the check holds one record (at most max_record_bytes + 64 KiB; three copies of it for a
    moment while kafka-python parses it), and ``budget`` caps the decompressed bytes and records
    per request.
    """
    if records is None or len(records) == 0:
        return INVALID_RECORD, "invalid_records", "a partition without record data"
    if len(records) > max_record_bytes + BATCH_SLACK:
        single = _single_record_size(records)
        if single is not None and single > max_record_bytes:  # say "record", the clearer error
            return _too_large(single, max_record_bytes)
        return (RECORD_LIST_TOO_LARGE, "batch_too_large",
                f"record data of {len(records)} bytes for one partition exceeds this user's limit of "
                f"{max_record_bytes + BATCH_SLACK} bytes")
    try:
        for batch in _batches(records):
            problem = _check_batch(batch, max_record_bytes, budget)
            if problem is not None:
                return problem
    except Exception as exc:  # noqa: BLE001 - kafka-python's parsers raise several kinds on bad bytes
        return INVALID_RECORD, "invalid_records", f"malformed record batch: {exc}"
    return None


def produce_needs_worker(payload: bytes, max_record_bytes: int) -> bool:
    """Whether checking this Produce may take long (records to decompress or parse): then it runs
    on a worker thread. Small uncompressed requests, the common case, are checked on the loop:
    a thread hand-off costs them more than the check (about 20 us for 10 KB)."""
    if len(payload) > INLINE_PRODUCE_BYTES:
        return True
    try:
        for topic in decode_request(payload).topic_data:
            for part in topic.partition_data:
                data = part.records or b""
                codecs = (_BATCH_HEADER.unpack_from(b)[5] & DefaultRecordBatch.CODEC_MASK for b in _batches(data))
                if len(data) > max_record_bytes or any(codecs):
                    return True
    except Exception:  # noqa: BLE001 - malformed somewhere: a worker checks the rest too
        return True
    return False


def _single_record_size(records: bytes) -> Optional[int]:
    """The value size when ``records`` is one uncompressed batch of one record (already in
    memory, so parsing it costs nothing extra), else None."""
    try:
        batches = list(_batches(records))
        if len(batches) != 1 or batches[0][_MAGIC_OFFSET] != 2:
            return None
        header = _BATCH_HEADER.unpack_from(batches[0])
        if header[12] != 1 or header[5] & DefaultRecordBatch.CODEC_MASK:
            return None
        value = next(iter(DefaultRecordBatch(batches[0]))).value
        return len(value) if value is not None else None
    except Exception:  # noqa: BLE001 - malformed: the caller's generic answer fits
        return None


def _check_batch(batch: memoryview, max_record_bytes: int, budget: _Budget) -> Optional[tuple[int, str, str]]:
    if batch[_MAGIC_OFFSET] != 2:
        return INVALID_RECORD, "invalid_records", "only magic-2 record batches are accepted"
    header = _BATCH_HEADER.unpack_from(batch)
    attributes, count = header[5], header[12]
    if attributes & (DefaultRecordBatch.CONTROL_MASK | DefaultRecordBatch.TRANSACTIONAL_MASK):
        return INVALID_RECORD, "invalid_records", "control and transactional batches are not accepted"
    if count < 0 or count > budget.records_left:
        return (RECORD_LIST_TOO_LARGE, "batch_too_large",
                f"too many records in one request (limit {MAX_RECORDS_CHECKED})")
    codec = attributes & DefaultRecordBatch.CODEC_MASK
    if codec == DefaultRecordBatch.CODEC_NONE:
        if len(batch) <= max_record_bytes:
            return None  # no value can be larger than the batch that holds it
        budget.records_left -= count
        for record in DefaultRecordBatch(batch):
            if record.value is not None and len(record.value) > max_record_bytes:
                return _too_large(len(record.value), max_record_bytes)
        return None
    stream = _decompressed(codec, bytes(batch[_BATCH_HEADER.size:]))
    if stream is None:
        return (UNSUPPORTED_COMPRESSION_TYPE, "unsupported_compression",
                f"compression codec {codec} cannot be checked here; use gzip or zstd")
    with stream:
        return _check_stream(stream, header, count, max_record_bytes, budget)


def _check_stream(stream: BinaryIO, header: tuple, count: int, max_record_bytes: int,
                  budget: _Budget) -> Optional[tuple[int, str, str]]:
    # Each record is parsed by kafka-python as the only record of an uncompressed batch that
    # has this batch's header fields, so only one record's bytes are ever held.
    single = list(header)
    single[5] &= ~DefaultRecordBatch.CODEC_MASK
    single[12] = 1
    for _ in range(count):
        length, varint = _read_varint(stream)
        if length < 0:
            raise ValueError("negative record length")
        if length > max_record_bytes + BATCH_SLACK:
            return _too_large(length, max_record_bytes)
        if length > budget.bytes_left:
            return (RECORD_LIST_TOO_LARGE, "batch_too_large",
                    "decompressed records of one request exceed this user's limit of "
                    f"{DECOMPRESSION_FACTOR} x (max_record_bytes + {BATCH_SLACK})")
        budget.bytes_left -= length
        budget.records_left -= 1
        # No name keeps the bytes read or their concatenation: only the batch's copy outlives the call.
        batch = DefaultRecordBatch(_BATCH_HEADER.pack(*single) + varint + _read_exact(stream, length))
        value = next(iter(batch)).value
        if value is not None and len(value) > max_record_bytes:
            return _too_large(len(value), max_record_bytes)
    if stream.read(1):
        raise ValueError("bytes after the batch's last record")
    return None


def _too_large(size: int, limit: int) -> tuple[int, str, str]:
    return (MESSAGE_TOO_LARGE, "record_too_large",
            f"a record of {size} bytes exceeds this user's limit of {limit} bytes per record value")


# --------------------------------------------------------------------------- the gate


class _Closed(Exception):
    """Raised inside a connection's tasks to end it (the reason is already logged)."""


class _Connection:
    """One client connection: SASL first, then each request checked and forwarded or answered.

    Answers go back in request order whoever makes them: every request that expects an answer
    puts a future into ``replies`` as it is read, the broker's answers fill the futures of
    forwarded requests in order, and one writer task sends them as they complete, in order.
    """

    def __init__(self, gate: "KafkaGate", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.gate, self.reader, self.writer = gate, reader, writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.user: Optional[GateUser] = None
        self.login_of: Optional[str] = None
        """The user this connection is logging in as, from the moment its login is counted against
        the user's connections (`max_user_connections`: logins that finish together cannot all pass)."""
        self.scram: Optional[ScramServer] = None
        self.handshake_version: Optional[int] = None
        self.raw_sasl = False  # after SaslHandshake v0 the SCRAM messages come as bare frames
        self.replies: asyncio.Queue[asyncio.Future] = asyncio.Queue(MAX_PENDING_REPLIES)
        self.awaiting: collections.deque[tuple[asyncio.Future, Optional[Callable[[bytes], bytes]]]] = \
            collections.deque()
        self.upstream: Optional[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = None
        self.logged: set[str] = set()
        self.tasks: list[asyncio.Task] = []
        self.closed = False
        self.drain_before_close = False  # an error answer is queued: send it, then close
        self.main: Optional[asyncio.Task] = None
        self.writer_task: Optional[asyncio.Task] = None

    @property
    def who(self) -> str:
        """For logs: the user, or the name a login attempt gave."""
        if self.user is not None:
            return self.user.name
        return f"{self.scram.username!r} (not logged in)" if self.scram and self.scram.username else "-"

    # ---- lifecycle

    async def run(self) -> None:
        self.main = asyncio.current_task()
        self.writer_task = asyncio.create_task(self._write_replies())
        self.tasks.append(self.writer_task)
        try:
            deadline = asyncio.get_running_loop().time() + AUTH_TIMEOUT_S
            while not self.closed:
                timeout = None if self.user else max(0.0, deadline - asyncio.get_running_loop().time())
                try:
                    payload = await asyncio.wait_for(self._read_frame(), timeout)
                except asyncio.TimeoutError:
                    self.refused("auth_timeout", f"no login within {AUTH_TIMEOUT_S:.0f} s")
                    break
                if payload is None:
                    break
                await self._handle(payload)
        except (_Closed, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            if not self.closed:
                raise
        except Exception:  # a bug must not take the gate down, only this connection
            log.exception("kafka gate: connection from %s (user %s) failed", self.peer, self.who)
        finally:
            if self.drain_before_close and not self.closed and self.writer_task is not None:
                await self._linger()
            await self._cleanup()

    def close(self, reason: str, graceful: bool = False) -> None:
        """End the connection (from the gate's loop): at once (revocation, stop, a refusal), or
        ``graceful``ly, after what was written so far has been sent."""
        if self.closed:
            return
        self.closed = True
        log.debug("kafka gate: closing %s (user %s): %s", self.peer, self.who, reason)
        if graceful:
            self.writer.close()
        else:
            self.writer.transport.abort()
        if self.upstream is not None:
            self.upstream[1].transport.abort()
        for task in self.tasks:
            task.cancel()
        if self.main is not None and self.main is not asyncio.current_task():
            self.main.cancel()

    async def _linger(self) -> None:
        """Send the error answer (and every answer before it), then give the client a moment to
        close first: kafka-python 3.0.12 drops bytes that arrive together with the end of the
        stream, so closing right after the answer would lose it."""
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.writer_task), AUTH_TIMEOUT_S)

        async def until_eof() -> None:
            """Whatever else the client sends now is read only to be discarded, until it closes."""
            chunk = b"?"
            while chunk:
                chunk = await self.reader.read(65536)

        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(until_eof(), CLOSE_LINGER_S)

    async def _cleanup(self) -> None:
        self.close("done", graceful=True)
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        for fut, _ in self.awaiting:
            fut.cancel()
        self.gate._forget(self)

    # ---- bytes in and out

    def _frame_cap(self) -> int:
        if self.user is None:
            return PRE_AUTH_MAX_FRAME
        return self.gate.max_frame_bytes or self.user.grant.max_record_bytes + FRAME_SLACK

    async def _read_frame(self) -> Optional[bytes]:
        try:
            head = await self.reader.readexactly(4)
        except asyncio.IncompleteReadError:
            return None
        (size,) = struct.unpack(">i", head)
        cap = self._frame_cap()
        if size < 0 or size > cap:
            # Refused from its size alone: the body is never read into memory.
            self.refused("frame_too_large", f"a request of {size} bytes (limit {cap})")
            raise _Closed()
        return await self.reader.readexactly(size)

    async def _write_replies(self) -> None:
        while True:
            fut = await self.replies.get()
            chunks = await fut
            if chunks is None:  # the answer before this one ends the connection
                await self.writer.drain()
                return
            self.writer.writelines(chunks)
            await self.writer.drain()

    async def _answer(self, payload: Optional[bytes], then_close: bool = False) -> None:
        """Queue the gate's own answer (behind every earlier answer)."""
        loop = asyncio.get_running_loop()
        if payload is not None:
            fut = loop.create_future()
            fut.set_result([frame(payload)])
            await self.replies.put(fut)
        if then_close:
            fut = loop.create_future()
            fut.set_result(None)
            await self.replies.put(fut)
            self.drain_before_close = True

    async def _forward(self, payload: bytes, expect_response: bool,
                       transform: Optional[Callable[[bytes], bytes]]) -> None:
        assert self.upstream is not None
        if expect_response:
            fut = asyncio.get_running_loop().create_future()
            self.awaiting.append((fut, transform))
            await self.replies.put(fut)
        writer = self.upstream[1]
        writer.writelines([struct.pack(">i", len(payload)), payload])
        await writer.drain()

    async def _read_upstream(self) -> None:
        assert self.upstream is not None
        reader = self.upstream[0]
        try:
            while True:
                head = await reader.readexactly(4)
                (size,) = struct.unpack(">i", head)
                if not 0 <= size <= UPSTREAM_MAX_FRAME:
                    raise ConnectionError(f"broker sent a frame of {size} bytes")
                payload = await reader.readexactly(size)
                if not self.awaiting:
                    raise ConnectionError("broker answered a request that was not sent")
                fut, transform = self.awaiting.popleft()
                if fut.cancelled():
                    continue
                try:
                    fut.set_result([frame(transform(payload))] if transform else [head, payload])
                except Exception as exc:  # noqa: BLE001 - an answer the gate cannot rewrite
                    log.error("kafka gate: cannot rewrite the broker's answer for %s: %s", self.who, exc)
                    raise ConnectionError("unreadable broker answer") from None
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            if not self.closed:
                log.info("kafka gate: broker connection of %s ended (%s); closing the client's", self.who, exc)
                self.close("broker connection ended")

    # ---- requests

    async def _handle(self, payload: bytes) -> None:
        if self.raw_sasl:
            await self._raw_sasl_token(payload)
            return
        try:
            key, version, correlation_id = _peek_header(payload)
        except ValueError:
            self.refused("malformed", "a request shorter than its header")
            raise _Closed() from None
        if key == API_VERSIONS:
            await self._answer(api_versions_payload(version, correlation_id, await self.gate.broker_versions(),
                                                    self.gate.sasl_handshake_max))
            return
        if self.user is None:
            await self._login_request(key, version, payload)
            return
        if key in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            self.refused("reauthentication", "SASL after login (re-authentication is not supported)")
            raise _Closed()
        grant = self.user.grant
        if key == PRODUCE and produce_needs_worker(payload, grant.max_record_bytes):
            # Decompressing and parsing records is CPU work: off the loop that serves every connection.
            plan = await asyncio.get_running_loop().run_in_executor(
                self.gate.executor, authorize, payload, grant, self.gate.advertised)
        else:
            plan = authorize(payload, grant, self.gate.advertised)
        await self._carry_out(plan)

    async def _carry_out(self, plan: Plan) -> None:
        for kind, detail in plan.refusals:
            self.refused(kind, detail)
        if plan.forward is not None:
            await self._forward(plan.forward, plan.expect_response, plan.transform)
        elif plan.reply is not None:
            await self._answer(plan.reply)
        if plan.close is not None:
            await self._answer(None, then_close=True)
            raise _Closed()

    def refused(self, kind: str, detail: str) -> None:
        # Counted under the user, or "-" before login: names a stranger makes up must not grow stats.
        self.gate._count(self.user.name if self.user else "-", kind)
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning("kafka gate: refused %s for user %s from %s: %s (logged once per connection)",
                        kind, self.who, self.peer, detail)

    # ---- login

    async def _login_request(self, key: int, version: int, payload: bytes) -> None:
        if key not in (SASL_HANDSHAKE, SASL_AUTHENTICATE):
            self.refused("before_login", f"{api_name(key)} before login")
            raise _Closed()
        low, high = GATE_VERSIONS[key]
        if key == SASL_HANDSHAKE:
            high = self.gate.sasl_handshake_max
        if not low <= version <= high:
            self.refused("unsupported_version", f"{api_name(key)} v{version}")
            raise _Closed()
        try:
            request = decode_request(payload)
        except Exception:  # noqa: BLE001
            self.refused("malformed", f"undecodable {api_name(key)}")
            raise _Closed() from None
        if key == SASL_HANDSHAKE:
            await self._handshake(request)
        else:
            await self._authenticate(request)

    async def _handshake(self, request: Any) -> None:
        ok = request.mechanism == SCRAM_MECHANISM and self.handshake_version is None
        error = NONE if ok else (UNSUPPORTED_SASL_MECHANISM if request.mechanism != SCRAM_MECHANISM
                                 else ILLEGAL_SASL_STATE)
        response = SaslHandshakeResponse[request.API_VERSION](error_code=error, mechanisms=[SCRAM_MECHANISM])
        await self._answer(_encode_reply(response, request.header.correlation_id), then_close=not ok)
        if not ok:
            self.refused("sasl_mechanism", f"SASL mechanism {request.mechanism!r}")
            raise _Closed()
        self.handshake_version = request.API_VERSION
        self.scram = self.gate.new_scram()
        self.raw_sasl = request.API_VERSION == 0

    async def _authenticate(self, request: Any) -> None:
        version, cid = request.API_VERSION, request.header.correlation_id
        if self.handshake_version != 1 or self.scram is None:
            response = SaslAuthenticateResponse[version](error_code=ILLEGAL_SASL_STATE, auth_bytes=b"",
                                                         error_message="SaslAuthenticate before SaslHandshake v1")
            await self._answer(_encode_reply(response, cid), then_close=True)
            self.refused("sasl_state", "SaslAuthenticate without SaslHandshake v1")
            raise _Closed()
        try:
            answer = await self._scram_step(bytes(request.auth_bytes))
        except ScramError as exc:
            await asyncio.sleep(AUTH_FAILURE_DELAY_S)
            message = f"Authentication failed for SCRAM-SHA-256 at the Kafka gate: {exc}"
            response = SaslAuthenticateResponse[version](error_code=SASL_AUTHENTICATION_FAILED,
                                                         error_message=message, auth_bytes=b"")
            await self._answer(_encode_reply(response, cid), then_close=True)
            raise _Closed() from None
        response = SaslAuthenticateResponse[version](error_code=NONE, error_message=None, auth_bytes=answer,
                                                     session_lifetime_ms=0)
        await self._answer(_encode_reply(response, cid))
        if self.scram.done:
            await self._logged_in()

    async def _raw_sasl_token(self, token: bytes) -> None:
        assert self.scram is not None
        try:
            answer = await self._scram_step(token)
        except ScramError:
            # SaslHandshake v0 has no way to say why: the connection just ends (as Kafka's does).
            await asyncio.sleep(AUTH_FAILURE_DELAY_S)
            raise _Closed() from None
        fut = asyncio.get_running_loop().create_future()
        fut.set_result([frame(answer)])
        await self.replies.put(fut)
        if self.scram.done:
            self.raw_sasl = False
            await self._logged_in()

    async def _scram_step(self, message: bytes) -> bytes:
        assert self.scram is not None
        try:
            answer = self.scram.step(message)
        except ScramError:
            self.gate._count_login_failure(self.scram.username)
            self.refused("auth_failed", f"SCRAM login as {self.scram.username!r} failed")
            raise
        if self.scram.done:
            # The user may have been removed or re-keyed while the exchange ran.
            current = self.gate.user(self.scram.username or "")
            if current is None or current.verifier != self.scram.verifier:
                self.gate._count_login_failure(self.scram.username)
                raise ScramError("authentication failed")
            held = sum(1 for c in self.gate._conns if c is not self and c.login_of == current.name)
            if held >= self.gate.max_user_connections:
                self.gate._count(current.name, "max_user_connections")
                log.warning("kafka gate: refused a login of %s from %s: it holds %d connections already",
                            current.name, self.peer, held)
                raise ScramError(f"user {current.name} holds {held} connections already, the most it may")
            self.login_of = current.name  # counted from here: no await between the count and this
        return answer

    async def _logged_in(self) -> None:
        assert self.scram is not None and self.scram.username is not None
        name = self.scram.username
        try:
            self.upstream = await asyncio.wait_for(asyncio.open_connection(*self.gate.broker), AUTH_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            log.error("kafka gate: cannot reach the broker at %s:%d for user %s: %s", *self.gate.broker, name, exc)
            raise _Closed() from None
        # Looked up after the wait: a revocation that came meanwhile found no user on this connection.
        user = self.gate.user(name)
        if user is None or user.verifier != self.scram.verifier:
            raise _Closed()
        self.user = user
        self.tasks.append(asyncio.create_task(self._read_upstream()))
        self.gate._count_login()
        log.info("kafka gate: %s logged in as %s", self.peer, user.name)


class KafkaGate:
    """The gate: listens on ``listen``, forwards to ``broker``, checks users from ``users_file``.

    ``advertised`` is the address put into Metadata answers (default: the listening address,
    which must then not be a wildcard). ``max_frame_bytes`` overrides the per-user request cap
    (max_record_bytes + 1 MiB). ``sasl_handshake_max`` 0 offers only the SaslHandshake v0
    (raw token) flow. Runs its own event loop in a daemon thread; every method is thread-safe
    and synchronous.
    """

    def __init__(self, listen: tuple[str, int], broker: tuple[str, int], users_file: str | Path,
                 advertised: Optional[tuple[str, int]] = None, max_frame_bytes: Optional[int] = None,
                 max_connections: int = 1024, sasl_handshake_max: int = GATE_VERSIONS[SASL_HANDSHAKE][1],
                 max_user_connections: int = MAX_USER_CONNECTIONS, max_unauthenticated: int = MAX_UNAUTHENTICATED):
        self.listen, self.broker = (listen[0], int(listen[1])), (broker[0], int(broker[1]))
        self.users_file = Path(users_file)
        self._advertised = advertised
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.max_user_connections = max_user_connections
        self.max_unauthenticated = max_unauthenticated
        self.sasl_handshake_max = sasl_handshake_max
        self._users: dict[str, GateUser] = {}
        self._users_signature: Any = "unread"
        self._conns: set[_Connection] = set()
        self._broker_versions: Optional[dict[int, tuple[int, int]]] = None
        self._versions_lock: Optional[asyncio.Lock] = None
        self._fake_secret = secrets.token_bytes(32)
        self._stats_lock = threading.Lock()
        self._refused: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._login_failures: collections.Counter = collections.Counter()
        self._accepted = 0
        self._logins = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping: Optional[asyncio.Event] = None
        self._address: Optional[tuple[str, int]] = None
        self.executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    # ---- public, any thread

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the gate listens on (the port chosen when 0 was given)."""
        if self._address is None:
            raise GateError("the Kafka gate is not started")
        return self._address

    @property
    def advertised(self) -> tuple[str, int]:
        return self._advertised or self.address

    @property
    def bootstrap(self) -> str:
        """The address clients use ("host:port", the advertised one)."""
        host, port = self.advertised
        return f"{host}:{port}"

    def start(self, timeout_s: float = 10.0) -> "KafkaGate":
        """Listen; returns once the socket accepts connections. Raises GateError if it cannot."""
        if self._thread is not None:
            raise GateError("the Kafka gate is already started")
        if self._advertised is None and self.listen[0] in ("", "0.0.0.0", "::"):
            raise GateError("the Kafka gate listens on every interface: give the address clients reach it at "
                            "(--advertise HOST:PORT)")
        self._load_users(initial=True)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kafka-gate-check")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._thread_main, args=(ready, failure), name="kafka-gate",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise GateError(f"the Kafka gate did not start within {timeout_s:.0f} s")
        if failure:
            self._thread.join(timeout_s)
            self._thread = None
            raise GateError(f"the Kafka gate cannot listen on {self.listen[0]}:{self.listen[1]}: {failure[0]}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout_s)
        self._thread = None
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "KafkaGate":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """Counters: connections accepted and open (and open per logged-in user), logins, failed
        logins per user name, refusals per user and reason ("-": a connection not logged in)."""
        conns = list(self._conns)
        with self._stats_lock:
            return {"accepted": self._accepted, "open": len(conns),
                    "open_by_user": dict(collections.Counter(c.user.name for c in conns if c.user and not c.closed)),
                    "logins": self._logins,
                    "login_failures": dict(self._login_failures),
                    "refused": {user: dict(counts) for user, counts in self._refused.items()},
                    "users": len(self._users)}

    def reload_users(self) -> None:
        """Re-read the users file now (it is also polled every second)."""
        loop = self._loop
        if loop is None or self._thread is None:
            self._load_users()
            return
        asyncio.run_coroutine_threadsafe(self._reload_async(), loop).result(10)

    # ---- used by connections (loop thread)

    def user(self, name: str) -> Optional[GateUser]:
        return self._users.get(name)

    def new_scram(self) -> ScramServer:
        return ScramServer(lambda name: (u.verifier if (u := self._users.get(name)) else None), self._fake_secret)

    async def broker_versions(self) -> dict[int, tuple[int, int]]:
        """The broker's ApiVersions ranges, asked once (on a connection of the gate's own)."""
        if self._broker_versions is not None:
            return self._broker_versions
        assert self._versions_lock is not None
        async with self._versions_lock:
            if self._broker_versions is None:
                self._broker_versions = await self._ask_broker_versions()
        return self._broker_versions

    async def _ask_broker_versions(self) -> dict[int, tuple[int, int]]:
        request = ApiVersionsRequest[0]()
        request.with_header(correlation_id=1, client_id="kafka-gate")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*self.broker), AUTH_TIMEOUT_S)
            try:
                writer.write(bytes(request.encode(header=True, framed=True)))
                (size,) = struct.unpack(">i", await asyncio.wait_for(reader.readexactly(4), AUTH_TIMEOUT_S))
                return parse_api_versions(await asyncio.wait_for(reader.readexactly(size), AUTH_TIMEOUT_S))
            finally:
                writer.close()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, GateError) as exc:
            log.error("kafka gate: cannot ask the broker at %s:%d for its API versions: %s", *self.broker, exc)
            raise _Closed() from None

    def _count(self, user: str, kind: str) -> None:
        with self._stats_lock:
            self._refused[user][kind] += 1

    def _count_login(self) -> None:
        with self._stats_lock:
            self._logins += 1

    def _count_login_failure(self, name: Optional[str]) -> None:
        # Names that are not users are lumped together: a stranger must not grow this table.
        with self._stats_lock:
            self._login_failures[name if name in self._users else "<unknown user>"] += 1

    def _forget(self, conn: _Connection) -> None:
        self._conns.discard(conn)

    # ---- the loop

    def _thread_main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            failure.append(exc)
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._versions_lock = asyncio.Lock()
        server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1], reuse_address=True)
        host, port = server.sockets[0].getsockname()[:2]
        self._address = (host, port)
        watcher = asyncio.create_task(self._watch_users())
        log.info("kafka gate listening on %s:%d (advertised %s) -> broker %s:%d", host, port, self.bootstrap,
                 *self.broker)
        ready.set()
        try:
            await self._stopping.wait()
        finally:
            watcher.cancel()
            server.close()
            for conn in list(self._conns):
                conn.close("gate stopping")
            await asyncio.sleep(0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._stats_lock:
            self._accepted += 1
        waiting = sum(1 for c in self._conns if c.user is None)
        if len(self._conns) >= self.max_connections or waiting >= self.max_unauthenticated:
            log.warning("kafka gate: %d connections open, %d not logged in; refusing another", len(self._conns),
                        waiting)
            writer.transport.abort()
            return
        self._maybe_reload()  # a user added a moment ago can log in at once
        conn = _Connection(self, reader, writer)
        self._conns.add(conn)
        await conn.run()

    async def _watch_users(self) -> None:
        while True:
            await asyncio.sleep(USERS_POLL_S)
            try:
                self._maybe_reload()
            except Exception:  # the watcher must survive anything a file can do
                log.exception("kafka gate: reloading %s failed", self.users_file)

    async def _reload_async(self) -> None:
        self._users_signature = "forced"
        self._maybe_reload()

    def _signature(self) -> Any:
        """What changes when the file is replaced or rewritten (None: there is no file)."""
        try:
            st = self.users_file.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode)

    def _maybe_reload(self) -> None:
        if self._signature() != self._users_signature:
            self._load_users()

    def _load_users(self, initial: bool = False) -> None:
        signature = self._signature()
        try:
            users = read_users(self.users_file)
        except GateError as exc:
            if initial:
                raise
            log.error("%s; every user is refused until it is fixed", exc)
            users = {}
        self._users_signature = signature
        self._apply_users(users)

    def _apply_users(self, users: dict[str, GateUser]) -> None:
        old, self._users = self._users, users
        if old.keys() != users.keys() or any(old[n] != users[n] for n in users):
            log.info("kafka gate: %d users from %s", len(users), self.users_file)
        for conn in list(self._conns):
            if conn.user is None:
                continue
            current = users.get(conn.user.name)
            if current is None or current.verifier != conn.user.verifier:
                log.warning("kafka gate: closing %s of user %s: %s", conn.peer, conn.user.name,
                            "removed from the users file" if current is None else "its password changed")
                conn.close("user revoked")
            else:
                conn.user = current  # a changed grant applies from the next request


# --------------------------------------------------------------------------- CLI


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"kafka_gate: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="python -m infra.kafka_gate",
        description="Authorizing Kafka gate: SCRAM-SHA-256 logins and per-user topic grants in front of a "
                    "broker without ACLs (Tansu). Users and grants come from --users (see the module docstring "
                    "for its format; infra.kafka_gate.add_user writes it).")
    parser.add_argument("--listen", type=_host_port, required=True, metavar="HOST:PORT",
                        help="where the gate listens (port 0: a free one)")
    parser.add_argument("--broker", type=_host_port, required=True, metavar="HOST:PORT",
                        help="the broker behind it")
    parser.add_argument("--users", type=Path, required=True, metavar="FILE", help="the users file (JSON, mode 0600)")
    parser.add_argument("--advertise", type=_host_port, default=None, metavar="HOST:PORT",
                        help="HOST:PORT clients reach the gate at (default: --listen; required with 0.0.0.0)")
    parser.add_argument("--max-frame-bytes", type=int, default=None, metavar="N",
                        help="largest request accepted (default: the user's max_record_bytes + 1 MiB)")
    parser.add_argument("--max-connections", type=int, default=1024, metavar="N",
                        help="connections at once, all users (default %(default)s)")
    parser.add_argument("--max-user-connections", type=int, default=MAX_USER_CONNECTIONS, metavar="N",
                        help="logged-in connections at once of one user (default %(default)s)")
    parser.add_argument("--max-unauthenticated", type=int, default=MAX_UNAUTHENTICATED, metavar="N",
                        help="connections at once that have not logged in (default %(default)s)")
    parser.add_argument("--log-level", default="INFO", metavar="LEVEL", help="logging level (default INFO)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    gate = KafkaGate(args.listen, args.broker, args.users, advertised=args.advertise,
                     max_frame_bytes=args.max_frame_bytes, max_connections=args.max_connections,
                     max_user_connections=args.max_user_connections, max_unauthenticated=args.max_unauthenticated)
    try:
        gate.start()
    except GateError as exc:
        print(f"kafka_gate: {exc}", file=sys.stderr)
        return 2
    print(f"kafka gate: {gate.address[0]}:{gate.address[1]} (advertised {gate.bootstrap}) -> "
          f"{args.broker[0]}:{args.broker[1]}", flush=True)
    serve_until_stopped(gate.stop)
    print(f"kafka gate stopped: {json.dumps(gate.stats())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
