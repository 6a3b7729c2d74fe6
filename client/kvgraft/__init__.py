"""kvgraft: byte-exact, content-addressed KV-cache artifacts.

The client library: `Client` talks to a kvgraftd daemon; `Artifact` is a
manifest plus its pages; `kvgraft.errors` is the error taxonomy; the `kvgraft`
command line lives in `kvgraft.cli`.
"""

__version__ = "0.1.0"

from kvgraft.artifact import Artifact
from kvgraft.client import Client
from kvgraft.errors import KvgraftError

__all__ = ["Artifact", "Client", "KvgraftError", "__version__"]
