"""The rollout message (schema version 1): one prompt group, one Kafka message.

The wire format is msgpack; numeric arrays travel as raw little-endian bytes with
their dtype and shape, so a client in any language can decode them without a
Python-specific format (docs/schema.md is the normative description). Kafka headers
repeat `policy_version`, `sampler_id`, `schema_version` and `rollout_id` so a consumer can
filter or deduplicate without decoding the value.

Serialization lives here and nowhere else; the Kafka client only moves bytes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np

from pipeline.wire.signing import SigningKey

SCHEMA_VERSION = 1

LOGPROB_RULE = "log_softmax(logits/temperature), full vocabulary, before top-k/top-p"
"""Which distribution the sampler's log-probs come from; the learner uses the same rule."""


class RolloutDecodeError(ValueError):
    """A message that is not a valid version-1 rollout; `reason` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Rollout:
    """One prompt group: G completions of one prompt sampled by one policy version."""

    prompt_id: str
    task: str
    sampler_id: str
    policy_version: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    """G completions (token ids after the prompt, EOS included when generated)."""
    sampler_logps: list[list[float]]
    """Per completion token: the sampler's log-prob of that token (LOGPROB_RULE)."""
    rewards: list[float]
    sampling: dict[str, float] = field(default_factory=dict)
    """temperature, top_p, top_k, max_new_tokens used by the sampler."""
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    schema_version: int = SCHEMA_VERSION
    run: str = ""
    """The run it was made for (signed, so a group cannot be replayed into another run)."""
    key_id: str = ""
    """Id of the sampler key that signs it ("" when unsigned)."""
    seq: int = 0
    """Per-key sequence number, increasing across the key's messages (replay protection)."""

    @property
    def group_size(self) -> int:
        return len(self.completion_ids)

    def token_ids(self) -> list[int]:
        """Every token id of the group, prompt first (what must fit a model's vocabulary)."""
        return list(self.prompt_ids) + [t for c in self.completion_ids for t in c]

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            ("schema_version", str(self.schema_version).encode()),
            ("policy_version", str(self.policy_version).encode()),
            ("sampler_id", self.sampler_id.encode()),
            ("rollout_id", self.rollout_id.encode()),
            ("key_id", self.key_id.encode()),
        ]


def _pack_array(values: np.ndarray) -> dict[str, Any]:
    arr = np.ascontiguousarray(values)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {"dtype": little.dtype.str, "shape": list(arr.shape), "data": little.tobytes()}


_ALLOWED_DTYPES = {"<i4", "<i8", "<f4", "<f8"}


def _unpack_array(obj: Any, name: str) -> np.ndarray:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise RolloutDecodeError(f"field {name} is not an array object {{dtype, shape, data}}")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in _ALLOWED_DTYPES:
        raise RolloutDecodeError(f"field {name} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise RolloutDecodeError(f"field {name} has an invalid shape {shape!r}")
    if not isinstance(data, bytes):
        raise RolloutDecodeError(f"field {name}.data is not bytes")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise RolloutDecodeError(f"field {name} holds {len(data)} bytes, shape {shape} needs {expected}")
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def encode_rollout(r: Rollout) -> bytes:
    lengths = np.array([len(c) for c in r.completion_ids], dtype="<i4")
    flat_ids = np.array([t for c in r.completion_ids for t in c], dtype="<i4")
    flat_logps = np.array([x for c in r.sampler_logps for x in c], dtype="<f4")
    message = {
        "schema_version": r.schema_version,
        "rollout_id": r.rollout_id,
        "prompt_id": r.prompt_id,
        "task": r.task,
        "sampler_id": r.sampler_id,
        "policy_version": int(r.policy_version),
        "created_at": float(r.created_at),
        "prompt_ids": _pack_array(np.array(r.prompt_ids, dtype="<i4")),
        "completion_lengths": _pack_array(lengths),
        "completion_ids": _pack_array(flat_ids),
        "sampler_logps": _pack_array(flat_logps),
        "rewards": _pack_array(np.array(r.rewards, dtype="<f4")),
        "sampling": {k: (float(v) if isinstance(v, float) else v) for k, v in r.sampling.items()},
        "logprob_rule": LOGPROB_RULE,
    }
    if r.key_id:
        message.update(run=r.run, key_id=r.key_id, seq=int(r.seq))
    return msgpack.packb(message, use_bin_type=True)


def seal_rollout(r: Rollout, key: SigningKey) -> bytes:
    """The signed wire form: `{signed_rollout: <body bytes>, signature: <Ed25519 over those bytes>}`.
    `r` must carry `run`, `key_id` (that of `key`) and `seq`, which the body includes."""
    if r.key_id != key.key_id:
        raise ValueError(f"rollout names key {r.key_id!r}, signing key is {key.key_id}")
    body = encode_rollout(r)
    return msgpack.packb({"signed_rollout": body, "signature": key.sign(body)}, use_bin_type=True)


def open_message(payload: bytes) -> tuple[bytes, Optional[bytes]]:
    """(body bytes, signature) of a sealed message; (payload, None) for an unsigned one."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise RolloutDecodeError(f"not msgpack: {type(e).__name__}") from None
    if isinstance(msg, dict) and "signed_rollout" in msg:
        body, signature = msg.get("signed_rollout"), msg.get("signature")
        if not isinstance(body, bytes) or not isinstance(signature, bytes):
            raise RolloutDecodeError("sealed message without bytes fields signed_rollout and signature")
        return body, signature
    return payload, None


_REQUIRED = {
    "schema_version": int, "rollout_id": str, "prompt_id": str, "task": str, "sampler_id": str,
    "policy_version": int, "created_at": (int, float), "prompt_ids": dict, "completion_lengths": dict,
    "completion_ids": dict, "sampler_logps": dict, "rewards": dict,
}


def decode_rollout(payload: bytes) -> Rollout:
    """Decode and validate one message, sealed or not (the signature is the learner's
    `pipeline.trust` check, not this one's); raises RolloutDecodeError with the reason."""
    return decode_body(open_message(payload)[0])


def decode_body(payload: bytes) -> Rollout:
    """Decode and validate the rollout map itself (what a seal's `signed_rollout` holds)."""
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise RolloutDecodeError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise RolloutDecodeError("top level is not a map")
    version = msg.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RolloutDecodeError(f"schema_version {version!r} is not {SCHEMA_VERSION}")
    for name, typ in _REQUIRED.items():
        if name not in msg:
            raise RolloutDecodeError(f"missing field {name}")
        if not isinstance(msg[name], typ) or isinstance(msg[name], bool):
            raise RolloutDecodeError(f"field {name} has type {type(msg[name]).__name__}")
    if msg["policy_version"] < 0:
        raise RolloutDecodeError("policy_version is negative")
    prompt_ids = _unpack_array(msg["prompt_ids"], "prompt_ids")
    lengths = _unpack_array(msg["completion_lengths"], "completion_lengths")
    flat_ids = _unpack_array(msg["completion_ids"], "completion_ids")
    flat_logps = _unpack_array(msg["sampler_logps"], "sampler_logps")
    rewards = _unpack_array(msg["rewards"], "rewards")
    if lengths.ndim != 1 or len(lengths) < 1:
        raise RolloutDecodeError("completion_lengths must be a non-empty 1-d array")
    if prompt_ids.ndim != 1 or len(prompt_ids) < 1:
        raise RolloutDecodeError("prompt_ids must be a non-empty 1-d array")
    if not np.isfinite(msg["created_at"]):
        raise RolloutDecodeError("created_at must be finite")
    if (lengths < 0).any():
        raise RolloutDecodeError("completion_lengths has a negative length")
    total = int(lengths.sum())
    if flat_ids.shape != (total,) or flat_logps.shape != (total,):
        raise RolloutDecodeError(
            f"completion_ids/sampler_logps hold {flat_ids.shape}/{flat_logps.shape} values, lengths sum to {total}")
    if rewards.shape != lengths.shape:
        raise RolloutDecodeError(f"rewards has shape {list(rewards.shape)}, expected [{len(lengths)}]")
    if not np.isfinite(flat_logps).all() or (flat_logps > 0).any():
        raise RolloutDecodeError("sampler_logps must be finite and <= 0")
    if not np.isfinite(rewards).all():
        raise RolloutDecodeError("rewards must be finite")
    bounds = np.cumsum(lengths)[:-1]
    sampling = msg.get("sampling", {})
    if not isinstance(sampling, dict):
        raise RolloutDecodeError("field sampling is not a map")
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in sampling.values()):
        raise RolloutDecodeError("field sampling holds a value that is not a number")
    run, key_id, seq = msg.get("run", ""), msg.get("key_id", ""), msg.get("seq", 0)
    if not isinstance(run, str) or not isinstance(key_id, str) or not isinstance(seq, int) or isinstance(seq, bool):
        raise RolloutDecodeError("fields run/key_id/seq must be text/text/int")
    return Rollout(
        prompt_id=msg["prompt_id"], task=msg["task"], sampler_id=msg["sampler_id"],
        policy_version=msg["policy_version"], prompt_ids=prompt_ids.astype(np.int64).tolist(),
        completion_ids=[a.astype(np.int64).tolist() for a in np.split(flat_ids, bounds)],
        sampler_logps=[a.astype(np.float64).tolist() for a in np.split(flat_logps, bounds)],
        rewards=rewards.astype(np.float64).tolist(), sampling=sampling,
        rollout_id=msg["rollout_id"], created_at=float(msg["created_at"]), schema_version=version,
        run=run, key_id=key_id, seq=seq,
    )


def header_value(headers: list[tuple[str, bytes]] | None, key: str) -> str | None:
    """A Kafka header as text (None if absent), for filtering without decoding."""
    for k, v in headers or []:
        if k == key:
            return v.decode("utf-8", "replace") if v is not None else None
    return None

