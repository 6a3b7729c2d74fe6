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

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_start = threading.Lock()
_thread: threading.Thread | None = None


def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread (directly, when already on it)."""
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    future: Future[T] = Future()
    _jobs.put((future, fn, args, kwargs))
    _ensure_started()
    return future.result()


def _ensure_started() -> None:
    # A daemon thread, like the model-load thread before it: a daemon stopping
    # while a model still loads exits without waiting for the load.
    global _thread
    with _start:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="compute", daemon=True)
            _thread.start()


def _serve() -> None:
    while True:
        future, fn, args, kwargs = _jobs.get()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # raised again in the caller's thread
            future.set_exception(error)
