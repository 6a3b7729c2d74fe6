"""The store's declared interfaces (kvgraftd.store.interface) and the classes that
implement them: the Store the whole of it, a tenant's view the engine's part.
The remote tier's view is held to it in tests/remote/test_remote.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraftd.store.artifact_store import Store
from kvgraftd.store.eviction import CacheBudget
from kvgraftd.store.interface import ArtifactStore, EngineStore, PageSource
from kvgraftd.store.tenant_view import TenantView
from tests.support.protocols import mismatches, protocol_members, public_methods


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "store", initial_map_bytes=1 << 20, min_free_bytes=1 << 20)
    yield s
    s.close()


def test_the_store_implements_its_declared_interface(store: Store) -> None:
    assert mismatches(Store, ArtifactStore, store) == []
    assert isinstance(store, ArtifactStore)
    assert isinstance(store, EngineStore) and isinstance(store, PageSource)


def test_every_public_method_of_the_store_is_declared() -> None:
    """A method the Store gains is declared in ArtifactStore too: a caller typed against
    the Protocol (the remote tier's view stands in for the Store) never needs more."""
    declared, _ = protocol_members(ArtifactStore)
    assert sorted(public_methods(Store) - declared) == []
    assert sorted(declared - public_methods(Store)) == []


def test_the_engine_interface_is_part_of_the_store_interface() -> None:
    engine, _ = protocol_members(EngineStore)
    pages, _ = protocol_members(PageSource)
    store, _ = protocol_members(ArtifactStore)
    assert pages < engine < store


def test_a_tenant_view_implements_the_engine_interface(store: Store) -> None:
    view = TenantView(store, "alice", CacheBudget())
    assert mismatches(TenantView, EngineStore, view) == []
    assert isinstance(view, EngineStore)
