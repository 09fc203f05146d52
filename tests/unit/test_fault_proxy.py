"""infra.fault_proxy against a local echo server: every fault, its stats, and the CLI.

No external servers: each test talks to a threaded echo server on loopback through a
proxy started in the same process. Timing assertions use tolerant bounds (a lower
bound where the fault must slow things down, a generous upper one where it must not).
"""

from __future__ import annotations

import os
import random
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.fault_proxy import (
    FaultProxy,
    FaultProxyError,
    FaultSchedule,
    FaultSpec,
    Route,
    connection_rng,
    draw_reset_delay,
    main,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
IO_TIMEOUT_S = 5.0


class _EchoHandler(socketserver.BaseRequestHandler):
    """Echo until the client half-closes, then half-close back (exercises EOF passing)."""

    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.request.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the proxy reset us: expected in the reset tests


@pytest.fixture
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def make_proxy(echo_port):
    """Start a proxy with one route "echo" in front of the echo server; stopped at teardown."""
    started: list[FaultProxy] = []

    def start(spec: FaultSpec = FaultSpec(), seed: int = 0) -> FaultProxy:
        proxy = FaultProxy([Route("echo", 0, "127.0.0.1", echo_port)], spec, seed=seed).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


def _connect(proxy: FaultProxy, timeout_s: float = IO_TIMEOUT_S) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port("echo")), timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    parts, received = [], 0
    while received < nbytes:
        data = sock.recv(min(65536, nbytes - received))
        if not data:
            raise EOFError(f"closed after {received} of {nbytes} bytes")
        parts.append(data)
        received += len(data)
    return b"".join(parts)


def _round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    return _recv_exactly(sock, len(payload))


def _echo_all(proxy: FaultProxy, payload: bytes) -> bytes:
    """Send payload while reading concurrently (so TCP buffers cannot deadlock), then EOF."""
    with _connect(proxy, timeout_s=30) as sock:
        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        parts = []
        while data := sock.recv(65536):
            parts.append(data)
        sender.join()
    return b"".join(parts)


def _wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _assert_reset(sock: socket.socket) -> None:
    """The proxy closes with SO_LINGER 0, so the client must see an RST, not a clean EOF."""
    with pytest.raises(ConnectionResetError):
        sock.recv(1) or sock.send(b"x")  # EOF would return b"" and fall through to send


# ------------------------------------------------------------------ pass-through


def test_pass_through_concurrent_connections(make_proxy):
    proxy = make_proxy()
    payloads = [os.urandom(1000 * (i + 1)) for i in range(8)]
    results: dict[int, bytes] = {}

    def client(i: int) -> None:
        with _connect(proxy) as sock:
            results[i] = _round_trip(sock, payloads[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(payloads))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(IO_TIMEOUT_S)
    assert [results.get(i) for i in range(len(payloads))] == payloads
    total = sum(map(len, payloads))
    assert _wait_until(lambda: proxy.stats()["echo"]["open_connections"] == 0)
    stats = proxy.stats()["echo"]
    assert stats["connections_accepted"] == len(payloads)
    assert stats["bytes_up"] == stats["bytes_down"] == total
    assert stats["connections_reset"] == 0


def test_large_payload_intact_and_in_order_with_jitter(make_proxy):
    proxy = make_proxy(FaultSpec(latency_ms=2, jitter_ms=10), seed=3)
    payload = random.Random(1).randbytes(1024 * 1024)
    assert _echo_all(proxy, payload) == payload  # also: EOF crossed the proxy both ways


def test_upstream_down_client_sees_reset(unused_port):
    proxy = FaultProxy([Route("dead", 0, "127.0.0.1", unused_port)]).start()
    try:
        # On loopback the RST can arrive before connect() returns, so it may surface there.
        with pytest.raises(ConnectionResetError):
            with socket.create_connection(("127.0.0.1", proxy.port("dead")), timeout=IO_TIMEOUT_S) as sock:
                sock.recv(1)
        assert proxy.stats()["dead"]["upstream_connect_failures"] == 1
    finally:
        proxy.stop()


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------- latency, bandwidth


def test_latency_applies_in_both_directions(make_proxy):
    proxy = make_proxy()
    with _connect(proxy) as sock:
        _round_trip(sock, b"warm-up")
        started = time.monotonic()
        _round_trip(sock, b"ping")
        fast_s = time.monotonic() - started

        proxy.set_spec(FaultSpec(latency_ms=100))  # live change, same connection
        started = time.monotonic()
        _round_trip(sock, b"ping")
        slow_s = time.monotonic() - started
    assert fast_s < 0.1
    assert 0.19 <= slow_s < 1.0


def test_bandwidth_cap(make_proxy):
    proxy = make_proxy(FaultSpec(bandwidth_bytes_per_s=100_000))
    payload = os.urandom(200_000)
    started = time.monotonic()
    assert _echo_all(proxy, payload) == payload
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 6.0


# ------------------------------------------------------------------------ resets


def test_reset_all_aborts_open_connections(make_proxy):
    proxy = make_proxy()
    sockets = [_connect(proxy) for _ in range(3)]
    for sock in sockets:
        assert _round_trip(sock, b"hello") == b"hello"
    assert proxy.reset_all() == 3
    for sock in sockets:
        _assert_reset(sock)
        sock.close()
    stats = proxy.stats()["echo"]
    assert stats["connections_reset"] == 3
    assert stats["open_connections"] == 0
    with _connect(proxy) as sock:  # the proxy itself keeps working
        assert _round_trip(sock, b"again") == b"again"


def test_random_resets_kill_connections_and_are_counted(make_proxy):
    proxy = make_proxy(FaultSpec(reset_probability_per_s=20.0), seed=7)  # mean life 50 ms
    sockets = [_connect(proxy) for _ in range(5)]
    assert _wait_until(lambda: proxy.stats()["echo"]["connections_reset"] == 5, timeout_s=5)
    for sock in sockets:
        _assert_reset(sock)
        sock.close()
    assert proxy.stats()["echo"]["open_connections"] == 0


# ---------------------------------------------------------------------- blackhole


def test_blackhole_window_times_out_then_recovers(make_proxy):
    proxy = make_proxy()
    busy, idle = _connect(proxy), _connect(proxy)
    for sock in (busy, idle):
        assert _round_trip(sock, b"before") == b"before"

    window_s = 1.0
    proxy.blackhole(window_s)
    window_end = time.monotonic() + window_s
    busy.settimeout(0.3)
    busy.sendall(b"lost")
    with pytest.raises(socket.timeout):  # a timeout, not a reset: nothing is closed
        busy.recv(10)
    fresh = _connect(proxy)  # the handshake completes, but the connection hangs
    fresh.settimeout(0.3)
    fresh.sendall(b"also lost")
    with pytest.raises(socket.timeout):
        fresh.recv(10)
    assert proxy.stats()["echo"]["open_connections"] == 3

    time.sleep(max(0.0, window_end - time.monotonic()) + 0.1)
    with _connect(proxy) as after:
        assert _round_trip(after, b"after") == b"after"
    assert _round_trip(idle, b"idle survives") == b"idle survives"
    # Connections that lost bytes carry a corrupt stream: reset when the window ended.
    for sock in (busy, fresh):
        sock.settimeout(IO_TIMEOUT_S)
        _assert_reset(sock)
        sock.close()
    idle.close()
    stats = proxy.stats()["echo"]
    assert stats["blackholed_windows"] == 1
    assert stats["connections_reset"] == stats["connections_reset_after_blackhole"] == 2
    assert stats["bytes_dropped"] == len(b"lost") + len(b"also lost")


def test_overlapping_blackhole_windows_merge(make_proxy):
    proxy = make_proxy()
    proxy.blackhole(0.2)
    proxy.blackhole(1.0)  # the short window's end must not reopen the route early
    started = time.monotonic()
    time.sleep(0.35)
    with _connect(proxy) as sock:
        sock.settimeout(0.3)
        sock.sendall(b"x")
        with pytest.raises(socket.timeout):
            sock.recv(1)
    assert time.monotonic() - started < 1.0
    time.sleep(max(0.0, started + 1.1 - time.monotonic()))
    with _connect(proxy) as sock:
        assert _round_trip(sock, b"open again") == b"open again"
    assert proxy.stats()["echo"]["blackholed_windows"] == 2


def test_new_connection_during_blackhole_works_after_it_if_it_sent_nothing(make_proxy):
    proxy = make_proxy(FaultSpec(blackhole=True))
    with _connect(proxy) as sock:
        time.sleep(0.1)
        proxy.set_spec(FaultSpec())
        assert _round_trip(sock, b"late but fine") == b"late but fine"
    assert proxy.stats()["echo"]["blackholed_windows"] == 1


def test_schedule_applies_actions_in_the_background(make_proxy):
    proxy = make_proxy()
    with _connect(proxy) as sock:
        assert _round_trip(sock, b"x") == b"x"
        schedule = (FaultSchedule()
                    .reset_all(0.05)
                    .blackhole(0.1, 0.2)
                    .set_spec(0.4, FaultSpec(latency_ms=30)))
        proxy.run_schedule(schedule).result(timeout=5)
        _assert_reset(sock)
    stats = proxy.stats()["echo"]
    assert stats["connections_reset"] == 1
    assert stats["blackholed_windows"] == 1
    assert proxy.spec("echo") == FaultSpec(latency_ms=30)


# ------------------------------------------------------------- seeded draws, spec


def _reset_delays(seed: int, connection: int, n: int = 20, rate: float = 0.5) -> list[float]:
    rng = connection_rng(seed, "kafka", connection, "reset")
    return [draw_reset_delay(rng, rate) for _ in range(n)]


def test_reset_draws_are_reproducible_per_seed_and_connection():
    assert _reset_delays(seed=0, connection=0) == _reset_delays(seed=0, connection=0)
    assert _reset_delays(seed=0, connection=0) != _reset_delays(seed=1, connection=0)
    assert _reset_delays(seed=0, connection=0) != _reset_delays(seed=0, connection=1)
    many = _reset_delays(seed=5, connection=0, n=20_000, rate=0.5)
    assert 1.9 < sum(many) / len(many) < 2.1  # exponential with mean 1/rate
    assert draw_reset_delay(random.Random(0), 0.0) == float("inf")


def test_random_schedule_is_a_function_of_its_seed():
    def draw(seed: int) -> FaultSchedule:
        return FaultSchedule.random(seed, duration_s=600, blackholes_per_min=0.5,
                                    blackhole_s=(5, 30), resets_per_min=1)

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    actions = list(draw(3))
    assert actions and [a.at_s for a in actions] == sorted(a.at_s for a in actions)
    assert {a.action for a in actions} == {"blackhole", "reset_all"}
    assert all(5 <= a.duration_s <= 30 for a in actions if a.action == "blackhole")


def test_spec_and_route_validation():
    with pytest.raises(ValueError):
        FaultSpec(latency_ms=-1)
    with pytest.raises(ValueError):
        FaultSpec(bandwidth_bytes_per_s=0)
    assert Route.parse("kafka:19092:127.0.0.1:9092") == Route("kafka", 19092, "127.0.0.1", 9092)
    assert Route.parse("r:0:[::1]:6379").target_host == "::1"
    for bad in ("kafka", "kafka:1:host", "kafka:x:host:1", "kafka:1:host:70000", ":1:host:2"):
        with pytest.raises(ValueError):
            Route.parse(bad)
    proxy = FaultProxy([Route("a", 0, "127.0.0.1", 1)])
    with pytest.raises(FaultProxyError):
        proxy.blackhole(1.0)  # not started
    with pytest.raises(FaultProxyError):
        proxy.set_spec(FaultSpec(), routes=["nope"])


# --------------------------------------------------------------------------- CLI


def _cli(*args: str, timeout_s: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.fault_proxy", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def test_cli_help_mentions_every_option():
    result = _cli("--help")
    assert result.returncode == 0
    for option in ("--route", "--latency-ms", "--jitter-ms", "--bandwidth-kbps", "--reset-per-min",
                   "--blackhole-at", "--blackhole-for", "--seed", "--duration"):
        assert option in result.stdout


def test_cli_bad_route_is_one_line_and_exit_2():
    result = _cli("--route", "kafka:19092:localhost")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "bad route" in result.stderr and "Traceback" not in result.stderr


def test_cli_port_in_use_is_one_line_and_exit_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["--route", f"redis:{port}:127.0.0.1:6379"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "address already in use" in err


def test_cli_runs_for_a_duration_and_prints_addresses_and_stats(echo_port, capsys):
    assert main(["--route", f"echo:0:127.0.0.1:{echo_port}", "--latency-ms", "5",
                 "--blackhole-at", "0.1", "--blackhole-for", "0.1", "--duration", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "echo: 127.0.0.1:" in out and f"-> 127.0.0.1:{echo_port}" in out
    assert '"blackholed_windows": 1' in out
