"""One thread for the engine's compute, whichever thread asks for it.

torch on CPU runs its parallel kernels on OpenMP, and OpenMP gives every
thread that enters a parallel region its own team of workers. The daemon
serves requests on many gRPC threads; if each ran its own forward passes the
process would hold several teams whose idle workers spin on the same cores.
Measured on the 2-core machine with the default model: a prompt of 512
tokens took 1.6-2.0 s on the thread that loaded the model and 2.9-4.2 s on
any other thread; with the model loaded and every forward run on one thread,
1.9-2.1 s. So the model is loaded, and every forward pass and token choice
runs, on one `ComputeThread` that the engine owns: the batcher's step loop
(kvgraftd.engine.scheduling.batcher) runs on it, and `run(fn, ...)` calls fn there between
two steps and returns its result (or raises its exception) to the caller, whose
thread only waits.

Jobs are served one at a time, in the order they arrive: `run` waits for its
result, `post` does not (the batcher posts its loop, which serves the jobs that
arrive meanwhile with `run_pending` between its steps).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "compute") -> None:
        self._name = name
        self._jobs: deque[tuple[Future, Callable, tuple, dict]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def here(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.current_thread() is self._thread

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on this thread (directly, when already on it)."""
        if self.here():
            return fn(*args, **kwargs)
        return self.post(fn, *args, **kwargs).result()

    def post(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """fn(*args, **kwargs) on this thread, after the jobs before it; its future."""
        future: Future[T] = Future()
        with self._cond:
            self._jobs.append((future, fn, args, kwargs))
            if self._thread is None:
                # A daemon thread, like the model-load thread before it: a daemon stopping
                # while a model still loads exits without waiting for the load.
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def run_pending(self) -> None:
        """Run the jobs waiting now (on this thread: a long job lets the others in)."""
        assert self.here(), "run_pending is called on the compute thread"
        while True:
            with self._cond:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            _call(*job)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
            _call(*job)


def _call(future: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:  # raised again in the caller's thread
        future.set_exception(error)
