"""How a client reaches a daemon: plaintext or TLS (mutual with a client certificate),
with or without a bearer token.

Each option comes from an argument, else from the environment:

| argument | environment | meaning |
|---|---|---|
| token / token_file | KVGRAFT_TOKEN_FILE | bearer token sent with every call |
| tls | KVGRAFT_TLS=1 | TLS, trusting the system's CA certificates |
| tls_ca | KVGRAFT_TLS_CA | TLS, trusting this PEM CA bundle (the daemon's CA) |
| tls_cert, tls_key | KVGRAFT_TLS_CERT, KVGRAFT_TLS_KEY | client certificate for mutual TLS |
| tls_server_name | KVGRAFT_TLS_SERVER_NAME | name to check the daemon's certificate against |

Giving any TLS option turns TLS on. The token travels as `authorization:
Bearer <token>` metadata; it is never logged, shown in a repr or put in an
error message (file paths are, contents never).

Credentials (the token, the client certificate) go only where whoever set them up
means them to: `Security.anonymous()` is the environment's TLS without them, for a
daemon somebody else named (kvgraftd.replication.pulls: a source a caller chose), and
`client_options()` hands a Security to kvgraft.Client as it is, the KVGRAFT_*
environment adding nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from kvgraft.errors import InvalidArgument

ENVIRONMENT = {
    "token_file": "KVGRAFT_TOKEN_FILE",
    "tls": "KVGRAFT_TLS",
    "tls_ca": "KVGRAFT_TLS_CA",
    "tls_cert": "KVGRAFT_TLS_CERT",
    "tls_key": "KVGRAFT_TLS_KEY",
    "tls_server_name": "KVGRAFT_TLS_SERVER_NAME",
}


@dataclass(frozen=True)
class Security:
    token: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None

    @classmethod
    def resolve(
        cls,
        *,
        token: str | bytes | None = None,
        token_file: str | os.PathLike | None = None,
        tls: bool | None = None,
        tls_ca: str | os.PathLike | None = None,
        tls_cert: str | os.PathLike | None = None,
        tls_key: str | os.PathLike | None = None,
        tls_server_name: str | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> Security:
        """Arguments first, then KVGRAFT_* variables; checks what it can before connecting."""

        def pick(value, name: str) -> str | None:
            chosen = value if value is not None else environ.get(ENVIRONMENT[name])
            return str(chosen) if chosen not in (None, "") else None

        if token is None:
            path = pick(token_file, "token_file")
            token = _read_token(path) if path else None
        elif isinstance(token, bytes):
            token = token.decode("ascii", errors="replace")
        if token is not None:
            token = token.strip()
            if not token or not token.isascii() or not token.isprintable():
                raise InvalidArgument("the token must be non-empty printable ASCII")
        ca, cert, key = pick(tls_ca, "tls_ca"), pick(tls_cert, "tls_cert"), pick(tls_key, "tls_key")
        if bool(cert) != bool(key):
            raise InvalidArgument("a client certificate needs its key: give tls_cert and tls_key")
        if tls is None:
            tls = environ.get(ENVIRONMENT["tls"], "").lower() in ("1", "true", "yes")
        server_name = pick(tls_server_name, "tls_server_name")
        tls = bool(tls or ca or cert or server_name)
        return cls(token, tls, ca, cert, key, server_name)

    @classmethod
    def anonymous(cls, environ: Mapping[str, str] = os.environ) -> Security:
        """The environment's TLS (on or off, the CA, the name to check) with none of its
        credentials: no bearer token (its file is not read), no client certificate."""
        return replace(cls.resolve(token_file="", environ=environ), tls_cert=None, tls_key=None)

    def client_options(self) -> dict[str, str | bool | None]:
        """kvgraft.Client's keyword arguments for exactly these settings: "" for those not
        set, so that the KVGRAFT_* environment fills none of them in."""
        return {
            "token": self.token,  # None: then token_file "", none
            "token_file": "",
            "tls": self.tls,
            "tls_ca": self.tls_ca or "",
            "tls_cert": self.tls_cert or "",
            "tls_key": self.tls_key or "",
            "tls_server_name": self.tls_server_name or "",
        }

    def channel(self, address: str, options: list[tuple[str, int | str]]) -> grpc.Channel:
        """A channel to `address` with these credentials (the token on every call)."""
        if self.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(self.tls_ca, "tls_ca") if self.tls_ca else None,
                private_key=_read_pem(self.tls_key, "tls_key") if self.tls_key else None,
                certificate_chain=_read_pem(self.tls_cert, "tls_cert") if self.tls_cert else None,
            )
            if self.tls_server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _BearerToken(self.token))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{what} {path}: cannot read it ({exc.strerror})") from None


# What each PEM file must hold. gRPC only logs why it cannot load one and then fails
# every call with "Failed to create security handshaker": check first, name the file.
_PEM = {  # name: (what it must contain, what it is, its first line)
    "tls_ca": (
        b"-----BEGIN CERTIFICATE-----",
        "the certificate of the CA that signed the daemon's certificate",
        "-----BEGIN CERTIFICATE-----",
    ),
    "tls_cert": (
        b"-----BEGIN CERTIFICATE-----",
        "a client certificate",
        "-----BEGIN CERTIFICATE-----",
    ),
    "tls_key": (
        b"PRIVATE KEY-----",
        "the private key of the client certificate",
        "-----BEGIN ... PRIVATE KEY-----",
    ),
}


def _read_pem(path: str, name: str) -> bytes:
    flag = "--" + name.replace("_", "-")  # the setting as the command line names it
    data = _read(path, flag)
    marker, meaning, first_line = _PEM[name]
    if marker not in data:
        raise InvalidArgument(
            f"{flag} {path} is not a PEM file: give {meaning} in PEM form "
            f"(a text file with a {first_line} line; {ENVIRONMENT[name]} takes it too)"
        )
    return data


def _read_token(path: str) -> str:
    raw = _read(path, "token file")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidArgument(f"token file {path} does not hold a printable ASCII token") from None


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:
        return "_BearerToken(<hidden>)"

    def _details(self, details):
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None
