"""Checkpoints in S3 (upload files, then the manifest; readers verify every byte) and the signed
pointer in Redis that names the current one.

Layout in the bucket: `<run>/v<version>/<file>` for each file of a Hugging Face model
directory (safetensors weights, config, tokenizer files), then
`<run>/v<version>/manifest.json` written last:

    {"format": "heterorl-checkpoint/1", "run": ..., "version": 3, "parent_version": 2,
     "created_at": ..., "files": [{"path": "model.safetensors", "size": 123, "sha256": "..."}, ...],
     "extra": {...},          # e.g. the Kafka offsets the learner had consumed
     "signature": {"key_id": ..., "value": ...}}   # the learner's Ed25519 signature

The signature covers the canonical JSON of everything else (`pipeline.wire.signing`), so the
file list, every sha256, the version and its parent are the learner's word; a reader that
pins the learner's public key (`trusted`) refuses an unsigned or altered manifest, and any
manifest whose run and version do not match the key it was read from.

A version without a manifest does not exist: `list_versions` and `fetch` only see
versions whose manifest is present, so a learner that dies mid-upload leaves nothing
a sampler could load. Fetching checks size and sha256 of every file and refuses the
checkpoint (CorruptCheckpointError) on any mismatch.

Policy versions samplers read (`pipeline.weights.policy`: keyframes and deltas) and the
learner's recovery states (`pipeline.weights.recovery`, under `<run>/state/s<step>/`, with
`learner_state/`: optimizer moments, fp32 master weights and LR schedule as safetensors +
JSON) are both published through this store; `fetch` leaves `learner_state/` out unless
the learner asks for it.

No pickle crosses the network: `publish` leaves out files that formats built on pickle
use (`.pt`, `.pth`, `.bin`, `.pkl`, `.pickle`, `.ckpt`), for instance the PyTorch weights
beside the safetensors of a downloaded model, and `fetch` refuses a manifest that names
one.

Downloads are chunked HTTP range requests into a partial file kept beside the
destination: a transfer cut at 90 % resumes at 90 % (also in a later `fetch` of the same
manifest), with bounded retries and backoff, so a slow link never restarts from zero.

The policy pointer (the end of this module): which version is current and where its manifest
is, in Redis, signed by the learner. Written (`PolicyPointer.set`, by the publisher once the
version's manifest is in S3), read (`PolicyPointer.read`) and verified (`verify_pointer`, by
samplers, validators and the evaluator against the learner key they pin) here, and nowhere
else. Redis holds the fields as text under `heterorl:<run>:policy`: version, manifest_key,
updated_at, and signature (JSON of {key_id, value}: an Ed25519 signature over
`pointer_document`). A sampler reads the same fields in its turn's one round trip
(`pipeline.clients.run_state.RunState.sampler_view`) and checks them with `verify_pointer`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional
from urllib.parse import urlparse

import redis
import urllib3
from minio import Minio
from minio.error import S3Error

from pipeline.errors import UserError
from pipeline.clients.retry import retry_call
from pipeline.clients.run_state import MalformedPointer, Pointer, not_a_hash, parse_pointer, wrong_type
from pipeline.clients.services import CredentialsRefused, ServiceUnavailable, Services
from pipeline.wire.signing import PublicKey, SignatureError, SigningKey, sign_document, verify_document

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "heterorl-checkpoint/1"
LEARNER_STATE_DIR = "learner_state"
"""Subdirectory of a checkpoint that only the learner downloads."""
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""File endings of formats that unpickle when loaded: never published, never fetched."""
CHUNK_BYTES = 16 * 1024 * 1024
"""Size of one range request. Each costs a round trip in which nothing arrives: on a far link
(300 ms) at 10 Mbit/s that is 2 % of a 16 MiB chunk's time, 9 % of a 4 MiB one's. A cut
loses only what was in flight: the file resumes from the bytes it holds."""
NETWORK_ERRORS = (urllib3.exceptions.HTTPError, OSError)
"""What a dropped or failing link raises while downloading (retried, the file resumes)."""


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint whose files do not match its manifest; it must not be loaded."""


class CheckpointNotFound(UserError, LookupError):
    """No manifest where one was expected (never published, or pruned)."""


class DownloadCancelled(Exception):
    """A download its caller gave up (`Transfer.cancel`)."""


class Transfer:
    """One download's progress, shared with a thread that may give it up: the bytes its path
    was planned at (`pipeline.weights.policy.fetch_policy` sets them), the bytes received so
    far, and `cancel`, checked at every 64 KiB block that arrives and before every chunk (a
    16 MiB chunk takes 13 s at 10 Mbit/s; a chunk waiting out a network error's backoff sees
    it at its next try)."""

    def __init__(self):
        self.planned = 0
        self.received = 0
        self.cancel = threading.Event()
        self._lock = threading.Lock()

    def received_block(self, nbytes: int) -> None:
        """Count `nbytes` arrived (deltas arrive on several threads); DownloadCancelled once cancelled."""
        with self._lock:
            self.received += nbytes
        self.raise_if_cancelled()

    def raise_if_cancelled(self) -> None:
        if self.cancel.is_set():
            raise DownloadCancelled()

    @property
    def remaining(self) -> int:
        """Bytes of the planned path still to come."""
        return max(0, self.planned - self.received)


def connect_s3(services: Services, timeout_s: float = 10.0) -> Minio:
    """A MinIO client for any S3-compatible endpoint, with timeouts and bounded retries."""
    url = urlparse(services.s3_endpoint)
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout_s, read=max(60.0, timeout_s)),
        maxsize=10,  # as many connections as MinIO's own client keeps: a multipart upload sends parts in parallel
        retries=urllib3.Retry(total=3, backoff_factor=0.5, backoff_jitter=0.5, status_forcelist=(500, 502, 503, 504)),
        **services.security.s3_pool_kwargs(services.s3_endpoint))
    client = Minio(url.netloc, access_key=services.s3_access_key or None,
                   secret_key=services.s3_secret_key or None, secure=url.scheme == "https",
                   region=services.s3_region, http_client=http)
    try:
        if not client.bucket_exists(services.bucket):
            client.make_bucket(services.bucket)
    except S3Error as e:
        if e.code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            raise CredentialsRefused(f"S3 at {services.s3_endpoint} refused the credentials ({e.code}): check "
                                     "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") from None
        raise ServiceUnavailable(f"cannot use S3 bucket {services.bucket!r} at {services.s3_endpoint} ({e.code}: "
                                 f"{str(e).splitlines()[0][:160]}): check the endpoint and credentials") from None
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise ServiceUnavailable(
            f"cannot use S3 bucket {services.bucket!r} at {services.s3_endpoint} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}): check the endpoint and credentials") from None
    return client


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def link_or_copy(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (no bytes copied), or a copy where links fail
    (another filesystem); its parent is created."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def safe_relpath(name: str) -> str:
    """`name` as a relative path inside a checkpoint; CorruptCheckpointError for an absolute, `..` or
    pickle-based one."""
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise CorruptCheckpointError(f"manifest names an unsafe path {name!r}")
    if is_pickle_file(name):
        raise CorruptCheckpointError(f"manifest names {name!r}, a pickle-based file: refused (checkpoints carry "
                                     "safetensors and JSON only)")
    return str(p)


def is_pickle_file(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


@dataclass(frozen=True)
class Manifest:
    run: str
    version: int
    created_at: float
    files: list[dict]
    extra: dict
    key: str
    parent_version: Optional[int] = None
    """The version this one was trained from (after a learner's rewind: the version of the
    recovery state it resumed from, not the number before it)."""

    @property
    def prefix(self) -> str:
        return self.key.rsplit("/", 1)[0] + "/"


class CheckpointStore:
    """publish / list_versions / fetch / prune for one run's checkpoints."""

    def __init__(self, client: Minio, bucket: str, run: str, *, signer: Optional[SigningKey] = None,
                 trusted: Optional[PublicKey] = None, label: str = "v"):
        """`signer`: the learner's key, which signs each manifest it publishes. `trusted`: the
        learner public key a reader pins; then only manifests it signed are read. `label`: the
        letter before each number in the keys (`v` for policy versions; the learner's recovery
        states use `s` for steps, under their own prefix)."""
        self.client = client
        self.bucket = bucket
        self.run = run
        self.signer = signer
        self.trusted = trusted
        self.label = label

    def version_prefix(self, version: int) -> str:
        return f"{self.run}/{self.label}{version}/"

    def manifest_key(self, version: int) -> str:
        return self.version_prefix(version) + MANIFEST_NAME

    def uri(self, version: int) -> str:
        return f"s3://{self.bucket}/{self.version_prefix(version)}"

    def upload(self, version: int, model_dir: Path, extra: Optional[dict] = None,
                parent_version: Optional[int] = None) -> str:
        """Upload every file of `model_dir`, then the manifest (signed, with a signer); returns
        the manifest key. `parent_version`: the version this one was trained from."""
        model_dir = Path(model_dir)
        # A manifest left by a learner that died before setting Redis would make this
        # version visible while its files are being replaced: hide it first.
        self.client.remove_object(self.bucket, self.manifest_key(version))
        files = []
        for path in sorted(p for p in model_dir.rglob("*") if p.is_file() and not is_pickle_file(p.name)):
            rel = path.relative_to(model_dir).as_posix()
            digest = sha256_file(path)
            self.client.fput_object(self.bucket, self.version_prefix(version) + rel, str(path))
            files.append({"path": rel, "size": path.stat().st_size, "sha256": digest})
        manifest = {"format": MANIFEST_FORMAT, "run": self.run, "version": version, "parent_version": parent_version,
                    "created_at": time.time(), "files": files, "extra": extra or {}}
        if self.signer is not None:
            manifest = sign_document(manifest, self.signer)
        body = json.dumps(manifest, indent=1).encode()
        self.client.put_object(self.bucket, self.manifest_key(version), io.BytesIO(body), len(body),
                               content_type="application/json")
        return self.manifest_key(version)

    def list_versions(self) -> list[int]:
        """Versions whose manifest exists (only those are visible), ascending."""
        versions = []
        n = len(self.label)
        for obj in self.client.list_objects(self.bucket, prefix=f"{self.run}/", recursive=True):
            parts = obj.object_name[len(self.run) + 1:].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME and parts[0][:n] == self.label and parts[0][n:].isdigit():
                versions.append(int(parts[0][n:]))
        return sorted(versions)

    def read_manifest(self, key: str) -> Manifest:
        try:
            resp = self.client.get_object(self.bucket, key)
            try:
                raw = resp.read()
            finally:
                resp.close()
                resp.release_conn()
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchBucket"):
                raise CheckpointNotFound(f"no checkpoint manifest at s3://{self.bucket}/{key}") from None
            raise
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise CorruptCheckpointError(f"manifest s3://{self.bucket}/{key} is malformed: {e}") from None
        if self.trusted is not None:
            try:
                data = verify_document(data, self.trusted, f"manifest s3://{self.bucket}/{key}")
            except SignatureError as e:
                raise CorruptCheckpointError(f"refused: {e.reason}") from None
            if data.get("run") != self.run or key != self.manifest_key(data.get("version", -1)):
                raise CorruptCheckpointError(f"refused: manifest s3://{self.bucket}/{key} is signed for run "
                                             f"{data.get('run')!r} v{data.get('version')}, not the one at this key")
        try:
            if data.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            files = [{"path": safe_relpath(f["path"]), "size": int(f["size"]), "sha256": str(f["sha256"])}
                     for f in data["files"]]
            return Manifest(run=str(data["run"]), version=int(data["version"]),
                            created_at=float(data["created_at"]), files=files,
                            extra=dict(data.get("extra") or {}), key=key,
                            parent_version=None if data.get("parent_version") is None else int(data["parent_version"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"manifest s3://{self.bucket}/{key} is malformed: {e}") from None

    def read_expected(self, manifest_key: str, expect_version: Optional[int],
                      read: Optional[Manifest] = None) -> Manifest:
        """The manifest at `manifest_key`, refused if it is not of `expect_version` (the version the
        caller was told this is: the policy pointer's), when given. `read`: that manifest as the
        caller already read it with this store's `read_manifest` (so checked against the same
        trusted key; not read again: on a far link each read is a round trip)."""
        manifest = self.read_manifest(manifest_key) if read is None or read.key != manifest_key else read
        if expect_version is not None and manifest.version != expect_version:
            raise CorruptCheckpointError(f"refused: the policy pointer says v{expect_version} but its manifest "
                                         f"s3://{self.bucket}/{manifest_key} is v{manifest.version}")
        return manifest

    def fetch(self, manifest_key: str, dest_dir: Path, attempts: int = 3, *, learner_state: bool = False,
              network_retries: int = 8, expect_version: Optional[int] = None, only: Optional[frozenset] = None,
              skip: frozenset = frozenset(), read: Optional[Manifest] = None,
              transfer: Optional[Transfer] = None) -> tuple[Path, Manifest]:
        """Download a checkpoint into `dest_dir`, verifying every file; only the learner
        asks for `learner_state`.

        Network errors resume the interrupted file (`network_retries` times, with backoff);
        a file that arrives complete but mismatching is downloaded again, `attempts` times in
        all, then CorruptCheckpointError. The directory only appears once verified.
        `expect_version`: the version the caller was told this is (the policy pointer's); a
        manifest of another version is refused. `only` / `skip`: the manifest's paths to
        download (default all) / to leave out (a keyframe's bridge delta, for a whole copy).
        `read`: the manifest as the caller already read it (`read_expected`). `transfer`: where
        the bytes received are counted, and a cancel that stops the download (DownloadCancelled).
        """
        manifest = self.read_expected(manifest_key, expect_version, read)
        dest_dir = Path(dest_dir)
        dest_dir.parent.mkdir(parents=True, exist_ok=True)
        wanted = [f for f in manifest.files
                  if (learner_state or not f["path"].startswith(LEARNER_STATE_DIR + "/"))
                  and (only is None or f["path"] in only) and f["path"] not in skip]
        if only is not None and {f["path"] for f in wanted} != set(only):
            raise CorruptCheckpointError(f"s3://{self.bucket}/{manifest.prefix}: its manifest lists no "
                                         f"{', '.join(sorted(set(only) - {f['path'] for f in wanted}))}")
        # Stable per manifest and selection, so a later fetch of the same files resumes what is there.
        partial = dest_dir.parent / f".partial-{hashlib.sha256(json.dumps(wanted).encode()).hexdigest()[:16]}"
        last_error = ""
        for _ in range(attempts):
            try:
                for f in wanted:
                    target = partial / f["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self._download(manifest.prefix + f["path"], target, f["size"], network_retries, transfer)
                    digest = sha256_file(target)
                    if digest != f["sha256"]:
                        target.unlink()
                        raise CorruptCheckpointError(f"{f['path']}: sha256 {digest[:12]}… != manifest {f['sha256'][:12]}…")
                if dest_dir.exists():
                    shutil.rmtree(dest_dir)
                partial.rename(dest_dir)
                return dest_dir, manifest
            except CorruptCheckpointError as e:
                last_error = str(e)
        shutil.rmtree(partial, ignore_errors=True)
        raise CorruptCheckpointError(
            f"refused checkpoint s3://{self.bucket}/{manifest.prefix} after {attempts} attempts: {last_error}")

    def _download(self, key: str, target: Path, size: int, network_retries: int,
                  transfer: Optional[Transfer] = None) -> None:
        """Range-request `key` into `target` from where it stops, CHUNK_BYTES at a time; a chunk
        that fails on the network is retried (`network_retries` times in a row at most)."""
        while True:
            have = target.stat().st_size if target.exists() else 0
            if have > size:
                target.unlink()
                raise CorruptCheckpointError(f"{key}: {have} bytes, manifest says {size}")
            if have == size:
                return
            try:
                if transfer is not None:
                    transfer.raise_if_cancelled()
                retry_call(lambda: self._append_chunk(key, target, size, transfer), retry_on=NETWORK_ERRORS, first_s=0.5,
                           max_s=8.0, attempts=network_retries + 1,
                           on_retry=lambda e, wait, _: log.warning(
                               "download of s3://%s/%s interrupted at %d/%d bytes (%s); resuming in %.1fs",
                               self.bucket, key, target.stat().st_size if target.exists() else 0, size,
                               type(e).__name__, wait))
            except NETWORK_ERRORS as e:
                raise ServiceUnavailable(f"download of s3://{self.bucket}/{key} failed {network_retries + 1} times "
                                         f"in a row at byte {have} of {size}: {type(e).__name__}") from None

    def _append_chunk(self, key: str, target: Path, size: int, transfer: Optional[Transfer] = None) -> None:
        """Append the next chunk of `key` (from `target`'s current size) to `target`."""
        have = target.stat().st_size if target.exists() else 0
        try:
            response = self.client.get_object(self.bucket, key, offset=have, length=min(CHUNK_BYTES, size - have))
        except S3Error as e:
            if e.code == "NoSuchKey":  # pruned while we were downloading
                raise CheckpointNotFound(f"s3://{self.bucket}/{key} was deleted during the download") from None
            if e.code == "InvalidRange":
                raise CorruptCheckpointError(f"{key}: shorter than the manifest's {size} bytes") from None
            raise
        try:
            with open(target, "ab") as out:
                for block in response.stream(64 * 1024):
                    out.write(block)
                    if transfer is not None:
                        transfer.received_block(len(block))
        finally:
            response.close()
            response.release_conn()

    def prune(self, keep_last: int, current: int) -> list[int]:
        """Delete all but the newest `keep_last` versions up to `current`: manifest first, so none
        is half-visible. Versions above `current` (left by an earlier, crashed learner) are not touched,
        and neither is v0, the base model: `heterorl replay` starts from it."""
        versions = [v for v in self.list_versions() if 0 < v <= current]
        doomed = versions[:-keep_last] if keep_last > 0 else versions
        for v in doomed:
            self.delete(v)
        return doomed

    def delete(self, version: int) -> None:
        """Remove one version: its manifest first, so it is never half-visible."""
        self.client.remove_object(self.bucket, self.manifest_key(version))
        for obj in self.client.list_objects(self.bucket, prefix=self.version_prefix(version), recursive=True):
            self.client.remove_object(self.bucket, obj.object_name)


# --- the policy pointer in Redis ---------------------------------------------------------------

POINTER_FORMAT = "heterorl-policy-pointer/1"


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

    def set(self, version: int, manifest_key: str, signer: Optional[SigningKey] = None) -> Pointer:
        """Make `version` current; call only once its manifest is in S3. With `signer` (the
        learner's key) the pointer carries a signature samplers check against the key they pin.
        Returns the pointer as written (what `read` gives back until someone else sets it)."""
        updated_at = repr(time.time())
        fields = {"version": version, "manifest_key": manifest_key, "updated_at": updated_at}
        if signer is not None:
            fields["signature"] = sign_pointer(self.run, version, manifest_key, updated_at, signer)
        pipe = self.client.pipeline()
        pipe.delete(self.key)  # no signature of an earlier pointer may survive
        pipe.hset(self.key, mapping=fields)
        pipe.execute()
        return Pointer(version, manifest_key, updated_at, fields.get("signature"))

    def read(self) -> Optional[Pointer]:
        """The pointer as it stands (None before the first version), not yet verified;
        MalformedPointer if the key holds anything else (another type, a field missing, a version
        that is no integer: whoever can write the key can write that)."""
        try:
            data = self.client.hgetall(self.key)
        except redis.ResponseError as e:
            if wrong_type(e):
                raise not_a_hash(self.client, self.key) from None
            raise
        return parse_pointer(data)

    def read_verified(self, trusted: Optional[PublicKey]) -> Optional[Pointer]:
        """`read`, and SignatureError unless the learner key `trusted` signed it (None: signatures
        are not required, and the pointer is taken as it is). MalformedPointer as `read`."""
        pointer = self.read()
        if pointer is not None and trusted is not None:
            verify_pointer(self.run, pointer.version, pointer.manifest_key, pointer.updated_at, pointer.signature,
                           trusted)
        return pointer

    def version(self) -> Optional[int]:
        """The version the pointer names, unverified (None: none, or a malformed pointer), for display."""
        return self.current()[0]

    def current(self) -> tuple[Optional[int], Optional[str]]:
        """(version, manifest key), unverified; (None, None) for no pointer or a malformed one."""
        try:
            found = self.read()
        except MalformedPointer:
            return None, None
        return (None, None) if found is None else (found.version, found.manifest_key)


def current(state) -> tuple[Optional[int], Optional[str]]:
    """(version, manifest key) the pointer names, not verified ((None, None): no pointer, or a
    malformed one): for what is only shown or compared (status, audits); whatever loads a version
    goes through `read_verified`."""
    return PolicyPointer(state).current()
