"""`heterorl keys init | add | revoke | list`: the run's root and learner keys and the
root-signed registry of sampler keys in Redis (docs/security.md).

`provision_local` is what `heterorl train` and `heterorl chaos` do for the samplers they
start themselves: keys made if missing, each sampler's key registered.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from pipeline.config import ConfigError, HeteroConfig
from pipeline.trust.keyring import (add_key, init_keys, key_paths, load_learner_public, load_root_key,
                                    load_root_public, read_admissions, read_registry, write_registry)
from pipeline.clients.run_state import connect_redis
from pipeline.clients.services import require_services
from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, read_key_file, write_key_file
from pipeline.trust import KeyEntry, KeyRegistry


def _redis(cfg: HeteroConfig):
    return connect_redis(require_services(cfg.services).redis_url, timeout_s=cfg.services.connect_timeout_s)


def _registry(cfg: HeteroConfig, client) -> KeyRegistry:
    try:
        return read_registry(client, cfg.run.name, load_root_public(key_paths(cfg)))
    except SignatureError as e:
        raise ConfigError(f"the key registry of run {cfg.run.name} in Redis is not valid: {e.reason}") from None


def _with_joined(cfg: HeteroConfig, client, registry: KeyRegistry) -> KeyRegistry:
    """`registry` and the keys the learner admitted under invites (`heterorl join`)."""
    paths = key_paths(cfg)
    if not paths.learner_public.exists():
        return registry
    try:
        return registry.with_admitted(read_admissions(client, cfg.run.name, load_learner_public(paths)).keys)
    except SignatureError as e:
        raise ConfigError(f"the admissions of run {cfg.run.name} in Redis are not the learner's: {e.reason}") from None


def keys_init(cfg: HeteroConfig) -> list[str]:
    paths = key_paths(cfg)
    written = init_keys(paths)
    lines = [f"wrote {p}" for p in written] or [f"keys already in {paths.keys_dir}/ (nothing written)"]
    root, learner = load_root_public(paths), read_key_file(paths.learner_key).public
    lines += [f"root key {root.key_id} (keep {paths.root_key} offline: it signs the sampler key registry)",
              f"learner key {learner.key_id}: give samplers {paths.learner_public} "
              "(security.learner_public_key) so they accept only its checkpoints"]
    return lines


def keys_new(path: Path) -> list[str]:
    """A key pair for a sampler (or validator) of another machine, made there: the private key to
    `path`, the public half printed for the run's operator (`keys add ID --public-key`)."""
    if path.exists():
        raise ConfigError(f"{path} already exists: choose another file")
    key = SigningKey.generate()
    write_key_file(key, path)
    return [f"wrote {path} (mode 0600): give it to the sampler as --key {path} (or validators.validator_key)",
            f"public key {key.public.to_b64()}",
            f"the run's operator registers it with: heterorl keys add ID --public-key {key.public.to_b64()}"]


def keys_add(cfg: HeteroConfig, sampler_id: str, *, public_key: Optional[str] = None, out: Optional[Path] = None,
             lifetime_days: Optional[float] = None, role: str = "sampler") -> list[str]:
    """Register a key for `sampler_id` (a validator's id with `role` validator): the given public
    key, or a new key pair written to `out` (default <keys_dir>/<role>s/<id>.key)."""
    paths = key_paths(cfg)
    root = load_root_key(paths)
    client = _redis(cfg)
    lines = []
    if public_key:
        try:
            public = PublicKey.from_b64(public_key)
        except SignatureError as e:
            raise ConfigError(f"--public-key: {e.reason}") from None
    else:
        target = Path(out) if out else paths.role_key(sampler_id, role)
        if target.exists():
            raise ConfigError(f"{target} already exists: revoke its key first, or pass --out / --public-key")
        key = SigningKey.generate()
        write_key_file(key, target)
        public = key.public
        lines.append(f"wrote {target} (mode 0600): give it to the sampler as security.sampler_key, or its base64 "
                     "key as HETERORL_SAMPLER_KEY" if role == "sampler" else
                     f"wrote {target} (mode 0600): give it to the validator as validators.validator_key, or its "
                     "base64 key as HETERORL_VALIDATOR_KEY")
    days = lifetime_days if lifetime_days is not None else cfg.security.key_lifetime_days
    registry = add_key(_registry(cfg, client), sampler_id, public, days, role=role)
    write_registry(client, registry, root)
    entry = registry.keys[public.key_id]
    lines.append(f"added key {entry.key_id} for {role} {sampler_id!r} to run {cfg.run.name}, expires "
                 f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(entry.expires_at))} (registry serial {registry.serial})")
    return lines


def keys_revoke(cfg: HeteroConfig, name: str) -> list[str]:
    """Revoke every active key whose id or sampler id is `name`."""
    paths = key_paths(cfg)
    root = load_root_key(paths)
    client = _redis(cfg)
    registry = _registry(cfg, client)
    targets = [k for k in _with_joined(cfg, client, registry).find(name) if k.status == "active"]
    if not targets:
        raise ConfigError(f"no active key {name!r} (a key id or sampler id) in run {cfg.run.name}: "
                          "see `heterorl keys list`")
    now = time.time()
    for k in targets:  # a volunteer's key (joined with an invite) is written into the registry as revoked
        registry = registry.with_revoked(k.key_id, now, entry=k)
    write_registry(client, registry, root)
    lines = [f"revoked key {k.key_id} of sampler {k.sampler_id!r} (registry serial {registry.serial}); the learner "
             f"refuses its rollouts within security.registry_refresh_s = {cfg.security.registry_refresh_s:g}s"
             for k in targets]
    return lines + [_end_invite_access(cfg, registry, grant) for grant in sorted({k.grant for k in targets if k.grant})]


def _end_invite_access(cfg: HeteroConfig, registry: KeyRegistry, grant_id: str) -> str:
    """A volunteer's server access is its invite's credentials: they go when every sampler the invite
    admits has joined and been revoked (an invite of one join: with its one volunteer); else a line says
    who keeps them."""
    from heterorl.invites import end_access
    from infra.credentials import stranger_joins

    joined = [k for k in registry.keys.values() if k.grant == grant_id]
    joins = stranger_joins(cfg.services.data_dir, grant_id)
    if joins is not None and len(joined) >= joins and all(k.status == "revoked" for k in joined):
        return end_access(cfg, grant_id)
    return (f"invite {grant_id}'s credentials stay for its other joiners (or joins to come): "
            f"`heterorl invite --revoke {grant_id}` ends them")


def run_registry(cfg: HeteroConfig, client) -> KeyRegistry:
    """The keys every role of the run reads: the root's registry and the learner's admissions."""
    return _with_joined(cfg, client, _registry(cfg, client))


def keys_list(cfg: HeteroConfig) -> list[str]:
    client = _redis(cfg)
    registry = run_registry(cfg, client)
    if not registry.keys:
        return [f"no sampler keys registered for run {cfg.run.name} (heterorl keys add <sampler id>, or "
                "heterorl invite)"]
    now = time.time()
    lines = [f"{'key id':16}  {'role':9}  {'id':24}  {'status':8}  {'expires':16}  invite"]
    for k in sorted(registry.keys.values(), key=lambda k: k.added_at):
        status = k.status if k.status != "active" or now <= k.expires_at else "expired"
        invite = (f"{k.grant}{' (revoked)' if k.grant in registry.revoked_grants else ''}" if k.grant
                  else "local" if k.local else "-")
        lines.append(f"{k.key_id:16}  {k.role:9}  {k.sampler_id:24}  {status:8}  "
                     f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(k.expires_at)):16}  {invite}")
    return lines


def provision_local(cfg: HeteroConfig, client, sampler_ids: list[str], validator_ids: list[str] = (), *,
                    local: bool = True) -> None:
    """For samplers (and validators) started by this machine's `train` / `chaos` (`client`: Redis
    as admin): keys made if missing, and each one's key file written and registered unless an
    active registration of it exists. `local`: the sampler keys are marked as the run's own
    processes (`KeyEntry.local`; `security.trust_local_samplers` decides what that spares them);
    False for samplers that stand for remote ones (`heterorl loadtest`; `heterorl attack`'s
    adversaries join with an invite instead)."""
    if not cfg.security.require_signatures and not validator_ids:
        return
    paths = key_paths(cfg)
    init_keys(paths)
    root = load_root_key(paths)
    registry = _registry(cfg, client)
    changed = False
    wanted = [(i, "sampler") for i in (sampler_ids if cfg.security.require_signatures else [])]
    for sampler_id, role in wanted + [(i, "validator") for i in validator_ids]:
        path = paths.role_key(sampler_id, role)
        key = read_key_file(path) if path.exists() else None
        entry: Optional[KeyEntry] = registry.keys.get(key.key_id) if key else None
        marked = local and role == "sampler"
        if (entry is not None and entry.status == "active" and entry.expires_at > time.time() + 3600
                and entry.local == marked):
            continue
        if key is not None:
            path.unlink()  # revoked, expired or marked otherwise: a fresh key
        key = SigningKey.generate()
        write_key_file(key, path)
        registry = add_key(registry, sampler_id, key.public, cfg.security.key_lifetime_days, role=role, local=marked)
        changed = True
    if changed:
        write_registry(client, registry, root)
