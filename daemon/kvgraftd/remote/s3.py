"""The remote tier's S3 client: its settings, its configuration and how its errors read.

`make_client` builds a boto3 client with connect/read timeouts, botocore's
standard retries (exponential backoff with jitter, 3 attempts by default; 1 for
the client of calls a local request waits on, whose retries would multiply
the timeout: kvgraftd.remote.tier), a connection
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

from kvgraft.errors import FailedPrecondition, Unauthenticated, Unavailable

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


def make_client(settings: RemoteSettings, attempts: int = 3):
    """A boto3 S3 client for the tier, making each request up to `attempts` times;
    Unauthenticated when there are no credentials."""
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
        # total_max_attempts counts the first attempt; botocore's max_attempts counts the
        # retries only (3 made four attempts: a hung server cost four timeouts).
        retries={"mode": "standard", "total_max_attempts": attempts},
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


def check_refusal(exc, settings: RemoteSettings) -> Exception | None:
    """What the bucket check's ClientError means when the daemon cannot go on (bad
    credentials, no bucket), in words that say what to fix; None for any other."""
    code = error_code(exc)
    where = f"bucket {settings.bucket!r} at {settings.endpoint or 'AWS S3'}"
    if code in AUTH:
        return Unauthenticated(
            f"the remote tier's S3 server refused the credentials for {where} ({code}). "
            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a credentials file: "
            "AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE) to a key with read, write and "
            "list rights on that bucket"
        )
    if code in ("NoSuchBucket", "404"):
        return FailedPrecondition(
            f"the remote tier's {where} does not exist: create it (e.g. `aws s3 mb "
            f"s3://{settings.bucket}`) or fix [remote] bucket"
        )
    return None


def write_error(key: str, exc: BaseException) -> Exception:
    if error_code(exc) in AUTH:
        return Unauthenticated(
            f"the remote tier refused {key} ({error_code(exc)}): check the S3 credentials and the "
            "key's rights on the bucket"
        )
    return Unavailable(f"the remote tier could not write or list {key} ({describe(exc)})")
