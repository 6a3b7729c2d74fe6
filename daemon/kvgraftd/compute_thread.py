"""One thread for the engine's torch work, whichever thread asks for it.

torch on CPU runs its parallel kernels on OpenMP, and OpenMP gives every
thread that enters a parallel region its own team of workers. The daemon
serves requests on many gRPC threads; if each ran its own forward passes the
process would hold several teams whose idle workers spin on the same cores.
Measured on the 2-core machine with the default model: a prompt of 512
tokens took 1.6-2.0 s on the thread that loaded the model and 2.9-4.2 s on
any other thread; with the model loaded and every forward run on one thread,
1.9-2.1 s. So the model is loaded, and every forward pass and token choice
runs, here: `run(fn, ...)` calls fn on the compute thread and returns its
result (or raises its exception) to the caller, whose thread only waits.

Calls are served one at a time, in the order they arrive: requests
interleave forward by forward, as they would under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_on_compute_thread = threading.local()


def _mark() -> None:
    _on_compute_thread.yes = True


_executor = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=_mark)


def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread (directly, when already on it)."""
    if getattr(_on_compute_thread, "yes", False):
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()
