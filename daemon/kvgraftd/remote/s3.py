"""The remote tier's S3 client: its settings, its configuration and how its errors read.

`make_client` builds a boto3 client with connect/read timeouts, botocore's
standard retries (exponential backoff with jitter, 3 attempts), a connection
pool as large as the tier's parallelism, path-style addressing for explicit
endpoints, and no payload signing (every object's SHA-256 is its key and
travels as x-amz-checksum-sha256 for the server to check). Credentials come
from the standard AWS chain and are never logged: botocore's own loggers are
held at WARNING so request headers never reach the daemon log.

This is the only module that imports boto3 (lazily: a daemon without a
[remote] section never imports it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvgraft.errors import Unauthenticated, Unavailable

MISSING = ("404", "NoSuchKey", "NotFound")
EXISTS = ("412", "PreconditionFailed")
AUTH = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken")

for _name in ("boto3", "botocore", "s3transfer", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class RemoteSettings:
    endpoint: str  # "" : AWS S3 of the configured region
    bucket: str
    prefix: str
    write: str  # "through" or "back"
    timeout_s: float = 10.0
    connections: int = 8


def make_client(settings: RemoteSettings):
    """A boto3 S3 client for the tier; Unauthenticated when there are no credentials."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    if session.get_credentials() is None:
        raise Unauthenticated(
            "the remote tier has no S3 credentials: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or a credentials file (AWS_SHARED_CREDENTIALS_FILE, "
            "AWS_PROFILE), in kvgraftd's environment"
        )
    config = Config(
        connect_timeout=settings.timeout_s,
        read_timeout=settings.timeout_s,
        retries={"mode": "standard", "max_attempts": 3},
        max_pool_connections=settings.connections,
        # The SHA-256 of every page and manifest is its key: it travels as
        # x-amz-checksum-sha256 and the server checks the bytes against it, so
        # signing the payload (hashing it a second time on this side) adds nothing.
        # Path-style for an explicit endpoint (Ceph RGW, SeaweedFS: no wildcard DNS).
        s3={
            "addressing_style": "path" if settings.endpoint else "auto",
            "payload_signing_enabled": False,
        },
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client(
        "s3",
        endpoint_url=settings.endpoint or None,
        region_name=session.region_name or "us-east-1",
        config=config,
    )


def error_code(exc) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else: a timeout's
    exception has a `response` too, and it is None)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def describe(exc: BaseException) -> str:
    code = error_code(exc)
    text = str(exc)
    return f"{code}: {text}" if code and code not in text else text


def write_error(key: str, exc: BaseException) -> Exception:
    if error_code(exc) in AUTH:
        return Unauthenticated(
            f"the remote tier refused {key} ({error_code(exc)}): check the S3 credentials and the "
            "key's rights on the bucket"
        )
    return Unavailable(f"the remote tier could not write or list {key} ({describe(exc)})")
