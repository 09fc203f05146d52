"""The way across machines, walked as docs/deployment.md ("Across machines without Docker")
says, on one machine: the servers, the learner and two samplers each get a host of their own
(a Linux network namespace with its own address on one bridge, as machines on one network),
their own working directory, and only the files and variables the docs give that role. The
run goes to its end, both samplers feed it, and a sampler given a wrong credential stops with
one line naming what is wrong.

Network namespaces need root and `ip` (iproute2); where either is missing the test says so
and skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.{}.{}"
HOSTS = ("servers", "learner", "sampler-a", "sampler-b")

RUN_CONFIG = """\
# The run every role is given (docs/deployment.md): names the run, the model and the task.
run:
  name: {run}
model:
  hidden_size: 32
  num_layers: 1
  num_heads: 2
  head_dim: 32
  intermediate_size: 64
  warmup_steps: 20
task:
  eval_size: 20
sampler:
  group_size: 4
  prompts_per_batch: 2
  max_new_tokens: 4
learner:
  groups_per_step: 4
  max_steps: 8
  idle_timeout_s: 120
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_no_namespaces() -> str | None:
    """Why this machine cannot give roles hosts of their own (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if not shutil.which("ip"):
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"hrl-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """Namespaces on one bridge: each host's address is 10.77.N.i, and nothing else is reachable."""

    def __init__(self, names: tuple[str, ...]):
        tag = uuid.uuid4().hex[:4]
        self.net = int(tag, 16) % 200 + 20
        self.bridge = f"hrlbr{tag}"
        self.ns = {name: f"hrl-{tag}-{i}" for i, name in enumerate(names, start=1)}
        self.address = {name: SUBNET.format(self.net, i) for i, name in enumerate(names, start=1)}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names, start=1):
            ns, outside, inside = self.ns[name], f"hv{tag}{i}", f"hp{tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, host: str, args: list[str], cwd: Path, env: dict, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *args], cwd=cwd, env=env, text=True,
                              capture_output=True, **kwargs)

    def start(self, host: str, args: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *args], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    def close(self) -> None:
        for ns in self.ns.values():
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)


def bare_env() -> dict:
    """What a fresh shell on another machine has: no service URLs, no keys, no proxies."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")
    return {k: os.environ[k] for k in keep if k in os.environ} | {"PYTHONUNBUFFERED": "1"}


def env_file(path: Path) -> dict:
    """`set -a; . FILE; set +a`: the `export K=V` lines of `heterorl env`."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            out[key] = value.strip("'\"")
    return out


def heterorl(*args: str) -> list[str]:
    return [sys.executable, "-m", "heterorl", *args]


@pytest.fixture
def hosts():
    why = why_no_namespaces()
    if why:
        pytest.skip(f"roles on hosts of their own need network namespaces: {why}")
    made = Hosts(HOSTS)
    try:
        yield made
    finally:
        made.close()


def test_a_run_across_four_hosts_as_the_docs_say(hosts, tmp_path):
    run = f"across-{uuid.uuid4().hex[:6]}"
    home = {h: tmp_path / h for h in HOSTS}
    for d in home.values():
        d.mkdir()
    base = bare_env() | {"PYTHONPATH": str(ROOT)}

    # 1. The servers' host: the local stack on its own address; one env file per role.
    up = hosts.run("servers", heterorl("up", "--host", hosts.address["servers"], "--data-dir", "stack"),
                   home["servers"], base, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    for role in ("learner", "sampler"):
        made = hosts.run("servers", heterorl("env", "--role", role, "--data-dir", "stack"), home["servers"], base,
                         timeout=60)
        assert made.returncode == 0, made.stderr
        (home["servers"] / f"{role}.env").write_text(made.stdout)
    try:
        # 2. The learner's host: the run's config, its env file; its keys, the samplers' registered.
        (home["learner"] / "run.yaml").write_text(RUN_CONFIG.format(run=run))
        shutil.copy(home["servers"] / "learner.env", home["learner"] / "learner.env")
        learner_env = base | env_file(home["learner"] / "learner.env")
        assert hosts.address["servers"] in learner_env["REDIS_URL"] and "learner:" in learner_env["REDIS_URL"]
        common = ["--config", "run.yaml", "--data-dir", "data"]
        made = hosts.run("learner", heterorl("keys", "init", *common), home["learner"], learner_env, timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        for sampler in ("sampler-a", "sampler-b"):
            # each sampler makes its own key pair on its own host; only the public half travels
            new = hosts.run(sampler, heterorl("keys", "new", "own.key"), home[sampler], base, timeout=60)
            assert new.returncode == 0, new.stdout + new.stderr
            public = next(line.split()[-1] for line in new.stdout.splitlines() if "public key" in line)
            added = hosts.run("learner", heterorl("keys", "add", sampler, "--public-key", public, *common),
                              home["learner"], learner_env, timeout=60)
            assert added.returncode == 0, added.stdout + added.stderr
        learner = hosts.start("learner", heterorl("learner", *common, "--out", "runs/learner"), home["learner"],
                              learner_env, tmp_path / "learner.log")

        # 3. Each sampler's host: the run's config, its env file, learner.pub, its own key.
        samplers = {}
        for sampler in ("sampler-a", "sampler-b"):
            shutil.copy(home["learner"] / "run.yaml", home[sampler] / "run.yaml")
            shutil.copy(home["servers"] / "sampler.env", home[sampler] / "sampler.env")
            shutil.copy(home["learner"] / "data" / "keys" / "learner.pub", home[sampler] / "learner.pub")
            env = base | env_file(home[sampler] / "sampler.env")
            samplers[sampler] = hosts.start(sampler, heterorl(
                "sampler", "--config", "run.yaml", "--data-dir", "data", "--id", sampler,
                "--key", "own.key", "--set", "security.learner_public_key=learner.pub"),
                home[sampler], env, tmp_path / f"{sampler}.log")

        # A sampler given a wrong credential: one line naming what is wrong, exit status 2.
        wrong = base | env_file(home["servers"] / "sampler.env")
        wrong["REDIS_URL"] = wrong["REDIS_URL"].replace("sampler:", "sampler:x", 1)
        refused = hosts.run("sampler-b", heterorl("sampler", "--config", "run.yaml", "--data-dir", "other", "--id",
                                                  "sampler-b", "--key", "own.key", "--set",
                                                  "security.learner_public_key=learner.pub"),
                            home["sampler-b"], wrong, timeout=120)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "refused the credentials" in lines[-1] and hosts.address["servers"] in lines[-1], lines
        assert "Traceback" not in refused.stderr

        assert learner.wait(timeout=600) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    finally:
        for proc in [*locals().get("samplers", {}).values()]:
            proc.send_signal(signal.SIGTERM)
        for proc in [*locals().get("samplers", {}).values()]:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        hosts.run("servers", heterorl("down", "--data-dir", "stack"), home["servers"], base, timeout=60)

    summary = json.loads((home["learner"] / "runs" / "learner" / "learner_summary.json").read_text())
    assert summary["final_step"] == 8 and summary["groups_used"] == 32 and summary["quarantined"] == {}
    assert summary["rejected_by_reason"] == {} and summary["malformed"] == 0
    entries = [json.loads(line) for line in (home["learner"] / "runs" / "learner" / "updates.jsonl").read_text()
               .splitlines()]
    used_by = {g["rollout_id"] for e in entries for g in e.get("used", [])}
    assert len(used_by) == 32  # every group used once
    # The run was fed from the samplers' hosts, each of which fetched the learner's weights from the
    # servers' host. Which sampler published how many groups is a race (a sampler that starts late
    # may find the run ahead of it and stop having published none), so only the total is asserted.
    published = 0
    for sampler in ("sampler-a", "sampler-b"):
        log = (tmp_path / f"{sampler}.log").read_text()
        stopped = re.search(r"stopped after (\d+) groups.*weights_bytes_downloaded (\d+)", log)
        assert stopped and int(stopped.group(2)) > 0, log[-2000:]
        published += int(stopped.group(1))
    assert published >= 32
