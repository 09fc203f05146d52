"""Where a run's keys live, and the signed key registry in Redis (`heterorl keys`).

    <keys_dir>/root.key, root.pub         signs the key registry (keep root.key offline)
    <keys_dir>/learner.key, learner.pub   signs manifests and the policy pointer
    <keys_dir>/samplers/<id>.key          a sampler's key (`heterorl keys add <id>`)
    <keys_dir>/validators/<id>.key        a validator's key (`heterorl keys add <id> --role validator`)

A remote sampler needs only `learner.pub` and its own key file (or HETERORL_SAMPLER_KEY).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import redis

from pipeline.config import ConfigError, HeteroConfig
from pipeline.wire.signing import (KeyFileError, PublicKey, SignatureError, SigningKey, read_key_file, read_public_file,
                              sign_document, write_key_file, write_public_file)
from pipeline.trust import KeyEntry, KeyRegistry
from pipeline.trust.invites import Admissions, GrantBook

SAMPLER_KEY_ENV = "HETERORL_SAMPLER_KEY"
"""A sampler's private key, base64 (what `heterorl keys add --print` shows)."""
VALIDATOR_KEY_ENV = "HETERORL_VALIDATOR_KEY"
"""A validator's private key, base64."""


@dataclass(frozen=True)
class KeyPaths:
    keys_dir: Path
    root_key: Path
    root_public: Path
    learner_key: Path
    learner_public: Path

    def sampler_key(self, sampler_id: str) -> Path:
        return self.role_key(sampler_id, "sampler")

    def role_key(self, holder_id: str, role: str) -> Path:
        """The key file of a sampler or validator (`role`) with this id."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", holder_id):
            raise ConfigError(f"{role} id {holder_id!r} cannot name a key file: use letters, digits, '_', '.', '-'")
        return self.keys_dir / f"{role}s" / f"{holder_id}.key"


def key_paths(cfg: HeteroConfig) -> KeyPaths:
    s = cfg.security
    keys_dir = Path(s.keys_dir or Path(cfg.services.data_dir) / "keys")
    return KeyPaths(keys_dir, keys_dir / "root.key", Path(s.root_public_key or keys_dir / "root.pub"),
                    Path(s.learner_key or keys_dir / "learner.key"),
                    Path(s.learner_public_key or keys_dir / "learner.pub"))


def init_keys(paths: KeyPaths) -> list[Path]:
    """Make the root and learner keys that do not exist yet; returns the files written."""
    written = []
    for private, public in ((paths.root_key, paths.root_public), (paths.learner_key, paths.learner_public)):
        if private.exists():
            key = read_key_file(private)
            if not public.exists():
                written.append(write_public_file(key.public, public))
            continue
        key = SigningKey.generate()
        written += [write_key_file(key, private), write_public_file(key.public, public)]
    return written


def _missing(path: Path, what: str) -> KeyFileError:
    return KeyFileError(f"no {what} at {path}: run `heterorl keys init` (or set security.* to the file)")


def _existing(path: Path, what: str) -> Path:
    if not path.exists():
        raise _missing(path, what)
    return path


def load_root_public(paths: KeyPaths) -> PublicKey:
    return read_public_file(_existing(paths.root_public, "root public key"))


def load_root_key(paths: KeyPaths) -> SigningKey:
    return read_key_file(_existing(paths.root_key, "root key"))


def load_learner_key(paths: KeyPaths) -> SigningKey:
    return read_key_file(_existing(paths.learner_key, "learner key"))


def load_learner_public(paths: KeyPaths) -> PublicKey:
    return read_public_file(_existing(paths.learner_public, "learner public key (samplers pin it)"))


def trusted_learner(cfg: HeteroConfig) -> Optional[PublicKey]:
    """The learner's public key every reader of what the learner signed pins (its checkpoints and
    pointer, its update log and dead letters); None where `security.require_signatures` is off (a
    run recorded before signing: everything is then read as it is). KeyFileError, in one line,
    if signatures are on and the file is missing."""
    return load_learner_public(key_paths(cfg)) if cfg.security.require_signatures else None


def load_sampler_key(paths: KeyPaths, sampler_id: str, configured: Optional[str]) -> SigningKey:
    """HETERORL_SAMPLER_KEY, else security.sampler_key, else <keys_dir>/samplers/<id>.key."""
    if os.environ.get(SAMPLER_KEY_ENV):
        return SigningKey.from_seed_b64(os.environ[SAMPLER_KEY_ENV], where=f"${SAMPLER_KEY_ENV}")
    path = Path(configured) if configured else paths.sampler_key(sampler_id)
    if not path.exists():
        raise KeyFileError(f"no key for sampler {sampler_id!r} at {path}: `heterorl keys add {sampler_id}` makes one "
                           f"(or set {SAMPLER_KEY_ENV} / security.sampler_key)")
    return read_key_file(path)


def load_validator_key(paths: KeyPaths, validator_id: str, configured: Optional[str]) -> SigningKey:
    """HETERORL_VALIDATOR_KEY, else validators.validator_key, else <keys_dir>/validators/<id>.key."""
    if os.environ.get(VALIDATOR_KEY_ENV):
        return SigningKey.from_seed_b64(os.environ[VALIDATOR_KEY_ENV], where=f"${VALIDATOR_KEY_ENV}")
    path = Path(configured) if configured else paths.role_key(validator_id, "validator")
    if not path.exists():
        raise KeyFileError(f"no key for validator {validator_id!r} at {path}: `heterorl keys add {validator_id} "
                           f"--role validator` makes one (or set {VALIDATOR_KEY_ENV} / validators.validator_key)")
    return read_key_file(path)


# ---- the registry in Redis ---------------------------------------------------------------------
def registry_key(run: str) -> str:
    return f"heterorl:{run}:key_registry"


def read_registry(client, run: str, root: PublicKey) -> KeyRegistry:
    """The run's registry as the root key signed it (an empty one if none was written yet);
    SignatureError if what Redis holds is not signed by the root key."""
    raw = client.get(registry_key(run))
    if raw is None:
        return KeyRegistry.empty(run)
    try:
        document = json.loads(raw)
    except ValueError:
        raise SignatureError("the key registry in Redis is not JSON") from None
    return KeyRegistry.from_signed(document, root, run)


def admissions_key(run: str) -> str:
    """The keys the learner admitted under invites, signed by its key (`Admissions`)."""
    return f"heterorl:{run}:admissions"


def join_requests_key(run: str) -> str:
    """The Redis stream of join requests (`heterorl join` adds, the learner decides in order)."""
    return f"heterorl:{run}:join_requests"


def read_admissions(client, run: str, learner: PublicKey) -> Admissions:
    """The admissions the learner signed (empty if none yet); SignatureError if not its."""
    raw = client.get(admissions_key(run))
    if raw is None:
        return Admissions(run)
    try:
        document = json.loads(raw)
    except ValueError:
        raise SignatureError("the admissions in Redis are not JSON") from None
    return Admissions.from_signed(document, learner, run)


class RegistryFollower:
    """A role's copy of the run's signed key registry, re-read from Redis at most every
    `refresh_s` (the learner and validators check seals against it): one not signed by the
    root key, or older (a lower serial) than the copy held, is ignored and logged. With the
    learner's public key (`learner`), the keys it admitted under invites are in it too."""

    def __init__(self, client, run: str, root: PublicKey, refresh_s: float, log, learner: Optional[PublicKey] = None):
        self.client, self.run, self.root, self.refresh_s, self.log = client, run, root, refresh_s, log
        self.learner = learner
        self.registry: Optional[KeyRegistry] = None
        self.admissions = Admissions(run)
        self.read_at = -float("inf")

    def due(self) -> bool:
        """Whether `refresh_s` has passed since the last read."""
        return time.monotonic() - self.read_at >= self.refresh_s

    def refresh(self, force: bool = False) -> Optional[KeyRegistry]:
        """The registry just read if it replaced the one held (None: not due, unreadable or refused)."""
        if not force and not self.due():
            return None
        self.read_at = time.monotonic()
        try:
            registry = read_registry(self.client, self.run, self.root)
        except SignatureError as e:
            self.log.error("ignoring the key registry in Redis: %s; keeping the last valid one", e.reason)
            return None
        except redis.RedisError as e:
            self.log.warning("could not read the key registry (%s); keeping the last one", type(e).__name__)
            return None
        if self.registry is not None and registry.serial < self.registry.serial:
            self.log.error("ignoring an older key registry (serial %d < %d): a rollback", registry.serial,
                           self.registry.serial)
            return None
        if self.learner is not None:
            self.admissions = self._newer_admissions()
            registry = registry.with_admitted(self.admissions.keys)
        self.registry = registry
        return registry

    def _newer_admissions(self) -> Admissions:
        try:
            admissions = read_admissions(self.client, self.run, self.learner)
        except SignatureError as e:
            self.log.error("ignoring the admissions in Redis: %s; keeping the last valid ones", e.reason)
            return self.admissions
        except redis.RedisError as e:
            self.log.warning("could not read the admissions (%s); keeping the last ones", type(e).__name__)
            return self.admissions
        if admissions.serial < self.admissions.serial:
            self.log.error("ignoring older admissions (serial %d < %d): a rollback", admissions.serial,
                           self.admissions.serial)
            return self.admissions
        return admissions


class JoinDesk:
    """The learner's side of invites: decides the join requests received since the last call
    (`GrantBook`, in the order Redis received them) and writes what it admitted, signed by the
    learner's key, with where it read to, so a restarted learner goes on from there with the
    same counts. The root key is not needed."""

    BATCH = 64

    def __init__(self, client, run: str, root: PublicKey, learner: SigningKey, key_lifetime_days: float, log):
        self.client, self.run, self.learner, self.log = client, run, learner, log
        self.root = root
        self.book: Optional[GrantBook] = None
        self.key_lifetime_s = key_lifetime_days * 86400

    def serve(self, registry: Optional[KeyRegistry], quarantined: set[str], now: Optional[float] = None) -> bool:
        """Decide the waiting requests; whether any was (the admissions then changed)."""
        try:
            if self.book is None:  # where the last learner left off
                self.book = GrantBook(self.run, self.root, read_admissions(self.client, self.run, self.learner.public),
                                      self.key_lifetime_s)
            entries = self.client.xrange(join_requests_key(self.run), f"({self.book.admissions.read_to}", "+",
                                         count=self.BATCH)
        except redis.RedisError as e:
            self.log.warning("could not read join requests (%s); trying again", type(e).__name__)
            return False
        except SignatureError as e:  # not ours: never overwritten with an empty book
            self.log.error("the admissions in Redis are not the learner's (%s): no volunteer is admitted", e.reason)
            return False
        if not entries:
            return False
        admissions = self.book.admissions
        registered = {} if registry is None else {k: e for k, e in registry.keys.items() if not e.grant}
        revoked = set() if registry is None else set(registry.revoked_grants)
        now = time.time() if now is None else now
        for entry_id, fields in entries:
            try:
                document = json.loads(fields.get("request", "")) if isinstance(fields, dict) else None
            except ValueError:
                document = None
            key_id, why = self.book.decide(document, now, registered, revoked, quarantined)
            admissions.read_to = entry_id
            if why:
                self.log.warning("join request %s refused: %s", entry_id, why)
            else:
                a = admissions.keys[key_id]
                self.log.info("admitted sampler %r (key %s) with invite %s: %d joined", a["sampler_id"], key_id,
                              a["grant"], admissions.joins[a["grant"]])
        admissions.serial += 1
        self.client.set(admissions_key(self.run), json.dumps(sign_document(admissions.to_document(), self.learner)))
        return True


def write_registry(client, registry: KeyRegistry, root: SigningKey) -> None:
    """Store `registry`, signed; refuses to replace a newer one (a higher serial)."""
    key = registry_key(registry.run)
    with client.pipeline() as pipe:
        pipe.watch(key)
        raw = pipe.get(key)
        if raw is not None and int(json.loads(raw).get("serial", 0)) >= registry.serial:
            raise ConfigError("the key registry changed meanwhile (another `heterorl keys` command?): run it again")
        pipe.multi()
        pipe.set(key, json.dumps(registry.signed(root)))
        pipe.execute()


def add_key(registry: KeyRegistry, sampler_id: str, public: PublicKey, lifetime_days: float,
            now: Optional[float] = None, role: str = "sampler", local: bool = False) -> KeyRegistry:
    """`registry` with `public` registered to `sampler_id` (a validator's id for role `validator`);
    `local`: minted by the run for a process it starts on the learner's machine (`KeyEntry.local`)."""
    now = time.time() if now is None else now
    if public.key_id in registry.keys:
        raise ConfigError(f"key {public.key_id} is already registered (to {registry.keys[public.key_id].sampler_id!r})")
    return registry.with_key(KeyEntry(public.key_id, sampler_id, public, "active", now + lifetime_days * 86400, now,
                                      role=role, local=local))
