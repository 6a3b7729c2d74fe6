"""Fixtures of the library tests: the tiny model with the toy tokenizer (once per module),
a fresh store, its engine and a library service on it (tests.support.toy_library)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraftd.engine.model.model_adapter import ModelAdapter
from kvgraftd.engine.requests.engine import Engine
from kvgraftd.library.service import LibraryService
from kvgraftd.store.artifact_store import Store
from tests.support.toy_library import library_service, toy_adapter, toy_engine


@pytest.fixture(scope="module")
def adapter() -> ModelAdapter:
    return toy_adapter()


@pytest.fixture
def store(tmp_path: Path):
    store = Store(tmp_path / "store")
    yield store
    store.close()


@pytest.fixture
def engine(adapter: ModelAdapter, store: Store) -> Engine:
    return toy_engine(adapter, store)


@pytest.fixture
def library(engine: Engine) -> LibraryService:
    return library_service(engine)
