"""kvgraft: byte-exact, content-addressed KV-cache artifacts.

The client library: `Client` talks to a kvgraftd daemon; its engine calls return
the typed results of kvgraft.results (`GenerateResult`, `DepositResult`,
`AskResult`, `VerifyResult`, each with its `Receipt`); `Artifact` is a manifest
plus its pages; `kvgraft.errors` is the error taxonomy; the `kvgraft` command
line lives in `kvgraft.cli.main`.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

from kvgraft.artifact import Artifact
from kvgraft.errors import KvgraftError
from kvgraft.results import (
    AskResult,
    DepositResult,
    GenerateResult,
    GenerationStream,
    Progress,
    Receipt,
    Sampling,
    Token,
    TokenLogprob,
    VerifyResult,
)

if TYPE_CHECKING:  # for type checkers and editors; at run time, on first use (below)
    from kvgraft.client.client import Client

__all__ = [
    "Artifact",
    "AskResult",
    "Client",
    "DepositResult",
    "GenerateResult",
    "GenerationStream",
    "KvgraftError",
    "Progress",
    "Receipt",
    "Sampling",
    "Token",
    "TokenLogprob",
    "VerifyResult",
    "__version__",
]


def __getattr__(name: str):
    """`kvgraft.Client`, imported on first use: importing the package must not import
    grpc, so the command line (kvgraft.cli) can quiet gRPC's C-core logging first."""
    if name == "Client":
        from kvgraft.client.client import Client

        return Client
    raise AttributeError(f"module 'kvgraft' has no attribute {name!r}")
