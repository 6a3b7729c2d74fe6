"""Scrub bench: a store of >= 1 GiB with bytes flipped on disk; does the scrub find every one?

Builds a real store of --gib GiB of artifacts in the default model's layout (30 layers,
3 KV heads of 64, float32: 98,304-byte pages of 64 tokens; random bytes), closes it,
flips one bit at a random offset of --flips random pages, straight in the segment files
(located through the store's index), reopens it and runs `Scrubber.run` unthrottled.
Reported: pages flipped, found, missed and wrongly accused (must be 0), the artifacts
quarantined against those holding a flipped page, and the scrub's rate against the
plainest baseline: hashlib.sha256 of the same pages read from the same files in one
pass (both read the page cache: the store was just written). The two are alternated
over --rounds; the ratio is the median of per-round ratios. What bounds the figure:
SHA-256 itself (SHA-NI, one core), plus the index walk and one read transaction per
64 pages. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from kvgraft.artifact import Artifact
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store.artifact_store import Store
from kvgraftd.store.page_records import INDEX_RECORD, page_records_of
from kvgraftd.store.scrub import Scrubber

LAYOUT = pb.KvLayout(num_layers=30, kv_heads=3, head_dim=64, kv_dtype=pb.KV_DTYPE_FLOAT32)
PAGE_TOKENS = 64
PAGE_BYTES = 2 * 3 * 64 * 4 * PAGE_TOKENS
PROFILE = pb.ComputeProfile(torch_version="bench", device_kind="cpu", page_tokens=PAGE_TOKENS)


def build(path: Path, gib: float, seed: int) -> tuple[dict[bytes, set[str]], int]:
    """The store; each page's holders and the bytes stored."""
    rng = np.random.default_rng(seed)
    holders: dict[bytes, set[str]] = {}
    stored, n = 0, 0
    store = Store(path, min_free_bytes=0)
    try:
        while stored < gib * (1 << 30):
            pages = [rng.bytes(PAGE_BYTES) for _ in range(8 * LAYOUT.num_layers)]  # 512 tokens
            artifact = Artifact.build(
                model_fingerprint=bytes(32),
                layout=LAYOUT,
                profile=PROFILE,
                token_ids=[(n * 512 + i) % 49_000 for i in range(8 * PAGE_TOKENS)],
                page_bytes=pages,
            )
            store.commit_artifact(artifact.manifest, page_records_of(artifact.pages))
            for digest in artifact.pages:
                holders.setdefault(digest, set()).add(artifact.id)
            stored += len(pages) * PAGE_BYTES
            n += 1
    finally:
        store.close()
    return holders, stored


def flip(path: Path, digests: list[bytes], rng: random.Random) -> None:
    """One bit flipped at a random offset of each page, in its segment file."""
    env = lmdb.open(str(path), max_dbs=16, readonly=True, lock=False)
    try:
        db = env.open_db(b"page_locations", create=False)
        with env.begin() as txn:
            locations = [INDEX_RECORD.unpack(txn.get(d, db=db))[1:] for d in digests]
    finally:
        env.close()
    for segment, offset, length in locations:
        fd = os.open(path / "segments" / f"{segment:08d}.seg", os.O_RDWR)
        try:
            at = offset + rng.randrange(length)
            byte = os.pread(fd, 1, at)[0]
            os.pwrite(fd, bytes([byte ^ (1 << rng.randrange(8))]), at)
        finally:
            os.close(fd)


def plain_sha256(path: Path) -> float:
    """Seconds to hash every page of the segment files with hashlib, in file order."""
    began = time.perf_counter()
    for segment in sorted((path / "segments").glob("*.seg")):
        with open(segment, "rb") as f:
            while chunk := f.read(PAGE_BYTES):
                hashlib.sha256(chunk).digest()
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="store size (at least 1)")
    parser.add_argument("--flips", type=int, default=100, help="pages to damage")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where the store goes")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        path = Path(scratch) / "store"
        holders, stored = build(path, args.gib, args.seed)
        flipped = set(rng.sample(sorted(holders), args.flips))
        flip(path, sorted(flipped), rng)
        expected = set().union(*(holders[d] for d in flipped))
        findings, ratios, rates = None, [], []
        for round_ in range(args.rounds):
            store = Store(path, min_free_bytes=0)
            try:
                timings = {}
                for variant in ("scrub", "sha256") if round_ % 2 == 0 else ("sha256", "scrub"):
                    began = time.perf_counter()
                    if variant == "scrub":
                        result = Scrubber(store, 1 << 50).run()
                        findings = findings or result
                    else:
                        plain_sha256(path)
                    timings[variant] = time.perf_counter() - began
            finally:
                store.close()
            rates.append(stored / timings["scrub"] / 1e9)
            ratios.append(timings["sha256"] / timings["scrub"])
    found = {bytes.fromhex(d) for d in findings.corrupt_pages}
    quarantined = set(findings.quarantined)
    print(f"store {stored / 1e9:.2f} GB, {len(holders)} pages; flipped {len(flipped)}")
    missed, wrongly = len(flipped - found), len(found - flipped)
    print(f"found {len(found & flipped)}, missed {missed}, wrongly accused {wrongly}")
    print(f"quarantined {len(quarantined)} of the {len(expected)} artifacts holding them")
    print(f"scrub {statistics.median(rates):.2f} GB/s, {statistics.median(ratios):.2f}x hashlib")
    print(
        json.dumps(
            {
                "bench": "scrub",
                "store_bytes": stored,
                "pages": len(holders),
                "flipped": len(flipped),
                "found": len(found & flipped),
                "missed": len(flipped - found),
                "wrongly_accused": len(found - flipped),
                "quarantined_as_expected": quarantined == expected,
                "scrub_gb_per_s": round(statistics.median(rates), 3),
                "scrub_vs_sha256": round(statistics.median(ratios), 3),
            }
        )
    )
    return 0 if found == flipped and quarantined == expected else 1


if __name__ == "__main__":
    sys.exit(main())
