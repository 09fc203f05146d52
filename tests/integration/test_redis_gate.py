"""infra.redis_gate in front of the local stack's Valkey, driven by redis-py as a stranger would.

One stack for the module (memory broker): the admin loads a small function library and seeds
two runs' keys; the gate forwards as the stack's `sampler` user; the stranger `vol1` may read
`heterorl:run1:*` and call `hr_test_set` on `heterorl:run1:sampler_stats` only. The revocation
test removes `vol1` and so runs last.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from infra.local_stack import stack_services, start_stack, stop_stack
from infra.redis_gate import (
    FunctionGrant,
    Grant,
    RedisGate,
    ReplyParser,
    add_user,
    encode_request,
    new_password,
    remove_user,
)

pytestmark = pytest.mark.integration

LIBRARY = """#!lua name=hr_gate_test
redis.register_function('hr_test_set', function(keys, args)
  return redis.call('HSET', keys[1], args[1], args[2])
end)
redis.register_function{function_name='hr_test_get', flags={'no-writes'}, callback=function(keys, args)
  return redis.call('HGET', keys[1], args[1])
end}
"""
STATS = "heterorl:run1:sampler_stats"
GRANT = Grant(read_keys=("heterorl:run1:*",),
              functions={"hr_test_set": FunctionGrant((STATS,), max_args=2, max_arg_bytes=1024),
                         "hr_test_get": FunctionGrant((STATS,), max_args=1, max_arg_bytes=64)})


@dataclass
class Env:
    admin: redis.Redis
    sampler_url: str
    gate: RedisGate
    users: Path
    password: str

    def client(self, password: str | None = None, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.gate.url("vol1", password or self.password), decode_responses=True,
                                    socket_timeout=10, **kwargs)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("gate-stack")
    state = start_stack(data_dir, kafka_storage="memory")
    try:
        admin = redis.Redis.from_url(stack_services(state).redis_url, protocol=2, decode_responses=True)
        admin.function_load(LIBRARY, replace=True)
        for run in ("run1", "run2"):
            prefix = f"heterorl:{run}:"
            admin.hset(prefix + "policy", mapping={"version": 3, "manifest_key": f"{run}/v3.json"})
            admin.hset(prefix + "claims", mapping={str(i): f"{run}-s{i % 4}" for i in range(50)})
            admin.rpush(prefix + "reissue", 7, 8, 9)
            admin.zadd(prefix + "samplers_seen", {"s0": 1.0, "s1": 2.0})
            admin.xadd(prefix + "join_requests", {"who": "s9"})
            admin.set(prefix + "prompt_cursor", 50)
        users = data_dir / "gate-users.json"
        password = new_password()
        add_user(users, "vol1", password, GRANT)
        gate = RedisGate(("127.0.0.1", 0), stack_services(state, "sampler").redis_url, users).start()
        try:
            yield Env(admin, stack_services(state, "sampler").redis_url, gate, users, password)
        finally:
            gate.stop()
            admin.close()
    finally:
        stop_stack(data_dir, wipe=True)


def _snapshot(admin: redis.Redis) -> dict:
    """Every key with its type and value, and the function libraries: what "nothing changed" means."""
    out = {}
    for key in sorted(admin.keys("*")):
        kind = admin.type(key)
        value = {"string": admin.get, "hash": admin.hgetall, "list": lambda k: admin.lrange(k, 0, -1),
                 "zset": lambda k: admin.zrange(k, 0, -1, withscores=True), "set": admin.smembers,
                 "stream": admin.xrange}[kind](key)
        out[key] = (kind, value)
    out["<functions>"] = admin.function_list(withcode=True)  # RESP2: nested lists, compared whole
    return out


def test_wrong_credentials_raise_authentication_error(env):
    # redis-py's default (no protocol given) tries HELLO 3, gets NOPROTO, falls back to AUTH over RESP2.
    for kwargs in ({"protocol": 2}, {}):
        with pytest.raises(redis.AuthenticationError):
            env.client(password="x" * 40, **kwargs).ping()
    with pytest.raises(redis.ResponseError, match="NOPROTO"):  # RESP3 asked for explicitly: no fallback
        env.client(protocol=3).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(env.gate.url("nobody", env.password)).ping()


def test_a_plain_from_url_client_works(env):
    client = redis.Redis.from_url(env.gate.url("vol1", env.password))  # default protocol, bytes
    assert client.ping() is True
    assert client.hgetall("heterorl:run1:policy") == {b"version": b"3", b"manifest_key": b"run1/v3.json"}
    client.close()


def test_reads_of_the_granted_run_work(env):
    client = env.client(protocol=2)
    admin = env.admin
    assert client.hgetall("heterorl:run1:policy") == admin.hgetall("heterorl:run1:policy")
    assert client.hget("heterorl:run1:policy", "version") == "3"
    assert client.hmget("heterorl:run1:policy", ["version", "nope"]) == ["3", None]
    assert client.get("heterorl:run1:prompt_cursor") == "50"
    assert client.mget(["heterorl:run1:prompt_cursor", "heterorl:run1:meta"]) == ["50", None]
    assert client.exists("heterorl:run1:policy", "heterorl:run1:meta") == 1
    assert client.type("heterorl:run1:claims") == "hash"
    assert client.hlen("heterorl:run1:claims") == 50 and client.hexists("heterorl:run1:claims", "7")
    assert dict(client.hscan_iter("heterorl:run1:claims", count=1000)) == admin.hgetall("heterorl:run1:claims")
    assert client.llen("heterorl:run1:reissue") == 3
    assert client.lrange("heterorl:run1:reissue", 0, -1) == ["7", "8", "9"]
    assert client.zrange("heterorl:run1:samplers_seen", 0, -1, withscores=True) == [("s0", 1.0), ("s1", 2.0)]
    assert client.zrangebyscore("heterorl:run1:samplers_seen", 1.5, "+inf") == ["s1"]
    assert client.zscore("heterorl:run1:samplers_seen", "s1") == 2.0
    assert client.zcard("heterorl:run1:samplers_seen") == 2
    assert client.xlen("heterorl:run1:join_requests") == 1
    assert client.xrange("heterorl:run1:join_requests")[0][1] == {"who": "s9"}
    assert client.xrevrange("heterorl:run1:join_requests")[0][1] == {"who": "s9"}
    assert client.echo("hi") == "hi" and len(client.time()) == 2
    client.close()


def test_reads_of_another_run_are_refused(env):
    client = env.client(protocol=2)
    for read in (lambda: client.hgetall("heterorl:run2:policy"), lambda: client.get("heterorl:run2:prompt_cursor"),
                 lambda: client.mget(["heterorl:run1:prompt_cursor", "heterorl:run2:prompt_cursor"]),
                 lambda: client.exists("heterorl:run1:policy", "heterorl:run2:policy"),
                 lambda: client.hscan("heterorl:run1:claims", 0, match="*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            read()
    assert client.hget("heterorl:run1:policy", "version") == "3"  # the connection stays open
    client.close()


def test_fcall_of_the_granted_function_writes_through_the_gate(env):
    client = env.client(protocol=2)
    assert client.fcall("hr_test_set", 1, STATS, "s1", '{"groups": 4}') == 1
    assert env.admin.hget(STATS, "s1") == '{"groups": 4}'
    assert client.fcall_ro("hr_test_get", 1, STATS, "s1") == '{"groups": 4}'
    client.close()


def test_fcall_outside_the_grant_is_refused(env):
    client = env.client(protocol=2)
    before = _snapshot(env.admin)
    for call in (lambda: client.fcall("hr_test_set", 1, "heterorl:run2:sampler_stats", "s1", "x"),
                 lambda: client.fcall("hr_test_set", 1, "heterorl:run1:claims", "0", "mine"),
                 lambda: client.fcall("hr_test_set", 1, STATS, "s1", "x" * 1025),
                 lambda: client.fcall("hr_test_set", 1, STATS, "s1", "x", "extra"),
                 lambda: client.fcall("hr_test_set", 0, "s1", "x"),
                 lambda: client.fcall("hr_unknown", 1, STATS, "s1", "x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    assert _snapshot(env.admin) == before
    refused = env.gate.stats()["refused"]["vol1"]
    assert refused["function_keys"] >= 3 and refused["function_args"] >= 2 and refused["function"] >= 1
    client.close()


@pytest.mark.parametrize("command", [
    ("HSET", "heterorl:run1:sampler:s1", "host", "evil"), ("RPUSH", "heterorl:run1:reissue", "garbage"),
    ("DEL", "heterorl:run1:policy"), ("SET", "heterorl:run1:meta", "x" * 1000), ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"), ("SCRIPT", "LOAD", "while true do end"),
    ("FUNCTION", "FLUSH"), ("FUNCTION", "DELETE", "hr_gate_test"), ("CONFIG", "GET", "*"), ("KEYS", "*"),
    ("FLUSHALL",), ("SCAN", "0"), ("MULTI",), ("SELECT", "1"), ("CLIENT", "LIST"), ("ACL", "WHOAMI"),
    ("DEBUG", "SLEEP", "5"), ("INCRBY", "heterorl:run1:prompt_cursor", "1000"),
])
def test_everything_else_is_refused_and_changes_nothing(env, command):
    client = env.client(protocol=2)
    before = _snapshot(env.admin)
    with pytest.raises(redis.exceptions.NoPermissionError, match="this user may not run"):
        client.execute_command(*command)
    assert _snapshot(env.admin) == before
    assert client.ping() is True  # refused, not disconnected
    client.close()


def test_a_pipeline_of_50_reads_answers_in_order(env):
    client = env.client(protocol=2)
    pipe = client.pipeline(transaction=False)
    for i in range(50):
        pipe.hget("heterorl:run1:claims", str(i))
    assert pipe.execute() == [f"run1-s{i % 4}" for i in range(50)]
    # The gate's own refusals keep their place between forwarded replies.
    pipe = client.pipeline(transaction=False)
    pipe.get("heterorl:run1:prompt_cursor").get("heterorl:run2:prompt_cursor").execute_command("EVAL", "return 1", 0)
    pipe.hget("heterorl:run1:policy", "version")
    first, second, third, fourth = pipe.execute(raise_on_error=False)
    assert first == "50" and fourth == "3"
    assert isinstance(second, redis.exceptions.NoPermissionError)
    assert isinstance(third, redis.exceptions.NoPermissionError)
    client.close()


def test_a_10_mb_request_closes_its_connection_only(env):
    other = env.client(protocol=2)
    assert other.hget("heterorl:run1:policy", "version") == "3"
    before = _snapshot(env.admin)
    big = env.client(protocol=2)
    assert big.ping() is True
    with pytest.raises((redis.ConnectionError, redis.ResponseError)):
        big.fcall("hr_test_set", 1, STATS, "s1", "x" * (10 * 1024 * 1024))
    # On a bare socket: the header alone is answered, the 10 MB are never awaited.
    host, port = env.gate.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_request(["AUTH", "vol1", env.password]))
        assert sock.recv(100) == b"+OK\r\n"
        sock.sendall(b"*6\r\n$5\r\nFCALL\r\n$11\r\nhr_test_set\r\n$1\r\n1\r\n$%d\r\n%s\r\n$2\r\ns1\r\n$10485760\r\nxxxx"
                     % (len(STATS), STATS.encode()))
        parser, data = ReplyParser(), b""
        while (reply := parser.next_reply()) is None:
            data = sock.recv(65536)
            assert data, "closed before the error reply"
            parser.feed(data)
        assert reply.startswith(b"-ERR request of at least")
        assert sock.recv(100) == b""  # and closed
    assert other.hget("heterorl:run1:policy", "version") == "3"  # the other client never noticed
    assert _snapshot(env.admin) == before
    assert env.gate.stats()["refused"]["vol1"]["too_large"] >= 2
    big.close()
    other.close()


def test_latency_of_hget_through_the_gate_and_directly(env, capsys):
    """A report, not a timed assertion: 1,000 sequential HGETs each way, same machine, same run."""
    direct = redis.Redis.from_url(env.sampler_url, protocol=2, decode_responses=True)
    gated = env.client(protocol=2)
    results = {}
    for name, client in (("direct", direct), ("gate", gated), ("direct again", direct), ("gate again", gated)):
        client.hget("heterorl:run1:policy", "version")  # connected before timing
        samples = []
        for _ in range(1000):
            t0 = time.perf_counter()
            assert client.hget("heterorl:run1:policy", "version") == "3"
            samples.append(time.perf_counter() - t0)
        samples.sort()
        results[name] = (sum(samples) * 1e3, samples[500] * 1e6, samples[990] * 1e6)
    with capsys.disabled():
        print("\n1,000 HGETs        total ms   median us   p99 us")
        for name, (total, median, p99) in results.items():
            print(f"  {name:<16} {total:8.1f}   {median:9.1f}   {p99:6.1f}")
    direct.close()
    gated.close()


def test_removing_the_user_closes_its_connections_and_refuses_new_auth(env):
    client = env.client(protocol=2)
    assert client.ping() is True
    host, port = env.gate.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        sock.sendall(encode_request(["AUTH", "vol1", env.password]) + encode_request(["PING"]))
        received = b""
        while received != b"+OK\r\n+PONG\r\n":
            received += sock.recv(100)
        # A user added now may log in at once (the file is re-read at each AUTH).
        password2 = new_password()
        add_user(env.users, "vol2", password2, Grant(read_keys=("heterorl:run1:policy",)))
        vol2 = redis.Redis.from_url(env.gate.url("vol2", password2), protocol=2, decode_responses=True)
        assert vol2.hget("heterorl:run1:policy", "version") == "3"

        assert remove_user(env.users, "vol1")
        removed_at = time.monotonic()
        sock.settimeout(3.0)
        assert sock.recv(100) == b""
        assert time.monotonic() - removed_at < 2.0
    finally:
        sock.close()
    with pytest.raises((redis.AuthenticationError, redis.ConnectionError)):
        client.ping()  # its connection is gone; a reconnect's AUTH is refused
    with pytest.raises(redis.AuthenticationError):
        env.client(protocol=2).ping()
    assert vol2.ping() is True  # other users keep their connections
    stats = env.gate.stats()
    assert stats["revoked_connections"] >= 2 and stats["forwarded"]["vol2"] >= 1
    vol2.close()


def test_a_user_names_no_more_keys_calls_or_connections_than_its_grant_and_the_gate_allow(env, tmp_path):
    """`max_distinct`: an invite's user may hold as many sampler leases as the invite admits samplers,
    so a stranger cannot make up sampler ids by the thousand (each holding claims); `max_calls`: it
    cannot flood a stream (join requests) with calls; and it holds at most `max_user_connections`
    connections, while at most `max_unauthenticated` wait for a login (each costs the gate memory)."""
    users = tmp_path / "limited-users.json"
    password = new_password()
    add_user(users, "two-ids", password, Grant(
        read_keys=("heterorl:run1:*",),
        functions={"hr_test_set": FunctionGrant(keys=("heterorl:run1:*",), max_args=2, max_arg_bytes=64),
                   "hr_test_get": FunctionGrant(keys=("heterorl:run1:*",), max_args=1, max_calls=3)},
        max_distinct={"heterorl:run1:sampler:*": 2}))
    gate = RedisGate(listen=("127.0.0.1", 0), upstream_url=env.sampler_url, users_file=users,
                     max_user_connections=2, max_unauthenticated=1).start()
    try:
        client = redis.Redis.from_url(gate.url("two-ids", password), protocol=2)
        for n in (1, 2, 1, 2):
            client.fcall("hr_test_set", 1, f"heterorl:run1:sampler:s{n}", "f", "v")
        with pytest.raises(redis.ResponseError, match="at most 2 keys like"):
            client.fcall("hr_test_set", 1, "heterorl:run1:sampler:s3", "f", "v")
        client.fcall("hr_test_set", 1, "heterorl:run1:sampler_stats", "f", "v")  # other keys are not counted
        assert [client.fcall("hr_test_get", 1, "heterorl:run1:sampler_stats", "f") for _ in range(3)] == [b"v"] * 3
        with pytest.raises(redis.ResponseError, match="may call 'hr_test_get' at most 3 times"):
            client.fcall("hr_test_get", 1, "heterorl:run1:sampler_stats", "f")
        second = redis.Redis.from_url(gate.url("two-ids", password), protocol=2)
        assert second.ping()
        with pytest.raises(redis.ResponseError, match="holds 2 connections already"):
            redis.Redis.from_url(gate.url("two-ids", password), protocol=2).ping()
        host, port = gate.address.rsplit(":", 1)
        waiting = socket.create_connection((host, int(port)), timeout=5)  # connected, never logs in
        time.sleep(0.2)
        late = socket.create_connection((host, int(port)), timeout=5)
        assert b"max number of clients" in late.recv(200)
        late.close()
        waiting.close()
        second.close()
        client.close()
        refused = gate.stats()["refused"]
        assert refused["two-ids"]["max_user_connections"] == 1 and refused["two-ids"]["max_calls"] == 1
    finally:
        gate.stop()
