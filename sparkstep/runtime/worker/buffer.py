"""The writes a worker's applies made since the last flush, held in memory over the open database.

Why. A step's apply reads every key its rows touch and writes every key it changes. Going to
RocksDB for both each step was most of a columnar kernel's time (a multi-get and a ``db.write``
of ~63k keys: 0.25 s of 0.42 s for a 100k-row count+sum batch), although nothing needs a step's
writes on disk: the working copy of an open store is never read after a crash (``open(v)``
starts again from committed version ``v``, and the runtime replays the logged steps after it).
So the applies write into a :class:`WriteBuffer`, and the buffer reaches the database when it
is flushed:

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
- :meth:`write` applies all its changes or none, and :meth:`flush` writes the whole buffer
  (one ``db.write_sorted`` per table) and empties it only once every write succeeded; a failed
  flush keeps every entry, so nothing an apply did is lost to the open database, and the next
  flush writes everything again. A flush is not atomic across tables, and need not be: the
  working copy is read only through the buffer until a flush succeeds, and is thrown away
  after a crash (``open(v)`` starts from a committed version).
- The buffer lives as long as its database's open session: the worker makes a new one at every
  ``open`` and drops it, unflushed, when the database is committed (after a flush), closed or
  reopened. Dropping it is what ``close`` means: the working copy is discarded.
- Entries a flush wrote stay as a read cache (*clean* runs), since they are what the database
  holds: a clean value is the database's value, a clean null the database's absence. So only
  something that changes the database other than through the buffer can make them wrong; the
  worker calls :meth:`forget_cache` before an import or a shard drop, and a commit hands the
  cache (:meth:`cache`) to the buffer of the next ``open`` only when it opens the very version
  the commit made (whose state is the flushed working copy). Before, every first step after a
  checkpoint read all its keys from RocksDB again (a multi-get of 63k keys: 140 ms).

How. A Python dict of bytes per key was the buffer until it cost more than the kernels it served
(a get and an update of 63k fresh keys: 80 ms of a 165 ms count+sum apply). Each table's
entries are now held as *runs*, each the entries of one write (or of merged writes) as Arrow
arrays sorted by a 64-bit hash of the key (``digest.hash_bytes``), each key at most once per
run. A read hashes the batch's keys once and finds them with ``numpy.searchsorted`` in the
newest run first, then the older ones, then the database; a hash match is confirmed by comparing
the keys (so a 64-bit collision costs a Python scan of that hash's few entries, never a wrong
answer). A write appends a run and merges it into the run before while it is at least half that
one's size (a merge of two hash-sorted runs is one stable sort, the older copy of a rewritten key
dropped), so a table holds O(log entries) runs and every entry is merged O(log) times.

Memory. A run's bytes are its keys' and values' bytes and :data:`ENTRY_OVERHEAD` per entry (a
key rewritten since its run was last merged counts again). :attr:`size` counts the unflushed
(*dirty*) runs, :attr:`cached_bytes` the clean ones; ``limit_bytes`` bounds the two together:
a write that passes it flushes, and a flush then drops clean runs, oldest first, until they
hold at most half of ``limit_bytes`` (so writes always have the other half, and a limit of 0
keeps no cache). Dropping the oldest is always safe: a newer run of a key hides an older one,
never the reverse. Not thread-safe: the worker calls it under its ``db_lock``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.operators.base import binary_layout
from sparkstep.runtime.worker.digest import hash_bytes
from sparkstep.storage.base import Database

__all__ = [
    "DEFAULT_LIMIT_BYTES",
    "ENTRY_OVERHEAD",
    "HashedEntries",
    "ReadCache",
    "Write",
    "WriteBuffer",
]

DEFAULT_LIMIT_BYTES = 128 << 20
"""A worker's default buffer bound: 128 MiB (about a million small entries)."""
ENTRY_OVERHEAD = 25
"""What one buffered entry costs beyond its key and value bytes, as counted by
:attr:`WriteBuffer.size`: its hash, the key's and the value's offsets, a validity bit."""
_LARGE = pa.large_binary()


class Write(NamedTuple):
    """One table's part of :meth:`WriteBuffer.write`: aligned ``keys`` and ``values`` (lists or
    binary arrays, ``None``/null a deletion), and the keys' ``hash_bytes`` when the caller has
    them (else the buffer computes them)."""

    table: str
    keys: Sequence[bytes] | pa.Array
    values: Sequence[bytes | None] | pa.Array
    hashes: np.ndarray | None = None


@dataclass(frozen=True)
class HashedEntries:
    """Entries sorted by ``hashes`` (uint64, ``hash_bytes`` of the key), each key once:
    ``keys`` and ``values`` large_binary, a null value a deletion (in the buffer) or an absent
    key (in a worker's record of its reads). A buffer's run, found with :meth:`find`."""

    hashes: np.ndarray
    keys: pa.Array
    values: pa.Array

    @classmethod
    def of(
        cls,
        keys: pa.Array,
        values: pa.Array,
        hashes: np.ndarray | None = None,
        *,
        sorted_parts: bool = False,
    ) -> HashedEntries:
        """The run of ``keys -> values`` in that order, where a later entry of a key replaces
        an earlier one. ``hashes``: the keys' hashes, when known. ``sorted_parts``: the input
        is runs laid one after another (a merge), which a stable sort merges in linear time;
        otherwise the hashes are sorted by quicksort (2-3x faster than a stable sort on
        random hashes), and stably only when three or more entries share a hash."""
        if hashes is None:
            hashes = hash_bytes(keys)
        stable = sorted_parts
        order = np.argsort(hashes, kind="stable" if stable else "quicksort")
        ordered = hashes[order]
        same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if not stable and np.any(same[1:] == same[:-1] + 1):
            stable = True  # a group of 3+: only input order can pick the last of a key
            order = np.argsort(hashes, kind="stable")
            ordered = hashes[order]
            same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(same):
            equal = pc.equal(keys.take(order[same]), keys.take(order[same + 1]))
            equal_np = equal.to_numpy(zero_copy_only=False)
            keep = np.ones(len(order), dtype=bool)
            # Of two neighbours with one key, drop the earlier in the input.
            earlier = np.where(order[same] < order[same + 1], same, same + 1)
            keep[earlier[equal_np]] = False
            collided = same[~equal_np]
            if stable and len(collided):  # a pair of different keys needs nothing
                keep &= _last_of_each_key(ordered, keys.take(order), collided)
            order = order[keep]
        return cls(hashes[order], keys.take(order), values.take(order))

    @cached_property
    def nbytes(self) -> int:
        """The run's bytes as :class:`WriteBuffer` counts them (module doc, "Memory")."""
        return len(self.hashes) * ENTRY_OVERHEAD + _data_bytes(self.keys) + _data_bytes(self.values)

    def find(self, hashes: np.ndarray, keys: pa.Array) -> np.ndarray:
        """Each of ``keys``' position in this run, -1 where absent (``hashes``: theirs)."""
        n = len(self.hashes)
        found = np.full(len(keys), -1, dtype=np.int64)
        if n == 0 or len(keys) == 0:
            return found
        at = np.searchsorted(self.hashes, hashes)
        hit = np.flatnonzero(self.hashes[np.minimum(at, n - 1)] == hashes)
        hit = hit[at[hit] < n]
        equal = pc.equal(self.keys.take(at[hit]), keys.take(hit)).to_numpy(zero_copy_only=False)
        found[hit[equal]] = at[hit[equal]]
        for q in hit[~equal].tolist():  # a 64-bit collision: scan the hash's entries
            wanted = keys[q].as_py()
            j = int(at[q]) + 1
            while j < n and self.hashes[j] == hashes[q]:
                if self.keys[j].as_py() == wanted:
                    found[q] = j
                    break
                j += 1
        return found

    def lookup(self, hashes: np.ndarray, keys: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """The values of ``keys`` (``hashes``: theirs), null where absent, and which are
        present."""
        at = self.find(hashes, keys)
        hit = at >= 0
        return self.values.take(pa.array(at, mask=~hit)), hit


def _last_of_each_key(hashes: np.ndarray, keys: pa.Array, collided: np.ndarray) -> np.ndarray:
    """Where two neighbours share a hash but not a key (a 64-bit collision, so rare), keep
    only the last entry of each key in each such group of equal hashes (Python per entry)."""
    keep = np.ones(len(hashes), dtype=bool)
    done: set[int] = set()
    for start in collided.tolist():
        while start and hashes[start - 1] == hashes[start]:
            start -= 1
        if start in done:
            continue
        done.add(start)
        end = start
        while end + 1 < len(hashes) and hashes[end + 1] == hashes[start]:
            end += 1
        last: dict[bytes, int] = {}
        for j in range(start, end + 1):
            last[keys[j].as_py()] = j
        keep[start : end + 1] = False
        keep[list(last.values())] = True
    return keep


def _data_bytes(array: pa.Array) -> int:
    """The bytes of a binary array's values."""
    return len(binary_layout(array)[1])


def _large(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        return pa.array(values, _LARGE)
    return values if values.type == _LARGE else values.cast(_LARGE)


@dataclass(frozen=True)
class ReadCache:
    """The clean runs of a flushed :class:`WriteBuffer` (per table, oldest first): what it knew
    its database held, handed to the buffer of a database that holds the same state."""

    runs: Mapping[str, tuple[HashedEntries, ...]]


class WriteBuffer:
    """Buffered writes (per table, runs of key -> value, null a deletion) over ``db``, and the
    entries of earlier flushes as a read cache (module doc). ``cache``: clean runs to start
    with, which the caller vouches ``db`` holds (:meth:`cache` of the buffer whose flush wrote
    them, with nothing written to the database since but by a commit)."""

    def __init__(
        self, db: Database, limit_bytes: int = DEFAULT_LIMIT_BYTES, cache: ReadCache | None = None
    ) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.db = db
        self.limit_bytes = limit_bytes
        self._runs: dict[str, list[HashedEntries]] = {}
        # Per table, how many of the oldest runs are clean (the rest are dirty, newer).
        self._clean: dict[str, int] = {}
        for table, runs in (cache.runs if cache is not None else {}).items():
            self._runs[table] = list(runs)
            self._clean[table] = len(runs)
        self._trim_cache()

    @property
    def size(self) -> int:
        """The bytes of the unflushed runs, as counted in the module doc; 0 when flushed."""
        return sum(run.nbytes for _, run in self._dirty_runs())

    @property
    def cached_bytes(self) -> int:
        """The bytes of the clean runs (the read cache)."""
        return sum(run.nbytes for _, run in self._clean_runs())

    def __len__(self) -> int:
        """The number of unflushed entries over all tables and runs."""
        return sum(len(run.hashes) for _, run in self._dirty_runs())

    def _dirty_runs(self) -> list[tuple[str, HashedEntries]]:
        return [(t, r) for t, runs in self._runs.items() for r in runs[self._clean.get(t, 0) :]]

    def _clean_runs(self) -> list[tuple[str, HashedEntries]]:
        return [(t, r) for t, runs in self._runs.items() for r in runs[: self._clean.get(t, 0)]]

    def get(self, table: str, key: bytes) -> bytes | None:
        """The value of ``key`` in ``table`` as if the buffer were flushed."""
        return self.get_many(table, [key])[0]

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """``[get(table, k) for k in keys]``."""
        if not self._runs.get(table):
            return self.db.get_many(table, keys)
        return self.get_array(table, pa.array(keys, _LARGE)).to_pylist()  # type: ignore[no-any-return]

    def get_array(self, table: str, keys: pa.Array, hashes: np.ndarray | None = None) -> pa.Array:
        """:meth:`get_many` for a binary array of keys (``hashes``: their ``hash_bytes``, when
        the caller has them): a large_binary array aligned with ``keys``, null where absent; one
        database multi-get for the keys no run (dirty or clean) holds."""
        keys = _large(keys)
        runs = self._runs.get(table)
        if not runs:
            return pa.array(self.db.get_many(table, keys.to_pylist()), _LARGE)
        if hashes is None:
            hashes = hash_bytes(keys)
        pending = np.arange(len(keys), dtype=np.int64)
        where: list[np.ndarray] = []
        pieces: list[pa.Array] = []
        for run in reversed(runs):  # the newest first
            whole = len(pending) == len(keys)
            at = run.find(
                hashes if whole else hashes[pending], keys if whole else keys.take(pending)
            )
            hit = at >= 0
            where.append(pending[hit])
            pieces.append(run.values.take(at[hit]))
            pending = pending[~hit]
            if not len(pending):
                break
        if len(pending):
            wanted = keys.take(pending).to_pylist()
            where.append(pending)
            pieces.append(pa.array(self.db.get_many(table, wanted), _LARGE))
        if len(pieces) == 1:  # every key found in the newest run, in order
            return pieces[0]
        inverse = np.empty(len(keys), dtype=np.int64)
        inverse[np.concatenate(where)] = np.arange(len(keys), dtype=np.int64)
        return pa.concat_arrays(pieces).take(inverse)

    def write(self, changes: Sequence[Write]) -> None:
        """Buffer ``changes`` (in order: a later write of a key wins), then flush if the
        buffer's size and its cache's passed ``limit_bytes``. Every change is buffered before
        the flush, so a failed flush never splits a write."""
        written: dict[str, list[tuple[pa.Array, pa.Array, np.ndarray]]] = {}
        for table, keys, values, hashes in changes:
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys but {len(values)} values for {table!r}")
            if len(keys):
                key_array = _large(keys)
                known = hash_bytes(key_array) if hashes is None else hashes
                written.setdefault(table, []).append((key_array, _large(values), known))
        built = [
            (
                table,
                HashedEntries.of(
                    pa.concat_arrays([k for k, _, _ in parts]),
                    pa.concat_arrays([v for _, v, _ in parts]),
                    np.concatenate([h for _, _, h in parts]),
                ),
            )
            for table, parts in written.items()
        ]
        for table, run in built:
            self._runs.setdefault(table, []).append(run)
            self._merge_newest(table)
        if self.size + self.cached_bytes > self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Write every dirty entry to the database; they become clean (the cache, trimmed to
        half of ``limit_bytes``). Each table's dirty runs are merged (the newest value of a key
        wins), sorted by key and written with one ``db.write_sorted``: one batch, or for a
        large table one SST file ingested (see ``storage.database``). Tables are written one
        after another, and the runs turn clean only once every table was written, so a failed
        flush may leave some written; the buffer still has every entry dirty, every read still
        sees them, and the next flush writes them all again, which gives the same state."""
        flushed: dict[str, HashedEntries] = {}
        for table, runs in self._runs.items():
            dirty = runs[self._clean.get(table, 0) :]
            if not dirty:
                continue
            entries = dirty[0] if len(dirty) == 1 else _merged(dirty)
            order = pc.sort_indices(entries.keys)
            self.db.write_sorted(
                table,
                entries.keys.take(order).to_pylist(),
                entries.values.take(order).to_pylist(),
            )
            flushed[table] = entries
        for table, entries in flushed.items():
            runs = self._runs[table]
            runs[self._clean.get(table, 0) :] = [entries]
            self._clean[table] = len(runs)
            self._merge_newest(table)
        self._trim_cache()

    def cache(self) -> ReadCache:
        """The clean runs, for the buffer of the database the next commit makes (module doc).
        Only a flushed buffer's cache is the whole truth about what it held, so a buffer with
        dirty entries refuses (ValueError)."""
        if self._dirty_runs():
            raise ValueError("the buffer holds unflushed writes: flush it before taking its cache")
        return ReadCache({table: tuple(runs) for table, runs in self._runs.items() if runs})

    def forget_cache(self) -> None:
        """Drop every clean run: the caller is about to change the database around the buffer
        (an import, a shard drop). Dirty runs stay."""
        for table, clean in self._clean.items():
            del self._runs[table][:clean]
        self._clean.clear()

    def _merge_newest(self, table: str) -> None:
        """Merge the table's newest run into the one before while it is at least half that
        one's size and both are dirty or both clean: O(log entries) runs per side."""
        runs = self._runs[table]
        clean = self._clean.get(table, 0)
        floor = clean if len(runs) > clean else 0  # the oldest run the newest may merge into
        while len(runs) - floor > 1 and 2 * len(runs[-1].hashes) >= len(runs[-2].hashes):
            runs[-2:] = [_merged(runs[-2:])]
            if floor == 0 and clean:  # all clean: the count shrinks with the runs
                clean = self._clean[table] = len(runs)

    def _trim_cache(self) -> None:
        """Drop clean runs, oldest first from the table caching most, until they hold at most
        half of ``limit_bytes``."""
        budget = self.limit_bytes // 2
        held = {t: sum(r.nbytes for r in self._runs[t][:c]) for t, c in self._clean.items()}
        while sum(held.values()) > budget:
            table = max(held, key=lambda t: held[t])
            dropped = self._runs[table].pop(0)
            held[table] -= dropped.nbytes
            self._clean[table] -= 1
            if not self._clean[table]:
                del self._clean[table], held[table]


def _merged(runs: Sequence[HashedEntries]) -> HashedEntries:
    """One run of ``runs`` (oldest first): the newest value of each key."""
    return HashedEntries.of(
        pa.concat_arrays([run.keys for run in runs]),
        pa.concat_arrays([run.values for run in runs]),
        np.concatenate([run.hashes for run in runs]),
        sorted_parts=True,
    )
