"""Signature V4 checks of the local S3 server (infra.s3_auth), against AWS's published examples
and requests signed by botocore (an independent signer)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from email.message import Message

import pytest
from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from infra.s3_auth import AuthError, S3Credentials, check_payload, decode_signed_chunks, verify_request

# The example credentials of AWS's Signature V4 documentation for S3.
AWS = S3Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "us-east-1")
AWS_TIME = datetime(2013, 5, 24, tzinfo=timezone.utc)
EMPTY = hashlib.sha256(b"").hexdigest()
SCOPE = "AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request"


def _headers(**items: str) -> Message:
    message = Message()
    for name, value in items.items():
        message[name.replace("_", "-")] = value
    return message


def _aws_get_object(signature: str) -> Message:
    return _headers(Host="examplebucket.s3.amazonaws.com", Range="bytes=0-9", x_amz_content_sha256=EMPTY,
                    x_amz_date="20130524T000000Z",
                    Authorization=f"AWS4-HMAC-SHA256 Credential={SCOPE},"
                                  "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
                                  f"Signature={signature}")


def test_aws_documentation_example_get_object():
    good = "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    verified = verify_request("GET", "/test.txt", _aws_get_object(good), AWS, now=AWS_TIME)
    assert verified.scope == "20130524/us-east-1/s3/aws4_request"
    with pytest.raises(AuthError) as err:
        verify_request("GET", "/test.txt", _aws_get_object("0" + good[1:]), AWS, now=AWS_TIME)
    assert (err.value.status, err.value.code) == (403, "SignatureDoesNotMatch")


def test_aws_documentation_example_signed_chunks():
    seed = "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"
    headers = _headers(Host="s3.amazonaws.com", x_amz_date="20130524T000000Z",
                       x_amz_storage_class="REDUCED_REDUNDANCY",
                       x_amz_content_sha256="STREAMING-AWS4-HMAC-SHA256-PAYLOAD", Content_Encoding="aws-chunked",
                       x_amz_decoded_content_length="66560", Content_Length="66824",
                       Authorization=f"AWS4-HMAC-SHA256 Credential={SCOPE},SignedHeaders=content-encoding;"
                                     "content-length;host;x-amz-content-sha256;x-amz-date;"
                                     f"x-amz-decoded-content-length;x-amz-storage-class,Signature={seed}")
    verified = verify_request("PUT", "/examplebucket/chunkObject.txt", headers, AWS, now=AWS_TIME)
    chunks = [(65536, "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648"),
              (1024, "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497"),
              (0, "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9")]
    body = b"".join(b"%x;chunk-signature=%s\r\n%s\r\n" % (n, sig.encode(), b"a" * n) for n, sig in chunks)
    assert len(body) == 66824
    assert decode_signed_chunks(body, verified, AWS) == b"a" * 66560
    tampered = body.replace(b"a" * 1024 + b"\r\n", b"b" + b"a" * 1023 + b"\r\n")
    with pytest.raises(AuthError, match="signature"):
        decode_signed_chunks(tampered, verified, AWS)


LOCAL = S3Credentials("heterorl-local", "local-secret", "us-east-1")


def _botocore_signed(creds: S3Credentials, method: str = "PUT", url: str = "http://127.0.0.1:9000/b/k%20x?tagging",
                     body: bytes = b"payload") -> tuple[str, Message]:
    request = AWSRequest(method=method, url=url, data=body, headers={"Content-Type": "text/plain"})
    S3SigV4Auth(Credentials(creds.access_key, creds.secret_key), "s3", creds.region).add_auth(request)
    target = url.split("://", 1)[1].partition("/")[2]
    return "/" + target, _headers(Host="127.0.0.1:9000", **{k.replace("-", "_"): v for k, v in request.headers.items()})


def test_botocore_signed_request_and_wrong_credentials():
    target, headers = _botocore_signed(LOCAL)
    verified = verify_request("PUT", target, headers, LOCAL)
    check_payload(b"payload", verified.payload_hash)
    with pytest.raises(AuthError) as err:
        check_payload(b"other", verified.payload_hash)
    assert err.value.code == "XAmzContentSHA256Mismatch"
    for creds, code in ((S3Credentials("heterorl-local", "wrong"), "SignatureDoesNotMatch"),
                        (S3Credentials("someone", "local-secret"), "InvalidAccessKeyId")):
        target, headers = _botocore_signed(creds)
        with pytest.raises(AuthError) as err:
            verify_request("PUT", target, headers, LOCAL)
        assert (err.value.status, err.value.code) == (403, code)


def test_unsigned_request_stale_clock_and_other_region_refused():
    with pytest.raises(AuthError) as err:
        verify_request("GET", "/b/k", _headers(Host="127.0.0.1:9000"), LOCAL)
    assert (err.value.status, err.value.code) == (403, "AccessDenied")
    target, headers = _botocore_signed(LOCAL)
    with pytest.raises(AuthError) as err:
        verify_request("PUT", target, headers, LOCAL, now=datetime.now(timezone.utc) + timedelta(minutes=16))
    assert err.value.code == "RequestTimeTooSkewed"
    target, headers = _botocore_signed(S3Credentials("heterorl-local", "local-secret", "eu-west-1"))
    with pytest.raises(AuthError) as err:
        verify_request("PUT", target, headers, LOCAL)
    assert (err.value.status, err.value.code) == (400, "AuthorizationHeaderMalformed")


def test_presigned_url_and_its_expiry():
    request = AWSRequest(method="GET", url="http://127.0.0.1:9000/b/k?response-content-type=text%2Fplain")
    S3SigV4QueryAuth(Credentials(LOCAL.access_key, LOCAL.secret_key), "s3", LOCAL.region, expires=60).add_auth(request)
    target = "/" + request.url.split("://", 1)[1].partition("/")[2]
    headers = _headers(Host="127.0.0.1:9000")
    assert verify_request("GET", target, headers, LOCAL).payload_hash == "UNSIGNED-PAYLOAD"
    with pytest.raises(AuthError) as err:
        verify_request("GET", target, headers, LOCAL, now=datetime.now(timezone.utc) + timedelta(seconds=120))
    assert (err.value.code, err.value.message) == ("AccessDenied", "Request has expired")
    with pytest.raises(AuthError) as err:
        verify_request("GET", target.replace("k?", "other?"), headers, LOCAL)
    assert err.value.code == "SignatureDoesNotMatch"


def test_credentials_repr_hides_the_secret():
    assert "local-secret" not in repr(LOCAL)
