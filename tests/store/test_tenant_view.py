"""The store as one tenant sees it (kvgraftd.store.tenant_view), on a real store in-process."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget
from kvgraftd.store.page_records import page_record
from kvgraftd.store.tenant_view import TenantView


def test_a_staged_page_collected_since_is_missing_again(tmp_path: Path) -> None:
    """Regression: a page bob staged was answered "not missing" after staged pages were
    collected, so an upload resumed without it could never commit."""
    store = Store(tmp_path / "store")
    try:
        bob = TenantView(store, "bob", CacheBudget())
        page = bytes(range(256)) * 16
        digest = hashlib.sha256(page).digest()
        assert bob.missing_pages([digest]) == [digest]
        bob.stage_pages({digest: page_record(page)})
        assert bob.missing_pages([digest]) == []  # sent already: a retry need not resend it
        assert store.collect_staged(0) >= 1
        assert bob.missing_pages([digest]) == [digest]
        alice = TenantView(store, "alice", CacheBudget())
        assert alice.missing_pages([digest]) == [digest]  # never hers
    finally:
        store.close()
