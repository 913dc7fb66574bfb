"""The writes a worker's applies made since the last flush, held in memory over the open database.

Why. A step's apply reads every key its rows touch and writes every key it changes. Going to
RocksDB for both each step was most of a columnar kernel's time (a multi-get and a ``db.write``
of ~63k keys: 0.25 s of 0.42 s for a 100k-row count+sum batch), although nothing needs a step's
writes on disk: the working copy of an open store is never read after a crash (``open(v)``
starts again from committed version ``v``, and the runtime replays the logged steps after it).
So the applies write into a :class:`WriteBuffer`, and the buffer reaches the database in one
``db.write`` when it is flushed:

- before any call other than ``apply`` and ``status`` touches the database (commit, export,
  import, drop, set_layout, track, inspect, dump: the worker's ``_flushed_db``), so everything
  that reads or moves state files sees every apply;
- before a kernel scans a range of its table (``stateful_map``'s timers): a scan reads RocksDB;
- when its size passes ``limit_bytes`` after a write (0: after every write, which is what the
  worker did before the buffer).

Invariants:

- A read through the buffer (:meth:`get`, :meth:`get_many`) returns what a read of the database
  would return had every buffered write been written: a buffered value, a buffered deletion
  (``None``), or else the database's value.
- :meth:`write` applies all its changes or none, and :meth:`flush` writes the whole buffer in
  ONE ``db.write`` and empties it only once that write succeeded; a failed flush keeps every
  entry, so nothing an apply did is lost to the open database.
- The buffer lives as long as its database's open session: the worker makes a new one at every
  ``open`` and drops it, unflushed, when the database is committed (after a flush), closed or
  reopened. Dropping it is what ``close`` means: the working copy is discarded.

Memory. :attr:`size` is an upper bound of what the entries hold: every write adds its keys' and
values' lengths, and a fixed per-entry cost for each key new to the buffer; a rewrite of a key
adds its new value again without taking the old one off, so the buffer flushes early, never
late. Not thread-safe: the worker calls it under its ``db_lock``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_

from sparkstep.storage.base import Database

__all__ = ["DEFAULT_LIMIT_BYTES", "ENTRY_OVERHEAD", "WriteBuffer"]

DEFAULT_LIMIT_BYTES = 128 << 20
"""A worker's default buffer bound: 128 MiB (about a million small entries)."""
ENTRY_OVERHEAD = 112
"""What one buffered entry costs beyond its key and value bytes: two ``bytes`` headers and a
dict slot, as counted by :attr:`WriteBuffer.size`."""
_ABSENT = object()


class WriteBuffer:
    """Buffered writes (table -> key -> value, ``None`` a deletion) over ``db`` (module doc)."""

    def __init__(self, db: Database, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.db = db
        self.limit_bytes = limit_bytes
        self._tables: dict[str, dict[bytes, bytes | None]] = {}
        self._size = 0

    @property
    def size(self) -> int:
        """The upper bound of the buffer's memory in bytes (module doc); 0 when empty."""
        return self._size

    def __len__(self) -> int:
        """The number of buffered entries over all tables."""
        return sum(len(entries) for entries in self._tables.values())

    def get(self, table: str, key: bytes) -> bytes | None:
        """The value of ``key`` in ``table`` as if the buffer were flushed."""
        value = self._tables.get(table, {}).get(key, _ABSENT)
        return self.db.get(table, key) if value is _ABSENT else value  # type: ignore[return-value]

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """``[get(table, k) for k in keys]``, with one database multi-get for the keys the
        buffer does not hold."""
        entries = self._tables.get(table)
        if not entries:
            return self.db.get_many(table, keys)
        found = list(map(entries.get, keys, repeat(_ABSENT)))
        if _ABSENT in found:
            misses = list(compress(range(len(found)), map(is_, found, repeat(_ABSENT))))
            read = self.db.get_many(table, [keys[i] for i in misses])
            for i, value in zip(misses, read, strict=True):
                found[i] = value
        return found  # type: ignore[return-value]

    def write(self, changes: Sequence[tuple[str, Sequence[bytes], Sequence[bytes | None]]]) -> None:
        """Buffer ``changes`` (``(table, keys, values)`` triples, ``None`` a deletion, in order:
        a later write of a key wins), then flush if the buffer's size passed ``limit_bytes``.
        Every change is buffered before the flush, so a failed flush never splits a write."""
        for table, keys, values in changes:
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys but {len(values)} values for {table!r}")
            buffered = self._tables.setdefault(table, {})
            before = len(buffered)
            buffered.update(zip(keys, values, strict=True))
            self._size += (len(buffered) - before) * ENTRY_OVERHEAD
            self._size += sum(map(len, keys)) + sum(map(len, filter(None, values)))
        if self._size > self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Write every buffered entry to the database in one ``db.write``, then empty the
        buffer (kept whole if the write fails)."""
        if not self._tables:
            return
        batch = self.db.batch()
        for table, entries in self._tables.items():
            batch.put_many(table, entries)
        self.db.write(batch)
        self._tables.clear()
        self._size = 0
