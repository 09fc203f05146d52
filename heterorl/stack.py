"""Which servers a command uses: the configured ones, else a running local stack, else a new one.

Roles (`producers/`, `consumers/`) only ever see a config whose `services` name every
server; the commands fill it here. `with_local_stack` completes a config from the
stack recorded in `services.data_dir`, if one runs; `services_for_run` is what `train`
and `study` do: use what is there, or start a local stack for the run and stop it
afterwards (unless asked to keep it), or leave that to the last run still using it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

from infra.local_stack import load_stack, stack_services, start_stack, stop_stack
from pipeline.config import HeteroConfig
from pipeline.clients.services import Services, resolve_services

log = logging.getLogger(__name__)


def local_stack_services(data_dir: str, role: str = "admin") -> Optional[Services]:
    """The servers of the local stack running in `data_dir`, if any, as its Redis user `role`
    (`admin`, `learner` or `sampler`; infra.local_stack.REDIS_ROLES)."""
    state = load_stack(data_dir)
    return None if state is None else stack_services(state, role)


def resolved_services(cfg: HeteroConfig, role: str = "admin") -> Optional[Services]:
    """The configured servers, completed by a running local stack; None if neither suffices."""
    return resolve_services(cfg.services, local_stack_services(cfg.services.data_dir, role))


def with_services(cfg: HeteroConfig, services: Services) -> HeteroConfig:
    """`cfg` whose `services` name exactly these servers (what came from a local stack is
    marked, so that a saved config does not pin its ports)."""
    values = {"kafka_bootstrap": services.kafka_bootstrap, "redis_url": services.redis_url,
              "s3_endpoint": services.s3_endpoint, "s3_access_key": services.s3_access_key,
              "s3_secret_key": services.s3_secret_key, "s3_region": services.s3_region, "bucket": services.bucket}
    filled = cfg.services.model_copy(update=values)
    if services.from_local_stack:
        filled._configured = {k: getattr(cfg.services, k) for k, v in values.items() if getattr(cfg.services, k) != v}
    return cfg.model_copy(update={"services": filled})


def with_local_stack(cfg: HeteroConfig, role: str = "admin") -> HeteroConfig:
    """`cfg` completed by the local stack running in its data dir (Redis as user `role`);
    unchanged if there is none (the role then names the missing servers in its one-line error)."""
    services = resolved_services(cfg, role)
    return cfg if services is None else with_services(cfg, services)


USERS_DIR = "stack-users"
"""In a local stack's data dir: one file per command running on it (named by its pid), so
that a run which started the stack leaves it to the last one still using it."""
STOP_WHEN_UNUSED = "stack-stop-when-unused"
"""In the data dir: the run that started the stack has ended; the last user out stops it."""


def _live_users(users: Path) -> list[Path]:
    alive = []
    for entry in users.glob("*-*"):
        try:
            os.kill(int(entry.name.split("-")[0]), 0)
            alive.append(entry)
        except (ValueError, ProcessLookupError):
            entry.unlink(missing_ok=True)  # a run that died without saying so
        except PermissionError:
            alive.append(entry)
    return alive


@contextlib.contextmanager
def services_for_run(cfg: HeteroConfig, keep: bool = False) -> Iterator[tuple[HeteroConfig, Services, bool]]:
    """(the config completed with servers for a run, those servers, whether a local stack
    was started for it): a local stack is started in `services.data_dir` if no servers are
    configured or running, and stopped on the way out unless `keep` -- or, while other runs
    still use it (a second `train` beside the first), by the last of them to end."""
    services = resolved_services(cfg)
    started = services is None
    users = Path(cfg.services.data_dir) / USERS_DIR
    marker = Path(cfg.services.data_dir) / STOP_WHEN_UNUSED
    if started:
        log.info("no servers configured: starting the local stack in %s/", cfg.services.data_dir)
        ports = cfg.services.local_stack
        start_stack(cfg.services.data_dir, kafka_port=ports.kafka_port, redis_port=ports.redis_port,
                    s3_port=ports.s3_port, external_kafka=cfg.services.kafka_bootstrap)
        services = resolved_services(cfg)
        marker.unlink(missing_ok=True)  # from a stack before this one
    me = None
    if services.from_local_stack:
        users.mkdir(parents=True, exist_ok=True)
        me = users / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        me.touch()
    try:
        yield with_services(cfg, services), services, started
    finally:
        if me is not None:
            me.unlink(missing_ok=True)
        others = _live_users(users) if me is not None else []
        if started and keep:
            print(f"local stack left running in {cfg.services.data_dir}/ (`heterorl status --json`, "
                  f"`heterorl down`)", file=sys.stderr)
        elif started and others:
            marker.touch()
            log.info("local stack in %s/ left running for the %d other run(s) using it; the last one stops it",
                     cfg.services.data_dir, len(others))
        elif started or (me is not None and not others and marker.exists()):
            stop_stack(cfg.services.data_dir)
            marker.unlink(missing_ok=True)


def as_role(services: Services, data_dir: str, role: str) -> Services:
    """`services` for a process of `role`: if they are the admin's of the local stack in `data_dir`,
    that stack's `role` user and key instead (least privilege: `infra.access`); otherwise unchanged."""
    state = load_stack(data_dir)
    if state is None or services.redis_url != stack_services(state).redis_url:
        return services
    own = stack_services(state, role)
    s3_is_the_stack_s = services.s3_endpoint == state.s3_endpoint
    return replace(services, redis_url=own.redis_url,
                   s3_access_key=own.s3_access_key if s3_is_the_stack_s else services.s3_access_key,
                   s3_secret_key=own.s3_secret_key if s3_is_the_stack_s else services.s3_secret_key)
