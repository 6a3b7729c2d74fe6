"""The remote tier's place in the daemon: built from the config, its RPCs, its figures.

`RemoteService.open(config, store)` is what the composition root calls. With
no [remote] bucket it returns a disabled service whose views are the store
itself, so the rest of the daemon has one code path. Otherwise it builds the
RemoteTier (kvgraftd.remote.tier), checks the bucket and the credentials at once
(bad credentials or a missing bucket stop the daemon with a message that
says what to fix; an unreachable server only logs, and local serving goes
on), and in write-back mode starts the queue's drain thread.

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
    from kvgraftd.remote.push_queue import WriteBackQueue
    from kvgraftd.remote.tier import RemoteTier

log = logging.getLogger(__name__)

LIST_BATCH = 1000


class RemoteService:
    def __init__(
        self,
        store: Store,
        trust: TrustPolicy,
        remote: RemoteTier | None = None,
        queue: WriteBackQueue | None = None,
    ) -> None:
        self._store = store
        self._trust = trust
        self.remote = remote
        self.queue = queue

    @classmethod
    def open(cls, config: DaemonConfig, store: Store, trust: TrustPolicy) -> RemoteService:
        if not config.remote_bucket:
            return cls(store, trust)
        from kvgraftd.remote.push_queue import WriteBackQueue
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
        reachable = remote.check()  # raises on bad credentials or a missing bucket
        queue = None
        if settings.write == "back":
            queue = WriteBackQueue(
                config.data / "remote-queue", lambda aid: push_artifact(store, remote, aid)
            )
            queue.start()
            store.evictor.keep = lambda aid: queue.holds(aid.hex())  # uploaded first
        log.info(
            "remote tier: bucket %s at %s, prefix %s, write-%s%s%s",
            settings.bucket,
            settings.endpoint or "AWS S3",
            settings.prefix,
            settings.write,
            "" if reachable else " (unreachable for now: reads are misses meanwhile)",
            f", {queue.backlog()} artifacts queued" if queue is not None else "",
        )
        return cls(store, trust, remote, queue)

    def view(self, store: Store, *, read_through: bool):
        """The store as a component should see it (the store itself when disabled)."""
        if self.remote is None:
            return store
        from kvgraftd.remote.backed_store import RemoteBackedStore

        enqueue = self.queue.add if self.queue is not None else None
        return RemoteBackedStore(
            store, self.remote, self._trust, read_through=read_through, enqueue=enqueue
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
            reachable=remote.breaker.available(),
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
                try:
                    moved.add(push_artifact(self._store, remote, artifact_id))
                except NotFound:
                    pass  # deleted meanwhile
                except KvgraftError as exc:
                    response.failures.append(f"push {artifact_id}: {exc}")
                    if not remote.breaker.available():
                        return  # the server went away: the rest would fail the same way
                    continue
                if self.queue is not None:
                    self.queue.discard(artifact_id)
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
