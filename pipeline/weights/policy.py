"""Policy versions as keyframes and deltas in S3: `PolicyWriter.write` and `fetch_policy`.

A policy version is written through `pipeline.weights.store.CheckpointStore` (files, then a
signed manifest; every download chunked, resumable and checked against its sha256) in one
of two kinds, named in the manifest's `extra["weights"]`:

- a **keyframe** holds the model directory's config and tokenizer files and its weights,
  packed (`keyframe.safetensors`: every tensor's bit patterns in byte planes, zstd-compressed
  by `pipeline.weights.codec.encode_keyframe`, about 0.7 of a bf16 model's bytes), and, per
  weights file, the dtype, shape and sha256 of every tensor and the payload that holds it:
  `{"kind": "keyframe", "files": {"model.safetensors": {name: {dtype, shape, sha256}}},
  "packed": {"model.safetensors": {name: payload key}}}`. A keyframe without `packed`
  (earlier releases', or weights that would unpack to more than `MAX_UNPACK_RATIO` times
  their payload) holds the `*.safetensors` files as they are;
- a **delta** holds `delta.safetensors` (the compressed payload of `pipeline.weights.codec`
  as uint8 tensors) and names its base version, the keyframe its chain starts from, each
  tensor's encoding and sha256, and the non-weight files it takes from its base with their
  sha256: `{"kind": "delta", "base_version": b, "keyframe_version": k, "files": {file:
  {name: entry}}, "inherit": [{path, size, sha256}, ...]}`;
- a keyframe written after another version also holds the delta from it (its **bridge**:
  `delta.safetensors`, described under `"bridge"` as a delta is), so that a sampler holding
  the version before a keyframe takes the delta, not the full copy; only a sampler with no
  version on the way (a joiner, or one left too far behind) downloads the full copy.

The learner (`PolicyWriter`) keeps the weights it published last and writes a delta
against them, or a keyframe: every `keyframe_every` versions or when the deltas since the
last keyframe would outweigh a full copy (`KeyframeRule`), and whenever anything but the
weights changed. A sampler (`fetch_policy`) holding version h rebuilds version t from the
deltas after h when h is on t's chain, crossing keyframes by their bridges while that costs
fewer bytes than the newest keyframe's path (`read_chain`), else from t's keyframe and the
deltas after it (`choose_path`). Every rebuilt tensor
must match its signed sha256 bit for bit. When the path from h fails (its copy is not what
the chain says, a delta does not fit), the failure is recorded in the returned
`FetchReport` and the keyframe path is taken; when that fails too, or a version on the
chain is gone, the version is refused. The rebuilt directory is written only once all of
it has been verified.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pipeline.errors import UserError
from pipeline.weights.codec import (DTYPES, Delta, DeltaError, apply_delta, decode_keyframe, describe, encode_delta,
                                    encode_keyframe)
from pipeline.weights.store import (LEARNER_STATE_DIR, CheckpointNotFound, CheckpointStore, CorruptCheckpointError,
                                    Manifest, Transfer, is_pickle_file, link_or_copy, safe_relpath, sha256_file)

DELTA_FILE = "delta.safetensors"
PACKED_FILE = "keyframe.safetensors"
"""A keyframe's packed weights (`encode_keyframe`'s payload, as uint8 tensors like a delta's)."""
MAX_UNPACK_RATIO = 64
"""A packed keyframe may declare at most this many bytes of weights per byte of its payload
(trained weights: about 1.4): zstd rebuilds whatever size a manifest declares, so a forged one
could otherwise make a few MB ask for a machine's memory. The learner publishes weights that
would pack tighter (nearly all one value) as they are."""
WEIGHTS_SUFFIX = ".safetensors"
KEYFRAME, DELTA = "keyframe", "delta"


# --- pure decisions -----------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyframeRule:
    """When the learner publishes a full copy instead of a delta."""

    keyframe_every: int = 10
    """A keyframe at least every this many versions (1: every version is a keyframe)."""

    def choose(self, versions_since_keyframe: int, chain_bytes: int, delta_bytes: int, full_bytes: int) -> str:
        """`versions_since_keyframe`: deltas published since the last keyframe; `chain_bytes`: their
        total size; `delta_bytes` / `full_bytes`: this version as a delta / as a keyframe."""
        if self.keyframe_every <= 1 or versions_since_keyframe + 1 >= self.keyframe_every:
            return KEYFRAME
        if chain_bytes + delta_bytes >= full_bytes:  # a far-behind sampler would fetch more than a full copy
            return KEYFRAME
        return DELTA


@dataclass(frozen=True)
class Link:
    """One version of a chain, as its manifest describes it."""

    version: int
    kind: str
    base_version: Optional[int]
    nbytes: int
    """Bytes a sampler downloads for this version (its weights or its delta, no learner state)."""
    bridge_base: Optional[int] = None
    """A keyframe's bridge: the version its delta is from (None: it has none)."""
    bridge_nbytes: int = 0
    via_bridge: bool = False
    """Taken as the delta of its bridge, not as a full copy (`kind` is then DELTA)."""

    def bridged(self) -> "Link":
        """This keyframe as the delta from its bridge's base."""
        return Link(self.version, DELTA, self.bridge_base, self.bridge_nbytes, via_bridge=True)


HELD_KEYFRAMES = 2
"""At most this many keyframes besides the newest are held for joiners (`held_keyframe`)."""


def held_keyframe(published: list[dict], now: float, keep_s: float) -> Optional[int]:
    """The oldest keyframe still held for slow joiners, or None: each keyframe is kept (with the
    deltas after it) until `keep_s` seconds after the next keyframe was published, so that a
    sampler that started downloading it just before has that long to finish and then follow the
    deltas and bridges to the newest version; but no more than `HELD_KEYFRAMES` of them, so that
    a learner publishing keyframes every few seconds does not fill S3 (a link that needs longer
    than that for a keyframe could not follow such a learner's deltas either).
    `published`: `PolicyWriter.published`, oldest first."""
    keyframes = [p for p in published if p["kind"] == KEYFRAME][-HELD_KEYFRAMES - 1:]
    for older, newer in zip(keyframes, keyframes[1:]):
        if now - newer["at"] < keep_s:
            return older["version"]
    return None


def choose_path(chain: list[Link], have: Optional[int]) -> list[Link]:
    """The versions to download, in order, to rebuild the last of `chain`.

    `chain` runs from a keyframe, or from the version the sampler holds or the one after it,
    to the target (each link's base the one before it). A sampler holding `have` on the chain
    applies the deltas after it (their bytes never exceed the keyframe's and its deltas': they
    are a part of them); otherwise it starts from the keyframe."""
    versions = [link.version for link in chain]
    if have is not None and have in versions:
        return chain[versions.index(have) + 1:]
    if have is not None and chain and chain[0].kind == DELTA and chain[0].base_version == have:
        return chain
    if not chain or chain[0].kind != KEYFRAME:
        raise CorruptCheckpointError("a policy chain must start from a keyframe")
    return chain


def nbytes_of(path: list[Link]) -> int:
    """Bytes a sampler downloads for the links of `path`."""
    return sum(link.nbytes for link in path)


def restart_is_cheaper(remaining_bytes: int, newer_path_bytes: int) -> bool:
    """Whether a first policy's download with `remaining_bytes` of its path still to come should
    give way to a newer version whose own path (`path_bytes`: its keyframe and the deltas after
    it) is fewer bytes: a version a newer one has overtaken is not worth finishing. What arrived
    of the first path is lost either way, so only what is left of it is weighed."""
    return newer_path_bytes < remaining_bytes


def path_bytes(store: CheckpointStore, manifest_key: str, expect_version: int) -> int:
    """Bytes a sampler holding nothing downloads for the version at `manifest_key` (manifests read)."""
    links, _ = read_chain(store, store.read_expected(manifest_key, expect_version))
    return nbytes_of(choose_path(links, None))


# --- reading and writing weights --------------------------------------------------------------

def _is_policy_file(rel: PurePosixPath) -> bool:
    """A file samplers get: not learner state, not a pickle-based format (never published)."""
    return LEARNER_STATE_DIR not in rel.parts and not is_pickle_file(rel.name)


def weights_files(model_dir: Path) -> list[str]:
    """The safetensors weight files of a model directory (relative paths, sorted)."""
    model_dir = Path(model_dir)
    return sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*" + WEIGHTS_SUFFIX)
                  if p.is_file() and _is_policy_file(PurePosixPath(p.relative_to(model_dir).as_posix())))


def other_files(model_dir: Path) -> list[dict]:
    """The model directory's other published files (config, tokenizer, ...): path, size, sha256."""
    model_dir = Path(model_dir)
    weights = set(weights_files(model_dir))
    out = []
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir).as_posix()
        if p.is_file() and rel not in weights and _is_policy_file(PurePosixPath(rel)):
            out.append({"path": rel, "size": p.stat().st_size, "sha256": sha256_file(p)})
    return out


def lay_out(tensors: dict[str, torch.Tensor], model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """`tensors` (a model's state dict) arranged by weights file as `model_dir` stores the same
    model (only its files' headers are read). A tensor the files do not name must be one they
    store under another name (tied weights, stored once); anything else is a ValueError, as is
    a named tensor missing from `tensors`."""
    layout = {}
    for name in weights_files(model_dir):
        with safe_open(str(Path(model_dir) / name), framework="pt") as f:
            layout[name] = list(f.keys())
    placed = {key for keys in layout.values() for key in keys}
    missing = sorted(placed - set(tensors))
    stored = {id(tensors[key]) for key in placed & set(tensors)}
    unplaced = sorted(k for k in set(tensors) - placed if id(tensors[k]) not in stored)
    if missing or unplaced:
        raise ValueError(f"the weights do not fit the files of {model_dir}: missing {missing[:3]}, "
                         f"not stored there {unplaced[:3]}")
    return {name: {key: tensors[key] for key in keys} for name, keys in layout.items()}


def read_weights(model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a model directory, by weights file."""
    return {name: load_file(str(Path(model_dir) / name)) for name in weights_files(model_dir)}


def write_weights(weights: dict[str, dict[str, torch.Tensor]], model_dir: Path) -> None:
    for name, tensors in weights.items():
        target = Path(model_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(target), metadata={"format": "pt"})


def _payload_tensors(payload: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {key: torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
            for key, blob in payload.items()}


def _payload_bytes(path: Path) -> dict[str, bytes]:
    """A payload file's parts, read one at a time (a keyframe's is most of a model: never twice in memory)."""
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key).numpy().tobytes() for key in f.keys()}


# --- the learner's side -----------------------------------------------------------------------

class PolicyWriter:
    """Publishes each policy version as a keyframe or a delta against the one before it.

    Only what samplers read is published: the weights (cast to `dtype` when given) and the
    model directory's other files; a `learner_state/` beside them is the recovery state's
    (`pipeline.weights.recovery`), never the policy's."""

    def __init__(self, store: CheckpointStore, rule: KeyframeRule = KeyframeRule(),
                 dtype: Optional[torch.dtype] = None, work_dir: Optional[Path] = None):
        """`work_dir`: where each version is staged before upload (default: beside the model
        directory published; the learner passes its own, so a read-only base model is fine)."""
        self.store = store
        self.work_dir = work_dir
        self.rule = rule
        self.dtype = dtype
        """The dtype samplers get (None: as saved, the learner's precision)."""
        self._last: Optional[tuple[int, dict[str, dict[str, torch.Tensor]], list[dict]]] = None
        """(version, weights, other files) published last: the base of the next delta."""
        self._keyframe_version: Optional[int] = None
        self._since_keyframe = 0
        self._chain_bytes = 0
        self._keyframe_bytes = 0
        """What the last keyframe cost a sampler (packed): what the deltas after it are weighed against."""
        self.published: list[dict] = []
        """Per version: version, kind, bytes a sampler downloads (a keyframe's full copy), a keyframe's
        bridge bytes (0: none), full bytes, and when it was published (time.time())."""

    def write(self, version: int, model_dir: Path, extra: Optional[dict] = None,
                parent_version: Optional[int] = None, keyframe: bool = False,
                tensors: Optional[dict[str, torch.Tensor]] = None) -> str:
        """Upload the policy of `model_dir` (a saved model) as `version`; returns the manifest key.
        `keyframe`: a full copy whatever the rule says (the last version of a run: it stands alone).
        `tensors`: the weights by name, in place of those in `model_dir`'s files and laid out as
        they are (`lay_out`): the learner hands over what it copied in memory, so nothing is
        written to disk and read back for a policy alone."""
        model_dir = Path(model_dir)
        weights = read_weights(model_dir) if tensors is None else lay_out(tensors, model_dir)
        if not weights:
            raise CorruptCheckpointError(f"{model_dir} holds no *.safetensors weights to publish")
        cast = self.dtype is not None and any(t.is_floating_point() and t.dtype != self.dtype
                                              for tensors in weights.values() for t in tensors.values())
        if cast:
            weights = {name: {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in tensors.items()}
                       for name, tensors in weights.items()}
        others = other_files(model_dir)
        full_bytes = sum(t.numel() * t.element_size() for tensors in weights.values() for t in tensors.values())
        delta = self._delta_against_last(version, weights, others)
        kind = KEYFRAME if delta is None or keyframe else self.rule.choose(
            self._since_keyframe, self._chain_bytes, sum(d.nbytes for d in delta.values()),
            self._keyframe_bytes or full_bytes)
        bridge_bytes = 0
        with tempfile.TemporaryDirectory(prefix=f".policy-v{version}-", dir=self.work_dir or model_dir.parent) as tmp:
            staged = Path(tmp)
            for f in others:
                link_or_copy(model_dir / f["path"], staged / f["path"])
            if kind == KEYFRAME:
                description = self._stage_keyframe(weights, staged, model_dir, written=cast or tensors is not None)
                if delta is not None:  # the samplers holding the version before take this, not the copy
                    description["bridge"] = {"base_version": self._last[0], "files": self._write_delta(delta, staged),
                                             "inherit": others}
                    bridge_bytes = (staged / DELTA_FILE).stat().st_size
                self._keyframe_version, self._since_keyframe, self._chain_bytes = version, 0, 0
            else:
                description = self._stage_delta(delta, staged, others)
            key = self.store.upload(version, staged, {**(extra or {}), "weights": description}, parent_version)
            nbytes = sum(p.stat().st_size for p in staged.rglob("*") if p.is_file()) - bridge_bytes
        if kind == DELTA:
            self._since_keyframe += 1
            self._chain_bytes += nbytes
        else:
            self._keyframe_bytes = nbytes
        self._last = (version, weights, others)
        self.published.append({"version": version, "kind": kind, "bytes": nbytes, "bridge_bytes": bridge_bytes,
                               "full_bytes": full_bytes + sum(f["size"] for f in others), "at": time.time()})
        return key

    def _delta_against_last(self, version, weights, others) -> Optional[dict[str, Delta]]:
        """The delta from the last published version, or None where only a keyframe will do: the
        first version, a version number not above the last, other files or architecture changed."""
        if self._last is None or version <= self._last[0] or set(self._last[1]) != set(weights) \
                or self._last[2] != others:
            return None
        try:
            return {name: encode_delta(self._last[1][name], tensors) for name, tensors in weights.items()}
        except DeltaError:  # a different architecture or dtype: start a new chain
            return None

    def _stage_delta(self, delta: dict[str, Delta], staged: Path, others: list[dict]) -> dict:
        """Stage the delta alone in `staged` (its other files are inherited); returns the manifest's
        description of the delta."""
        # The other files travel by reference ("inherit"): a delta's directory holds only its payload.
        for f in others:
            (staged / f["path"]).unlink()
        for d in sorted((p for p in staged.rglob("*") if p.is_dir()), reverse=True):
            d.rmdir()
        return {"kind": DELTA, "base_version": self._last[0], "keyframe_version": self._keyframe_version,
                "files": self._write_delta(delta, staged), "inherit": others}

    def _stage_keyframe(self, weights, staged: Path, model_dir: Path, written: bool) -> dict:
        """Stage the keyframe's weights in `staged`, packed (`encode_keyframe`); returns the
        manifest's description. Weights that pack tighter than `MAX_UNPACK_RATIO` allows a
        reader go as they are (`written`: they differ from `model_dir`'s files, so they are
        saved, not linked)."""
        packed = {name: encode_keyframe(tensors) for name, tensors in weights.items()}
        files = {name: {tensor: {k: entry[k] for k in ("dtype", "shape", "sha256")}
                        for tensor, entry in delta.entries.items()} for name, delta in packed.items()}
        if unpacks_within_bound(files, sum(d.nbytes for d in packed.values())):
            entries = self._write_delta(packed, staged, PACKED_FILE)
            return {"kind": KEYFRAME, "files": files, "packed": {
                name: {tensor: entry["parts"]["words"] for tensor, entry in tensors.items()}
                for name, tensors in entries.items()}}
        if written:
            write_weights(weights, staged)
        else:
            for name in weights:
                link_or_copy(model_dir / name, staged / name)
        return {"kind": KEYFRAME, "files": files}

    @staticmethod
    def _write_delta(delta: dict[str, Delta], staged: Path, file_name: str = DELTA_FILE) -> dict:
        """Write `delta` (a delta's, or a keyframe's packed weights) as `file_name` into `staged`;
        returns its entries by weights file."""
        payload: dict[str, bytes] = {}
        files = {}
        for name, file_delta in delta.items():
            entries = {}
            for tensor, entry in file_delta.entries.items():
                for key in entry["parts"].values():
                    payload[f"{name}::{key}"] = file_delta.payload[key]
                entries[tensor] = {**entry, "parts": {part: f"{name}::{key}" for part, key in entry["parts"].items()}}
            files[name] = entries
        save_file(_payload_tensors(payload), str(staged / file_name), metadata={"format": "heterorl-delta/1"})
        return files


def prune_policies(store: CheckpointStore, current: int, keep_from: int) -> list[int]:
    """Delete the versions below `keep_from` (and up to `current`) that no version from
    `keep_from` on needs: a kept delta keeps its whole chain back to its keyframe. v0, the
    base model, and versions above `current` (left by a crashed learner) stay. Returns
    the deleted versions."""
    versions = [v for v in store.list_versions() if v <= current]
    kept = [v for v in versions if v >= keep_from]
    if not kept:
        return []
    floor = kept[0]
    try:
        links, _ = read_chain(store, store.read_manifest(store.manifest_key(kept[0])))
        floor = links[0].version
    except (CheckpointNotFound, CorruptCheckpointError):
        return []  # an unreadable chain: keep everything rather than guess
    doomed = [v for v in versions if 0 < v < floor]
    for v in doomed:
        store.delete(v)
    return doomed


# --- the sampler's side -----------------------------------------------------------------------

@dataclass
class FetchReport:
    """What one `fetch_policy` did."""

    path: list[int] = field(default_factory=list)
    """Versions downloaded, in order."""
    bytes_downloaded: int = 0
    keyframe_bytes: int = 0
    """Of `bytes_downloaded`, the keyframe's (0 when the path started from the caller's copy)."""
    refused: list[str] = field(default_factory=list)
    """Why a path was refused before the one that worked (a broken chain, a tampered delta)."""
    from_keyframe: bool = False


def weights_description(manifest: Manifest) -> dict:
    """The manifest's `extra.weights`, checked for shape (a manifest without it is a plain
    keyframe: every version published before deltas). CorruptCheckpointError if malformed."""
    weights = manifest.extra.get("weights")
    if weights is None:
        return {"kind": KEYFRAME, "files": None}

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest v{manifest.version}: {what}")

    def tensor_files(files) -> dict:
        if not isinstance(files, dict) or not all(
                isinstance(name, str) and isinstance(entries, dict)
                and all(isinstance(t, str) and isinstance(e, dict) and e.get("dtype") in DTYPES
                        and isinstance(e.get("shape"), list)
                        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in e["shape"])
                        for t, e in entries.items())
                for name, entries in files.items()):
            raise bad("its weights files are not described tensor by tensor")
        for name in files:  # tensors are written under these names: inside the model directory only
            if safe_relpath(name) != name or not name.endswith(WEIGHTS_SUFFIX) or not _is_policy_file(
                    PurePosixPath(name)) or name in (DELTA_FILE, PACKED_FILE):
                raise bad(f"{name!r} is not a weights file of a model directory")
        return files

    def delta_part(part, what: str) -> dict:
        """A delta's base, tensors and inherited files (a delta version's, or a keyframe's bridge)."""
        if not isinstance(part, dict):
            raise bad(f"{what} is not described")
        base = part.get("base_version")
        if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < manifest.version:
            raise bad(f"{what} without a valid base version")
        files = tensor_files(part.get("files"))
        inherit = part.get("inherit")
        if not isinstance(inherit, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str)
                                                    and isinstance(f.get("sha256"), str) for f in inherit):
            raise bad(f"{what} whose inherited files are not listed")
        for f in inherit:
            rel = PurePosixPath(safe_relpath(f["path"]))
            if rel.name.endswith(WEIGHTS_SUFFIX) or not _is_policy_file(rel):
                raise bad(f"{what} may not inherit {f['path']!r}")
        return {"base_version": base, "files": files, "inherit": inherit}

    if not isinstance(weights, dict) or weights.get("kind") not in (KEYFRAME, DELTA):
        raise bad(f"unknown weights kind {weights.get('kind') if isinstance(weights, dict) else weights!r}")
    if weights["kind"] == DELTA:
        return {"kind": DELTA, **delta_part(weights, "a delta")}
    files = tensor_files(weights.get("files"))
    bridge = None if weights.get("bridge") is None else delta_part(weights["bridge"], "a keyframe's bridge")
    packed = weights.get("packed")
    if packed is not None:
        if not isinstance(packed, dict) or {n: set(t) for n, t in packed.items() if isinstance(t, dict)} != {
                n: set(t) for n, t in files.items()} or not all(
                isinstance(key, str) for tensors in packed.values() for key in tensors.values()):
            raise bad("its packed weights are not the tensors its files name, each by its payload")
        packed = {name: {tensor: {**files[name][tensor], "encoding": "words", "parts": {"words": key}}
                         for tensor, key in tensors.items()} for name, tensors in packed.items()}
    return {"kind": KEYFRAME, "files": files, "bridge": bridge, "packed": packed}


def _unpacked_weight_bytes(files: dict) -> int:
    """The bytes of the tensors a keyframe's `files` describe."""
    return sum(math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize
               for entries in files.values() for entry in entries.values())


def unpacks_within_bound(files: dict, packed_bytes: int) -> bool:
    """Whether the tensors `files` describe fit `MAX_UNPACK_RATIO` times `packed_bytes`."""
    return _unpacked_weight_bytes(files) <= MAX_UNPACK_RATIO * max(1, packed_bytes)


def unpacked_bytes(manifest: Manifest) -> int:
    """A version's size as a sampler holds it once rebuilt: its tensors' bytes (bf16 or as
    published) and its other files; what a keyframe or a delta costs is `link_of(...).nbytes`."""
    files = weights_description(manifest)["files"]
    if files is None:  # a plain checkpoint: its files as they are
        return sum(f["size"] for f in manifest.files if _is_policy_file(PurePosixPath(f["path"])))
    return _unpacked_weight_bytes(files) + sum(f["size"] for f in _other_files_of(manifest))


def link_of(manifest: Manifest) -> Link:
    """The chain link a manifest describes."""
    description = weights_description(manifest)
    sizes = {f["path"]: f["size"] for f in manifest.files if not f["path"].startswith(LEARNER_STATE_DIR + "/")}
    if description.get("packed") is not None:
        if PACKED_FILE not in sizes:
            raise CorruptCheckpointError(f"manifest v{manifest.version}: packed weights without their {PACKED_FILE}")
        if not unpacks_within_bound(description["files"], sizes[PACKED_FILE]):
            raise CorruptCheckpointError(f"manifest v{manifest.version}: its weights would unpack to more than "
                                         f"{MAX_UNPACK_RATIO} times its {PACKED_FILE} (refused unread)")
    bridge = description.get("bridge")
    if description["kind"] == KEYFRAME and bridge is not None:
        if DELTA_FILE not in sizes:
            raise CorruptCheckpointError(f"manifest v{manifest.version}: a bridge without its {DELTA_FILE}")
        bridge_nbytes = sizes.pop(DELTA_FILE)
        return Link(manifest.version, KEYFRAME, None, sum(sizes.values()), bridge["base_version"], bridge_nbytes)
    return Link(manifest.version, description["kind"], description.get("base_version"), sum(sizes.values()))


MANIFESTS_AHEAD = 8
"""Manifests read side by side while a chain is walked back: the version needed and the ones
below it, this many in all (a chain's links are nearly always consecutive versions, and on a far
link each read is a round trip). A guess that is not needed costs one small read; its errors are
never seen."""


class _ManifestsAhead:
    """The manifests of the versions a chain walk will need, read `MANIFESTS_AHEAD` at a time by
    threads; guesses never below `floor` (the sampler's own version is read only if the walk
    itself needs it)."""

    def __init__(self, store: CheckpointStore, floor: int):
        self.store, self.floor = store, floor
        self.pool = ThreadPoolExecutor(max_workers=MANIFESTS_AHEAD, thread_name_prefix="manifest-read")
        self.reads: dict = {}

    def read(self, version: int) -> Manifest:
        lowest = min(version, max(self.floor, version - MANIFESTS_AHEAD + 1))  # the one needed, always
        for v in range(version, lowest - 1, -1):
            if v not in self.reads:
                self.reads[v] = self.pool.submit(self.store.read_manifest, self.store.manifest_key(v))
        return self.reads.pop(version).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def read_chain(store: CheckpointStore, manifest: Manifest, have: Optional[int] = None,
               max_links: int = 1000) -> tuple[list[Link], dict[int, Manifest]]:
    """The links from the keyframe `manifest`'s version rests on, or from the version after
    `have` if the chain passes through it, up to `manifest` (oldest first), and their
    manifests. `have`'s own manifest is not read: the caller's copy was verified when it was
    fetched, and a version altered in the bucket since then must not block the deltas after
    it (every tensor they rebuild is checked against the target's signed manifest).

    A keyframe with a bridge is crossed as the delta from its bridge's base while the deltas
    down to `have` cost fewer bytes than the newest keyframe's path (that keyframe and the
    deltas after it); where they would not, or a version on the way is gone, or a keyframe has
    no bridge, the chain from the newest keyframe is returned. Raises CheckpointNotFound when a
    version on that chain is gone. The manifests below are read ahead (`MANIFESTS_AHEAD`)."""
    ahead = _ManifestsAhead(store, floor=0 if have is None else have + 1)
    try:
        return _walk_chain(ahead, manifest, have, max_links)
    finally:
        ahead.close()


def _walk_chain(ahead: _ManifestsAhead, manifest: Manifest, have: Optional[int],
                max_links: int) -> tuple[list[Link], dict[int, Manifest]]:
    manifests = {manifest.version: manifest}
    links = [link_of(manifest)]
    newest_keyframe: Optional[tuple[list[Link], dict[int, Manifest]]] = None
    """The chain from the newest keyframe, once the walk has crossed it by its bridge."""

    def reached(link: Link) -> bool:
        return have is not None and have in (link.version, link.base_version)

    def costs_more(candidate: list[Link]) -> bool:
        return nbytes_of(candidate) >= nbytes_of(newest_keyframe[0])

    while not reached(links[0]):
        first = links[0]
        if first.kind == KEYFRAME:
            if have is None or first.bridge_base is None or have >= first.version:
                break
            newest_keyframe = newest_keyframe or (list(links), dict(manifests))
            links[0] = first.bridged()
            if costs_more(links):
                return newest_keyframe
            continue
        if len(links) > max_links:
            raise CorruptCheckpointError(f"the chain of v{manifest.version} is longer than {max_links} versions")
        try:
            base = ahead.read(first.base_version)
        except CheckpointNotFound:
            if newest_keyframe is not None:  # pruned below the keyframe: take the keyframe
                return newest_keyframe
            raise
        if base.version != first.base_version:
            raise CorruptCheckpointError(f"the manifest at v{first.base_version} says v{base.version}")
        manifests[base.version] = base
        links.insert(0, link_of(base))
        if newest_keyframe is not None and links[0].kind == DELTA and costs_more(links):
            return newest_keyframe
    if newest_keyframe is not None and not reached(links[0]):
        return newest_keyframe
    return links, manifests


def fetch_policy(store: CheckpointStore, manifest_key: str, dest_dir: Path, *,
                 have: Optional[tuple[int, Path]] = None, expect_version: Optional[int] = None,
                 work_dir: Optional[Path] = None, transfer: Optional[Transfer] = None
                 ) -> tuple[Path, Manifest, FetchReport]:
    """Rebuild the version at `manifest_key` into `dest_dir` as a plain model directory.

    `have`: (version, directory) of a verified copy the caller holds, the base for its deltas.
    Every tensor is checked against the signed sha256 before `dest_dir` appears; a path from
    `have` that fails (the copy is not what the chain says, a delta does not fit or was
    tampered with) is recorded in the report, and the keyframe path is tried; if that fails
    too, CorruptCheckpointError (or CheckpointNotFound when a version on the chain is gone).
    `transfer`: the path's bytes (`planned`) and those received, and a cancel that gives the
    download up (DownloadCancelled; `pipeline.weights.follower.PolicyFollower` restarts a first
    policy's download on a newer version whose path is fewer bytes than what is left of this one)."""
    transfer = transfer or Transfer()
    target = store.read_expected(manifest_key, expect_version)
    dest_dir = Path(dest_dir)
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(work_dir or dest_dir.parent)
    work_dir.mkdir(parents=True, exist_ok=True)
    report = FetchReport()
    links, manifests = read_chain(store, target, have=have[0] if have else None)
    path = choose_path(links, have[0] if have else None)
    transfer.planned = nbytes_of(path)
    if have is not None and (not path or path[0].kind == DELTA):
        try:
            origin = Path(have[1])
            weights = _rebuild(store, path, manifests, origin, _read_local(origin), work_dir, report, transfer)
            if not path:  # the caller holds the target itself: check it as if it had been downloaded
                _check_tensors(target, weights)
                _check_files(target, _other_files_of(target), origin)
            return _finish(weights, origin, dest_dir, target), target, report
        except (DeltaError, CorruptCheckpointError) as e:
            report.refused.append(f"from v{have[0]}: {e}")
            if links[0].kind != KEYFRAME:
                links, manifests = read_chain(store, target)
            path = links
            transfer.planned = transfer.received + nbytes_of(path)
    report.from_keyframe = True
    keyframe = path[0]
    origin = Path(tempfile.mkdtemp(prefix=f"keyframe-v{keyframe.version}-", dir=work_dir))
    try:
        origin_dir, _ = store.fetch(store.manifest_key(keyframe.version), origin / "model",
                                    expect_version=keyframe.version, skip=frozenset({DELTA_FILE}),
                                    read=manifests[keyframe.version], transfer=transfer)
        report.path.append(keyframe.version)
        report.bytes_downloaded += keyframe.nbytes
        report.keyframe_bytes += keyframe.nbytes
        packed = weights_description(manifests[keyframe.version]).get("packed")
        if packed is None:
            weights = read_weights(origin_dir)
            _check_tensors(manifests[keyframe.version], weights)
        else:  # every tensor unpacked was checked against the sha256 of its `files` entry
            weights = _unpack(packed, origin_dir)
        if len(path) == 1 and packed is None:  # its verified files are the result (a packed one is written out)
            if dest_dir.exists():
                shutil.rmtree(dest_dir)
            shutil.move(str(origin_dir), str(dest_dir))
            return dest_dir, target, report
        weights = _rebuild(store, path[1:], manifests, origin_dir, weights, work_dir, report, transfer)
        return _finish(weights, origin_dir, dest_dir, target), target, report
    except DeltaError as e:
        raise CorruptCheckpointError(f"refused policy v{target.version}: {e}") from None
    finally:
        shutil.rmtree(origin, ignore_errors=True)


def check_copy(store: CheckpointStore, manifest_key: str, model_dir: Path, expect_version: int) -> Manifest:
    """The version at `manifest_key` as a copy someone else wrote holds it (the learner's
    publisher, on its host: `pipeline.weights.same_host.HostCopies`), checked as a download is:
    every tensor against the signed manifest's dtype, shape and sha256, every other file against
    its sha256. Its manifest; CorruptCheckpointError if the copy is not that version (or cannot
    be read), CheckpointNotFound if the version is gone."""
    target = store.read_expected(manifest_key, expect_version)
    if weights_description(target)["files"] is None:  # an earlier release's plain checkpoint
        raise CorruptCheckpointError(f"v{target.version}'s manifest names no tensor sha256 to check a copy against")
    try:
        weights = _read_local(Path(model_dir))
        _check_tensors(target, weights)
        _check_files(target, _other_files_of(target), Path(model_dir))
    except DeltaError as e:
        raise CorruptCheckpointError(f"the copy of v{target.version} in {model_dir} is not what it signed: {e}") \
            from None
    return target


def _unpack(packed: dict, origin_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A packed keyframe's weights, by weights file, out of its `PACKED_FILE` in `origin_dir`
    (removed: the rest of the directory is the model's other files)."""
    payload_file = origin_dir / PACKED_FILE
    try:
        payload = _payload_bytes(payload_file)
    except SafetensorError as e:
        raise DeltaError(f"the keyframe's {PACKED_FILE} is not a safetensors file ({e})") from None
    payload_file.unlink()
    return {name: decode_keyframe(Delta(entries=entries, payload=payload)) for name, entries in packed.items()}


def _read_local(model_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The caller's own copy; one that cannot be read is a copy that does not fit (DeltaError)."""
    try:
        return read_weights(model_dir)
    except (OSError, SafetensorError, ValueError) as e:
        raise DeltaError(f"the local copy in {model_dir} cannot be read ({type(e).__name__}: {e})") from None


def _check_tensors(manifest: Manifest, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    """Every tensor as the manifest describes it: the same files and names, dtype, shape, sha256."""
    files = weights_description(manifest)["files"]
    if files is None:
        return  # a plain checkpoint: its files' sha256 were checked by the download
    if set(files) != set(weights):
        raise DeltaError(f"v{manifest.version} holds weights files {sorted(files)}, the copy {sorted(weights)}")
    for name, tensors in weights.items():
        if set(files[name]) != set(tensors):
            raise DeltaError(f"v{manifest.version}: {name} does not hold the tensors its manifest names")
        for tensor, entry in files[name].items():
            got = describe(tensors[tensor])
            if any(got[k] != entry.get(k) for k in ("dtype", "shape", "sha256")):
                raise DeltaError(f"v{manifest.version}: tensor {tensor!r} does not match its manifest")


PREFETCH_DELTAS = 2
"""Deltas of a path downloaded at once, ahead of the one being applied: a far link's round trips
and the rebuild overlap the next downloads. At most this many payloads and one more wait in
memory besides the one applied. A path refused midway waits for the downloads under way before
the keyframe path is tried, and those are not counted in `bytes_downloaded`."""


def _rebuild(store, deltas: list[Link], manifests: dict[int, Manifest], origin_dir: Path,
             weights: dict[str, dict[str, torch.Tensor]], work_dir: Path, report: FetchReport,
             transfer: Transfer):
    """Apply `deltas` in order to `weights` (read from `origin_dir`, which must hold each delta's
    inherited files); returns the rebuilt weights. Each delta is downloaded by a thread up to
    `PREFETCH_DELTAS` ahead of the one being applied."""
    with ThreadPoolExecutor(max_workers=PREFETCH_DELTAS, thread_name_prefix="delta-fetch") as pool:
        pending = deque()
        try:
            for i, link in enumerate(deltas):
                while len(pending) <= PREFETCH_DELTAS and i + len(pending) < len(deltas):
                    ahead = deltas[i + len(pending)]
                    pending.append(pool.submit(_delta_payload, store, ahead, manifests[ahead.version], work_dir,
                                               transfer))
                payload = pending.popleft().result()
                report.path.append(link.version)
                report.bytes_downloaded += link.nbytes
                manifest = manifests[link.version]
                description = weights_description(manifest)
                if link.via_bridge:  # a keyframe taken as the delta from the version before it
                    description = description["bridge"]
                files = description["files"]
                if set(files) != set(weights):
                    raise DeltaError(f"delta v{link.version} is for weights files {sorted(files)}, its base holds "
                                     f"{sorted(weights)}")
                weights = {name: apply_delta(weights[name], Delta(entries=entries, payload=payload))
                           for name, entries in files.items()}
                del payload  # applied: in memory now, the payloads of the downloads ahead only
                _check_files(manifest, description["inherit"], origin_dir)
        finally:
            for future in pending:  # a refused delta: the downloads ahead of it are not wanted
                future.cancel()
    return weights


def _delta_payload(store, link: Link, manifest: Manifest, work_dir: Path, transfer: Transfer) -> dict[str, bytes]:
    """The payload of `link`'s delta (a delta version's, or a keyframe's bridge), downloaded and
    checked against its sha256 in the signed manifest."""
    scratch = Path(tempfile.mkdtemp(prefix=f"delta-v{link.version}-", dir=work_dir))
    try:
        delta_dir, _ = store.fetch(manifest.key, scratch / "d", expect_version=link.version,
                                   only=frozenset({DELTA_FILE}), read=manifest, transfer=transfer)
        return _payload_bytes(delta_dir / DELTA_FILE)
    except SafetensorError as e:
        raise DeltaError(f"delta v{link.version}'s payload is not a safetensors file ({e})") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _other_files_of(manifest: Manifest) -> list[dict]:
    """The non-weight files a version's directory holds, with their sha256."""
    description = weights_description(manifest)
    if description["kind"] == DELTA:
        return description["inherit"]
    return [f for f in manifest.files if not f["path"].endswith(WEIGHTS_SUFFIX)
            and _is_policy_file(PurePosixPath(f["path"]))]


def _check_files(manifest: Manifest, files: list[dict], origin_dir: Path) -> None:
    for f in files:
        path = origin_dir / safe_relpath(f["path"])
        if not path.is_file() or sha256_file(path) != f["sha256"]:
            raise DeltaError(f"v{manifest.version} takes {f['path']} with sha256 {f['sha256'][:12]}…, which "
                             f"{origin_dir} does not hold")


def _finish(weights, origin_dir: Path, dest_dir: Path, target: Manifest) -> Path:
    """Write the verified weights and the target's other files (from `origin_dir`) to `dest_dir`."""
    return write_model_dir(weights, _other_files_of(target), origin_dir, dest_dir)


def write_model_dir(weights: dict[str, dict[str, torch.Tensor]], others: list[dict], origin_dir: Path,
                    dest_dir: Path) -> Path:
    """A model directory at `dest_dir`: `weights` by weights file, and the `others` (entries with
    a relative `path`) copied from `origin_dir`; it appears whole or not at all."""
    staging = Path(tempfile.mkdtemp(prefix=".rebuilding-", dir=dest_dir.parent))
    try:
        for f in others:
            rel = safe_relpath(f["path"])
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin_dir / rel, staging / rel)
        write_weights(weights, staging)
        if dest_dir.exists():
            shutil.rmtree(dest_dir)
        staging.rename(dest_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest_dir


# --- any version, by its address ----------------------------------------------------------------

class CheckpointUrlError(UserError, ValueError):
    """A checkpoint address that does not name a published version."""


_URL = re.compile(r"s3://(?P<bucket>[^/]+)/(?P<run>.+?)/v(?P<version>\d+)/?(?:manifest\.json)?")


def parse_checkpoint_url(url: str) -> tuple[str, str, int]:
    """`s3://BUCKET/RUN/vN/` (as runs print it, with or without `manifest.json`) -> (bucket, run, N)."""
    match = _URL.fullmatch(url.strip())
    if match is None:
        raise CheckpointUrlError(f"{url!r} is not a published version: expected s3://BUCKET/RUN/vN/ "
                                 "(as `heterorl train` prints it)")
    return match["bucket"], match["run"], int(match["version"])


def fetch_published(client, url: str, out: Path, trusted=None) -> tuple[Path, Manifest, FetchReport]:
    """Rebuild the version at `url` into `out` (a plain Hugging Face directory), every tensor
    checked against its manifest; `trusted`: the learner public key its manifests must carry."""
    bucket, run, version = parse_checkpoint_url(url)
    store = CheckpointStore(client, bucket, run, trusted=trusted)
    out = Path(out)
    return fetch_policy(store, store.manifest_key(version), out, expect_version=version)
