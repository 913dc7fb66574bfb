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
- Each table's entries of its last flush stay as its read cache, since they are what the
  database holds: a cached value is the database's value, a cached null the database's
  absence. So only something that changes the database other than through the buffer can make
  them wrong; the worker calls :meth:`forget_cache` before an import or a shard drop, and a
  commit hands the cache (:meth:`cache`) to the buffer of the next ``open`` only when it opens
  the very version the commit made (whose state is the flushed working copy). Before, every
  first step after a checkpoint read all its keys from RocksDB again (a multi-get of 63k keys:
  140 ms). Only the last flush's entries: merging each flush into the cache cost more than it
  saved when most keys are new (``distinct``), and the keys a checkpoint's steps wrote are the
  ones the next steps are likeliest to read.

How. A Python dict of bytes per key was the buffer until it cost more than the kernels it served
(a get and an update of 63k fresh keys: 80 ms of a 165 ms count+sum apply). Each table's
entries are now held as *runs*, each the entries of one write (or of merged writes): Arrow
arrays of keys and values as written, the keys' 64-bit hashes (``digest.hash_bytes``) sorted,
and each entry's slot in the arrays; each key at most once per run. Building or merging a run
sorts hashes and slots only: keys and values move when read, flushed, or when a merge finds
the older copies of rewritten keys the majority of the entries or of their bytes and drops
them. A read hashes the batch's keys once, sorts the hashes, and finds them with
``numpy.searchsorted`` in the newest run first, then the older ones, then the database; a hash
match is confirmed by comparing the keys (so a 64-bit collision costs a Python scan of that
hash's few entries, never a wrong answer). A write appends a run and merges it into the run
before while it is at least half that one's size (a merge of two hash-sorted runs is one
stable sort, the older copy of a rewritten key dropped), so a table holds O(log entries) runs
and every entry is merged O(log) times.

Memory. A run's bytes are its keys' and values' bytes, dead slots included, and
:data:`ENTRY_OVERHEAD` per entry (a key rewritten since its run was last merged counts again).
:attr:`size` counts the unflushed runs, :attr:`cached_bytes` the cache; ``limit_bytes`` bounds
the two together: a write that passes it flushes, and a flush then cuts tables' caches, the
largest first, until they hold at most half of ``limit_bytes`` (so writes always have the other
half, and a limit of 0 keeps no cache). A cut table keeps the entries of its lowest hashes that
fit (a sample of its keys): before, a table whose cache passed the bound kept none of it, so a
state of a little more than 64 MiB (a join's rows, by default) read every key from RocksDB
after each flush. Cutting or dropping a cache is always safe: the database has the same
entries. Not thread-safe: the worker calls it under its ``db_lock``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.hashing import word_rows
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
    "key_order",
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
    """Entries sorted by ``hashes`` (uint64, ``hash_bytes`` of the key), each key once. The
    i-th entry in hash order is ``keys[slots[i]] -> values[slots[i]]`` (large_binary arrays
    in the order they were written, so that building or merging runs moves no key or value);
    a null value is a deletion (in the buffer) or an absent key (in a worker's record of its
    reads). Slots no entry names hold older values of rewritten keys: dead, counted in
    :attr:`nbytes`, and dropped by the merge that finds them the majority of the entries or of
    their bytes. A buffer's run, found with :meth:`find`."""

    hashes: np.ndarray
    slots: np.ndarray
    keys: pa.Array
    values: pa.Array

    @classmethod
    def of(
        cls,
        keys: pa.Array,
        values: pa.Array,
        hashes: np.ndarray | None = None,
        *,
        slots: np.ndarray | None = None,
        sorted_parts: bool = False,
    ) -> HashedEntries:
        """The run of entries ``i = 0, 1, ...``, entry ``i`` being ``keys[slots[i]] ->
        values[slots[i]]`` (``slots``: all of ``keys`` in order by default) with hash
        ``hashes[i]`` (computed when not given, which needs the default ``slots``), where a
        later entry of a key replaces an earlier one. ``sorted_parts``: the entries are runs
        laid one after another (a merge), which a stable sort merges in linear time; otherwise
        the hashes are sorted by quicksort (2-3x faster than a stable sort on random hashes),
        and stably only when three or more entries share a hash."""
        if hashes is None:
            if slots is not None:
                raise ValueError("the hashes of entries in given slots must be given")
            hashes = hash_bytes(keys)
        if slots is None:
            slots = np.arange(len(keys), dtype=np.int64)
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
            first, second = slots[order[same]], slots[order[same + 1]]
            equal = pc.equal(keys.take(first), keys.take(second))
            equal_np = equal.to_numpy(zero_copy_only=False)
            keep = np.ones(len(order), dtype=bool)
            # Of two neighbours with one key, drop the earlier in the input.
            earlier = np.where(order[same] < order[same + 1], same, same + 1)
            keep[earlier[equal_np]] = False
            collided = same[~equal_np]
            if stable and len(collided):  # a pair of different keys needs nothing
                keep &= _last_of_each_key(ordered, keys.take(slots[order]), collided)
            order = order[keep]
        live = slots[order]
        if len(live) < len(keys) and _mostly_dead(keys, values, live):
            keys, values = keys.take(live), values.take(live)  # keep only the live entries
            live = np.arange(len(live), dtype=np.int64)
        return cls(hashes[order], live, keys, values)

    @cached_property
    def nbytes(self) -> int:
        """The run's bytes as :class:`WriteBuffer` counts them (module doc, "Memory")."""
        return len(self.hashes) * ENTRY_OVERHEAD + _data_bytes(self.keys) + _data_bytes(self.values)

    def within(self, nbytes: int) -> HashedEntries | None:
        """The entries of the lowest hashes whose bytes (as :attr:`nbytes` counts them, dead
        slots dropped) add up to at most ``nbytes``, in arrays of their own; None if not even
        one fits. Hashes are uniform, so they are a sample of the keys whatever their sizes."""
        sizes = _slot_bytes(self.keys, self.values)[self.slots] + ENTRY_OVERHEAD
        n = int(np.searchsorted(np.cumsum(sizes), nbytes, side="right"))
        if n == 0:
            return None
        slots = self.slots[:n]
        return HashedEntries(
            self.hashes[:n],
            np.arange(n, dtype=np.int64),
            self.keys.take(slots),
            self.values.take(slots),
        )

    def keys_at(self, positions: np.ndarray) -> pa.Array:
        """The keys of the entries at ``positions`` (in hash order)."""
        return self.keys.take(self.slots[positions])

    def values_at(self, positions: np.ndarray) -> pa.Array:
        """The values of the entries at ``positions`` (in hash order)."""
        return self.values.take(self.slots[positions])

    def find(self, hashes: np.ndarray, keys: pa.Array) -> np.ndarray:
        """Each of ``keys``' position in this run, -1 where absent (``hashes``: theirs)."""
        n = len(self.hashes)
        found = np.full(len(keys), -1, dtype=np.int64)
        if n == 0 or len(keys) == 0:
            return found
        at = np.searchsorted(self.hashes, hashes)
        hit = np.flatnonzero(self.hashes[np.minimum(at, n - 1)] == hashes)
        hit = hit[at[hit] < n]
        equal = pc.equal(self.keys_at(at[hit]), keys.take(hit)).to_numpy(zero_copy_only=False)
        found[hit[equal]] = at[hit[equal]]
        for q in hit[~equal].tolist():  # a 64-bit collision: scan the hash's entries
            wanted = keys[q].as_py()
            j = int(at[q]) + 1
            while j < n and self.hashes[j] == hashes[q]:
                if self.keys[int(self.slots[j])].as_py() == wanted:
                    found[q] = j
                    break
                j += 1
        return found

    def lookup(self, hashes: np.ndarray, keys: pa.Array) -> tuple[pa.Array, np.ndarray]:
        """The values of ``keys`` (``hashes``: theirs), null where absent, and which are
        present."""
        at = self.find(hashes, keys)
        hit = at >= 0
        picked = np.zeros(len(at), dtype=np.int64)
        picked[hit] = self.slots[at[hit]]
        return self.values.take(pa.array(picked, mask=~hit)), hit

    def sorted_by_key(self) -> tuple[pa.Array, pa.Array]:
        """The entries' keys and values in key order (what ``Database.write_sorted`` takes)."""
        keys = self.keys.take(self.slots)
        order = key_order(keys)
        return keys.take(order), self.values.take(self.slots[order])


_WORDS_MAX = 4
"""The longest keys :func:`key_order` sorts as words: 4 words, 32 bytes."""


def key_order(keys: pa.Array) -> np.ndarray:
    """The order that sorts binary ``keys`` (no nulls) bytewise, ties in input order.

    Keys all of one length up to 32 bytes (every key of a table keyed by integer columns) are
    sorted as big-endian 64-bit words, zero-padded (equal lengths, so the padding orders
    nothing), leaving out the words every key shares: 1.3-2x faster than Arrow's sort of
    binary values, which the keys of other lengths get."""
    n = len(keys)
    offsets, raw = binary_layout(keys)
    lengths = np.diff(offsets)
    length = int(lengths[0]) if n else 0
    if not n or not 0 < length <= 8 * _WORDS_MAX or (lengths != length).any():
        return pc.sort_indices(keys).to_numpy()  # type: ignore[no-any-return]
    as_words = word_rows(raw, n, length).view(">u8").astype(np.uint64)
    varying = [
        as_words[:, j] for j in range(as_words.shape[1]) if (as_words[:, j] != as_words[0, j]).any()
    ]
    if not varying:
        return np.arange(n, dtype=np.int64)
    if len(varying) == 1:
        return np.argsort(varying[0], kind="stable")
    return np.lexsort(varying[::-1])


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


def _mostly_dead(keys: pa.Array, values: pa.Array, live: np.ndarray) -> bool:
    """Whether the dead slots (all but ``live``) are the majority of the entries or of their
    bytes: a few large values rewritten (a hot key's join rows or min/max multiset) are worth
    dropping as soon as many small ones."""
    if 2 * len(live) < len(keys):
        return True
    sizes = _slot_bytes(keys, values)
    return 2 * int(sizes[live].sum()) < int(sizes.sum())


def _slot_bytes(keys: pa.Array, values: pa.Array) -> np.ndarray:
    """The bytes of each slot's key and value (int64, one per slot of the arrays)."""
    key_sizes, value_sizes = (np.diff(binary_layout(a)[0]) for a in (keys, values))
    sizes: np.ndarray = key_sizes + value_sizes
    return sizes


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
    """A flushed :class:`WriteBuffer`'s cache (per table, the entries of its last flush): what
    it knew its database held, handed to the buffer of a database that holds the same state."""

    tables: Mapping[str, HashedEntries]


class WriteBuffer:
    """Buffered writes (per table, runs of key -> value, null a deletion) over ``db``, and the
    entries of each table's last flush as a read cache (module doc). ``cache``: the cache to
    start with, which the caller vouches ``db`` holds (:meth:`cache` of the buffer whose flush
    wrote it, with nothing written to the database since but by a commit)."""

    def __init__(
        self, db: Database, limit_bytes: int = DEFAULT_LIMIT_BYTES, cache: ReadCache | None = None
    ) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.db = db
        self.limit_bytes = limit_bytes
        self._runs: dict[str, list[HashedEntries]] = {}
        self._cache: dict[str, HashedEntries] = dict(cache.tables) if cache is not None else {}
        self._trim_cache()

    @property
    def size(self) -> int:
        """The bytes of the unflushed runs, as counted in the module doc; 0 when flushed."""
        return sum(run.nbytes for runs in self._runs.values() for run in runs)

    @property
    def cached_bytes(self) -> int:
        """The bytes of the read cache."""
        return sum(entries.nbytes for entries in self._cache.values())

    def __len__(self) -> int:
        """The number of unflushed entries over all tables and runs."""
        return sum(len(run.hashes) for runs in self._runs.values() for run in runs)

    def get(self, table: str, key: bytes) -> bytes | None:
        """The value of ``key`` in ``table`` as if the buffer were flushed."""
        return self.get_many(table, [key])[0]

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """``[get(table, k) for k in keys]``."""
        if not self._runs.get(table) and table not in self._cache:
            return self.db.get_many(table, keys)
        return self.get_array(table, pa.array(keys, _LARGE)).to_pylist()  # type: ignore[no-any-return]

    def get_array(self, table: str, keys: pa.Array, hashes: np.ndarray | None = None) -> pa.Array:
        """:meth:`get_many` for a binary array of keys (``hashes``: their ``hash_bytes``, when
        the caller has them): a large_binary array aligned with ``keys``, null where absent;
        the unflushed runs newest first, then the cache, then one database multi-get for the
        keys none of them holds, in key order (:func:`key_order`: RocksDB answers a sorted
        multi-get 2-3x faster, and the database need not sort them in Python)."""
        keys = _large(keys)
        if not len(keys):
            return keys
        runs = self._runs.get(table, [])
        cached = self._cache.get(table)
        searched = [cached, *runs] if cached is not None else runs
        pending = np.arange(len(keys), dtype=np.int64)
        if searched:
            # Searched in hash order: a binary search for sorted hashes stays in the part of
            # the run the last one ended in (100k keys in a run of 300k: 2 ms, 15 in random
            # order).
            hashes = hash_bytes(keys) if hashes is None else hashes
            pending = np.argsort(hashes)
        where: list[np.ndarray] = []
        pieces: list[pa.Array] = []
        for run in reversed(searched):  # the newest first
            assert hashes is not None
            at = run.find(hashes[pending], keys.take(pending))
            hit = at >= 0
            where.append(pending[hit])
            pieces.append(run.values_at(at[hit]))
            pending = pending[~hit]
            if not len(pending):
                break
        if len(pending):
            wanted = keys.take(pending)
            order = key_order(wanted)
            found = self.db.get_many(table, wanted.take(order).to_pylist(), ascending=True)
            where.append(pending[order])
            pieces.append(pa.array(found, _LARGE))
        inverse = np.empty(len(keys), dtype=np.int64)
        inverse[np.concatenate(where)] = np.arange(len(keys), dtype=np.int64)
        return pa.concat_arrays(pieces).take(inverse)

    def write(self, changes: Sequence[Write], *, flush: bool = True) -> None:
        """Buffer ``changes`` (in order: a later write of a key wins), then, with ``flush``,
        :meth:`flush_if_full`. Every change is buffered before the flush, so a failed flush
        never splits a write. ``flush=False`` leaves the flush to the caller's
        :meth:`flush_if_full`, for a caller that must record something once the changes are
        in the buffer, whether or not the flush succeeds (the worker's apply markers)."""
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
            runs = self._runs.setdefault(table, [])
            runs.append(run)
            while len(runs) > 1 and 2 * len(runs[-1].hashes) >= len(runs[-2].hashes):
                runs[-2:] = [_merged(runs[-2:])]
        if flush:
            self.flush_if_full()

    def flush_if_full(self) -> None:
        """:meth:`flush` if the buffer's size and its cache's passed ``limit_bytes``."""
        if self.size + self.cached_bytes > self.limit_bytes:
            self.flush()

    def flush(self) -> None:
        """Write every buffered entry to the database, then empty the buffer (kept whole if a
        write fails); each table's written entries become its cache (trimmed to half of
        ``limit_bytes``). Each table's runs are merged (the newest value of a key wins), sorted
        by key and written with one ``db.write_sorted``: one batch, or for a large table one
        SST file ingested (see ``storage.database``). Tables are written one after another, so
        a failed flush may leave some written; the buffer still has every entry, every read
        still sees them, and the next flush writes them all again, which gives the same
        state."""
        flushed: dict[str, HashedEntries] = {}
        for table, runs in self._runs.items():
            entries = runs[0] if len(runs) == 1 else _merged(runs)
            keys, values = entries.sorted_by_key()
            self.db.write_sorted(table, keys.to_pylist(), values.to_pylist())
            flushed[table] = entries
        self._runs.clear()
        self._cache.update(flushed)
        self._trim_cache()

    def cache(self) -> ReadCache:
        """The read cache, for the buffer of the database the next commit makes (module doc).
        Only a flushed buffer's cache agrees with the database about every key it holds, so a
        buffer with unflushed entries refuses (ValueError)."""
        if self._runs:
            raise ValueError("the buffer holds unflushed writes: flush it before taking its cache")
        return ReadCache(dict(self._cache))

    def forget_cache(self) -> None:
        """Drop the read cache: the caller is about to change the database other than through
        the buffer (an import, a shard drop). Unflushed entries stay."""
        self._cache.clear()

    def _trim_cache(self) -> None:
        """Cut tables' caches, the largest first, until they hold at most half of
        ``limit_bytes``: the largest keeps what fits beside the others
        (:meth:`HashedEntries.within`), or nothing, and the next largest is cut if that was
        not enough. Any part of a flush's entries is a valid cache: each is what the database
        holds."""
        excess = self.cached_bytes - self.limit_bytes // 2
        while self._cache and excess > 0:
            table = max(self._cache, key=lambda t: self._cache[t].nbytes)
            entries = self._cache.pop(table)
            kept = entries.within(entries.nbytes - excess)
            if kept is not None:
                self._cache[table] = kept
            excess -= entries.nbytes - (0 if kept is None else kept.nbytes)


def _merged(runs: Sequence[HashedEntries]) -> HashedEntries:
    """One run of ``runs`` (oldest first): the newest value of each key."""
    starts = np.cumsum([0] + [len(run.keys) for run in runs[:-1]])
    return HashedEntries.of(
        pa.concat_arrays([run.keys for run in runs]),
        pa.concat_arrays([run.values for run in runs]),
        np.concatenate([run.hashes for run in runs]),
        slots=np.concatenate([run.slots + start for run, start in zip(runs, starts, strict=True)]),
        sorted_parts=True,
    )
