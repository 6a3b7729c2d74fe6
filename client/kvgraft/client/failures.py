"""What a failed call means, in the user's words: gRPC's details of a connection that
could not be made, a TLS handshake that failed, a connection that closed, or a deadline
that passed, turned into one message that says what happened and which setting to fix.

kvgraft.client.connection maps every gRPC error to its kvgraft.errors class and asks
`explain` for the message; an answer of the daemon itself (its own UNAVAILABLE while
the model loads, its DEADLINE_EXCEEDED past `max_call_s`) keeps the daemon's words.
Settings are named as flags with their environment variable (`--tls-ca`,
KVGRAFT_TLS_CA), as the command line and the Client take the same ones.
"""

from __future__ import annotations

# What gRPC says when no connection could be made (as opposed to a daemon that
# answered UNAVAILABLE itself, e.g. while its model loads or it shuts down) ...
_UNREACHABLE = ("failed to connect", "Connection refused", "DNS resolution failed", "unreachable")
# ... when a connection closed under a call: a daemon that stopped, a network that
# cut, or (when it happens at once) a failed TLS handshake ...
_CLOSED = ("Socket closed", "Ssl handshake failed")
# ... and, over TLS, what the handshake reports (BoringSSL's reasons, gRPC's checks).
_TLS_FILES = ("Failed to create security handshaker",)
_TLS_PLAINTEXT_PEER = ("WRONG_VERSION_NUMBER",)
_TLS_UNTRUSTED = ("CERTIFICATE_VERIFY_FAILED",)
_TLS_WRONG_NAME = ("Hostname Verification Check failed", "Peer name")
# gRPC's own words for a deadline that passed on this side.
_CLIENT_DEADLINE = "Deadline Exceeded"


def _any(signs: tuple[str, ...], details: str) -> bool:
    return any(sign in details for sign in signs)


def explain(
    code: str, details: str, *, address: str, tls: bool, deadline: tuple[str, float] | None
) -> str:
    """The message of a failed call: `code` is the status code's name, `details` gRPC's
    text, `deadline` (Client argument, seconds) the deadline the call ran under."""
    if code == "DEADLINE_EXCEEDED" and details == _CLIENT_DEADLINE and deadline is not None:
        name, seconds = deadline
        return (
            f"kvgraftd at {address} did not finish the call within its deadline of "
            f"{seconds:g} s: give it longer with --timeout S (in Python, Client({name}=S))"
        )
    if code != "UNAVAILABLE":
        return details
    if tls:
        told = _tls_failure(details, address)
        if told:
            return told
    if _any(_CLOSED, details) and _any(_UNREACHABLE, details):  # closed as it connected
        return f"kvgraftd at {address} closed the connection at once ({details}): " + (
            "it refused the TLS handshake: it requires a client certificate of its CA "
            "(--tls-cert and --tls-key, KVGRAFT_TLS_CERT and KVGRAFT_TLS_KEY)"
            if tls
            else "it may serve TLS: give --tls-ca (KVGRAFT_TLS_CA)"
        )
    if _any(_UNREACHABLE, details):
        return (
            f"cannot reach kvgraftd at {address} ({details}); is it running? Start it with "
            "`make serve` or `kvgraft serve`, or set --server/KVGRAFT_SERVER"
            + ("" if tls else "; if the daemon serves TLS, give --tls-ca (KVGRAFT_TLS_CA)")
        )
    if _any(_CLOSED, details):
        return (
            f"the connection to kvgraftd at {address} closed ({details}): the daemon stopped "
            "or the network cut the call; retry"
        )
    return details


def _tls_failure(details: str, address: str) -> str | None:
    """What a failed TLS handshake means, or None when it was something else."""
    host = address.rpartition(":")[0] or address
    if _any(_TLS_FILES, details):
        return (
            "the TLS settings could not be loaded: --tls-ca (KVGRAFT_TLS_CA) must hold PEM "
            "certificates of the CA that signed the daemon's certificate, and --tls-cert "
            "with --tls-key a PEM client certificate and its own private key"
        )
    if _any(_TLS_PLAINTEXT_PEER, details):
        return (
            f"kvgraftd at {address} does not speak TLS (its answer is not a TLS handshake): "
            "leave out --tls, --tls-ca, --tls-cert, --tls-key and --tls-server-name "
            "(and KVGRAFT_TLS*), or check that --server names the daemon"
        )
    if _any(_TLS_UNTRUSTED, details):
        return (
            f"the certificate of kvgraftd at {address} is not signed by a CA this client "
            "trusts: give the CA that signed it with --tls-ca (KVGRAFT_TLS_CA)"
        )
    if _any(_TLS_WRONG_NAME, details):
        return (
            f"the certificate of kvgraftd at {address} does not name {host}: connect by a "
            "name it holds, or give that name with --tls-server-name (KVGRAFT_TLS_SERVER_NAME)"
        )
    return None
