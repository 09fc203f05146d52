"""`heterorl wan`: a run whose samplers sit behind shaped wide-area links, and what each link costs.

  1. a local stack in OUT/ARM/data listening on every address of this machine, whose broker
     advertises 127.0.0.1: each role reaches the servers at 127.0.0.1, as on one host;
  2. the learner, and each unshaped sampler, in this network namespace; each shaped sampler on a
     host of its own (a Linux network namespace on a bridge), where 127.0.0.1 is a fault proxy
     (`infra/fault_proxy.py`: latency, jitter, connection resets) whose every byte crosses a veth
     pair shaped in the kernel (`tc` token-bucket filter: the link's rate, both ways). The
     kernels of these machines have no `netem`, so the delay is the proxy's;
  3. samplers with a registered key start with the learner; a link with `join` gets a sampler
     that joins at that second with only an invite (`heterorl join --invite`), as a stranger
     (its groups checked);
  4. after `minutes`, the samplers stop, the learner drains, and each arm is audited as `chaos`
     audits (lost 0, used twice 0); with `--compare-unshaped` the same run follows with every
     link unshaped, the reference the report measures against;
  5. OUT/wan_report.json, a table on screen and OUT/wan_report.png: per sampler the bytes of its
     first policy (keyframe) and per version it held (deltas), seconds from its start (or join)
     to its first group used, groups sent, used, dropped stale and refused, seconds waiting on
     weights; for the learner, steps per minute and busy share against the unshaped arm.

Network namespaces and `tc` need root and iproute2; without them the command says so and stops.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from lab.attack import joined_as_stranger, keys_of
from heterorl.invites import make_run_invite, write_invite_file
from heterorl.keys import provision_local, run_registry
from heterorl.processes import Processes, child_env
from heterorl.stack import with_services
from infra import netns
from infra.local_stack import stack_services, start_stack, stop_stack
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import ENV_OVERRIDES, Services, free_port
from pipeline.clients.topics import read_topic
from pipeline.config import ConfigError, HeteroConfig, dump_config
from pipeline.errors import UserError
from pipeline.records.audit import audit_topic
from pipeline.records.update_log import UpdateEntry, read_update_log
from pipeline.runtime import resolve_base_model, setup_logging
from pipeline.trust.keyring import init_keys, key_paths, trusted_learner
from pipeline.weights.policy import link_of, unpacked_bytes
from pipeline.weights.recovery import latest_state, recovery_store
from pipeline.weights.store import CheckpointStore, PolicyPointer, connect_s3
from pipeline.wire.rollout import header_value

LOOPBACK = "127.0.0.1"
BIND_ALL = "0.0.0.0"
SUBNET = "10.79.{}.{}"
TBF_QUEUE_MS = 200
"""How long a packet may wait in a shaped link's queue before the kernel drops it (tbf `latency`)."""
STALE_REASONS = ("too_stale_steps", "too_old_seconds")


@dataclass(frozen=True)
class WanLink:
    """One sampler's link to the servers. Unset fields leave that part of the link as it is."""

    name: str
    rate_mbit: Optional[float] = None
    """Bandwidth each way in Mbit/s (kernel tbf); None: not limited."""
    delay_ms: float = 0.0
    """One-way delay added in each direction (the fault proxy's)."""
    jitter_ms: float = 0.0
    """Extra uniform delay in [0, jitter] per chunk and direction (never reorders bytes)."""
    reset_every_s: Optional[float] = None
    """Mean seconds between resets of each connection (exponential); None: no resets."""
    join_at_s: Optional[float] = None
    """Its sampler joins this many seconds into the run with an invite; None: it starts with the
    learner under a registered key."""

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0 or self.jitter_ms > 0 or self.reset_every_s is not None

    def unshaped(self) -> "WanLink":
        """The same sampler with nothing on its link (the reference arm)."""
        return WanLink(self.name, join_at_s=self.join_at_s)

    def describe(self) -> str:
        parts = [f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit is not None else "unlimited"]
        if self.delay_ms or self.jitter_ms:
            parts.append(f"{self.delay_ms:g}±{self.jitter_ms:g} ms each way")
        if self.reset_every_s is not None:
            parts.append(f"a reset every {self.reset_every_s:g} s")
        if self.join_at_s is not None:
            parts.append(f"joins at {self.join_at_s:g} s with an invite")
        return ", ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "WanLink":
        """`NAME [rate=MBIT] [delay=MS] [jitter=MS] [reset=S] [join=S]`, e.g. `C rate=10 delay=150 reset=120`."""
        words = text.split()
        if not words or not re.fullmatch(r"[A-Za-z0-9_-]+", words[0]):
            raise ConfigError(f"--link {text!r}: start with the link's name (letters, digits, '_', '-')")
        keys = {"rate": "rate_mbit", "delay": "delay_ms", "jitter": "jitter_ms", "reset": "reset_every_s",
                "join": "join_at_s"}
        values: dict = {}
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key not in keys:
                raise ConfigError(f"--link {text!r}: unknown field {key!r}; use {', '.join(k + '=' for k in keys)}")
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"--link {text!r}: {key}= needs a number, got {value!r}") from None
            if number < 0 or (key in ("rate", "reset") and number == 0):
                raise ConfigError(f"--link {text!r}: {key}= must be {'above' if key in ('rate', 'reset') else 'at least'} 0")
            values[keys[key]] = number
        return cls(words[0], **values)


DEFAULT_LINKS = (
    WanLink("A"),
    WanLink("B", rate_mbit=50, delay_ms=40, jitter_ms=4),
    WanLink("C", rate_mbit=10, delay_ms=150, jitter_ms=15, reset_every_s=120),
    WanLink("D", rate_mbit=10, delay_ms=150, jitter_ms=15, join_at_s=180),
)
"""A: the reference; B: a fast link across a continent; C: a slow far link that drops its
connections every 2 minutes on average; D: like C (without resets), a volunteer joining at minute 3."""


def check_links(links: list[WanLink], minutes: float) -> None:
    """ConfigError naming what makes these links unusable for a run of `minutes`."""
    names = [link.name for link in links]
    if not links or len(set(names)) != len(names):
        raise ConfigError(f"--link: give each link once, by a name of its own (got {', '.join(names) or 'none'})")
    if all(link.join_at_s is not None for link in links):
        raise ConfigError("--link: at least one sampler must start with the learner (a link without join=)")
    for link in links:
        if link.join_at_s is not None and link.join_at_s >= minutes * 60:
            raise ConfigError(f"--link {link.name}: join={link.join_at_s:g} s is not within the run's "
                              f"{minutes:g} minutes")


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc qdisc add dev IF root` arguments that cap a link at `rate_mbit` Mbit/s: a token bucket
    whose burst (at least 32 KiB, or 10 ms of the rate) lets the kernel's timer keep the rate."""
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes / 100))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{TBF_QUEUE_MS}ms"]


def why_no_namespaces() -> Optional[str]:
    """Why this machine cannot give samplers hosts of their own with shaped links (None: it can)."""
    return netns.why_no_namespaces(tools=("ip", "tc"))


def _tc(namespace: Optional[str], *args: str) -> None:
    done = subprocess.run(["tc", *(["-n", namespace] if namespace else []), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")


class LinkHosts:
    """A host of its own for each shaped link: a namespace on a bridge, its veth pair shaped by tbf
    both ways, and in it a fault proxy on 127.0.0.1 at the servers' ports that forwards to them."""

    def __init__(self, links: list[WanLink], ports: dict[str, int], logs: Path, seed: int):
        self.tag = uuid.uuid4().hex[:4]
        net = int(self.tag, 16) % 200 + 20
        self.gateway = SUBNET.format(net, 1)
        self.bridge = f"hrlw{self.tag}"
        self.namespaces: dict[str, str] = {}
        self.proxies: dict[str, subprocess.Popen] = {}
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        try:
            self._build(links, ports, net, seed)
        except BaseException:
            self.close()
            raise

    def _build(self, links: list[WanLink], ports: dict[str, int], net: int, seed: int) -> None:
        netns.add_bridge(self.bridge, f"{self.gateway}/24")
        for i, link in enumerate((link for link in links if link.shaped), start=2):
            ns, outside, inside = f"hrlw-{self.tag}-{link.name}", f"hwo{self.tag}{i}", f"hwi{self.tag}{i}"
            self.namespaces[link.name] = ns  # before it exists: a failure half-way is cleaned up too
            netns.add_host(ns, self.bridge, outside, inside, f"{SUBNET.format(net, i)}/24")
            if link.rate_mbit is not None:  # egress of each end: to the sampler, and from it
                _tc(None, "qdisc", "add", "dev", outside, "root", *tbf_args(link.rate_mbit))
                _tc(ns, "qdisc", "add", "dev", inside, "root", *tbf_args(link.rate_mbit))
            self._start_proxy(link, ns, ports, seed + i)

    def _start_proxy(self, link: WanLink, ns: str, ports: dict[str, int], seed: int) -> None:
        log_path = self.logs / f"proxy-{link.name}.log"
        routes = [a for name, port in ports.items() for a in ("--route", f"{name}:{port}:{self.gateway}:{port}")]
        faults = ["--latency-ms", str(link.delay_ms), "--jitter-ms", str(link.jitter_ms), "--seed", str(seed)]
        if link.reset_every_s is not None:
            faults += ["--reset-per-min", str(60.0 / link.reset_every_s)]
        with open(log_path, "wb") as log:
            self.proxies[link.name] = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "infra.fault_proxy", *routes, *faults],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while "faults:" not in log_path.read_text(errors="replace"):
            if self.proxies[link.name].poll() is not None or time.monotonic() > deadline:
                raise UserError(f"the fault proxy of link {link.name} did not start: "
                                f"{log_path.read_text(errors='replace').strip()[-300:]}")
            time.sleep(0.1)

    def prefix(self, link: WanLink) -> tuple[str, ...]:
        """What runs a process behind `link` (nothing for an unshaped one: this host's network)."""
        return ("ip", "netns", "exec", self.namespaces[link.name]) if link.name in self.namespaces else ()

    def proxy_stats(self) -> dict[str, dict]:
        """Per shaped link, its proxy's counters (bytes each way, connections reset), once stopped."""
        out = {}
        for name, proc in self.proxies.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            text = (self.logs / f"proxy-{name}.log").read_text(errors="replace")
            found = text.split("stats:", 1)
            try:
                routes = json.loads(found[1]) if len(found) == 2 else {}
            except ValueError:
                routes = {}
            out[name] = {"bytes_down": sum(r.get("bytes_down", 0) for r in routes.values()),
                         "bytes_up": sum(r.get("bytes_up", 0) for r in routes.values()),
                         "connections_reset": sum(r.get("connections_reset", 0) for r in routes.values())}
        return out

    def close(self) -> None:
        for proc in self.proxies.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        netns.remove_hosts(self.namespaces.values(), self.bridge)


def on_loopback(services: Services) -> Services:
    """`services` of a stack bound to every address, as a client on this host (or behind its
    link's proxy) reaches them: at 127.0.0.1."""
    return replace(services, kafka_bootstrap=services.kafka_bootstrap.replace(BIND_ALL, LOOPBACK),
                   redis_url=services.redis_url.replace(f"@{BIND_ALL}:", f"@{LOOPBACK}:").replace(
                       f"//{BIND_ALL}:", f"//{LOOPBACK}:"),
                   s3_endpoint=services.s3_endpoint.replace(BIND_ALL, LOOPBACK))


def stranger_env() -> dict:
    """A volunteer's environment: this one's without any server's URL or credentials."""
    return {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES} | {"PYTHONUNBUFFERED": "1"}


# ---- what a run gives, per sampler and for the learner ------------------------------------------

@dataclass
class SamplerFigures:
    link: str
    sampler_id: str
    started_s: float
    """Seconds into the run it started (or joined)."""
    sent: int = 0
    used: int = 0
    dropped_stale: int = 0
    refused: int = 0
    first_used_s: Optional[float] = None
    """Seconds from its start (or join) to the learner's step that first used one of its groups."""
    first_policy_s: Optional[float] = None
    """Seconds from its start (or join) to its first policy loaded."""
    first_policy_bytes: int = 0
    """Bytes of its first policy (a keyframe, and the deltas after it)."""
    keyframe_bytes: int = 0
    """Bytes of every keyframe it downloaded, the first policy's included."""
    versions_followed: int = 0
    """Versions it advanced after its first policy."""
    bytes_per_version: Optional[float] = None
    """Bytes per version advanced after its first policy, keyframes taken since included."""
    bytes_down: Optional[int] = None
    """Bytes its link carried to it (the proxy's count: retries and aborted downloads included;
    None for an unshaped link, which has no proxy)."""
    weights_wait_s: Optional[float] = None
    """Seconds with no policy yet, plus seconds stalled behind (waiting for a newer version rather
    than making groups that would be dropped)."""
    weights_download_s: float = 0.0
    refused_checkpoints: int = 0
    refused_delta_paths: int = 0
    first_downloads_restarted: int = 0
    """First downloads given up for a newer version fewer bytes away (a joiner's, at a keyframe)."""
    used_share: Optional[float] = None
    """used / (used + dropped stale): how much of what it sent the delay let in."""


def sampler_figures(links: dict[str, WanLink], sampler_ids: dict[str, str], started_at: dict[str, float],
                    run_start: float, entries: list[UpdateEntry], sender: dict[tuple, str],
                    reports: dict[str, dict]) -> dict[str, SamplerFigures]:
    """Per link, what its sampler sent and what became of it, from the topic (`sender`: message ->
    sampler id), the update log and the sampler's own final stats. Pure: no I/O."""
    by_id = {sampler_ids[name]: name for name in links}
    out = {name: SamplerFigures(name, sampler_ids[name], round(started_at[name] - run_start, 1)) for name in links}
    for message, sender_id in sender.items():
        if sender_id in by_id:
            out[by_id[sender_id]].sent += 1
    for entry in (e for e in entries if e.kind == "step"):
        for group in entry.used:
            name = by_id.get(sender.get((group.partition, group.offset, group.rollout_id)))
            if name is not None:
                figures = out[name]
                figures.used += 1
                since = round(entry.time - started_at[name], 1)
                figures.first_used_s = since if figures.first_used_s is None else min(figures.first_used_s, since)
        for group in entry.dropped:
            name = by_id.get(sender.get((group.partition, group.offset, group.rollout_id)))
            if name is not None:
                if group.reason in STALE_REASONS:
                    out[name].dropped_stale += 1
                else:
                    out[name].refused += 1
    for name, figures in out.items():
        report = reports.get(figures.sampler_id, {})
        figures.keyframe_bytes = int(report.get("keyframe_bytes") or 0)
        figures.first_policy_bytes = int(report.get("first_policy_bytes") or 0)
        if report.get("first_policy_version") is not None and report.get("policy_version") is not None:
            figures.versions_followed = int(report["policy_version"]) - int(report["first_policy_version"])
        figures.bytes_per_version = report.get("per_version_bytes")
        if report.get("first_policy_at") is not None:  # a joiner's download starts before its sampler does
            figures.first_policy_s = round(float(report["first_policy_at"]) - started_at[name], 1)
            figures.weights_wait_s = round(figures.first_policy_s + float(report.get("stalled_behind_s") or 0), 1)
        figures.weights_download_s = float(report.get("weights_download_s") or 0.0)
        figures.refused_checkpoints = int(report.get("refused_checkpoints") or 0)
        figures.refused_delta_paths = int(report.get("refused_delta_paths") or 0)
        figures.first_downloads_restarted = int(report.get("first_downloads_restarted") or 0)
        if figures.used + figures.dropped_stale:
            figures.used_share = round(figures.used / (figures.used + figures.dropped_stale), 3)
    return out


def learner_figures(entries: list[UpdateEntry], run_start: float, run_end: float, summary: dict,
                    learner_wall_s: float) -> dict:
    """Steps per minute while the samplers ran, and the learner's busy share of its wall time."""
    steps = [e for e in entries if e.kind == "step" and run_start <= e.time <= run_end]
    busy = sum(v for k, v in (summary.get("seconds") or {}).items() if k.startswith("time_"))
    return {"steps": len(steps), "minutes": round((run_end - run_start) / 60, 2),
            "steps_per_min": round(len(steps) / max((run_end - run_start) / 60, 1e-9), 3),
            "busy_share": round(busy / learner_wall_s, 3) if learner_wall_s > 0 else None,
            "final_policy_version": summary.get("final_policy_version"), "precision": summary.get("precision")}


# ---- one arm: a whole run behind one set of links ----------------------------------------------

@dataclass
class ArmResult:
    name: str
    run: str
    links: list[WanLink]
    samplers: dict[str, SamplerFigures]
    learner: dict
    audit: dict
    proxies: dict = field(default_factory=dict)
    model_bytes: int = 0
    """The policy's size as a sampler holds it (v0's tensors in the published dtype, and its other
    files): what bytes per version are a share of."""
    keyframe_bytes: int = 0
    """What a keyframe costs to download (v0's, packed): what a joiner's first group is timed against."""
    volunteers_not_admitted: list[str] = field(default_factory=list)
    """Samplers that joined with the invite whose key is not one admitted under it as a stranger's (must be none)."""


class WanArm:
    """The servers, processes and links of one arm of the rehearsal."""

    def __init__(self, cfg: HeteroConfig, out: Path, name: str, links: list[WanLink], minutes: float, log):
        self.cfg, self.out, self.name, self.links, self.minutes, self.log = cfg, out, name, links, minutes, log
        self.run_name = f"{cfg.run.name}-wan-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.sampler_ids = {link.name: f"{self.run_name}-{link.name}" for link in links}
        self.started_at: dict[str, float] = {}

    def run(self) -> ArmResult:
        out, cfg = self.out, self.cfg
        out.mkdir(parents=True, exist_ok=True)
        cfg = cfg.model_copy(update={
            "run": cfg.run.model_copy(update={"name": self.run_name, "rollout_topic": None}),
            "services": cfg.services.model_copy(update={"data_dir": str(out / "data"), "kafka_bootstrap": None,
                                                        "redis_url": None, "s3_endpoint": None}),
            "learner": cfg.learner.model_copy(update={"max_steps": 10**9,
                                                      "idle_timeout_s": max(cfg.learner.idle_timeout_s, 600.0)}),
        })
        taken: set[int] = set()
        ports = {name: free_port(taken) for name in ("kafka", "redis", "s3")}
        stack = start_stack(out / "data", kafka_port=ports["kafka"], redis_port=ports["redis"], s3_port=ports["s3"],
                            kafka_advertised=f"{LOOPBACK}:{ports['kafka']}", host=BIND_ALL)
        hosts: Optional[LinkHosts] = None
        procs: Optional[Processes] = None
        ports.update({gate: stack.port(gate) for gate in ("kafka-gate", "redis-gate")})  # routed by each link too
        try:
            # the samplers stand for other machines: Kafka through the gate, as the sampler role logs in there
            role = {r: on_loopback(stack_services(stack, r, remote=r == "sampler")) for r in ("admin", "learner",
                                                                                            "sampler")}
            cfg = with_services(cfg, role["admin"])
            init_keys(key_paths(cfg))
            admin_redis = connect_redis(role["admin"].redis_url)
            registered = [self.sampler_ids[link.name] for link in self.links if link.join_at_s is None]
            provision_local(cfg, admin_redis, registered)
            joiners = [link for link in self.links if link.join_at_s is not None]
            invite_file = out / "invite.txt"
            grant_id = None
            if joiners:
                text, grant, _ = make_run_invite(cfg, with_services(cfg, role["sampler"]), len(joiners), 24.0)
                write_invite_file(invite_file, text)
                grant_id = grant.grant_id
            config_file = out / "config.yaml"
            plain = cfg.model_copy(update={"services": cfg.services.model_copy(update={
                "kafka_bootstrap": None, "redis_url": None, "s3_endpoint": None})})
            config_file.write_text(dump_config(plain))
            hosts = LinkHosts(self.links, ports, out / "logs", cfg.run.seed) if any(l.shaped for l in self.links) \
                else None
            procs = Processes(out, child_env(role["learner"]))
            common = ["--config", str(config_file), "--data-dir", cfg.services.data_dir]
            run_start = time.time()
            learner_started = time.monotonic()
            procs.start("learner", ["learner", *common, "--out", str(out)])
            for link in self.links:
                if link.join_at_s is None:
                    self._start_sampler(procs, hosts, link, common, env=child_env(role["sampler"]))
            state = RunState(admin_redis, self.run_name)
            self._wait(procs, hosts, state, common, invite_file, run_start)
            run_end = time.time()
            self.log.info("%s: stopping the samplers (they flush their spools), then draining the learner", self.name)
            procs.stop([f"sampler-{link.name}" for link in self.links], grace_s=120.0)
            self._drain(procs)
            learner_wall_s = time.monotonic() - learner_started
            proxies = hosts.proxy_stats() if hosts else {}
            return self._result(cfg, stack, state, admin_redis, run_start, run_end, learner_wall_s, proxies, grant_id)
        finally:
            if procs is not None:
                procs.stop()
            if hosts is not None:
                hosts.close()
            stop_stack(out / "data")

    def _start_sampler(self, procs: Processes, hosts: Optional[LinkHosts], link: WanLink, common: list[str], *,
                       env: Optional[dict] = None, invite_file: Optional[Path] = None) -> None:
        """A sampler with a registered key in `env`, or (`invite_file`) a volunteer joining with the invite."""
        prefix = hosts.prefix(link) if hosts else ()
        sampler_id = self.sampler_ids[link.name]
        if invite_file is None:
            spool = self.out / "data" / "spool" / link.name
            procs.start(f"sampler-{link.name}", ["sampler", *common, "--id", sampler_id,
                                                 "--set", f"sampler.spool_dir={spool}"], env=env, prefix=prefix)
        else:  # a stranger: only the invite, and a home of its own
            procs.start(f"sampler-{link.name}", ["join", "--invite", str(invite_file), "--id", sampler_id,
                                                 "--home", str(self.out / "volunteers" / link.name)],
                        env=stranger_env(), prefix=prefix)
        self.started_at[link.name] = time.time()
        self.log.info("%s: sampler %s started behind link %s (%s)", self.name, sampler_id, link.name, link.describe())

    def _wait(self, procs: Processes, hosts, state: RunState, common: list[str], invite_file: Path,
              run_start: float) -> None:
        duration_s = self.minutes * 60
        waiting = sorted((link for link in self.links if link.join_at_s is not None), key=lambda l: l.join_at_s)
        bar = tqdm(total=int(duration_s), desc=f"wan {self.name}", unit="s", file=sys.stderr, disable=None,
                   mininterval=2)
        while time.time() - run_start < duration_s:
            elapsed = time.time() - run_start
            while waiting and waiting[0].join_at_s <= elapsed:
                self._start_sampler(procs, hosts, waiting.pop(0), common, invite_file=invite_file)
            learner = procs.procs["learner"]
            if learner.poll() is not None:
                raise procs.failure("learner", f"learner exited with {learner.returncode}")
            for link in self.links:
                p = procs.procs.get(f"sampler-{link.name}")
                if p is not None and p.poll() is not None:
                    raise procs.failure(f"sampler-{link.name}", f"the sampler behind link {link.name} exited with "
                                                                f"{p.returncode}")
            bar.update(int(elapsed) - bar.n)
            bar.set_postfix_str(f"v{PolicyPointer(state).version()}")
            time.sleep(0.5)
        bar.close()

    def _drain(self, procs: Processes, timeout_s: float = 900.0) -> None:
        learner = procs.procs["learner"]
        learner.send_signal(signal.SIGUSR1)
        try:
            learner.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise procs.failure("learner", f"the learner did not finish draining within {timeout_s:.0f}s") from None
        if learner.returncode != 0:
            raise procs.failure("learner", f"learner exited with {learner.returncode} while draining")

    def _result(self, cfg: HeteroConfig, stack, state: RunState, admin_redis, run_start: float, run_end: float,
                learner_wall_s: float, proxies: dict, grant_id: Optional[str]) -> ArmResult:
        admin = on_loopback(stack_services(stack))
        store = CheckpointStore(connect_s3(admin), admin.bucket, self.run_name)
        final_state = latest_state(recovery_store(store))
        if final_state is None:
            raise UserError(f"run {self.run_name} wrote no recovery state: nothing to audit")
        reports = {**state.expired_samplers(within_s=10**9), **state.sampler_stats()}
        audit = audit_topic(admin.kafka_bootstrap, cfg.run.topic, final_state.extra, trusted_learner(cfg), reports,
                            honest_sampler_ids=set(self.sampler_ids.values()))
        update_log = read_update_log(admin.kafka_bootstrap, cfg.run.topic, trusted_learner(cfg))
        entries = update_log.entries if update_log else []
        sender = {(r.partition, r.offset, header_value(r.headers, "rollout_id")): header_value(r.headers, "sampler_id")
                  for r in read_topic(admin.kafka_bootstrap, cfg.run.topic, timeout_s=30.0)}
        links = {link.name: link for link in self.links}
        figures = sampler_figures(links, self.sampler_ids, self.started_at, run_start, entries, sender, reports)
        for name, counted in proxies.items():
            figures[name].bytes_down = counted["bytes_down"]
        summary = json.loads((self.out / "learner_summary.json").read_text())
        learner = learner_figures(entries, run_start, run_end, summary, learner_wall_s)
        first = store.read_manifest(store.manifest_key(0))
        volunteers_not_admitted = strangers_not_admitted(cfg, admin_redis, [self.sampler_ids[link.name] for link in self.links
                                                                    if link.join_at_s is not None], grant_id)
        return ArmResult(self.name, self.run_name, self.links, figures, learner, audit, proxies, unpacked_bytes(first),
                         link_of(first).nbytes, volunteers_not_admitted)


def strangers_not_admitted(cfg: HeteroConfig, client, sampler_ids: list[str], grant_id: Optional[str]) -> list[str]:
    """Of the samplers that joined with the invite, those whose key in the registry every role
    reads is not exactly one key admitted under that invite and checked as a stranger's."""
    if not sampler_ids:
        return []
    registry = run_registry(cfg, client)
    return [sampler_id for sampler_id in sampler_ids if not joined_as_stranger(keys_of(registry, sampler_id), grant_id)]


# ---- the report -----------------------------------------------------------------------------

def wan_report(arms: list[ArmResult], minutes: float, machine: str) -> dict:
    """The report of one rehearsal: each arm's figures, and the targets where both arms ran."""
    shaped = arms[0]
    unshaped = next((a for a in arms if a.name == "unshaped"), None)
    report = {"minutes": minutes, "machine": machine, "arms": {}}
    for arm in arms:
        report["arms"][arm.name] = {
            "run": arm.run, "model_bytes": arm.model_bytes, "keyframe_bytes": arm.keyframe_bytes,
            "learner": arm.learner, "proxies": arm.proxies,
            "links": {link.name: {**asdict(link), "describe": link.describe()} for link in arm.links},
            "samplers": {name: asdict(f) for name, f in arm.samplers.items()},
            "audit": {k: arm.audit.get(k) for k in ("produced", "used_in_updates", "dropped_stale", "dead_lettered",
                                                     "duplicates_ignored", "pending_at_end", "lost", "used_twice",
                                                     "unaccounted_count", "forged_used_in_updates")},
            "volunteers_not_admitted": arm.volunteers_not_admitted,
        }
    report["targets"] = wan_targets(shaped, unshaped)
    report["audit_ok"] = all(a.audit.get("lost") == 0 and a.audit.get("used_twice") == 0
                             and a.audit.get("unaccounted_count") == 0 and not a.volunteers_not_admitted for a in arms)
    return report


def wan_targets(shaped: ArmResult, unshaped: Optional[ArmResult]) -> dict:
    """Each target of the rehearsal with the figure it was judged on and whether it was met
    (None where this run cannot judge it: no unshaped arm, no delta taken, no joiner)."""
    targets = {}
    if unshaped is not None and unshaped.learner["steps_per_min"]:
        ratio = shaped.learner["steps_per_min"] / unshaped.learner["steps_per_min"]
        targets["learner_pace"] = {"value": round(ratio, 3), "target": ">= 0.9 of the unshaped arm's steps/min",
                                   "met": ratio >= 0.9}
    followers = [f for f in shaped.samplers.values() if f.versions_followed and f.bytes_per_version is not None]
    if followers and shaped.model_bytes:  # weighted by versions followed: the mean over the run's versions
        share = (sum(f.bytes_per_version * f.versions_followed for f in followers)
                 / sum(f.versions_followed for f in followers) / shaped.model_bytes)
        targets["bytes_per_version"] = {"value": round(100 * share, 3), "unit": "% of the policy",
                                        "target": "<= 1 %", "met": share <= 0.01}
    for link in shaped.links:
        f = shaped.samplers[link.name]
        if link.join_at_s is not None and link.rate_mbit is not None:
            bound = shaped.keyframe_bytes * 8 / (link.rate_mbit * 1e6) + 60
            targets[f"first_used_{link.name}"] = {
                "value": f.first_used_s, "target": f"<= keyframe bytes / link rate + 60 s = {bound:.0f} s",
                "met": f.first_used_s is not None and f.first_used_s <= bound}
        if link.shaped:
            targets[f"used_share_{link.name}"] = {"value": f.used_share, "target": ">= 0.8 of its groups used",
                                                  "met": f.used_share is not None and f.used_share >= 0.8}
    return targets


def report_table(report: dict) -> str:
    lines = []
    for arm_name, arm in report["arms"].items():
        lines.append(f"\n{arm_name} (run {arm['run']}; policy {arm['model_bytes'] / 1e6:.1f} MB, "
                     f"keyframe {arm['keyframe_bytes'] / 1e6:.1f} MB): learner "
                     f"{arm['learner']['steps']} steps in {arm['learner']['minutes']:g} min = "
                     f"{arm['learner']['steps_per_min']:.2f}/min, busy {arm['learner']['busy_share']}; lost "
                     f"{arm['audit']['lost']}, used twice {arm['audit']['used_twice']}")
        lines.append(f"  {'link':<5}{'':34}{'1st MB':>8}{'kf MB':>8}{'link MB':>8}{'MB/ver':>8}{'% pol':>7}"
                     f"{'1st used s':>11}{'sent':>6}{'used':>6}{'stale':>6}{'refused':>8}{'wait s':>8}")

        def cell(value, fmt: str = "") -> str:
            return "-" if value is None else format(value, fmt)

        for name, s in arm["samplers"].items():
            link = arm["links"][name]["describe"]
            per_version = s["bytes_per_version"]
            share = 100 * per_version / arm["model_bytes"] if per_version and arm["model_bytes"] else None
            lines.append(f"  {name:<5}{link[:33]:<34}{s['first_policy_bytes'] / 1e6:>8.1f}"
                         f"{s['keyframe_bytes'] / 1e6:>8.1f}{cell(s['bytes_down'] and s['bytes_down'] / 1e6, '.1f'):>8}"
                         f"{cell(per_version and per_version / 1e6, '.2f'):>8}{cell(share, '.2f'):>7}"
                         f"{cell(s['first_used_s']):>11}{s['sent']:>6}{s['used']:>6}{s['dropped_stale']:>6}"
                         f"{s['refused']:>8}{cell(s['weights_wait_s']):>8}")
    lines.append("  (1st MB: its first policy; kf MB: every keyframe it took; link MB: what its link carried to it; "
                 "MB/ver, % pol: bytes per version followed after the first, keyframes included)")
    lines.append("\ntargets:")
    for name, t in report["targets"].items():
        verdict = {True: "met", False: "MISSED", None: "not judged"}[t["met"]]
        lines.append(f"  {name}: {t['value']}{' ' + t['unit'] if t.get('unit') else ''} ({t['target']}): {verdict}")
    return "\n".join(lines)


def report_png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(report["arms"])
    names = list(report["arms"][arms[0]]["samplers"])
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    width = 0.8 / len(arms)
    panels = [("first group used (s after start/join)", lambda a, s: s["first_used_s"]),
              ("groups used", lambda a, s: s["used"]),
              ("bytes per version followed (% of policy)",
               lambda a, s: 100 * s["bytes_per_version"] / a["model_bytes"] if s["bytes_per_version"] else None)]
    for ax, (title, value) in zip(axes, panels):
        for i, arm in enumerate(arms):
            a = report["arms"][arm]
            ys = [value(a, a["samplers"][n]) for n in names]
            ax.bar([x + i * width for x in range(len(names))], [y or 0 for y in ys], width, label=arm)
        ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(names))], names)
        ax.set_title(title, fontsize=9)
    ax = axes[3]
    ax.bar(arms, [report["arms"][a]["learner"]["steps_per_min"] for a in arms], color=["C0", "C1"][:len(arms)])
    ax.set_title("learner steps per minute", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"heterorl wan: {report['minutes']:g} min per arm, {report['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_kind() -> str:
    """The CPU (model name and whether it multiplies bf16) and core count, for the report."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    units = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2" \
        if "avx2" in flags else "no bf16 units"
    return f"{os.cpu_count()}-core {model} ({units})"


def run_wan(cfg: HeteroConfig, out: Path, minutes: float, links: list[WanLink], compare_unshaped: bool) -> int:
    log = setup_logging("wan")
    check_links(links, minutes)
    why = why_no_namespaces() if any(link.shaped for link in links) else None
    if why:
        raise UserError(f"heterorl wan puts each shaped sampler on a host of its own: {why}")
    out = Path(out)
    if (out / "wan_report.json").exists():
        raise UserError(f"{out} already holds a WAN rehearsal (wan_report.json); choose another --out")
    base = resolve_base_model(cfg).resolve()  # from the usual model cache, before the data dir moves to OUT
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"base": str(base)})})
    arms = [("shaped", links)] + ([("unshaped", [link.unshaped() for link in links])] if compare_unshaped else [])
    results = [WanArm(cfg, out / name, name, arm_links, minutes, log).run() for name, arm_links in arms]
    report = wan_report(results, minutes, machine_kind())
    (out / "wan_report.json").write_text(json.dumps(report, indent=2))
    report_png(report, out / "wan_report.png")
    print(report_table(report) + f"\n\nreport: {out}/wan_report.json, {out}/wan_report.png")
    return 0 if report["audit_ok"] else 1
