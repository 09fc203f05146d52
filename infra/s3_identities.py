"""Who may do what on the local S3 server: identities (access key, secret, role) with
per-bucket, per-prefix grants, the file that holds them, and the decision for one request.

Why: the server (``localbucket``, see ``infra.localbucket_ops``) has no permissions of its
own, and one key for everything meant that whoever held it (a volunteer sampler, say) could
delete the broker's unread batches or a run's checkpoints. Each role now gets its own key with
only what it needs, the way MinIO/AWS bucket policies work; ``infra.s3_auth`` checks the
signature, ``authorize`` here decides right after, before the server touches anything.

Actions (a closed set) and the operations they allow, inside a grant's bucket and prefix:

==========  ==================================================================================
``read``    GetObject (range reads too), HeadObject, GetObjectTagging; the source of a copy
``list``    ListObjects / ListObjectsV2 whose ``prefix`` parameter starts with the grant's
            prefix (so a sampler cannot list outside its run); HeadBucket and
            GetBucketLocation of the bucket (any list grant there, whatever its prefix)
``write``   PutObject, CopyObject and UploadPart(Copy) targets, Create/Complete/Abort
            MultipartUpload
``delete``  DeleteObject; DeleteObjects only if every key of its body is covered
``admin``   all of the above, plus CreateBucket / DeleteBucket (a grant on the whole bucket,
            prefix ``""``) and ListBuckets (bucket ``"*"``, prefix ``""``)
==========  ==================================================================================

A grant's ``bucket`` is a bucket name or ``"*"`` (every bucket); its ``prefix`` is matched
with ``str.startswith`` on the key, so ``"myrun/"`` is one run and ``"myrun"`` would also be
``"myrun2/"``: end run prefixes with ``/``. A key with ``.`` or ``..`` segments is covered
only by a grant on the whole bucket (the server refuses such keys anyway). Anything not
granted is refused: 403 ``AccessDenied`` with a one-line message naming the operation.

The identities file (``<data_dir>/s3-identities.json``, mode 0600, replaced atomically)::

    {
      "format": "heterorl-s3-identities/1",
      "identities": [
        {"access_key": "heterorl-3f2a...", "secret_key": "...", "role": "sampler",
         "grants": [{"bucket": "heterorl", "prefix": "myrun/",  "actions": ["list"]},
                    {"bucket": "heterorl", "prefix": "myrun/v", "actions": ["read"]}]}
      ]
    }

``access_key``: 3-128 characters of ``A-Z a-z 0-9 . _ @ + -``, unique in the file;
``secret_key``: at least 8 characters; ``role``: free text for logs; ``grants``: a list
(maybe empty: the key authenticates but may do nothing). ``grants_for`` gives the grants
recommended for each of the product's roles.

The server reads the file through ``IdentityStore``, which stats it on every lookup and
re-reads it when it changed, so ``add_identity`` / ``remove_identity`` take effect on the
next request: a removed key's next request is refused with ``InvalidAccessKeyId``. The
stack's own admin key is not in the file: the store is given it as a fixed identity, which
the file can neither shadow nor revoke.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence
from urllib.parse import unquote

from infra.private_files import update_locked, write_private_json
from infra.s3_auth import AuthError, S3Credentials
from pipeline.errors import UserError

log = logging.getLogger(__name__)

FORMAT = "heterorl-s3-identities/1"
IDENTITIES_FILE = "s3-identities.json"  # in the stack's data dir, beside (not in) the served s3/
IDENTITIES_ENV = "HETERORL_S3_IDENTITIES"  # the file's path, in the S3 server's environment

READ, LIST, WRITE, DELETE, ADMIN = "read", "list", "write", "delete", "admin"
ACTIONS = frozenset({READ, LIST, WRITE, DELETE, ADMIN})
ANY_BUCKET = "*"
ROLES = ("sampler", "validator", "learner", "broker", "admin")
_ACCESS_KEY = re.compile(r"^[A-Za-z0-9._@+-]{3,128}$")
MIN_SECRET_LEN = 8


class IdentityFileError(UserError, ValueError):
    """The identities file (or an identity given to a helper) is not usable; one line."""


@dataclass(frozen=True)
class S3Grant:
    """``actions`` on the keys of ``bucket`` (``"*"``: every bucket) that start with ``prefix``."""

    bucket: str
    prefix: str = ""
    actions: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", frozenset(self.actions))  # a list or set given: stored frozen
        unknown = sorted(self.actions - ACTIONS)
        if unknown:
            raise IdentityFileError(f"unknown S3 action(s) {', '.join(map(repr, unknown))}; "
                                    f"expected some of {', '.join(sorted(ACTIONS))}")
        if not self.actions:
            raise IdentityFileError(f"the grant on bucket {self.bucket!r} prefix {self.prefix!r} names no action")
        if not isinstance(self.bucket, str) or not self.bucket or "/" in self.bucket:
            raise IdentityFileError(f"a grant's bucket must be a bucket name or '*', not {self.bucket!r}")
        if not isinstance(self.prefix, str):
            raise IdentityFileError(f"a grant's prefix must be a string, not {self.prefix!r}")

    def to_json(self) -> dict:
        return {"bucket": self.bucket, "prefix": self.prefix, "actions": sorted(self.actions)}


@dataclass(frozen=True)
class S3Identity:
    """One key the server accepts: its secret, a role name (for logs only) and its grants."""

    access_key: str
    secret_key: str = field(repr=False)  # never in a log line or traceback
    role: str = ""
    grants: tuple[S3Grant, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "grants", tuple(self.grants))
        if not isinstance(self.access_key, str) or not _ACCESS_KEY.match(self.access_key):
            raise IdentityFileError(f"access key {self.access_key!r} must be 3-128 characters of "
                                    "A-Z a-z 0-9 . _ @ + -")
        if not isinstance(self.secret_key, str) or len(self.secret_key) < MIN_SECRET_LEN:
            raise IdentityFileError(f"the secret of access key {self.access_key!r} must be a string of at least "
                                    f"{MIN_SECRET_LEN} characters")
        if not isinstance(self.role, str):
            raise IdentityFileError(f"the role of access key {self.access_key!r} must be a string")

    def credentials(self, region: str) -> S3Credentials:
        """What ``infra.s3_auth`` checks a signature against."""
        return S3Credentials(self.access_key, self.secret_key, region)

    def to_json(self) -> dict:
        return {"access_key": self.access_key, "secret_key": self.secret_key, "role": self.role,
                "grants": [grant.to_json() for grant in self.grants]}

    @classmethod
    def from_json(cls, data: Any) -> "S3Identity":
        if not isinstance(data, dict):
            raise IdentityFileError(f"an identity must be a JSON object, not {type(data).__name__}")
        unknown = sorted(set(data) - {"access_key", "secret_key", "role", "grants"})
        if unknown:  # a misspelt "grant" would otherwise silently grant nothing
            raise IdentityFileError(f"identity {data.get('access_key')!r}: unknown field(s) {', '.join(unknown)}")
        grants = data.get("grants", [])
        if not isinstance(grants, list) or not all(isinstance(g, dict) for g in grants):
            raise IdentityFileError(f"identity {data.get('access_key')!r}: grants must be a list of objects")
        odd = sorted({name for g in grants for name in g} - {"bucket", "prefix", "actions"})
        if odd:
            raise IdentityFileError(f"identity {data.get('access_key')!r}: unknown grant field(s) {', '.join(odd)}")
        try:
            parsed = tuple(S3Grant(g.get("bucket", ""), g.get("prefix", ""), _actions(g.get("actions"))) for g in grants)
        except IdentityFileError as error:
            raise IdentityFileError(f"identity {data.get('access_key')!r}: {error}") from None
        return cls(data.get("access_key", ""), data.get("secret_key", ""), data.get("role", ""), parsed)


def _actions(value: Any) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise IdentityFileError(f"a grant's actions must be a list of strings, not {value!r}")
    return frozenset(value)


def admin_identity(access_key: str, secret_key: str, role: str = "admin") -> S3Identity:
    """A key that may do everything (the stack's own key)."""
    return S3Identity(access_key, secret_key, role, (S3Grant(ANY_BUCKET, "", frozenset({ADMIN})),))


def grants_for(role: str, bucket: str, run: str = "") -> tuple[S3Grant, ...]:
    """The grants recommended for one of ``ROLES``. ``bucket``: the role's bucket (the
    checkpoints' ``heterorl``; the broker's ``heterorl-kafka``); ``run``: for a sampler or
    validator, the run whose policy versions it reads.

    A policy reader lists ``<run>/`` (``CheckpointStore.list_versions``) and reads
    ``<run>/v<N>/...``; it may list but not read the learner's states ``<run>/state/``."""
    if role in ("sampler", "validator"):
        if not run or "/" in run:
            raise IdentityFileError(f"a {role}'s grants name its run (no '/'), not {run!r}")
        return (S3Grant(bucket, f"{run}/", frozenset({LIST})), S3Grant(bucket, f"{run}/v", frozenset({READ})))
    if role in ("learner", "broker"):
        return (S3Grant(bucket, "", frozenset({READ, LIST, WRITE, DELETE})),)
    if role == "admin":
        return (S3Grant(ANY_BUCKET, "", frozenset({ADMIN})),)
    raise IdentityFileError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def new_identity(role: str, grants: Iterable[S3Grant]) -> S3Identity:
    """An identity with a fresh random key (``heterorl-<role>-<12 hex>``) and secret."""
    tag = re.sub(r"[^A-Za-z0-9.-]", "", role)[:32]  # the role is free text; the key is not
    return S3Identity(f"heterorl-{tag + '-' if tag else ''}{secrets.token_hex(6)}", secrets.token_urlsafe(24),
                      role, tuple(grants))


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Need:
    """One permission a request needs: ``action`` on ``key`` of ``bucket``. ``key`` None: on
    some key of the bucket (HeadBucket); for ``list`` it is the listing's prefix."""

    action: str
    bucket: str
    key: Optional[str]


def _clean(key: str) -> bool:
    return not any(part in (".", "..") for part in key.split("/"))


def _covers(grant: S3Grant, need: Need) -> bool:
    if grant.bucket not in (need.bucket, ANY_BUCKET):
        return False
    if need.action not in grant.actions and ADMIN not in grant.actions:
        return False
    if need.key is None:
        return True
    # "run/v1/../../other/x" starts with "run/v": only a whole-bucket grant covers such a key.
    return need.key.startswith(grant.prefix) and (not grant.prefix or _clean(need.key))


def _copy_source(header: str) -> tuple[str, str]:
    """Bucket and key of ``x-amz-copy-source``, parsed as localbucket parses it."""
    source = unquote(header.partition("?")[0])
    bucket, _, key = source.lstrip("/").partition("/")
    return bucket, key


def required(method: str, bucket: str, key: str, query: Mapping[str, str], *,
             copy_source: Optional[str] = None,
             delete_keys: Optional[Sequence[str]] = None) -> tuple[str, list[Need]]:
    """The S3 operation a request is (routed as localbucket routes it) and what it needs."""
    method = method.upper()
    if not bucket:  # ListBuckets; anything else on "/" is not an S3 operation: admin only
        return ("ListBuckets" if method == "GET" else f"{method} /"), [Need(ADMIN, "", "")]
    if method in ("GET", "HEAD") and not key:
        if method == "HEAD":
            return "HeadBucket", [Need(LIST, bucket, None)]
        if "location" in query:
            return "GetBucketLocation", [Need(LIST, bucket, None)]
        operation = "ListObjectsV2" if query.get("list-type") == "2" else "ListObjects"
        return operation, [Need(LIST, bucket, query.get("prefix", ""))]
    if method in ("GET", "HEAD"):
        operation = "HeadObject" if method == "HEAD" else "GetObjectTagging" if "tagging" in query else "GetObject"
        return operation, [Need(READ, bucket, key)]
    if method == "PUT":
        if not key:
            return "CreateBucket", [Need(ADMIN, bucket, "")]
        source = [Need(READ, *_copy_source(copy_source))] if copy_source is not None else []
        if "uploadId" in query or "partNumber" in query:
            return ("UploadPartCopy" if source else "UploadPart"), [Need(WRITE, bucket, key), *source]
        return ("CopyObject" if source else "PutObject"), [Need(WRITE, bucket, key), *source]
    if method == "POST":
        if not key and "delete" in query:
            # Before the body is read the keys are unknown: some delete grant on the bucket
            # lets the server read it; then each key is checked.
            keys: Sequence[Optional[str]] = [None] if delete_keys is None else delete_keys
            return "DeleteObjects", [Need(DELETE, bucket, k) for k in keys]
        if key and "uploads" in query:
            return "CreateMultipartUpload", [Need(WRITE, bucket, key)]
        if key and "uploadId" in query:
            return "CompleteMultipartUpload", [Need(WRITE, bucket, key)]
    if method == "DELETE":
        if not key:
            return "DeleteBucket", [Need(ADMIN, bucket, "")]
        if "uploadId" in query:
            return "AbortMultipartUpload", [Need(WRITE, bucket, key)]
        return "DeleteObject", [Need(DELETE, bucket, key)]
    return f"{method} {'object' if key else 'bucket'}", [Need(ADMIN, bucket, "")]  # unsupported: admin only


def _describe(operation: str, need: Need) -> str:
    if need.action == LIST and need.key is not None:
        return f"{operation} of bucket {need.bucket!r} with prefix {need.key!r}"
    if need.key:
        return f"{operation} of {need.bucket}/{need.key}"
    return f"{operation} of bucket {need.bucket!r}" if need.bucket else operation


def authorize(identity: S3Identity, method: str, bucket: str, key: str, query: Mapping[str, str], *,
              copy_source: Optional[str] = None, delete_keys: Optional[Sequence[str]] = None) -> None:
    """Raise ``AuthError(403, "AccessDenied")`` unless ``identity`` may perform the request.

    ``bucket``, ``key``, ``query``: as the server parsed them (path unquoted, first value of
    each query parameter); ``copy_source``: the ``x-amz-copy-source`` header, if sent;
    ``delete_keys``: DeleteObjects' keys once its body is read (None before: then any delete
    grant on the bucket passes, and the server calls again with the keys)."""
    operation, needs = required(method, bucket, key, query, copy_source=copy_source, delete_keys=delete_keys)
    for need in needs:
        if not any(_covers(grant, need) for grant in identity.grants):
            raise AuthError(403, "AccessDenied", f"Access Denied: {_describe(operation, need)} is not granted "
                                                 f"to access key {identity.access_key!r}")


# --------------------------------------------------------------------------- the file


def _parse(text: str, path: Path) -> list[S3Identity]:
    try:
        data = json.loads(text)
    except ValueError as error:
        raise IdentityFileError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("identities"), list):
        raise IdentityFileError(f"{path}: expected {{\"format\": \"{FORMAT}\", \"identities\": [...]}}")
    try:
        identities = [S3Identity.from_json(item) for item in data["identities"]]
    except IdentityFileError as error:
        raise IdentityFileError(f"{path}: {error}") from None
    _check_unique(identities, path)
    return identities


def _check_unique(identities: Sequence[S3Identity], path: Path) -> None:
    seen: set[str] = set()
    for identity in identities:
        if identity.access_key in seen:
            raise IdentityFileError(f"{path}: access key {identity.access_key!r} appears twice")
        seen.add(identity.access_key)


def read_identities(path: str | Path) -> list[S3Identity]:
    """The identities in ``path``; a missing file holds none. Raises IdentityFileError."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise IdentityFileError(f"cannot read {path}: {error.strerror or error}") from None
    return _parse(text, path)


def write_identities(path: str | Path, identities: Iterable[S3Identity]) -> None:
    """Replace ``path`` with ``identities``: written to a 0600 temporary file beside it, then
    renamed over it, so the server never reads half a file and the secrets are never readable
    by others."""
    path = Path(path)
    identities = list(identities)
    _check_unique(identities, path)
    write_private_json(path, {"format": FORMAT, "identities": [i.to_json() for i in identities]}, indent=1)


def add_identity(path: str | Path, identity: S3Identity, *, replace: bool = False) -> None:
    """Add ``identity`` to the file (created if missing). An access key already there is an
    error unless ``replace`` (then its secret, role and grants are replaced)."""
    def add(identities: list[S3Identity]) -> bool:
        keys = [i.access_key for i in identities]
        if identity.access_key not in keys:
            identities.append(identity)
        elif replace:
            identities[keys.index(identity.access_key)] = identity  # in place: the file's order stays
        else:
            raise IdentityFileError(f"{path}: access key {identity.access_key!r} is already there")
        return True

    update_locked(path, read_identities, write_identities, add)


def remove_identity(path: str | Path, access_key: str) -> bool:
    """Remove an access key from the file; False if it was not there."""
    def remove(identities: list[S3Identity]) -> bool:
        kept = [i for i in identities if i.access_key != access_key]
        changed = len(kept) != len(identities)
        identities[:] = kept
        return changed

    return update_locked(path, read_identities, write_identities, remove)


class IdentityStore:
    """The identities a server accepts: ``fixed`` ones (the stack's admin key) and those of
    the file at ``path``, re-read whenever its inode, size or mtime changes (one ``stat`` per
    lookup), and on every lookup while its mtime is within ``RACY_NS`` of when it was last
    read: file systems stamp mtimes with a coarse clock and recycle inodes, so a second
    same-sized rewrite in the same tick would otherwise look unchanged (a revoked key kept).
    A file that cannot be read or parsed grants nothing until it is fixed (fail closed: a key
    revoked by an edit that broke the file stays revoked); the error is logged once per
    change. Safe to call from the server's threads."""

    RACY_NS = 2_000_000_000

    def __init__(self, path: str | Path | None, fixed: Iterable[S3Identity] = ()):
        self.path = Path(path) if path is not None else None
        self._fixed = {identity.access_key: identity for identity in fixed}
        self._loaded: dict[str, S3Identity] = {}
        self._signature: Optional[tuple[int, int, int]] = None  # (inode, size, mtime_ns) of what _loaded holds
        self._read_at_ns = 0  # wall clock just before _loaded was read
        self._lock = threading.Lock()

    def get(self, access_key: str) -> Optional[S3Identity]:
        """The identity of ``access_key``, or None if the server does not know it (now)."""
        if access_key in self._fixed:  # the file can neither shadow nor revoke these
            return self._fixed[access_key]
        return self._current().get(access_key)

    def _current(self) -> dict[str, S3Identity]:
        if self.path is None:
            return {}
        try:
            st = os.stat(self.path)
            signature: Optional[tuple[int, int, int]] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            signature = None
        except OSError as error:
            log.error("cannot stat %s (%s): only the fixed S3 keys are accepted", self.path, error)
            return {}
        with self._lock:
            racy = signature is not None and signature[2] >= self._read_at_ns - self.RACY_NS
            if signature != self._signature or racy:
                errors_logged = signature == self._signature  # a racy re-read of a broken file: logged already
                self._read_at_ns = time.time_ns()
                self._loaded = self._load(quiet=errors_logged) if signature is not None else {}
                self._signature = signature
            return self._loaded

    def _load(self, quiet: bool = False) -> dict[str, S3Identity]:
        assert self.path is not None
        try:
            identities = read_identities(self.path)
        except IdentityFileError as error:
            if not quiet:
                log.error("%s; until it is fixed only the fixed S3 keys are accepted", error)
            return {}
        shadowing = [i.access_key for i in identities if i.access_key in self._fixed]
        if shadowing and not quiet:
            log.warning("%s: ignoring %s, the stack's own key", self.path, ", ".join(shadowing))
        return {i.access_key: i for i in identities if i.access_key not in self._fixed}
