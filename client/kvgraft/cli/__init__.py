"""The `kvgraft` command line: one module per group of commands, `main` the entry point.

May import everything in kvgraft. Importing it quiets gRPC's C-core logging, so no
line of gRPC's own reaches the terminal (a TLS file it cannot load, a handshake that
failed): the command line says what happened in its own words
(kvgraft.client.failures). A GRPC_VERBOSITY set by the user still wins, to debug.
"""

import os

# gRPC reads GRPC_VERBOSITY once, when it is imported: set it for that moment only, so
# processes started from here (`kvgraft serve` runs the daemon) keep their own logging.
_ASKED_VERBOSITY = os.environ.get("GRPC_VERBOSITY")
os.environ["GRPC_VERBOSITY"] = _ASKED_VERBOSITY or "NONE"
import grpc  # noqa: E402, F401

if _ASKED_VERBOSITY is None:
    del os.environ["GRPC_VERBOSITY"]
