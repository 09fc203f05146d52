"""`heterorl invite` and `heterorl join`: a volunteer joins a run with one line of text
(pipeline/trust/invites.py says what the line holds; docs/security.md, "Invites", what it lets
its holder do).

`invite` runs where the root key is: it signs a grant (how many may join, until when) and
packs it with what a sampler needs. `join` runs on the volunteer's host: it makes the host's
own key, asks the learner to admit it under the grant (a join request in Redis) and, once
admitted, runs the sampler of the run's config. Running `join` again resumes as the same
sampler: its key, id and spool stay in its directory (`--home`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

import redis
import yaml

from infra.credentials import add_stranger, remove_stranger
from infra.local_stack import gate_bootstrap, load_stack, stranger_services
from pipeline.clients.run_state import RunState, connect_redis
from pipeline.clients.services import ServiceUnavailable, check_reachable, require_services
from pipeline.config import ConfigError, HeteroConfig, config_from_text, dump_config
from pipeline.trust.invites import (Grant, Invite, InviteError, check_not_expired, make_invite, make_join_request,
                                    read_invite)
from pipeline.trust.keyring import (SAMPLER_KEY_ENV, key_paths, load_learner_public, load_root_key,
                                    read_admissions, read_registry, write_registry)
from pipeline.wire.signing import SignatureError, SigningKey, read_key_file, write_key_file, write_public_file

INVITED_SECTIONS = ("services", "security")
"""Config sections the invite sets for the joiner (`--config` / `--set` may not)."""
RUN_SECTIONS = ("run", "model", "task", "sampler", "learner")
"""The run's config sections an invite carries (what a sampler uses; the rest are defaults)."""
SAMPLER_SECURITY = ("require_signatures", "key_lifetime_days")
"""The `security` fields of the run a joiner's sampler is given (paths are the joiner's own)."""
SERVICE_FIELDS = ("kafka_bootstrap", "redis_url", "s3_endpoint", "s3_access_key", "s3_secret_key", "s3_region",
                  "bucket", "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username",
                  "kafka_sasl_password", "kafka_ssl_check_hostname", "s3_cert_check")
CA_FIELDS = ("kafka_ssl_cafile", "redis_ssl_ca_certs", "s3_ca_file")
LOOPBACK = ("127.", "localhost", "[::1]")
OTHER_ROLE_USERS = ("admin", "learner", "validator")
"""Users that heterorl's stacks (local and compose) make for roles other than samplers: an
invite never carries their credentials."""
CREDENTIALS_GONE_S = 5.0
"""Within this the servers refuse an invite's deleted credentials: the gates re-read their users every
second and close the user's connections, the S3 server checks its keys at every request."""
ADMIT_WAIT_S = 120.0
"""How long `join` waits for the learner to decide its request (the learner reads requests
every `security.registry_refresh_s` while it runs)."""


# ---- invite -------------------------------------------------------------------------------
def make_run_invite(cfg: HeteroConfig, sampler_cfg: HeteroConfig, joins: int, hours: float,
                    now: Optional[float] = None) -> tuple[str, Grant, list[str]]:
    """(the invite's text, its grant, lines for the operator) for run `cfg` (as its admin),
    `sampler_cfg` the same run as its sampler role sees it (its Redis user)."""
    if joins < 1 or hours <= 0:
        raise ConfigError(f"--joins {joins} and --hours {hours:g}: an invite admits at least one sampler for some time")
    paths = key_paths(cfg)
    root, learner = load_root_key(paths), load_learner_public(paths)
    services = require_services(sampler_cfg.services)
    refuse_other_roles(services.redis_url, sampler_cfg.services.kafka_sasl_username)
    grant = Grant.new(cfg.run.name, joins, hours * 3600, time.time() if now is None else now)
    gated, lines = invite_services(cfg, services, grant), []
    if gated is None:
        lines.append("these servers are not a local stack with gates: the invite carries the sampler role's own "
                     "credentials, and revoking it ends admission, not access (docs/security.md, \"Invites\")")
    services = gated or services
    fields = {**{k: getattr(sampler_cfg.services, k) for k in SERVICE_FIELDS}, **{
        "kafka_bootstrap": services.kafka_bootstrap, "redis_url": services.redis_url,
        "s3_endpoint": services.s3_endpoint, "s3_access_key": services.s3_access_key,
        "s3_secret_key": services.s3_secret_key, "s3_region": services.s3_region, "bucket": services.bucket}}
    if gated is not None:
        sec = gated.security
        fields.update(kafka_security_protocol=sec.kafka_security_protocol, kafka_sasl_mechanism=sec.kafka_sasl_mechanism,
                      kafka_sasl_username=sec.kafka_sasl_username, kafka_sasl_password=sec.kafka_sasl_password)
    tls = {"kafka_ssl_cafile": sampler_cfg.services.kafka_security_protocol in ("SSL", "SASL_SSL"),
           "redis_ssl_ca_certs": services.redis_url.startswith("rediss://"),
           "s3_ca_file": services.s3_endpoint.startswith("https://")}
    ca_files = {getattr(cfg.services, k) for k in CA_FIELDS if tls[k] and getattr(cfg.services, k)}
    if len(ca_files) > 1:
        raise ConfigError(f"services use {len(ca_files)} CA files ({', '.join(sorted(ca_files))}): an invite "
                          "carries one")
    ca_pem = Path(ca_files.pop()).read_text() if ca_files else None
    everything = yaml.safe_load(dump_config(cfg))
    config = {section: everything[section] for section in RUN_SECTIONS}
    config["security"] = {k: everything["security"][k] for k in SAMPLER_SECURITY}
    text = make_invite(root, grant, services=fields, ca_pem=ca_pem, learner_public=learner, config=config)
    lines = [*lines, f"invite {grant.grant_id} of run {cfg.run.name}: up to {joins} sampler(s) may join until "
             f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(grant.expires_at))}, as strangers (their groups "
             "are checked)",
             "anyone holding it can join: send it privately; end it with "
             f"`heterorl invite --revoke {grant.grant_id}`"]
    if any(services.kafka_bootstrap.startswith(p) or f"@{p}" in services.redis_url or f"//{p}" in services.redis_url
           for p in LOOPBACK):
        lines.append("its servers are on loopback (127.0.0.1): only this machine can join; for other hosts start "
                     "the stack with `heterorl up --host ADDRESS`")
    return text, grant, lines


def invite_services(cfg: HeteroConfig, services, grant: Grant):
    """The servers as invite `grant`'s holder reaches them, with credentials of its own (made here),
    where `services` are a running local stack's: Kafka and Redis through its gates, an S3 key that
    reads only this run's policies (`infra.access`, role `stranger`). None elsewhere (servers of
    your own, docker-compose): the invite then carries the sampler role's credentials."""
    state = load_stack(cfg.services.data_dir)
    if state is None or not (state.kafka_gate and state.redis_gate) or services.kafka_bootstrap not in (
            state.kafka_bootstrap, gate_bootstrap(state)):
        return None
    made = add_stranger(state.data_dir, grant.grant_id, cfg.run.name, cfg.run.topic, grant.max_joins, state.bucket)
    return stranger_services(state, made)


def write_invite_file(path: Path, text: str) -> None:
    """Write the invite to `path`, readable by its owner only (it carries the sampler role's
    credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def read_invite_file(path: Path) -> str:
    """The text of the invite in `path` (`--invite FILE`)."""
    if not path.is_file():
        raise ConfigError(f"--invite {path}: no such file")
    return path.read_text()


def refuse_other_roles(redis_url: str, kafka_user: Optional[str]) -> None:
    """ConfigError if the servers' users named here are another role's: where the variables of
    `heterorl env --role learner` are set (the learner's host, where the root key is), they
    override the local stack's sampler user, and the invite would hand its holder the
    learner's Redis user, which writes every key of the run."""
    for server, user in (("Redis", urlsplit(redis_url).username), ("Kafka", kafka_user)):
        if user in OTHER_ROLE_USERS:
            raise ConfigError(f"the {server} user set here is {user!r}: an invite carries the sampler role's "
                              "credentials, so make it with the sampler's variables loaded (`set -a; . "
                              "./sampler.env; set +a`, from `heterorl env --role sampler`)")


def revoke_invite(cfg: HeteroConfig, client, grant_id: str) -> list[str]:
    """Revoke the invite `grant_id` in the root-signed registry: no key joins with it any more,
    and those that joined with it are revoked."""
    paths = key_paths(cfg)
    root = load_root_key(paths)
    registry = read_registry(client, cfg.run.name, root.public)
    if grant_id in registry.revoked_grants:
        raise ConfigError(f"invite {grant_id} of run {cfg.run.name} is already revoked")
    joined = [k for k in read_admissions(client, cfg.run.name, load_learner_public(paths)).keys.values()
              if k["grant"] == grant_id]
    write_registry(client, registry.with_revoked_grant(grant_id, time.time()), root)
    return [f"revoked invite {grant_id} of run {cfg.run.name}: no key joins with it any more, and its "
            f"{len(joined)} sampler(s) ({', '.join(k['sampler_id'] for k in joined) or 'none'}) are refused within "
            f"security.registry_refresh_s = {cfg.security.registry_refresh_s:g}s", end_access(cfg, grant_id)]


def end_access(cfg: HeteroConfig, grant_id: str) -> str:
    """Delete invite `grant_id`'s credentials on the local stack's servers; a line saying where."""
    servers = remove_stranger(cfg.services.data_dir, grant_id) if load_stack(cfg.services.data_dir) else []
    if not servers:
        return (f"invite {grant_id} has no credentials of its own here (not made on a running local stack): its "
                "holders keep the access those credentials give")
    return (f"deleted invite {grant_id}'s credentials on {', '.join(servers)}: its holders' connections end within "
            f"{CREDENTIALS_GONE_S:g} s")


# ---- join ---------------------------------------------------------------------------------
def join_home(base: Path, invite: Invite) -> Path:
    """Where a joiner keeps its key, id and spool for this run and invite."""
    return base / f"{invite.run}-{invite.grant.grant_id}"


def joined_config(invite: Invite, home: Path, config_file: Optional[str], overrides: list[str]) -> HeteroConfig:
    """The run's config from the invite, with the joiner's `--config` file and `--set` on top
    (anything but `services` and `security`, which the invite and the joiner's key set)."""
    data = json.loads(json.dumps(invite.config))
    if config_file:
        from heterorl.config_files import config_path

        path = config_path(config_file)
        mine = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(mine, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        for section, values in mine.items():
            if section in INVITED_SECTIONS or section == "run":
                raise ConfigError(f"{path}: {section}: the invite sets it (a joiner sets the sampler, model and "
                                  "task fields)")
            data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    for assignment in overrides:
        if assignment.split("=", 1)[0].split(".", 1)[0] in (*INVITED_SECTIONS, "run"):
            raise ConfigError(f"--set {assignment}: the invite sets it (a joiner sets the sampler, model and task "
                              "fields)")
    services = dict(invite.services)
    if invite.ca_pem:
        ca = home / "ca.crt"
        ca.write_text(invite.ca_pem)
        services.update({k: str(ca) for k in CA_FIELDS})
    services["data_dir"] = str(home)
    data["services"] = services
    data["security"] = {**data.get("security", {}), "learner_public_key": str(home / "learner.pub"),
                        "root_public_key": str(home / "root.pub"), "sampler_key": str(home / "sampler.key"),
                        "keys_dir": str(home / "keys")}
    return config_from_text(yaml.safe_dump(data), f"the invite of run {invite.run}", overrides, env={})


def open_home(invite: Invite, base: Path, sampler_id: Optional[str]) -> tuple[Path, SigningKey, str, bool]:
    """(the joiner's directory, its key, its sampler id, whether the learner admitted it from here
    before): made on the first try; on a later one, the same key and id (an --id that differs is an
    error), so a try the learner never answered is asked again as the same host, not a second one."""
    home = join_home(base, invite)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_file, record = home / "sampler.key", home / "joined.json"
    if key_file.exists() and record.exists():
        joined = json.loads(record.read_text())
        if sampler_id and sampler_id != joined["sampler_id"]:
            raise ConfigError(f"this host joined run {invite.run} as {joined['sampler_id']!r} ({home}): run "
                              "`heterorl join` without --id to resume, or with --home DIR to join anew")
        return home, read_key_file(key_file), joined["sampler_id"], bool(joined.get("admitted"))
    key = SigningKey.generate()
    chosen = sampler_id or f"{socket.gethostname().split('.')[0][:40]}-{key.key_id[:8]}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", chosen):
        raise ConfigError(f"--id {chosen!r}: use letters, digits, '_', '.', '-' (128 at most)")
    write_key_file(key, key_file)
    record.write_text(json.dumps({"sampler_id": chosen, "key_id": key.key_id, "grant": invite.grant.grant_id,
                                  "admitted": False}))
    write_public_file(invite.learner_public, home / "learner.pub")
    write_public_file(invite.root_public, home / "root.pub")
    return home, key, chosen, False


def ask_to_join(client, invite: Invite, key: SigningKey, sampler_id: str, wait_s: float = ADMIT_WAIT_S,
                say: Callable[[str], None] = print, now: Callable[[], float] = time.time) -> None:
    """Send the join request (unless the learner admitted this key already) and wait for the
    learner's decision; InviteError with its reason if refused, or if it never decides."""
    run = invite.run
    used_up(client, invite, key)
    ended = client.hget(f"heterorl:{run}:learner", "ended_at")
    if ended not in (None, "null"):
        raise InviteError(f"run {run} ended at {time.strftime('%Y-%m-%d %H:%M', time.localtime(float(ended)))}: "
                          "there is nothing to join")
    try:
        registry = read_registry(client, run, invite.root_public)
    except SignatureError as e:
        raise InviteError(f"this invite is not run {run}'s: its key registry is not signed by the invite's root "
                          f"key {invite.root_public.key_id} ({e.reason})") from None
    if invite.grant.grant_id in registry.revoked_grants:
        raise InviteError(f"the invite {invite.grant.grant_id} of run {run} was revoked")
    entry = registry.keys.get(key.key_id)
    if entry is not None and entry.status == "revoked":
        raise InviteError(f"this host's key {key.key_id} was revoked in run {run}")
    if client.hexists(f"heterorl:{run}:quarantine", key.key_id):
        raise InviteError(f"this host's key {key.key_id} is quarantined in run {run}: its groups failed the checks")
    if _decision(client, invite, key)[0]:
        return
    request = make_join_request(key, invite, sampler_id, socket.gethostname(), now())
    RunState(client, run).request_join(request)
    say(f"asked to join run {run} as {sampler_id} (key {key.key_id}); waiting for the learner to admit it")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        admitted, why = _decision(client, invite, key)
        if admitted:
            return
        if why:
            raise InviteError(f"the learner of run {run} refused to admit this host: {why}")
        time.sleep(0.5)
    raise InviteError(f"the learner of run {run} did not answer within {wait_s:.0f} s: is it running? "
                      "(`heterorl join` again resumes)")


def used_up(client, invite: Invite, key: SigningKey) -> None:
    """InviteError if the learner's signed admissions show the invite's joins all taken by other keys
    (said at once, whether or not the run is still going)."""
    try:
        admissions = read_admissions(client, invite.run, invite.learner_public)
    except SignatureError:
        return  # said by `_decision`, with the learner's reason
    grant = invite.grant
    joined = admissions.joins.get(grant.grant_id, 0)
    if key.key_id not in admissions.keys and joined >= grant.max_joins:
        raise InviteError(f"invite {grant.grant_id} of run {invite.run} is used up ({joined} of {grant.max_joins} "
                          "joined)")


def _decision(client, invite: Invite, key: SigningKey) -> tuple[bool, str]:
    """(admitted, why refused) as the learner's signed admissions say now."""
    try:
        admissions = read_admissions(client, invite.run, invite.learner_public)
    except SignatureError as e:
        raise InviteError(f"the admissions of run {invite.run} are not signed by its learner: {e.reason}") from None
    return key.key_id in admissions.keys, admissions.refused.get(key.key_id, "")


@dataclass(frozen=True)
class Admitted:
    """A host the learner admitted under an invite: what it samples with."""

    invite: Invite
    home: Path
    key: SigningKey
    sampler_id: str
    again: bool
    """Whether it had joined from `home` before (it resumes)."""
    cfg: HeteroConfig
    """The run's config as this host's sampler runs it (`joined_config`)."""
    client: redis.Redis


def be_admitted(text: str, *, base: Path, config_file: Optional[str], overrides: list[str],
                sampler_id: Optional[str], wait_s: float = ADMIT_WAIT_S,
                while_waiting: Optional[Callable[[HeteroConfig, str], None]] = None) -> Admitted:
    """Read the invite, make (or reuse) this host's key and wait until the learner admits it:
    what `heterorl join` does before it samples, and `heterorl adversary --invite` before it lies.
    `while_waiting(cfg, sampler_id)` is called once the servers answer, before asking to join."""
    invite = read_invite(text)
    home, key, sampler_id, again = open_home(invite, base, sampler_id)
    if not again:
        check_not_expired(invite.grant, time.time())
    cfg = joined_config(invite, home, config_file, overrides)
    services = require_services(cfg.services)
    check_reachable(services, cfg.services.connect_timeout_s)
    client = connect_redis(services.redis_url, timeout_s=cfg.services.connect_timeout_s,
                           security=services.security)
    if while_waiting is not None:
        while_waiting(cfg, sampler_id)
    try:
        ask_to_join(client, invite, key, sampler_id, wait_s)
    except redis.RedisError as e:
        raise ServiceUnavailable(f"Redis at {services.public()['redis_url']}: {type(e).__name__}: {e}") from None
    if not again:  # admitted now: a later start resumes, past the invite's expiry too
        record = home / "joined.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "admitted": True}))
    os.environ.pop(SAMPLER_KEY_ENV, None)  # this host's key is the one in its home
    return Admitted(invite, home, key, sampler_id, again, cfg, client)


def join(text: str, *, base: Path, config_file: Optional[str], overrides: list[str], sampler_id: Optional[str],
         run_sampler: Optional[Callable[..., int]] = None, wait_s: float = ADMIT_WAIT_S) -> int:
    """`heterorl join`: read the invite, make (or reuse) this host's key, be admitted, sample.
    The newest policy downloads from when the servers answer, beside the admission
    (`FirstPolicy`); `run_sampler(cfg, sampler_id, policy)` is handed the follower fetching it."""
    first = FirstPolicy()
    try:
        admitted = be_admitted(text, base=base, config_file=config_file, overrides=overrides,
                               sampler_id=sampler_id, wait_s=wait_s, while_waiting=first.start)
    except Exception:  # refused, or no answer: nothing of it stays (Ctrl-C: the next start cleans up)
        first.discard()
        raise
    invite, sampler_id = admitted.invite, admitted.sampler_id
    print(f"joined run {invite.run} as {sampler_id} (key {admitted.key.key_id}, invite {invite.grant.grant_id}); "
          f"{'resuming' if admitted.again else 'fetching the newest policy'}; Ctrl-C leaves (groups not sent stay "
          f"in {admitted.home}/ for the next start)", file=sys.stderr, flush=True)
    if run_sampler is None:
        from producers.sampler import run_sampler
    progress = JoinProgress(RunState(admitted.client, invite.run), sampler_id)
    progress.start()
    try:
        return run_sampler(admitted.cfg, sampler_id, first.follower())
    finally:
        progress.stop.set()
        progress.join(timeout=5)
        print(progress.line(), file=sys.stderr, flush=True)


class FirstPolicy:
    """A volunteer's first policy, downloading on a thread of its own while the learner admits
    the host and the sampler starts (`producers.sampler.fetch_first_policy`, which imports torch:
    not on the admission's way). A host refused leaves nothing behind (`discard`)."""

    def __init__(self):
        self.thread: Optional[threading.Thread] = None
        self.fetched = None
        self.work_dir: Optional[Path] = None

    def start(self, cfg: HeteroConfig, sampler_id: str) -> None:
        self.thread = threading.Thread(target=self._fetch, args=(cfg, sampler_id), name="first-policy", daemon=True)
        self.thread.start()

    def follower(self):
        """The follower fetching it (None: the sampler fetches its own), once it has started."""
        if self.thread is not None:
            self.thread.join()
        return self.fetched

    def _fetch(self, cfg: HeteroConfig, sampler_id: str) -> None:
        from producers.sampler import fetch_first_policy, sampler_work_dir

        self.work_dir = sampler_work_dir(cfg, sampler_id)
        shutil.rmtree(self.work_dir, ignore_errors=True)  # what an earlier start left half-downloaded
        self.fetched = fetch_first_policy(cfg, sampler_id)

    def discard(self) -> None:
        """The host was not admitted: the download is stopped, and what was downloaded goes."""
        if self.thread is not None:
            self.thread.join()
        if self.fetched is not None:
            self.fetched.stop()
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)


class JoinProgress(threading.Thread):
    """One line on screen every `every_s` while a joined sampler runs: the policy it holds,
    the groups it sent and how many of them the learner trained on."""

    def __init__(self, state: RunState, sampler_id: str, every_s: float = 30.0):
        super().__init__(name="join-progress", daemon=True)
        self.state, self.sampler_id, self.every_s = state, sampler_id, every_s
        self.stop = threading.Event()

    def line(self) -> str:
        try:  # once the sampler stopped (the last line), its lease is gone: what it left
            lease = self.state.sampler_lease(self.sampler_id) or self.state.last_of_sampler(self.sampler_id)
            used = self.state.used_by(self.sampler_id)
        except redis.RedisError as e:
            return f"{self.sampler_id}: Redis unreachable ({type(e).__name__}); the sampler retries"
        version = str(lease.get("policy_version"))  # a string in the lease, JSON once it is gone
        return (f"{self.sampler_id}: policy {'v' + version if version not in ('None', '') else 'not loaded yet'}, "
                f"groups sent {lease.get('groups', 0)}, used by the learner {used}")

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            print(self.line(), file=sys.stderr, flush=True)
