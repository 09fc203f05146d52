"""infra.redis_gate without Redis: the RESP parsers, the grant decisions, the users file, and the
gate's own answers on loopback (before AUTH, wrong passwords, oversized requests, a dead upstream).

The forwarding itself, against a real Valkey, is in tests/integration/test_redis_gate.py.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.redis_gate import (
    READ_COMMANDS,
    FunctionGrant,
    GateError,
    Grant,
    RedisGate,
    ReplyError,
    ReplyParser,
    RequestParser,
    RequestProtocolError,
    RequestTooLarge,
    Upstream,
    _UsersFile,
    add_user,
    check_request,
    encode_request,
    new_password,
    password_hash,
    read_users,
    remove_user,
    write_users,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
IO_TIMEOUT_S = 5.0


def _args(*parts: str | bytes) -> list[bytes]:
    return [p if isinstance(p, bytes) else p.encode() for p in parts]


# --------------------------------------------------------------------------- request parser


def _parse_all(parser: RequestParser) -> list[list[bytes]]:
    out = []
    while (request := parser.next_request()) is not None:
        out.append(request)
    return out


def test_a_request_and_a_pipeline_are_parsed_in_order():
    parser = RequestParser()
    parser.feed(encode_request(["HGET", "heterorl:run1:policy", "version"]) + encode_request(["PING"]))
    assert _parse_all(parser) == [_args("HGET", "heterorl:run1:policy", "version"), [b"PING"]]
    assert parser.buffered() == 0


def test_binary_arguments_with_crlf_inside_survive():
    parser = RequestParser()
    parser.feed(encode_request([b"ECHO", b"a\r\nb\x00\xff"]))
    assert _parse_all(parser) == [[b"ECHO", b"a\r\nb\x00\xff"]]


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(st.lists(st.binary(max_size=40), min_size=1, max_size=6), min_size=1, max_size=6),
       cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_requests_split_at_any_boundary_parse_the_same(requests, cuts):
    wire = b"".join(encode_request(r) for r in requests)
    bounds = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    parser = RequestParser()
    got = []
    for start, stop in zip(bounds, bounds[1:]):
        parser.feed(wire[start:stop])
        got += _parse_all(parser)
    assert got == requests


def test_a_100_mb_bulk_header_is_refused_at_once():
    parser = RequestParser()
    parser.feed(b"*3\r\n$4\r\nECHO\r\n$104857600\r\n")  # the header only: no data follows yet
    with pytest.raises(RequestTooLarge, match="over the gate's limit of 65536"):
        parser.next_request()
    assert parser.buffered() < 100  # nothing was waited for, nothing was held


def test_too_many_arguments_are_refused_on_the_array_header():
    parser = RequestParser(max_args=1024)
    parser.feed(b"*1025\r\n")
    with pytest.raises(RequestTooLarge, match="1025 arguments"):
        parser.next_request()


def test_the_size_cap_counts_the_whole_request_and_allows_exactly_the_cap():
    request = encode_request(["ECHO", "x" * 100])
    exact = RequestParser(max_request_bytes=len(request))
    exact.feed(request)
    assert _parse_all(exact) == [_args("ECHO", "x" * 100)]
    over = RequestParser(max_request_bytes=len(request) - 1)
    over.feed(request[:20])  # the second bulk header is enough to know
    with pytest.raises(RequestTooLarge):
        over.next_request()


def test_many_small_arguments_add_up_to_the_cap():
    parser = RequestParser(max_request_bytes=1000, max_args=1024)
    parser.feed(encode_request(["MGET"] + ["k" * 20] * 100))
    with pytest.raises(RequestTooLarge):
        parser.next_request()


@pytest.mark.parametrize("wire, message", [
    (b"GET foo\r\n", "inline commands"),
    (b"*1\r\n:12\r\n", "expected '\\$'"),
    (b"*1\r\n$-1\r\n", "invalid bulk length"),
    (b"*1\r\n$3\r\nabcXY", "not followed by CRLF"),
    (b"*x\r\n", "invalid multibulk length"),
    (b"*" + b"1" * 40, "header line too long"),
    (b"X" * 100, "inline commands"),
])
def test_protocol_errors(wire, message):
    parser = RequestParser()
    parser.feed(wire)
    with pytest.raises(RequestProtocolError, match=message):
        parser.next_request()


def test_inline_ping_empty_lines_and_empty_arrays():
    parser = RequestParser()
    parser.feed(b"\r\nping\r\n*0\r\n*-1\r\n" + encode_request(["TIME"]))
    assert _parse_all(parser) == [[b"PING"], [b"TIME"]]


# --------------------------------------------------------------------------- reply parser

_line = st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b)
_scalars = st.one_of(
    _line.map(lambda s: b"+" + s + b"\r\n"),
    _line.map(lambda s: b"-ERR " + s + b"\r\n"),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda i: b":%d\r\n" % i),
    st.binary(max_size=50).map(lambda b: b"$%d\r\n%s\r\n" % (len(b), b)),
    st.just(b"$-1\r\n"),
    st.just(b"*-1\r\n"),
    st.just(b"*0\r\n"),
)
_replies = st.recursive(_scalars, lambda inner: st.lists(inner, min_size=1, max_size=4).map(
    lambda items: b"*%d\r\n" % len(items) + b"".join(items)), max_leaves=15)


def _replies_of(parser: ReplyParser) -> list[bytes]:
    out = []
    while (reply := parser.next_reply()) is not None:
        out.append(reply)
    return out


@pytest.mark.parametrize("reply", [
    b"+OK\r\n", b"-ERR nope\r\n", b":-42\r\n", b"$0\r\n\r\n", b"$5\r\na\r\nbc\r\n", b"$-1\r\n", b"*-1\r\n",
    b"*0\r\n", b"*3\r\n:1\r\n*2\r\n$-1\r\n*-1\r\n+x\r\n", b"*2\r\n*1\r\n*1\r\n*0\r\n$1\r\nz\r\n",
])
def test_every_reply_type_byte_by_byte(reply):
    parser = ReplyParser()
    got = []
    for i in range(len(reply)):
        parser.feed(reply[i:i + 1])
        got += _replies_of(parser)
        assert got == ([] if i < len(reply) - 1 else [reply])


@settings(max_examples=300, deadline=None)
@given(replies=st.lists(_replies, min_size=1, max_size=5),
       cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=15))
def test_replies_split_at_any_boundary_come_back_unchanged(replies, cuts):
    wire = b"".join(replies)
    bounds = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    parser = ReplyParser()
    got = []
    for start, stop in zip(bounds, bounds[1:]):
        parser.feed(wire[start:stop])
        got += _replies_of(parser)
    assert got == replies


def test_reply_errors_and_cap():
    for bad in (b"%2\r\n", b"$x\r\n", b"*-5\r\n", b"$3\r\nabcde\r\n"):
        parser = ReplyParser()
        parser.feed(bad)
        with pytest.raises(ReplyError):
            parser.next_reply()
    parser = ReplyParser(max_reply_bytes=100)
    parser.feed(b"$1000\r\n")
    with pytest.raises(ReplyError, match="over 100 bytes"):
        parser.next_reply()


# --------------------------------------------------------------------------- grants

GRANT = Grant(read_keys=("heterorl:run1:*", "heterorl:runs"),
              functions={"hr_set": FunctionGrant(("heterorl:run1:sampler_stats", "heterorl:run1:sampler:*"),
                                                 max_args=2, max_arg_bytes=10)})


def _reason(*parts: str | bytes, grant: Grant = GRANT) -> str | None:
    refusal = check_request(grant, _args(*parts))
    return None if refusal is None else refusal.reason


def test_reads_pass_by_key_pattern():
    assert _reason("HGETALL", "heterorl:run1:policy") is None
    assert _reason("hget", "heterorl:run1:policy", "version") is None  # command names in any case
    assert _reason("ZREVRANGE", "heterorl:runs", "0", "0") is None
    assert _reason("GET", "heterorl:run2:policy") == "key"
    assert _reason("GET", "HETERORL:RUN1:policy") == "key"  # patterns are case-sensitive
    assert _reason("GET", "heterorl:runs:x") == "key"
    assert _reason("MGET", "heterorl:run1:a", "heterorl:run2:a") == "key"  # every key of MGET
    assert _reason("EXISTS", "heterorl:run1:a", "other") == "key"
    assert _reason("PING") is None and _reason("TIME") is None and _reason("ECHO", "hi") is None
    refusal = check_request(GRANT, _args("HGET", "heterorl:run2:policy", "version"))
    assert refusal.message == "NOPERM this user may not read key 'heterorl:run2:policy'"


def test_read_commands_can_be_narrowed_and_must_be_known():
    narrow = Grant(read_keys=("*",), read_commands=frozenset({"get"}))
    assert _reason("GET", "k", grant=narrow) is None
    assert _reason("HGET", "k", "f", grant=narrow) == "command"
    with pytest.raises(GateError, match="SET are not gate read commands"):
        Grant(read_commands=frozenset({"GET", "SET"}))


def test_arity_is_checked_before_keys():
    assert _reason("GET") == "syntax"
    assert _reason("GET", "heterorl:run1:a", "heterorl:run2:b") == "syntax"  # a second "key" never slips by
    assert _reason("LRANGE", "heterorl:run1:reissue", "0") == "syntax"


def test_hscan_without_match_and_with_a_bounded_count():
    assert _reason("HSCAN", "heterorl:run1:claims", "0") is None
    assert _reason("HSCAN", "heterorl:run1:claims", "0", "COUNT", "1000") is None
    assert _reason("HSCAN", "heterorl:run1:claims", "0", "NOVALUES") is None
    assert _reason("HSCAN", "heterorl:run1:claims", "0", "MATCH", "*") == "command"
    assert _reason("HSCAN", "heterorl:run1:claims", "0", "COUNT", "1001") == "command"
    assert _reason("HSCAN", "heterorl:run1:claims", "0", "COUNT", "01") == "command"
    assert _reason("HSCAN", "heterorl:run2:claims", "0") == "key"


@pytest.mark.parametrize("command", [
    ("SET", "heterorl:run1:a", "1"), ("HSET", "heterorl:run1:a", "f", "v"), ("RPUSH", "heterorl:run1:reissue", "x"),
    ("DEL", "heterorl:run1:a"), ("EVAL", "return 1", "0"), ("EVALSHA", "a" * 40, "0"), ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"), ("FUNCTION", "LOAD", "x"), ("KEYS", "*"), ("SCAN", "0"), ("CONFIG", "GET", "*"),
    ("ACL", "LIST"), ("MULTI",), ("EXEC",), ("SUBSCRIBE", "c"), ("CLIENT", "LIST"), ("CLIENT", "KILL", "x"),
    ("DEBUG", "SLEEP", "10"), ("FLUSHALL",), ("SELECT", "1"), ("BLPOP", "heterorl:run1:reissue", "0"),
    ("XREAD", "STREAMS", "heterorl:run1:x", "0"), ("MONITOR",), ("SHUTDOWN",), ("OBJECT", "ENCODING", "k"),
    ("SORT", "heterorl:run1:reissue", "STORE", "heterorl:run1:x"),
    ("ZRANGESTORE", "heterorl:run1:a", "heterorl:run1:b", "0", "1"),
    ("GET\x00", "heterorl:run1:a"), ("WAIT", "0", "0"), ("RESET",), ("COMMAND",),
])
def test_everything_else_is_refused(command):
    refusal = check_request(GRANT, _args(*command))
    assert refusal is not None and refusal.reason == "command"
    assert refusal.message.startswith("NOPERM this user may not run '")
    assert "\r" not in refusal.message and "\n" not in refusal.message


def test_fcall_by_name_keys_and_argument_sizes():
    keys = ("heterorl:run1:sampler_stats", "heterorl:run1:sampler:s1")
    assert _reason("FCALL", "hr_set", "2", *keys, "a", "b" * 10) is None
    assert _reason("FCALL_RO", "hr_set", "2", *keys) is None
    assert _reason("fcall", "hr_set", "2", *keys, "a") is None
    assert _reason("FCALL", "HR_SET", "2", *keys) == "function"  # function names are case-sensitive
    assert _reason("FCALL", "hr_other", "2", *keys) == "function"
    assert _reason("FCALL", "hr_set", "1", keys[0], keys[1]) == "function_keys"  # numkeys must match
    assert _reason("FCALL", "hr_set", "3", *keys, "heterorl:run1:x") == "function_keys"
    for numkeys in ("02", "+2", "-2", " 2", "2.0"):
        assert _reason("FCALL", "hr_set", numkeys, *keys) == "function_keys", numkeys
    assert _reason("FCALL", "hr_set", "2", keys[1], keys[0]) == "function_keys"  # keys in order
    assert _reason("FCALL", "hr_set", "2", "heterorl:run2:sampler_stats", keys[1]) == "function_keys"
    assert _reason("FCALL", "hr_set", "2", keys[0], "heterorl:run1:sampler_stats") == "function_keys"
    assert _reason("FCALL", "hr_set", "2", *keys, "a", "b", "c") == "function_args"
    assert _reason("FCALL", "hr_set", "2", *keys, "a", "b" * 11) == "function_args"
    assert _reason("FCALL", "hr_set", "2", keys[0]) == "syntax"
    assert _reason("FCALL", "hr_set") == "syntax"
    refusal = check_request(GRANT, _args("FCALL", "hr_set", "2", *keys, "x" * 11))
    assert refusal.message == "NOPERM argument 1 of 'hr_set' has 11 bytes, over the 10 allowed"


def test_grant_json_round_trip_and_strictness():
    assert Grant.from_json(json.loads(json.dumps(GRANT.to_json()))) == GRANT
    assert Grant.from_json({}).read_commands == frozenset(READ_COMMANDS)
    with pytest.raises(GateError, match="unknown read_key"):
        Grant.from_json({"read_key": ["*"]})
    with pytest.raises(GateError, match="missing keys"):
        Grant.from_json({"functions": {"f": {"max_args": 1}}})
    with pytest.raises(GateError, match="max_args must be a non-negative integer"):
        Grant.from_json({"functions": {"f": {"keys": [], "max_args": -1}}})
    with pytest.raises(GateError, match="read_keys must be a list"):
        Grant(read_keys="heterorl:*")
    for bad in ({"read_keys": 5}, {"read_keys": "heterorl:*"}, {"read_commands": 5}, {"read_commands": [1]},
                {"functions": {"f": {"keys": 5}}}, {"functions": {"f": {"keys": [], "max_args": True}}},
                {"functions": []}):
        with pytest.raises(GateError):
            Grant.from_json(bad)


# --------------------------------------------------------------------------- users file


def test_write_users_is_0600_atomic_and_round_trips(tmp_path):
    path = tmp_path / "users.json"
    password = new_password()
    add_user(path, "vol1", password, GRANT)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    users = read_users(path)
    assert users["vol1"].sha256 == password_hash(password) and users["vol1"].grant == GRANT
    assert json.loads(path.read_text())["version"] == 1
    add_user(path, "vol2", new_password(), Grant())
    assert sorted(read_users(path)) == ["vol1", "vol2"]
    assert remove_user(path, "vol1") and not remove_user(path, "vol1")
    assert sorted(read_users(path)) == ["vol2"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_users_file_refusals(tmp_path):
    path = tmp_path / "users.json"
    with pytest.raises(GateError, match=">= 22 characters"):
        add_user(path, "vol1", "short", Grant())
    write_users(path, {})
    os.chmod(path, 0o644)
    with pytest.raises(GateError, match="chmod 600"):
        read_users(path)
    os.chmod(path, 0o600)
    path.write_text('{"users": {"bad name": {"sha256": "00", "grant": {}}}}')
    with pytest.raises(GateError, match="user name 'bad name'"):
        read_users(path)
    path.write_text('{"users": {"vol1": {"sha256": "00", "grant": {}}}}')
    with pytest.raises(GateError, match="64 lower-case hex"):
        read_users(path)
    path.write_text("{not json")
    with pytest.raises(GateError, match="not JSON"):
        read_users(path)
    with pytest.raises(GateError, match="cannot read the users file"):
        read_users(tmp_path / "missing.json")


def test_password_hash_is_plain_sha256():
    assert password_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert password_hash(b"abc") == password_hash("abc")
    assert len(new_password()) >= 43


def test_users_file_reload_on_change_and_fail_closed(tmp_path):
    path = tmp_path / "users.json"
    password = new_password()
    add_user(path, "vol1", password, GRANT)
    users = _UsersFile(path)
    users.load_strict()
    assert not users.refresh()
    assert users.authenticate(b"vol1", password.encode()).name == "vol1"
    assert users.authenticate(b"vol1", b"wrong") is None
    assert users.authenticate(b"nobody", password.encode()) is None
    other = new_password()
    add_user(path, "vol1", other, GRANT)  # same size, maybe the same mtime: the rename changes the inode
    assert users.refresh()
    assert users.authenticate(b"vol1", password.encode()) is None
    path.write_text("{broken")
    os.chmod(path, 0o600)
    assert users.refresh() and users.users == {}
    path.unlink()
    assert users.refresh() and users.users == {}


def test_upstream_url():
    up = Upstream.from_url("redis://sampler:p%40ss@10.0.0.1:6390/2")
    assert (up.host, up.port, up.username, up.password, up.db) == ("10.0.0.1", 6390, "sampler", "p@ss", 2)
    assert Upstream.from_url("redis://sampler@h:1/0", password="env").password == "env"
    assert Upstream.from_url("redis://sampler:url@h:1/0", password="env").password == "url"
    with pytest.raises(GateError, match="no password for the upstream user sampler"):
        Upstream.from_url("redis://sampler@h:1/0")
    with pytest.raises(GateError, match="must be redis://"):
        Upstream.from_url("http://h:1")


# --------------------------------------------------------------------------- the gate on loopback


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Raw:
    """A RESP client on a plain socket: what a hostile stranger could send."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=IO_TIMEOUT_S)
        self.parser = ReplyParser()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def call(self, *args: str | bytes) -> bytes:
        self.send(encode_request(list(args)))
        return self.reply()

    def reply(self) -> bytes:
        while (reply := self.parser.next_reply()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.parser.feed(data)
        return reply

    def closed_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except (socket.timeout, TimeoutError):
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def offline_gate(tmp_path):
    """A gate whose upstream is a closed port: everything before a successful AUTH still works."""
    users = tmp_path / "users.json"
    password = new_password()
    add_user(users, "vol1", password, GRANT)
    gate = RedisGate(("127.0.0.1", 0), f"redis://127.0.0.1:{_closed_port()}/0", users, upstream_timeout_s=2.0)
    gate.start()
    yield gate, password
    gate.stop()


def test_before_auth_only_the_handshake_passes(offline_gate):
    gate, _ = offline_gate
    raw = _Raw(gate.address)
    try:
        assert raw.call("PING") == b"+PONG\r\n"
        assert raw.call("CLIENT", "SETINFO", "LIB-NAME", "redis-py") == b"+OK\r\n"
        assert raw.call("HELLO", "3", "AUTH", "vol1", "x") == (
            b"-NOPROTO sorry, this protocol version is not supported.\r\n")
        hello = raw.call("HELLO", "2")
        assert hello.startswith(b"*14\r\n") and b"$5\r\nproto\r\n:2\r\n" in hello
        for command in (("GET", "heterorl:run1:a"), ("EVAL", "return 1", "0"), ("SELECT", "0"),
                        ("CLIENT", "SETNAME", "x")):
            assert raw.call(*command) == b"-NOAUTH Authentication required.\r\n"
        assert raw.call("AUTH", "vol1", "wrong") == (
            b"-WRONGPASS invalid username-password pair or user is disabled.\r\n")
        assert raw.call("AUTH", "nobody", "wrong").startswith(b"-WRONGPASS")
        assert raw.call("HELLO", "2", "AUTH", "vol1", "wrong").startswith(b"-WRONGPASS")
        assert raw.call("QUIT") == b"+OK\r\n"
        assert raw.closed_within(2.0)
    finally:
        raw.close()
    refused = gate.stats()["refused"]
    assert refused["<anonymous>"]["noauth"] == 4
    assert refused["vol1"]["wrongpass"] == 2 and refused["<unknown>"]["wrongpass"] == 1


def test_an_oversized_request_is_refused_before_it_is_sent_whole(offline_gate):
    gate, _ = offline_gate
    raw = _Raw(gate.address)
    other = _Raw(gate.address)
    try:
        raw.send(b"*3\r\n$4\r\nECHO\r\n$104857600\r\n" + b"x" * 1000)  # claims 100 MB, sends 1 KB
        assert raw.reply().startswith(b"-ERR request of at least")
        assert raw.closed_within(2.0)
        assert other.call("PING") == b"+PONG\r\n"  # another connection is not disturbed
    finally:
        raw.close()
        other.close()
    assert gate.stats()["refused"]["<anonymous>"]["too_large"] == 1


def test_a_successful_auth_with_the_upstream_down_fails_the_client(offline_gate):
    gate, password = offline_gate
    raw = _Raw(gate.address)
    try:
        assert raw.call("AUTH", "vol1", password) == b"-ERR upstream unavailable\r\n"
        assert raw.closed_within(2.0)
    finally:
        raw.close()
    assert gate.stats()["upstream_failures"] == 1


def test_unauthenticated_connections_time_out(tmp_path):
    users = tmp_path / "users.json"
    write_users(users, {})
    with RedisGate(("127.0.0.1", 0), "redis://127.0.0.1:1/0", users, auth_timeout_s=0.3) as gate:
        raw = _Raw(gate.address)
        started = time.monotonic()
        try:
            assert raw.reply() == b"-ERR authentication timeout\r\n"
            assert raw.closed_within(2.0) and time.monotonic() - started < 2.0
        finally:
            raw.close()


def test_a_bad_users_file_fails_at_construction(tmp_path):
    users = tmp_path / "users.json"
    users.write_text("{}")
    os.chmod(users, 0o600)
    with pytest.raises(GateError, match="missing users"):
        RedisGate(("127.0.0.1", 0), "redis://127.0.0.1:1/0", users)


def test_cli_help_names_the_password_variable():
    out = subprocess.run([sys.executable, "-m", "infra.redis_gate", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--upstream-url" in out.stdout and "REDIS_GATE_UPSTREAM_PASSWORD" in out.stdout


def test_cli_refuses_a_missing_users_file_in_one_line(tmp_path, capsys):
    from infra.redis_gate import main

    code = main(["--listen", "127.0.0.1:0", "--upstream-url", "redis://127.0.0.1:1/0",
                 "--users", str(tmp_path / "none.json")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("redis-gate: cannot read the users file") and "\n" not in err


# --------------------------------------------------------------------------- forwarding, against a fake upstream


class _FakeRedis(socketserver.ThreadingTCPServer):
    """Answers each request by its command name from `replies` (None: close the connection),
    in two writes so the gate sees replies split; records what it was sent."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, replies: dict[bytes, bytes | None]):
        super().__init__(("127.0.0.1", 0), _FakeRedisHandler)
        self.replies = replies
        self.seen: list[list[bytes]] = []


class _FakeRedisHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        parser = RequestParser(max_request_bytes=1 << 30)
        while data := self.request.recv(65536):
            parser.feed(data)
            while (request := parser.next_request()) is not None:
                self.server.seen.append(request)
                reply = self.server.replies.get(request[0].upper(), b"+OK\r\n")
                if reply is None:
                    return
                self.request.sendall(reply[:3])
                time.sleep(0.01)
                self.request.sendall(reply[3:])


NESTED = b"*4\r\n$-1\r\n*-1\r\n*2\r\n:1\r\n$4\r\n\r\n\r\n\r\n+x\r\n"


@pytest.fixture
def fake_upstream():
    server = _FakeRedis({b"GET": NESTED, b"HGETALL": b"$2000\r\n" + b"x" * 2000 + b"\r\n", b"LLEN": None})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_replies_are_passed_back_unchanged_and_only_checked_requests_go_upstream(tmp_path, fake_upstream):
    users = tmp_path / "users.json"
    password = new_password()
    add_user(users, "vol1", password, GRANT)
    url = f"redis://up@127.0.0.1:{fake_upstream.server_address[1]}/3"
    with RedisGate(("127.0.0.1", 0), url, users, upstream_password="secret", max_reply_bytes=1000) as gate:
        raw = _Raw(gate.address)
        try:
            assert raw.call("CLIENT", "SETINFO", "LIB-VER", "1") == b"+OK\r\n"
            assert raw.call("AUTH", "vol1", password) == b"+OK\r\n"
            assert raw.call("SELECT", "0") == b"+OK\r\n"
            raw.send(encode_request(["GET", "heterorl:run1:a"]) + encode_request(["SET", "heterorl:run1:a", "1"])
                     + encode_request(["get", "heterorl:run1:b"]))  # a pipeline with a refusal in the middle
            assert [raw.reply(), raw.reply(), raw.reply()] == [NESTED, b"-NOPERM this user may not run 'SET'\r\n",
                                                               NESTED]
            assert raw.call("HGETALL", "heterorl:run1:big") == (
                b"-ERR reply over 1000 bytes, over the gate's limit\r\n")
            assert raw.closed_within(2.0)
        finally:
            raw.close()
        raw = _Raw(gate.address)
        try:
            assert raw.call("AUTH", "vol1", password) == b"+OK\r\n"
            assert raw.call("LLEN", "heterorl:run1:reissue") == b"-ERR upstream unavailable\r\n"
            assert raw.closed_within(2.0)
        finally:
            raw.close()
        stats = gate.stats()
    assert fake_upstream.seen[:4] == [[b"AUTH", b"up", b"secret"], [b"SELECT", b"3"],
                                      [b"GET", b"heterorl:run1:a"], [b"get", b"heterorl:run1:b"]]
    assert not any(request[0].upper() in (b"SET", b"CLIENT") for request in fake_upstream.seen)
    assert stats["forwarded"]["vol1"] == 2 and stats["upstream_failures"] == 1
    assert stats["refused"]["vol1"] == {"command": 1, "reply_too_large": 1}
