"""The remote tier's place in the daemon: built from the config, its RPCs, its figures.

`RemoteService.open(config, store)` is what the composition root calls. With
no [remote] bucket it returns a disabled service whose views are the store
itself, so the rest of the daemon has one code path. Otherwise it builds the
RemoteTier (kvgraftd.remote.tier) and checks the bucket and the credentials
(the breaker's first probe), waiting for the answer at most START_CHECK_S:
bad credentials or a missing bucket, said by a server that answers, stop the
daemon with a message that says what to fix; a server that cannot be reached
or does not answer in time only logs, and local serving starts at once
(reads are misses and write-through uploads fail until the probe, still
under way, or a later one gets an answer). In write-back mode it starts the
queue's drain thread. Either way the store's evictor keeps what the bucket
does not hold yet (kvgraftd.remote.push_queue).

RPCs (independent of gRPC, like kvgraftd.store.service):
* RemoteStatus: configuration (never credentials), reachability, backlog,
  counters, the last error.
* RemoteSync: push drains the write-back queue, then uploads every local
  artifact whose manifest the bucket lacks; pull imports every artifact of
  the bucket (all model fingerprints under the prefix) this store lacks.
  Each artifact moves or fails on its own; failures are listed, one line each.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvgraft.errors import FailedPrecondition, KvgraftError, NotFound, Unavailable
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.signing import TrustPolicy

if TYPE_CHECKING:
    from kvgraftd.config import DaemonConfig
    from kvgraftd.remote.push_queue import PushesUnderWay, WriteBackQueue
    from kvgraftd.remote.tier import RemoteTier

log = logging.getLogger(__name__)

LIST_BATCH = 1000
# A server that answers at all answers a one-key listing in well under this; one that
# does not must not delay the start (its timeout may be long).
START_CHECK_S = 2.0
# What a write refused for room says of the artifacts the bucket does not hold yet
# (kvgraftd.store.eviction's `kept_because`), by write mode.
UPLOAD_PENDING = {
    "back": (
        "not yet uploaded to the remote tier, which has not taken them (`kvgraft remote "
        "status` says why; they can be evicted once uploaded)",
        "bring the remote tier back (`kvgraft remote sync` pushes them at once)",
    ),
    "through": (
        'being uploaded to the remote tier (write = "through")',
        "retry when their uploads have ended",
    ),
}


class RemoteService:
    def __init__(
        self,
        store: Store,
        trust: TrustPolicy,
        remote: RemoteTier | None = None,
        queue: WriteBackQueue | None = None,
        pushes: PushesUnderWay | None = None,
    ) -> None:
        self._store = store
        self._trust = trust
        self.remote = remote
        self.queue = queue
        self._pushes = pushes  # write-through's uploads under way

    @classmethod
    def open(cls, config: DaemonConfig, store: Store, trust: TrustPolicy) -> RemoteService:
        if not config.remote_bucket:
            return cls(store, trust)
        from kvgraftd.remote.push_queue import PushesUnderWay, WriteBackQueue
        from kvgraftd.remote.s3 import RemoteSettings
        from kvgraftd.remote.tier import RemoteTier
        from kvgraftd.remote.transfer import push_artifact

        settings = RemoteSettings(
            endpoint=config.remote_endpoint,
            bucket=config.remote_bucket,
            prefix=config.remote_prefix,
            write=config.remote_write,
            timeout_s=config.remote_timeout_s,
            connections=config.remote_connections,
        )
        remote = RemoteTier(settings)
        answered = _check_at_start(remote)  # raises on bad credentials or a missing bucket
        queue, pushes = None, None
        if settings.write == "back":
            queue = WriteBackQueue(
                config.data / "remote-queue", lambda aid: push_artifact(store, remote, aid)
            )
            store.evictor.keep = queue.holds  # uploaded first
            queue.start()
        else:
            pushes = PushesUnderWay()
            store.evictor.keep = pushes.holds
        store.evictor.kept_because = UPLOAD_PENDING[settings.write]
        if answered:
            reachability = ""
        elif answered is None:
            reachability = " (not answering yet: reads are misses until it does)"
        else:
            reachability = " (unreachable for now: reads are misses meanwhile)"
        log.info(
            "remote tier: bucket %s at %s, prefix %s, write-%s%s%s",
            settings.bucket,
            settings.endpoint or "AWS S3",
            settings.prefix,
            settings.write,
            reachability,
            f", {queue.backlog()} artifacts queued" if queue is not None else "",
        )
        return cls(store, trust, remote, queue, pushes)

    def view(self, store: Store, *, read_through: bool):
        """The store as a component should see it (the store itself when disabled)."""
        if self.remote is None:
            return store
        from kvgraftd.remote.backed_store import RemoteBackedStore

        return RemoteBackedStore(
            store,
            self.remote.on_request_path(),
            self._trust,
            read_through=read_through,
            uploads=self.queue if self.queue is not None else self._pushes,
        )

    def stop(self) -> None:
        """Stop the drain thread and the transfer pool (before the store closes)."""
        if self.queue is not None:
            self.queue.stop()
        if self.remote is not None:
            self.remote.close()

    # ------------------------------------------------------------------
    def _require(self) -> RemoteTier:
        if self.remote is None:
            raise FailedPrecondition(
                "this daemon has no remote tier: add a [remote] section (endpoint, bucket, "
                "prefix, write) to its config file, or --remote-bucket, and restart it"
            )
        return self.remote

    def status(self, request: pb.RemoteStatusRequest) -> pb.RemoteStatusResponse:
        remote = self.remote
        if remote is None:
            return pb.RemoteStatusResponse(enabled=False)
        c = remote.counters
        settings = remote.settings
        return pb.RemoteStatusResponse(
            enabled=True,
            endpoint=settings.endpoint,
            bucket=settings.bucket,
            prefix=settings.prefix,
            write_mode=settings.write,
            reachable=remote.breaker.closed,
            backlog_artifacts=self.queue.backlog() if self.queue is not None else 0,
            uploaded_artifacts=c.artifacts_up,
            uploaded_pages=c.pages_up,
            uploaded_bytes=c.bytes_up,
            downloaded_pages=c.pages_down,
            downloaded_bytes=c.bytes_down,
            hits=c.hits,
            misses=c.misses,
            corrupt_objects=c.corrupt,
            last_error=c.last_error,
            last_error_unix_ms=c.last_error_unix_ms,
            retry_in_s=remote.breaker.retry_in_s(),
        )

    def tier_infos(self) -> list[pb.TierInfo]:
        """The remote tier's line in Info and Stats (none when disabled)."""
        if self.remote is None:
            return []
        c = self.remote.counters
        return [
            pb.TierInfo(
                name="remote",
                hits=c.pages_down,  # pages it served (fetched and verified)
                misses=c.page_misses,
                bytes_streamed=c.bytes_down,
                backlog_artifacts=self.queue.backlog() if self.queue is not None else 0,
            )
        ]

    # ------------------------------------------------------------------
    def sync(self, request: pb.RemoteSyncRequest) -> pb.RemoteSyncResponse:
        from kvgraftd.remote.transfer import Moved

        remote = self._require()
        if not remote.check():  # an explicit sync tries now, whatever the backoff says
            raise Unavailable(
                f"the remote tier cannot be reached ({remote.counters.last_error}); nothing "
                "was synced: retry once its S3 server answers"
            )
        push, pull = request.push, request.pull
        if not push and not pull:
            push = pull = True
        response = pb.RemoteSyncResponse()
        pushed, pulled = Moved(), Moved()
        if push:
            if self.queue is not None:
                _, failures = self.queue.drain()
                response.failures.extend(failures)
            self._push_all(remote, pushed, response)
        if pull:
            self._pull_all(remote, pulled, response)
        response.pushed_artifacts = pushed.artifacts
        response.pushed_pages = pushed.pages
        response.pushed_bytes = pushed.bytes
        response.pulled_artifacts = pulled.artifacts
        response.pulled_pages = pulled.pages
        response.pulled_bytes = pulled.bytes
        response.in_both = pushed.already if push else pulled.already
        response.backlog_artifacts = self.queue.backlog() if self.queue is not None else 0
        return response

    def _push_all(self, remote: RemoteTier, moved, response: pb.RemoteSyncResponse) -> None:
        from kvgraftd.remote.transfer import push_artifact

        after = b""
        while True:
            batch = self._store.list_records(after, LIST_BATCH)
            if not batch:
                return
            for artifact_id, _ in batch:
                queued = self.queue.generation(artifact_id) if self.queue is not None else 0
                try:
                    moved.add(push_artifact(self._store, remote, artifact_id))
                except NotFound:
                    pass  # deleted meanwhile
                except KvgraftError as exc:
                    response.failures.append(f"push {artifact_id}: {exc}")
                    if not remote.breaker.available():
                        return  # the server went away: the rest would fail the same way
                    continue
                if queued:
                    self.queue.discard(artifact_id, queued)
            after = bytes.fromhex(batch[-1][0])

    def _pull_all(self, remote: RemoteTier, moved, response: pb.RemoteSyncResponse) -> None:
        from kvgraftd.remote.transfer import Moved, import_artifact

        for fingerprint in remote.fingerprints():
            for artifact_id in remote.manifest_ids(fingerprint):
                try:
                    self._store.resolve(artifact_id)
                    if not self._store.is_quarantined(artifact_id):
                        moved.add(Moved(already=1))
                        continue  # a quarantined one is pulled: its corrupt pages again
                except NotFound:
                    pass
                try:
                    moved.add(
                        import_artifact(self._store, remote, fingerprint, artifact_id, self._trust)
                    )
                except KvgraftError as exc:
                    response.failures.append(f"pull {artifact_id}: {exc}")
                    if not remote.breaker.available():
                        return


def _check_at_start(remote: RemoteTier) -> bool | None:
    """The first probe, waited for at most START_CHECK_S: True if the bucket answered,
    False if it failed, None if it has not answered yet (the probe goes on). Raises the
    probe's Unauthenticated or FailedPrecondition (bad credentials, no bucket)."""
    probe = remote.breaker.probe_now()
    probe.join(START_CHECK_S)
    if probe.is_alive():
        return None
    if isinstance(remote.breaker.probe_error, KvgraftError):
        raise remote.breaker.probe_error
    return remote.breaker.closed
