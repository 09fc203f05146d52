"""The policy pointer: which version is current and where its manifest is, in Redis, signed
by the learner. Written (`PolicyPointer.set`, by the publisher once the version's manifest is
in S3), read (`PolicyPointer.read`) and verified (`verify_pointer`, by samplers, validators and
the evaluator against the learner key they pin) here, and nowhere else.

Redis holds the fields as text under `heterorl:<run>:policy`: version, manifest_key,
updated_at, and signature (JSON of {key_id, value}: an Ed25519 signature over the pointer
document below). A sampler reads the same fields in its turn's one round trip
(`pipeline.clients.run_state.RunState.sampler_view`) and checks them with `verify_pointer`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, sign_document, verify_document

POINTER_FORMAT = "heterorl-policy-pointer/1"


@dataclass(frozen=True)
class Pointer:
    """The pointer as Redis holds it."""

    version: int
    manifest_key: str
    updated_at: Optional[str] = None
    signature: Optional[str] = None


def pointer_document(run: str, version: int, manifest_key: str, updated_at: str) -> dict:
    """What the learner signs when it makes `version` current."""
    return {"format": POINTER_FORMAT, "run": run, "version": int(version), "manifest_key": manifest_key,
            "updated_at": str(updated_at)}


def sign_pointer(run: str, version: int, manifest_key: str, updated_at: str, key: SigningKey) -> str:
    """The pointer's `signature` field: JSON of {key_id, value}."""
    return json.dumps(sign_document(pointer_document(run, version, manifest_key, updated_at), key)["signature"])


def verify_pointer(run: str, version: int, manifest_key: str, updated_at: Optional[str], signature: Optional[str],
                   trusted: PublicKey) -> None:
    """SignatureError unless the learner's key signed exactly this pointer."""
    if not signature:
        raise SignatureError(f"the policy pointer to v{version} is not signed")
    try:
        sig = json.loads(signature)
    except ValueError:
        raise SignatureError(f"the policy pointer to v{version} has a malformed signature") from None
    verify_document({**pointer_document(run, version, manifest_key, updated_at or ""), "signature": sig}, trusted,
                    f"the policy pointer to v{version}")


class PolicyPointer:
    """The run's pointer in Redis (`state`: the run's `RunState`)."""

    def __init__(self, state):
        self.client, self.run, self.key = state.client, state.run, state.prefix + "policy"

    def set(self, version: int, manifest_key: str, signer: Optional[SigningKey] = None) -> None:
        """Make `version` current; call only once its manifest is in S3. With `signer` (the
        learner's key) the pointer carries a signature samplers check against the key they pin."""
        updated_at = repr(time.time())
        fields = {"version": version, "manifest_key": manifest_key, "updated_at": updated_at}
        if signer is not None:
            fields["signature"] = sign_pointer(self.run, version, manifest_key, updated_at, signer)
        pipe = self.client.pipeline()
        pipe.delete(self.key)  # no signature of an earlier pointer may survive
        pipe.hset(self.key, mapping=fields)
        pipe.execute()

    def read(self) -> Optional[Pointer]:
        """The pointer as it stands (None before the first version), not yet verified."""
        data = self.client.hgetall(self.key)
        if not data:
            return None
        return Pointer(int(data["version"]), data["manifest_key"], data.get("updated_at"), data.get("signature"))

    def read_verified(self, trusted: Optional[PublicKey]) -> Optional[Pointer]:
        """`read`, and SignatureError unless the learner key `trusted` signed it (None: signatures
        are not required, and the pointer is taken as it is)."""
        pointer = self.read()
        if pointer is not None and trusted is not None:
            verify_pointer(self.run, pointer.version, pointer.manifest_key, pointer.updated_at, pointer.signature,
                           trusted)
        return pointer

    def version(self) -> Optional[int]:
        raw = self.client.hget(self.key, "version")
        return None if raw is None else int(raw)


def current(state) -> tuple[Optional[int], Optional[str]]:
    """(version, manifest key) the pointer names, not verified: for what is only shown or
    compared (status, audits); whatever loads a version goes through `read_verified`."""
    pointer = PolicyPointer(state).read()
    return (None, None) if pointer is None else (pointer.version, pointer.manifest_key)
