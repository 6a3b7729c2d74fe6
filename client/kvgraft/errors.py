"""The error taxonomy shared by the kvgraft client and daemon.

Each class names the gRPC status code it travels as (`code`, a string, so this
module needs no gRPC). The daemon maps raised errors to status codes in one
place (kvgraftd.server.grpc_server); the client maps status codes back to these classes in
one place (kvgraft.client.client). Messages say what happened and what to do.
"""

from __future__ import annotations


class KvgraftError(Exception):
    """Base of every kvgraft error."""

    code = "UNKNOWN"


class InvalidArgument(KvgraftError):
    """The request is malformed: fix the input and retry."""

    code = "INVALID_ARGUMENT"


class NotFound(KvgraftError):
    """No such artifact (or page)."""

    code = "NOT_FOUND"


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
        Unauthenticated,
        Unimplemented,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}
