"""The stranger of `heterorl attack`: the holder of an invite of its own, who tries during the run
everything issue 77's review did with an invite alone, against the servers underneath the
application's checks, and is then revoked.

What it tries (`ROWS`; each attempt is recorded with the server's answer, `refused: ...`, or
`accepted`, which is a failure of the gates):

 1. a 9 MB record (gzip) to the rollout topic;
 2. a record that is no JSON to the update log;
 3. a forged rewind to the update log, forged dead letters;
 4. deleting the rollout topic;
 5. reading, deleting and rewriting the broker's log in S3 (its bucket);
 6. deleting the run's checkpoints;
 7. a lease with no expiry, then 100,000 claims under a lease of its own (bounded: what it holds
    counts as one batch of the fleet's; outcome `bounded: ...`);
 8. pushing `abc` into the re-issue queue;
 9. `EVAL "while true do end"`;
10. pushing one prompt into the re-issue queue 3,000 times;
11. a 200 MB value, another run's keys, an honest sampler's lease, the run's `meta`;
12. a topic of 10,000 partitions;
13. after the operator revokes its invite (`revoke`, at `revoke_after_s`): how long until Kafka,
    Redis and S3 each refuse its credentials (target: all three within `REVOKED_WITHIN_S`).

Rows 1-4, 8-11 are tried again every `every_s`, so they meet a run under way, not only its start;
the lease of row 7 is renewed until the revocation, holding its claims the whole time.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import threading
import time
from typing import Callable, Optional

import redis
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from minio import Minio
from minio.deleteobjects import DeleteObject

from pipeline.clients.run_functions import sampler_token
from pipeline.clients.run_state import RunState
from pipeline.records.update_log import dead_letter_topic, rewind_entry, updates_topic

log = logging.getLogger("attack.stranger")

ROWS = {1: "a 9 MB record to the rollout topic", 2: "no JSON to the update log",
        3: "a forged rewind and forged dead letters", 4: "delete the rollout topic",
        5: "the broker's log in S3 (read, delete, rewrite)", 6: "delete the run's checkpoints",
        7: "a lease with no expiry; 100,000 claims", 8: "RPUSH reissue abc", 9: "EVAL while true do end",
        10: "RPUSH reissue 7 x 3000", 11: "a 200 MB value; another run's keys; an honest lease; meta",
        12: "a topic of 10,000 partitions", 13: "revoked: its credentials refused"}
REPEATED = (1, 2, 3, 4, 8, 9, 10, 11)
REVOKED_WITHIN_S = 30.0


def every_one_refused(*attempts: Callable[[], object]) -> None:
    """Try each; return (the row was accepted) if any went through, else raise the first refusal."""
    refusals = []
    for attempt in attempts:
        try:
            attempt()
        except Exception as e:  # noqa: BLE001 - a refusal: the next one
            refusals.append(e)
            continue
        return
    raise refusals[0]


class Stranger(threading.Thread):
    """`services`: the invite's servers and credentials (`pipeline.trust.invites.Invite.services`);
    `revoke`: what the operator does to revoke the invite (`heterorl invite --revoke`)."""

    def __init__(self, services: dict, run: str, rollout_topic: str, honest_id: str, *,
                 revoke: Callable[[], object], revoke_after_s: float, every_s: float = 20.0):
        super().__init__(name="stranger", daemon=True)
        self.services, self.run_name, self.topic, self.honest_id = services, run, rollout_topic, honest_id
        self.revoke, self.revoke_after_s, self.every_s = revoke, revoke_after_s, every_s
        self.stopped = threading.Event()
        self.outcomes: dict[int, list[str]] = {row: [] for row in ROWS}
        self.revoked_after: dict[str, float] = {}
        self.sampler_id = f"{run}-stranger"

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        started = time.monotonic()
        state = RunState(self._redis(), self.run_name)
        state.hold_as(self.sampler_id, sampler_token(self.run_name, self.sampler_id, os.urandom(32)))
        self._try(7, lambda: self.hoard(state))
        for row in (5, 6, 12):
            self._try(row, getattr(self, f"row_{row}"))
        while not self.stopped.is_set() and time.monotonic() - started < self.revoke_after_s:
            for row in REPEATED:
                self._try(row, getattr(self, f"row_{row}"))
            self._try(7, lambda: state.renew_sampler_lease(self.sampler_id, {"host": "stranger"}, 30.0) or
                      "bounded: its lease renewed, its claims held")
            self.stopped.wait(self.every_s)
        if not self.stopped.is_set():
            try:
                self.revoked(time.monotonic())
            except Exception as e:  # noqa: BLE001 - a revocation not measured is a target missed, said
                self.outcomes[13].append(f"accepted: not measured ({type(e).__name__}: {e})")

    def _try(self, row: int, attempt: Callable[[], object]) -> None:
        try:
            said = attempt()
            outcome = said if isinstance(said, str) and said.startswith("bounded") else "accepted"
        except Exception as e:  # noqa: BLE001 - every answer but success is a refusal, said
            outcome = f"refused: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        if outcome == "accepted":
            log.error("stranger: row %d (%s) was accepted", row, ROWS[row])
        self.outcomes[row].append(outcome)

    # ---- its clients --------------------------------------------------------------------
    def _kafka(self) -> dict:
        s = self.services
        return dict(bootstrap_servers=s["kafka_bootstrap"], security_protocol=s["kafka_security_protocol"],
                    sasl_mechanism=s["kafka_sasl_mechanism"], sasl_plain_username=s["kafka_sasl_username"],
                    sasl_plain_password=s["kafka_sasl_password"])

    def _produce(self, topic: str, value: bytes) -> None:
        sink = KafkaProducer(acks="all", retries=0, request_timeout_ms=3000, delivery_timeout_ms=5000, max_block_ms=5000,
                             max_request_size=32 << 20, **self._kafka())
        try:
            sink.send(topic, value).get(timeout=10)
        finally:
            sink.close(timeout=10)

    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.services["redis_url"], protocol=2, decode_responses=True, socket_timeout=10)

    def _s3(self) -> Minio:
        s = self.services
        return Minio(s["s3_endpoint"].split("://")[1], s["s3_access_key"], s["s3_secret_key"],
                     secure=s["s3_endpoint"].startswith("https"), region=s["s3_region"])

    # ---- the rows -----------------------------------------------------------------------
    def row_1(self) -> None:
        self._produce(self.topic, gzip.compress(os.urandom(9 << 20), compresslevel=1))

    def row_2(self) -> None:
        self._produce(updates_topic(self.topic), b"this is not json")

    def row_3(self) -> None:
        self._produce(updates_topic(self.topic), rewind_entry(0, "gepo", attempt="stranger").to_json().encode())
        self._produce(dead_letter_topic(self.topic), json.dumps({"schema": 2, "source_topic": self.topic,
                                                                 "partition": 0, "offset": 0}).encode())

    def row_4(self) -> None:
        admin = KafkaAdminClient(request_timeout_ms=5000, **self._kafka())
        try:
            admin.delete_topics([self.topic])
        finally:
            admin.close()

    def row_5(self) -> None:
        s3, bucket = self._s3(), f"{self.services['bucket']}-kafka"
        every_one_refused(lambda: next(iter(s3.list_objects(bucket, recursive=True)), None),
                          lambda: s3.remove_object(bucket, "clusters/tansu_cluster/topics"),
                          lambda: s3.put_object(bucket, "clusters/watermark", io.BytesIO(b"0"), 1))

    def row_6(self) -> None:
        s3, bucket, v0 = self._s3(), self.services["bucket"], f"{self.run_name}/v0/manifest.json"
        names = [o.object_name for o in s3.list_objects(bucket, prefix=f"{self.run_name}/", recursive=True)]

        def delete_all() -> None:
            errors = list(s3.remove_objects(bucket, [DeleteObject(n) for n in names or [v0]]))
            if errors:
                raise PermissionError(f"{len(errors)} of {len(names or [v0])} deletes refused: {errors[0].code}")

        every_one_refused(delete_all, lambda: s3.remove_object(bucket, v0))

    def hoard(self, state: RunState) -> str:
        try:  # "no expiry"
            state.renew_sampler_lease(self.sampler_id, {"host": "stranger"}, 10**9)
        except Exception as e:  # noqa: BLE001
            self.outcomes[7].append(f"refused: {type(e).__name__}: {e}")
        state.renew_sampler_lease(self.sampler_id, {"host": "stranger"}, 30.0)
        held = [i for _ in range(100) for i in state.claim_prompts(self.sampler_id, 1024)]
        return f"bounded: {len(held)} of 100,000 claims held, counted as one batch in the fleet's pacing"

    def row_8(self) -> None:
        self._redis().rpush(f"heterorl:{self.run_name}:reissue", "abc")

    def row_9(self) -> None:
        self._redis().eval("while true do end", 0)

    def row_10(self) -> None:
        self._redis().rpush(f"heterorl:{self.run_name}:reissue", *["7"] * 3000)

    def row_11(self) -> None:
        prefix = f"heterorl:{self.run_name}:"
        every_one_refused(lambda: self._redis().hset(prefix + "sampler_stats", "x", "y" * (200 << 20)),
                          lambda: self._redis().hset(prefix + "meta", "rollout_topic", "evil"),
                          lambda: self._redis().hgetall("heterorl:another-run:policy"),
                          lambda: RunState(self._redis(), self.run_name).renew_sampler_lease(self.honest_id,
                                                                                            {"host": "x"}, 30))

    def row_12(self) -> None:
        admin = KafkaAdminClient(request_timeout_ms=5000, **self._kafka())
        try:
            admin.create_topics([NewTopic(f"{self.run_name}.evil", num_partitions=10_000, replication_factor=1)])
        finally:
            admin.close()

    # ---- row 13 -------------------------------------------------------------------------
    def revoked(self, since: float) -> None:
        """Revoke, then try each server until it refuses (at most `REVOKED_WITHIN_S` + 10 s); Kafka with
        a producer logged in before, which the gate must cut off, and sends that give up in 2 s."""
        sink = KafkaProducer(acks="all", retries=0, request_timeout_ms=2000, delivery_timeout_ms=2000, max_block_ms=2000,
                             linger_ms=0, **self._kafka())
        sink.send(self.topic, b"before the revocation").get(timeout=10)
        self.revoke()
        since = time.monotonic()
        probes = {"kafka": lambda: sink.send(self.topic, b"after the revocation").get(timeout=2),
                  "redis": lambda: self._redis().get(f"heterorl:{self.run_name}:policy"),
                  "s3": lambda: self._s3().get_object(self.services["bucket"], f"{self.run_name}/v0/manifest.json")}
        while len(self.revoked_after) < 3 and time.monotonic() - since < REVOKED_WITHIN_S + 10:
            for name, probe in probes.items():
                if name in self.revoked_after:
                    continue
                try:
                    probe()
                except Exception:  # noqa: BLE001 - refused
                    self.revoked_after[name] = round(time.monotonic() - since, 2)
            time.sleep(0.5)
        with contextlib.suppress(Exception):  # its last sends are never acknowledged
            sink.close(timeout=3)
        within = len(self.revoked_after) == 3 and max(self.revoked_after.values()) <= REVOKED_WITHIN_S
        self.outcomes[13].append(f"refused: every server within {max(self.revoked_after.values()):.1f} s"
                                 if within else f"accepted: refused by {sorted(self.revoked_after)} only")

    # ---- the audit ----------------------------------------------------------------------
    def report(self) -> dict:
        accepted = {row: [o for o in found if o.startswith("accepted")] for row, found in self.outcomes.items()}
        return {"rows": {str(row): {"what": ROWS[row], "tried": len(found),
                                    "refused": sum(o.startswith("refused") for o in found),
                                    "bounded": sum(o.startswith("bounded") for o in found),
                                    "accepted": len(accepted[row]), "first": found[0] if found else None}
                         for row, found in self.outcomes.items()},
                "revoked_after_s": self.revoked_after,
                "target_met": all(not a for a in accepted.values()) and all(self.outcomes.values())}
