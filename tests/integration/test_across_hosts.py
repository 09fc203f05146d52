"""The way across machines, walked as docs/deployment.md ("Across machines without Docker")
and the README ("Across machines") say, on one machine: the servers, the learner, a sampler
and three volunteers each get a host of their own (a Linux network namespace with its own
address on one bridge, as machines on one network), their own working directory, and only the
files and variables the docs give that role. The sampler joins the manual way (`keys new`,
`keys add`, `heterorl sampler`); two volunteers are given only an invite (`heterorl invite`
where the root key is) and join the running run with `heterorl join`: the learner admits them,
uses their groups and checks them as strangers'. The run goes to its end. A sampler given a
wrong credential, and a third volunteer given an expired, an altered and a used-up invite, stop
with one line naming what is wrong.

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
import time
import uuid
from pathlib import Path

import pytest

from infra.netns import add_bridge, add_host, remove_hosts, why_no_namespaces
from pipeline.trust.invites import decode_invite, encode_invite, read_invite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.{}.{}"
HOSTS = ("servers", "learner", "sampler", "volunteer-1", "volunteer-2", "volunteer-3")
VOLUNTEERS = ("volunteer-1", "volunteer-2")
MAX_GROUPS = 14
"""Groups each of the three samplers makes at most: any two of them make fewer (28) than the
run's 32 (8 steps of 4), so each one's groups are used, however fast the others start, and up
to 10 may be dropped as too stale."""

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


class Hosts:
    """Namespaces on one bridge: each host's address is 10.77.N.i, and nothing else is reachable."""

    def __init__(self, names: tuple[str, ...]):
        tag = uuid.uuid4().hex[:4]
        self.net = int(tag, 16) % 200 + 20
        self.bridge = f"hrlbr{tag}"
        self.ns = {name: f"hrl-{tag}-{i}" for i, name in enumerate(names, start=1)}
        self.address = {name: SUBNET.format(self.net, i) for i, name in enumerate(names, start=1)}
        add_bridge(self.bridge)
        for i, name in enumerate(names, start=1):
            add_host(self.ns[name], self.bridge, f"hv{tag}{i}", f"hp{tag}{i}", f"{self.address[name]}/24")

    def run(self, host: str, args: list[str], cwd: Path, env: dict, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *args], cwd=cwd, env=env, text=True,
                              capture_output=True, **kwargs)

    def start(self, host: str, args: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *args], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)

    def close(self) -> None:
        remove_hosts(self.ns.values(), self.bridge)


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


def join_error(refused: subprocess.CompletedProcess) -> str:
    """The one line a refused `heterorl join` prints, after asserting it is one line and exit 2."""
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stdout + refused.stderr
    assert lines[0].startswith("heterorl join: error: "), lines
    return lines[0]


def wait_for(condition, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.5)


def test_a_run_across_hosts_as_the_docs_say(hosts, tmp_path):
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
        # 2. The learner's host: the run's config, its env file; its keys, the sampler's registered.
        (home["learner"] / "run.yaml").write_text(RUN_CONFIG.format(run=run))
        shutil.copy(home["servers"] / "learner.env", home["learner"] / "learner.env")
        learner_env = base | env_file(home["learner"] / "learner.env")
        assert hosts.address["servers"] in learner_env["REDIS_URL"] and "learner:" in learner_env["REDIS_URL"]
        common = ["--config", "run.yaml", "--data-dir", "data"]
        made = hosts.run("learner", heterorl("keys", "init", *common), home["learner"], learner_env, timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        # the sampler makes its own key pair on its own host; only the public half travels
        new = hosts.run("sampler", heterorl("keys", "new", "own.key"), home["sampler"], base, timeout=60)
        assert new.returncode == 0, new.stdout + new.stderr
        public = next(line.split()[-1] for line in new.stdout.splitlines() if "public key" in line)
        added = hosts.run("learner", heterorl("keys", "add", "sampler", "--public-key", public, *common),
                          home["learner"], learner_env, timeout=60)
        assert added.returncode == 0, added.stdout + added.stderr
        learner = hosts.start("learner", heterorl("learner", *common, "--out", "runs/learner"), home["learner"],
                              learner_env, tmp_path / "learner.log")

        # 3. The sampler's host: the run's config, its env file, learner.pub, its own key.
        shutil.copy(home["learner"] / "run.yaml", home["sampler"] / "run.yaml")
        shutil.copy(home["servers"] / "sampler.env", home["sampler"] / "sampler.env")
        shutil.copy(home["learner"] / "data" / "keys" / "learner.pub", home["sampler"] / "learner.pub")
        sampler = hosts.start("sampler", heterorl(
            "sampler", "--config", "run.yaml", "--data-dir", "data", "--id", "sampler", "--key", "own.key",
            "--set", "security.learner_public_key=learner.pub", "--set", f"sampler.max_groups={MAX_GROUPS}"),
            home["sampler"], base | env_file(home["sampler"] / "sampler.env"), tmp_path / "sampler.log")

        # 4. Invites, made where the root key is with the sampler role's variables (what an invite
        # carries): one for two volunteers, one that expires at once. Each volunteer's host gets the
        # invite's file alone, and no variables.
        shutil.copy(home["servers"] / "sampler.env", home["learner"] / "sampler.env")
        invite_env = base | env_file(home["learner"] / "sampler.env")
        for name, hours in (("invite.txt", "1"), ("expired.txt", "0.0001")):
            made = hosts.run("learner", heterorl("invite", *common, "--joins", "2", "--hours", hours, "--out", name),
                             home["learner"], invite_env, timeout=60)
            assert made.returncode == 0, made.stdout + made.stderr
        text = (home["learner"] / "invite.txt").read_text().strip()
        invite = read_invite(text)
        assert invite.services["redis_url"].startswith("redis://sampler:"), "an invite carries the sampler's user"
        volunteers = {}
        for volunteer in VOLUNTEERS:
            shutil.copy(home["learner"] / "invite.txt", home[volunteer] / "invite.txt")
            volunteers[volunteer] = hosts.start(volunteer, heterorl(
                "join", "--invite", "invite.txt", "--home", "joined", "--set", f"sampler.max_groups={MAX_GROUPS}"),
                home[volunteer], base, tmp_path / f"{volunteer}.log")

        # A sampler given a wrong credential: one line naming what is wrong, exit status 2.
        wrong = base | env_file(home["servers"] / "sampler.env")
        wrong["REDIS_URL"] = wrong["REDIS_URL"].replace("sampler:", "sampler:x", 1)
        refused = hosts.run("sampler", heterorl("sampler", "--config", "run.yaml", "--data-dir", "other", "--id",
                                                "sampler", "--key", "own.key", "--set",
                                                "security.learner_public_key=learner.pub"),
                            home["sampler"], wrong, timeout=120)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "refused the credentials" in lines[-1] and hosts.address["servers"] in lines[-1], lines
        assert "Traceback" not in refused.stderr

        # A third volunteer's bad invites: expired, altered (its count raised: the root's signature
        # no longer holds), and, once both volunteers joined, used up. One line each, exit status 2.
        third = home["volunteer-3"]
        shutil.copy(home["learner"] / "expired.txt", third / "expired.txt")
        altered = decode_invite(text)
        altered["grant"]["max_joins"] = 100
        (third / "altered.txt").write_text(encode_invite(altered))
        (third / "invite.txt").write_text(text)

        def join(name: str) -> str:
            return join_error(hosts.run("volunteer-3", heterorl("join", "--invite", name, "--home", name + ".d"),
                                        third, base, timeout=180))

        expired = read_invite((third / "expired.txt").read_text()).grant.grant_id
        assert f"invite {expired} of run {run} expired" in join("expired.txt")
        assert "altered" in join("altered.txt")
        learner_log = tmp_path / "learner.log"
        wait_for(lambda: learner_log.read_text().count("admitted sampler") >= 2 or learner.poll() is not None,
                 "the learner to admit both volunteers")
        assert "is used up (2 of 2 joined)" in join("invite.txt")

        assert learner.wait(timeout=600) == 0, learner_log.read_text()[-3000:]
        # A volunteer still sampling when the run ends is stopped with Ctrl-C on its host: it leaves
        # with its lease released, as one that stopped at its max_groups did.
        for proc in volunteers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for volunteer, proc in volunteers.items():
            assert proc.wait(timeout=60) == 0, (tmp_path / f"{volunteer}.log").read_text()[-3000:]

        # What the learner's host sees: each volunteer with its invite (never `local`), and in Redis
        # the groups of each that the learner trained on and its released lease.
        listed = hosts.run("learner", heterorl("keys", "list", *common), home["learner"], learner_env, timeout=60)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        joined = {}
        for volunteer in VOLUNTEERS:
            said = re.search(rf"joined run {run} as (\S+) \(key (\w+), invite {invite.grant.grant_id}\)",
                             (tmp_path / f"{volunteer}.log").read_text())
            assert said, (tmp_path / f"{volunteer}.log").read_text()[-3000:]
            joined[volunteer] = said.group(1)
            row = next(line for line in listed.stdout.splitlines() if line.startswith(said.group(2)))
            assert row.split()[-1] == invite.grant.grant_id and said.group(1) in row, listed.stdout
            # its last line on screen: the groups it sent, once its lease is gone
            last = (tmp_path / f"{volunteer}.log").read_text().strip().splitlines()[-1]
            assert re.fullmatch(rf"{said.group(1)}: policy v\d+, groups sent [1-9]\d*, used by the learner \d+",
                                last), last
        # The invite revoked from the learner's host: every key that joined with it is listed so.
        revoked = hosts.run("learner", heterorl("invite", "--revoke", invite.grant.grant_id, *common),
                            home["learner"], learner_env, timeout=60)
        assert revoked.returncode == 0 and f"its {len(VOLUNTEERS)} sampler(s)" in revoked.stdout, (
            revoked.stdout + revoked.stderr)
        relisted = hosts.run("learner", heterorl("keys", "list", *common), home["learner"], learner_env, timeout=60)
        rows = [line for line in relisted.stdout.splitlines() if line.endswith(f"{invite.grant.grant_id} (revoked)")]
        assert len(rows) == len(VOLUNTEERS), relisted.stdout
        read = hosts.run("learner", [sys.executable, "-c", REDIS_READ, run, *joined.values()], home["learner"],
                         learner_env, timeout=60)
        assert read.returncode == 0, read.stdout + read.stderr
        redis_seen = json.loads(read.stdout)
    finally:
        for proc in [locals().get("sampler"), *locals().get("volunteers", {}).values()]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
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
    learner_log = (tmp_path / "learner.log").read_text()
    checked = summary["checks"]["logprob_gap_by_sampler"]
    for volunteer, sampler_id in joined.items():
        # admitted by the learner, its groups trained on and their log-probs checked (a stranger's)
        assert f"admitted sampler {sampler_id!r}" in learner_log
        assert redis_seen["used"].get(sampler_id, 0) > 0, (volunteer, redis_seen)
        # and counted as judged, of its id: the fleet's pacing counts what each sent against this
        assert redis_seen["judged"].get(sampler_id, 0) >= redis_seen["used"][sampler_id], (volunteer, redis_seen)
        assert checked.get(sampler_id, {}).get("groups", 0) > 0, (volunteer, checked)
        assert "released_at" in redis_seen["last"][sampler_id], (volunteer, redis_seen)
    # What the learner counts (used, dropped, refused by reason) is where samplers cannot read it
    # (test_invites: the sampler role is refused `learner_stats`); the `learner` hash they read for
    # pacing holds its progress only, so a forger cannot watch its groups' fate there.
    counters = {"groups_used", "groups_dropped", "refused_by_reason", "dropped_by_reason"}
    assert counters <= set(redis_seen["learner_stats"]), redis_seen
    assert not counters & set(redis_seen["learner"]) and "policy_version" in redis_seen["learner"], redis_seen
    # The run was fed from the samplers' hosts, each of which fetched the learner's weights from the
    # servers' host. Which sampler published how many groups is a race, so only the total is asserted.
    published = 0
    for sampler_host in ("sampler", *VOLUNTEERS):
        log = (tmp_path / f"{sampler_host}.log").read_text()
        stopped = re.search(r"stopped after (\d+) groups.*weights_bytes_downloaded (\d+)", log)
        assert stopped and int(stopped.group(2)) > 0, log[-2000:]
        published += int(stopped.group(1))
    assert published >= 32


REDIS_READ = """
import json, os, sys
import redis
client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
prefix = f"heterorl:{sys.argv[1]}:"
last = {s: json.loads(client.hget(prefix + "sampler_last", s) or "{}") for s in sys.argv[2:]}
print(json.dumps({"used": {k: int(v) for k, v in client.hgetall(prefix + "used_by_sampler").items()}, "last": last,
                  "judged": {k: int(v) for k, v in client.hgetall(prefix + "judged_by").items()},
                  "learner": sorted(client.hgetall(prefix + "learner")),
                  "learner_stats": sorted(client.hgetall(prefix + "learner_stats"))}))
"""
