"""Denials of service found by an adversarial probe of a running daemon, one test each.

Every case was reproduced against the daemon before its fix: a message that took
minutes of CPU to decode, uploads that grew memory or disk without bound, a
recompute that ignored the daemon's context limit, a sampling temperature that
made the daemon answer INTERNAL. Each test sends the hostile input to a real
daemon in its own process (or the engine, where the limit lives there) and checks
the clear refusal, that the daemon keeps answering, and that nothing else changed.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvgraft import Client, wire
from kvgraft.bundle import write_bundle
from kvgraft.errors import (
    Cancelled,
    DataLoss,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraft.v1 import kvgraft_pb2_grpc as pb_grpc
from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.decoding import DecodeOptions
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.store.artifact_store import Store
from kvgraftd.testing.daemon_process import wait_model_ready
from kvgraftd.testing.s3_server import s3_env
from tests.support.factory import random_artifact

PUT_METHOD = "/kvgraft.v1.Kvgraft/PutArtifact"
CODE = grpc.StatusCode


def raw_put(address: str, messages: Iterable[bytes], timeout_s: float = 60) -> grpc.RpcError:
    """Send hand-made PutArtifact messages; the error the daemon answered."""
    with grpc.insecure_channel(address) as channel:
        put = channel.stream_unary(
            PUT_METHOD,
            request_serializer=None,
            response_deserializer=pb.PutArtifactResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            put(iter(messages), timeout=timeout_s)
    return caught.value


def partial_pages(count: int, announced: int, sent: int) -> Iterator[bytes]:
    """Messages each starting a page of `announced` bytes with `sent` bytes, never finished."""
    for index in range(count):
        digest = hashlib.sha256(b"never finished %d" % index).digest()
        chunk = wire.Chunk(digest, 0, announced, bytes(sent))
        yield wire.encode_page_block(wire.PUT_PAGES, [chunk])


def test_a_message_of_empty_chunks_is_refused_at_once(start_daemon) -> None:
    """Was: one 1.28 MB message of empty page chunks kept a core busy ~4.5 minutes (the
    blocks were concatenated, O(n^2)); now decoding is linear and an empty chunk is refused."""
    daemon = start_daemon()
    hostile = b"\x0a\x02\x0a\x00" * 320_000
    started = time.monotonic()
    error = raw_put(daemon.address, [hostile], timeout_s=120)
    assert error.code() == CODE.INVALID_ARGUMENT, error.details()
    assert "carries no bytes" in error.details()
    # and the same number of blocks each holding a one-byte chunk, which decode: the
    # blocks were concatenated one by one (O(n^2)); now they are extended (O(n))
    chunk = wire.Chunk(bytes(32), 0, 1, b"x")
    blocks = wire.encode_page_block(wire.PUT_PAGES, [chunk]) * 90_000  # under 4 MiB
    error = raw_put(daemon.address, [blocks], timeout_s=120)
    assert error.code() == CODE.DATA_LOSS, error.details()  # its bytes hash to another name
    assert time.monotonic() - started < 60  # a functional bound: it was minutes
    with Client(daemon.address, timeout_s=5) as client:
        assert client.info().version  # and it answers


def test_pages_never_finished_cannot_grow_the_daemon(start_daemon) -> None:
    """Was: a stream announcing 64 MiB pages and never finishing them grew the daemon by
    1.1 GiB; now the bytes of unfinished pages are bounded by max(spill_bytes, 64 MiB)."""
    daemon = start_daemon(extra_args=["--spill-bytes", "1MiB"])
    error = raw_put(daemon.address, partial_pages(100, 64 << 20, 1 << 20))
    assert error.code() == CODE.RESOURCE_EXHAUSTED, error.details()
    assert "has not finished" in error.details() and "one after the other" in error.details()
    with Client(daemon.address, timeout_s=5) as client:
        stats = client.stats()
    assert stats.staged_pages == 0 and stats.page_bytes == 0  # nothing of it was kept


def test_tiny_staged_pages_cannot_fill_the_disk(start_daemon) -> None:
    """Was: 20,000 four-byte staged pages (0.9 MB sent) took 82 MB of segments for 24 h;
    now staged pages count whole blocks against staged_max_bytes."""
    daemon = start_daemon(extra_args=["--spill-bytes", "1MiB", "--staged-max-bytes", "4MiB"])

    def tiny_pages() -> Iterator[bytes]:
        for start in range(0, 20_000, 1000):
            chunks = [
                wire.Chunk(hashlib.sha256(page).digest(), 0, 4, page)
                for page in (index.to_bytes(4, "little") for index in range(start, start + 1000))
            ]
            yield wire.encode_page_block(wire.PUT_PAGES, chunks)

    error = raw_put(daemon.address, tiny_pages())
    assert error.code() == CODE.RESOURCE_EXHAUSTED, error.details()
    assert "staged_max_bytes" in error.details()
    with Client(daemon.address, timeout_s=5) as client:
        stats = client.stats()
        assert stats.staged_pages * 4096 <= 4 << 20  # within the bound, in whole blocks
        assert stats.segment_disk_bytes <= (4 << 20) + (1 << 20)
        artifact = random_artifact(random.Random(0))
        assert client.put_artifact(artifact).artifact_id == artifact.id  # still serves


def test_verify_keeps_the_context_limit(tmp_path: Path) -> None:
    """Was: Verify recomputed an artifact of any length, whatever max_context_tokens."""
    adapter = ModelAdapter.load("tiny:0", Path("/nonexistent"))
    store = Store(tmp_path / "store")
    try:
        roomy = Engine(adapter, store, page_tokens=8, block_tokens=32, max_context_tokens=512)
        *_, result = roomy.generate(list(range(3, 203)), DecodeOptions(deposit=True))
        strict = Engine(adapter, store, page_tokens=8, block_tokens=32, max_context_tokens=128)
        with pytest.raises(InvalidArgument, match="exceeds max_context_tokens=128"):
            strict.verify(result.artifact_id)
        assert roomy.verify(result.artifact_id).ok
    finally:
        store.close()


def test_extreme_temperatures_are_refused_not_internal(start_daemon) -> None:
    """Was: greedy=false, temperature=1e-38 answered INTERNAL (multinomial over inf/nan)."""
    daemon = start_daemon(extra_args=["--model", "tiny:0"])
    wait_model_ready(daemon.address)
    with Client(daemon.address, timeout_s=30) as client:
        for temperature in (1e-38, 1e-30, float("inf"), float("nan"), 1e30):
            with pytest.raises(InvalidArgument, match=r"temperature .* is outside"):
                client.generate(token_ids=[1, 2, 3], greedy=False, temperature=temperature)
        sampled = client.generate(token_ids=[1, 2, 3], greedy=False, temperature=0.7, seed=3)
        assert len(sampled.token_ids) == 32
        assert not [k for k in client.stats().rpc_calls if k.endswith(":INTERNAL")]


def _rewritten(bundle: bytes, edit) -> bytes:
    """The bundle with its JSON header replaced by edit(header text) (the body kept)."""
    size = int.from_bytes(bundle[:8], "little")
    header = edit(bundle[8 : 8 + size].decode().rstrip(" ")).encode()
    header += b" " * (-(8 + len(header)) % 8)
    return len(header).to_bytes(8, "little") + header + bundle[8 + size :]


def _edit_page(change):
    """An edit of the first page's header entry: change(entry) in place."""

    def edit(text: str) -> str:
        header = json.loads(text)
        first = next(key for key in header if key.startswith("kv."))
        change(header, first)
        return json.dumps(header)

    return edit


BAD_BUNDLES = {
    "offsets-short": _edit_page(lambda h, k: h[k].update(data_offsets=[0])),
    "offsets-text": _edit_page(lambda h, k: h[k].update(data_offsets="0,10")),
    "offsets-three": _edit_page(lambda h, k: h[k].update(data_offsets=[0, 1, 2])),
    "offsets-bool": _edit_page(lambda h, k: h[k].update(data_offsets=[False, True])),
    "offsets-negative": _edit_page(lambda h, k: h[k].update(data_offsets=[-8, 8])),
    "offsets-past-end": _edit_page(lambda h, k: h[k].update(data_offsets=[0, 1 << 40])),
    "wrong-dtype": _edit_page(lambda h, k: h[k].update(dtype="I64")),
    "wrong-shape": _edit_page(lambda h, k: h[k].update(shape=[1, 2, 3])),
    "extra-tensor": _edit_page(lambda h, k: h.update({"kv.extra": dict(h[k])})),
    "not-an-object": _edit_page(lambda h, k: h.update({k: [1, 2]})),
    "duplicate-name": lambda text: _repeat_first_page(text),
}


def _repeat_first_page(text: str) -> str:
    """The header with its first page's entry given twice (json would keep the last)."""
    first = next(key for key in json.loads(text) if key.startswith("kv."))
    return text[:-1] + f", {json.dumps(first)}: {json.dumps(json.loads(text)[first])}}}"


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_a_crafted_bundle_is_refused_with_a_json_error(start_daemon, tmp_path, case) -> None:
    """Was: crafted data_offsets gave a traceback; a wrong dtype or shape, extra tensors and
    duplicate names were imported without a word."""
    daemon = start_daemon()
    artifact = random_artifact(random.Random(case))
    good = tmp_path / "good.safetensors"
    write_bundle(artifact, good)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_rewritten(good.read_bytes(), BAD_BUNDLES[case]))
    result = subprocess.run(
        [sys.executable, "-m", "kvgraft", "--server", daemon.address, "--json", "import", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["code"] in ("INVALID_ARGUMENT", "DATA_LOSS"), error
    with Client(daemon.address) as client:
        assert client.stats().artifacts == 0
        assert client.import_bundle(good).artifact_id == artifact.id  # the real one imports


def test_idle_followers_do_not_lock_out_other_calls(start_daemon) -> None:
    """Was: 16 idle follow-Watch streams (the default `workers`) made Info, Stats and List
    miss their deadlines while health said SERVING; 64 made every call RESOURCE_EXHAUSTED.
    Long-lived streams now take no worker and have a limit of their own."""
    daemon = start_daemon(extra_args=["--max-follow-streams", "20"])
    artifact = random_artifact(random.Random(1))
    with Client(daemon.address, timeout_s=5) as client:
        client.put_artifact(artifact)
        streams = [client.watch(follow=True) for _ in range(20)]
        try:
            for stream in streams:  # each one established: it delivered the feed so far
                assert next(stream).artifact_id == artifact.id
            for _ in range(3):
                assert client.info().version and client.stats().artifacts == 1
                assert [i.artifact_id for i in client.list_artifacts()] == [artifact.id]
            with pytest.raises(ResourceExhausted, match="max_follow_streams"):
                next(client.watch(follow=True))
            again = random_artifact(random.Random(2))
            assert client.put_artifact(again).artifact_id == again.id
            assert next(streams[0]).artifact_id == again.id  # and they still follow
        finally:
            for stream in streams:
                stream.cancel()


class HungServer:
    """A TCP server on loopback that accepts connections and never answers (a hung S3)."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self._held.append(connection)

    def close(self) -> None:
        self._socket.close()
        for connection in self._held:
            connection.close()


@pytest.fixture
def hung_s3():
    server = HungServer()
    yield server
    server.close()


def test_a_hung_s3_endpoint_never_stalls_local_serving(start_daemon, hung_s3) -> None:
    """Was: the daemon exited at start with an AttributeError (`exc.response` is None), and
    at run time Deposit, Generate, Lookup and RemoteSync answered INTERNAL after ~12 s."""
    daemon = start_daemon(
        extra_args=[
            *("--model", "tiny:0", "--page-tokens", "16", "--block-tokens", "64"),
            *("--remote-endpoint", f"http://127.0.0.1:{hung_s3.port}"),
            *("--remote-bucket", "kvgraft", "--remote-timeout-s", "1"),
        ],
        env=s3_env(),
    )
    wait_model_ready(daemon.address)
    with Client(daemon.address, timeout_s=60, transfer_timeout_s=120) as client:
        prompt = list(range(5, 45))
        with pytest.raises(Unavailable, match="stored locally"):
            client.deposit(token_ids=prompt)
        assert client.stats().artifacts == 1  # it was: the caller is told so
        grafted = client.generate(token_ids=[*prompt, 7], max_new_tokens=2)
        # the local pages (their tail too, on row-invariant products), whatever the bucket does
        local = 40 if grafted.receipt.raw.profile.products else 32
        assert grafted.reused_tokens == local
        assert client.lookup(prompt).matched_tokens == local
        with pytest.raises(Unavailable):
            client.remote_sync()
        assert client.remote_status().last_error
        assert not [k for k in client.stats().rpc_calls if k.endswith(":INTERNAL")]
    assert "Traceback" not in daemon.log()


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def test_idle_metrics_connections_are_bounded(start_daemon) -> None:
    """Was: the metrics port kept a thread for every idle connection, without bound."""
    daemon = start_daemon(extra_args=["--metrics-listen", "127.0.0.1:0"])
    url = daemon.metrics_url
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    assert b"kvgraft_store_artifacts" in urllib.request.urlopen(url, timeout=10).read()
    before = _threads(daemon.proc.pid)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        time.sleep(1)
        assert _threads(daemon.proc.pid) <= before + 16
        time.sleep(11)  # past the idle timeout: their threads are gone, the port serves
        assert b"kvgraft_store_artifacts" in urllib.request.urlopen(url, timeout=10).read()
        assert _threads(daemon.proc.pid) <= before + 1
    finally:
        for connection in idle:
            connection.close()
    assert "Traceback" not in daemon.log()  # was: a TimeoutError's for each idle connection


def test_a_call_on_a_closed_client_is_a_kvgraft_error(daemon) -> None:
    """Was: a pull whose caller left closed its client under the pass's threads, whose next
    call raised ValueError ("Cannot invoke RPC on closed channel"), a traceback in the log;
    now it is Cancelled, an error of the taxonomy every replication path handles."""
    client = Client(daemon.address)
    assert client.info().version
    client.close()
    with pytest.raises(Cancelled, match="closed under the call"):
        client.info()
    with pytest.raises(Cancelled):
        list(client.watch())


class LoopingSource(pb_grpc.KvgraftServicer):
    """A hostile replication source (a fake: the real daemon cannot misbehave so): its
    listing sends the same page with a next-page token for ever."""

    def __init__(self) -> None:
        ids = sorted(hashlib.sha256(b"%d" % i).hexdigest() for i in range(1000))
        self.page = pb.ListResponse(
            artifacts=[pb.ArtifactInfo(artifact_id=aid, page_bytes=1) for aid in ids],
            next_page_token="00" * 32,
        )
        self.pages_sent = 0

    def Info(self, request, context):
        return pb.InfoResponse(version="hostile", instance_id="not-the-target")

    def Stats(self, request, context):
        return pb.StatsResponse(last_sequence=0)

    def Watch(self, request, context):
        return iter(())

    def List(self, request, context):
        self.pages_sent += 1
        return self.page


def test_a_listing_that_never_ends_is_refused(start_daemon) -> None:
    """Was: a source paging List for ever grew a pulling daemon from 123 MiB to 2.1 GiB in
    60 s; now a listing must advance in id order, else the pull fails with DATA_LOSS."""
    source = LoopingSource()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_KvgraftServicer_to_server(source, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = start_daemon(extra_args=["--replication-pull-from", "*"])
        with Client(target.address, timeout_s=30) as client:
            with pytest.raises(DataLoss, match="does not advance"):
                client.pull_from(f"127.0.0.1:{port}")
            assert source.pages_sent <= 2 * 8  # each attempt stops at the second page
            assert client.stats().artifacts == 0 and client.info().version
    finally:
        server.stop(0)
