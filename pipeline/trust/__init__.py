"""Trust decisions about samplers, without I/O: the key registry, the signature check of
each rollout, the log-prob and termination rules, and the strike policy.

The learner (consumers/learner.py) does the I/O: it reads the signed registry from Redis
every `security.registry_refresh_s`, dead-letters what `RolloutVerifier` rejects, and
records quarantines in Redis for `heterorl status`. docs/security.md is the threat model.

What is attributable. A rejection is *attributable* to a key only if the message was
signed by that key: a bad or missing signature, an unknown key, or an exact copy of an
earlier message could have come from anyone who can write to the topic, so they are
refused one by one (never used) but strike nobody; otherwise anyone could get an honest
sampler quarantined by forging messages in its name. Everything a valid signature
vouches for (a sequence number used twice, a policy version the learner never made, a
sampler id the key is not registered for, wrong rewards or log-probs) is the key
holder's doing and strikes its key.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from pipeline.wire.rollout import Rollout, decode_body, open_message
from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, sign_document, verify_document

REGISTRY_FORMAT = "heterorl-key-registry/1"

ROLES = ("sampler", "validator")
"""What a registered key may sign: rollouts (a sampler's) or verdicts on them (a validator's,
docs/security.md). A key signs for its own role only."""

IMMEDIATE = frozenset({"future_version", "sequence_reused", "sampler_id_mismatch"})
"""Strike kinds that quarantine at once: a valid signature on something no honest sampler sends."""


class Rejected(Exception):
    """A message the learner must not use; `code` is a short name, `reason` one line."""

    def __init__(self, code: str, reason: str, *, key_id: str = "", sampler_id: str = "",
                 attributable: bool = False):
        super().__init__(reason)
        self.code, self.reason = code, reason
        self.key_id, self.sampler_id, self.attributable = key_id, sampler_id, attributable


# ---- the key registry ------------------------------------------------------------------
@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    sampler_id: str
    """The id of the sampler (or validator, for a validator key) it is registered to."""
    public_key: PublicKey
    status: str
    """`active` or `revoked`."""
    expires_at: float
    added_at: float
    revoked_at: Optional[float] = None
    role: str = "sampler"
    """One of ROLES."""
    local: bool = False
    """Minted by the run itself for a role it started on the learner's machine (`heterorl
    train`): the user's own process, whose log-probs the learner need not re-score
    (`security.trust_local_samplers`). `heterorl keys add` never sets it."""
    grant: str = ""
    """The invite it joined with (`heterorl join`: admitted by the learner, never local), "" for
    a key the root key registered."""


@dataclass(frozen=True)
class KeyRegistry:
    """The sampler keys a run accepts, as signed by its root key."""

    run: str
    serial: int
    """Increases with every change, so an older registry can never replace a newer one."""
    keys: dict[str, KeyEntry]
    revoked_grants: dict[str, float] = field(default_factory=dict)
    """Invites revoked (`heterorl invite --revoke`): grant id -> when. No key joins with them, and
    the keys that joined with them are revoked."""

    @classmethod
    def empty(cls, run: str) -> "KeyRegistry":
        return cls(run, 0, {})

    def to_document(self) -> dict:
        return {"format": REGISTRY_FORMAT, "run": self.run, "serial": self.serial, "keys": {
            k.key_id: {"sampler_id": k.sampler_id, "public_key": k.public_key.to_b64(), "status": k.status,
                       "expires_at": k.expires_at, "added_at": k.added_at, "revoked_at": k.revoked_at,
                       **({} if k.role == "sampler" else {"role": k.role}), **({"local": True} if k.local else {}),
                       **({"grant": k.grant} if k.grant else {})}
            for k in self.keys.values()}, **({"revoked_grants": self.revoked_grants} if self.revoked_grants else {})}

    def signed(self, root: SigningKey) -> dict:
        return sign_document(self.to_document(), root)

    @classmethod
    def from_signed(cls, document: object, root: PublicKey, run: str) -> "KeyRegistry":
        """The registry in `document` if the root key signed it for `run`; else SignatureError."""
        body = verify_document(document, root, "the key registry")
        if body.get("format") != REGISTRY_FORMAT:
            raise SignatureError(f"the key registry has format {body.get('format')!r}, not {REGISTRY_FORMAT!r}")
        if body.get("run") != run:
            raise SignatureError(f"the key registry is for run {body.get('run')!r}, not {run!r}")
        try:
            keys = {kid: KeyEntry(kid, str(e["sampler_id"]), PublicKey.from_b64(e["public_key"]), str(e["status"]),
                                  float(e["expires_at"]), float(e["added_at"]),
                                  None if e.get("revoked_at") is None else float(e["revoked_at"]),
                                  str(e.get("role", "sampler")), e.get("local", False) is True,
                                  str(e.get("grant", "")))
                    for kid, e in body["keys"].items()}
            serial = int(body["serial"])
            revoked_grants = {str(g): float(at) for g, at in (body.get("revoked_grants") or {}).items()}
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise SignatureError(f"the key registry is malformed ({type(e).__name__}: {e})") from None
        for kid, entry in keys.items():
            if entry.status not in ("active", "revoked") or entry.public_key.key_id != kid or entry.role not in ROLES:
                raise SignatureError(f"the key registry's entry {kid} is malformed (status {entry.status!r}, "
                                     f"role {entry.role!r})")
        return cls(run, serial, keys, revoked_grants)

    def with_key(self, entry: KeyEntry) -> "KeyRegistry":
        return KeyRegistry(self.run, self.serial + 1, {**self.keys, entry.key_id: entry}, self.revoked_grants)

    def with_revoked(self, key_id: str, now: float, entry: Optional[KeyEntry] = None) -> "KeyRegistry":
        """Revoked: the registered key `key_id`, or `entry` (a key that joined with an invite)."""
        old = entry or self.keys[key_id]
        revoked = KeyEntry(old.key_id, old.sampler_id, old.public_key, "revoked", old.expires_at, old.added_at, now,
                           old.role, old.local, old.grant)
        return KeyRegistry(self.run, self.serial + 1, {**self.keys, key_id: revoked}, self.revoked_grants)

    def with_revoked_grant(self, grant_id: str, now: float) -> "KeyRegistry":
        return KeyRegistry(self.run, self.serial + 1, dict(self.keys), {**self.revoked_grants, grant_id: now})

    def with_admitted(self, admitted: dict[str, dict]) -> "KeyRegistry":
        """This registry and the keys the learner admitted under invites (`Admissions.keys`):
        never local; revoked where the root key revoked them or their invite. A key the root key
        registered keeps its own entry."""
        keys = dict(self.keys)
        for key_id, a in admitted.items():
            if key_id in keys:
                continue
            revoked_at = self.revoked_grants.get(a["grant"])
            keys[key_id] = KeyEntry(key_id, a["sampler_id"], PublicKey.from_b64(a["public_key"]),
                                    "active" if revoked_at is None else "revoked", float(a["expires_at"]),
                                    float(a["admitted_at"]), revoked_at, "sampler", False, a["grant"])
        return KeyRegistry(self.run, self.serial, keys, self.revoked_grants)

    def is_local(self, key_id: str) -> bool:
        """Whether `key_id` is an active key the run minted for a sampler it started itself."""
        entry = self.keys.get(key_id)
        return entry is not None and entry.local and entry.status == "active" and entry.role == "sampler"

    def find(self, name: str) -> list[KeyEntry]:
        """Entries whose key id or sampler id is `name`."""
        return [k for k in self.keys.values() if name in (k.key_id, k.sampler_id)]


def trusted_sampler(registry: Optional[KeyRegistry], key_id: str, trust_local: bool) -> bool:
    """Whether groups signed by `key_id` come from one of the run's own samplers, whose log-probs
    are not re-scored (`security.trust_local_samplers`: `trust_local`)."""
    return trust_local and registry is not None and bool(key_id) and registry.is_local(key_id)


# ---- the signature check of each message -------------------------------------------------
class RolloutVerifier:
    """Checks each message's seal against the registry: signed by an active, unexpired key
    registered for the sampler id it names, for this run, with a sequence number the key
    has not used for another message. No I/O: the learner hands in the registry."""

    def __init__(self, run: str, registry: Optional[KeyRegistry], require_signatures: bool = True):
        self.run = run
        self.registry = registry
        self.require_signatures = require_signatures
        self.seen: dict[str, dict[int, str]] = {}
        """key id -> sequence number -> the rollout id it was first seen on."""
        self.rejected: Counter = Counter()

    def check(self, value: bytes, now: float) -> Rollout:
        """The decoded rollout, if its seal holds; else Rejected (RolloutDecodeError if undecodable)."""
        try:
            return self._check(value, now)
        except Rejected as e:
            self.rejected[e.code] += 1
            raise

    def _check(self, value: bytes, now: float) -> Rollout:
        body, signature = open_message(value)
        rollout = decode_body(body)
        if signature is None:
            if self.require_signatures:
                raise Rejected("unsigned", "unsigned rollout (security.require_signatures is on)",
                               sampler_id=rollout.sampler_id)
            rollout.key_id = ""  # a claim nobody proved: it must not strike (or spare) a real key
            return rollout
        where = f"key {rollout.key_id or '(none)'} of sampler {rollout.sampler_id!r}"
        if self.registry is None:
            raise Rejected("no_registry", "no valid key registry to check signatures against (heterorl keys init)",
                           key_id=rollout.key_id, sampler_id=rollout.sampler_id)
        entry = self.registry.keys.get(rollout.key_id)
        if entry is None:
            raise Rejected("unknown_key", f"signed with unknown {where}", key_id=rollout.key_id,
                           sampler_id=rollout.sampler_id)
        if not entry.public_key.verify(signature, body):
            raise Rejected("bad_signature", f"bad signature for {where}", key_id=rollout.key_id,
                           sampler_id=rollout.sampler_id)
        if entry.role != "sampler":  # a validator's key vouches for verdicts, never for rollouts
            raise Rejected("wrong_role", f"signed with a {entry.role} key ({entry.key_id}), not a sampler's",
                           key_id=rollout.key_id, sampler_id=rollout.sampler_id)
        signed = dict(key_id=entry.key_id, sampler_id=rollout.sampler_id)
        if entry.status == "revoked":
            raise Rejected("revoked_key", f"{where} was revoked", **signed)
        if now > entry.expires_at:
            raise Rejected("expired_key", f"{where} expired", **signed)
        if rollout.run != self.run:
            # A genuine message of another run that uses the same key: a replay, not the key's doing.
            raise Rejected("wrong_run", f"signed for run {rollout.run!r}, this is {self.run!r}", **signed)
        if rollout.sampler_id != entry.sampler_id:
            raise Rejected("sampler_id_mismatch", f"{where} is registered to sampler {entry.sampler_id!r}",
                           attributable=True, **signed)
        seen = self.seen.setdefault(entry.key_id, {})
        first = seen.setdefault(rollout.seq, rollout.rollout_id)
        if first != rollout.rollout_id:
            raise Rejected("sequence_reused", f"{where} signed sequence number {rollout.seq} twice",
                           attributable=True, **signed)
        return rollout


# ---- checks of a group's content -----------------------------------------------------------
def logprob_gap(sampler_logps: Sequence[Sequence[float]], learner_logps: Sequence[Sequence[float]]) -> float:
    """median over the group's tokens of exp(|Δ|) − 1, Δ = sampler − learner log-prob: 0 for
    identical numbers, ≈ |Δ| for small ones, robust to a few outlier tokens."""
    gaps = [math.expm1(abs(a - b)) for sa, la in zip(sampler_logps, learner_logps) for a, b in zip(sa, la)]
    return statistics.median(gaps) if gaps else 0.0


def termination_error(completion_ids: Sequence[Sequence[int]], eos_ids: Iterable[int], max_new_tokens: int) -> str:
    """Why a group breaks the termination rule ("" if it keeps it): every completion stops at
    its first EOS, and one without an EOS has exactly `max_new_tokens` tokens."""
    eos = set(eos_ids)
    for i, c in enumerate(completion_ids):
        first = next((k for k, t in enumerate(c) if t in eos), None)
        if first is not None and first != len(c) - 1:
            return f"completion {i} goes on after an EOS at token {first}"
        if first is None and len(c) != max_new_tokens:
            return f"completion {i} stops after {len(c)} tokens without an EOS (max_new_tokens {max_new_tokens})"
    return ""


# ---- strikes and quarantine ------------------------------------------------------------------
@dataclass
class Quarantine:
    key_id: str
    sampler_id: str
    reason: str
    at: float
    strikes: list[str] = field(default_factory=list)


class StrikePolicy:
    """Counts failures per key; quarantines at once for IMMEDIATE kinds, else after
    `strikes_to_quarantine` failures."""

    def __init__(self, strikes_to_quarantine: int, quarantined: Iterable[Quarantine] = ()):
        self.limit = strikes_to_quarantine
        self.strikes: dict[str, list[str]] = {}
        self.quarantined: dict[str, Quarantine] = {q.key_id: q for q in quarantined}

    def is_quarantined(self, key_id: str) -> bool:
        return bool(key_id) and key_id in self.quarantined

    def strike(self, key_id: str, sampler_id: str, kind: str, detail: str, now: float) -> Optional[Quarantine]:
        """Record a failure; returns the Quarantine if this one puts the key in quarantine."""
        if not key_id or key_id in self.quarantined:
            return None
        history = self.strikes.setdefault(key_id, [])
        history.append(f"{kind}: {detail}")
        if kind in IMMEDIATE or len(history) >= self.limit:
            reason = f"{kind} ({detail})" if kind in IMMEDIATE else f"{len(history)} failed checks, last {kind} ({detail})"
            q = Quarantine(key_id, sampler_id, reason, now, list(history))
            self.quarantined[key_id] = q
            return q
        return None


