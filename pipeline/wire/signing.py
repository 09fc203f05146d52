"""Ed25519 keys, signatures and signed documents (no I/O but key files).

Who signs what (docs/security.md):
- the run's **root key** (`heterorl keys init`) signs the key registry, the list of sampler
  public keys the learner accepts (`pipeline.trust.KeyRegistry`);
- each **sampler key** signs its rollouts: the exact bytes of the rollout body
  (`pipeline.wire.rollout.seal_rollout`);
- the **learner key** signs every checkpoint manifest and the Redis policy pointer;
  samplers pin its public key.

A key file is JSON `{"kind": "heterorl-ed25519/1", "key_id": ..., "private_key": <base64
of the 32-byte seed>}`, written 0600. A public key travels as base64 of its 32 raw bytes;
its id is the first 16 hex digits of its sha256, so an id names exactly one key.

Signed documents (registry, manifest, pointer) are JSON objects; the signature covers
`canonical_json(document)` (sorted keys, no spaces, UTF-8), which Python's json module
reproduces exactly from the parsed document.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.errors import UserError

KEY_FILE_KIND = "heterorl-ed25519/1"
SIGNATURE_BYTES = 64


class KeyFileError(UserError, ValueError):
    """A key file or key text that cannot be used; the message names it."""


class SignatureError(ValueError):
    """A document or message whose signature does not verify; `reason` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise SignatureError(f"{what} is not base64") from None


def key_id_of(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


@dataclass(frozen=True)
class PublicKey:
    raw: bytes

    @classmethod
    def from_b64(cls, text: str) -> "PublicKey":
        raw = unb64(text, "public key")
        if len(raw) != 32:
            raise SignatureError(f"public key has {len(raw)} bytes, Ed25519 needs 32")
        return cls(raw)

    @property
    def key_id(self) -> str:
        return key_id_of(self.raw)

    def to_b64(self) -> str:
        return b64(self.raw)

    def verify(self, signature: bytes, data: bytes) -> bool:
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, data)
            return True
        except InvalidSignature:
            return False


class SigningKey:
    """An Ed25519 private key with its public half and id."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public = PublicKey(raw)

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed_b64(cls, text: str, where: str = "key") -> "SigningKey":
        try:
            seed = base64.b64decode(text.strip(), validate=True)
            return cls(Ed25519PrivateKey.from_private_bytes(seed))
        except ValueError:
            raise KeyFileError(f"{where} is not a base64 Ed25519 private key (32 bytes)") from None

    @property
    def key_id(self) -> str:
        return self.public.key_id

    def seed_b64(self) -> str:
        return b64(self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                               serialization.NoEncryption()))

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def write_key_file(key: SigningKey, path: Path) -> Path:
    """Write `key` to `path` (mode 0600, never overwriting an existing file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"kind": KEY_FILE_KIND, "key_id": key.key_id, "private_key": key.seed_b64()})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def read_key_file(path: Path) -> SigningKey:
    """The private key in `path`; a one-line KeyFileError if it is missing or not a key file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise KeyFileError(f"key file {path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("kind") != KEY_FILE_KIND or "private_key" not in data:
        raise KeyFileError(f"{path} is not a heterorl key file (expected kind {KEY_FILE_KIND!r})")
    key = SigningKey.from_seed_b64(str(data["private_key"]), where=str(path))
    if data.get("key_id") not in (None, key.key_id):
        raise KeyFileError(f"key file {path} says key id {data.get('key_id')} but holds key {key.key_id}")
    return key


def write_public_file(public: PublicKey, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key_id": public.key_id, "public_key": public.to_b64()}) + "\n")
    return path


def read_public_file(path: Path) -> PublicKey:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        return PublicKey.from_b64(str(data["public_key"]))
    except FileNotFoundError:
        raise KeyFileError(f"public key file {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError, SignatureError) as e:
        raise KeyFileError(f"{path} is not a heterorl public key file ({e})") from None


def canonical_json(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sign_document(document: dict, key: SigningKey) -> dict:
    """`document` as JSON will carry it (integer map keys become text, tuples lists), with a
    `signature` field {key_id, value} over its canonical JSON: what a reader parses back is
    exactly what was signed."""
    body = json.loads(json.dumps({k: v for k, v in document.items() if k != "signature"}))
    return {**body, "signature": {"key_id": key.key_id, "value": b64(key.sign(canonical_json(body)))}}


def verify_document(document: Any, trusted: PublicKey, what: str) -> dict:
    """`document` without its signature, if `trusted` signed it; else SignatureError naming `what`."""
    if not isinstance(document, dict) or not isinstance(document.get("signature"), dict):
        raise SignatureError(f"{what} is not signed")
    signature = document["signature"]
    if signature.get("key_id") != trusted.key_id:
        raise SignatureError(f"{what} is signed by key {signature.get('key_id')!r}, not the trusted {trusted.key_id}")
    body = {k: v for k, v in document.items() if k != "signature"}
    try:
        signed_bytes = canonical_json(body)
    except (UnicodeError, TypeError, ValueError):  # e.g. a lone surrogate: nothing honest signs that
        raise SignatureError(f"{what} cannot be encoded canonically (forged)") from None
    if not trusted.verify(unb64(str(signature.get("value", "")), f"{what} signature"), signed_bytes):
        raise SignatureError(f"{what} has a bad signature (altered after signing, or forged)")
    return body
