"""Invites: how a volunteer joins a run with one token and no operator action (docs/security.md,
"Invites"). No I/O here: `heterorl invite` and `heterorl join` (heterorl/invites.py) and the
learner's `JoinDesk` (pipeline/trust/keyring.py) do it.

- A **grant**, signed by the run's root key: which run, how many samplers may join with it,
  until when, as which role (sampler only) and never as the run's own (`local` is false: their
  groups are checked as strangers').
- An **invite**: the grant and everything a sampler needs to reach the run (the services' URLs
  and the sampler role's credentials, the CA certificate where TLS is on, the learner's and the
  root's public keys, the run's config), signed as a whole by the root key and written as one
  line of text (`encode_invite`). The root key is needed only to make it.
- A **join request**: the grant, the id the volunteer samples as and its own public key, signed
  by that key (the private half never leaves its host). The learner decides each request
  (`GrantBook.decide`) in the order Redis received them and writes what it admitted, signed
  by its own key (`Admissions`): that is what every role reads beside the root-signed registry.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.errors import UserError
from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, canonical_json, sign_document, verify_document

INVITE_PREFIX = "heterorl-invite-1:"
"""What an invite's text starts with (then base64url of the compressed, signed JSON)."""
GRANT_FORMAT = "heterorl-grant/1"
INVITE_FORMAT = "heterorl-invite/1"
REQUEST_FORMAT = "heterorl-join/1"
ADMISSIONS_FORMAT = "heterorl-admissions/1"
REFUSALS_KEPT = 256
"""Refused requests the admissions document remembers (the newest), so a joiner can read why."""


class InviteError(UserError, ValueError):
    """An invite that cannot be used; one line saying why."""


# ---- the grant ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Grant:
    grant_id: str
    run: str
    max_joins: int
    """How many sampler keys may join with it."""
    expires_at: float
    """After this, no key joins with it (keys already joined stay until revoked)."""
    issued_at: float
    role: str = "sampler"
    local: bool = False
    """Always false: a volunteer is never the run's own process (its groups are checked)."""

    @classmethod
    def new(cls, run: str, max_joins: int, lifetime_s: float, now: float) -> "Grant":
        return cls(uuid.uuid4().hex[:12], run, max_joins, now + lifetime_s, now)

    def to_document(self) -> dict:
        return {"format": GRANT_FORMAT, "grant_id": self.grant_id, "run": self.run, "role": self.role,
                "local": self.local, "max_joins": self.max_joins, "expires_at": self.expires_at,
                "issued_at": self.issued_at}

    @classmethod
    def from_signed(cls, document: Any, root: PublicKey) -> "Grant":
        """The grant if `root` signed it and it admits samplers only; else SignatureError."""
        body = verify_document(document, root, "the invite's grant")
        try:
            grant = cls(str(body["grant_id"]), str(body["run"]), int(body["max_joins"]), float(body["expires_at"]),
                        float(body["issued_at"]), str(body["role"]), body["local"] is True)
        except (KeyError, TypeError, ValueError) as e:
            raise SignatureError(f"the invite's grant is malformed ({type(e).__name__}: {e})") from None
        if body.get("format") != GRANT_FORMAT or grant.role != "sampler" or grant.local or grant.max_joins < 1:
            raise SignatureError(f"the invite's grant is not one heterorl makes (format {body.get('format')!r}, "
                                 f"role {grant.role!r}, local {grant.local}, joins {grant.max_joins})")
        return grant


# ---- the invite -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Invite:
    grant: Grant
    grant_document: dict
    """The grant as the root key signed it: what a join request carries to the learner."""
    services: dict
    """`services.*` fields for the sampler role: URLs, the role's credentials."""
    ca_pem: Optional[str]
    """The CA certificate of the servers' TLS (None: no TLS, or public CAs)."""
    learner_public: PublicKey
    root_public: PublicKey
    config: dict
    """The run's config, without `services` and `security` (those come from the invite)."""

    @property
    def run(self) -> str:
        return self.grant.run


def make_invite(root: SigningKey, grant: Grant, *, services: dict, ca_pem: Optional[str], learner_public: PublicKey,
                config: dict) -> str:
    """The invite as one line of text, signed by `root`."""
    document = {"format": INVITE_FORMAT, "grant": sign_document(grant.to_document(), root), "services": services,
                "ca_pem": ca_pem, "learner_public_key": learner_public.to_b64(), "root_public_key": root.public.to_b64(),
                "config": config}
    return encode_invite(sign_document(document, root))


def encode_invite(signed: dict) -> str:
    packed = zlib.compress(canonical_json(signed), 9)
    return INVITE_PREFIX + base64.urlsafe_b64encode(packed).decode().rstrip("=")


def decode_invite(text: str) -> dict:
    """The signed JSON in an invite's text, unverified; InviteError if it is cut or garbled."""
    text = "".join(text.split())  # a chat may wrap the line
    if not text.startswith(INVITE_PREFIX):
        raise InviteError(f"this is not a heterorl invite (it should start with {INVITE_PREFIX!r})")
    body = text[len(INVITE_PREFIX):]
    try:
        raw = zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        document = json.loads(raw)
    except (binascii.Error, zlib.error, ValueError):
        raise InviteError(f"the invite is cut short or garbled ({len(text)} characters): copy the whole line "
                          "again") from None
    if not isinstance(document, dict):
        raise InviteError("the invite is garbled: it holds no invite")
    return document


def read_invite(text: str) -> Invite:
    """The invite in `text`, if its root key signed all of it; else InviteError (one line)."""
    document = decode_invite(text)
    try:
        root = PublicKey.from_b64(str(document.get("root_public_key", "")))
        body = verify_document(document, root, "the invite")
        grant = Grant.from_signed(body.get("grant"), root)
        learner = PublicKey.from_b64(str(body.get("learner_public_key", "")))
    except SignatureError as e:
        raise InviteError(f"the invite was altered or is not one heterorl made: {e.reason}") from None
    if body.get("format") != INVITE_FORMAT:
        raise InviteError(f"the invite has format {body.get('format')!r}, not {INVITE_FORMAT!r}: a newer heterorl "
                          "made it?")
    services, config, ca_pem = body.get("services"), body.get("config"), body.get("ca_pem")
    if not isinstance(services, dict) or not isinstance(config, dict) or not isinstance(ca_pem, (str, type(None))):
        raise InviteError("the invite is malformed: it lacks the services or the run's config")
    return Invite(grant, body["grant"], services, ca_pem, learner, root, config)


def check_not_expired(grant: Grant, now: float) -> None:
    if now > grant.expires_at:
        ago = now - grant.expires_at
        when = f"{ago / 3600:.1f} h" if ago >= 3600 else f"{ago / 60:.0f} min" if ago >= 60 else f"{ago:.0f} s"
        raise InviteError(f"the invite {grant.grant_id} of run {grant.run} expired {when} ago: ask the run's "
                          "operator for a new one")


# ---- a join request -------------------------------------------------------------------------
@dataclass(frozen=True)
class JoinRequest:
    grant: Grant
    sampler_id: str
    public_key: PublicKey
    host: str
    at: float


def make_join_request(key: SigningKey, invite: Invite, sampler_id: str, host: str, now: float) -> dict:
    """A join request, signed by the joiner's own `key`."""
    return sign_document({"format": REQUEST_FORMAT, "run": invite.run, "grant": invite.grant_document,
                          "sampler_id": sampler_id, "public_key": key.public.to_b64(), "host": host, "at": now}, key)


def read_join_request(document: Any, root: PublicKey, run: str) -> JoinRequest:
    """The request if its key signed it and the run's `root` signed its grant for `run`; else
    SignatureError naming what is wrong."""
    if not isinstance(document, dict):
        raise SignatureError("the join request is not a JSON object")
    try:
        public = PublicKey.from_b64(str(document.get("public_key", "")))
    except SignatureError as e:
        raise SignatureError(f"the join request's public key: {e.reason}") from None
    body = verify_document(document, public, "the join request")
    if body.get("format") != REQUEST_FORMAT:
        raise SignatureError(f"the join request has format {body.get('format')!r}")
    grant_signer = (body.get("grant") or {}).get("signature", {}).get("key_id") if isinstance(body.get("grant"), dict) \
        else None
    if grant_signer != root.key_id:
        raise SignatureError(f"its invite is signed by root key {grant_signer!r}, not this run's ({root.key_id}): "
                             "an invite of another run")
    grant = Grant.from_signed(body["grant"], root)
    if grant.run != run or body.get("run") != run:
        raise SignatureError(f"its invite is for run {grant.run!r}, not {run!r}")
    try:
        return JoinRequest(grant, str(body["sampler_id"]), public, str(body.get("host", "")), float(body["at"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SignatureError(f"the join request is malformed ({type(e).__name__}: {e})") from None


# ---- what the learner admitted --------------------------------------------------------------
@dataclass
class Admissions:
    """Sampler keys admitted under grants, as the learner decided and signed them."""

    run: str
    serial: int = 0
    read_to: str = "0-0"
    """The id of the last join request decided (Redis stream ids increase)."""
    keys: dict[str, dict] = field(default_factory=dict)
    """Key id -> {sampler_id, public_key, grant, host, admitted_at, expires_at}."""
    joins: dict[str, int] = field(default_factory=dict)
    """Grant id -> keys admitted under it (what its `max_joins` is counted against)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Key id -> why its newest request was refused (the newest `REFUSALS_KEPT`)."""

    def to_document(self) -> dict:
        return {"format": ADMISSIONS_FORMAT, "run": self.run, "serial": self.serial, "read_to": self.read_to,
                "keys": self.keys, "joins": self.joins, "refused": self.refused}

    @classmethod
    def from_signed(cls, document: Any, learner: PublicKey, run: str) -> "Admissions":
        body = verify_document(document, learner, "the admissions")
        if body.get("format") != ADMISSIONS_FORMAT or body.get("run") != run:
            raise SignatureError(f"the admissions are of format {body.get('format')!r} for run {body.get('run')!r}")
        try:
            return cls(run, int(body["serial"]), str(body["read_to"]), dict(body["keys"]),
                       {str(g): int(n) for g, n in body["joins"].items()}, dict(body["refused"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SignatureError(f"the admissions are malformed ({type(e).__name__}: {e})") from None


class GrantBook:
    """Decides join requests, in the order received, against the run's root key, its registry,
    the grants revoked there and the keys quarantined (no I/O: the learner's `JoinDesk` reads
    the requests and writes `admissions`)."""

    def __init__(self, run: str, root: PublicKey, admissions: Admissions, key_lifetime_s: float):
        self.run, self.root, self.admissions, self.key_lifetime_s = run, root, admissions, key_lifetime_s

    def decide(self, document: Any, now: float, registered: dict, revoked_grants: set[str],
               quarantined: set[str]) -> tuple[Optional[str], str]:
        """(key id or None, "" if admitted, else why not) for one request; an admitted key is
        recorded in `admissions` (a key already admitted is admitted again without counting)."""
        try:
            request = read_join_request(document, self.root, self.run)
        except SignatureError as e:
            key_id = _claimed_key_id(document)
            return self._refuse(key_id, e.reason)
        grant, key_id, a = request.grant, request.public_key.key_id, self.admissions
        if key_id in quarantined:
            return self._refuse(key_id, "its key is quarantined: it cannot join again")
        if grant.grant_id in revoked_grants:
            return self._refuse(key_id, f"invite {grant.grant_id} was revoked")
        admitted = a.keys.get(key_id)
        if admitted is not None:
            if admitted["sampler_id"] != request.sampler_id or admitted["grant"] != grant.grant_id:
                return self._refuse(key_id, f"its key joined as {admitted['sampler_id']!r} with invite "
                                            f"{admitted['grant']}")
            return key_id, ""  # the same volunteer starting again
        if key_id in registered:
            return self._refuse(key_id, "its key is already registered in the run")
        taken = {e["sampler_id"] for e in a.keys.values()} | {e.sampler_id for e in registered.values()}
        if request.sampler_id in taken:
            return self._refuse(key_id, f"sampler id {request.sampler_id!r} is taken: join with another --id")
        if now > grant.expires_at:
            return self._refuse(key_id, f"invite {grant.grant_id} expired")
        if a.joins.get(grant.grant_id, 0) >= grant.max_joins:
            return self._refuse(key_id, f"invite {grant.grant_id} is used up ({grant.max_joins} of "
                                        f"{grant.max_joins} joined)")
        a.keys[key_id] = {"sampler_id": request.sampler_id, "public_key": request.public_key.to_b64(),
                          "grant": grant.grant_id, "host": request.host[:128], "admitted_at": now,
                          "expires_at": now + self.key_lifetime_s}
        a.joins[grant.grant_id] = a.joins.get(grant.grant_id, 0) + 1
        a.refused.pop(key_id, None)
        return key_id, ""

    def _refuse(self, key_id: Optional[str], why: str) -> tuple[Optional[str], str]:
        if key_id:
            refused = self.admissions.refused
            refused.pop(key_id, None)
            refused[key_id] = why
            for old in list(refused)[:-REFUSALS_KEPT]:
                del refused[old]
        return key_id, why


def _claimed_key_id(document: Any) -> Optional[str]:
    """The key id a request names, where its public key parses (to tell its sender why not)."""
    try:
        return PublicKey.from_b64(str(document.get("public_key", ""))).key_id if isinstance(document, dict) else None
    except SignatureError:
        return None
