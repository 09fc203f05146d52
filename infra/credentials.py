"""The credentials of a local stack, in the files its servers read them from: each role's (made
when the stack starts) and each invite's (made by `heterorl invite`, deleted by its revocation).

Where they live, beside the stack's data (every file 0600, replaced atomically, re-read by its
server when it changes, so a change takes effect within seconds without a restart):

    DATA_DIR/s3-identities.json       the S3 keys of learner, sampler, validator, broker and of each
                                      invite (``infra.s3_identities``; the admin's key is the server's own)
    DATA_DIR/gates/kafka-users.json   the Kafka gate's users: admin, learner, sampler, validator and
                                      each invite (``infra.kafka_gate``; SCRAM verifiers only)
    DATA_DIR/gates/redis-users.json   the Redis gate's users: each invite (``infra.redis_gate``); the
                                      roles have Redis users of their own (``redis/users.acl``)

What each gets is ``infra.access``'s; this module only writes and deletes. An invite's user is
named ``invite-<grant id>`` on every server, so `remove_stranger` finds all three.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from infra import kafka_gate, redis_gate
from infra.access import kafka_gate_grant, redis_gate_grant, s3_grants
from infra.s3_identities import IDENTITIES_FILE, S3Identity, add_identity, read_identities, remove_identity

GATES_DIR = "gates"
KAFKA_USERS = "kafka-users.json"
REDIS_USERS = "redis-users.json"
S3_ROLES = ("learner", "sampler", "validator", "broker")
"""Roles with an S3 key of their own (the admin uses the server's)."""
KAFKA_GATE_ROLES = ("admin", "learner", "sampler", "validator")
"""Roles with a Kafka gate user (for their processes on other machines)."""


def kafka_users_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / GATES_DIR / KAFKA_USERS


def redis_users_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / GATES_DIR / REDIS_USERS


def identities_file(data_dir: str | Path) -> Path:
    return Path(data_dir) / IDENTITIES_FILE


def new_secret() -> str:
    """A password or S3 secret: 192 random bits, URL-safe."""
    return secrets.token_urlsafe(24)


def write_role_credentials(data_dir: str | Path, bucket: str, s3_keys: dict[str, list[str]],
                           gate_passwords: dict[str, str]) -> None:
    """The roles' S3 identities and Kafka gate users, as a stack records them (`StackState.s3_keys`,
    `gate_passwords`); an invite's entries already in the files are kept."""
    path = identities_file(data_dir)
    for role, (access, secret) in s3_keys.items():
        add_identity(path, S3Identity(access, secret, role, s3_grants(role, bucket)), replace=True)
    users = kafka_users_file(data_dir)
    users.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for role, password in gate_passwords.items():
        kafka_gate.add_user(users, role, password, kafka_gate_grant(role))
    redis_users = redis_users_file(data_dir)
    if not redis_users.exists():
        redis_gate.write_users(redis_users, {})


@dataclass(frozen=True)
class StrangerCredentials:
    """What an invite carries for its holder: a user at each gate and an S3 key, all its own."""

    user: str
    kafka_password: str
    redis_password: str
    s3_access_key: str
    s3_secret_key: str


def stranger_user(grant_id: str) -> str:
    return f"invite-{grant_id}"


def add_stranger(data_dir: str | Path, grant_id: str, run: str, rollout_topic: str, joins: int,
                 bucket: str) -> StrangerCredentials:
    """Make the credentials of invite `grant_id` (run `run`, `joins` samplers) on all three servers."""
    user = stranger_user(grant_id)
    made = StrangerCredentials(user, new_secret(), new_secret(), f"heterorl-{user}", new_secret())
    kafka_gate.add_user(kafka_users_file(data_dir), user, made.kafka_password,
                        kafka_gate_grant("stranger", rollout_topic))
    redis_gate.add_user(redis_users_file(data_dir), user, made.redis_password, redis_gate_grant(run, joins))
    add_identity(identities_file(data_dir), S3Identity(made.s3_access_key, made.s3_secret_key, f"stranger {user}",
                                                       s3_grants("stranger", bucket, run)), replace=True)
    return made


def remove_stranger(data_dir: str | Path, grant_id: str) -> list[str]:
    """Delete invite `grant_id`'s credentials everywhere; the servers where there were some. Each
    server refuses them within seconds (the gates close the user's open connections)."""
    user = stranger_user(grant_id)
    removed = []
    if kafka_gate.remove_user(kafka_users_file(data_dir), user):
        removed.append("Kafka")
    if redis_gate.remove_user(redis_users_file(data_dir), user):
        removed.append("Redis")
    if remove_identity(identities_file(data_dir), f"heterorl-{user}"):
        removed.append("S3")
    return removed


def stranger_joins(data_dir: str | Path, grant_id: str) -> int | None:
    """How many samplers invite `grant_id` admits, as its Redis gate user records it (None: it has no
    credentials here)."""
    users = redis_gate.read_users(redis_users_file(data_dir)) if redis_users_file(data_dir).exists() else {}
    user = users.get(stranger_user(grant_id))
    if user is None:
        return None
    return max(user.grant.max_distinct.values(), default=None)


def strangers(data_dir: str | Path) -> list[str]:
    """The grant ids of the invites whose credentials exist."""
    keys = [i.access_key for i in read_identities(identities_file(data_dir))]
    prefix = f"heterorl-{stranger_user('')}"
    return sorted(k[len(prefix):] for k in keys if k.startswith(prefix))
