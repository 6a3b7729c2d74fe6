"""One-shot pulls into this daemon: the Replicate RPC (`kvgraft replicate --pull`).

A caller names a source daemon; this daemon copies from it what it holds,
deletes too, with kvgraft.replication.replicator.Replicator, exactly as a follower
(kvgraftd.replication.follower) does but once: the source's gRPC API on one side, this
daemon's own intake (LocalTarget) on the other. The bytes go from the source
to this daemon and nowhere else, so a replication started from a laptop does
not carry the store through the laptop, and the machine pays one gRPC hop
instead of two.

Contract:
* `replicate(request, is_active)` yields a ReplicateProgress about every
  PROGRESS_INTERVAL_S while the pass runs, then one with `done` and the final
  summary. The pass is idempotent and resumable like any replication: what was
  committed stays, a retry moves only what is missing.
* The source is host:port or a gRPC target such as unix:PATH
  (kvgraft.replication.addresses; else INVALID_ARGUMENT), the address as this daemon
  reaches it, and one the operator allows (`[replication] pull_from`, "*" for any, and
  the follow peers): any other is FAILED_PRECONDITION.
  One it cannot reach fails with UNAVAILABLE, saying so.
* Credentials go only where the operator sent them. A source the configuration
  names is reached like a follower's peer: TLS, the client certificate and the
  bearer token of KVGRAFT_TLS_* and KVGRAFT_TOKEN_FILE in this daemon's
  environment. A source allowed only by "*" is one the caller chose: it is reached
  with the same TLS but neither the token nor the client certificate, so "*" never
  sends the operator's credentials to a host a caller names. Such a source that asks
  for credentials (UNAUTHENTICATED) is FAILED_PRECONDITION saying to name it in
  pull_from (Client.replicate_to then relays through the caller).
* A caller that goes away ends the pass: no retry starts and the source
  connection is closed; artifacts committed so far stay. `stop` ends every
  pass in progress and waits for them (main calls it before the store closes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvgraft import Client
from kvgraft.client.channel import Security
from kvgraft.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from kvgraft.replication.addresses import TARGETS, address_problem
from kvgraft.replication.replicator import Replicator
from kvgraft.replication.summary import ReplicationSummary
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.replication.follower import LocalTarget

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5


class ByteProgress:
    """The replicator's progress bar (tqdm's `total` and `update`), read from another thread."""

    def __init__(self) -> None:
        self.total = 0
        self.done = 0

    def update(self, n: int) -> None:
        self.done += n  # the replicator's ledger calls this under its lock


def connect_to_source(source: str, named: bool) -> Client:
    """A client of `source`, with this daemon's credentials only when its configuration
    names the source (`named`)."""
    if named:
        return Client(source)  # the KVGRAFT_* environment: the operator's credentials
    return Client(source, **Security.anonymous().client_options())


class Pulls:
    def __init__(
        self,
        target: LocalTarget,
        allowed: Iterable[str],
        instance_id: str,
        connect: Callable[[str, bool], Client] = connect_to_source,
    ) -> None:
        self._target = target
        self._named = frozenset(allowed) - {"*"}
        self._any_source = "*" in allowed
        self._instance_id = instance_id
        self._connect = connect
        self._lock = threading.Lock()
        self._stopping = False
        self._running: dict[Future, Callable[[], None]] = {}  # pass -> its end

    def stop(self, timeout_s: float) -> None:
        with self._lock:
            self._stopping = True
            running = dict(self._running)
        for end in running.values():
            end()
        wait(running, timeout_s)

    def replicate(
        self, request: pb.ReplicateRequest, is_active: Callable[[], bool]
    ) -> Iterator[pb.ReplicateProgress]:
        source = request.source.strip()
        if problem := address_problem(source):
            raise InvalidArgument(
                f"Replicate needs the source as host:port or {TARGETS} ({problem}: got "
                f"{request.source!r}), the address at which this daemon reaches it, e.g. "
                "10.0.0.5:50051"
            )
        named = source in self._named
        if not named and not self._any_source:
            raise FailedPrecondition(
                f"this daemon copies only from sources its operator allows, and {source} is "
                "not one: add it to [replication] pull_from in the daemon's config (or "
                "--replication-pull-from) and restart it, or replicate through the caller "
                "(without --pull)"
            )
        progress = ByteProgress()
        with (
            self._connect(source, named) as client,
            ThreadPoolExecutor(1, thread_name_prefix="pull") as pool,
        ):
            try:
                source_instance = client.info().instance_id
            except Unavailable as exc:
                raise _unreachable(source, exc, named) from None
            except Unauthenticated:
                raise _unauthenticated(source, named) from None
            if source_instance == self._instance_id:
                raise FailedPrecondition(
                    f"the source {source} is this daemon itself: pull from another daemon"
                )
            target = self._target.from_source(source)
            replicator = Replicator(client, target, progress=progress)

            def end() -> None:
                replicator.stop()
                client.close()

            with self._lock:
                if self._stopping:
                    raise Unavailable("this daemon is shutting down: pull again once it is back")
                copying = pool.submit(replicator.sync, max(1, request.from_sequence))
                self._running[copying] = end
            log.info("pulling from %s (a Replicate call)", source)
            try:
                while not wait([copying], PROGRESS_INTERVAL_S).done:
                    if not is_active():
                        return  # (through the finally below)
                    yield _progress(progress, replicator.snapshot(), done=False)
            finally:  # the caller went away, or the daemon stops: end the pass
                if not copying.done():
                    end()
                    wait([copying])
                    log.info("the pull from %s ended early: its caller went away", source)
                with self._lock:
                    del self._running[copying]
        error = copying.exception()
        if self._stopping:  # the pass was ended under it, whatever it returned
            raise Unavailable(
                f"this daemon is shutting down: the pull from {source} stopped; what it copied "
                "stays, run it again once the daemon is back"
            )
        if isinstance(error, Unavailable) and f"at {source}" in str(error):
            raise _unreachable(source, error, named) from None
        result = copying.result()  # raises any other error of the pass
        log.info("pulled from %s: %d artifacts added", source, result.artifacts_added)
        yield _progress(progress, result, done=True)


def _unauthenticated(source: str, named: bool) -> FailedPrecondition:
    """The source refused this daemon (not the caller: UNAUTHENTICATED would say so)."""
    if named:
        return FailedPrecondition(
            f"the source {source} refused this daemon's credentials: check the token and "
            "client certificate in its KVGRAFT_* environment against the source's"
        )
    return FailedPrecondition(
        f"the source {source} asks for credentials, and this daemon sends its own only to "
        "sources its configuration names (pull_from = * names none): add it to "
        "[replication] pull_from and restart the daemon, or replicate through the caller "
        "(without --pull)"
    )


def _unreachable(source: str, error: Exception, named: bool) -> Unavailable:
    # a source that wants a client certificate fails the TLS handshake without one
    sent = "" if named else " (allowed by * only, it was sent no client certificate)"
    return Unavailable(
        f"this daemon could not reach the source {source}{sent} ({error}); give the source "
        "as this daemon reaches it, or replicate through the caller (without --pull)"
    )


def _progress(progress: ByteProgress, summary: ReplicationSummary, done: bool):
    return pb.ReplicateProgress(
        bytes_planned=progress.total,
        bytes_done=progress.done,
        done=done,
        summary=summary.to_proto(),
    )
