"""Authorizing Redis gate: the one way strangers (invited volunteer samplers) reach a run's Redis.

Why a gate and not Redis ACLs: checked on Valkey 9, ACL permissions apply to the commands a
Redis function runs too (a user without HSET cannot have a function HSET for it). So a user
allowed to call our functions must also hold their write permissions, and could use them
directly: RPUSH garbage into a queue, HSET another sampler's lease, store 200 MB values; and
EVAL lets it run ``while true do end`` and block Redis for everybody. Strangers therefore get
credentials for this gate only. The gate is a small RESP2 proxy that authenticates them
itself, lets through only reads of allowed keys and FCALLs of allowed functions with allowed
keys and bounded arguments, and forwards those on its own upstream connection as a Redis
user that has the write permissions the functions need. The functions validate their
arguments; the gate stops everything else.

What passes (per user, from its grant; ``Grant``):

* reads: ``READ_COMMANDS`` (GET, MGET, EXISTS, TYPE, HGET, HMGET, HGETALL, HLEN, HEXISTS,
  HSCAN, LLEN, LRANGE, ZSCORE, ZRANGE, ZREVRANGE, ZRANGEBYSCORE, ZCARD, XLEN, XRANGE,
  XREVRANGE, SMEMBERS, SCARD, PING, ECHO, TIME) that the grant lists, on keys matching one of
  its ``read_keys`` globs (fnmatch-style, case-sensitive: ``*``, ``?``, ``[abc]``, ``[!abc]``;
  every key of MGET/EXISTS). HSCAN only without MATCH and with COUNT <= 1000.
* ``FCALL``/``FCALL_RO`` of a function the grant names, with exactly as many keys as its
  patterns (key i must match pattern i) and at most ``max_args`` arguments after the keys,
  each at most ``max_arg_bytes`` long.
* answered by the gate itself: ``AUTH``, ``HELLO 2 [AUTH user pass] [SETNAME name]``, ``QUIT``,
  ``CLIENT SETINFO``/``SETNAME`` (+OK, not forwarded), ``SELECT 0`` (+OK), and ``PING`` before
  AUTH. Before a successful AUTH nothing else passes (``-NOAUTH``).

Everything else (EVAL, EVALSHA, SCRIPT, FUNCTION, every write, SCAN/KEYS, CONFIG, ACL,
MULTI/EXEC, SUBSCRIBE, other CLIENT subcommands, DEBUG, SELECT n>0, unknown commands...) gets
``-NOPERM this user may not run '<cmd>'`` (or naming the key or function), the connection
stays open, and the refusal is counted per user and reason (``RedisGate.stats``) and logged
once per reason and connection. ``HELLO 3`` gets ``-NOPROTO``: the gate speaks RESP2 only.
redis-py 8.2 (this venv) defaults to RESP3, sends ``HELLO 3 AUTH user pass`` first, and on NOPROTO falls
back to RESP2 and ``AUTH user pass`` (logging a warning each connection; pass ``protocol=2``
to ``redis.Redis`` to skip the round trip and the warning).

Requests must be RESP arrays of bulk strings (what redis-py and redis-cli send; the only
inline command accepted is ``PING``). A request larger than ``max_request_bytes`` (64 KiB) or
with more than ``max_args`` (1024) arguments is refused as soon as its header says so, before
it is read whole, and the connection is closed (so is one that breaks the protocol).
Requests are handled one at a time in order: each allowed one is re-encoded and sent upstream,
exactly one RESP2 reply is read back and passed on unchanged; the gate's own replies keep their
place, so pipelines (``transaction=False``) work. A reply over ``max_reply_bytes`` (8 MiB; the
gate holds each reply whole) is answered with an error and the connection closed.

Users file (``--users``, JSON, mode 0600: the gate refuses one that others may read)::

    {"version": 1,
     "users": {
       "vol-7f3a": {
         "sha256": "<hex sha256 of the password>",
         "grant": {
           "read_keys": ["heterorl:run1:*"],
           "read_commands": ["GET", "HGET", "HGETALL", "PING"],      # optional: all of READ_COMMANDS
           "functions": {
             "hr_test_set": {"keys": ["heterorl:run1:sampler_stats"],
                             "max_args": 2, "max_arg_bytes": 1024}}}}}}

Passwords are random tokens of >= 128 bits (``new_password``), so a plain sha256 is enough.
Edit the file with ``add_user``/``remove_user``/``write_users`` (tmp + rename, 0600). The gate
re-reads it when its inode, mtime or size changes (checked every ``users_check_s``, 1 s, and
at each AUTH); connections of a user that was removed or whose password changed are closed
at the next check (within 2 s), and a changed grant applies to open connections at once.
A file that cannot be read or parsed after start counts as "no users" (fail closed).

Running it::

    export REDIS_GATE_UPSTREAM_PASSWORD=...      # the upstream user's password, kept out of argv
    python -m infra.redis_gate --listen 0.0.0.0:6380 \\
        --upstream-url redis://sampler@127.0.0.1:6379/0 --users /etc/heterorl/gate-users.json

or from Python (its own event loop in a daemon thread)::

    gate = RedisGate(listen=("127.0.0.1", 0), upstream_url=url, users_file=path).start()
    client = redis.Redis.from_url(f"redis://vol-7f3a:{password}@{gate.address}/0", protocol=2)
    ...; print(gate.stats()); gate.stop()

Each client connection gets its own upstream connection, opened when its AUTH succeeds
(``-ERR upstream unavailable`` and a close if Redis cannot be reached or refuses the gate).
Connections that do not authenticate within ``auth_timeout_s`` (10 s) are closed; at most
``max_clients`` (1000) are open at once, ``max_unauthenticated`` (64) of them not logged in
yet, and ``max_user_connections`` (32) of one user (the next AUTH is refused and closed): so one
stranger makes the gate hold at most 32 x (64 KiB request + 8 MiB reply). A function grant's
``max_calls`` bounds how often a user may call it over the gate's life (a stranger's join
requests: a restart of the gate starts the count again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union
from urllib.parse import unquote, urlsplit

from infra.private_files import serve_until_stopped, update_locked, write_private_json
from pipeline.config import strip_password
from pipeline.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024
DEFAULT_MAX_ARGS = 1024
DEFAULT_MAX_REPLY_BYTES = 8 * 1024 * 1024
"""A reply larger than this closes the connection: the gate holds each reply whole (a stranger's
largest, HGETALL of its run's claims, is well under a megabyte at 1,000 samplers)."""
MAX_SCAN_COUNT = 1000
USERS_CHECK_S = 1.0
AUTH_TIMEOUT_S = 10.0
UPSTREAM_TIMEOUT_S = 30.0
MAX_CLIENTS = 1000
MAX_USER_CONNECTIONS = 32
"""Connections one user may hold at once: with ``max_reply_bytes`` and ``max_request_bytes`` what
bounds the memory one stranger makes the gate hold (32 x 8 MiB)."""
MAX_UNAUTHENTICATED = 64
"""Connections that have not logged in yet, at once (each may hold ``max_request_bytes``)."""
UPSTREAM_PASSWORD_ENV = "REDIS_GATE_UPSTREAM_PASSWORD"
USERS_FILE_VERSION = 1
MIN_PASSWORD_CHARS = 22
"""``secrets.token_urlsafe(16)``: 128 bits. Shorter passwords are refused by ``add_user``."""
READ_CHUNK = 64 * 1024
ANONYMOUS = "<anonymous>"
"""The user refusals before AUTH are counted under."""
UNKNOWN_USER = "<unknown>"
"""The user a failed AUTH with a name not in the users file is counted under."""

OK = b"+OK\r\n"
PONG = b"+PONG\r\n"
NOAUTH = "NOAUTH Authentication required."
WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."
NOPROTO = "NOPROTO sorry, this protocol version is not supported."
UPSTREAM_UNAVAILABLE = "ERR upstream unavailable"

PathLike = Union[str, Path]


class GateError(UserError, RuntimeError):
    """A gate misconfiguration (bad URL, users file, grant); the message is one line."""


# --------------------------------------------------------------------------- RESP requests


class RequestError(Exception):
    """A request the gate will not read on: it replies ``message`` and closes the connection."""

    reason = "protocol"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestTooLarge(RequestError):
    reason = "too_large"


class RequestProtocolError(RequestError):
    reason = "protocol"


_INCOMPLETE = object()
_INTEGER = re.compile(rb"-?[0-9]{1,18}")


class RequestParser:
    """Incremental parser of RESP2 requests (arrays of bulk strings), with hard caps.

    ``feed`` bytes as they arrive, then call ``next_request`` until it returns None (needs
    more bytes). A request whose header announces more than ``max_args`` arguments, or a bulk
    string that would take it past ``max_request_bytes``, raises RequestTooLarge as soon as that
    header is buffered: the gate never waits for, or holds, the rest of it.
    """

    MAX_LINE = 32
    """A header line ("*1024", "$65536") is short; one without CRLF in this many bytes is garbage."""
    MAX_INLINE = 64

    def __init__(self, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_args: int = DEFAULT_MAX_ARGS):
        self.max_request_bytes = max_request_bytes
        self.max_args = max_args
        self._buf = bytearray()
        self._pos = 0
        self._argc: Optional[int] = None  # None: at the start of a request
        self._args: list[bytes] = []
        self._size = 0  # bytes of the current request read so far

    def feed(self, data: bytes) -> None:
        if self._pos:  # drop what was parsed, so the buffer holds at most one partial request + a chunk
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def buffered(self) -> int:
        """Bytes received and not yet parsed into a request."""
        return len(self._buf) - self._pos

    def next_request(self) -> Optional[list[bytes]]:
        while True:
            if self._argc is None:
                if self._pos >= len(self._buf):
                    return None
                if self._buf[self._pos] != ord("*"):
                    inline = self._inline()
                    if inline is _INCOMPLETE:
                        return None
                    if inline is None:  # an empty line: Redis skips those too
                        continue
                    return inline  # type: ignore[return-value]
                end = self._line_end()
                if end is None:
                    return None
                argc = self._integer(self._buf[self._pos + 1 : end], "multibulk length")
                if argc > self.max_args:
                    raise RequestTooLarge(f"ERR request has {argc} arguments, over the gate's limit of {self.max_args}")
                self._size = end + 2 - self._pos
                self._pos = end + 2
                if argc <= 0:  # "*0" and "*-1": Redis ignores them
                    continue
                self._argc, self._args = argc, []
            while len(self._args) < self._argc:
                arg = self._bulk()
                if arg is None:
                    return None
                self._args.append(arg)
            args, self._argc, self._args = self._args, None, []
            return args

    def _line_end(self) -> Optional[int]:
        end = self._buf.find(b"\r\n", self._pos, self._pos + self.MAX_LINE)
        if end >= 0:
            return end
        if len(self._buf) - self._pos >= self.MAX_LINE:
            raise RequestProtocolError("ERR Protocol error: header line too long")
        return None

    def _bulk(self) -> Optional[bytes]:
        end = self._line_end()
        if end is None:
            return None
        if self._buf[self._pos] != ord("$"):
            got = _show(bytes(self._buf[self._pos : self._pos + 1]))
            raise RequestProtocolError(f"ERR Protocol error: expected '$', got '{got}'")
        length = self._integer(self._buf[self._pos + 1 : end], "bulk length")
        if length < 0:
            raise RequestProtocolError("ERR Protocol error: invalid bulk length")
        header = end + 2 - self._pos
        total = self._size + header + length + 2
        if total > self.max_request_bytes:  # decided on the header alone, before the data arrives
            raise RequestTooLarge(f"ERR request of at least {total} bytes, over the gate's limit of "
                                  f"{self.max_request_bytes}")
        start = end + 2
        stop = start + length
        if len(self._buf) < stop + 2:
            return None
        if self._buf[stop : stop + 2] != b"\r\n":
            raise RequestProtocolError("ERR Protocol error: bulk string not followed by CRLF")
        self._size = total
        self._pos = stop + 2
        return bytes(self._buf[start:stop])

    def _inline(self) -> object:
        """Inline commands: PING only (health checks by hand); anything else ends the connection."""
        end = self._buf.find(b"\n", self._pos, self._pos + self.MAX_INLINE)
        if end < 0:
            if len(self._buf) - self._pos >= self.MAX_INLINE:
                raise RequestProtocolError("ERR Protocol error: inline commands are not accepted, send RESP arrays")
            return _INCOMPLETE
        line = bytes(self._buf[self._pos : end]).strip()
        self._pos = end + 1
        if not line:
            return None
        if line.upper() == b"PING":
            return [b"PING"]
        raise RequestProtocolError("ERR Protocol error: inline commands are not accepted, send RESP arrays")

    @staticmethod
    def _integer(raw: bytearray, what: str) -> int:
        if not _INTEGER.fullmatch(raw):
            raise RequestProtocolError(f"ERR Protocol error: invalid {what}")
        return int(raw)


def encode_request(args: Sequence[Union[bytes, str, int]]) -> bytes:
    """``args`` as a RESP2 array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


# --------------------------------------------------------------------------- RESP replies


class ReplyError(Exception):
    """The upstream sent what is no RESP2 reply."""


class ReplyTooLarge(ReplyError):
    """A reply over the gate's cap (``max_reply_bytes``)."""


class ReplyParser:
    """Incremental splitter of RESP2 replies (``+ - : $ *``, nil bulk and nil array included).

    ``next_reply`` returns one complete reply's bytes exactly as received, or None until one
    is complete. The scan resumes where the last feed ended: ``pending`` counts the values the
    current reply still needs (an array of n adds n), so nested arrays need no recursion and
    each element is looked at once.
    """

    def __init__(self, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        self.max_reply_bytes = max_reply_bytes
        self._buf = bytearray()
        self._pos = 0  # end of the complete values scanned so far (the reply starts at 0)
        self._pending = 1

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_reply(self) -> Optional[bytes]:
        buf = self._buf
        while self._pending:
            end = buf.find(b"\r\n", self._pos)
            if end < 0:
                if len(buf) > self.max_reply_bytes:
                    raise ReplyTooLarge(f"reply over {self.max_reply_bytes} bytes")
                return None
            kind = buf[self._pos]
            nxt = end + 2
            if kind in b"+-:":
                self._pending -= 1
            elif kind == ord("$"):
                length = self._length(buf[self._pos + 1 : end])
                if length >= 0:
                    nxt = end + 2 + length + 2
                    if nxt > self.max_reply_bytes:
                        raise ReplyTooLarge(f"reply over {self.max_reply_bytes} bytes")
                    if len(buf) < nxt:
                        return None
                    if buf[nxt - 2 : nxt] != b"\r\n":
                        raise ReplyError("bulk string not followed by CRLF")
                self._pending -= 1
            elif kind == ord("*"):
                self._pending += max(self._length(buf[self._pos + 1 : end]), 0) - 1
            else:
                raise ReplyError(f"unexpected reply type {_show(bytes([kind]))!r}")
            self._pos = nxt
            if self._pos > self.max_reply_bytes:
                raise ReplyTooLarge(f"reply over {self.max_reply_bytes} bytes")
        reply = bytes(buf[: self._pos])
        del buf[: self._pos]
        self._pos, self._pending = 0, 1
        return reply

    @staticmethod
    def _length(raw: bytearray) -> int:
        if not _INTEGER.fullmatch(raw):
            raise ReplyError(f"invalid length {_show(bytes(raw))!r}")
        value = int(raw)
        if value < -1:
            raise ReplyError(f"invalid length {value}")
        return value


# --------------------------------------------------------------------------- grants


@dataclass(frozen=True)
class _ReadSpec:
    """Where a read command's keys are: its arity (arguments after the name) and key positions."""

    min_args: int
    max_args: Optional[int]  # None: any number
    keys: str  # "none" | "first" | "all"


READ_COMMANDS: Mapping[str, _ReadSpec] = MappingProxyType({
    "GET": _ReadSpec(1, 1, "first"),
    "MGET": _ReadSpec(1, None, "all"),
    "EXISTS": _ReadSpec(1, None, "all"),
    "TYPE": _ReadSpec(1, 1, "first"),
    "HGET": _ReadSpec(2, 2, "first"),
    "HMGET": _ReadSpec(2, None, "first"),
    "HGETALL": _ReadSpec(1, 1, "first"),
    "HLEN": _ReadSpec(1, 1, "first"),
    "HVALS": _ReadSpec(1, 1, "first"),
    "HEXISTS": _ReadSpec(2, 2, "first"),
    "HSCAN": _ReadSpec(2, 7, "first"),  # key cursor [COUNT n] [NOVALUES]; MATCH refused (_check_hscan)
    "LLEN": _ReadSpec(1, 1, "first"),
    "LRANGE": _ReadSpec(3, 3, "first"),
    "ZSCORE": _ReadSpec(2, 2, "first"),
    "ZRANGE": _ReadSpec(3, 9, "first"),  # key start stop [BYSCORE|BYLEX] [REV] [LIMIT o c] [WITHSCORES]
    "ZREVRANGE": _ReadSpec(3, 4, "first"),
    "ZRANGEBYSCORE": _ReadSpec(3, 7, "first"),
    "ZCARD": _ReadSpec(1, 1, "first"),
    "XLEN": _ReadSpec(1, 1, "first"),
    "XRANGE": _ReadSpec(3, 5, "first"),
    "XREVRANGE": _ReadSpec(3, 5, "first"),
    "SMEMBERS": _ReadSpec(1, 1, "first"),
    "SCARD": _ReadSpec(1, 1, "first"),
    "PING": _ReadSpec(0, 1, "none"),
    "ECHO": _ReadSpec(1, 1, "none"),
    "TIME": _ReadSpec(0, 0, "none"),
})
"""The read commands a grant may allow. None of them writes or blocks, and every key they take
is at the position named here, so checking those positions checks every key they touch."""


@functools.lru_cache(maxsize=1024)
def _glob(patterns: tuple[str, ...]) -> "re.Pattern[str]":
    """One compiled regex matching any of ``patterns`` (fnmatch-style, case-sensitive)."""
    if not patterns:
        return re.compile(r"(?!)")
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def key_matches(key: bytes, patterns: Sequence[str]) -> bool:
    """Whether ``key`` matches one of ``patterns``. Undecodable bytes stay distinct (surrogates),
    so they match ``*`` and ``?`` but no literal character."""
    return _glob(tuple(patterns)).match(key.decode("utf-8", "surrogateescape")) is not None


@dataclass(frozen=True)
class FunctionGrant:
    """What FCALL of one function may carry: one key glob per key position, in order, and at most
    ``max_args`` arguments after the keys, each at most ``max_arg_bytes`` long; ``max_calls``: how
    many times the user may call it over the gate's life (None: no limit)."""

    keys: tuple[str, ...]
    max_args: int = 8
    max_arg_bytes: int = 1024
    max_calls: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.keys, (str, bytes)) or not all(isinstance(p, str) and p for p in self.keys):
            raise GateError(f"a function grant's keys must be a list of non-empty glob patterns, not {self.keys!r}")
        object.__setattr__(self, "keys", tuple(self.keys))
        for name in ("max_args", "max_arg_bytes", "max_calls"):
            value = getattr(self, name)
            if name == "max_calls" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GateError(f"a function grant's {name} must be a non-negative integer, not {value!r}")

    def to_json(self) -> dict[str, Any]:
        limits = {} if self.max_calls is None else {"max_calls": self.max_calls}
        return {"keys": list(self.keys), "max_args": self.max_args, "max_arg_bytes": self.max_arg_bytes, **limits}

    @classmethod
    def from_json(cls, data: Any) -> "FunctionGrant":
        _expect_fields(data, required={"keys"}, optional={"max_args", "max_arg_bytes", "max_calls"},
                       what="a function grant")
        return cls(keys=_string_list(data["keys"], "a function grant's keys"),
                   **{k: v for k, v in data.items() if k != "keys"})


@dataclass(frozen=True)
class Grant:
    """What one gate user may do: read keys matching ``read_keys`` with ``read_commands``, and
    call the ``functions`` named (name -> FunctionGrant). Nothing else passes the gate."""

    read_keys: tuple[str, ...] = ()
    read_commands: frozenset[str] = frozenset(READ_COMMANDS)
    functions: Mapping[str, FunctionGrant] = field(default_factory=dict, hash=False)
    max_distinct: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Key glob -> the most distinct keys matching it this user may name in its FCALLs (in this
    gate's lifetime): e.g. at most as many sampler leases as the invite admits samplers, so one
    stranger cannot make up ids by the thousand."""

    def __post_init__(self) -> None:
        if isinstance(self.read_keys, (str, bytes)) or not all(isinstance(p, str) and p for p in self.read_keys):
            raise GateError(f"read_keys must be a list of non-empty glob patterns, not {self.read_keys!r}")
        object.__setattr__(self, "read_keys", tuple(self.read_keys))
        if isinstance(self.read_commands, (str, bytes)):
            raise GateError(f"read_commands must be a list of command names, not {self.read_commands!r}")
        commands = frozenset(str(c).upper() for c in self.read_commands)
        unknown = sorted(commands - set(READ_COMMANDS))
        if unknown:  # never let a command through whose keys the gate cannot find
            raise GateError(f"read_commands {', '.join(unknown)} are not gate read commands "
                            f"(known: {', '.join(sorted(READ_COMMANDS))})")
        object.__setattr__(self, "read_commands", commands)
        functions = {}
        for name, spec in dict(self.functions).items():
            if not isinstance(name, str) or not name:
                raise GateError(f"function names must be non-empty strings, not {name!r}")
            functions[name] = spec if isinstance(spec, FunctionGrant) else FunctionGrant.from_json(spec)
        object.__setattr__(self, "functions", MappingProxyType(functions))
        limits = dict(self.max_distinct)
        if not all(isinstance(p, str) and p and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                   for p, n in limits.items()):
            raise GateError(f"max_distinct must map key globs to non-negative integers, not {limits!r}")
        object.__setattr__(self, "max_distinct", MappingProxyType(limits))

    def may_read(self, key: bytes) -> bool:
        return key_matches(key, self.read_keys)

    def to_json(self) -> dict[str, Any]:
        return {"read_keys": list(self.read_keys), "read_commands": sorted(self.read_commands),
                "functions": {name: spec.to_json() for name, spec in sorted(self.functions.items())},
                "max_distinct": dict(sorted(self.max_distinct.items()))}

    @classmethod
    def from_json(cls, data: Any) -> "Grant":
        _expect_fields(data, required=set(), optional={"read_keys", "read_commands", "functions", "max_distinct"},
                       what="a grant")
        functions = data.get("functions", {})
        if not isinstance(functions, dict):
            raise GateError(f"a grant's functions must be an object of name -> function grant, not {functions!r}")
        return cls(read_keys=_string_list(data.get("read_keys", []), "read_keys"),
                   read_commands=frozenset(_string_list(data.get("read_commands", sorted(READ_COMMANDS)),
                                                        "read_commands")),
                   functions={name: FunctionGrant.from_json(spec) for name, spec in functions.items()},
                   max_distinct=dict(data.get("max_distinct", {})) if isinstance(data.get("max_distinct", {}), dict)
                   else data["max_distinct"])


def _string_list(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise GateError(f"{what} must be a list of strings, not {json.dumps(value)[:80]}")
    return tuple(value)


def _expect_fields(data: Any, required: set[str], optional: set[str], what: str) -> None:
    if not isinstance(data, dict):
        raise GateError(f"{what} must be a JSON object, not {type(data).__name__}")
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - required - optional)  # strict: a typo must not widen or narrow a grant silently
    if missing or unknown:
        detail = "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                              f"unknown {', '.join(unknown)}" if unknown else "") if part)
        raise GateError(f"{what}: {detail}")


@dataclass(frozen=True)
class Refusal:
    """Why a request does not pass: ``reason`` (counted) and the error reply, code first."""

    reason: str  # "command" | "key" | "function" | "function_keys" | "function_args" | "syntax"
    message: str  # e.g. "NOPERM this user may not run 'EVAL'"


_NAME = re.compile(rb"[A-Za-z][A-Za-z0-9_|-]{0,63}")


def command_name(raw: bytes) -> str:
    """A command's (or option's) name upper-cased; "" for anything that is no plain name (never
    allowed)."""
    return raw.decode("ascii").upper() if _NAME.fullmatch(raw) else ""


def check_request(grant: Grant, args: Sequence[bytes]) -> Optional[Refusal]:
    """None if ``args`` (a request, command first) may be forwarded under ``grant``, else why not.
    Commands the gate answers itself (AUTH, HELLO, QUIT, CLIENT SETINFO, SELECT 0) are not
    decided here."""
    name = command_name(args[0]) if args else ""
    if name in ("FCALL", "FCALL_RO"):
        return _check_fcall(grant, name, args)
    spec = READ_COMMANDS.get(name)
    if spec is None or name not in grant.read_commands:
        return Refusal("command", f"NOPERM this user may not run '{name or _show(args[0] if args else b'')}'")
    count = len(args) - 1
    if count < spec.min_args or (spec.max_args is not None and count > spec.max_args):
        return Refusal("syntax", f"ERR wrong number of arguments for '{name.lower()}' command")
    keys = args[1:2] if spec.keys == "first" else args[1:] if spec.keys == "all" else []
    for key in keys:
        if not grant.may_read(key):
            return Refusal("key", f"NOPERM this user may not read key '{_show(key)}'")
    if name == "HSCAN":
        return _check_hscan(args)
    return None


def _check_hscan(args: Sequence[bytes]) -> Optional[Refusal]:
    """HSCAN key cursor [COUNT n<=1000] [NOVALUES]: no MATCH (a glob the server runs on every field)."""
    options = list(args[3:])
    while options:
        option = command_name(options.pop(0))
        if option == "NOVALUES":
            continue
        if option == "COUNT" and options:
            count = _canonical_int(options.pop(0))
            if count is None or not 1 <= count <= MAX_SCAN_COUNT:
                return Refusal("command", "NOPERM this user may not run 'HSCAN' with a COUNT other than "
                                          f"1..{MAX_SCAN_COUNT}")
            continue
        return Refusal("command", f"NOPERM this user may not run 'HSCAN' with '{option or '?'}'")
    return None


def _check_fcall(grant: Grant, name: str, args: Sequence[bytes]) -> Optional[Refusal]:
    if len(args) < 3:
        return Refusal("syntax", f"ERR wrong number of arguments for '{name.lower()}' command")
    try:
        function = args[1].decode("utf-8")
    except UnicodeDecodeError:
        function = ""
    spec = grant.functions.get(function)
    if spec is None:
        return Refusal("function", f"NOPERM this user may not call function '{_show(args[1])}'")
    # numkeys in canonical decimal only: the gate and Redis must agree on where the keys end.
    numkeys = _canonical_int(args[2])
    if numkeys != len(spec.keys):
        return Refusal("function_keys", f"NOPERM function '{function}' takes {len(spec.keys)} keys, "
                                        f"not '{_show(args[2])}'")
    if len(args) < 3 + numkeys:
        return Refusal("syntax", "ERR Number of keys can't be greater than number of args")
    for position, (key, pattern) in enumerate(zip(args[3 : 3 + numkeys], spec.keys), 1):
        if not key_matches(key, (pattern,)):
            return Refusal("function_keys", f"NOPERM this user may not call '{function}' with key "
                                            f"'{_show(key)}' (key {position})")
    extra = args[3 + numkeys :]
    if len(extra) > spec.max_args:
        return Refusal("function_args", f"NOPERM function '{function}' takes at most {spec.max_args} "
                                        f"arguments, not {len(extra)}")
    for position, arg in enumerate(extra, 1):
        if len(arg) > spec.max_arg_bytes:
            return Refusal("function_args", f"NOPERM argument {position} of '{function}' has {len(arg)} bytes, "
                                            f"over the {spec.max_arg_bytes} allowed")
    return None


def _canonical_int(raw: bytes) -> Optional[int]:
    """A non-negative integer written the one way str(int) writes it ("0", "12"; not "012", "+1")."""
    if not raw.isdigit() or not raw.isascii() or len(raw) > 18 or (len(raw) > 1 and raw[:1] == b"0"):
        return None
    return int(raw)


def _show(raw: bytes, limit: int = 60) -> str:
    """``raw`` for an error reply or a log line: printable ASCII, escaped otherwise, shortened
    (a reply line must never carry CR or LF)."""
    text = raw[:limit].decode("ascii", "backslashreplace")
    text = "".join(c if c.isprintable() and c != "'" else f"\\x{ord(c):02x}" for c in text)
    return text + ("..." if len(raw) > limit else "")


# --------------------------------------------------------------------------- users file


@dataclass(frozen=True)
class GateUser:
    """One entry of the users file."""

    name: str
    sha256: str  # hex sha256 of the password
    grant: Grant

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "grant": self.grant.to_json()}


def password_hash(password: Union[str, bytes]) -> str:
    """The hex sha256 the users file keeps of a password."""
    return hashlib.sha256(password.encode() if isinstance(password, str) else password).hexdigest()


def new_password() -> str:
    """A fresh random password (256 bits)."""
    return secrets.token_urlsafe(32)


_USER_NAME = re.compile(r"[A-Za-z0-9_.@:+=-]{1,128}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def parse_users(data: Any) -> dict[str, GateUser]:
    """The users of a users file's JSON; GateError naming the first problem."""
    _expect_fields(data, required={"users"}, optional={"version"}, what="the users file")
    if data.get("version", USERS_FILE_VERSION) != USERS_FILE_VERSION:
        raise GateError(f"the users file has version {data.get('version')!r}; "
                        f"this gate reads version {USERS_FILE_VERSION}")
    if not isinstance(data["users"], dict):
        raise GateError("the users file's users must be an object of name -> {sha256, grant}")
    users = {}
    for name, entry in data["users"].items():
        if not _USER_NAME.fullmatch(name):
            raise GateError(f"user name {name!r} is not 1-128 characters of letters, digits and _.@:+=-")
        _expect_fields(entry, required={"sha256", "grant"}, optional=set(), what=f"user {name}")
        if not isinstance(entry["sha256"], str) or not _HEX64.fullmatch(entry["sha256"]):
            raise GateError(f"user {name}: sha256 must be 64 lower-case hex digits")
        try:
            grant = Grant.from_json(entry["grant"])
        except GateError as exc:
            raise GateError(f"user {name}: {exc}") from None
        users[name] = GateUser(name, entry["sha256"], grant)
    return users


def read_users(path: PathLike) -> dict[str, GateUser]:
    """The users in ``path``; GateError if it is missing, readable by others, or malformed."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return _parse_users_file(path, fh.read(), os.fstat(fh.fileno()).st_mode)
    except OSError as exc:
        raise GateError(f"cannot read the users file {path}: {exc.strerror or exc}") from None


def _parse_users_file(path: Path, raw: bytes, mode: int) -> dict[str, GateUser]:
    if mode & 0o077:  # it holds password hashes and grants: only the gate's user may read it
        raise GateError(f"the users file {path} has mode {mode & 0o777:o}; run chmod 600 {path}")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise GateError(f"the users file {path} is not JSON: {exc}") from None
    return parse_users(data)


def write_users(path: PathLike, users: Mapping[str, GateUser]) -> None:
    """Replace the users file with ``users`` at once (tmp + fsync + rename, mode 0600)."""
    path = Path(path)
    body = {"version": USERS_FILE_VERSION, "users": {name: user.to_json() for name, user in sorted(users.items())}}
    parse_users(json.loads(json.dumps(body)))  # never write a file the gate would refuse
    write_private_json(path, body, indent=2, sort_keys=True)


def add_user(path: PathLike, name: str, password: str, grant: Grant) -> None:
    """Add (or replace) user ``name`` with ``password`` (>= 22 characters of a random token) and
    ``grant``; creates the file if needed."""
    if len(password) < MIN_PASSWORD_CHARS:
        raise GateError(f"a gate password must be a random token of >= {MIN_PASSWORD_CHARS} characters "
                        "(use new_password())")
    user = GateUser(name, password_hash(password), grant)
    update_locked(path, lambda p: read_users(p) if p.exists() else {}, write_users,
                  lambda users: users.update({name: user}) or True)


def remove_user(path: PathLike, name: str) -> bool:
    """Remove user ``name`` (its open connections close at the gate's next check); False if absent."""
    return update_locked(path, read_users, write_users, lambda users: users.pop(name, None) is not None)


_NO_SUCH_USER_HASH = password_hash("")  # compared against when the name is unknown: same work either way


class _UsersFile:
    """The users file as the gate last read it, re-read when its inode, mtime or size change."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp: Optional[tuple[int, int, int]] = None
        self.users: dict[str, GateUser] = {}

    def load_strict(self) -> None:
        """At start: a bad file is the operator's mistake, said at once."""
        self.users = read_users(self.path)
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self) -> bool:
        """Re-read the file if it changed; True if it did. An unreadable file means no users."""
        try:
            st = os.stat(self.path)
            stamp: Optional[tuple[int, int, int]] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.users = read_users(self.path) if stamp is not None else {}
        except GateError as exc:
            log.error("redis-gate: %s; no user may connect until it is fixed", exc)
            self.users = {}
        if stamp is None:
            log.error("redis-gate: the users file %s is gone; no user may connect", self.path)
        return True

    def authenticate(self, name: bytes, password: bytes) -> Optional[GateUser]:
        user = self.users.get(name.decode("utf-8", "replace"))
        expected = user.sha256 if user is not None else _NO_SUCH_USER_HASH
        matches = hmac.compare_digest(password_hash(password), expected)
        return user if user is not None and matches else None


# --------------------------------------------------------------------------- upstream


@dataclass(frozen=True)
class Upstream:
    """Where the gate forwards to and as whom (from ``redis://USER:PASS@HOST:PORT/DB``)."""

    host: str
    port: int
    username: Optional[str]
    password: Optional[str]
    db: int = 0

    @classmethod
    def from_url(cls, url: str, password: Optional[str] = None) -> "Upstream":
        """``password`` (e.g. from $REDIS_GATE_UPSTREAM_PASSWORD) is used when the URL has none."""
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise GateError(f"the upstream URL must be redis://USER:PASS@HOST:PORT/DB, not {strip_password(url)!r}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise GateError(f"the upstream URL {strip_password(url)!r} has an invalid port") from None
        db_text = parts.path.lstrip("/") or "0"
        if not db_text.isdigit():
            raise GateError(f"the upstream URL {strip_password(url)!r} names database {db_text!r}, not a number")
        username = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password is not None else password
        if username and password is None:
            raise GateError(f"no password for the upstream user {username}: put it in ${UPSTREAM_PASSWORD_ENV}")
        return cls(parts.hostname or "127.0.0.1", port, username, password, int(db_text))

    def describe(self) -> str:
        return f"redis://{self.username + '@' if self.username else ''}{self.host}:{self.port}/{self.db}"


class UpstreamError(Exception):
    """The upstream cannot be reached, refused the gate, or broke the protocol."""


async def _open_upstream(upstream: Upstream, timeout_s: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(upstream.host, upstream.port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise UpstreamError(f"cannot connect to {upstream.describe()}: {str(exc) or 'timeout'}") from None
    handshake = []
    if upstream.password is not None:
        handshake.append(["AUTH", upstream.username, upstream.password] if upstream.username
                         else ["AUTH", upstream.password])
    if upstream.db:
        handshake.append(["SELECT", upstream.db])
    try:
        writer.write(b"".join(encode_request(cmd) for cmd in handshake))
        parser = ReplyParser()
        for command in handshake:
            reply = await _read_reply(reader, parser, timeout_s)
            if reply.startswith(b"-"):
                raise UpstreamError(f"{upstream.describe()} refused {command[0]}: "
                                    f"{reply[1:].decode('utf-8', 'replace').strip()}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _read_reply(reader: asyncio.StreamReader, parser: ReplyParser, timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):  # one deadline per reply: cheaper than wait_for per read
            while (reply := parser.next_reply()) is None:
                data = await reader.read(READ_CHUNK)
                if not data:
                    raise UpstreamError("the upstream closed the connection")
                parser.feed(data)
    except asyncio.TimeoutError:
        raise UpstreamError(f"no reply from the upstream within {timeout_s:.0f} s") from None
    except ReplyTooLarge:
        raise  # the upstream is fine; the reply is more than the gate will hold
    except (OSError, ReplyError) as exc:
        raise UpstreamError(f"upstream: {exc}") from None
    return reply


# --------------------------------------------------------------------------- the server


def _error(message: str) -> bytes:
    return b"-" + message.replace("\r", " ").replace("\n", " ").encode("utf-8", "replace") + b"\r\n"


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class _Session:
    """One client connection: who it is, its upstream connection, what it was told."""

    def __init__(self, number: int, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        self.number = number
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.user: Optional[GateUser] = None
        self.login_of: Optional[str] = None
        """The user this connection is logging in as, from the moment its login is counted against
        the user's connections (`max_user_connections`: logins that finish together cannot all pass)."""
        self.upstream: Optional[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = None
        self.reply_parser = ReplyParser(max_reply_bytes)
        self.logged: set[str] = set()  # refusal reasons already logged on this connection
        self.closing = False
        self.task: Optional[asyncio.Task] = None

    @property
    def who(self) -> str:
        return self.user.name if self.user is not None else ANONYMOUS


class _Core:
    """The gate inside its event loop: accepts clients, checks and forwards their requests."""

    def __init__(self, gate: "RedisGate"):
        self.gate = gate
        self.users = _UsersFile(gate.users_file)
        self.sessions: set[_Session] = set()
        self.named: dict[tuple[str, str], set[bytes]] = {}  # (user, glob) -> keys it named (Grant.max_distinct)
        self.calls: dict[tuple[str, str], int] = {}  # (user, function) -> calls (FunctionGrant.max_calls)
        self.connections = 0
        self._upstream_logged_at = -1e9

    # ---- connections

    async def on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        waiting = sum(1 for s in self.sessions if s.user is None)
        if len(self.sessions) >= self.gate.max_clients or waiting >= self.gate.max_unauthenticated:
            self.gate._refused_count(ANONYMOUS, "max_clients" if len(self.sessions) >= self.gate.max_clients
                                     else "max_unauthenticated")
            writer.write(_error("ERR max number of clients reached"))
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            return
        self.connections += 1
        session = _Session(self.connections, peer_text, reader, writer, self.gate.max_reply_bytes)
        session.task = asyncio.current_task()
        self.sessions.add(session)
        try:
            # the client went away; or it was revoked, or the gate stops (cancelled: this task is the
            # connection's top, nothing waits on it): either way the connection ends here
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
                await self._serve(session)
        finally:
            self.sessions.discard(session)
            if session.upstream is not None:
                session.upstream[1].close()
            writer.close()

    async def _serve(self, session: _Session) -> None:
        parser = RequestParser(self.gate.max_request_bytes, self.gate.max_args)
        loop = asyncio.get_running_loop()
        auth_deadline = loop.time() + self.gate.auth_timeout_s
        while not session.closing:
            # Unauthenticated connections get a deadline: a stranger may not hold sockets open for free.
            timeout = None if session.user is not None else max(0.0, auth_deadline - loop.time())
            try:
                data = await asyncio.wait_for(session.reader.read(READ_CHUNK), timeout)
            except asyncio.TimeoutError:
                session.writer.write(self._refuse(session, "auth_timeout", "ERR authentication timeout"))
                break
            if not data:
                return
            parser.feed(data)
            while not session.closing:
                try:
                    args = parser.next_request()
                except RequestError as exc:
                    session.writer.write(self._refuse(session, exc.reason, exc.message))
                    session.closing = True
                    break
                if args is None:
                    break
                session.writer.write(await self._dispatch(session, args))
                await session.writer.drain()  # a client that does not read stops being read
        await session.writer.drain()

    def revoke(self) -> None:
        """Close the connections of users removed from the file or whose password changed;
        give the others their (possibly new) grant."""
        for session in list(self.sessions):
            if session.user is None:
                continue
            current = self.users.users.get(session.user.name)
            if current is not None and current.sha256 == session.user.sha256:
                session.user = current
                continue
            log.warning("redis-gate: closing connection %d of %s from %s: its credentials were revoked",
                        session.number, session.user.name, session.peer)
            self.gate._bump("revoked_connections")
            session.closing = True
            if session.task is not None:
                session.task.cancel()

    async def watch_users(self) -> None:
        while True:
            await asyncio.sleep(self.gate.users_check_s)
            try:
                if self.users.refresh():
                    self.revoke()
            except Exception:  # noqa: BLE001 - revocation must outlive any one bad check
                log.exception("redis-gate: checking the users file failed")

    # ---- requests

    async def _dispatch(self, session: _Session, args: list[bytes]) -> bytes:
        name = command_name(args[0])
        if name == "AUTH":
            return await self._auth(session, args[1:])
        if name == "HELLO":
            return await self._hello(session, args[1:])
        if name == "QUIT":
            session.closing = True
            return OK
        if name == "CLIENT" and len(args) >= 2 and command_name(args[1]) in ("SETINFO", "SETNAME"):
            sub = command_name(args[1])
            if sub == "SETNAME" and session.user is None:
                return self._refuse(session, "noauth", NOAUTH)
            if len(args) != (4 if sub == "SETINFO" else 3):
                return _error(f"ERR wrong number of arguments for 'client|{sub.lower()}' command")
            return OK  # nothing upstream needs to know; the gate's log names the user
        if session.user is None:
            if name == "PING":
                return _bulk(args[1]) if len(args) == 2 else PONG
            return self._refuse(session, "noauth", NOAUTH)
        if name == "SELECT":
            if args[1:] == [b"0"]:
                return OK
            return self._refuse(session, "command", "NOPERM this user may not run 'SELECT' other than 'SELECT 0'")
        refusal = (check_request(session.user.grant, args) or self._too_many_keys(session.user, args)
                   or self._too_many_calls(session.user, args))
        if refusal is not None:
            return self._refuse(session, refusal.reason, refusal.message)
        return await self._forward(session, args)

    def _too_many_keys(self, user: GateUser, args: list[bytes]) -> Optional[Refusal]:
        """A refusal if this FCALL names a key past the user's `max_distinct` for its glob (checked
        request: its numkeys is canonical); the keys it names are remembered otherwise."""
        if command_name(args[0]) not in ("FCALL", "FCALL_RO") or not user.grant.max_distinct:
            return None
        keys = args[3:3 + int(args[2])]
        for pattern, limit in user.grant.max_distinct.items():
            named = self.named.setdefault((user.name, pattern), set())
            new = {key for key in keys if key_matches(key, (pattern,))} - named
            if len(named) + len(new) > limit:
                return Refusal("distinct_keys", f"NOPERM this user may name at most {limit} keys like "
                                                f"'{pattern}'")
            named |= new
        return None

    def _too_many_calls(self, user: GateUser, args: list[bytes]) -> Optional[Refusal]:
        """A refusal if this FCALL (a checked one) is past its function's `max_calls` for the user;
        counted otherwise."""
        if command_name(args[0]) not in ("FCALL", "FCALL_RO"):
            return None
        function = args[1].decode("utf-8")
        limit = user.grant.functions[function].max_calls
        if limit is None:
            return None
        calls = self.calls.get((user.name, function), 0)
        if calls >= limit:
            return Refusal("max_calls", f"NOPERM this user may call '{function}' at most {limit} times")
        self.calls[(user.name, function)] = calls + 1
        return None

    async def _forward(self, session: _Session, args: list[bytes]) -> bytes:
        assert session.upstream is not None
        reader, writer = session.upstream
        try:
            writer.write(encode_request(args))  # re-encoded: upstream sees exactly what was checked
            await writer.drain()
            reply = await _read_reply(reader, session.reply_parser, self.gate.upstream_timeout_s)
        except ReplyTooLarge as exc:
            session.closing = True  # the rest of the reply is still on its way: the stream is out of step
            return self._refuse(session, "reply_too_large", f"ERR {exc}, over the gate's limit")
        except (UpstreamError, OSError) as exc:
            self._upstream_failed(exc)
            session.closing = True  # the upstream stream is out of step now
            return _error(UPSTREAM_UNAVAILABLE)
        self.gate._bump("forwarded", session.who)
        return reply

    async def _auth(self, session: _Session, params: list[bytes]) -> bytes:
        if len(params) not in (1, 2):
            return _error("ERR wrong number of arguments for 'auth' command")
        name, password = (params[0], params[1]) if len(params) == 2 else (b"default", params[0])
        if self.users.refresh():  # a user added a moment ago may log in at once
            self.revoke()
        user = self.users.authenticate(name, password)
        if user is None:
            known = name.decode("utf-8", "replace") in self.users.users
            return self._refuse(session, "wrongpass", WRONGPASS,
                                who=name.decode("utf-8", "replace") if known else UNKNOWN_USER)
        session.login_of = None
        held = sum(1 for s in self.sessions if s is not session and s.login_of == user.name)
        if held >= self.gate.max_user_connections:
            session.closing = True
            return self._refuse(session, "max_user_connections", f"ERR user {user.name} holds "
                                f"{self.gate.max_user_connections} connections already, the most it may",
                                who=user.name)
        session.login_of = user.name  # counted from here: no await between the count and this
        if session.upstream is None:
            try:
                session.upstream = await _open_upstream(self.gate.upstream, self.gate.upstream_timeout_s)
            except UpstreamError as exc:
                self._upstream_failed(exc)
                session.closing, session.login_of = True, None
                return _error(UPSTREAM_UNAVAILABLE)
            # The file may have changed while the upstream connected; the watcher only acts on the
            # next change, so check again (nothing else runs between here and the assignment).
            current = self.users.users.get(user.name)
            if current is None or current.sha256 != user.sha256:
                session.login_of = None
                return self._refuse(session, "wrongpass", WRONGPASS, who=user.name)
            user = current
        session.user = user
        return OK

    async def _hello(self, session: _Session, params: list[bytes]) -> bytes:
        if params:
            version = _canonical_int(params[0])
            if version is None:
                return _error("ERR Protocol version is not an integer or out of range")
            if version != 2:
                return _error(NOPROTO)  # redis-py falls back to RESP2 + AUTH on this
        rest = params[1:]
        auth: Optional[list[bytes]] = None
        i = 0
        while i < len(rest):
            option = command_name(rest[i])
            if option == "AUTH" and i + 2 < len(rest):
                auth = [rest[i + 1], rest[i + 2]]
                i += 3
            elif option == "SETNAME" and i + 1 < len(rest):
                i += 2
            else:
                return _error(f"ERR Syntax error in HELLO option '{_show(rest[i])}'")
        if auth is not None:
            answer = await self._auth(session, auth)
            if answer != OK:
                return answer
        return self._hello_reply(session)

    @staticmethod
    def _hello_reply(session: _Session) -> bytes:
        fields: list[bytes] = [_bulk(b"server"), _bulk(b"redis-gate"), _bulk(b"version"), _bulk(b"1.0.0"),
                               _bulk(b"proto"), b":2\r\n", _bulk(b"id"), b":%d\r\n" % session.number,
                               _bulk(b"mode"), _bulk(b"standalone"), _bulk(b"role"), _bulk(b"master"),
                               _bulk(b"modules"), b"*0\r\n"]
        return b"*%d\r\n" % len(fields) + b"".join(fields)

    # ---- refusals

    def _refuse(self, session: _Session, reason: str, message: str, who: Optional[str] = None) -> bytes:
        who = who or session.who
        self.gate._refused_count(who, reason)
        if reason not in session.logged:  # one line per kind and connection: no flood
            session.logged.add(reason)
            log.warning("redis-gate: refused %s on connection %d of %s from %s: %s (further %s refusals on "
                        "this connection are counted, not logged)", reason, session.number, who, session.peer,
                        message, reason)
        return _error(message)

    def _upstream_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._upstream_logged_at >= 10.0:  # one line per 10 s, however many clients fail
            self._upstream_logged_at = now
            log.error("redis-gate: upstream unavailable: %s", exc)
        self.gate._bump("upstream_failures")


class RedisGate:
    """The gate, run by its own event loop in a daemon thread; every method is thread-safe.

    ``listen``: (host, port), port 0 picks a free one. ``upstream_url``: the Redis it forwards
    to, as the user whose ACL allows what the functions do; ``upstream_password`` (or
    $REDIS_GATE_UPSTREAM_PASSWORD, for the CLI) when the URL carries none. Raises GateError at
    once for a bad URL or users file.
    """

    def __init__(self, listen: tuple[str, int] = ("127.0.0.1", 0), upstream_url: str = "redis://127.0.0.1:6379/0",
                 users_file: PathLike = "gate-users.json", *, upstream_password: Optional[str] = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_args: int = DEFAULT_MAX_ARGS,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES, max_clients: int = MAX_CLIENTS,
                 max_user_connections: int = MAX_USER_CONNECTIONS, max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 users_check_s: float = USERS_CHECK_S, auth_timeout_s: float = AUTH_TIMEOUT_S,
                 upstream_timeout_s: float = UPSTREAM_TIMEOUT_S):
        self.listen = listen
        self.upstream = Upstream.from_url(upstream_url, upstream_password)
        self.users_file = Path(users_file)
        self.max_request_bytes = max_request_bytes
        self.max_args = max_args
        self.max_reply_bytes = max_reply_bytes
        self.max_clients = max_clients
        self.max_user_connections = max_user_connections
        self.max_unauthenticated = max_unauthenticated
        self.users_check_s = users_check_s
        self.auth_timeout_s = auth_timeout_s
        self.upstream_timeout_s = upstream_timeout_s
        self._core = _Core(self)
        self._core.users.load_strict()
        self._lock = threading.Lock()
        self._refused: dict[str, dict[str, int]] = {}
        self._forwarded: dict[str, int] = {}
        self._counters = {"revoked_connections": 0, "upstream_failures": 0}
        self._port = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping: Optional[asyncio.Event] = None

    # ---- lifecycle

    def start(self, timeout_s: float = 10.0) -> "RedisGate":
        """Start listening; returns once the socket is open (GateError if it cannot be)."""
        if self._thread is not None:
            raise GateError("the gate is already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._thread_main, args=(ready, failure), name="redis-gate", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise GateError(f"the gate did not start within {timeout_s:.0f} s")
        if failure:
            self._thread.join(timeout_s)
            self._thread = None
            exc = failure[0]
            raise GateError(f"the gate cannot listen on {self.listen[0]}:{self.listen[1]}: {exc}") from exc
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "RedisGate":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """"host:port" the gate listens on (the picked port for port 0)."""
        return f"{self.listen[0]}:{self._port}"

    def url(self, user: str, password: str) -> str:
        """The redis:// URL a client of ``user`` connects with."""
        return f"redis://{user}:{password}@{self.address}/0"

    def stats(self) -> dict[str, Any]:
        """{"refused": {user: {reason: n}}, "forwarded": {user: n}, "revoked_connections": n,
        "upstream_failures": n, "connections_open": n, "connections_total": n}. Refusals before
        AUTH are counted under "<anonymous>", failed AUTHs under the name tried if it is a user,
        else "<unknown>"."""
        with self._lock:
            return {"refused": {user: dict(reasons) for user, reasons in self._refused.items()},
                    "forwarded": dict(self._forwarded), **self._counters,
                    "connections_open": len(self._core.sessions), "connections_total": self._core.connections}

    # ---- inside the loop

    def _refused_count(self, user: str, reason: str) -> None:
        with self._lock:
            reasons = self._refused.setdefault(user, {})
            reasons[reason] = reasons.get(reason, 0) + 1

    def _bump(self, counter: str, user: Optional[str] = None) -> None:
        with self._lock:
            if counter == "forwarded" and user is not None:
                self._forwarded[user] = self._forwarded.get(user, 0) + 1
            else:
                self._counters[counter] += 1

    def _thread_main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # surfaced to start() through `failure`
            failure.append(exc)
            if ready.is_set():
                log.error("redis-gate: stopped: %s", exc)
        finally:
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._core.on_client, self.listen[0], self.listen[1])
        self._port = server.sockets[0].getsockname()[1]
        watcher = asyncio.create_task(self._core.watch_users())
        ready.set()
        try:
            await self._stopping.wait()
        finally:
            watcher.cancel()
            server.close()
            tasks = [s.task for s in self._core.sessions if s.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)


# --------------------------------------------------------------------------- CLI


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host or "127.0.0.1", int(port)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.redis_gate",
        description="Authorizing RESP2 gate in front of Redis: strangers authenticate with the gate and may "
                    "only read allowed keys and FCALL allowed functions (see the module docstring).")
    parser.add_argument("--listen", type=_parse_listen, required=True, help="HOST:PORT to listen on (port 0: any)")
    parser.add_argument("--upstream-url", required=True,
                        help=f"redis://USER[:PASS]@HOST:PORT/DB the gate forwards as; without PASS the password "
                             f"is read from ${UPSTREAM_PASSWORD_ENV} (keeps it out of argv)")
    parser.add_argument("--users", type=Path, required=True, help="users JSON file (mode 0600)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request; a larger one closes the connection (default %(default)s)")
    parser.add_argument("--max-args", type=int, default=DEFAULT_MAX_ARGS,
                        help="most arguments in one request (default %(default)s)")
    parser.add_argument("--max-reply-bytes", type=int, default=DEFAULT_MAX_REPLY_BYTES,
                        help="largest reply passed on; a larger one closes the connection (default %(default)s)")
    parser.add_argument("--max-clients", type=int, default=MAX_CLIENTS,
                        help="connections at once, all users (default %(default)s)")
    parser.add_argument("--max-user-connections", type=int, default=MAX_USER_CONNECTIONS,
                        help="connections at once of one user (default %(default)s)")
    parser.add_argument("--max-unauthenticated", type=int, default=MAX_UNAUTHENTICATED,
                        help="connections at once that have not logged in (default %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (default WARNING)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    if urlsplit(args.upstream_url).password is not None:
        log.warning("redis-gate: the upstream password is in argv (visible to ps); prefer $%s", UPSTREAM_PASSWORD_ENV)
    try:
        gate = RedisGate(args.listen, args.upstream_url, args.users,
                         upstream_password=os.environ.get(UPSTREAM_PASSWORD_ENV),
                         max_request_bytes=args.max_request_bytes, max_args=args.max_args,
                         max_reply_bytes=args.max_reply_bytes, max_clients=args.max_clients,
                         max_user_connections=args.max_user_connections,
                         max_unauthenticated=args.max_unauthenticated).start()
    except GateError as exc:
        print(f"redis-gate: {exc}", file=sys.stderr)
        return 2
    print(f"redis-gate listening on {gate.address}, forwarding to {gate.upstream.describe()}", flush=True)
    serve_until_stopped(gate.stop)
    print(f"redis-gate stopped: {json.dumps(gate.stats(), sort_keys=True)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
