"""The open database of a RocksDB store: its working copy, read and written until commit or close.

A :class:`RocksDBDatabase` is made only by :meth:`RocksDBStore.open` (:mod:`.rocksdb`), on the
store's ``work/`` directory (:mod:`.layout`). Writes skip the RocksDB WAL (and a large
:meth:`RocksDBDatabase.write_sorted` skips the memtable too: one SST file ingested): after a
crash the working copy is thrown away anyway, and :meth:`RocksDBDatabase.commit` flushes every
memtable before taking the checkpoint that becomes the next version (the steps and failpoints
of commit are in :mod:`.rocksdb`). Shard export/import/drop are in :mod:`.shards`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import rocksdict

from sparkstep.failpoints import failpoint
from sparkstep.ids import Step, Version
from sparkstep.storage import shards as shard_io
from sparkstep.storage.base import Database, DatabaseStatus, ExportedShards, WriteBatch
from sparkstep.storage.errors import CorruptStoreError, InvalidTableError, StoreClosedError
from sparkstep.storage.files import remove_path
from sparkstep.storage.layout import (
    LOAD_DIR,
    MAX_TABLE_NAME,
    META_LAYOUT,
    META_STEP,
    META_VERSION,
    TABLE_PREFIX,
    decode_u64,
    encode_u64,
)
from sparkstep.storage.options import RocksDBOptions
from sparkstep.storage.translate import raise_translated, translated

if TYPE_CHECKING:
    from sparkstep.storage.rocksdb import RocksDBStore

__all__ = ["INGEST_MIN_ENTRIES", "RocksDBDatabase", "RocksDBWriteBatch"]

INGEST_MIN_ENTRIES = 32_768
"""From this many keys, :meth:`RocksDBDatabase.write_sorted` ingests an SST file."""


def _table_cf(table: str) -> str:
    if not isinstance(table, str) or not table or len(table) > MAX_TABLE_NAME:
        raise InvalidTableError(
            f"table name {table!r} is invalid: use a non-empty string of at most "
            f"{MAX_TABLE_NAME} characters"
        )
    return TABLE_PREFIX + table


class RocksDBWriteBatch(WriteBatch):
    """A :class:`~sparkstep.storage.base.WriteBatch` over one rocksdict ``WriteBatch``.

    Each operation goes straight into the RocksDB batch, naming the table's column family, so
    the whole batch commits in one RocksDB write (atomic across column families). A table
    first named here is created when the operation is added; if the batch is then dropped, an
    empty table remains, which reads exactly like no table.
    """

    __slots__ = ("_db", "_handles", "_wb")

    def __init__(self, db: RocksDBDatabase) -> None:
        self._db = db
        self._handles = db._handles  # the same dict object: cleared when the db ends
        self._wb = rocksdict.WriteBatch(raw_mode=True)

    def _handle(self, table: str) -> rocksdict.ColumnFamily:
        """The column family of ``table`` (created on first use)."""
        handle = self._handles.get(table)
        return handle if handle is not None else self._db._family(table)[1]

    def put(self, table: str, key: bytes, value: bytes) -> None:
        handle = self._handle(table)
        try:
            self._wb.put(key, value, handle)
        except Exception as exc:
            raise_translated(exc, f"batch put into table {table!r}")

    def delete(self, table: str, key: bytes) -> None:
        handle = self._handle(table)
        try:
            self._wb.delete(key, handle)
        except Exception as exc:
            raise_translated(exc, f"batch delete from table {table!r}")

    def put_many(self, table: str, changes: Mapping[bytes, bytes | None]) -> None:
        handle = self._handle(table)
        put, delete = self._wb.put, self._wb.delete
        try:
            for key, value in changes.items():
                if value is None:
                    delete(key, handle)
                else:
                    put(key, value, handle)
        except Exception as exc:
            raise_translated(exc, f"batch put_many into table {table!r}")

    def delete_range(self, table: str, begin: bytes, end: bytes) -> None:
        handle = self._handle(table)
        try:
            self._wb.delete_range(begin, end, handle)
        except Exception as exc:
            raise_translated(exc, f"batch delete_range in table {table!r}")

    def __len__(self) -> int:
        return int(self._wb.len())


class RocksDBDatabase(Database):
    """A :class:`RocksDBStore` opened at ``base_version``: its working copy, until commit/close.

    Made only by :meth:`RocksDBStore.open`. Status (:class:`DatabaseStatus`): ``OPEN`` until
    :meth:`commit` (``COMMITTED``) or :meth:`close` (``CLOSED``); both end it and every later
    call raises :class:`StoreClosedError`. Writes skip the RocksDB WAL (see the module
    docstring).
    """

    def __init__(
        self, store: RocksDBStore, work: Path, base_version: Version, options: RocksDBOptions
    ) -> None:
        self._store: RocksDBStore | None = store
        self._work = work
        self._base = base_version
        self._status = DatabaseStatus.OPEN
        self._create_lock = threading.Lock()
        self._write_options = rocksdict.WriteOptions()
        # rocksdict's stub declares disable_wal a method; at runtime it is a property.
        setattr(self._write_options, "disable_wal", True)  # noqa: B010
        self._options = options
        rocks_options = options.to_options()
        rocks_options.create_if_missing(False)
        families = rocksdict.Rdict.list_cf(str(work), rocks_options)
        self._rdb: rocksdict.Rdict | None = rocksdict.Rdict(
            str(work),
            rocks_options,
            column_families={name: options.to_options() for name in families if name != "default"},
        )
        # table -> (column family view, column family handle); empty once closed, so the hot
        # paths need no separate closed check: a miss goes to _family(), which checks.
        self._families: dict[str, tuple[rocksdict.Rdict, rocksdict.ColumnFamily]] = {}
        self._handles: dict[str, rocksdict.ColumnFamily] = {}
        try:
            for name in families:
                if name.startswith(TABLE_PREFIX):
                    self._remember(name[len(TABLE_PREFIX) :], name)
            recorded = self._rdb.get(META_VERSION)
            if recorded is None or decode_u64(recorded) != base_version:
                found = None if recorded is None else decode_u64(recorded)
                raise CorruptStoreError(
                    f"checkpoint of version {base_version} in store {store.path} holds version "
                    f"{found}: the directory was altered outside sparkstep"
                )
        except BaseException:
            self._drop_handles()
            raise

    # ---- status --------------------------------------------------------------------------------

    @property
    def base_version(self) -> Version:
        return self._base

    @property
    def status(self) -> DatabaseStatus:
        return self._status

    def _live(self) -> rocksdict.Rdict:
        if self._rdb is None:
            raise StoreClosedError(
                f"the database opened at version {self._base} is {self._status.value}: "
                "open the store again"
            )
        return self._rdb

    def _remember(self, table: str, name: str) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        rdb = self._live()
        entry = (rdb.get_column_family(name), rdb.get_column_family_handle(name))
        self._families[table] = entry
        self._handles[table] = entry[1]
        return entry

    def _family(self, table: str) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        """The column family of ``table``, created on first use (the slow path of every call)."""
        with self._create_lock:
            entry = self._families.get(table)
            if entry is not None:
                return entry
            name = _table_cf(table)
            rdb = self._live()
            with translated(f"creating table {table!r}"):
                rdb.create_column_family(name, self._options.to_options())
                return self._remember(table, name)

    def _drop_handles(self) -> None:
        for view, _ in self._families.values():
            with contextlib.suppress(Exception):
                view.close()
        # Cleared, not rebound: batches hold the same dict and must see the db end.
        self._families.clear()
        self._handles.clear()
        rdb, self._rdb = self._rdb, None
        if rdb is not None:
            with contextlib.suppress(Exception):
                rdb.close()

    # ---- reads and writes --------------------------------------------------------------------

    def get(self, table: str, key: bytes) -> bytes | None:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return None
        try:
            value: bytes | None = entry[0].get(key)
        except Exception as exc:
            raise_translated(exc, f"get from table {table!r}")
        return value

    def get_many(
        self, table: str, keys: Sequence[bytes], *, ascending: bool = False
    ) -> list[bytes | None]:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return [None] * len(keys)
        # RocksDB answers a multi-get in key order two to three times faster than in random
        # order (each lookup continues near the previous one), so large ones are sorted.
        unsorted = len(keys) > 64 and not ascending
        order = sorted(range(len(keys)), key=keys.__getitem__) if unsorted else None
        try:
            if order is None:
                return cast(list[bytes | None], entry[0].get(list(keys)))
            found = cast(list[bytes | None], entry[0].get([keys[i] for i in order]))
        except Exception as exc:
            raise_translated(exc, f"get_many from table {table!r}")
        values: list[bytes | None] = [None] * len(keys)
        for i, value in zip(order, found, strict=True):
            values[i] = value
        return values

    def put(self, table: str, key: bytes, value: bytes) -> None:
        entry = self._families.get(table) or self._family(table)
        try:
            entry[0].put(key, value, self._write_options)
        except Exception as exc:
            raise_translated(exc, f"put into table {table!r}")

    def delete(self, table: str, key: bytes) -> None:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return
        try:
            entry[0].delete(key, self._write_options)
        except Exception as exc:
            raise_translated(exc, f"delete from table {table!r}")

    def batch(self) -> RocksDBWriteBatch:
        self._live()
        return RocksDBWriteBatch(self)

    def write(self, batch: WriteBatch) -> None:
        if not isinstance(batch, RocksDBWriteBatch) or batch._db is not self:
            raise TypeError("write() takes a batch made by this database's batch()")
        rdb = self._live()
        try:
            rdb.write(batch._wb, self._write_options)
        except Exception as exc:
            raise_translated(exc, "write batch")
        batch._wb = rocksdict.WriteBatch(raw_mode=True)

    def write_sorted(
        self, table: str, keys: Sequence[bytes], values: Sequence[bytes | None]
    ) -> None:
        """One batch below :data:`INGEST_MIN_ENTRIES` keys; from there one SST file written
        into the store's ``load/`` and ingested (moved into ``work/``): no memtable insert per
        key now and no memtable flush at commit, about half the cost of a batch at 100k keys
        (BENCHMARKS.md). Small sets stay batches: every ingestion adds a file to level 0."""
        if len(keys) < INGEST_MIN_ENTRIES:
            super().write_sorted(table, keys, values)
            return
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        self._live()
        store = self._store
        assert store is not None
        load = store.path / LOAD_DIR
        try:
            exported = shard_io.export_sorted(table, keys, values, load, self._options)
            self.import_files(exported.files, move=True)
        finally:
            remove_path(load)  # what a failed export or ingestion left (a moved file is gone)

    def items(
        self, table: str, *, start: bytes | None = None, end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return iter(())
        return shard_io.iterate_range(entry[0], table, start, end)

    def tables(self) -> list[str]:
        self._live()
        return sorted(self._families)

    # ---- metadata ----------------------------------------------------------------------------

    def get_step(self) -> Step:
        with translated("get_step"):
            raw = self._live().get(META_STEP)
        return Step(0 if raw is None else decode_u64(raw))

    def set_step(self, step: int) -> None:
        if type(step) is not int or not 0 <= step < 1 << 64:
            raise ValueError(f"step must be an int in 0..2**64-1, not {step!r}")
        with translated("set_step"):
            self._live().put(META_STEP, encode_u64(step), self._write_options)

    def get_layout(self) -> bytes | None:
        with translated("get_layout"):
            raw: bytes | None = self._live().get(META_LAYOUT)
        return raw

    def set_layout(self, layout: bytes) -> None:
        if not isinstance(layout, bytes):
            raise TypeError(f"layout must be bytes (e.g. JSON encoded), not {type(layout)}")
        with translated("set_layout"):
            self._live().put(META_LAYOUT, layout, self._write_options)

    # ---- shards -------------------------------------------------------------------------------

    def export_shards(self, shards: Iterable[int], directory: str | Path) -> ExportedShards:
        self._live()
        with self._create_lock:  # a writer in another thread may be adding a table
            tables = {table: view for table, (view, _) in self._families.items()}
        return shard_io.export_shards(tables, shards, directory, self._options)

    def export_keys(
        self, keys: Mapping[str, Iterable[bytes]], directory: str | Path
    ) -> ExportedShards:
        self._live()
        entries = {}
        for table, wanted in keys.items():
            ordered = sorted(set(wanted))
            entries[table] = dict(zip(ordered, self.get_many(table, ordered), strict=True))
        return shard_io.export_entries(entries, directory, self._options)

    def import_files(
        self, files: Mapping[str, Sequence[str | Path]], *, move: bool = False
    ) -> None:
        shard_io.import_files(lambda table: self._family(table)[0], files, move=move)

    def drop_shards(self, shards: Iterable[int]) -> None:
        batch = shard_io.drop_shards(self.batch, self.tables(), shards)
        if len(batch):
            self.write(batch)

    # ---- commit and close ----------------------------------------------------------------------

    def commit(self) -> None:
        rdb = self._live()
        store = self._store
        assert store is not None
        new = self._base + 1
        checkpoint = store._version_dir(new)
        try:
            with translated(f"committing version {new} of store {store.path}"):
                # Step 1. Record the version this state becomes.
                rdb.put(META_VERSION, encode_u64(new), self._write_options)
                failpoint("store.commit.before_flush")
                # Step 2. Flush every memtable (writes skip the WAL).
                for view, _ in self._families.values():
                    view.flush(True)
                rdb.flush(True)
                failpoint("store.commit.after_flush")
                # Step 3. Checkpoint into versions/<v+1> (hard links), durably.
                remove_path(checkpoint)
                remove_path(checkpoint.with_name(checkpoint.name + ".tmp"))
                rocksdict.Checkpoint(rdb).create_checkpoint(str(checkpoint))
                # Step 4. Publish VERSION = [v, v+1] (fsyncs the checkpoint first).
                store._committed(self._base, checkpoint)
        except BaseException:
            self._status = DatabaseStatus.CLOSED
            self._drop_handles()
            store._reload_versions()
            raise
        # Step 5. Close the working copy.
        self._status = DatabaseStatus.COMMITTED
        self._drop_handles()
        failpoint("store.commit.after_close")

    def close(self) -> None:
        if self._status is not DatabaseStatus.OPEN:
            return
        self._status = DatabaseStatus.CLOSED
        self._drop_handles()

    def __repr__(self) -> str:
        return f"RocksDBDatabase(base_version={self._base}, status={self._status.name})"
