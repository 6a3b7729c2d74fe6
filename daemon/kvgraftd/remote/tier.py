"""The remote tier: pages, manifests and chain entries as objects of an S3 bucket.

A fleet of daemons that outgrows one machine shares one bucket of an existing
S3 server (Ceph RGW, AWS S3, SeaweedFS, ...), never a home-made cluster.
Content addressing maps straight onto object keys, one prefix per model
fingerprint:

    PREFIX/FINGERPRINT/pages/SHA256       the page's bytes
    PREFIX/FINGERPRINT/manifests/ID       the artifact's canonical manifest bytes
    PREFIX/FINGERPRINT/chains/CHAINKEY    the id (hex) of an artifact holding that whole page

(all hex). Pages and manifests are written with `If-None-Match: *` (a
conditional put: a second writer of the same hash gets 412 and that is a
success) and `x-amz-checksum-sha256` (the server refuses bytes damaged on
the way up; it is the object's own key, so it costs nothing to compute).
Chain objects are hints, overwritten freely: whatever they name is verified.

Nothing read from the bucket is trusted: a page is used only if its bytes
hash to its key, a manifest only if it hashes to its id (kvgraftd.remote.backed_store
then checks that it really holds the chain key asked for). An object that
fails is logged as DATA_LOSS, counted, and read as a miss; never served.

Faults: every request has connect/read timeouts (`timeout_s`); background
transfers (the write-back drain, a sync) keep botocore's retries, the calls a
local request waits on make one attempt (`on_request_path`). A failure opens
the breaker (kvgraftd.remote.health: reads are misses, a probe of its own finds
the server back; logged once per outage). Background writes are always
attempted and fail with Unavailable.
Credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_SHARED_CREDENTIALS_FILE,
AWS_PROFILE); they are never logged, and botocore's own loggers are held at
WARNING so its debug output (request headers) never reaches the daemon log.

kvgraftd.remote.s3 makes the boto3 client, kvgraftd.remote.health keeps the
counters and the breaker. None knows anything of LMDB or gRPC.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from google.protobuf.message import DecodeError

from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.remote.health import Breaker, RemoteCounters
from kvgraftd.remote.s3 import (
    EXISTS,
    MISSING,
    RemoteSettings,
    check_refusal,
    error_code,
    make_client,
    write_error,
)

log = logging.getLogger(__name__)

KNOWN_PAGES = 1 << 18  # page hashes remembered as present in the bucket


class RemoteTier:
    def __init__(self, settings: RemoteSettings, client=None) -> None:
        self.settings = settings
        self.counters = RemoteCounters()
        self._s3 = client if client is not None else make_client(settings)
        # one attempt: probes, and the calls local requests wait on (`on_request_path`)
        self._s3_once = client if client is not None else make_client(settings, attempts=1)
        self._bucket = settings.bucket
        self._prefix = settings.prefix.strip("/")
        self._pool = ThreadPoolExecutor(settings.connections, thread_name_prefix="remote")
        self._lock = threading.Lock()
        where = f"{self._bucket} at {settings.endpoint or 'AWS S3'}"
        self.breaker = Breaker(self.counters, where, self.check)
        self._known: OrderedDict[bytes, None] = OrderedDict()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def on_request_path(self) -> RemoteTier:
        """The same tier (counters, breaker, pool, known pages) for the calls a local request
        waits on: each S3 request is made once, so it takes at most `timeout_s`."""
        twin = copy.copy(self)  # shallow: everything shared but the client
        twin._s3 = self._s3_once
        return twin

    # ------------------------------------------------------------------
    # keys

    def key(self, fingerprint: bytes, kind: str, name: bytes | str) -> str:
        text = name.hex() if isinstance(name, bytes) else name
        return f"{self._prefix}/{fingerprint.hex()}/{kind}/{text}"

    # ------------------------------------------------------------------
    # health

    def check(self) -> bool:
        """Ask the bucket once (a one-key listing, one attempt): True if it answers, False
        (the breaker told) if it cannot be reached; raises on bad credentials or no bucket.
        The breaker's probe, and a sync's first step."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._s3_once.list_objects_v2(Bucket=self._bucket, Prefix=self._prefix + "/", MaxKeys=1)
        except ClientError as exc:
            refused = check_refusal(exc, self.settings)
            if refused is not None:
                raise refused from None
            self.breaker.failed("check", exc)
            return False
        except BotoCoreError as exc:
            self.breaker.failed("check", exc)
            return False
        self.breaker.succeeded()
        return True

    def _remember(self, digest: bytes) -> None:
        with self._lock:
            self._known[digest] = None
            self._known.move_to_end(digest)
            while len(self._known) > KNOWN_PAGES:
                self._known.popitem(last=False)

    def known(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._known

    # ------------------------------------------------------------------
    # reads: None is a miss (absent, unreachable or corrupt), never an exception

    def _get(self, key: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        if not self.breaker.available():
            self.counters.add(misses=1)
            return None
        try:
            body = self._s3.get_object(Bucket=self._bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if error_code(exc) in MISSING:
                self.breaker.succeeded()
                self.counters.add(misses=1)
                return None
            self.breaker.failed(f"GET {key}", exc)
            self.counters.add(misses=1)
            return None
        except BotoCoreError as exc:
            self.breaker.failed(f"GET {key}", exc)
            self.counters.add(misses=1)
            return None
        self.breaker.succeeded()
        return body

    def _corrupt(self, key: str, actual: bytes) -> None:
        self.counters.add(corrupt=1, misses=1)
        log.error(
            "event=remote_data_loss key=%s actual_sha256=%s: the object's bytes do not hash to "
            "its name; it was not used (the next deposit of the same content rewrites it)",
            key,
            actual.hex(),
        )

    def get_page(self, fingerprint: bytes, digest: bytes) -> bytes | None:
        key = self.key(fingerprint, "pages", digest)
        data = self._get(key)
        if data is None:
            self.counters.add(page_misses=1)
            return None
        actual = hashlib.sha256(data).digest()
        if actual != digest:
            self._corrupt(key, actual)
            self.counters.add(page_misses=1)
            return None
        self.counters.add(hits=1, pages_down=1, bytes_down=len(data))
        self._remember(digest)
        return data

    def get_pages(
        self, fingerprint: bytes, digests: Sequence[bytes], timeout_s: float | None = None
    ) -> dict[bytes, bytes]:
        """The pages that could be fetched and verified within `timeout_s` (the rest are misses)."""
        futures = {self._pool.submit(self.get_page, fingerprint, d): d for d in digests}
        done, pending = wait(futures, timeout=timeout_s)
        for future in pending:
            future.cancel()
        return {
            futures[f]: f.result() for f in done if not f.cancelled() and f.result() is not None
        }

    def get_manifest(self, fingerprint: bytes, artifact_id: str) -> bytes | None:
        """The canonical manifest bytes of `artifact_id`, verified against the id."""
        key = self.key(fingerprint, "manifests", artifact_id)
        data = self._get(key)
        if data is None:
            return None
        actual = hashlib.sha256(data).digest()
        if actual.hex() != artifact_id:
            self._corrupt(key, actual)
            return None
        self.counters.add(hits=1)
        return data

    def get_signatures(self, fingerprint: bytes, artifact_id: str) -> list[pb.ArtifactSignature]:
        """The signatures kept for an artifact (none when absent or unreadable; the caller
        checks each against the id and its trusted keys)."""
        key = self.key(fingerprint, "signatures", artifact_id)
        data = self._get(key)
        if data is None:
            return []
        try:
            return list(pb.Provenance.FromString(data).signatures)
        except DecodeError:
            self._corrupt(key, hashlib.sha256(data).digest())
            return []

    def get_chain(self, fingerprint: bytes, chain_key: bytes) -> str | None:
        """The artifact id a chain object names (a hint: the caller verifies it)."""
        data = self._get(self.key(fingerprint, "chains", chain_key))
        if data is None:
            return None
        text = data.decode("ascii", "replace").strip()
        if len(text) != 64 or text.strip("0123456789abcdef"):
            self._corrupt(self.key(fingerprint, "chains", chain_key), hashlib.sha256(data).digest())
            return None
        self.counters.add(hits=1)
        return text

    # ------------------------------------------------------------------
    # writes: raise Unavailable (or Unauthenticated) when the object could not be written

    def _request(self, what: str, key: str, call, answered: tuple[str, ...]) -> bool:
        """Run one S3 request of an explicit operation: True if it succeeded, False if
        it failed with an error code in `answered` (an answer, not a fault); any other
        failure opens the breaker and raises (write_error)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            call()
        except ClientError as exc:
            if error_code(exc) in answered:
                self.breaker.succeeded()
                return False
            self.breaker.failed(f"{what} {key}", exc)
            raise write_error(key, exc) from None
        except BotoCoreError as exc:
            self.breaker.failed(f"{what} {key}", exc)
            raise write_error(key, exc) from None
        self.breaker.succeeded()
        return True

    def _put(self, key: str, body: bytes | memoryview, digest: bytes, conditional: bool) -> bool:
        """Write one object; False if it was there already (conditional puts only)."""
        extra = {"IfNoneMatch": "*"} if conditional else {}
        return self._request(
            "PUT",
            key,
            lambda: self._s3.put_object(
                Bucket=self._bucket,
                Key=key,
                Body=bytes(body) if isinstance(body, memoryview) else body,
                ChecksumSHA256=base64.b64encode(digest).decode("ascii"),
                **extra,
            ),
            EXISTS if conditional else (),
        )

    def put_page(self, fingerprint: bytes, digest: bytes, data: bytes | memoryview) -> int:
        """Upload a page unless known present; the bytes written (0 if it was there)."""
        if self.known(digest):
            return 0
        written = self._put(self.key(fingerprint, "pages", digest), data, digest, True)
        self._remember(digest)
        if not written:
            return 0
        self.counters.add(pages_up=1, bytes_up=len(data))
        return len(data)

    def put_pages(self, fingerprint: bytes, pages: Iterable[tuple[bytes, object]]) -> list[int]:
        """Upload pages in parallel; `pages` yields (digest, bytes or a callable giving them).

        At most 2 x `connections` pages are read ahead of the uploads, so
        memory stays bounded whatever the artifact's size. The first failure
        is raised once the uploads in flight have ended.
        """
        results: list[int] = []
        window = 2 * self.settings.connections
        inflight: set[Future] = set()

        def one(digest: bytes, source) -> int:
            if self.known(digest):
                return 0
            return self.put_page(fingerprint, digest, source() if callable(source) else source)

        try:
            for digest, source in pages:
                if len(inflight) >= window:
                    done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                    results += _results(done)
                inflight.add(self._pool.submit(one, digest, source))
            done, inflight = wait(inflight)
            results += _results(done)
        except BaseException:
            for future in inflight:
                future.cancel()
            wait(inflight)
            raise
        return results

    def put_manifest(self, fingerprint: bytes, artifact_id: str, canonical: bytes) -> bool:
        digest = bytes.fromhex(artifact_id)
        return self._put(self.key(fingerprint, "manifests", artifact_id), canonical, digest, True)

    def put_signatures(
        self, fingerprint: bytes, artifact_id: str, signatures: Iterable[pb.ArtifactSignature]
    ) -> None:
        """Keep an artifact's signatures (one object, rewritten as signatures are added)."""
        body = pb.Provenance(signatures=signatures).SerializeToString(deterministic=True)
        key = self.key(fingerprint, "signatures", artifact_id)
        self._put(key, body, hashlib.sha256(body).digest(), False)

    def put_chains(self, fingerprint: bytes, chain_keys: Iterable[bytes], artifact_id: str) -> None:
        """Point chain keys at an artifact whose pages are all uploaded (last writer wins)."""
        body = artifact_id.encode("ascii")
        digest = hashlib.sha256(body).digest()
        futures = [
            self._pool.submit(self._put, self.key(fingerprint, "chains", k), body, digest, False)
            for k in chain_keys
        ]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for future in pending:
                future.cancel()
            wait(pending)
            raise failed.exception()

    def has_manifest(self, fingerprint: bytes, artifact_id: str) -> bool:
        """Whether the bucket holds the manifest (raises Unavailable when it cannot tell)."""
        key = self.key(fingerprint, "manifests", artifact_id)
        return self._request(
            "HEAD", key, lambda: self._s3.head_object(Bucket=self._bucket, Key=key), MISSING
        )

    # ------------------------------------------------------------------
    # listing (sync)

    def _list(self, prefix: str, delimiter: str = "") -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=prefix, **({"Delimiter": delimiter} if delimiter else {})
        )
        try:
            for page in pages:
                for common in page.get("CommonPrefixes", ()):
                    yield common["Prefix"][len(prefix) :].rstrip("/")
                for item in page.get("Contents", ()):
                    yield item["Key"][len(prefix) :]
        except (ClientError, BotoCoreError) as exc:
            self.breaker.failed(f"LIST {prefix}", exc)
            raise write_error(prefix, exc) from None
        self.breaker.succeeded()

    def fingerprints(self) -> list[bytes]:
        """The model fingerprints that have objects under the prefix."""
        out = []
        for name in self._list(self._prefix + "/", delimiter="/"):
            try:
                out.append(bytes.fromhex(name))
            except ValueError:
                continue  # not ours
        return out

    def manifest_ids(self, fingerprint: bytes, id_prefix: str = "") -> Iterator[str]:
        prefix = f"{self._prefix}/{fingerprint.hex()}/manifests/"
        for name in self._list(prefix + id_prefix):
            full = id_prefix + name
            if len(full) == 64 and not full.strip("0123456789abcdef"):
                yield full


def _results(done: Iterable[Future]) -> list:
    """The results of finished futures; the first failure is raised."""
    for future in done:
        if future.exception() is not None:
            raise future.exception()
    return [future.result() for future in done]
