"""Store formats: which one a store has (`check_format`), and the migrations
run when a store of an older format is opened.

Format 1 (kvgraft up to 0.x of 2026-12-01) kept each page inside LMDB, as the
value `xxh3-128 || bytes` of the `pages` sub-database. Format 2 keeps the
bytes in segment files and their locations in `page_locations`
(kvgraftd.store.segments, kvgraftd.store.page_records). `migrate_v1` moves the pages
over in batches of about BATCH_BYTES; each batch is one write transaction
that appends the bytes to the segments, indexes them and deletes them from
`pages`, so after a crash every page is in exactly one of the two and the
next open goes on where this one stopped. When `pages` is empty it is
dropped and the format becomes 2, in one transaction.

Format 3 adds trust (kvgraftd.store.trust_index): a `provenance` record per artifact
and `vouchers` for the chain index, which holds trusted artifacts' pages only.
`migrate_index` empties the chain index of a format-2 store, whose artifacts have
no provenance and are therefore untrusted until verified.

Format 4 lists every chain entry under its parent (`chain_children`,
kvgraftd.store.chains), so a prompt reuses any prefix of a stored page, and
every untrusted artifact by its first tokens (`untrusted_heads`), so Lookup
names one holding a prompt's prefix. `migrate_index` builds both lists from
the artifacts, in one transaction.

The checksum travels with the bytes unchanged (a page corrupt in format 1
stays detectably corrupt). Migration needs free disk for the page bytes;
LMDB's file keeps its size (the space the pages held is reused by the index,
and `mdb_copy -c` compacts it offline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import lmdb

from kvgraft.errors import FailedPrecondition
from kvgraft.v1 import kvgraft_pb2 as pb
from kvgraftd.store import chains, trust_index
from kvgraftd.store.catalog import decode_record, now_ms
from kvgraftd.store.lmdb_env import LmdbEnv
from kvgraftd.store.page_records import PageRecord

log = logging.getLogger(__name__)

STORE_FORMAT_VERSION = 4
BATCH_BYTES = 256 << 20
V1_CHECKSUM_BYTES = 16

WriteAppending = Callable[[int, int, Callable[[lmdb.Transaction], int]], int]
AppendPages = Callable[[lmdb.Transaction, Mapping[bytes, PageRecord]], None]


def check_format(env: LmdbEnv, path: Path) -> int:
    """The store's format version (a new store is marked with the current one);
    FailedPrecondition for a format this kvgraftd cannot read."""

    def body(txn: lmdb.Transaction) -> int:
        meta = env.db["meta"]
        found = txn.get(b"format_version", db=meta)
        if found is None:
            txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(), db=meta)
            txn.put(b"created_unix_ms", str(now_ms()).encode(), db=meta)
            return STORE_FORMAT_VERSION
        return int(bytes(found))

    version = env.write(0, body)
    if not 1 <= version <= STORE_FORMAT_VERSION:  # 1: PageStore.open, 2 and 3: migrate_index
        raise FailedPrecondition(
            f"store {path} has format {version}; this kvgraftd reads formats 1 to "
            f"{STORE_FORMAT_VERSION}. Use a matching kvgraft version."
        )
    return version


def migrate_v1(env: LmdbEnv, write_appending: WriteAppending, append: AppendPages) -> int:
    """Move every format-1 page into the segments; returns the pages moved."""
    old = env.open_db("pages")
    started, moved, moved_bytes = time.monotonic(), 0, 0

    def batch(txn: lmdb.Transaction) -> int:
        records: dict[bytes, PageRecord] = {}
        size = 0
        for key, value in txn.cursor(db=old):
            records[bytes(key)] = PageRecord(
                bytes(value[:V1_CHECKSUM_BYTES]), memoryview(value)[V1_CHECKSUM_BYTES:]
            )
            size += len(value)
            if size >= BATCH_BYTES:
                break
        append(txn, records)  # copies the bytes before the deletes below move them
        for key in records:
            txn.delete(key, db=old)
        nonlocal moved_bytes
        moved_bytes += size - V1_CHECKSUM_BYTES * len(records)
        return len(records)

    while count := write_appending(1 << 20, BATCH_BYTES, batch):
        moved += count
        log.info("store format 1 -> 2: %d pages (%.1f MB) moved", moved, moved_bytes / 1e6)

    def finish(txn: lmdb.Transaction) -> int:
        txn.drop(old, delete=True)
        txn.put(b"format_version", b"2", db=env.db["meta"])
        return 0

    env.write(0, finish)
    log.info("store format 1 -> 2 done: %d pages in %.1f s", moved, time.monotonic() - started)
    return moved


def migrate_index(env: LmdbEnv, version: int) -> None:
    """Format 2 or 3 -> 4, in one transaction. From 2: artifacts gain a provenance, and
    only trusted ones feed the chain index; a format-2 artifact has none, so none is
    trusted yet: the index is emptied (`kvgraft verify ID` trusts an artifact again).
    From 3: every chain entry is listed under its parent."""

    def finish(txn: lmdb.Transaction) -> int:
        if version < 3:
            trust_index.clear_chains(txn, env.db)
        else:
            _list_chain_children(txn, env.db)
        _list_untrusted(txn, env.db)
        txn.put(b"format_version", str(STORE_FORMAT_VERSION).encode(), db=env.db["meta"])
        return 0

    env.write(0, finish)
    if version < 3:
        log.info(
            "store format 2 -> 4: artifacts stored before are untrusted until verified "
            "(kvgraft verify ID); they are no longer grafted automatically"
        )
    else:
        log.info("store format 3 -> 4: chain entries and untrusted artifacts listed")


def _list_chain_children(txn: lmdb.Transaction, dbs: Mapping) -> None:
    """The chain entries of every trusted artifact not in quarantine, listed under their
    parents (where the index holds that entry)."""
    for raw_aid, raw in txn.cursor(db=dbs["provenance"]):
        aid = bytes(raw_aid)
        if not trust_index.is_trusted(pb.Provenance.FromString(bytes(raw))):
            continue
        found = txn.get(aid, db=dbs["artifacts"])
        if found is None or txn.get(aid, db=dbs["quarantine"]) is not None:
            continue
        for key, entry in chains.manifest_entries(decode_record(found).manifest()):
            if txn.get(key, db=dbs["chains"]) is not None:
                txn.put(
                    chains.child_key(entry.parent, entry.token_ids, key),
                    b"",
                    db=dbs["chain_children"],
                )


def _list_untrusted(txn: lmdb.Transaction, dbs: Mapping) -> None:
    """Every untrusted artifact listed by its first tokens."""
    for raw_aid, raw in txn.cursor(db=dbs["artifacts"]):
        aid = bytes(raw_aid)
        if not trust_index.is_trusted(trust_index.read(txn, dbs, aid)):
            manifest = decode_record(raw).manifest()
            trust_index.list_untrusted(txn, dbs, aid, manifest, True)
