"""Verdicts: a validator's signed finding on one rollout group, and their check, without I/O.

A validator (consumers/validator.py) reads the rollout topic beside the learner, applies the
learner's content checks to each group (`consumers.screening`) and publishes a verdict to
`<topic>.verdicts`. The learner (with `validators.enabled`) lets a group into a batch only
once a passing verdict for it arrived, and strikes its key on a failing one
(docs/security.md, "Validators").

A verdict is bound to one message: it names the group's rollout id, where it was read
(partition, offset) and the SHA-256 of its bytes, so it cannot vouch for another group or for
altered content under the same id. It is signed (Ed25519, canonical JSON) by a key the run's
root key registered with the role `validator` (a sampler key cannot sign one), and carries a
per-key sequence number, so a copy sent again is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from pipeline.wire.signing import SignatureError, SigningKey, sign_document, verify_document
from pipeline.trust import KeyRegistry, Rejected

VERDICT_FORMAT = "heterorl-verdict/1"


def verdicts_topic(rollout_topic: str) -> str:
    return f"{rollout_topic}.verdicts"


def group_digest(message: bytes) -> str:
    """SHA-256 (hex) of a rollout message as read from the topic: what a verdict vouches for."""
    return hashlib.sha256(message).hexdigest()


@dataclass(frozen=True)
class GroupVerdict:
    """One validator's finding on one group."""

    run: str
    rollout_id: str
    partition: int
    offset: int
    group_digest: str
    """SHA-256 of the message at (partition, offset) (`group_digest`)."""
    sampler_id: str
    key_id: str
    """The sampler key that signed the group ("" if unsigned)."""
    passed: bool
    failure: str = ""
    """The failed check's kind (as the learner's: reward_mismatch, logprob_mismatch, …); "" if passed."""
    detail: str = ""
    checks: tuple[str, ...] = ()
    """What was checked: `rewards` (prompt and every reward re-scored), `logprobs` (re-scored with
    `version_used`); a group passes on what was checked (after probation a stale group's
    log-probs are checked only when drawn, as in the learner)."""
    version_used: Optional[int] = None
    validator_id: str = ""
    validator_key_id: str = ""
    seq: int = 0
    """Per validator key, increasing: a second message with a sequence number seen is a replay."""
    created_at: float = field(default_factory=time.time)

    @property
    def ref(self) -> str:
        """`<validator key id>:<seq>`: how the update log names the verdict that let a group in."""
        return f"{self.validator_key_id}:{self.seq}"

    @property
    def strikes(self) -> bool:
        """Whether a failure is the sampler's doing (an unverifiable group is not)."""
        return not self.passed and self.failure != "unverifiable"


def seal_verdict(verdict: GroupVerdict, key: SigningKey) -> bytes:
    """The wire form: the verdict's fields as JSON, with the validator key's signature."""
    if verdict.validator_key_id != key.key_id:
        raise ValueError(f"verdict names key {verdict.validator_key_id!r}, signing key is {key.key_id}")
    body = {"format": VERDICT_FORMAT, **asdict(verdict), "checks": list(verdict.checks)}
    return json.dumps(sign_document(body, key), sort_keys=True).encode()


_FIELDS = {"run": str, "rollout_id": str, "partition": int, "offset": int, "group_digest": str, "sampler_id": str,
           "key_id": str, "passed": bool, "failure": str, "detail": str, "checks": list, "validator_id": str,
           "validator_key_id": str, "seq": int, "created_at": (int, float)}


def decode_verdict(value: bytes) -> tuple[GroupVerdict, dict]:
    """(the verdict, the signed document) of a message; Rejected("malformed_verdict") if it is not one."""
    try:
        document = json.loads(value)
    except (UnicodeError, ValueError, RecursionError, TypeError):
        raise Rejected("malformed_verdict", "a verdict that is not JSON") from None
    if not isinstance(document, dict) or document.get("format") != VERDICT_FORMAT:
        raise Rejected("malformed_verdict", f"not a {VERDICT_FORMAT} document")
    for name, kind in _FIELDS.items():
        if not isinstance(document.get(name), kind) or (kind is int and isinstance(document.get(name), bool)):
            raise Rejected("malformed_verdict", f"verdict field {name!r} missing or not {getattr(kind, '__name__', kind)}")
    version = document.get("version_used")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise Rejected("malformed_verdict", "verdict field 'version_used' is not an integer")
    verdict = GroupVerdict(**{name: document[name] for name in _FIELDS if name != "checks"},
                           checks=tuple(str(c) for c in document["checks"]), version_used=version)
    return verdict, document


class VerdictVerifier:
    """Checks each verdict's seal against the key registry: signed by an active, unexpired key
    registered with the role `validator` to the validator id it names, for this run, with a
    sequence number the key has not used before. No I/O: the learner hands in the registry."""

    def __init__(self, run: str, registry: Optional[KeyRegistry]):
        self.run, self.registry = run, registry
        self.seen: dict[str, set[int]] = {}
        """Validator key id -> sequence numbers seen."""

    def check(self, value: bytes, now: float) -> GroupVerdict:
        verdict, document = decode_verdict(value)
        signature = document.get("signature")
        if not isinstance(signature, dict):
            raise Rejected("unsigned_verdict", f"unsigned verdict on group {verdict.rollout_id}")
        key_id = str(signature.get("key_id", ""))
        where = f"verdict on group {verdict.rollout_id} signed by key {key_id or '(none)'}"
        entry = None if self.registry is None else self.registry.keys.get(key_id)
        if entry is None:
            raise Rejected("unknown_key", f"{where}: not a registered key")
        if entry.role != "validator":
            raise Rejected("wrong_role", f"{where}: a {entry.role} key cannot sign verdicts")
        try:
            verify_document(document, entry.public_key, where)
        except SignatureError as e:
            raise Rejected("bad_signature", e.reason) from None
        if key_id != verdict.validator_key_id or entry.sampler_id != verdict.validator_id:
            raise Rejected("validator_id_mismatch", f"{where}: the key is registered to validator "
                                                    f"{entry.sampler_id!r}, the verdict names {verdict.validator_id!r}")
        if entry.status == "revoked":
            raise Rejected("revoked_key", f"{where}: the key was revoked")
        if now > entry.expires_at:
            raise Rejected("expired_key", f"{where}: the key expired")
        if verdict.run != self.run:
            raise Rejected("wrong_run", f"{where}: signed for run {verdict.run!r}, this is {self.run!r}")
        seen = self.seen.setdefault(key_id, set())
        if verdict.seq in seen:
            raise Rejected("replayed_verdict", f"{where}: sequence number {verdict.seq} seen before (a replay)")
        seen.add(verdict.seq)
        return verdict
