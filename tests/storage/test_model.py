"""Random operation sequences against the real store and a model of seed 004's two versions.

The model is the seed's text, literally: a store holds a ``range`` of 1 or 2 versions, each an
immutable snapshot; ``open(v)`` keeps only ``v`` and works on a copy; ``commit`` adds ``v + 1``;
anything else (close, dropping the objects without closing, closing the store) keeps ``v``.
"""

from __future__ import annotations

import gc
import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparkstep.storage import (
    RocksDBDatabase,
    RocksDBStore,
    StoreBusyError,
    StoreClosedError,
    VersionNotAvailableError,
    shard_key,
)

TABLES = st.sampled_from(["a", "t.a", "default", "table with spaces", "ü"])
KEYS = st.builds(lambda s, i: shard_key(s, bytes([i])), st.integers(0, 3), st.integers(0, 5))
VALUES = st.binary(max_size=12)

Contents = dict[tuple[str, bytes], bytes]


@dataclass
class Snapshot:
    step: int = 0
    layout: bytes | None = None
    contents: Contents = field(default_factory=dict)

    def copy(self) -> Snapshot:
        return Snapshot(self.step, self.layout, dict(self.contents))


def read_all(db: RocksDBDatabase) -> Snapshot:
    contents = {(table, key): value for table in db.tables() for key, value in db.items(table)}
    return Snapshot(db.get_step(), db.get_layout(), contents)


class TwoVersionStore(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="sparkstep-model-"))
        self.paths = itertools.count()
        self.path = self.root / f"s{next(self.paths)}"
        self.store: RocksDBStore | None = RocksDBStore(self.path)
        self.db: RocksDBDatabase | None = None
        self.ended: RocksDBDatabase | None = None
        # The model.
        self.versions: dict[int, Snapshot] = {0: Snapshot()}
        self.base = 0
        self.work: Snapshot | None = None

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = self.db = self.ended = None
        gc.collect()
        shutil.rmtree(self.root, ignore_errors=True)

    def _range(self) -> range:
        return range(min(self.versions), max(self.versions) + 1)

    # ---- the store object ------------------------------------------------------------------

    @precondition(lambda self: self.store is None)
    @rule()
    def reopen_path(self) -> None:
        self.store = RocksDBStore(self.path)

    @precondition(lambda self: self.store is not None)
    @rule()
    def close_store(self) -> None:
        assert self.store is not None
        self.store.close()
        self.store = None
        self._db_ended()

    @precondition(lambda self: self.store is not None)
    @rule()
    def throw_store_away(self) -> None:
        """Drop the objects without closing anything: what a crashed owner leaves behind."""
        self.store = self.db = self.ended = None
        gc.collect()
        self.work = None

    @rule(version=st.integers(0, 30))
    def create_new_store(self, version: int) -> None:
        if self.store is not None:
            self.store.close()
        self._db_ended()
        self.path = self.root / f"s{next(self.paths)}"
        self.store = RocksDBStore.create(self.path, version=version)
        self.versions = {version: Snapshot()}

    # ---- open / commit / close -------------------------------------------------------------

    @precondition(lambda self: self.store is not None and self.db is None)
    @rule(offset=st.integers(-1, 2))
    def open(self, offset: int) -> None:
        assert self.store is not None
        assert self.store.versions() == self._range()
        version = min(self.versions) + offset
        if version not in self.versions:
            with pytest.raises(VersionNotAvailableError):
                self.store.open(version)
            return
        self.db = self.store.open(version)
        # The version above is discarded, the one below kept until the next commit.
        self.versions = {v: snap for v, snap in self.versions.items() if v <= version}
        self.base = version
        self.work = self.versions[version].copy()
        assert read_all(self.db) == self.work

    @precondition(lambda self: self.db is not None)
    @rule()
    def open_twice(self) -> None:
        assert self.store is not None
        with pytest.raises(StoreBusyError):
            self.store.open(self.base)

    @precondition(lambda self: self.db is not None)
    @rule()
    def commit(self) -> None:
        assert self.db is not None and self.work is not None and self.store is not None
        self.db.commit()
        self.versions = {self.base: self.versions[self.base], self.base + 1: self.work}
        self.work = None
        self.ended, self.db = self.db, None
        assert self.store.versions() == range(self.base, self.base + 2)

    @precondition(lambda self: self.db is not None)
    @rule()
    def close(self) -> None:
        assert self.db is not None
        self.db.close()
        self._db_ended()

    def _db_ended(self) -> None:
        if self.db is not None:
            self.ended, self.db = self.db, None
        self.work = None

    @precondition(lambda self: self.ended is not None)
    @rule(table=TABLES, key=KEYS)
    def ended_database_refuses(self, table: str, key: bytes) -> None:
        assert self.ended is not None
        with pytest.raises(StoreClosedError):
            self.ended.put(table, key, b"x")
        with pytest.raises(StoreClosedError):
            self.ended.get(table, key)

    # ---- writes -------------------------------------------------------------------------------

    @precondition(lambda self: self.db is not None)
    @rule(table=TABLES, key=KEYS, value=VALUES)
    def put(self, table: str, key: bytes, value: bytes) -> None:
        assert self.db is not None and self.work is not None
        self.db.put(table, key, value)
        self.work.contents[(table, key)] = value

    @precondition(lambda self: self.db is not None)
    @rule(table=TABLES, key=KEYS)
    def delete(self, table: str, key: bytes) -> None:
        assert self.db is not None and self.work is not None
        self.db.delete(table, key)
        self.work.contents.pop((table, key), None)

    @precondition(lambda self: self.db is not None)
    @rule(
        ops=st.lists(
            st.tuples(st.booleans(), TABLES, KEYS, VALUES),
            max_size=8,
        )
    )
    def write(self, ops: list[tuple[bool, str, bytes, bytes]]) -> None:
        assert self.db is not None and self.work is not None
        batch = self.db.batch()
        for is_put, table, key, value in ops:
            if is_put:
                batch.put(table, key, value)
            else:
                batch.delete(table, key)
        self.db.write(batch)
        for is_put, table, key, value in ops:
            if is_put:
                self.work.contents[(table, key)] = value
            else:
                self.work.contents.pop((table, key), None)

    @precondition(lambda self: self.db is not None)
    @rule(step=st.integers(0, 2**40))
    def set_step(self, step: int) -> None:
        assert self.db is not None and self.work is not None
        self.db.set_step(step)
        self.work.step = step

    @precondition(lambda self: self.db is not None)
    @rule(layout=st.binary(max_size=20))
    def set_layout(self, layout: bytes) -> None:
        assert self.db is not None and self.work is not None
        self.db.set_layout(layout)
        self.work.layout = layout

    @precondition(lambda self: self.db is not None)
    @rule(table=TABLES, key=KEYS)
    def get(self, table: str, key: bytes) -> None:
        assert self.db is not None and self.work is not None
        assert self.db.get(table, key) == self.work.contents.get((table, key))

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def versions_match(self) -> None:
        if self.store is not None:
            assert self.store.versions() == self._range()
        assert len(self.versions) in (1, 2)

    @invariant()
    def working_state_matches(self) -> None:
        if self.db is not None:
            assert self.work is not None
            assert self.db.get_step() == self.work.step
            assert self.db.get_layout() == self.work.layout


TwoVersionStore.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_two_version_store = TwoVersionStore.TestCase
