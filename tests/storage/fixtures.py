"""Factory fixtures for the storage tests: real RocksDB stores in ``tmp_path``, always closed."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkstep.storage import RocksDBStore

StoreFactory = Callable[..., RocksDBStore]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """A path where no store exists yet."""
    return tmp_path / "store"


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[StoreFactory]:
    """``store_factory(path=None, **kwargs)`` -> a RocksDBStore, closed at teardown."""
    made: list[RocksDBStore] = []
    counter = itertools.count()

    def make(path: Path | None = None, **kwargs: Any) -> RocksDBStore:
        store = RocksDBStore(path or tmp_path / f"store-{next(counter)}", **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
