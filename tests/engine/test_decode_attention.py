"""Decode-step attention with the native kernel: accurate, a function of the values alone, and
never fed a corrupt page.

The kernel's results are compared with float64 attention (accuracy) and with
themselves as bytes (the same blocks from other strides, threads and orders,
and with or without the check). Corruption: a flipped byte in a page,
whether in K or V, is refused by the check; one flipped on disk is never
attended by a scan through the store, and leaves no slot pinned.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvgraft.artifact import FORMAT_VERSION
from kvgraft.errors import DataLoss
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.engine.attention.block_gather import GatheredContext
from kvgraftd.engine.attention.kv_context import KvContext
from kvgraftd.engine.attention.online_softmax import OnlineSoftmax, softmax_for
from kvgraftd.engine.attention.ordered_partials import OrderedPartials
from kvgraftd.engine.model import decode_attention
from kvgraftd.engine.model.decode_attention import (
    CorruptBlock,
    DecodeSoftmax,
    RowsSoftmax,
)
from kvgraftd.engine.model.geometry import ModelGeometry
from kvgraftd.engine.requests.receipts import compute_profile
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import page_records_of
from kvgraftd.tiers.device_pool import DevicePool
from kvgraftd.tiers.host_cache import HostCache
from kvgraftd.tiers.stack import Tiers
from tests.support import native_kernels
from tests.support.on_disk import flip_stored_page
from tests.support.protocols import mismatches

if not decode_attention.available():
    native_kernels.missing("the native attention kernel is not built")


def _inputs(heads: int, kv_heads: int, dim: int, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, 1, dim, generator=gen)
    keys = torch.randn(kv_heads, tokens, dim, generator=gen) * 2
    values = torch.randn(kv_heads, tokens, dim, generator=gen)
    return q, keys, values


def _slot(keys: torch.Tensor, values: torch.Tensor, capacity: int) -> torch.Tensor:
    kv_heads, tokens, dim = keys.shape
    slot = torch.full((2, kv_heads, capacity, dim), float("nan"))  # past `tokens`: never read
    slot[0, :, :tokens], slot[1, :, :tokens] = keys, values
    return slot


def _decode(q, keys, values, block: int, capacity: int | None = None, batch: int = 1):
    """Attention over blocks of `block` positions, each in a slot of `capacity`, `batch`
    blocks per call of the kernel."""
    softmax = DecodeSoftmax(q, keys.shape[0], keys.shape[2] ** -0.5)
    begins = range(0, keys.shape[1], block)
    for first in range(0, len(begins), batch):
        slots = []
        for begin in begins[first : first + batch]:
            k, v = keys[:, begin : begin + block], values[:, begin : begin + block]
            slots.append((_slot(k, v, capacity or block), k.shape[1]))
        softmax.merge(
            softmax.partials([softmax.slot_block(slot, tokens) for slot, tokens in slots])
        )
    return softmax.result()


def _reference(q, keys, values) -> torch.Tensor:
    heads, _, dim = q.shape
    kv_heads = keys.shape[0]
    qg = q.double().reshape(kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("kgd,ktd->kgt", qg, keys.double()) * dim**-0.5
    out = torch.einsum("kgt,ktd->kgd", torch.softmax(scores, dim=-1), values.double())
    return out.reshape(1, heads, dim)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,tokens,block",
    [(9, 3, 64, 1000, 128), (4, 2, 16, 77, 8), (10, 2, 32, 300, 64), (8, 1, 128, 50, 50)],
)
def test_decode_matches_float64_attention(heads, kv_heads, dim, tokens, block) -> None:
    q, keys, values = _inputs(heads, kv_heads, dim, tokens)
    error = (_decode(q, keys, values, block).double() - _reference(q, keys, values)).abs().max()
    assert error.item() < 2e-6


def test_the_result_is_a_function_of_the_values_alone() -> None:
    """Slots of any capacity, blocks batched any way, pages read in place, partials made on
    other threads in any order: the same bytes, since partials are merged in block order."""
    q, keys, values = _inputs(9, 3, 64, 1024)
    expected = _decode(q, keys, values, 128)
    assert torch.equal(_decode(q, keys, values, 128, capacity=4096), expected)
    for batch in (3, 8):
        assert torch.equal(_decode(q, keys, values, 128, batch=batch), expected)

    pages = [_slot(keys[:, b : b + 128], values[:, b : b + 128], 128) for b in range(0, 1024, 128)]
    softmax = DecodeSoftmax(q, 3, 64**-0.5)

    def late_first(index: int):  # the first blocks finish last
        time.sleep(0.02 * (len(pages) - index))
        page = pages[index].numpy().view(np.uint8).reshape(-1)
        return softmax.partials([softmax.page_block(page, None)])

    with ThreadPoolExecutor(4) as workers, OrderedPartials(workers, 8, softmax.merge) as partials:
        for index in range(len(pages)):
            partials.submit(late_first, index)
    assert torch.equal(softmax.result(), expected)


def test_the_check_refuses_any_flipped_byte_and_changes_nothing_else() -> None:
    q, keys, values = _inputs(9, 3, 64, 256)
    page = _slot(keys, values, 256).numpy().view(np.uint8).reshape(-1).copy()
    good = xxhash.xxh3_128_digest(page)
    softmax = DecodeSoftmax(q, 3, 0.125)
    checked = softmax.partials([softmax.page_block(page, good)])
    unchecked = softmax.partials([softmax.page_block(page, None)])
    assert all(np.array_equal(a, b) for a, b in zip(checked, unchecked, strict=True))
    for at in (0, page.nbytes // 2 - 1, page.nbytes // 2 + 5, page.nbytes - 1):  # K, then V
        bad = page.copy()
        bad[at] ^= 0x01
        # alone, and as the second block of a batch whose other blocks are sound
        for batch in ([bad], [page, bad, page]):
            blocks = [softmax.page_block(each, good) for each in batch]
            with pytest.raises(CorruptBlock) as refused:
                softmax.partials(blocks)
            assert refused.value.index == len(batch) // 2


def test_prefill_rows_attend_in_tiles_with_the_bits_of_decode_steps() -> None:
    """40 tokens at positions 100..139 over a checked page (positions 0-63), a slot block
    (64-99) and a block they write as they go (100-149): each token's result, from tiles of
    up to TILE_TOKENS tokens a call (split between threads), is a decode step's at its
    position, bit for bit; a flipped byte of the page fails the tiles too."""
    heads, kv_heads, dim, n, first = 9, 3, 64, 40, 100
    q, keys, values = _inputs(heads, kv_heads, dim, 150, seed=4)
    q = torch.randn(heads, n, dim, generator=torch.Generator().manual_seed(5))
    page = _slot(keys[:, :64], values[:, :64], 64).numpy().view(np.uint8).reshape(-1).copy()
    checksum = xxhash.xxh3_128_digest(page)
    middle = _slot(keys[:, 64:100], values[:, 64:100], 40)
    live = _slot(keys[:, 100:], values[:, 100:], 50)

    def blocks(softmax, tokens_live: int, page_bytes=page):
        return [
            softmax.page_block(page_bytes, checksum, 0),
            softmax.slot_block(middle, 36, 64),
            softmax.slot_block(live, tokens_live, 100),
        ]

    rows = RowsSoftmax(q, kv_heads, first, 0.125)
    rows.merge(rows.partials(blocks(rows, 50)))
    together = rows.result()  # [n, heads, D]
    for t in range(n):
        step = DecodeSoftmax(q[:, t : t + 1].contiguous(), kv_heads, 0.125)
        for block in blocks(step, t + 1):
            step.merge(step.partials([block]))
        alone = step.result().reshape(heads, dim)
        assert torch.equal(together[t], alone), t
    bad = page.copy()
    bad[page.nbytes - 3] ^= 0x10
    with pytest.raises(CorruptBlock):
        rows.partials(blocks(rows, 50, bad))


ATTEND_BUILDS = {"generic": 1, "avx2": 2, "avx512": 3}  # attend.c's kvg_attend_builds bits


def _check_windowed_tiles(tile, pointer) -> None:
    """A tile with sliding windows and a soft cap: each token's outputs are those of a tile of
    that token alone (a decode step's), bit for bit, and are the attention they stand for:
    over keys [Los[g], Ts[g]) of scores cap * tanh(s / cap), against float64."""
    H, R, D, G, T, cap = 2, 2, 32, 7, 77, 2.5
    Ts = np.array([77, 70, 64, 41, 33, 9, 1], np.int32)
    Los = np.array([60, 0, 57, 8, 31, 1, 0], np.int32)  # in and past 8-key groups
    q = np.random.default_rng(2).standard_normal((G, H, R, D), np.float32) * 0.3
    _, keys, values = _inputs(H * R, H, D, T, seed=2)
    page = _slot(keys, values, T).numpy().view(np.uint8).reshape(-1).copy()

    def call(q, Ts, Los):
        count = len(Ts)
        out = [np.empty(count * H * R, np.float32), np.empty(count * H * R, np.float32)]
        out.append(np.empty((count * H * R, D), np.float32))
        scores = np.empty(count * R * T, np.float32)
        status = tile(
            ctypes.c_void_p(q.ctypes.data), ctypes.c_void_p(page.ctypes.data),
            ctypes.c_void_p(page.ctypes.data + H * T * D * 4), ctypes.c_int64(T * D), H, R, D,
            count, Ts.ctypes.data_as(pointer), Los.ctypes.data_as(pointer), ctypes.c_float(cap),
            scores.ctypes.data_as(pointer), *(array.ctypes.data_as(pointer) for array in out),
            None,
        )  # fmt: skip
        assert status == 0
        return out

    together = call(q, Ts, Los)
    k64, v64 = keys.double().numpy(), values.double().numpy()
    for g in range(G):
        alone = call(q[g : g + 1].copy(), Ts[g : g + 1].copy(), Los[g : g + 1].copy())
        rows = slice(g * H * R, (g + 1) * H * R)
        assert all(
            a[rows].tobytes() == b.tobytes() for a, b in zip(together, alone, strict=True)
        ), g
        _, total, acc = alone
        out = acc / total[:, None]
        for h in range(H):
            seen = slice(Los[g], Ts[g])
            s = q[g, h].astype(np.float64) @ k64[h, seen].T  # [R, keys]
            s = cap * np.tanh(s / cap)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            expected = (w @ v64[h, seen]) / w.sum(axis=1, keepdims=True)
            assert np.abs(out[h * R : (h + 1) * R] - expected).max() < 1e-5, (g, h)
    with pytest.raises(AssertionError):  # a window past its keys is refused (KVG_BAD_ARGS)
        call(q[:1].copy(), np.array([9], np.int32), np.array([9], np.int32))


def test_every_build_of_the_kernel_gives_the_portable_bits() -> None:
    """The portable, AVX2 and AVX-512 builds (those this CPU runs) over shapes with and
    without a tail of fewer than 8 tokens, 1-4 rows a KV head: the same bits, the same
    checks, the same tiles of a prefill's tokens (each its own number of keys; with sliding
    windows and a soft cap too, each token's the bits of its own tile and the attention it
    stands for), the same
    merges (13 rows, not a multiple of 8, with an empty state and a head size off the
    vector); so the profile names one kernel, not a build."""
    library = decode_attention._library
    mask = library.kvg_attend_builds()
    builds = [name for name, bit in ATTEND_BUILDS.items() if mask & (1 << bit)]
    assert builds[0] == "generic"
    functions = {name: getattr(library, f"kvg_block_partial_{name}") for name in builds}
    pointer = ctypes.c_void_p
    for function in functions.values():
        function.argtypes = [pointer] * 3 + [ctypes.c_int64] + [ctypes.c_int32] * 4
        function.argtypes += [pointer] * 4 + [ctypes.c_char_p]

    def run(function, q, page, H, R, D, T, checksum):
        out = [np.empty(H * R, np.float32), np.empty(H * R, np.float32)]
        out.append(np.empty((H * R, D), np.float32))
        scores = np.empty(H * R * T, np.float32)
        base = page.ctypes.data
        status = function(
            q.ctypes.data, base, base + H * T * D * 4, T * D, H, R, D, T,
            scores.ctypes.data, *(array.ctypes.data for array in out), checksum,
        )  # fmt: skip
        return status, b"".join(array.tobytes() for array in out)

    for H, R, D, T in ((3, 3, 64, 200), (2, 1, 16, 7), (1, 4, 128, 64), (4, 2, 32, 33)):
        q, keys, values = _inputs(H * R, H, D, T)
        page = _slot(keys, values, T).numpy().view(np.uint8).reshape(-1).copy()
        scaled = (q.reshape(H, R, D) * 0.125).contiguous().numpy()
        checksum = xxhash.xxh3_128_digest(page)
        expected = run(functions["generic"], scaled, page, H, R, D, T, checksum)
        assert expected[0] == 0
        for name, function in functions.items():
            assert run(function, scaled, page, H, R, D, T, checksum) == expected, (name, H, R, D, T)
            assert run(function, scaled, page, H, R, D, T, bytes(16))[0] == 1  # a bad checksum
    tiles = {name: getattr(library, f"kvg_tile_partial_{name}") for name in builds}
    # plain; a sliding window (keys before lo left out, lo inside and past 8-key groups) and
    # a softcap (the models that have them)
    for (H, R, D, G), windowed in itertools.product(((3, 3, 64, 16), (2, 2, 32, 5)), (0, 1)):
        T = 77  # the largest Ts: a tail of 5 past 72
        Ts = np.array([T - 4 * g if g % 3 else T - g for g in range(G)], np.int32)  # 21-77
        Los = np.array([(5 * g + 3) % 20 * windowed for g in range(G)], np.int32)
        cap = 2.5 * windowed
        q = np.random.default_rng(G).standard_normal((G, H, R, D), np.float32) * 0.125
        _, keys, values = _inputs(H * R, H, D, T, seed=G)
        page = _slot(keys, values, T).numpy().view(np.uint8).reshape(-1).copy()
        tiled = set()
        for name, function in tiles.items():
            out = [np.empty(G * H * R, np.float32), np.empty(G * H * R, np.float32)]
            out.append(np.empty((G * H * R, D), np.float32))
            scores = np.empty(G * R * T, np.float32)
            base = page.ctypes.data
            status = function(
                ctypes.c_void_p(q.ctypes.data), ctypes.c_void_p(base),
                ctypes.c_void_p(base + H * T * D * 4), ctypes.c_int64(T * D), H, R, D, G,
                Ts.ctypes.data_as(pointer), Los.ctypes.data_as(pointer), ctypes.c_float(cap),
                scores.ctypes.data_as(pointer),
                *(array.ctypes.data_as(pointer) for array in out), None,
            )  # fmt: skip
            assert status == 0, name
            tiled.add(b"".join(array.tobytes() for array in out))
        assert len(tiled) == 1, (H, R, D, G)
    _check_windowed_tiles(tiles[builds[-1]], pointer)
    rng = np.random.default_rng(9)
    for D in (64, 24):
        rows = 13
        state = [rng.standard_normal(rows, np.float32) * 4, rng.random(rows, np.float32) * 9]
        state.append(rng.standard_normal((rows, D), np.float32))
        state[0][[2, 11]] = -np.inf  # states that hold nothing yet
        partial = [rng.standard_normal(rows, np.float32) * 4, rng.random(rows, np.float32) * 9]
        partial.append(rng.standard_normal((rows, D), np.float32))
        merged = {}
        for name in builds:
            into = [array.copy() for array in state]
            getattr(library, f"kvg_merge_{name}")(
                rows, D, *(array.ctypes.data_as(pointer) for array in (*into, *partial))
            )
            merged[name] = b"".join(array.tobytes() for array in into)
        assert all(value == merged["generic"] for value in merged.values()), D
        assert merged["generic"] != b"".join(array.tobytes() for array in state)


def test_a_failed_block_waits_for_the_others_before_raising() -> None:
    ended: list[int] = []

    def block(index: int):
        if index == 0:
            raise DataLoss("page 0 is corrupt")
        time.sleep(0.2)
        ended.append(index)
        return None

    workers = ThreadPoolExecutor(2)
    with pytest.raises(DataLoss), OrderedPartials(workers, 4, lambda partial: None) as partials:
        for index in range(3):
            partials.submit(block, index)
    workers.shutdown()
    assert sorted(ended) == [1, 2]


PAGE, KV_HEADS, DIM = 64, 3, 64


def _stored_context(store: Store, pages: int, tiers: Tiers) -> tuple[KvContext, list[np.ndarray]]:
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(2 * KV_HEADS * PAGE * DIM, dtype=np.float32) for _ in range(pages)]
    hashes = [hashlib.sha256(d).digest() for d in data]
    manifest = pb.Manifest(
        format_version=FORMAT_VERSION,
        model_fingerprint=b"\0" * 32,
        layout=pb.KvLayout(num_layers=1, kv_heads=KV_HEADS, head_dim=DIM, kv_dtype=1),
        profile=pb.ComputeProfile(page_tokens=PAGE),
        token_ids=list(range(pages * PAGE)),
        segment_ends=[pages * PAGE],
        page_sha256=hashes,
    )
    store.commit_artifact(manifest, page_records_of(dict(zip(hashes, data, strict=True))))
    geometry = ModelGeometry(1, 3 * KV_HEADS, KV_HEADS, DIM, 1)
    context = KvContext(geometry, PAGE, PAGE, tiers)
    context.attach(range(pages * PAGE), hashes)
    return context, data


def _step(context: KvContext) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3 * KV_HEADS, 1, DIM, generator=gen)
    k, v = (torch.randn(KV_HEADS, 1, DIM, generator=gen) for _ in range(2))
    context.begin_chunk(context.length, [0])
    with torch.inference_mode():
        return context.attend(0, q, k, v, DIM**-0.5)


def test_a_page_corrupt_on_disk_is_never_attended(tmp_path: Path) -> None:
    """A scan (pages read in place, checked by the kernel) and a resident pool both refuse it,
    in batches of two pages, and the scan leaves no slot of its pool pinned."""
    store = Store(tmp_path / "store")
    slot_shape = (2, KV_HEADS, PAGE, DIM)
    try:
        scan = Tiers(DevicePool(2 * 2 * KV_HEADS * PAGE * DIM * 4, slot_shape), HostCache(store, 0))
        context, data = _stored_context(store, 40, scan)
        hashes = [digest for page in context._stored_pages for digest in page]
        assert scan.attention_batch(40) == 2  # page 7 is the second of its batch

        def fresh(tiers: Tiers) -> KvContext:
            new = KvContext(context.geometry, PAGE, PAGE, tiers)
            new.attach(range(40 * PAGE), hashes)
            return new

        expected = _step(context)
        assert torch.equal(
            _step(fresh(Tiers(DevicePool(0, slot_shape), HostCache(store, 0)))), expected
        )
        assert flip_stored_page(store.path, data[7].tobytes()) == 1
        for tiers in (scan, Tiers(DevicePool(0, slot_shape), HostCache(store, 0))):
            with pytest.raises(DataLoss, match="corrupt on disk"):
                _step(fresh(tiers))
        assert all(scan.pool.acquire(("probe", i), 0, None, wait=False) for i in range(2))
    finally:
        store.close()


def _slot_contexts(store: Store, slots: int, batch: int) -> tuple[KvContext, KvContext]:
    """24 stored pages in blocks of two (every block goes through a slot), grafted twice: on
    an unbounded pool, and on a pool of `slots` slots attended in batches of `batch`."""
    block = 2 * PAGE
    slot_shape = (2, KV_HEADS, block, DIM)
    context, _ = _stored_context(store, 24, Tiers(DevicePool(0, slot_shape), HostCache(store, 0)))
    hashes = [digest for page in context._stored_pages for digest in page]
    pool = DevicePool(slots * 2 * KV_HEADS * block * DIM * 4, slot_shape)
    small = Tiers(pool, HostCache(store, 0))
    small.attention_batch = lambda blocks, slots=False: batch
    grafts = []
    for tiers in (context.tiers, small):
        grafts.append(KvContext(context.geometry, PAGE, block, tiers))
        grafts[-1].attach(range(24 * PAGE), hashes)
    return grafts[0], grafts[1]


def test_a_batch_of_slots_larger_than_the_pool_is_handed_on_not_waited_on(tmp_path) -> None:
    """The thread filling a batch of slots hands it to the workers when the pool runs out,
    instead of waiting for slots only it holds (regression: before that, a batch larger than
    the free slots waited forever)."""
    store = Store(tmp_path / "store")
    try:
        resident, scan = _slot_contexts(store, slots=4, batch=5)  # a batch larger than the pool
        expected = _step(resident)
        result: list[torch.Tensor] = []
        stepping = threading.Thread(target=lambda: result.append(_step(scan)), daemon=True)
        stepping.start()
        stepping.join(timeout=60)
        assert not stepping.is_alive(), "the step waited on slots its own batch held"
        assert torch.equal(result[0], expected)
        assert all(scan.tiers.pool.acquire(("probe", i), 0, None, wait=False) for i in range(4))
    finally:
        store.close()


def test_a_failed_batch_of_slots_leaves_every_slot_released_once(tmp_path, monkeypatch) -> None:
    """A batch that fails on a worker surfaces while a later batch is handed over: that batch
    is released by its worker only (regression: the handing thread released it as well, so a
    slot in use could count as free). No real fault makes the kernel fail on a slot, so one is
    injected into the second batch."""
    store = Store(tmp_path / "store")
    try:
        _, scan = _slot_contexts(store, slots=6, batch=1)
        calls = itertools.count()
        real = DecodeSoftmax.partials

        def failing_second(self, blocks):
            if next(calls) == 1:
                time.sleep(0.2)  # fails once later batches are being handed over
                raise ValueError("injected")
            return real(self, blocks)

        monkeypatch.setattr(DecodeSoftmax, "partials", failing_second)
        with pytest.raises(ValueError, match="injected"):
            _step(scan)
        assert all(scan.tiers.pool.acquire(("probe", i), 0, None, wait=False) for i in range(6))
    finally:
        store.close()


def test_a_scan_reads_its_stored_pages_one_batch_at_a_time(tmp_path, monkeypatch) -> None:
    """A scan copies its stored pages out of the store batch by batch, on the workers that
    attend them, so a step holds the batches in flight, never a layer's stored pages; a
    corrupt page fails the step and the store quarantines the artifact holding it."""
    store = Store(tmp_path / "store")
    try:
        scan = Tiers(DevicePool(2 * 2 * KV_HEADS * PAGE * DIM * 4, (2, KV_HEADS, PAGE, DIM)),
                     HostCache(store, 0))  # fmt: skip
        context, data = _stored_context(store, 40, scan)
        hashes = [digest for page in context._stored_pages for digest in page]

        def fresh() -> KvContext:
            new = KvContext(context.geometry, PAGE, PAGE, scan)
            new.attach(range(40 * PAGE), hashes)
            return new

        expected = _step(fresh())
        asked: list[int] = []
        real_unchecked = scan.host.unchecked

        @contextmanager
        def recorded_unchecked(digests):
            asked.append(len(digests))
            with real_unchecked(digests) as pages:
                yield pages

        monkeypatch.setattr(scan.host, "unchecked", recorded_unchecked)
        assert torch.equal(_step(fresh()), expected)
        assert sum(asked) == 40 and max(asked) == scan.attention_batch(40) < 40
        assert flip_stored_page(store.path, data[0].tobytes()) == 1
        with pytest.raises(DataLoss, match="corrupt on disk"):
            _step(fresh())
        store.read_quarantine.settled()
        assert len(store.quarantined_ids()) == 1
    finally:
        store.close()


def test_the_profile_names_the_decode_kernel(monkeypatch) -> None:
    q = torch.randn(9, 1, 64)
    assert isinstance(softmax_for(q, 3, 10, 0.125), DecodeSoftmax)
    assert isinstance(softmax_for(torch.randn(9, 2, 64), 3, 10, 0.125), OnlineSoftmax)  # prefill
    assert isinstance(softmax_for(torch.randn(9, 1, 24), 3, 10, 0.125), OnlineSoftmax)  # D % 16
    kernel = decode_attention.kernel_for(9, 3, 64)
    assert kernel == "native" and decode_attention.kernel_build() in ATTEND_BUILDS
    native = compute_profile(64, 64, ModelGeometry(1, 9, 3, 64, 1)).attention
    assert native.endswith(f"decode={kernel}")
    # geometries the kernel does not take decode with torch, and their profile says so
    for heads, kv_heads, dim in ((9, 3, 24), (18, 2, 64)):  # D % 16, 9 rows per KV head
        profile = compute_profile(64, 64, ModelGeometry(1, heads, kv_heads, dim, 1))
        assert profile.attention.endswith("decode=torch")
        odd = torch.randn(heads, 1, dim)
        assert isinstance(softmax_for(odd, kv_heads, 10, 0.125), OnlineSoftmax)
    monkeypatch.setattr(decode_attention, "_library", None)
    assert decode_attention.kernel_for(9, 3, 64) == "torch"
    assert isinstance(softmax_for(q, 3, 10, 0.125), OnlineSoftmax)
    other = compute_profile(64, 64, ModelGeometry(1, 9, 3, 64, 1)).attention
    assert other != native  # other last bits, another profile


def test_a_context_gives_its_block_gather_all_it_declares(tmp_path: Path) -> None:
    """BlockGather reads a context only through GatheredContext: KvContext implements it."""
    store = Store(tmp_path / "store")
    tiers = Tiers(DevicePool(0, (2, KV_HEADS, PAGE, DIM)), HostCache(store, 0))
    try:
        context, _ = _stored_context(store, 2, tiers)
        assert mismatches(KvContext, GatheredContext, context) == []
        context.close()
    finally:
        store.close()
