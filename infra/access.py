"""Which servers and which credentials each role gets: the one place that says it, for the local
stack (``infra.local_stack``) and for ``docker-compose.yml`` (whose init scripts a test holds to
this module), and the table of docs/security.md ("What each role's credentials can do") is
generated from it (``access_table``; ``tests/unit/test_access.py`` compares them).

The roles:

- ``admin``: the operator (``heterorl up``, ``keys``, ``invite``, ``status``): everything.
- ``learner``: the run's learner: every key of the run in Redis, the checkpoint bucket in S3, every
  topic (it creates them, reads the rollouts and verdicts, writes the update log and dead letters).
- ``sampler``: the operator's own samplers (``heterorl train`` starts them; ``keys add`` registers
  one on another machine). Redis: only through the run functions (``pipeline/clients/run_functions.py``),
  on the sampler keys; read-only on what it paces on. Kafka: produce the rollout topic. S3: read
  and list the checkpoint bucket.
- ``validator``: the operator's validators: read the rollouts, write the verdicts; its leases.
- ``stranger``: a volunteer who joined by an invite. Every server through a gate or a key of its
  invite's own, which ``heterorl invite --revoke`` deletes: Kafka through the Kafka gate (produce
  its run's rollout topic only, records of at most ``MAX_RECORD_BYTES``), Redis through the Redis
  gate (reads of its run's keys, the sampler functions with its run's keys, at most as many
  sampler ids as the invite admits samplers), S3 with a key that reads and lists its run's
  policy versions only.
- ``broker``: the local Kafka-API broker, whose log lives in S3: its bucket only.

Where each role reaches the servers (``Route``): on the stack's own machine every role but the
stranger uses the servers' own ports on loopback; from another machine (``heterorl up --host``)
Kafka only through the gate, as every role (the broker itself listens on loopback only: it
checks no credentials at all), Redis and S3 at their own ports with the role's credentials.
A stranger always goes through the gates, even on loopback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from infra.kafka_gate import KafkaGrant
from infra.redis_gate import FunctionGrant, Grant as RedisGrant
from infra.s3_identities import ADMIN, DELETE, LIST, READ, WRITE, S3Grant
from pipeline.clients.run_functions import (FUNCTION_KEYS, MAX_CALL_INDICES, MAX_FIELDS, MAX_JSON_BYTES,
                                            SAMPLER_FUNCTIONS)
from pipeline.clients.topics import MAX_MESSAGE_BYTES
from pipeline.records.update_log import dead_letter_topic, updates_topic
from pipeline.trust.verdicts import verdicts_topic

ROLES = ("admin", "learner", "sampler", "validator", "stranger", "broker")

MAX_RECORD_BYTES = MAX_MESSAGE_BYTES
"""The largest record a role outside the operator's machine may produce (the product's own
limit: the samplers' producer sends at most this)."""

# ---- Redis: keys under heterorl:<run>: ---------------------------------------------------------

SAMPLER_WRITES = ("sampler:*", "samplers_seen", "sampler_last", "sampler_stats", "sampler_owners", "claims",
                  "reissue", "prompt_cursor", "claim_stats", "claim_counts", "reissued_from", "completed_by",
                  "discarded_by", "claims_sweep", "meta", "join_requests")
"""What the run functions a sampler calls write (pipeline/clients/run_functions.py): the sampler role
needs write access to them for its functions to run (Redis checks the caller's ACL inside them),
and a stranger, which has no Redis user of its own, reaches them only through those functions."""
SAMPLER_READS = ("policy", "learner", "key_registry", "quarantine", "admissions", "used_by_sampler", "judged_by")
"""What a sampler only reads: the learner's and the root's (signed), its count of groups used and
the learner's count of each sampler's groups judged (the fleet's pacing)."""
VALIDATOR_WRITES = ("validator:*", "partition_lease:*", "validator_offsets", "validator_stats")
"""A validator's lease, the partition leases and where its verdicts end (consumers/validator.py)."""

_ROLE_COMMANDS = "-@all +@connection +@read +@write +@transaction -@dangerous -@admin -@scripting +fcall +fcall_ro +time"
"""Every role but the admin: no FLUSHALL/KEYS/CONFIG/ACL/DEBUG/SHUTDOWN/MONITOR or other admin
command, and no script of its own (EVAL, SCRIPT, FUNCTION): the run functions are called with
FCALL (the learner loads them: `+function|load`)."""

STRANGER_READS = (*SAMPLER_READS, "claims", "claim_stats", "claim_counts", "completed_by", "discarded_by",
                  "samplers_seen", "sampler:*", "sampler_last", "sampler_stats")
"""What a stranger's sampler reads through the Redis gate: what it paces on, and its own lease and
stats (`heterorl join` shows them)."""


def redis_acl_rules(role: str, redis_version: tuple[int, int]) -> str:
    """`role`'s Redis ACL rules (keys and commands), without user name and password.

    Redis >= 7 (and Valkey, the local stack's) gets read-only key patterns (``%R~``) for what a
    sampler only reads; an older Redis has none, so there a sampler can write those keys too (the
    pointer is signed by the learner's key, and a malformed one is "nothing new" to every reader)."""
    if role == "admin":
        return "~* &* +@all"
    if role == "learner":
        return f"resetkeys ~heterorl:* resetchannels {_ROLE_COMMANDS} +function|load"
    if role not in ("sampler", "validator"):
        raise ValueError(f"role {role!r} has no Redis user of its own; users: admin, learner, sampler, validator")
    writes = " ".join(f"~heterorl:*:{key}" for key in (SAMPLER_WRITES if role == "sampler" else VALIDATOR_WRITES))
    read_only = "%R~" if redis_version >= (7, 0) else "~"
    reads = " ".join(f"{read_only}heterorl:*:{key}" for key in SAMPLER_READS)
    return f"resetkeys {writes} {reads} resetchannels {_ROLE_COMMANDS}"


STRANGER_FUNCTIONS = tuple(name for name in SAMPLER_FUNCTIONS if name != "hr_epoch_size")
"""The run functions a stranger may call (the epoch size is the operator's samplers' to record)."""
JOIN_REQUESTS_PER_SAMPLER = 4
"""Join requests a stranger may send through the Redis gate per sampler its invite admits (a
request that is refused may be sent again; a flood would push others' requests out of the stream)."""


MAX_FUNCTION_ARGS = max(4 + 2 * MAX_FIELDS, 2 + MAX_CALL_INDICES)
"""Arguments after the keys a stranger's call may carry: a heartbeat's lease fields, or the prompt
indices of one `hr_complete` (RunState sends no more than that)."""


def redis_gate_grant(run: str, samplers: int) -> RedisGrant:
    """A stranger's grant at the Redis gate: reads of its run's keys, the sampler functions with its
    run's keys (arguments as large as a lease's last info or a join request), and at most `samplers`
    sampler ids (the invite's joins)."""
    prefix = f"heterorl:{run}:"
    functions = {name: FunctionGrant(tuple(prefix + k for k in FUNCTION_KEYS[name]), max_args=MAX_FUNCTION_ARGS,
                                     max_arg_bytes=MAX_JSON_BYTES,
                                     max_calls=JOIN_REQUESTS_PER_SAMPLER * samplers if name == "hr_join_request" else None)
                 for name in STRANGER_FUNCTIONS}
    return RedisGrant(read_keys=tuple(prefix + k for k in STRANGER_READS), functions=functions,
                      max_distinct={prefix + "sampler:*": samplers})


# ---- Kafka -------------------------------------------------------------------------------------

def kafka_gate_grant(role: str, rollout_topic: str = "*.rollouts") -> KafkaGrant:
    """What `role` may do through the Kafka gate, for the run whose rollout topic is `rollout_topic`
    (a glob: `*.rollouts`, every run's, for the stack's role users; a run with a rollout topic of
    another name gets an invite's user, or runs its samplers on the stack's machine)."""
    if role in ("admin", "learner"):
        return KafkaGrant(everything=True)
    if role in ("sampler", "stranger"):
        return KafkaGrant(produce=frozenset({rollout_topic}), max_record_bytes=MAX_RECORD_BYTES)
    if role == "validator":
        return KafkaGrant(produce=frozenset({verdicts_topic(rollout_topic)}), fetch=frozenset({rollout_topic}),
                          max_record_bytes=MAX_RECORD_BYTES)
    raise ValueError(f"role {role!r} has no Kafka user")


# ---- S3 ----------------------------------------------------------------------------------------

def s3_grants(role: str, bucket: str, run: Optional[str] = None) -> tuple[S3Grant, ...]:
    """What `role`'s S3 key may do: `bucket` holds the checkpoints (`<bucket>-kafka` the broker's
    log); `run` (a stranger's) narrows a reader to that run's policy versions."""
    if role == "admin":
        return (S3Grant("*", "", frozenset({ADMIN})),)
    if role == "learner":
        return (S3Grant(bucket, "", frozenset({READ, LIST, WRITE, DELETE})),)
    if role == "broker":
        return (S3Grant(broker_bucket(bucket), "", frozenset({READ, LIST, WRITE, DELETE})),)
    if role in ("sampler", "validator"):
        return (S3Grant(bucket, "", frozenset({READ, LIST})),)
    if role == "stranger":
        if not run:
            raise ValueError("a stranger's S3 key is for one run")
        return (S3Grant(bucket, f"{run}/", frozenset({LIST})), S3Grant(bucket, f"{run}/v", frozenset({READ})))
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def broker_bucket(bucket: str) -> str:
    """The bucket where the local broker keeps its log."""
    return f"{bucket}-kafka"


# ---- the table of docs/security.md ------------------------------------------------------------

TESTED_BY = {
    ("learner", "Kafka"): "tests/integration/test_kafka_gate.py::test_a_grant_of_everything_creates_topics_and_reads_and_writes_any",
    ("sampler", "Kafka"): "tests/integration/test_kafka_gate.py::test_topic_globs_grant_every_run_s_rollouts_and_nothing_else",
    ("validator", "Kafka"): "tests/integration/test_kafka_gate.py::test_a_validator_writes_its_verdicts_but_not_rollouts",
    ("stranger", "Kafka"): "tests/integration/test_stranger.py::test_rows_1_to_4_and_12_kafka",
    ("learner", "Redis"): "tests/integration/test_service_auth.py::test_sampler_cannot_flush_configure_or_write_outside_its_keys",
    ("sampler", "Redis"): "tests/integration/test_run_functions.py::test_the_sampler_user_runs_no_script_of_its_own_and_cannot_load_one",
    ("validator", "Redis"): "tests/integration/test_service_auth.py::test_sampler_cannot_flush_configure_or_write_outside_its_keys",
    ("stranger", "Redis"): "tests/integration/test_stranger.py::test_rows_7_to_11_redis",
    ("learner", "S3"): "tests/integration/test_service_auth.py::test_each_role_s_s3_key_does_its_part_and_no_more",
    ("sampler", "S3"): "tests/integration/test_service_auth.py::test_each_role_s_s3_key_does_its_part_and_no_more",
    ("validator", "S3"): "tests/integration/test_service_auth.py::test_each_role_s_s3_key_does_its_part_and_no_more",
    ("stranger", "S3"): "tests/integration/test_stranger.py::test_rows_5_and_6_s3",
    ("broker", "S3"): "tests/integration/test_service_auth.py::test_each_role_s_s3_key_does_its_part_and_no_more",
}
"""The test that tries each row's "cannot" against the real servers."""


@dataclass(frozen=True)
class Row:
    role: str
    server: str
    can: str
    cannot: str
    tested_by: str


def access_rows(run: str = "<run>", bucket: str = "heterorl") -> list[Row]:
    """One row per role and server: what its credentials can and cannot do, read off the grants above."""
    topic = f"{run}.rollouts"
    rows = []
    for role in ("learner", "sampler", "validator", "stranger"):
        grant = kafka_gate_grant(role, topic if role == "stranger" else "*.rollouts")
        if grant.everything:
            can, cannot = "every request: it creates the run's topics, reads and writes them", "-"
        else:
            parts = [f"produce {', '.join(sorted(grant.produce))}"] + (
                [f"read {', '.join(sorted(grant.fetch))}"] if grant.fetch else [])
            can = "; ".join(parts) + f" (records of at most {grant.max_record_bytes >> 20} MiB)"
            cannot = ("any other topic (the update log, the dead letters, another run's), create, delete or "
                      "alter a topic, an admin or consumer-group request, a larger record")
        where = " (through the gate)" if role == "stranger" else " (through the gate from another machine)"
        rows.append(Row(role, "Kafka" + where, can, cannot, TESTED_BY[(role, "Kafka")]))
    for role in ("learner", "sampler", "validator"):
        if role == "learner":
            can, cannot = "read and write every key of its runs; load the run functions", \
                "run a script of its own (EVAL); admin commands (FLUSHALL, CONFIG, KEYS, ACL)"
        else:
            writes = ", ".join(SAMPLER_WRITES if role == "sampler" else VALIDATOR_WRITES)
            can = (f"through the run functions: {writes}" if role == "sampler" else writes) + \
                f"; read {', '.join(SAMPLER_READS)}"
            cannot = (f"write {', '.join(SAMPLER_READS)}; run a script of its own (EVAL, FUNCTION); read "
                      "learner_stats; admin commands (FLUSHALL, CONFIG, KEYS, ACL)")
        rows.append(Row(role, "Redis", can, cannot, TESTED_BY[(role, "Redis")]))
    rows.append(Row("stranger", "Redis (through the gate)",
                    f"read {', '.join(STRANGER_READS)} of its run; call the sampler functions with its run's keys, "
                    "for as many sampler ids as its invite admits",
                    "any other write (RPUSH, HSET, DEL...); another run's keys; EVAL, SCAN, KEYS, MULTI, CONFIG; a "
                    "request over the gate's size limit; another sampler's lease, claims or stats (a function acts only for the "
                    "token an id was first held with); more sampler ids than its invite admits",
                    TESTED_BY[("stranger", "Redis")]))
    for role in ("learner", "sampler", "validator", "stranger", "broker"):
        grants = s3_grants(role, bucket, run)
        can = "; ".join(f"{'+'.join(sorted(g.actions))} s3://{g.bucket}/{g.prefix}" for g in grants)
        cannot = {"learner": f"the broker's bucket {broker_bucket(bucket)}",
                  "sampler": "write or delete; the broker's bucket",
                  "validator": "write or delete; the broker's bucket",
                  "stranger": f"write, delete, list outside {run}/, read outside {run}/v*, the learner's states; "
                              "the broker's bucket",
                  "broker": f"the checkpoint bucket {bucket}"}[role]
        rows.append(Row(role, "S3", can, cannot, TESTED_BY[(role, "S3")]))
    return rows


def access_table(run: str = "<run>", bucket: str = "heterorl") -> str:
    """`access_rows` as the Markdown table docs/security.md holds."""
    lines = ["| role | server | can | cannot | tried by |", "|---|---|---|---|---|"]
    lines += [f"| {r.role} | {r.server} | {r.can} | {r.cannot} | `{r.tested_by}` |" for r in access_rows(run, bucket)]
    return "\n".join(lines)
