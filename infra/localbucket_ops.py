"""What the local S3 server (``localbucket`` 1.2) gets on top of its stock operations:
Signature V4 authentication of every request (``infra.s3_auth``), GetBucketLocation and
DeleteObjects (multi-object delete). ``install`` patches them into the handler class in the
server's own process (``infra.local_stack._serve_localbucket``); nothing else imports it.

Why: stock localbucket checks no credentials at all (any secret reads every object, the
broker's log included) and answers ``GET /bucket?location`` and ``POST /bucket?delete`` with
NotImplemented, which a minio client made without ``region=`` and ``remove_objects`` need.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET
from http import HTTPStatus
from typing import Any, Callable

from infra.s3_auth import SIGNED_CHUNKS, AuthError, S3Credentials, check_payload, decode_signed_chunks, verify_request

MAX_DELETE_KEYS = 1000


def install(localbucket: Any, creds: S3Credentials) -> None:
    """Patch ``localbucket.S3Handler``: authenticate, then serve the two extra operations."""
    handler = localbucket.S3Handler
    stock_dispatch: Callable = handler._dispatch
    stock_get: Callable = handler._get_request
    stock_post: Callable = handler._post_request
    S3Error = localbucket.S3Error

    def to_s3_error(error: AuthError) -> Any:
        return S3Error(HTTPStatus(error.status), error.code, error.message)

    def dispatch(self: Any, action: Callable) -> None:
        try:
            self._sigv4 = verify_request(self.command, self.path, self.headers, creds)
        except AuthError as error:
            self._send_error(to_s3_error(error))
            return
        stock_dispatch(self, action)

    def read_body(self: Any) -> bytes:
        try:
            return _read_verified_body(self, localbucket, creds)
        except AuthError as error:
            raise to_s3_error(error) from None

    def get_request(self: Any, bucket: str, key: str) -> None:
        if bucket and not key and "location" in self.query:
            self._check_query("GetBucketLocation", {"location"})
            self._bucket_dir(bucket)
            root = ET.Element("LocationConstraint", xmlns=localbucket.S3_NAMESPACE)
            root.text = creds.region
            self._send_xml(root)
            return
        stock_get(self, bucket, key)

    def post_request(self: Any, bucket: str, key: str) -> None:
        if bucket and not key and "delete" in self.query:
            self._check_query("DeleteObjects", {"delete"})
            self._bucket_dir(bucket)
            _delete_objects(self, localbucket, bucket, self._read_body())
            return
        stock_post(self, bucket, key)

    handler._dispatch = dispatch
    handler._read_body = read_body
    handler._get_request = get_request
    handler._post_request = post_request


def _read_verified_body(self: Any, localbucket: Any, creds: S3Credentials) -> bytes:
    """The body as stock ``_read_body`` decodes it, checked against what the client signed."""
    if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
        raw = localbucket.read_chunked(self.rfile)  # HTTP/1.1 chunking, not signed
    else:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    payload_hash = self._sigv4.payload_hash
    if payload_hash == SIGNED_CHUNKS:
        return decode_signed_chunks(raw, self._sigv4, creds)
    if payload_hash.startswith("STREAMING-") or "aws-chunked" in self.headers.get("Content-Encoding", ""):
        return localbucket.read_chunked(io.BytesIO(raw))  # unsigned chunks: headers only
    check_payload(raw, payload_hash)
    return raw


def _delete_objects(self: Any, localbucket: Any, bucket: str, body: bytes) -> None:
    """DeleteObjects: each listed key is deleted (a missing one counts as deleted, as in S3);
    with ``<Quiet>true</Quiet>`` only the failures are listed."""
    try:
        request = ET.fromstring(body)
    except ET.ParseError:
        raise self._malformed_xml_error() from None
    keys = [obj.findtext("{*}Key") or "" for obj in request.findall("{*}Object")]
    if not keys or len(keys) > MAX_DELETE_KEYS:
        raise self._malformed_xml_error()
    quiet = (request.findtext("{*}Quiet") or "").strip().lower() == "true"
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
