"""What the local S3 server (``localbucket`` 1.2) gets on top of its stock operations:
Signature V4 authentication of every request (``infra.s3_auth``) against the key it names,
then authorization of the operation for that key's identity (``infra.s3_identities``),
GetBucketLocation and DeleteObjects (multi-object delete). ``install`` patches them into the
handler class in the server's own process (``infra.local_stack._serve_localbucket``); nothing
else imports it.

Why: stock localbucket checks no credentials at all (any secret reads every object, the
broker's log included), has no notion of who may do what (one key for everything let an
invited sampler delete the broker's batches and a run's checkpoints), and answers
``GET /bucket?location`` and ``POST /bucket?delete`` with NotImplemented, which a minio
client made without ``region=`` and ``remove_objects`` need.

Authorization runs after authentication and before the stock handler touches anything, on
the bucket, key and query exactly as localbucket's ``_dispatch`` parsed them (the request
that is checked is the one that is served). DeleteObjects is checked twice: before its body
is read (some delete grant on the bucket), then every key of the body; one key not granted
refuses the whole request, nothing deleted. A refusal is 403 AccessDenied and one log line.
"""

from __future__ import annotations

import io
import logging
import xml.etree.ElementTree as ET
from http import HTTPStatus
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from infra.s3_auth import (SIGNED_CHUNKS, AuthError, S3Credentials, Verified, check_payload, decode_signed_chunks,
                           verify_request)
from infra.s3_identities import IdentityStore, S3Identity, admin_identity, authorize

log = logging.getLogger(__name__)

MAX_DELETE_KEYS = 1000


class Identities(Protocol):
    """Where the server looks up a request's access key (``IdentityStore``)."""

    def get(self, access_key: str) -> Optional[S3Identity]: ...


def install(localbucket: Any, keys: Union[Identities, S3Credentials], region: Optional[str] = None) -> None:
    """Patch ``localbucket.S3Handler``: authenticate, authorize, then serve the two extra
    operations. ``keys``: the identities accepted (an ``IdentityStore``), or one key that may
    do everything (as before identities); ``region``: the server's (default: that key's, or
    us-east-1)."""
    if isinstance(keys, S3Credentials):
        region = region or keys.region
        keys = IdentityStore(None, [admin_identity(keys.access_key, keys.secret_key)])
    region = region or "us-east-1"
    identities: Identities = keys
    handler = localbucket.S3Handler
    stock_dispatch: Callable = handler._dispatch
    stock_get: Callable = handler._get_request
    stock_post: Callable = handler._post_request
    S3Error = localbucket.S3Error

    def to_s3_error(error: AuthError) -> Any:
        return S3Error(HTTPStatus(error.status), error.code, error.message)

    def check(self: Any, bucket: str, key: str, delete_keys: Optional[Sequence[str]] = None) -> None:
        try:
            authorize(self._identity, self.command, bucket, key, self.query,
                      copy_source=self.headers.get("x-amz-copy-source"), delete_keys=delete_keys)
        except AuthError as error:
            log.warning("refused role %r from %s: %s", self._identity.role, self.address_string(), error.message)
            raise to_s3_error(error) from None

    def dispatch(self: Any, action: Callable) -> None:
        try:
            self._sigv4, self._identity = _authenticate(self, identities, region)
        except AuthError as error:
            self._send_error(to_s3_error(error))
            return

        def authorized(bucket: str, key: str) -> None:  # runs inside stock _dispatch, on its parse
            check(self, bucket, key)
            action(bucket, key)

        stock_dispatch(self, authorized)

    def read_body(self: Any) -> bytes:
        try:
            return _read_verified_body(self, localbucket)
        except AuthError as error:
            raise to_s3_error(error) from None

    def get_request(self: Any, bucket: str, key: str) -> None:
        if bucket and not key and "location" in self.query:
            self._check_query("GetBucketLocation", {"location"})
            self._bucket_dir(bucket)
            root = ET.Element("LocationConstraint", xmlns=localbucket.S3_NAMESPACE)
            root.text = region
            self._send_xml(root)
            return
        stock_get(self, bucket, key)

    def post_request(self: Any, bucket: str, key: str) -> None:
        if bucket and not key and "delete" in self.query:
            self._check_query("DeleteObjects", {"delete"})
            self._bucket_dir(bucket)
            doomed, quiet = _delete_request(self, self._read_body())
            check(self, bucket, key, delete_keys=doomed)  # every key, before any is deleted
            _delete_objects(self, localbucket, bucket, doomed, quiet)
            return
        stock_post(self, bucket, key)

    handler._dispatch = dispatch
    handler._read_body = read_body
    handler._get_request = get_request
    handler._post_request = post_request


def _authenticate(self: Any, identities: Identities, region: str) -> tuple[Verified, S3Identity]:
    """The request's verified signature and the identity of the key it names."""
    found: list[S3Identity] = []

    def lookup(access_key: str) -> Optional[S3Credentials]:
        identity = identities.get(access_key)  # looked up once: the same identity is authorized
        if identity is None:
            return None
        found.append(identity)
        return identity.credentials(region)

    verified = verify_request(self.command, self.path, self.headers, lookup)
    return verified, found[-1]


def _read_verified_body(self: Any, localbucket: Any) -> bytes:
    """The body as stock ``_read_body`` decodes it, checked against what the client signed."""
    if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
        raw = localbucket.read_chunked(self.rfile)  # HTTP/1.1 chunking, not signed
    else:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    payload_hash = self._sigv4.payload_hash
    if payload_hash == SIGNED_CHUNKS:
        return decode_signed_chunks(raw, self._sigv4)
    if payload_hash.startswith("STREAMING-") or "aws-chunked" in self.headers.get("Content-Encoding", ""):
        return localbucket.read_chunked(io.BytesIO(raw))  # unsigned chunks: headers only
    check_payload(raw, payload_hash)
    return raw


def _delete_request(self: Any, body: bytes) -> tuple[list[str], bool]:
    """DeleteObjects' keys and its ``<Quiet>`` flag."""
    try:
        request = ET.fromstring(body)
    except ET.ParseError:
        raise self._malformed_xml_error() from None
    keys = [obj.findtext("{*}Key") or "" for obj in request.findall("{*}Object")]
    if not keys or len(keys) > MAX_DELETE_KEYS:
        raise self._malformed_xml_error()
    return keys, (request.findtext("{*}Quiet") or "").strip().lower() == "true"


def _delete_objects(self: Any, localbucket: Any, bucket: str, keys: list[str], quiet: bool) -> None:
    """DeleteObjects: each listed key is deleted (a missing one counts as deleted, as in S3);
    with ``<Quiet>true</Quiet>`` only the failures are listed."""
    root = ET.Element("DeleteResult", xmlns=localbucket.S3_NAMESPACE)
    for key in keys:
        try:
            _delete_one(self, bucket, key)
        except localbucket.S3Error as error:
            failed = ET.SubElement(root, "Error")
            for tag, text in (("Key", key), ("Code", error.code), ("Message", error.message)):
                localbucket.sub_element(failed, tag, text)
            continue
        if not quiet:
            localbucket.sub_element(ET.SubElement(root, "Deleted"), "Key", key)
    self._send_xml(root)


def _delete_one(self: Any, bucket: str, key: str) -> None:
    """Stock DeleteObject's file work (unlink, then drop folders left empty), without a reply."""
    bucket_dir = self._bucket_dir(bucket).resolve()
    target = self._object_path(bucket, key)
    if target.is_file():
        target.unlink(missing_ok=True)
        parent = target.parent
        while parent != bucket_dir:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
