"""kvgraft: byte-exact, content-addressed KV-cache artifacts.

The client library: `Client` talks to a kvgraftd daemon (`final_result` takes the
result out of a generate or graft stream); `Artifact` is a
manifest plus its pages; `kvgraft.errors` is the error taxonomy; the `kvgraft`
command line lives in `kvgraft.cli`.
"""

__version__ = "0.1.0"

from kvgraft.artifact import Artifact
from kvgraft.client import Client
from kvgraft.engine_calls import final_result
from kvgraft.errors import KvgraftError

__all__ = ["Artifact", "Client", "KvgraftError", "__version__", "final_result"]
