"""The contract of a two-version worker store (seed 004, "Database"), independent of RocksDB.

A worker keeps its state in one store that holds **at most two committed versions**. The rules
(``v`` is always the version passed to :meth:`Store.open`):

- A new store has exactly one version, 0, which is empty (step 0, no tables, no layout).
  ``Store.create(path, version=v)`` makes a new empty store whose only version is ``v``.
- ``versions()`` is a ``range`` of length 1 or 2: the versions :meth:`Store.open` accepts.
- ``open(v)`` discards the version above ``v``, if any, and keeps the one below; reads and
  writes then go to ``v + 1``, which starts as a copy of ``v``. Version ``v`` itself never
  changes. So ``open(v)`` of ``{v - 1, v}`` keeps both, of ``{v, v + 1}`` keeps ``{v}``.
- ``commit()`` makes the working state version ``v + 1`` and discards the version below ``v``;
  afterwards ``versions()`` is ``range(v, v + 2)``, ``v`` unchanged, and the database is closed.
- ``close()`` (or any end other than commit: an exception, a crash, a SIGKILL) keeps what
  ``open`` kept: ``v`` and the version below it, if any.
- A crash at any instant, inside ``open`` and ``commit`` included, leaves ``versions()`` equal
  to what it was before the call or to what the call makes, and every version that can be
  opened holds exactly what was committed to it: uncommitted writes never reach a committed
  version.

Where this differs from seed 004, and why. Seed 004's ``open(v)`` discards every version but
``v``. Then a checkpoint must write its manifest (which names ``v + 1``) before it reopens the
stores at ``v + 1``, and the manifest must wait until the step log holds every step the stores
committed: the step loop stands still while the last step's transaction commits. Keeping the
version below ``v`` until the next commit lets the runtime reopen its stores at ``v + 1`` and
run the next step while the manifest still names ``v`` (and the last write commits); a crash
then recovers from ``v``, which every store still holds
(:meth:`~sparkstep.runtime.driver.Runtime.checkpoint`). Still at most two versions, and the one
a manifest names is never discarded before the next manifest is written.

Lifecycle, owned by :class:`Store` (one owner: the directory lock is held from construction to
:meth:`Store.close`)::

            Store(path) / Store.create(path, version=v)     [takes the directory lock]
                           |
                           v
     +-------------->  IDLE  ---------- close() ---------->  CLOSED  [lock released]
     |                   |
     |               open(v)         [discards the version > v; working copy = v]
     |                   v
     +-- commit() ---  OPEN(v)   [db: get/put/delete/write/write_sorted, set_step, shards, layout]
     +-- close() ----+

The database (:class:`Database`) refuses every call once committed or closed
(:class:`~sparkstep.storage.errors.StoreClosedError`).

Tables. A table is a named key-value map of bytes; it exists as soon as something is written to
it (an empty table and a missing table are the same thing: ``get`` returns ``None``). State keys
start with their shard (:mod:`sparkstep.storage.keys`), so shards can be moved in bulk.

Identity. A store records the deployment id and the fingerprint (state schema, ``S``, operator
names and key types; computed by the caller) the first time it is given them, and refuses to be
opened for another (:class:`~sparkstep.storage.errors.WrongDeploymentError`,
:class:`~sparkstep.storage.errors.WrongFingerprintError`). The layout is different: it changes at
rescale together with the data, so it lives **inside** each version (:meth:`Database.set_layout`)
and a crash before a rescale's manifest write rolls it back with the data.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from sparkstep.ids import ShardId, Step, Version

__all__ = ["Database", "DatabaseStatus", "ExportedShards", "Store", "WriteBatch"]


class DatabaseStatus(enum.Enum):
    """Where a :class:`Database` is in its life; only ``OPEN`` accepts calls.

    ::

        OPEN --commit()--> COMMITTED
          |
          +---close() / store.close() / a failed commit---> CLOSED
    """

    OPEN = "open"
    COMMITTED = "committed"
    CLOSED = "closed"


@dataclass(frozen=True)
class ExportedShards:
    """What :meth:`Database.export_shards` wrote: SST files per table, ready to import elsewhere.

    ``files`` maps a table name to the SST files holding that table's keys of ``shards`` (a
    table with no such keys has no entry). Pass ``files`` to :meth:`Database.import_files` of the
    receiving store. ``keys`` and ``bytes`` count what was exported (bytes = file sizes).
    """

    shards: tuple[ShardId, ...]
    files: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    keys: int = 0
    bytes: int = 0


class WriteBatch(abc.ABC):
    """Puts and deletes over several tables, applied all or nothing by :meth:`Database.write`.

    Build one with :meth:`Database.batch`, fill it, hand it to :meth:`Database.write`::

        batch = db.batch()
        batch.put("counts", shard_key(7, b"k"), b"3")
        batch.delete("markers", shard_key(7, b"old"))
        db.write(batch)          # atomic across tables; afterwards the batch is empty again

    Operations apply in the order they were added (a later put of a key wins over an earlier
    delete). A batch belongs to the database that made it; it is empty after a successful
    ``write`` and can be filled again. Nothing is visible to ``get`` until ``write``.
    """

    @abc.abstractmethod
    def put(self, table: str, key: bytes, value: bytes) -> None:
        """Set ``key`` to ``value`` in ``table`` when the batch is written."""

    @abc.abstractmethod
    def delete(self, table: str, key: bytes) -> None:
        """Remove ``key`` from ``table`` when the batch is written (no error if absent)."""

    @abc.abstractmethod
    def delete_range(self, table: str, begin: bytes, end: bytes) -> None:
        """Remove every key ``begin <= key < end`` of ``table`` when the batch is written."""

    def put_many(self, table: str, changes: Mapping[bytes, bytes | None]) -> None:
        """For each ``key -> value`` of ``changes`` in order: :meth:`put`, or :meth:`delete` when
        the value is ``None``. Same result as those calls one by one; implementations do it
        with one table lookup for the whole mapping."""
        for key, value in changes.items():
            if value is None:
                self.delete(table, key)
            else:
                self.put(table, key, value)

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of operations in the batch."""


class Database(abc.ABC):
    """A store opened at version ``base_version``; reads and writes go to ``base_version + 1``.

    Invariants:

    - Every write goes to the working copy only; committed versions never change.
    - ``get_step()`` is the step of the next step to apply; 0 in a new store.
    - :meth:`commit` publishes the working copy as ``base_version + 1`` and closes; :meth:`close`
      drops it. Either ends the database: every later call raises ``StoreClosedError``.
    - Used as a context manager, leaving the block without ``commit`` closes (see :meth:`close`).
    - Threads: reads and writes (``get``, ``put``, ``delete``, ``write``, ``items``) may come
      from several threads at once, as RocksDB allows; ``commit``, ``close``, the shard
      operations and the metadata setters must not run concurrently with anything else on the
      same database (the state worker serialises them).
    """

    @property
    @abc.abstractmethod
    def base_version(self) -> Version:
        """The version passed to ``open``; commit makes ``base_version + 1``."""

    @property
    @abc.abstractmethod
    def status(self) -> DatabaseStatus:
        """``OPEN`` until ``commit`` (``COMMITTED``) or ``close`` (``CLOSED``)."""

    @property
    def closed(self) -> bool:
        """True once the database was committed or closed."""
        return self.status is not DatabaseStatus.OPEN

    @abc.abstractmethod
    def get(self, table: str, key: bytes) -> bytes | None:
        """The value of ``key`` in ``table``, or ``None`` when absent (or the table is)."""

    @abc.abstractmethod
    def get_many(
        self, table: str, keys: Sequence[bytes], *, ascending: bool = False
    ) -> list[bytes | None]:
        """``[get(table, k) for k in keys]`` in one RocksDB multi-get. ``ascending``: the
        caller gives the keys in ascending order, so they are not sorted again (a multi-get in
        key order is 2-3x faster); keys out of order still get their values, only slower."""

    @abc.abstractmethod
    def put(self, table: str, key: bytes, value: bytes) -> None:
        """Set ``key`` to ``value`` in ``table`` (the table is created on first use)."""

    @abc.abstractmethod
    def delete(self, table: str, key: bytes) -> None:
        """Remove ``key`` from ``table``; no error when it is absent."""

    @abc.abstractmethod
    def batch(self) -> WriteBatch:
        """A new, empty :class:`WriteBatch` bound to this database."""

    @abc.abstractmethod
    def write(self, batch: WriteBatch) -> None:
        """Apply every operation of ``batch`` atomically across tables, then empty the batch."""

    def write_sorted(
        self, table: str, keys: Sequence[bytes], values: Sequence[bytes | None]
    ) -> None:
        """Set each of ``keys`` (ascending bytewise, each once) to its value in ``values``
        (``None`` deletes) in ``table``: the state one :meth:`write` of the same puts and
        deletes gives, and atomic like it. The default is one batch; a store may load a large
        set a cheaper way (RocksDB: one SST file written and ingested, no memtable).

        Raises ``ValueError`` if the lengths differ; a store that relies on the order may
        raise its own error for keys out of order (and then writes nothing).
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        batch = self.batch()
        for key, value in zip(keys, values, strict=True):
            if value is None:
                batch.delete(table, key)
            else:
                batch.put(table, key, value)
        self.write(batch)

    @abc.abstractmethod
    def items(
        self, table: str, *, start: bytes | None = None, end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` of ``table`` with ``start <= key < end``, ascending by key.

        The iterator reads a consistent snapshot taken when it is created; do not write to the
        same table while iterating if you need to see your own writes.
        """

    @abc.abstractmethod
    def tables(self) -> list[str]:
        """The names of the tables ever written in this state, sorted (some may be empty)."""

    @abc.abstractmethod
    def get_step(self) -> Step:
        """The next step to apply; 0 in a new store."""

    @abc.abstractmethod
    def set_step(self, step: int) -> None:
        """Record ``step`` as the next step to apply (committed with the data)."""

    @abc.abstractmethod
    def get_layout(self) -> bytes | None:
        """The layout stored in this state (opaque to the store), ``None`` if never set."""

    @abc.abstractmethod
    def set_layout(self, layout: bytes) -> None:
        """Store ``layout`` (opaque bytes, e.g. JSON) in the working state, versioned with it."""

    @abc.abstractmethod
    def export_shards(self, shards: Iterable[int], directory: str | Path) -> ExportedShards:
        """Write every key of ``shards``, of every table, into new SST files under ``directory``.

        Reads the working state (committed plus uncommitted writes); changes nothing. Internal
        metadata (step, layout) is never exported. ``directory`` is created if missing and must
        not already hold files of an earlier export with the same table names.
        """

    @abc.abstractmethod
    def export_keys(
        self, keys: Mapping[str, Iterable[bytes]], directory: str | Path
    ) -> ExportedShards:
        """Write the current state of ``keys`` (table -> keys) into new SST files under
        ``directory``: a key present is a put of its value, a key absent a deletion, so that
        importing the files over an older copy of those keys brings it to the state now.

        The answer's ``shards`` is empty and ``keys`` counts puts and deletions. Reads the
        working state; changes nothing. A table whose keys are all absent and unknown still
        gets its deletions (a key deleted since the older copy must be deleted there too).
        """

    @abc.abstractmethod
    def import_files(
        self, files: Mapping[str, Sequence[str | Path]], *, move: bool = False
    ) -> None:
        """Ingest SST files made by :meth:`export_shards` (table -> files) into the working state.

        ``move=True`` hard-links the files into the database instead of copying them (same file
        system; the caller must not use them afterwards).

        Each table's files are ingested atomically (one RocksDB ingestion per table). Across
        tables the import is not atomic inside the working copy, but the working copy only becomes
        a version at ``commit``, so a crash midway leaves no trace in any version. Imported keys
        overwrite existing ones; import shards the receiving store does not already hold.
        """

    @abc.abstractmethod
    def drop_shards(self, shards: Iterable[int]) -> None:
        """Delete every key of ``shards`` from every table, atomically (range deletions)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Publish the working state as ``base_version + 1`` and close the database.

        Afterwards ``versions() == range(base_version, base_version + 2)``: a version below
        ``base_version`` is discarded (module docstring). Costs time
        proportional to what changed since ``open``, not to the size of the state.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close without commit: the working state is dropped, the versions stay what ``open``
        left (``v``, and the version below it if there was one).

        Idempotent; a no-op after ``commit``.
        """

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Store(abc.ABC):
    """A worker's two-version store at one directory, locked by this object until ``close``.

    The constructor (of an implementation) takes the directory lock, creates a new store
    (version 0) when the directory holds none, and checks identity. ``versions`` and ``open``
    follow seed 004 (see the module docstring). At most one :class:`Database` is open at a time.
    """

    @property
    @abc.abstractmethod
    def path(self) -> Path:
        """The store's directory."""

    @property
    @abc.abstractmethod
    def deployment(self) -> str | None:
        """The deployment id recorded in the store, ``None`` until one is given."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str | None:
        """The fingerprint recorded in the store, ``None`` until one is given."""

    @abc.abstractmethod
    def record_identity(self, deployment: str | None, fingerprint: str | None) -> None:
        """Check ``deployment`` and ``fingerprint`` as the constructor does, and record each the
        store has none of yet (``None`` skips it). Raises ``WrongDeploymentError`` or
        ``WrongFingerprintError`` if the store recorded another one."""

    @property
    @abc.abstractmethod
    def fence(self) -> int:
        """The highest fencing token admitted (0: none ever was)."""

    @abc.abstractmethod
    def admit(self, token: int | None) -> None:
        """Admit a caller that holds fencing token ``token`` (or none).

        Fencing: each owner of the store (in sparkstep, each runtime process, by its generation)
        presents a token that is higher than every earlier owner's. A token above :attr:`fence`
        is recorded durably before ``admit`` returns, so from then on every lower token is
        refused, across restarts of this process. Raises ``StoreFencedError`` for a token below
        :attr:`fence`, or for ``None`` once any token was admitted (a caller without a token is
        only standalone use of a store no owner ever fenced). The caller must serialise
        ``admit`` with the calls it guards (the check is not a lease).
        """

    @abc.abstractmethod
    def versions(self) -> range:
        """The versions ``open`` accepts: ``range(v, v + 1)`` or ``range(v, v + 2)``."""

    @abc.abstractmethod
    def open(self, version: int) -> Database:
        """Discard the version above ``version`` (if any) and open a working copy of
        ``version``; the version below it stays until the next commit (see the module doc).

        Raises ``VersionNotAvailableError`` if ``version`` is not in ``versions()`` and
        ``StoreBusyError`` if a database of this store is still open.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the open database (without commit), if any, and release the lock. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
