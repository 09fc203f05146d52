"""AWS Signature Version 4 checks for the local S3 server (``localbucket``, see
``infra.local_stack._serve_localbucket``), so that only holders of a key it knows reach it.
What each key may then do is ``infra.s3_identities.authorize``'s decision, not this module's.

What a request must carry to be served:

* ``Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...``
  (header auth), or the ``X-Amz-Algorithm`` / ``X-Amz-Credential`` / ``X-Amz-Date`` /
  ``X-Amz-Expires`` / ``X-Amz-SignedHeaders`` / ``X-Amz-Signature`` query parameters
  (a presigned URL, payload ``UNSIGNED-PAYLOAD``). Nothing else: no anonymous access, no
  Signature V2.
* A known access key (``verify_request``'s ``creds``: the one key, or a lookup from access
  key to its credentials, e.g. ``infra.s3_identities.IdentityStore``), the server's region
  and the service ``s3`` in the credential scope. The signature is checked with that key's
  secret; ``Verified.credentials`` says which key it was.
* A request time (``X-Amz-Date``) within ``MAX_SKEW_S`` of the server's clock; a presigned
  URL must also be inside its ``X-Amz-Expires`` window.
* ``host`` among the signed headers; with header auth an ``x-amz-content-sha256`` header.
* A signature equal (``hmac.compare_digest``) to the one computed here from the method,
  path, query, the signed headers as received and the ``x-amz-content-sha256`` value.

The payload itself is checked by the server once it has read the body
(``check_payload`` / ``decode_signed_chunks``): a hex ``x-amz-content-sha256`` must be the
sha256 of the body received; ``STREAMING-AWS4-HMAC-SHA256-PAYLOAD`` bodies have every chunk
signature checked against the chain that starts at the header's (seed) signature;
``UNSIGNED-PAYLOAD`` and the other ``STREAMING-*`` forms (unsigned, or with trailers) are
accepted with the headers signed but the body unchecked, as S3 itself does.

The canonical forms (query, headers) and the key derivation come from botocore's
``S3SigV4Auth``, the signer the AWS SDKs use, so this module only parses what the client
sent and puts the pieces in order. Errors are ``AuthError`` with S3's status and code:
403 ``AccessDenied`` (no or expired credentials), 403 ``InvalidAccessKeyId``, 403
``SignatureDoesNotMatch``, 403 ``RequestTimeTooSkewed``, 400
``AuthorizationHeaderMalformed``, 400 ``XAmzContentSHA256Mismatch``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional, Union
from urllib.parse import quote, unquote

from botocore.auth import EMPTY_SHA256_HASH, SIGV4_TIMESTAMP, S3SigV4Auth
from botocore.compat import HTTPHeaders
from botocore.credentials import Credentials

ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW_S = 15 * 60
MAX_PRESIGN_EXPIRES_S = 7 * 24 * 3600
SIGNED_CHUNKS = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_AUTH_FIELD = re.compile(r"(Credential|SignedHeaders|Signature)=([^,\s]*)")


@dataclass(frozen=True)
class S3Credentials:
    """One key the local S3 server accepts (access key, secret) and the server's region."""

    access_key: str
    secret_key: str = ""
    region: str = "us-east-1"

    def __repr__(self) -> str:  # never the secret in a log line or traceback
        return f"S3Credentials(access_key={self.access_key!r}, region={self.region!r})"


class AuthError(Exception):
    """A request the server refuses; ``status`` and ``code`` go into the S3 error response."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(frozen=True)
class Verified:
    """What a verified request was signed with; the body checks continue from it."""

    timestamp: str  # X-Amz-Date, 20240101T000000Z
    scope: str  # 20240101/us-east-1/s3/aws4_request
    signature: str  # the header's (seed) signature
    payload_hash: str  # x-amz-content-sha256 as sent (UNSIGNED-PAYLOAD for presigned URLs)
    credentials: Optional[S3Credentials] = field(default=None, repr=False, compare=False)  # the key it was signed with


# An access key's credentials, or None for a key the server does not know (now).
CredentialLookup = Callable[[str], Optional[S3Credentials]]


def _access_denied(message: str = "Access Denied") -> AuthError:
    return AuthError(403, "AccessDenied", message)


def _malformed(message: str) -> AuthError:
    return AuthError(400, "AuthorizationHeaderMalformed", message)


def _query_pairs(raw_query: str) -> list[tuple[str, str]]:
    # Split by hand: parse_qsl would turn "+" into a space, which the signer did not.
    pairs = []
    for item in raw_query.split("&") if raw_query else []:
        key, _, value = item.partition("=")
        pairs.append((unquote(key), unquote(value)))
    return pairs


def _signer(creds: S3Credentials) -> S3SigV4Auth:
    return S3SigV4Auth(Credentials(creds.access_key, creds.secret_key), "s3", creds.region)


class _Context:
    """The bits of a botocore AWSRequest that its signature methods read."""

    def __init__(self, timestamp: str):
        self.context = {"timestamp": timestamp}


def _signature(creds: S3Credentials, timestamp: str, string_to_sign: str) -> str:
    return _signer(creds).signature(string_to_sign, _Context(timestamp))


def _string_to_sign(creds: S3Credentials, timestamp: str, canonical_request: str) -> str:
    return _signer(creds).string_to_sign(_Context(timestamp), canonical_request)


def canonical_request(method: str, raw_path: str, query: list[tuple[str, str]], headers: Any,
                      signed: list[str], payload_hash: str) -> str:
    """SigV4's canonical request of what was received (``headers``: the request's headers,
    anything with ``get_all``; ``signed``: the lower-case names the client signed)."""
    signer = _signer(S3Credentials(""))
    chosen = HTTPHeaders()
    for name in signed:
        for value in headers.get_all(name) or []:
            chosen[name] = value
    return "\n".join([
        method.upper(),
        quote(unquote(raw_path), safe="/~"),
        signer._canonical_query_string_params(query),
        signer.canonical_headers(chosen) + "\n",
        ";".join(signed),
        payload_hash,
    ])


def _parse_time(text: str) -> datetime:
    try:
        return datetime.strptime(text, SIGV4_TIMESTAMP).replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        raise _malformed(f"X-Amz-Date {text!r} is not of the form YYYYMMDDTHHMMSSZ") from None


def _as_lookup(creds: Union[S3Credentials, CredentialLookup]) -> CredentialLookup:
    if not isinstance(creds, S3Credentials):
        return creds
    return lambda access_key: creds if hmac.compare_digest(access_key.encode(), creds.access_key.encode()) else None


def _check_scope(credential: str, timestamp: str, keys: CredentialLookup) -> tuple[str, S3Credentials]:
    """The credential scope after the access key, and that key's credentials, once key, date,
    region and service match."""
    access_key, _, scope = credential.partition("/")
    parts = scope.split("/")
    if len(parts) != 4 or parts[3] != "aws4_request":
        raise _malformed(f"credential {credential!r} is not <key>/<date>/<region>/s3/aws4_request")
    creds = keys(access_key)
    if creds is None:
        raise AuthError(403, "InvalidAccessKeyId",
                        "The AWS Access Key Id you provided does not exist in our records.")
    if parts[0] != timestamp[:8]:
        raise _malformed(f"credential date {parts[0]} is not the request date {timestamp[:8]}")
    if parts[1] != creds.region or parts[2] != "s3":
        raise _malformed(f"the credential scope names region {parts[1]!r}, service {parts[2]!r}; "
                         f"expecting {creds.region!r}, 's3'")
    return scope, creds


def _check_signed_headers(text: str) -> list[str]:
    signed = [name for name in text.split(";") if name]
    if "host" not in signed or signed != sorted(set(signed)) or any(n != n.lower() for n in signed):
        raise _malformed(f"SignedHeaders {text!r} must be sorted lower-case names that include host")
    return signed


def _check_signature(expected: str, given: str) -> None:
    if not hmac.compare_digest(expected.encode(), given.encode()):
        raise AuthError(403, "SignatureDoesNotMatch",
                        "The request signature we calculated does not match the signature you provided. "
                        "Check your key and signing method.")


def _check_clock(when: datetime, now: datetime) -> None:
    if abs((now - when).total_seconds()) > MAX_SKEW_S:
        raise AuthError(403, "RequestTimeTooSkewed",
                        "The difference between the request time and the current time is too large.")


def verify_request(method: str, target: str, headers: Any, creds: Union[S3Credentials, CredentialLookup],
                   now: Optional[datetime] = None) -> Verified:
    """Check the SigV4 signature of one request (``target``: the raw request-target,
    path and query as sent; ``headers``: anything with ``get`` and ``get_all``; ``creds``:
    the one key accepted, or a lookup from an access key to its credentials).

    Returns what it was signed with; raises AuthError naming S3's error code."""
    now = now or datetime.now(timezone.utc)
    keys = _as_lookup(creds)
    raw_path, _, raw_query = target.partition("?")
    query = _query_pairs(raw_query)
    if any(key == "X-Amz-Signature" for key, _ in query):
        return _verify_presigned(method, raw_path, query, headers, keys, now)
    authorization = headers.get("Authorization")
    if not authorization:
        raise _access_denied()
    return _verify_header(method, raw_path, query, headers, authorization, keys, now)


def _verify_header(method: str, raw_path: str, query: list[tuple[str, str]], headers: Any,
                   authorization: str, keys: CredentialLookup, now: datetime) -> Verified:
    algorithm, _, rest = authorization.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise _malformed(f"only {ALGORITHM} (Signature Version 4) is accepted, not {algorithm!r}")
    fields = dict(_AUTH_FIELD.findall(rest))
    if set(fields) != {"Credential", "SignedHeaders", "Signature"}:
        raise _malformed("the Authorization header needs Credential, SignedHeaders and Signature")
    payload_hash = headers.get("x-amz-content-sha256")
    if not payload_hash:
        raise AuthError(400, "InvalidRequest", "Missing required header for this request: x-amz-content-sha256")
    timestamp = headers.get("x-amz-date") or ""
    when = _parse_time(timestamp)
    scope, creds = _check_scope(fields["Credential"], timestamp, keys)
    signed = _check_signed_headers(fields["SignedHeaders"])
    request = canonical_request(method, raw_path, query, headers, signed, payload_hash)
    _check_signature(_signature(creds, timestamp, _string_to_sign(creds, timestamp, request)), fields["Signature"])
    _check_clock(when, now)  # after the signature: a wrong key says so even with a wrong clock
    return Verified(timestamp, scope, fields["Signature"], payload_hash, creds)


def _verify_presigned(method: str, raw_path: str, query: list[tuple[str, str]], headers: Any,
                      keys: CredentialLookup, now: datetime) -> Verified:
    params = dict(query)
    if params.get("X-Amz-Algorithm") != ALGORITHM:
        raise _malformed(f"X-Amz-Algorithm must be {ALGORITHM}")
    timestamp = params.get("X-Amz-Date", "")
    when = _parse_time(timestamp)
    scope, creds = _check_scope(params.get("X-Amz-Credential", ""), timestamp, keys)
    signed = _check_signed_headers(params.get("X-Amz-SignedHeaders", ""))
    try:
        expires = int(params.get("X-Amz-Expires", ""))
    except ValueError:
        raise _malformed("X-Amz-Expires must be a number of seconds") from None
    if not 1 <= expires <= MAX_PRESIGN_EXPIRES_S:
        raise _malformed(f"X-Amz-Expires must be between 1 and {MAX_PRESIGN_EXPIRES_S}")
    unsigned_query = [(k, v) for k, v in query if k != "X-Amz-Signature"]
    request = canonical_request(method, raw_path, unsigned_query, headers, signed, "UNSIGNED-PAYLOAD")
    _check_signature(_signature(creds, timestamp, _string_to_sign(creds, timestamp, request)),
                     params["X-Amz-Signature"])
    if (now - when).total_seconds() > expires:
        raise _access_denied("Request has expired")
    if (when - now).total_seconds() > MAX_SKEW_S:
        raise AuthError(403, "RequestTimeTooSkewed", "The request time is too far in the future.")
    return Verified(timestamp, scope, params["X-Amz-Signature"], "UNSIGNED-PAYLOAD", creds)


def check_payload(body: bytes, payload_hash: str) -> None:
    """A hex ``x-amz-content-sha256`` must be the sha256 of the body received."""
    if _HEX64.match(payload_hash) and not hmac.compare_digest(hashlib.sha256(body).hexdigest(), payload_hash):
        raise AuthError(400, "XAmzContentSHA256Mismatch",
                        "The provided 'x-amz-content-sha256' header does not match what was computed.")


def decode_signed_chunks(raw: bytes, verified: Verified, creds: Optional[S3Credentials] = None) -> bytes:
    """The data of an ``aws-chunked`` body (``STREAMING-AWS4-HMAC-SHA256-PAYLOAD``), each
    chunk's signature checked: it chains from the previous one, starting at the seed
    (``creds``: the key the headers were signed with; by default ``verified.credentials``)."""
    creds = creds or verified.credentials
    if creds is None:
        raise ValueError("decode_signed_chunks needs the key the request was signed with")
    data, previous, pos = bytearray(), verified.signature, 0
    while True:
        end = raw.find(b"\r\n", pos)
        if end < 0:
            raise AuthError(400, "IncompleteBody", "Chunked body ended unexpectedly.")
        size_text, _, extension = raw[pos:end].decode("ascii", "replace").partition(";")
        given = extension.strip().removeprefix("chunk-signature=")
        try:
            size = int(size_text.strip(), 16)
        except ValueError:
            raise AuthError(400, "InvalidRequest", "Invalid chunk size.") from None
        chunk = raw[end + 2:end + 2 + size]
        if len(chunk) != size:
            raise AuthError(400, "IncompleteBody", "Chunk is shorter than declared.")
        string_to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", verified.timestamp, verified.scope, previous,
                                    EMPTY_SHA256_HASH, hashlib.sha256(chunk).hexdigest()])
        expected = _signature(creds, verified.timestamp, string_to_sign)
        _check_signature(expected, given)
        if size == 0:
            return bytes(data)
        data += chunk
        previous, pos = given, end + 2 + size + 2
