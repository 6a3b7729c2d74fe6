"""The error taxonomy shared by the kvgraft client and daemon.

Each class names the gRPC status code it travels as (`code`, a string, so this
module needs no gRPC). The daemon maps raised errors to status codes in one
place (kvgraftd.server.grpc_server); the client maps status codes back to these classes in
one place (kvgraft.client.client). Messages say what happened and what to do.
`printable` is how either side shows text someone else chose (an id in a message, a
label): nothing in it may move the cursor, reorder or hide what follows.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` safe to print on a terminal or in a log: characters that move the cursor,
    reorder text or hide (controls, bidirectional overrides, invisible format characters)
    escaped as Python writes them (\\x1b, \\u202e)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class KvgraftError(Exception):
    """Base of every kvgraft error.

    `param` names the request field at fault as the caller spelled it (OpenAI's `param`;
    None where no one field is). `reason` is a finer cause than `code` where a protocol
    has a name for it (OpenAI's error `code`, e.g. "model_not_found"); "" where not.
    """

    code = "UNKNOWN"
    reason = ""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidArgument(KvgraftError):
    """The request is malformed: fix the input and retry."""

    code = "INVALID_ARGUMENT"


class ContextLengthExceeded(InvalidArgument):
    """The prompt and the tokens asked for do not fit the context: shorten one of them."""

    reason = "context_length_exceeded"


class NotFound(KvgraftError):
    """No such artifact (or page)."""

    code = "NOT_FOUND"


class ModelNotFound(NotFound):
    """The request names a model this daemon does not serve."""

    reason = "model_not_found"


class DataLoss(KvgraftError):
    """Bytes do not match their hash: corruption was detected and nothing was served."""

    code = "DATA_LOSS"


class FailedPrecondition(KvgraftError):
    """The request cannot run in the current state (fingerprint/profile mismatch, pinned)."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(KvgraftError):
    """A store, disk, pool or server limit is full."""

    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(KvgraftError):
    """Missing or bad credentials."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KvgraftError):
    """The caller's token does not allow this (another tenant's shared artifact, an
    operator's RPC)."""

    code = "PERMISSION_DENIED"


class Unimplemented(KvgraftError):
    """This daemon version does not serve the RPC yet."""

    code = "UNIMPLEMENTED"


class Unavailable(KvgraftError):
    """The daemon cannot be reached or is shutting down."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KvgraftError):
    """The call ran past its deadline."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(KvgraftError):
    """The call was cancelled."""

    code = "CANCELLED"


class Internal(KvgraftError):
    """A bug in kvgraft: please report it with the daemon's log."""

    code = "INTERNAL"


ERRORS_BY_CODE: dict[str, type[KvgraftError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        DataLoss,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Unimplemented,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}
