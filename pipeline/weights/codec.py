"""Weight deltas between two policy versions: pure functions, no I/O.

At RL learning rates about 99 % of a bf16 model's elements keep their exact bit pattern from
one version to the next, so a version can travel as what changed against a version the
sampler already holds. Per tensor, `encode_delta` measures three encodings and keeps the
smallest (sparse only where at most half the elements changed), the tensors side by side in
threads:

- ``same``: no element changed; nothing is sent.
- ``sparse``: the flat indices of the changed elements, delta-coded (gaps between
  consecutive indices, as uint32), plus the step of each of those elements: new − old of the
  bit patterns read as integers (modulo 2^16 or 2^32), zigzag-coded (0, −1, 1, −2, 2, ... as
  0, 1, 2, 3, 4, ...). An element that moves by one bf16 step is a step of ±1, stored as 1 or 2.
- ``dense``: the step of every element (the unchanged elements are zero words).

Each part is stored in byte planes (`byte_planes`: all the words' lowest bytes, then the
next, ...) and zstd-compressed: the high planes of small steps and gaps are mostly zero,
and zstd squeezes them to almost nothing. Steps replaced the XOR of the old and new patterns
(this codec's first form): the XOR of a one-step move is a run of low ones whose length
follows the carry, and drops the direction (docs/weights.md gives both sizes).

A keyframe (a whole model) travels through the same code as the delta from an all-zero
model: `encode_keyframe` stores each tensor's bit patterns themselves (``words``), in byte
planes and zstd-compressed, and `decode_keyframe` rebuilds them with every check below.

Everything works on the raw bit patterns (uint16 for bf16/fp16, uint32 for fp32), never on
float values, so reconstruction is exact: `apply_delta(base, encode_delta(base, new))` equals
`new` bit for bit, NaNs and signed zeros included. Every reconstructed tensor is checked
against the sha256 of the tensor it must equal (`tensor_sha256`), which the delta carries and
the learner signs with the manifest; a mismatch, a payload that does not decompress to
exactly the size its entry declares, a missing base tensor, or a shape or dtype other than
the entry's is refused with DeltaError. A payload's zstd frame must declare that exact size
before it is decompressed, so a hostile payload cannot expand past it.

A delta is `Delta(entries, payload)`: `entries` is JSON-ready (per tensor: encoding, dtype,
shape, sha256, the payload names and sizes), `payload` maps names to compressed bytes. The
caller stores the payload (as uint8 tensors in a safetensors file) and signs the entries.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
import zstandard

from pipeline.errors import UserError

ZSTD_LEVEL = 3
"""zstd's default level: within a few per cent of level 19 on weight deltas, many times faster."""

BIT_VIEWS = {torch.bfloat16: (torch.int16, np.uint16), torch.float16: (torch.int16, np.uint16),
             torch.float32: (torch.int32, np.uint32)}
"""How each supported dtype is read as raw bits: the torch integer view, then numpy's unsigned one."""

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
ENCODINGS = ("same", "sparse", "dense", "words")
"""What `encode_delta` writes (and `words`, what `encode_keyframe` writes). `apply_delta` also
reads what earlier releases wrote (`xor`, and `sparse` with a `flips` part: new = old XOR flip),
so their runs' versions still rebuild."""
MAX_SPARSE_ELEMENTS = 2**32 - 1
"""Largest tensor whose changed elements can be sent as uint32 index gaps (larger ones: `dense`)."""


class DeltaError(UserError, ValueError):
    """A delta that cannot rebuild the tensors it claims to: never loaded."""


@dataclass
class Delta:
    entries: dict[str, dict] = field(default_factory=dict)
    """Per tensor name: {"encoding", "dtype", "shape", "sha256", "changed", "parts": {part: payload name}}."""
    payload: dict[str, bytes | memoryview] = field(default_factory=dict)
    """Compressed bytes by payload name (`<tensor>.indices` and `<tensor>.steps`)."""

    @property
    def nbytes(self) -> int:
        """Bytes the delta's payload takes (what travels, besides the manifest)."""
        return sum(len(b) for b in self.payload.values())


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The flat raw bit patterns of `tensor` (uint16 or uint32), sharing no memory with it."""
    if tensor.dtype not in BIT_VIEWS:
        raise DeltaError(f"weights of dtype {tensor.dtype} are not supported (bf16, fp16 or fp32)")
    int_view, np_view = BIT_VIEWS[tensor.dtype]
    return tensor.detach().contiguous().reshape(-1).view(int_view).numpy().view(np_view).copy()


def from_bits(raw: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor whose raw bit patterns are `raw` (inverse of `bits`)."""
    int_view, _ = BIT_VIEWS[dtype]
    signed = {torch.int16: np.int16, torch.int32: np.int32}[int_view]
    return torch.from_numpy(np.ascontiguousarray(raw).view(signed).copy()).view(dtype).reshape(shape)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes in row-major order (its dtype and shape are recorded beside it)."""
    return hashlib.sha256(bits(tensor).tobytes()).hexdigest()


def steps(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """What turns each word of `old` into `new`: new − old modulo the word size, zigzag-coded
    so that small steps of either sign are small numbers (0, −1, 1, −2, 2 → 0, 1, 2, 3, 4)."""
    signed = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}[old.dtype]
    bits_per_word = 8 * old.itemsize
    step = (new - old).view(signed)  # unsigned subtraction wraps: exact modulo 2^bits
    return ((step << 1) ^ (step >> (bits_per_word - 1))).view(old.dtype)


def apply_steps(old: np.ndarray, zigzag: np.ndarray) -> np.ndarray:
    """`old` moved by `steps` (its inverse): old + step modulo the word size, in place."""
    old += (zigzag >> 1) ^ (zigzag.dtype.type(0) - (zigzag & 1))  # 0 - 1 wraps to all ones
    return old


def byte_planes(words: np.ndarray) -> bytes:
    """`words` with their bytes regrouped by significance: every word's byte 0, then every
    byte 1, ... A small step leaves the high bytes zero, and zstd squeezes a plane of zeros
    to nothing (2.3x smaller than whole words, measured on bf16 steps)."""
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, words.itemsize).T).tobytes()


def from_byte_planes(data: bytes, dtype) -> np.ndarray:
    """The words `byte_planes` regrouped (a new, writable array)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(data, dtype=np.uint8).reshape(dtype.itemsize, -1).T.copy().view(dtype).reshape(-1)


def describe(tensor: torch.Tensor) -> dict:
    """What a keyframe records per tensor: dtype, shape and the sha256 a reader checks."""
    return {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "sha256": tensor_sha256(tensor)}


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                 level: int = ZSTD_LEVEL, workers: int = 0) -> Delta:
    """What turns `base` into `new`, per tensor the smallest of `same`, `sparse` and `dense`.

    Both must hold the same names with the same dtypes and shapes (a version changes values,
    never the architecture); otherwise DeltaError. Tensors are encoded by `workers` threads
    (0: `codec_workers()`): hashing, numpy and zstd let go of the GIL, so a model's tensors
    encode side by side, and the result is the same bytes whatever the count."""
    if set(base) != set(new):
        missing, extra = sorted(set(new) - set(base)), sorted(set(base) - set(new))
        raise DeltaError(f"cannot encode a delta between models with different tensors "
                         f"(only in the new one: {missing[:3]}; only in the base: {extra[:3]})")
    return _encoded(sorted(new), lambda name: _encode_tensor(name, base[name], new[name], level), workers)


def _encoded(names: list[str], encode, workers: int) -> Delta:
    """The Delta of `encode(name)` -> (entry, {part: compressed bytes}) for each name, the
    tensors encoded side by side by `workers` threads (0: `codec_workers()`)."""
    with ThreadPoolExecutor(max_workers=workers or codec_workers()) as pool:
        encoded = list(pool.map(encode, names))
    delta = Delta()
    for name, (entry, parts) in zip(names, encoded):
        delta.entries[name] = {**entry, "parts": {}}
        for part, blob in parts.items():
            key = f"{name}.{part}"
            delta.entries[name]["parts"][part] = key
            delta.payload[key] = blob
    return delta


def encode_keyframe(tensors: Mapping[str, torch.Tensor], level: int = ZSTD_LEVEL, workers: int = 0) -> Delta:
    """A whole model as it travels in a keyframe: per tensor the `words` encoding, its raw bit
    patterns in byte planes, zstd-compressed. The high plane of bf16 weights (sign and most of
    the exponent: few values are common) shrinks to under half, the low plane (mostly mantissa)
    hardly at all: a trained model travels as about 0.7 of its bf16 bytes (docs/weights.md).
    It is the delta from an all-zero model, so `decode_keyframe` rebuilds it through
    `apply_delta` with every check a delta gets. Raises DeltaError for a dtype the codec does
    not read."""
    return _encoded(sorted(tensors), lambda name: _encode_words(tensors[name], level), workers)


def decode_keyframe(delta: Delta, workers: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a keyframe `encode_keyframe` wrote, each checked against its sha256
    (DeltaError otherwise). The zero base is a view that takes no memory: `words` never reads it."""
    base = {}
    for name, entry in delta.entries.items():
        if not isinstance(entry, dict):
            raise DeltaError(f"tensor {name!r}: the keyframe entry is not an object")
        if entry.get("encoding") != "words":
            raise DeltaError(f"tensor {name!r}: a keyframe holds words, not {entry.get('encoding')!r}")
        dtype, shape = _entry_dtype_shape(name, entry)
        base[name] = torch.zeros(1, dtype=dtype).expand(shape) if shape else torch.zeros((), dtype=dtype)
    return apply_delta(base, delta, workers)


def _encode_words(tensor: torch.Tensor, level: int) -> tuple[dict, dict]:
    words = bits(tensor)
    entry = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
             "sha256": hashlib.sha256(words.tobytes()).hexdigest(), "encoding": "words"}
    return entry, {"words": zstandard.ZstdCompressor(level=level).compress(byte_planes(words))}


def codec_workers() -> int:
    """Threads that encode or rebuild a delta's tensors: this process's cores, at most 8."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _encode_tensor(name: str, old_t: torch.Tensor, new_t: torch.Tensor, level: int) -> tuple[dict, dict]:
    """One tensor's delta entry (without its part keys) and its compressed parts."""
    if old_t.dtype != new_t.dtype or tuple(old_t.shape) != tuple(new_t.shape):
        raise DeltaError(f"tensor {name!r} is {old_t.dtype} {tuple(old_t.shape)} in the base and "
                         f"{new_t.dtype} {tuple(new_t.shape)} in the new model")
    compressor = zstandard.ZstdCompressor(level=level)
    old_bits, new_bits = bits(old_t), bits(new_t)
    entry = {"dtype": _dtype_name(new_t.dtype), "shape": list(new_t.shape),
             "sha256": hashlib.sha256(new_bits.tobytes()).hexdigest()}
    changed = np.flatnonzero(old_bits != new_bits)
    entry["changed"] = int(changed.size)
    if changed.size == 0:
        return {**entry, "encoding": "same"}, {}
    moves = steps(old_bits, new_bits)
    candidates = [("dense", {"steps": compressor.compress(byte_planes(moves))})]
    # Sparse pays a gap per changed element on top of its steps, and dense's unchanged elements
    # are zero bytes that zstd all but removes: past half the elements changed (every element, in
    # an fp32 step) sparse saves next to nothing and would double the work.
    if new_bits.size <= MAX_SPARSE_ELEMENTS and 2 * changed.size <= new_bits.size:  # gaps are uint32
        gaps = np.diff(changed, prepend=0).astype(np.uint32)  # first gap is the first index itself
        candidates.append(("sparse", {"indices": compressor.compress(byte_planes(gaps)),
                                      "steps": compressor.compress(byte_planes(moves[changed]))}))
    chosen, parts = min(candidates, key=lambda c: sum(len(b) for b in c[1].values()))
    return {**entry, "encoding": chosen}, parts


def apply_delta(base: Mapping[str, torch.Tensor], delta: Delta, workers: int = 0) -> dict[str, torch.Tensor]:
    """The tensors `delta` rebuilds from `base`, each checked bit for bit against its sha256
    (by `workers` threads, 0: `codec_workers()`).

    Raises DeltaError for anything that does not rebuild exactly what the entries declare."""
    if set(base) != set(delta.entries):
        missing = sorted(set(delta.entries) - set(base))
        extra = sorted(set(base) - set(delta.entries))
        raise DeltaError(f"the delta does not fit its base model (tensors it needs but the base lacks: "
                         f"{missing[:3]}; in the base but not in the delta: {extra[:3]})")
    names = sorted(delta.entries)
    with ThreadPoolExecutor(max_workers=workers or codec_workers()) as pool:
        return dict(zip(names, pool.map(lambda name: _rebuild_tensor(name, base[name], delta), names)))


def _rebuild_tensor(name: str, old_t: torch.Tensor, delta: Delta) -> torch.Tensor:
    decompressor = zstandard.ZstdDecompressor()
    entry = delta.entries[name]
    if not isinstance(entry, dict):
        raise DeltaError(f"tensor {name!r}: the delta entry is not an object")
    dtype, shape = _entry_dtype_shape(name, entry)
    if old_t.dtype != dtype or list(old_t.shape) != shape:
        raise DeltaError(f"tensor {name!r}: the delta is for {entry['dtype']} {shape}, the base holds "
                         f"{old_t.dtype} {list(old_t.shape)}")
    encoding = entry.get("encoding")
    if encoding == "words":  # every element's bit pattern (a keyframe's): the base is not read
        words = np.dtype(BIT_VIEWS[dtype][1])
        raw = from_byte_planes(_part(decompressor, delta, name, entry, "words", math.prod(shape) * words.itemsize),
                               words)
    else:
        raw = bits(old_t)
    if encoding == "sparse":
        count = _int_field(name, entry, "changed")
        if not 1 <= count <= raw.size:
            raise DeltaError(f"tensor {name!r}: the delta claims {count} changed elements of {raw.size}")
        gaps = from_byte_planes(_part(decompressor, delta, name, entry, "indices", count * 4), np.uint32)
        flipped = isinstance(entry.get("parts"), dict) and "flips" in entry["parts"]  # an earlier release's
        moves = from_byte_planes(_part(decompressor, delta, name, entry, "flips" if flipped else "steps",
                                       count * raw.itemsize), raw.dtype)
        indices = np.cumsum(gaps, dtype=np.int64)
        if count and (indices[-1] >= raw.size or (count > 1 and np.any(gaps[1:] == 0))):
            raise DeltaError(f"tensor {name!r}: the delta's indices fall outside the tensor or repeat")
        raw[indices] = raw[indices] ^ moves if flipped else apply_steps(raw[indices], moves)
    elif encoding == "dense":
        apply_steps(raw, from_byte_planes(_part(decompressor, delta, name, entry, "steps", raw.nbytes), raw.dtype))
    elif encoding == "xor":  # an earlier release's: old XOR new of every element
        raw ^= from_byte_planes(_part(decompressor, delta, name, entry, "xor", raw.nbytes), raw.dtype)
    elif encoding not in ("same", "words"):
        raise DeltaError(f"tensor {name!r}: unknown delta encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    digest = hashlib.sha256(raw.tobytes()).hexdigest()
    if digest != entry.get("sha256"):
        raise DeltaError(f"tensor {name!r} rebuilt with sha256 {digest[:12]}…, the manifest says "
                         f"{str(entry.get('sha256'))[:12]}…: refused")
    return from_bits(raw, dtype, shape)


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise DeltaError(f"weights of dtype {dtype} are not supported (bf16, fp16 or fp32)")
    return DTYPE_NAMES[dtype]


def _entry_dtype_shape(name: str, entry: dict) -> tuple[torch.dtype, list[int]]:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
    except (KeyError, TypeError, ValueError):
        raise DeltaError(f"tensor {name!r}: the delta entry has no valid dtype and shape") from None
    if any(n < 0 for n in shape):
        raise DeltaError(f"tensor {name!r}: the delta entry's shape {shape} has a negative size")
    return dtype, shape


def _int_field(name: str, entry: dict, key: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DeltaError(f"tensor {name!r}: the delta entry's {key!r} is not a count")
    return value


def _part(decompressor: zstandard.ZstdDecompressor, delta: Delta, name: str, entry: dict, part: str,
          expected: int) -> bytes:
    """The decompressed bytes of one payload part, which must be exactly `expected` long."""
    parts = entry.get("parts")
    key = parts.get(part) if isinstance(parts, dict) else None
    if not isinstance(key, str) or key not in delta.payload:
        raise DeltaError(f"tensor {name!r}: the delta's {part} payload is missing")
    blob = delta.payload[key]
    try:
        # The frame must declare exactly the size the entry does before anything is allocated:
        # zstd honours a declared content size over `max_output_size`.
        declared = zstandard.get_frame_parameters(blob).content_size
        if declared != expected:
            raise DeltaError(f"tensor {name!r}: the delta's {part} payload declares "
                             f"{'no size' if declared == zstandard.CONTENTSIZE_UNKNOWN else f'{declared} bytes'}, "
                             f"{expected} expected")
        out = decompressor.decompress(blob, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise DeltaError(f"tensor {name!r}: the delta's {part} payload does not decompress ({e})") from None
    if len(out) != expected:
        raise DeltaError(f"tensor {name!r}: the delta's {part} payload holds {len(out)} bytes, "
                         f"{expected} expected")
    return out
