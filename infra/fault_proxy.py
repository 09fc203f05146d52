"""TCP fault-injection proxy: make a loopback link behave like an unreliable WAN.

Samplers reach the broker, Redis and S3 through this proxy instead of directly, and
the proxy injects the faults a far-away sampler meets on a real wide-area link:

=====================  ===============================================================
fault                  what the proxy does
=====================  ===============================================================
latency + jitter       hold every chunk ``latency_ms + U(0, jitter_ms)`` per direction;
                       a FIFO per direction, so bytes are never reordered
bandwidth              token bucket per connection and direction (bytes/s)
resets                 abort each connection (RST: SO_LINGER 0) after an exponential
                       lifetime with rate ``reset_probability_per_s``
blackhole (partition)  accept connections but forward nothing either way; bytes that
                       arrive are dropped, nothing is closed, new connections hang
=====================  ===============================================================

Usage from Python (the proxy runs its own event loop in a daemon thread, every control
call is thread-safe and synchronous)::

    proxy = FaultProxy([Route("redis", 0, "127.0.0.1", 6379)], FaultSpec(latency_ms=50))
    proxy.start()
    client = redis.Redis.from_url(f"redis://{proxy.address('redis')}/0")
    proxy.blackhole(30)                          # a 30 s partition, starting now
    proxy.set_spec(FaultSpec(reset_probability_per_s=1 / 60), routes=["redis"])
    proxy.run_schedule(FaultSchedule().blackhole(60, 30).reset_all(120))
    print(proxy.stats()); proxy.stop()

and from the shell: ``python -m infra.fault_proxy --help`` (see ``docs/faults.md``).

Protocol caveats - which services work through a plain TCP proxy:

* **Redis, S3 (HTTP)**: yes. The client only ever connects to the address it was given,
  so pointing ``REDIS_URL`` / the S3 endpoint at the proxy routes all traffic through it.
* **Kafka: only if the broker advertises the proxy's address.** A Kafka client uses the
  bootstrap address just for its first metadata request; the metadata lists every
  broker's *advertised* listener, and the client opens all further connections (produce,
  fetch, ...) to those addresses directly. If the broker advertises its own port, the
  client bypasses the proxy after the first request and no fault reaches it. So start
  the broker with its advertised listener set to the proxy's port, e.g. Tansu with
  ``--listener-url tcp://127.0.0.1:9092 --advertised-listener-url
  tcp://127.0.0.1:19092`` and the route ``kafka:19092:127.0.0.1:9092`` (the proxy port
  must then be fixed in advance, not 0). One proxy route per broker.

Design decisions worth knowing:

* **A blackhole drops, it does not buffer** (a partition longer than a TCP retransmission
  budget, as the brief asks). A connection that lost bytes, in either direction, carries
  a corrupted byte stream afterwards (a request without its reply, half a frame), so when
  the window ends the proxy resets exactly those connections; connections that were idle
  through the window carry on untouched. Nothing is closed *during* the window: clients
  see read timeouts, not resets, as on a real partition. Random resets are suppressed
  while a route is blackholed for the same reason (a RST would not cross a partition);
  ``reset_all`` is an explicit command and always acts.
* **New connections during a blackhole** are accepted (the kernel completes the
  handshake anyway) but the proxy connects upstream only when the window ends, so they
  hang; if their client sent nothing meanwhile they then work normally.
* **Latency is applied to data, not to the TCP handshake**: the upstream connect starts
  at once and overlaps with the first chunk's delay.
* **Reproducibility**: each connection draws its reset lifetime and jitter from its own
  ``random.Random`` seeded by (seed, route name, connection number, purpose), see
  :func:`connection_rng`; the draw sequence does not depend on traffic or on other
  connections. Wall-clock timing of course still varies.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import math
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence, TypeVar

from pipeline.errors import UserError

log = logging.getLogger(__name__)

LISTEN_HOST = "127.0.0.1"
READ_CHUNK = 64 * 1024
# Bytes a direction may hold in its delay line before it stops reading its source: this
# pushes back through TCP flow control instead of growing memory without bound. Like a
# TCP window it caps throughput at 4 MiB per one-way delay (measured: ~490 MiB/s with no
# faults, ~60 MiB/s at 50 ms + 20 ms jitter), far above the WAN links being simulated.
DELAY_LINE_MAX_BYTES = 4 * 1024 * 1024
# Token bucket: burst allowance in seconds of traffic, and write granularity so a
# throttled stream trickles out smoothly rather than in large bursts.
BANDWIDTH_BURST_S = 0.1
BANDWIDTH_SLICE_S = 0.02
CONTROL_TIMEOUT_S = 10.0
STAT_KEYS = (
    "connections_accepted",
    "connections_reset",
    "connections_reset_after_blackhole",
    "bytes_up",
    "bytes_down",
    "bytes_dropped",
    "blackholed_windows",
    "upstream_connect_failures",
    "open_connections",
)

T = TypeVar("T")


class FaultProxyError(UserError, RuntimeError):
    """A proxy that cannot start or be controlled (port in use, unknown route, ...)."""


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class FaultSpec:
    """The faults applied to one route; every default means "no fault"."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: Optional[float] = None
    reset_probability_per_s: float = 0.0
    blackhole: bool = False

    def __post_init__(self) -> None:
        for name in ("latency_ms", "jitter_ms", "reset_probability_per_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"FaultSpec.{name} must be a finite number >= 0, got {value!r}")
        rate = self.bandwidth_bytes_per_s
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"FaultSpec.bandwidth_bytes_per_s must be > 0 or None, got {rate!r}")


@dataclass(frozen=True)
class Route:
    """Listen on 127.0.0.1:listen_port (0 = any free port) and forward to target."""

    name: str
    listen_port: int
    target_host: str
    target_port: int

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ValueError(f"route name must be letters, digits, '_', '-' or '.', got {self.name!r}")
        for label, port in (("listen_port", self.listen_port), ("target_port", self.target_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"route {self.name}: {label} must be 0..65535, got {port}")
        if self.target_port == 0:
            raise ValueError(f"route {self.name}: target_port must not be 0")
        if not self.target_host:
            raise ValueError(f"route {self.name}: target_host is empty")

    @classmethod
    def parse(cls, text: str) -> "Route":
        """Parse ``NAME:LISTEN_PORT:TARGET_HOST:TARGET_PORT`` (host may be ``[ipv6]``)."""
        parts = text.split(":", 2)
        if len(parts) != 3 or ":" not in parts[2]:
            raise ValueError(f"bad route {text!r}: expected NAME:LISTEN_PORT:TARGET_HOST:TARGET_PORT")
        name, listen, rest = parts
        host, target = rest.rsplit(":", 1)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            listen_port, target_port = int(listen), int(target)
        except ValueError:
            raise ValueError(f"bad route {text!r}: ports must be integers") from None
        try:
            return cls(name, listen_port, host, target_port)
        except ValueError as exc:
            raise ValueError(f"bad route {text!r}: {exc}") from None


# ------------------------------------------------------------------ seeded draws


def connection_rng(seed: int, route_name: str, connection_number: int, purpose: str) -> random.Random:
    """The random stream of one connection for one purpose ("reset", "jitter-up", ...).

    Why separate streams: a connection's reset lifetime must not depend on how many
    chunks it carried (each jitter draw would shift it) or on other connections, so a
    seeded run resets the n-th connection of a route after the same draws every time.
    """
    return random.Random(f"{seed}/{route_name}/{connection_number}/{purpose}")


def draw_reset_delay(rng: random.Random, reset_probability_per_s: float) -> float:
    """Seconds until the next reset of a connection: exponential with the given rate.

    A constant hazard rate means a connection's remaining life does not depend on its
    age, so the delay can simply be redrawn whenever the rate changes. Rate 0 -> inf.
    """
    if reset_probability_per_s <= 0:
        return math.inf
    return rng.expovariate(reset_probability_per_s)


def draw_jitter_s(rng: random.Random, jitter_ms: float) -> float:
    """Extra one-way delay for one chunk: uniform in [0, jitter_ms]."""
    return rng.uniform(0.0, jitter_ms) / 1000.0 if jitter_ms > 0 else 0.0


# --------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class ScheduledAction:
    """One entry of a FaultSchedule: do ``action`` ``at_s`` seconds after the start."""

    at_s: float
    action: str  # "set_spec" | "blackhole" | "reset_all"
    spec: Optional[FaultSpec] = None
    duration_s: float = 0.0
    routes: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.action not in ("set_spec", "blackhole", "reset_all"):
            raise ValueError(f"unknown schedule action {self.action!r}")
        if not self.at_s >= 0:
            raise ValueError(f"schedule time must be >= 0, got {self.at_s!r}")
        if self.action == "set_spec" and self.spec is None:
            raise ValueError("a set_spec action needs a spec")
        if self.action == "blackhole" and not self.duration_s > 0:
            raise ValueError(f"a blackhole needs a duration > 0, got {self.duration_s!r}")


def _route_tuple(routes: Optional[Iterable[str]]) -> Optional[tuple[str, ...]]:
    if isinstance(routes, str):
        return (routes,)
    return None if routes is None else tuple(routes)


@dataclass
class FaultSchedule:
    """A timed list of fault actions, applied by ``FaultProxy.run_schedule``.

    Build it explicitly (the builder methods return the schedule, so calls chain)::

        FaultSchedule().blackhole(60, 30).set_spec(120, FaultSpec(latency_ms=200))

    or draw a random one with :meth:`random`, which is a pure function of its seed.
    """

    actions: list[ScheduledAction] = field(default_factory=list)

    def _add(self, action: ScheduledAction) -> "FaultSchedule":
        self.actions.append(action)
        self.actions.sort(key=lambda a: a.at_s)  # stable: same-time actions keep their order
        return self

    def set_spec(self, at_s: float, spec: FaultSpec, routes: Optional[Iterable[str]] = None) -> "FaultSchedule":
        return self._add(ScheduledAction(at_s, "set_spec", spec=spec, routes=_route_tuple(routes)))

    def blackhole(self, at_s: float, duration_s: float, routes: Optional[Iterable[str]] = None) -> "FaultSchedule":
        return self._add(ScheduledAction(at_s, "blackhole", duration_s=duration_s, routes=_route_tuple(routes)))

    def reset_all(self, at_s: float, routes: Optional[Iterable[str]] = None) -> "FaultSchedule":
        return self._add(ScheduledAction(at_s, "reset_all", routes=_route_tuple(routes)))

    def __iter__(self) -> Iterator[ScheduledAction]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    @classmethod
    def random(
        cls,
        seed: int,
        duration_s: float,
        *,
        blackholes_per_min: float = 0.0,
        blackhole_s: tuple[float, float] = (5.0, 30.0),
        resets_per_min: float = 0.0,
        routes: Optional[Iterable[str]] = None,
    ) -> "FaultSchedule":
        """Poisson-timed partitions (uniform length in ``blackhole_s``) and reset_alls.

        Why a pure function of the seed: a chaos run that found a bug can be replayed
        with the very same fault timeline.
        """
        rng = random.Random(f"schedule/{seed}")
        schedule = cls()
        shortest, longest = blackhole_s
        for at_s in _poisson_times(rng, blackholes_per_min / 60.0, duration_s):
            schedule.blackhole(at_s, rng.uniform(shortest, longest), routes)
        for at_s in _poisson_times(rng, resets_per_min / 60.0, duration_s):
            schedule.reset_all(at_s, routes)
        return schedule


def _poisson_times(rng: random.Random, rate_per_s: float, duration_s: float) -> list[float]:
    times: list[float] = []
    now = draw_reset_delay(rng, rate_per_s)
    while now < duration_s:
        times.append(round(now, 6))
        now += draw_reset_delay(rng, rate_per_s)
    return times


# ------------------------------------------------------------ per-connection parts


@dataclass
class _Chunk:
    data: bytes  # b"" = end of stream (the source half-closed)
    release_at: float  # loop time at which it may be delivered


class _DelayLine:
    """FIFO of chunks waiting for their release time, bounded in bytes.

    A single FIFO per direction is what keeps jitter from reordering bytes: a chunk
    never leaves before the one ahead of it, whatever delay each drew.
    """

    def __init__(self, max_bytes: int = DELAY_LINE_MAX_BYTES):
        self._chunks: collections.deque[_Chunk] = collections.deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._changed = asyncio.Condition()

    async def put(self, chunk: _Chunk) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._bytes < self._max_bytes)
            self._chunks.append(chunk)
            self._bytes += len(chunk.data)
            self._changed.notify_all()

    async def get(self) -> _Chunk:
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._chunks))
            chunk = self._chunks.popleft()
            self._bytes -= len(chunk.data)
            self._changed.notify_all()
            return chunk


class _TokenBucket:
    """Bandwidth cap for one direction of one connection (rate may change live)."""

    def __init__(self) -> None:
        self._tokens: Optional[float] = None  # None = full bucket on first use
        self._updated = 0.0

    async def spend(self, nbytes: int, rate: float) -> None:
        """Take nbytes out of the bucket, sleeping off any deficit before returning."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        burst = rate * BANDWIDTH_BURST_S
        if self._tokens is None:
            self._tokens = burst
        else:
            self._tokens = min(burst, self._tokens + (now - self._updated) * rate)
        self._updated = now
        self._tokens -= nbytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / rate)


def _hard_reset(writer: Optional[asyncio.StreamWriter]) -> None:
    """Close a socket with an RST (SO_LINGER 0), the way a middlebox or crash does."""
    if writer is None:
        return
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Connection:
    """One proxied client connection: two directions, each reader -> delay line -> writer."""

    def __init__(self, route: "_RouteState", number: int,
                 client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter):
        self.route = route
        self.number = number
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.upstream_writer: Optional[asyncio.StreamWriter] = None
        self.lost_bytes = False  # dropped something in a blackhole: stream is corrupt
        self._finished = False
        self._task: Optional[asyncio.Task] = None
        self._subtasks: list[asyncio.Task] = []

    # -- lifecycle

    async def run(self) -> None:
        self._task = asyncio.current_task()
        self.route.connections.add(self)
        self.route.counters["connections_accepted"] += 1
        try:
            await self._serve()
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("%s#%d ended: %r", self.route.route.name, self.number, exc)
            self._abort()
        except asyncio.CancelledError:
            self._abort()  # reset()/stop(): already aborted, this is a no-op then
        finally:
            for task in self._subtasks:
                task.cancel()
            self.route.connections.discard(self)

    async def _serve(self) -> None:
        seed, name = self.route.seed, self.route.route.name
        up_line, down_line = _DelayLine(), _DelayLine()
        self._spawn(self._watch_for_reset(connection_rng(seed, name, self.number, "reset")))
        up_reader = self._spawn(self._read_into(self.client_reader, up_line,
                                                connection_rng(seed, name, self.number, "jitter-up")))
        await self._wait_until_open(up_reader)  # new connections hang through a blackhole
        upstream_reader, self.upstream_writer = await self._connect_upstream()
        if upstream_reader is None:
            return
        pumps = [
            up_reader,
            self._spawn(self._write_from(up_line, self.upstream_writer, "bytes_up")),
            self._spawn(self._read_into(upstream_reader, down_line,
                                        connection_rng(seed, name, self.number, "jitter-down"))),
            self._spawn(self._write_from(down_line, self.client_writer, "bytes_down")),
        ]
        done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # re-raise a peer's error -> run() aborts both sides
        self._close_gracefully()

    async def _wait_until_open(self, up_reader: asyncio.Task) -> None:
        """Wait for the route to leave its blackhole, but give up if the client errors."""
        opened = self._spawn(self.route.wait_until_open())
        await asyncio.wait([opened, up_reader], return_when=asyncio.FIRST_COMPLETED)
        if up_reader.done() and up_reader.exception() is not None:
            raise up_reader.exception()
        await opened

    async def _connect_upstream(self):
        target = self.route.route
        try:
            return await asyncio.open_connection(target.target_host, target.target_port)
        except OSError as exc:
            log.warning("route %s: cannot connect to %s:%d: %s", target.name,
                        target.target_host, target.target_port, exc)
            self.route.counters["upstream_connect_failures"] += 1
            self._abort()  # the client sees a reset, as it would from a closed port
            return None, None

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._subtasks.append(task)
        return task

    def reset(self, counted: bool = True) -> bool:
        """Abort both sides with an RST now (counted as a proxy-made reset).

        Returns False if the connection had already ended, so callers count only real resets.
        """
        if self._finished:
            return False
        if counted:
            self.route.counters["connections_reset"] += 1
        self._abort()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        return True

    def _abort(self) -> None:
        if self._finished:
            return
        self._finished = True
        _hard_reset(self.client_writer)
        _hard_reset(self.upstream_writer)

    def _close_gracefully(self) -> None:
        if self._finished:
            return
        self._finished = True
        for writer in (self.client_writer, self.upstream_writer):
            if writer is not None:
                writer.close()

    # -- the pumps

    async def _read_into(self, reader: asyncio.StreamReader, line: _DelayLine, jitter_rng: random.Random) -> None:
        """Read a source and queue each chunk with its release time; drop in a blackhole."""
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(READ_CHUNK)
            if self.route.blackholed:
                self._drop(data)
            else:
                spec = self.route.spec
                delay = spec.latency_ms / 1000.0 + draw_jitter_s(jitter_rng, spec.jitter_ms)
                await line.put(_Chunk(data, loop.time() + delay))
            if not data:
                return

    async def _write_from(self, line: _DelayLine, writer: asyncio.StreamWriter, counter: str) -> None:
        """Deliver queued chunks in order once due, throttled; pass end-of-stream on."""
        loop = asyncio.get_running_loop()
        bucket = _TokenBucket()
        while True:
            chunk = await line.get()
            wait = chunk.release_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.route.blackholed:  # in flight when the partition began: lost
                self._drop(chunk.data)
            elif not chunk.data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            else:
                await self._write_throttled(writer, chunk.data, bucket, counter)
            if not chunk.data:
                return

    async def _write_throttled(self, writer: asyncio.StreamWriter, data: bytes,
                               bucket: _TokenBucket, counter: str) -> None:
        view = memoryview(data)
        while view:
            rate = self.route.spec.bandwidth_bytes_per_s
            if rate is None:
                piece, view = view, view[len(view):]
            else:
                size = max(256, int(rate * BANDWIDTH_SLICE_S))
                piece, view = view[:size], view[size:]
                await bucket.spend(len(piece), rate)
            writer.write(piece)
            self.route.counters[counter] += len(piece)
            await writer.drain()

    def _drop(self, data: bytes) -> None:
        self.lost_bytes = True
        self.route.counters["bytes_dropped"] += len(data)

    async def _watch_for_reset(self, rng: random.Random) -> None:
        """Reset this connection after an exponential lifetime; redraw on spec change."""
        while True:
            changed = self.route.spec_changed
            delay = draw_reset_delay(rng, self.route.spec.reset_probability_per_s)
            try:
                await asyncio.wait_for(changed.wait(), None if math.isinf(delay) else delay)
                continue  # new spec: a memoryless lifetime is simply redrawn
            except asyncio.TimeoutError:
                pass
            if not self.route.blackholed:  # an RST would not cross a partition either
                self.reset()
                return


# --------------------------------------------------------------------- per route


class _RouteState:
    """Listener, faults, blackhole window and counters of one route (loop thread only)."""

    def __init__(self, route: Route, spec: FaultSpec, seed: int):
        self.route = route
        self.spec = spec
        self.seed = seed
        self.server: Optional[asyncio.AbstractServer] = None
        self.port = route.listen_port
        self.connections: set[_Connection] = set()
        self.counters = {key: 0 for key in STAT_KEYS if key != "open_connections"}
        self.blackhole_until = 0.0  # loop time a blackhole() window ends; 0 = none running
        self.blackholed = False
        self.open = asyncio.Event()
        self.open.set()
        self.spec_changed = asyncio.Event()
        self._next_number = 0
        if spec.blackhole:
            self.counters["blackholed_windows"] += 1
        self.refresh_blackhole()

    async def listen(self) -> None:
        try:
            self.server = await asyncio.start_server(self._accept, LISTEN_HOST, self.route.listen_port)
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise FaultProxyError(f"route {self.route.name}: cannot listen on "
                                  f"{LISTEN_HOST}:{self.route.listen_port}: {reason}") from None
        self.port = self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number, self._next_number = self._next_number, self._next_number + 1
        await _Connection(self, number, reader, writer).run()

    async def wait_until_open(self) -> None:
        await self.open.wait()

    def set_spec(self, spec: FaultSpec) -> None:
        if spec.blackhole and not self.spec.blackhole:
            self.counters["blackholed_windows"] += 1
        self.spec = spec
        self.spec_changed.set()  # wake watchers waiting on the old spec ...
        self.spec_changed = asyncio.Event()  # ... and give the next waiters a fresh event
        self.refresh_blackhole()

    def start_blackhole(self, seconds: float) -> None:
        """Open a window now; overlapping windows merge (the later end wins)."""
        loop = asyncio.get_running_loop()
        self.counters["blackholed_windows"] += 1
        self.blackhole_until = max(self.blackhole_until, loop.time() + seconds)
        loop.call_at(self.blackhole_until, self._window_elapsed, self.blackhole_until)
        self.refresh_blackhole()

    def _window_elapsed(self, until: float) -> None:
        # Compared by identity of the end time, not against the clock: asyncio may run a
        # call_at handle up to one clock resolution early, and the window must still end.
        if self.blackhole_until == until:
            self.blackhole_until = 0.0
            self.refresh_blackhole()

    def refresh_blackhole(self) -> None:
        """Enter or leave the blackhole state; on leaving, reset connections that lost bytes."""
        blackholed = self.spec.blackhole or self.blackhole_until > 0
        if blackholed == self.blackholed:
            return
        self.blackholed = blackholed
        if blackholed:
            self.open.clear()
            return
        self.open.set()
        for connection in list(self.connections):
            if connection.lost_bytes and connection.reset():
                self.counters["connections_reset_after_blackhole"] += 1

    def reset_all(self) -> int:
        return sum(connection.reset() for connection in list(self.connections))

    def stats(self) -> dict[str, int]:
        return {**self.counters, "open_connections": len(self.connections)}

    async def close(self) -> None:
        for connection in list(self.connections):
            connection.reset(counted=False)
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)


# ------------------------------------------------------------------------ proxy


class FaultProxy:
    """Fault-injecting TCP proxy for a set of routes, controlled from synchronous code.

    Why a thread with its own loop: the callers (tests, chaos runs, the CLI) are
    synchronous and must keep running while the proxy shuffles bytes; every control
    method hands its work to the loop and waits for it, so it is safe from any thread.
    """

    def __init__(self, routes: Sequence[Route], spec: FaultSpec = FaultSpec(), seed: int = 0):
        if not routes:
            raise ValueError("FaultProxy needs at least one route")
        names = [route.name for route in routes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate route names: {', '.join(duplicates)}")
        self.routes = list(routes)
        self.seed = seed
        self._initial_specs = {route.name: spec for route in self.routes}
        self._states: dict[str, _RouteState] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping: Optional[asyncio.Event] = None
        self._schedule_tasks: set[asyncio.Task] = set()

    # -- lifecycle

    def start(self, timeout_s: float = CONTROL_TIMEOUT_S) -> "FaultProxy":
        """Start listening on every route; returns once all listeners are open."""
        if self._thread is not None:
            raise FaultProxyError("proxy already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._thread_main, args=(ready, failure),
                                        name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise FaultProxyError(f"proxy did not start within {timeout_s} s")
        if failure:
            self._thread.join(timeout_s)
            self._thread = None
            raise failure[0]
        return self

    def stop(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        """Close all listeners and connections (without counting them as resets)."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None or loop is None or stopping is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _thread_main(self, ready: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # surfaced to start() through `failure`
            failure.append(exc)
        finally:
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        states = {route.name: _RouteState(route, self._initial_specs[route.name], self.seed)
                  for route in self.routes}
        try:
            for state in states.values():
                await state.listen()
            self._states = states
            ready.set()
            await self._stopping.wait()
        finally:
            for task in list(self._schedule_tasks):
                task.cancel()
            for state in states.values():
                await state.close()

    # -- addresses

    def port(self, name: str) -> int:
        """The port route ``name`` listens on (the picked one for listen_port 0)."""
        state = self._states.get(name)
        if state is not None:
            return state.port
        route = self._route(name)
        if route.listen_port == 0:
            raise FaultProxyError(f"route {name} has no port until the proxy is started")
        return route.listen_port

    def address(self, name: str) -> str:
        return f"{LISTEN_HOST}:{self.port(name)}"

    def _route(self, name: str) -> Route:
        for route in self.routes:
            if route.name == name:
                return route
        raise FaultProxyError(f"unknown route {name!r}; routes are {', '.join(r.name for r in self.routes)}")

    # -- control (thread-safe)

    def set_spec(self, spec: FaultSpec, routes: Optional[Iterable[str]] = None) -> None:
        """Change the faults now, for all routes or the named ones; open connections follow."""
        names = self._names(routes)
        if not self._running():  # not started yet: becomes the starting spec
            self._initial_specs.update({name: spec for name in names})
            return
        self._call(lambda: [self._states[name].set_spec(spec) for name in names])

    def spec(self, name: str) -> FaultSpec:
        """The faults route ``name`` applies now."""
        self._route(name)
        if not self._running():
            return self._initial_specs[name]
        return self._call(lambda: self._states[name].spec)

    def blackhole(self, seconds: float, routes: Optional[Iterable[str]] = None) -> None:
        """Partition the named routes (default all) for ``seconds``, starting now."""
        if not seconds > 0:
            raise ValueError(f"blackhole duration must be > 0, got {seconds!r}")
        names = self._names(routes)
        self._call(lambda: [self._states[name].start_blackhole(seconds) for name in names])

    def reset_all(self, routes: Optional[Iterable[str]] = None) -> int:
        """Abort every open connection of the named routes now; returns how many."""
        names = self._names(routes)
        return self._call(lambda: sum(self._states[name].reset_all() for name in names))

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per route name, keys as in STAT_KEYS.

        bytes_up/bytes_down count bytes delivered (client->target / target->client),
        bytes_dropped what a blackhole swallowed. connections_reset counts every reset the
        proxy made (random, reset_all, end of a blackhole); the last kind is also counted
        in connections_reset_after_blackhole, so random resets are the difference.
        """
        if not self._states:  # never started
            return {route.name: {key: 0 for key in STAT_KEYS} for route in self.routes}
        if not self._running():  # stopped: the loop is gone, the counters stay readable
            return {name: state.stats() for name, state in self._states.items()}
        return self._call(lambda: {name: state.stats() for name, state in self._states.items()})

    def run_schedule(self, schedule: FaultSchedule) -> concurrent.futures.Future:
        """Apply the schedule's actions at their times (counted from now) in the background.

        Returns a Future that completes after the last action; cancel it to stop early.
        """
        for action in schedule:
            self._names(action.routes)  # fail now on an unknown route, not minutes later
        loop = self._running_loop()
        return asyncio.run_coroutine_threadsafe(self._run_schedule(list(schedule)), loop)

    async def _run_schedule(self, actions: list[ScheduledAction]) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        self._schedule_tasks.add(task)
        try:
            started = loop.time()
            for action in actions:
                await asyncio.sleep(max(0.0, started + action.at_s - loop.time()))
                self._apply(action)
        finally:
            self._schedule_tasks.discard(task)

    def _apply(self, action: ScheduledAction) -> None:
        log.info("schedule: %s", action)
        for name in self._names(action.routes):
            state = self._states[name]
            if action.action == "set_spec":
                state.set_spec(action.spec)
            elif action.action == "blackhole":
                state.start_blackhole(action.duration_s)
            else:
                state.reset_all()

    # -- plumbing

    def _names(self, routes: Optional[Iterable[str]]) -> list[str]:
        if routes is None:
            return [route.name for route in self.routes]
        return [self._route(name).name for name in _route_tuple(routes)]

    def _running(self) -> bool:
        return self._loop is not None and self._thread is not None and bool(self._states)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if not self._running():
            raise FaultProxyError("proxy is not running; call start() first")
        return self._loop

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the proxy's loop and return its result (directly if already there)."""
        loop = self._running_loop()
        if threading.current_thread() is self._thread:
            return fn()

        async def in_loop() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(in_loop(), loop).result(CONTROL_TIMEOUT_S)


# -------------------------------------------------------------------------- CLI


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(message)


def _fail(message: str) -> None:
    print(f"fault_proxy: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _route_arg(text: str) -> Route:
    try:
        return Route.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="python -m infra.fault_proxy",
        description="TCP fault-injection proxy: listens on 127.0.0.1 and forwards each route to "
                    "its target while adding latency, jitter, a bandwidth cap, random connection "
                    "resets and scheduled blackholes (network partitions). Runs until Ctrl-C "
                    "(or --duration) and prints per-route stats at exit. Kafka works only if the "
                    "broker advertises the proxy's address (see docs/faults.md).",
    )
    parser.add_argument("--route", action="append", type=_route_arg, required=True,
                        metavar="NAME:LISTEN_PORT:TARGET_HOST:TARGET_PORT",
                        help="forward 127.0.0.1:LISTEN_PORT to TARGET_HOST:TARGET_PORT (LISTEN_PORT 0 "
                             "picks a free port); repeat for several routes, e.g. "
                             "--route redis:16379:127.0.0.1:6379")
    parser.add_argument("--latency-ms", type=_non_negative, default=0.0,
                        help="one-way delay added in each direction (a round trip gains twice this)")
    parser.add_argument("--jitter-ms", type=_non_negative, default=0.0,
                        help="extra uniform random delay in [0, JITTER] per chunk and direction; "
                             "never reorders bytes")
    parser.add_argument("--bandwidth-kbps", type=_positive, default=None,
                        help="bandwidth cap per connection and direction in kilobits per second "
                             "(1 kbps = 125 bytes/s); default: unlimited")
    parser.add_argument("--reset-per-min", type=_non_negative, default=0.0,
                        help="mean number of resets (RST) per connection per minute: each connection "
                             "lives an exponential time with this rate")
    parser.add_argument("--blackhole-at", type=_non_negative, action="append", default=[],
                        metavar="SECONDS",
                        help="start a blackhole (partition: nothing forwarded, data dropped, nothing "
                             "closed) this many seconds after start; repeatable; needs --blackhole-for")
    parser.add_argument("--blackhole-for", type=_positive, default=None, metavar="SECONDS",
                        help="length of each --blackhole-at window in seconds")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random draws (jitter, reset times); same seed, same draws")
    parser.add_argument("--duration", type=_positive, default=None, metavar="SECONDS",
                        help="stop after this many seconds instead of waiting for Ctrl-C")
    return parser


def spec_from_args(args: argparse.Namespace) -> FaultSpec:
    bandwidth = None if args.bandwidth_kbps is None else args.bandwidth_kbps * 1000 / 8
    return FaultSpec(latency_ms=args.latency_ms, jitter_ms=args.jitter_ms,
                     bandwidth_bytes_per_s=bandwidth,
                     reset_probability_per_s=args.reset_per_min / 60.0)


def schedule_from_args(args: argparse.Namespace) -> FaultSchedule:
    schedule = FaultSchedule()
    for at_s in args.blackhole_at:
        schedule.blackhole(at_s, args.blackhole_for)
    return schedule


def _check_args(args: argparse.Namespace) -> None:
    if args.blackhole_at and args.blackhole_for is None:
        _fail("--blackhole-at needs --blackhole-for SECONDS")
    if args.blackhole_for is not None and not args.blackhole_at:
        _fail("--blackhole-for needs at least one --blackhole-at SECONDS")
    names = [route.name for route in args.route]
    if len(set(names)) != len(names):
        _fail(f"route names must be unique, got {', '.join(names)}")
    ports = [route.listen_port for route in args.route if route.listen_port]
    if len(set(ports)) != len(ports):
        _fail("two routes listen on the same port")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _wait_for_stop(duration_s: Optional[float]) -> None:
    """Block until Ctrl-C, SIGTERM or the duration ends (SIGTERM is treated as Ctrl-C,
    so a supervisor stopping the proxy still gets the stats printed)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main_thread else None
    deadline = math.inf if duration_s is None else time.monotonic() + duration_s
    try:
        while time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    proxy = FaultProxy(args.route, spec_from_args(args), seed=args.seed)
    try:
        proxy.start()
    except FaultProxyError as exc:
        _fail(str(exc))
    try:
        for route in args.route:
            print(f"{route.name}: {proxy.address(route.name)} -> {route.target_host}:{route.target_port}",
                  flush=True)
        print(f"faults: {json.dumps(dataclasses.asdict(proxy.spec(args.route[0].name)))}", flush=True)
        schedule = schedule_from_args(args)
        if len(schedule):
            proxy.run_schedule(schedule)
            print("schedule: " + ", ".join(f"blackhole at {a.at_s:g}s for {a.duration_s:g}s" for a in schedule),
                  flush=True)
        _wait_for_stop(args.duration)
        print(f"stats: {json.dumps(proxy.stats(), indent=2)}", flush=True)
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
