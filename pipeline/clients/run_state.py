"""Redis: the current policy version, its manifest, sampler leases, prompt claims and learner progress.

Keys (all under `heterorl:<run>:`):
- `policy`            hash {version, manifest_key, updated_at}: written in one HSET
                      *after* the checkpoint's manifest is in S3, so a reader that sees a
                      version can always fetch it.
- `sampler:<id>`      hash {host, policy_version, groups, rollouts_per_min, started_at,
                      heartbeat_at, ...}, with a TTL renewed by each heartbeat (the lease).
                      Its absence is what "this sampler is gone" means everywhere below.
- `samplers_seen`     sorted set sampler id -> time of its last heartbeat (or release), so
                      samplers whose lease key has vanished can still be listed.
- `sampler_last`      hash sampler id -> JSON of its last lease info + `heartbeat_at`,
                      `lease_ttl_s`; a clean stop adds `released_at` and `release_reason`
                      (absent: the lease ran out - the sampler crashed or was cut off).
- `sampler_stats`     hash sampler id -> JSON totals written when a sampler stops.
- `key_registry`      the sampler keys the learner accepts, signed by the root key
                      (JSON, `pipeline.trust.keyring`); `policy` also carries the learner's
                      `signature` over (run, version, manifest_key, updated_at).
- `join_requests`     stream of volunteers' join requests (`heterorl join`), each signed by the
                      joiner's own key; the learner decides them in order (`JoinDesk`).
- `admissions`        the keys the learner admitted under invites, the joins per invite, where it
                      read the requests to and why it refused the newest, signed by the
                      learner's key (JSON, `pipeline.trust.invites.Admissions`).
- `quarantine`        hash key id -> JSON {sampler_id, reason, at, strikes} of sampler keys
                      the learner stopped trusting (`pipeline.trust.StrikePolicy`).
- `learner`           hash of what samplers pace on: the learner's step and version, its position
                      in the topic (offsets, unread, pending), and `busy_until`: while it checks
                      and trains a batch (samplers on its machine may pause meanwhile,
                      `sampler.yield_to_learner`). Samplers may read it.
- `learner_stats`     hash of the learner's counters (groups used, dropped and refused by reason,
                      staleness): for `heterorl status` and the operator. No sampler or validator
                      user may read it: a forger would learn from it which of its groups were used.
- `used_by_sampler`   hash sampler id -> groups of it the learner trained on (samplers may read
                      it: `heterorl join` shows a volunteer its count; the per-group secret draw
                      of stale checks makes knowing what was used worthless to a forger).
- `evaluator`         hash {version, done, total}: the evaluator's progress on the version it
                      scores (`heterorl train` shows it while it waits).
- `validator:<id>`    hash {host, groups, started_at, heartbeat_at} with a TTL renewed by each
                      heartbeat: the validator's lease (consumers/validator.py).
- `partition_lease:<p>` the id of the validator that checks partition p of the rollout topic,
                      with a TTL (`validators.lease_s`) its holder renews; a killed
                      validator's partitions are free again once it runs out.
- `validator_stats`   hash validator id -> JSON of its totals and checks, written when it stops.
- `validator_offsets` hash partition -> next offset whose verdict is not yet published (written
                      by the partition's holder only, after its verdicts are acknowledged):
                      where the next holder starts.
- `meta`              hash {rollout_topic, started_at, epoch_size?} written by the learner
                      (epoch_size by samplers that know it); the run is also listed in the
                      global sorted set `heterorl:runs` (by start time).
- `prompt_cursor`     counter: the next never-issued index of the task's train stream
                      (claimed with INCRBY, so samplers share one stream without overlap).
- `claims`            hash prompt index -> id of the sampler that holds it: every claimed
                      index stays here until its owner completes it (group acknowledged
                      by Kafka, or deliberately discarded).
- `reissue`           list of indices taken back from samplers whose lease is gone; claims
                      take from here before advancing the cursor, so nothing is skipped.
- `claim_stats`       hash of counters {claimed, completed, reissued, late_completions,
                      reissue_withdrawn}; invariants: claimed - reissued == completed +
                      HLEN claims, and cursor + reissued == claimed + LLEN reissue +
                      reissue_withdrawn (a late completion takes its index off the queue);
                      and `discarded_at_source`: completed groups a sampler dropped from its
                      spool as too stale to send (they never reach the learner).
- `completed_by`, `discarded_by`
                      hashes sampler id -> its groups completed, and of those discarded at the
                      source (the run functions write both; discards at most the completions).
- `judged_by`         hash sampler id -> its groups the learner judged (only the learner writes
                      it). Per sampler, completed - discarded - judged is what it sent that the
                      learner has not judged yet: the fleet's pacing sums it (`fleet_unjudged`).

An epoch is `epoch_size` consecutive indices (epoch = index // epoch_size). Each index is
issued once from the cursor and again only if its holder died, so within an epoch no
prompt is skipped and none is done twice except the re-issued ones, which are counted.
"""

from __future__ import annotations

import contextlib

import json
import time
from dataclasses import dataclass
from typing import Optional

import redis

from pipeline.config import strip_password
from pipeline.errors import UserError
from pipeline.clients.run_functions import (FUNCTION_KEYS, MAX_BATCH, MAX_CALL_INDICES, MAX_SWEEP_MS, MAX_TTL_MS,
                                             sampler_token)
from pipeline.clients.services import CredentialsRefused, ServiceSecurity, ServiceUnavailable


def _prefix(run: str) -> str:
    return f"heterorl:{run}:"


def connect_redis(url: str, timeout_s: float = 10.0, security: Optional[ServiceSecurity] = None) -> redis.Redis:
    """A client for `url` (`redis://user:password@host:port/db`, `rediss://` for TLS with the
    CA and client files of `security`), checked with a PING. Raises ServiceUnavailable naming
    the URL (without its password): unreachable, or credentials refused."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  decode_responses=True, retry_on_timeout=True,
                                  **(security or ServiceSecurity()).redis_kwargs(url))
    try:
        client.ping()
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as e:
        raise CredentialsRefused(f"Redis at {strip_password(url)} refused the credentials ({e}): check the user and "
                                 "password in the URL (REDIS_URL)") from None
    except redis.RedisError as e:
        raise ServiceUnavailable(f"cannot reach Redis at {strip_password(url)} ({e}): start it or fix the URL") from None
    return client


RUNS_KEY = "heterorl:runs"


def latest_run(client: redis.Redis) -> Optional[str]:
    """The most recently started run on these servers, if any."""
    newest = client.zrevrange(RUNS_KEY, 0, 0)
    return newest[0] if newest else None


@dataclass(frozen=True)
class Pointer:
    """The policy pointer as Redis holds it (`heterorl:<run>:policy`), parsed but not verified:
    its signature is checked by `pipeline.weights.store.verify_pointer`."""

    version: int
    manifest_key: str
    updated_at: Optional[str] = None
    signature: Optional[str] = None


class MalformedPointer(ValueError):
    """The policy key holds something no learner wrote: another type than a hash, a field
    missing, a version that is no integer. Readers take it as "no new version" and go on; the
    learner's publisher sets the pointer again."""


POINTER_FIELDS = ("version", "manifest_key")
"""The fields every pointer has (`updated_at` and `signature` may be absent: unsigned runs)."""


def parse_pointer(fields: dict) -> Optional[Pointer]:
    """The pointer in the hash's `fields` (None: no pointer yet); MalformedPointer, saying what
    is wrong in one line, for a hash the learner did not write. The one parser of the pointer:
    samplers (`RunState.sampler_view`) and every other reader (`PolicyPointer.read`) use it."""
    if not fields:
        return None
    missing = [name for name in POINTER_FIELDS if name not in fields]
    if missing:
        raise MalformedPointer(f"the policy pointer lacks {', '.join(missing)} (fields: {', '.join(sorted(fields))})")
    raw = fields["version"]
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 18):  # 18 digits fit int64
        raise MalformedPointer(f"the policy pointer's version {str(raw)[:40]!r} is not a non-negative integer below 10^18")
    if not fields["manifest_key"]:
        raise MalformedPointer("the policy pointer names no manifest")
    return Pointer(int(raw), fields["manifest_key"], fields.get("updated_at"), fields.get("signature"))


def wrong_type(error: BaseException) -> bool:
    """Whether `error` is Redis saying a key holds another type than the command needs."""
    return isinstance(error, redis.ResponseError) and str(error).startswith("WRONGTYPE")


def not_a_hash(client: redis.Redis, key: str) -> MalformedPointer:
    """The error for a pointer key of another type than a hash, naming the type (one more command,
    only on this path)."""
    return MalformedPointer(f"the policy pointer is a {client.type(key)}, not a hash")


def _describe_gone_sampler(last: dict) -> dict:
    """A gone sampler's last info, plus how and when it ended."""
    released = "released_at" in last
    heartbeat_at = last.get("heartbeat_at")
    ttl_s = last.get("lease_ttl_s")
    if released:
        ended_at = last["released_at"]
    else:
        ended_at = heartbeat_at + ttl_s if heartbeat_at is not None and ttl_s is not None else heartbeat_at
    return {**last, "last_heartbeat_at": heartbeat_at, "ended": "released" if released else "expired",
            "ended_at": ended_at}


_CLAIM_COUNTERS = ("claimed", "completed", "reissued", "late_completions", "reissue_withdrawn")


class RunStateRefused(UserError, RuntimeError):
    """A write the run's Redis functions refused (`pipeline.clients.run_functions`), in one line:
    another process holds this sampler id, a lease time or a size out of bounds..."""


def _refused(error: redis.ResponseError) -> Optional[str]:
    """The reason, if `error` is one of the functions' refusals (`HETERORL ...`)."""
    text = str(error)
    return text[len("HETERORL "):] if text.startswith("HETERORL ") else None


class RunState:
    """The run's shared state in Redis."""

    def __init__(self, client: redis.Redis, run: str, epoch_size: Optional[int] = None):
        """`epoch_size`: indices per epoch of the train stream, only for reporting (the
        stream itself is endless); without it the run's recorded value is used, if any."""
        if epoch_size is not None and epoch_size <= 0:
            raise ValueError(f"epoch_size must be positive, got {epoch_size}")
        self.client = client
        self.run = run
        self.prefix = _prefix(run)
        self.epoch_size = epoch_size
        self._epoch_size_recorded = False
        self._tokens: dict[str, str] = {}

    # ---- the run's functions (pipeline/clients/run_functions.py) ----------------------
    def hold_as(self, sampler_id: str, token: str) -> None:
        """Act for `sampler_id` with `token` (`run_functions.sampler_token` of its signing key); a
        sampler id not given one here uses the token a keyless sampler has."""
        self._tokens[sampler_id] = token

    def _token(self, sampler_id: str) -> str:
        if sampler_id not in self._tokens:
            self._tokens[sampler_id] = sampler_token(self.run, sampler_id, None)
        return self._tokens[sampler_id]

    def _keys(self, function: str, sampler_id: Optional[str] = None) -> list[str]:
        """The keys `function` takes (`FUNCTION_KEYS`), this run's; the lease `sampler_id`'s."""
        return [self.prefix + (f"sampler:{sampler_id}" if name == "sampler:*" else name)
                for name in FUNCTION_KEYS[function]]

    def _call(self, function: str, keys: list[str], args: list) -> object:
        """FCALL `function` with this run's `keys`; RunStateRefused for the functions' refusals,
        and a one-line error if the server lacks them (the learner or `heterorl up` loads them)."""
        try:
            return self.client.fcall(function, len(keys), *keys, *(str(a) for a in args))
        except redis.exceptions.NoPermissionError as e:  # the ACL, or a gate in front of Redis
            raise RunStateRefused(f"Redis refused {function} for run {self.run}: {e}") from None
        except redis.ResponseError as e:
            why = _refused(e)
            if why is not None:
                raise RunStateRefused(f"Redis refused {function} for run {self.run}: {why}") from None
            if "function not found" in str(e).lower():
                raise RunStateRefused(f"Redis has not the run functions ({function}): the learner loads them when "
                                      "it starts, and `heterorl up` with the local stack") from None
            raise

    # ---- run registry ----------------------------------------------------------------
    def register_run(self, rollout_topic: str) -> None:
        now = time.time()
        self.client.hsetnx(self.prefix + "meta", "started_at", now)
        self.client.hset(self.prefix + "meta", "rollout_topic", rollout_topic)
        self.client.zadd(RUNS_KEY, {self.run: now})

    def meta(self) -> dict:
        return self.client.hgetall(self.prefix + "meta")

    # ---- policy version ------------------------------------------------------------
    # ---- quarantined sampler keys (the learner's verdicts, for status) -------------------
    def record_quarantine(self, key_id: str, info: dict) -> None:
        self.client.hset(self.prefix + "quarantine", key_id, json.dumps(info, default=str))

    def quarantines(self) -> dict[str, dict]:
        """The recorded quarantines; an entry that is not a JSON object (not the learner's) is skipped."""
        return _json_objects(self.client.hgetall(self.prefix + "quarantine"))

    # ---- sampler leases --------------------------------------------------------------
    def _lease_key(self, sampler_id: str) -> str:
        return f"{self.prefix}sampler:{sampler_id}"

    def renew_sampler_lease(self, sampler_id: str, info: dict, ttl_s: float) -> None:
        """Keep this sampler's lease alive for `ttl_s` more seconds (one function call: readers never
        see half a heartbeat), and remember its info (outside the lease key) so it can still be shown
        once the lease has gone. The heartbeat time is the server's. RunStateRefused if another
        process holds this sampler id."""
        fields = [x for k, v in info.items() for x in (k, v)]
        self._call("hr_heartbeat", self._keys("hr_heartbeat", sampler_id),
                   [sampler_id, self._token(sampler_id), int(ttl_s * 1000), json.dumps(info, default=str),
                    *fields])

    def release_sampler_lease(self, sampler_id: str, reason: str = "stopped") -> None:
        """End the lease now, noting that the sampler stopped on purpose (so status can
        tell a clean stop from a crash). Its outstanding claims are re-issued by the next
        `reissue_expired_claims`, like those of a sampler whose lease ran out."""
        self._call("hr_release", self._keys("hr_release", sampler_id), [sampler_id, self._token(sampler_id), reason])

    def record_sampler_stats(self, sampler_id: str, stats: dict) -> None:
        """A stopping sampler's totals (generated, published, waits, refreshes), kept for the run."""
        self._call("hr_record_stats", self._keys("hr_record_stats"), [sampler_id, self._token(sampler_id), json.dumps(stats)])

    def sampler_stats(self) -> dict[str, dict]:
        """Each sampler's recorded totals; an entry that is no JSON object is left out."""
        return _json_objects(self.client.hgetall(self.prefix + "sampler_stats"))

    def last_of_sampler(self, sampler_id: str) -> dict:
        """What a sampler's last heartbeat said, kept once its lease is gone; where it stopped
        cleanly (`released_at`), its groups and policy version are the final ones it recorded
        (a heartbeat can be a whole interval behind: a short run may end before the second)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.prefix + "sampler_last", sampler_id)
        pipe.hget(self.prefix + "sampler_stats", sampler_id)
        raw_last, raw_stats = pipe.execute()
        last = json.loads(raw_last) if raw_last else {}
        if "released_at" in last and raw_stats:
            final = json.loads(raw_stats)
            last["groups"] = final.get("published", last.get("groups", 0))
            last["policy_version"] = final.get("policy_version", last.get("policy_version"))
        return last

    def live_samplers(self) -> dict[str, dict]:
        """Samplers whose lease has not expired."""
        return self._live_leases("sampler")

    def _live_leases(self, role: str) -> dict[str, dict]:
        """Id -> lease info of each `role:<id>` lease key that has not expired."""
        out = {}
        for key in self.client.scan_iter(match=f"{self.prefix}{role}:*", count=100):
            data = self.client.hgetall(key)
            if data:
                out[key[len(self.prefix) + len(role) + 1:]] = data
        return out

    def expired_samplers(self, within_s: float = 3600) -> dict[str, dict]:
        """Samplers seen in the last `within_s` seconds whose lease is gone: their last
        info plus `last_heartbeat_at`, `ended` ("released": stopped cleanly; "expired":
        stopped renewing - crashed or cut off) and `ended_at` (release time, or when the
        lease ran out)."""
        recent = self.client.zrangebyscore(self.prefix + "samplers_seen", time.time() - within_s, "+inf")
        if not recent:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for sampler_id in recent:
            pipe.exists(self._lease_key(sampler_id))
        gone = [sid for sid, alive in zip(recent, pipe.execute()) if not alive]
        if not gone:
            return {}
        raws = self.client.hmget(self.prefix + "sampler_last", gone)
        return {sid: _describe_gone_sampler(json.loads(raw) if raw else {}) for sid, raw in zip(gone, raws)}

    # ---- prompt stream ---------------------------------------------------------------
    def claim_prompts(self, sampler_id: str, count: int, in_flight_limit: Optional[int] = None,
                      allowance: Optional[int] = None) -> list[int]:
        """`count` indices of the task's train stream for `sampler_id` alone: re-issued
        ones first, then the next never-issued ones. Each stays claimed by this sampler
        until `complete_prompts`, or until its lease is gone and a sweep re-issues it, so
        claim only while holding a lease (`renew_sampler_lease` first).

        With `in_flight_limit`, at most as many as keep the fleet's claims within it (possibly
        none): checked and claimed in one script, so samplers that decide at the same moment
        cannot all claim (a fleet starting together overshot the learner's max delay). The fleet's
        claims count each sampler's up to `allowance` (its batch, `sampler.prompts_per_batch`;
        None: every claim), as `sampler_view` counts them."""
        if count <= 0:
            return []
        self._record_epoch_size()
        keys = self._keys("hr_claim", sampler_id)
        limit = "" if in_flight_limit is None else max(0, int(in_flight_limit))
        try:
            claimed = self._call("hr_claim", keys, [sampler_id, self._token(sampler_id), int(count), limit,
                                                    min(max(1, int(allowance or MAX_BATCH)), MAX_BATCH)])
        except RunStateRefused as e:
            if "holds no lease" in str(e) or "never held a lease" in str(e):  # lapsed (a stall longer than its
                return []  # time) or not taken yet: the next heartbeat renews it
            raise
        return [int(i) for i in claimed]

    def _record_epoch_size(self) -> None:
        """Once per RunState: lets `heterorl status` report epochs without being told the size (a
        stranger's sampler may not: the operator's own record it)."""
        if self.epoch_size is not None and not self._epoch_size_recorded:
            self._epoch_size_recorded = True
            with contextlib.suppress(RunStateRefused):
                self._call("hr_epoch_size", self._keys("hr_epoch_size"), [self.epoch_size])

    def complete_prompts(self, sampler_id: str, indices: list[int]) -> int:
        """Release claims whose groups Kafka acknowledged (or that were deliberately
        discarded). Only claims still owned by `sampler_id` are removed - one re-issued
        meanwhile belongs to its new holder - and that count is returned; the rest are
        counted as `late_completions`. A late one still waiting in the re-issue queue is
        taken out of it (counted as `reissue_withdrawn`), so nobody does it again."""
        unique = list(dict.fromkeys(int(i) for i in indices))
        keys = self._keys("hr_complete")
        done = 0
        for start in range(0, len(unique), MAX_CALL_INDICES):
            done += int(self._call("hr_complete", keys, [sampler_id, self._token(sampler_id),
                                                         *unique[start:start + MAX_CALL_INDICES]]))
        return done

    def reissue_expired_claims(self) -> list[int]:
        """Put back in the queue every claim whose owner's lease key is gone (expired or
        released), each exactly once even with many concurrent callers; returns the
        indices this call re-issued, ascending. Cheap enough to call every heartbeat."""
        by_owner = self._claims_by_owner()
        if not by_owner:
            return []
        owners = list(by_owner)
        pipe = self.client.pipeline(transaction=False)
        for owner in owners:
            pipe.exists(self._lease_key(owner))
        reissued: list[int] = []
        for owner, alive in zip(owners, pipe.execute()):
            if not alive:
                reissued += self._reissue_claims_of(owner, sorted(by_owner[owner]))
        return sorted(reissued)

    def claim_sweep_due(self, every_s: float) -> bool:
        """Whether this caller should run `reissue_expired_claims` now: True for one caller per
        `every_s` seconds across the whole fleet (a token, SET NX PX). The sweep costs one
        command per claim owner, so with every sampler sweeping at every heartbeat Redis's work
        grew with the square of the fleet (`heterorl loadtest`, docs/loadtest.md)."""
        every_ms = min(max(1, int(every_s * 1000)), MAX_SWEEP_MS)
        return bool(self._call("hr_sweep_due", self._keys("hr_sweep_due"), [every_ms]))

    def _claims_by_owner(self) -> dict[str, list[int]]:
        """Claimed index -> owner, by owner (an entry no claim function wrote, which only a user with
        direct write access could make, is left out)."""
        by_owner: dict[str, list[int]] = {}
        for index, owner in self.client.hscan_iter(self.prefix + "claims", count=1000):
            if index.isascii() and index.isdigit():
                by_owner.setdefault(owner, []).append(int(index))
        return by_owner

    def _reissue_claims_of(self, owner: str, indices: list[int]) -> list[int]:
        keys = self._keys("hr_reissue", owner)
        moved: list[int] = []
        for start in range(0, len(indices), MAX_CALL_INDICES):
            moved += [int(i) for i in self._call("hr_reissue", keys, [owner, *indices[start:start + MAX_CALL_INDICES]])]
        return moved

    def note_discarded_at_source(self, sampler_id: str, count: int) -> None:
        """`count` completed groups were dropped from `sampler_id`'s spool as too stale to send: the
        fleet's backlog must stop counting them, or at a small max delay the samplers would wait for
        the learner to read groups that will never arrive (and the learner for new ones)."""
        keys = self._keys("hr_discarded")
        while count > 0:
            self._call("hr_discarded", keys, [sampler_id, self._token(sampler_id), min(count, MAX_BATCH)])
            count -= MAX_BATCH

    def claim_stats(self) -> dict:
        """Where the prompt stream stands: `cursor` (indices ever issued fresh),
        `outstanding` claims, `reissue_queue` length, counters `claimed`, `completed`,
        `reissued`, `late_completions`, `reissue_withdrawn`, and `epoch_size`/`epoch`
        (the epoch of the next fresh index; None when the epoch size is unknown).

        Invariants: claimed - reissued == completed + outstanding, and
        cursor + reissued == claimed + reissue_queue + reissue_withdrawn."""
        pipe = self.client.pipeline()  # one consistent snapshot
        pipe.get(self.prefix + "prompt_cursor")
        pipe.hlen(self.prefix + "claims")
        pipe.llen(self.prefix + "reissue")
        pipe.hgetall(self.prefix + "claim_stats")
        pipe.hget(self.prefix + "meta", "epoch_size")
        cursor, outstanding, queued, counters, recorded_epoch_size = pipe.execute()
        cursor = int(cursor or 0)
        epoch_size = self.epoch_size or (int(recorded_epoch_size) if recorded_epoch_size else None)
        return {"cursor": cursor, "outstanding": int(outstanding), "reissue_queue": int(queued),
                **{name: int(counters.get(name, 0)) for name in _CLAIM_COUNTERS},
                "epoch_size": epoch_size, "epoch": cursor // epoch_size if epoch_size else None}

    def epoch_of(self, index: int) -> Optional[int]:
        """The epoch a prompt index belongs to, when the epoch size is known."""
        return index // self.epoch_size if self.epoch_size else None

    # ---- validators ------------------------------------------------------------------
    def renew_validator_lease(self, validator_id: str, info: dict, ttl_s: float) -> None:
        key = f"{self.prefix}validator:{validator_id}"
        pipe = self.client.pipeline()
        pipe.hset(key, mapping={**{k: str(v) for k, v in info.items()}, "heartbeat_at": time.time()})
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        pipe.execute()

    def record_validator_stats(self, validator_id: str, stats: dict) -> None:
        """A stopping validator's totals and its checks' statistics (`GroupScreen.summary`)."""
        self.client.hset(self.prefix + "validator_stats", validator_id, json.dumps(stats))

    def validator_stats(self) -> dict[str, dict]:
        return _json_objects(self.client.hgetall(self.prefix + "validator_stats"))

    def release_validator_lease(self, validator_id: str) -> None:
        self.client.delete(f"{self.prefix}validator:{validator_id}")

    def live_validators(self) -> dict[str, dict]:
        """Validators whose lease has not expired."""
        return self._live_leases("validator")

    def partition_holders(self, partitions: list[int]) -> dict[int, Optional[str]]:
        """Who holds each partition's lease (None: nobody)."""
        values = self.client.mget([f"{self.prefix}partition_lease:{p}" for p in partitions]) if partitions else []
        return dict(zip(partitions, values))

    def hold_partition(self, partition: int, validator_id: str, ttl_s: float) -> bool:
        """Take or renew the lease of a partition; False if another validator holds it."""
        return bool(self._call("hr_hold", [f"{self.prefix}partition_lease:{partition}"],
                               [validator_id, min(max(1, int(ttl_s * 1000)), MAX_TTL_MS)]))

    def let_go_partition(self, partition: int, validator_id: str) -> None:
        self._call("hr_let_go", [f"{self.prefix}partition_lease:{partition}"], [validator_id])

    def record_validator_offset(self, partition: int, offset: int, validator_id: str) -> bool:
        """Where the next holder of `partition` starts, written only while `validator_id` holds it."""
        return bool(self._call("hr_record_if_held", [f"{self.prefix}partition_lease:{partition}",
                                                     self.prefix + "validator_offsets"],
                               [validator_id, partition, int(offset)]))

    def validator_offsets(self) -> dict[int, int]:
        return {int(p): int(o) for p, o in self.client.hgetall(self.prefix + "validator_offsets").items()}

    # ---- joins -------------------------------------------------------------------------
    def request_join(self, request: dict) -> None:
        """Add a volunteer's signed join request (`heterorl join`) to the stream the learner reads."""
        self._call("hr_join_request", self._keys("hr_join_request"), [json.dumps(request)])

    # ---- learner progress ------------------------------------------------------------
    def report_learner(self, progress: dict) -> None:
        """Every value is stored as JSON, so readers get numbers, null and maps back."""
        self.client.hset(self.prefix + "learner", mapping={k: json.dumps(v) for k, v in progress.items()})

    def count_used(self, by_sampler: dict[str, int]) -> None:
        """Add each sampler's groups used in a step to `used_by_sampler` (what `heterorl join`
        shows a volunteer)."""
        if not by_sampler:
            return
        pipe = self.client.pipeline(transaction=False)
        for sampler_id, n in by_sampler.items():
            pipe.hincrby(self.prefix + "used_by_sampler", sampler_id, n)
        pipe.execute()

    def count_judged(self, by_sampler: dict[str, int]) -> None:
        """Add each sampler's groups the learner judged (read and decided on: used, dropped or
        refused) to `judged_by`, against which the fleet's pacing counts what each sent
        (`fleet_unjudged`); ids that never held a lease are left out (`hr_judged`)."""
        pairs = [x for sampler_id, n in by_sampler.items() if n > 0 for x in (sampler_id, n)]
        for start in range(0, len(pairs), 2 * MAX_CALL_INDICES):
            self._call("hr_judged", self._keys("hr_judged"), pairs[start:start + 2 * MAX_CALL_INDICES])

    def used_by(self, sampler_id: str) -> int:
        return int(self.client.hget(self.prefix + "used_by_sampler", sampler_id) or 0)

    def sampler_lease(self, sampler_id: str) -> dict:
        """What a live sampler's last heartbeat said (empty once its lease is gone)."""
        return self.client.hgetall(self._lease_key(sampler_id))

    def report_learner_stats(self, counters: dict) -> None:
        """The learner's counters (used, dropped, refused by reason...), where only the learner and
        the admin may read them (`learner_stats`); stored as JSON like `report_learner`."""
        self.client.hset(self.prefix + "learner_stats", mapping={k: json.dumps(v) for k, v in counters.items()})

    def learner_progress(self) -> dict:
        """The learner's progress and its counters (the latter readable by the admin only)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.prefix + "learner")
        pipe.hgetall(self.prefix + "learner_stats")
        progress, counters = pipe.execute()
        return {k: json.loads(v) for k, v in {**progress, **counters}.items()}

    def report_evaluation(self, version: int, done: int, total: int) -> None:
        """The evaluator's progress on the version it is scoring: completions decoded of `total`."""
        self.client.hset(self.prefix + "evaluator", mapping={"version": version, "done": done, "total": total})

    def evaluation_progress(self) -> Optional[dict[str, int]]:
        """The evaluator's last report (`report_evaluation`), None before its first."""
        raw = self.client.hgetall(self.prefix + "evaluator")
        return {k: int(v) for k, v in raw.items()} if raw else None

    def report_learner_offsets(self, offsets: dict[int, int], unread: Optional[int] = None, pending: int = 0) -> None:
        """Next offset the learner will judge, per partition, how many messages of the topic it
        has not judged yet, and how many judged groups wait in its partly filled batch (samplers
        pace themselves on these)."""
        self.report_learner({"offsets": {str(p): o for p, o in offsets.items()}, "unread": unread,
                             "pending": pending})

    def mark_learner_busy(self, seconds: float) -> None:
        """The learner is on its critical path (checking and training a batch) for up to `seconds`
        more (0: no longer). Samplers and the evaluator that share its machine
        (`sampler.yield_to_learner`) pause generating meanwhile; a learner that dies busy is
        waited for no longer than `seconds`."""
        self.client.hset(self.prefix + "learner", "busy_until", json.dumps(time.time() + seconds if seconds else 0))

    @contextlib.contextmanager
    def learner_busy_while(self, at_most_s: float):
        """`mark_learner_busy` for the block (and at most `at_most_s`), then no longer."""
        self.mark_learner_busy(at_most_s)
        try:
            yield
        finally:
            self.mark_learner_busy(0)

    def learner_busy(self) -> bool:
        raw = self.client.hget(self.prefix + "learner", "busy_until")
        return raw is not None and float(json.loads(raw)) > time.time()

    def learner_offsets(self) -> dict[int, int]:
        raw = self.client.hget(self.prefix + "learner", "offsets")
        return _offsets(raw)

    def sampler_view(self, with_policy: bool = True, allowance: Optional[int] = None,
                     live_within_s: Optional[float] = None) -> "RunView":
        """What a sampler paces itself on, in one round trip: the learner's position and (unless
        not `with_policy`: then None) the newest policy. `allowance`: the fleet's claims in flight
        count each sampler's up to this many (its batch: `claim_prompts` judges so too), so one
        that claims and never delivers holds the fleet back no more than a sampler at work;
        None: every claim counts. `live_within_s`: the groups sent and not judged count only for
        samplers heard from (heartbeat or release, by the server's clock) this recently, so what
        a sampler gone for good left unsent stops holding the fleet back once its lease would
        have run out; None: every sampler's count."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.prefix + "learner", ["offsets", "unread", "pending", "policy_version"])
        if allowance is None:
            pipe.hlen(self.prefix + "claims")
        else:
            pipe.hvals(self.prefix + "claim_counts")
        for name in ("completed_by", "discarded_by", "judged_by"):
            pipe.hgetall(self.prefix + name)
        pipe.zrange(self.prefix + "samplers_seen", 0, -1, withscores=True)
        pipe.time()
        if with_policy:
            pipe.hgetall(self.prefix + "policy")
        replies = pipe.execute(raise_on_error=False)  # a pointer of the wrong type is the pointer's problem
        for reply in replies[:7] + [r for r in replies[7:] if not wrong_type(r)]:
            if isinstance(reply, Exception):
                raise reply
        ((offsets, unread, pending, learner_version), in_flight, completed_by, discarded_by, judged_by, seen,
         (server_s, server_us), *policy) = replies
        if allowance is not None:
            in_flight = sum(min(int(n), allowance) for n in in_flight if n.lstrip("-").isdigit())
        if live_within_s is not None:
            since = server_s + server_us / 1e6 - live_within_s
            live = {sampler_id for sampler_id, heard_at in seen if heard_at >= since}
            completed_by = {k: v for k, v in completed_by.items() if k in live}
        unjudged = fleet_unjudged(completed_by, discarded_by, judged_by,
                                  None if allowance is None else UNJUDGED_BATCHES * allowance)
        unread = json.loads(unread) if unread is not None else None  # null: the learner does not know yet
        position = dict(learner_offsets=_offsets(offsets), learner_unread=unread, in_flight=int(in_flight),
                        unjudged=unjudged, learner_pending=int(json.loads(pending or "0") or 0),
                        learner_version=json.loads(learner_version) if learner_version is not None else None)
        try:
            if policy and isinstance(policy[0], Exception):
                raise not_a_hash(self.client, self.prefix + "policy")
            pointer = parse_pointer(policy[0]) if policy else None
        except MalformedPointer as e:
            return RunView(None, None, pointer_error=str(e), **position)
        if pointer is None:
            return RunView(None, None, **position)
        return RunView(pointer.version, pointer.manifest_key, updated_at=pointer.updated_at,
                       signature=pointer.signature, **position)


@dataclass(frozen=True)
class RunView:
    """A sampler's view of the run, read once per turn (`RunState.sampler_view`)."""

    newest_version: Optional[int]
    """The newest published policy version (None: none yet)."""
    manifest_key: Optional[str]
    """Its checkpoint manifest in S3."""
    learner_offsets: dict[int, int]
    """Next offset the learner will read, per partition."""
    updated_at: Optional[str] = None
    signature: Optional[str] = None
    """The learner's signature over (run, version, manifest_key, updated_at), if any."""
    learner_unread: Optional[int] = None
    """Messages in the topic the learner has not judged yet, as it last reported (None: not known)."""
    in_flight: int = 0
    """Prompts claimed by the fleet whose groups are not spooled yet (being generated or in transit)."""
    unjudged: Optional[int] = None
    """Groups the fleet has sent (their claims completed) and not discarded as too stale, that the
    learner has not judged yet, as of its last report (`fleet_unjudged`; None: not known)."""
    learner_pending: int = 0
    """Groups the learner judged into its partly filled batch, as it last reported."""
    learner_version: Optional[int] = None
    """The learner's newest version as it last reported (after each step; published a moment later)."""
    pointer_error: Optional[str] = None
    """Why the policy pointer read could not be parsed (`MalformedPointer`; the version fields are
    then None): the sampler keeps what it knew, as if nothing new were published."""

    @property
    def version_at_use(self) -> Optional[int]:
        """The version a group's staleness is counted from when it is used, at the least: the
        learner's newest, published or still being published (None until a policy is published)."""
        if self.newest_version is None:
            return None
        return max(self.newest_version, self.learner_version or 0)


UNJUDGED_BATCHES = 4
"""A sampler's groups sent and not yet judged count toward the fleet's backlog up to this many of
its batches (`fleet_unjudged`)."""


def fleet_unjudged(completed_by: dict[str, str], discarded_by: dict[str, str], judged_by: dict[str, str],
                   each_at_most: Optional[int] = None) -> int:
    """The groups the fleet sent that the learner has not judged yet, summed over sampler ids: what
    each completed (`hr_complete`), less what it discarded as too stale to send and what the
    learner judged of its groups (`count_judged`), each id's at least 0 and at most `each_at_most`
    (None: no bound). Per sampler, so that one which completes claims without sending anything
    (a stranger: nothing stops it) holds the fleet's pacing back by at most `each_at_most` groups,
    not by everything it ever completed; and its groups do not count against anyone else's."""
    total = 0
    for sampler_id, raw in completed_by.items():
        counts = [_count(raw), _count(discarded_by.get(sampler_id)), _count(judged_by.get(sampler_id))]
        left = max(0, counts[0] - counts[1] - counts[2])
        total += left if each_at_most is None else min(left, each_at_most)
    return total


def _count(raw: Optional[str]) -> int:
    return int(raw) if raw is not None and raw.isascii() and raw.isdigit() else 0


def _json_objects(raw: dict[str, str]) -> dict[str, dict]:
    """The values of a hash that are JSON objects, by field."""
    out = {}
    for field_name, text in raw.items():
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            out[field_name] = value
    return out


def _offsets(raw: Optional[str]) -> dict[int, int]:
    return {int(p): int(o) for p, o in json.loads(raw).items()} if raw else {}
