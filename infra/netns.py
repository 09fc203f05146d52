"""Hosts of their own on one machine: Linux network namespaces joined by a bridge, each with its
own address, as machines on one network (`heterorl wan`'s samplers, and the test that walks the
docs' way across machines). Needs root and iproute2; `why_no_namespaces` says what is missing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Iterable, Optional

from pipeline.errors import UserError


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`; UserError naming the command and its error when `check` and it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise UserError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def why_no_namespaces(tools: Iterable[str] = ("ip",)) -> Optional[str]:
    """Why this machine cannot give processes hosts of their own (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    for tool in tools:
        if not shutil.which(tool):
            return f"no `{tool}` command (iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"hrl-probe-{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def add_bridge(bridge: str, address_cidr: Optional[str] = None) -> None:
    ip("link", "add", bridge, "type", "bridge")
    if address_cidr:
        ip("addr", "add", address_cidr, "dev", bridge)
    ip("link", "set", bridge, "up")


def add_host(ns: str, bridge: str, outside: str, inside: str, address_cidr: str) -> None:
    """Namespace `ns` with a veth pair (`outside` on `bridge`, `inside` in `ns` at `address_cidr`)
    and its loopback up."""
    ip("netns", "add", ns)
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", ns)
    ip("link", "set", outside, "master", bridge)
    ip("link", "set", outside, "up")
    ip("-n", ns, "addr", "add", address_cidr, "dev", inside)
    ip("-n", ns, "link", "set", inside, "up")
    ip("-n", ns, "link", "set", "lo", "up")


def remove_hosts(namespaces: Iterable[str], bridge: str) -> None:
    """Kill every process in the namespaces, delete them (their veth pairs go with them) and the bridge."""
    for ns in namespaces:
        for pid in ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", ns, check=False)
    ip("link", "del", bridge, check=False)
