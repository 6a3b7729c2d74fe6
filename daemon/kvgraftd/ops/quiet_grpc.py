"""gRPC's C core kept off stderr unless asked for: import this before anything imports grpc.

The C core logs failures in its own format beside the daemon's log ("E1203 17:59:21.020476
17957 add_port.cc:83] Failed to add port to server: ..."), about things the daemon reports
in its own words (a port in use, a client's failed TLS handshake). It reads GRPC_VERBOSITY
once, when grpc loads, so the default is set at import time; a GRPC_VERBOSITY in the
environment (debug, info, error) is kept: that is how to see those lines again.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "NONE")
