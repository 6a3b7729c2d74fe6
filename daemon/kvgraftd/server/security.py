"""Who may call the daemon: the exposure rule, TLS credentials and bearer tokens.

* **Exposure**: an address other machines can reach (not loopback, not a
  Unix socket) is served only with TLS (`tls_cert`, `tls_key`), a token
  (`token_file`), or both — or with `insecure = true`, said out loud. The
  same holds for `http_listen` (the OpenAI-compatible API: the same token, as
  `Authorization: Bearer`) and `metrics_listen` (no token there: TLS or loopback).
* **TLS**: the daemon presents `tls_cert`; with `tls_client_ca` every client
  must present a certificate that CA signed (mutual TLS), checked in the
  handshake, before any call.
* **Token**: with `token_file`, every call — kvgraft RPCs, server reflection,
  health Watch — carries `authorization: Bearer <token>`, compared in
  constant time (hmac.compare_digest). Only health `Check` stays open, so
  probes need no secret. A missing or wrong token is UNAUTHENTICATED.

The token is read once at start and never logged, echoed in an error or
put in a metric. Status codes stay in kvgraftd.server.grpc_server: the interceptor here
refuses through the `abort` callback that server.py hands it.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import grpc

from kvgraft.errors import KvgraftError, Unauthenticated
from kvgraft.tenancy import OPERATOR
from kvgraftd.config import ConfigError, DaemonConfig
from kvgraftd.server.limits import behavior_field

log = logging.getLogger(__name__)

TOKEN_HEADER = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})

# abort(context, method, error): end the call with the error's status code.
Abort = Callable[[grpc.ServicerContext, str, KvgraftError], NoReturn]


def is_local(address: str) -> bool:
    """True for addresses only this machine can reach: loopback IPs, localhost, Unix sockets."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check(config: DaemonConfig) -> None:
    """Refuse (ConfigError) an exposed address without protection, and unreadable files."""
    if not config.insecure:
        if not is_local(config.listen) and not (config.tls_cert or config.token_file):
            raise ConfigError(
                f"listen {config.listen!r} is reachable from other machines: serve TLS "
                "(tls_cert, tls_key), require a token (token_file), or both; or pass "
                "--insecure (insecure = true) to serve it unprotected"
            )
        exposed = config.http_listen and not is_local(config.http_listen)
        if exposed and not (config.tls_cert or config.token_file):
            raise ConfigError(
                f"http_listen {config.http_listen!r} is reachable from other machines: "
                "serve TLS (tls_cert, tls_key), require a token (token_file), or both; "
                'bind it to 127.0.0.1, turn it off (http_listen = "") or pass '
                "--insecure (insecure = true)"
            )
        if config.metrics_listen and not is_local(config.metrics_listen) and not config.tls_cert:
            raise ConfigError(
                f"metrics_listen {config.metrics_listen!r} is reachable from other machines "
                "and has no token: serve TLS (tls_cert, tls_key), bind it to 127.0.0.1, or "
                "pass --insecure (insecure = true)"
            )
    tokens = [load_token(config.token_file)] if config.token_file else []
    tokens += [load_token(tenant.token_file) for tenant in config.tenants]
    if len(set(tokens)) < len(tokens):
        raise ConfigError(
            "two of token_file and the [tenants] token files hold the same token: a token "
            "names one caller; give each tenant its own"
        )
    if config.tls_cert:
        context = tls_context()
        try:
            context.load_cert_chain(config.tls_cert, config.tls_key)
        except FileNotFoundError as exc:
            raise ConfigError(f"tls_cert/tls_key: {exc.filename} does not exist") from None
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls_cert {config.tls_cert} and tls_key {config.tls_key} do not load as a PEM "
                f"certificate chain and its private key ({exc})"
            ) from None
    if config.tls_client_ca:
        try:
            tls_context().load_verify_locations(config.tls_client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls_client_ca {config.tls_client_ca} does not load as PEM CA certificates ({exc})"
            ) from None


def tls_context() -> ssl.SSLContext:
    return ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)


def load_token(path: str) -> bytes:
    """The token of `path`: its content without surrounding whitespace, never empty."""
    try:
        raw = Path(path).read_bytes()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"token_file {path}: cannot read it ({exc.strerror})") from None
    token = raw.strip()
    if not token:
        raise ConfigError(f"token_file {path} is empty: put the token in it (e.g. 32 random hex)")
    if mode & stat.S_IROTH:
        log.warning("token_file %s is readable by every user: chmod 600 it", path)
    return token


def server_credentials(config: DaemonConfig) -> grpc.ServerCredentials | None:
    """TLS (mutual when tls_client_ca is set) for the listening port; None: plaintext."""
    if not config.tls_cert:
        return None
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class TokenCheck:
    """Compares a call's bearer token with the daemon's (the operator's) and each
    tenant's, every one in constant time, and says whose it is."""

    def __init__(self, token: bytes, tenants: Mapping[str, bytes] | None = None) -> None:
        self._expected = [(b"Bearer " + token, OPERATOR)] + [
            (b"Bearer " + tenant_token, name) for name, tenant_token in (tenants or {}).items()
        ]

    def verify(self, metadata) -> str:
        """The caller's tenant ("" : the operator); Unauthenticated for no or a wrong token."""
        given = next((value for key, value in metadata or () if key == TOKEN_HEADER), None)
        if given is None:
            raise Unauthenticated(
                "this daemon requires a bearer token: give the client its token file "
                "(--token-file, KVGRAFT_TOKEN_FILE or Client(token_file=...))"
            )
        if isinstance(given, str):
            given = given.encode()
        caller = None
        for expected, name in self._expected:  # every one compared: the time names no one
            if hmac.compare_digest(given, expected):
                caller = name
        if caller is None:
            raise Unauthenticated(
                "the bearer token is not this daemon's: check the client's token file "
                "(--token-file, KVGRAFT_TOKEN_FILE)"
            )
        return caller


class AccessInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token, and non-health calls from the probe socket.

    The probe socket (a Unix socket in the data directory, opened only when
    TLS is on and systemd asked for notifications) lets kvgraftd.ops.readiness
    probe health without a client certificate; nothing else may use it.
    """

    def __init__(self, token_check: TokenCheck | None, abort: Abort, probe_socket: bool) -> None:
        self._token_check = token_check
        self._abort = abort
        self._probe_socket = probe_socket

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        if self._token_check is not None:
            try:
                self._token_check.verify(handler_call_details.invocation_metadata)
            except Unauthenticated as exc:
                log.debug("refused %s: %s", method, exc)
                return self._wrapped(handler, method, exc)
        if self._probe_socket:
            return self._wrapped(handler, method, None)
        return handler

    def _wrapped(self, handler, method: str, refusal: KvgraftError | None):
        """`handler` with its behavior refused (or refused on the probe socket)."""
        field = behavior_field(handler)
        behavior = getattr(handler, field)
        abort = self._abort
        local_refusal = Unauthenticated(
            f"{method} is not served on the health probe socket; call the daemon's address"
        )

        def guarded(request, context):
            if refusal is not None:
                abort(context, method, refusal)
            if context.peer().startswith("unix:"):
                abort(context, method, local_refusal)
            return behavior(request, context)

        return handler._replace(**{field: guarded})


def probe_socket_path(data: Path) -> Path:
    return Path(data).resolve() / "health-probe.sock"
