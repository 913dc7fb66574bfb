"""``join``: incremental inner equi-join of two keyed Z-sets (the bilinear rule).

For inputs L and R with integrals ``L_old``/``R_old`` before a batch, a batch ``dL`` on the left
produces ``dL join R_old`` and a batch ``dR`` on the right produces ``L_now join dR``. One
``apply`` carries one side (``ApplyContext.input_index``: 0 left, 1 right); when both sides
change in a step, the two applies give ``dL join R_old + L_new join dR`` (left first) or
``L_old join dR + dL join R_new`` (right first): the same Z-set, since
``(L + dL) join (R + dR) - L join R`` is both. The weight of a joined row is the product of the
weights. Output schema: key columns, the left's other user columns, the right's other user
columns, ``__weight``; output is consolidated (one row per distinct joined row, weight != 0).
Null keys never match (SQL).

State layout. A side's multiset of rows for a key is held as one or more *runs*, each a
multiset of rows (consolidated within the run: each row once, multiplicity != 0); the key's
multiset is their sum. With ``K = shard prefix + side byte (b"L" or b"R") + enc([key
values...])``::

    K                            = the newest run's rows: w little-endian int64 words each, the
                                   row's c column words, its null mask (ceil(c / 64) words), its
                                   multiplicity; then, when the key has older runs, the *index*:
                                   their row counts, oldest first, as int64 LE words, and their
                                   number as one byte; no entry when there is neither
    K + bytes([j])               = the bytes of string column j (numbered among the side's
                                   string columns, j < 255) of the newest run's rows, one after
                                   another in row order; no entry when they are all empty
    K + b"\xff" + bytes([p])     = older run p's rows (as the newest's), p = 0 the oldest
    K + b"\xff" + bytes([p, j])  = older run p's string column j (as the newest's)

A value of ``K`` is a whole number of words without an index and one byte more with one, so
the two never look alike. A key that never outgrew :data:`INLINE_ROWS` rows has no older run:
its rows are ``K`` and ``K + bytes([j])`` alone, as in state format 4, which this layout
extends, and a step reads each key of its batch once per
side and entry as before; only a key with older runs needs a second read. Why runs: with one
value per key, a batch rewrote every row of each key it touched, so a key that gains a few rows
per step cost the size of its whole history each step (a hot key: quadratic). Now a batch's
rows for a key become the newest run, merged (one sort, equal rows summed, zeros dropped) with
the newer runs it reaches: starting at the newest, a run of at most ``max(2 * m,
INLINE_ROWS)`` rows is merged in, ``m`` being the rows merged so far (the batch's first), and
the first run larger than that stops the merge, it and every older run kept as they are. So
every older run held more than twice the rows of all newer ones together when it was left
behind (fewer than ``log2(rows / INLINE_ROWS) + 2`` runs), and a row is rewritten O(log)
times over its life instead of once per step of its key. When a batch does not merge the
newest run, its bytes move unchanged to a new older run. A row inserted in one run and
retracted in another stays in both until a merge meets them: the key's rows are the runs' sum,
consolidated when read.

A column's word: a signed integer, date, time, timestamp or duration by its value (temporal
types by their integer storage), a uint64 by its bits, a bool as 0 or 1, a float as the bits
of the float64 it widens to exactly (every NaN as Python's NaN), a string as its length in
bytes (UTF-8), a null-typed column 0. A null column's word is 0 and bit ``i % 64`` of mask
word ``i // 64`` says column ``i`` is null. The key's record is marshal's self-delimiting
encoding, so no key is a prefix of another key's entries. A run's rows are sorted by their
words (column words then mask, as signed integers) and then their strings in byte order: a
canonical order, so its bytes do not depend on the order of the rows that made it, and which
runs a key has depends only on the batches' row counts, never on their order; 0.0 and -0.0 are
two rows, as they are two groups to Arrow. (State format 2 held a list of ``[row values...,
multiplicity]`` per key sorted by encoded row; format 3 one marshal list per column plus one
of multiplicities; format 4 one run per key.)

The work is vectorised, no Python per key or row: the batch is consolidated with ``group_by``
(its NaNs made one NaN first); the newest runs (with their indexes) of the batch's keys, both
sides, are read as one Arrow array, and the older runs the step needs (this side's that merge, every
one of the other side's) as a second; a side's rows are one numpy view of the values' bytes,
its strings one Arrow array over the string entries' bytes (``_Rows.decode``); this side's
rows are merged with the batch by one sort of packed words and string ranks and a segmented
sum, and cut back into one value per key and entry (``_Rows.merge``); the other side's runs
are summed the same way when a key has more than one; the batch joins the other side's rows by
key index (``np.repeat``, no hashing). Both sides' rows being distinct per key, the joined rows
are too, so the delta needs no further consolidation. The merge plan runs once per run depth
over all keys, not per key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.errors import KernelError, OperatorSpecError
from sparkstep.runtime.operators.base import (
    SHARD,
    WEIGHT,
    ApplyContext,
    Kernel,
    KernelResult,
    StateChanges,
    StateReader,
    binary_layout,
    plain_type,
    rows_order,
    state_keys,
    user_columns,
)
from sparkstep.runtime.operators.spec import OperatorSpec

__all__ = [
    "JoinKernel",
]

_SIDES = (b"L", b"R")
_OWNER = "__owner"  # a stored or batch row's key, as its index among the batch's keys
_MULT = "__mult"
_WORD = np.dtype("<i8")
_INDEX = b"\xff"  # K + _INDEX + bytes([p]): a key's older run p (module docstring)
INLINE_ROWS = 64
"""A run of at most this many rows always merges with the next batch of its key, so a key that
never held more has one run, the newest, and no index (module docstring)."""


def _binary(offsets: np.ndarray, data: np.ndarray | bytes) -> pa.Array:
    """The large_binary array of ``data`` cut at ``offsets`` (int64, ``len + 1`` of them)."""
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(),
        len(offsets) - 1,
        [None, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data)],
    )


def _suffixed(keys: pa.Array, runs: np.ndarray, column: int | None) -> pa.Array:
    """``keys[i] + b"\\xff" + bytes([runs[i]])``, then ``bytes([column])`` unless None: the key
    of older run ``runs[i]`` of rows key ``keys[i]``, or of that run's string column."""
    parts = [np.full(len(keys), _INDEX[0], dtype=np.uint8), runs.astype(np.uint8)]
    if column is not None:
        parts.append(np.full(len(keys), column, dtype=np.uint8))
    suffix = _binary(np.arange(len(keys) + 1) * len(parts), np.stack(parts, axis=1).tobytes())
    return pc.binary_join_element_wise(
        keys.cast(pa.large_binary()), suffix, pa.scalar(b"", pa.large_binary())
    )


def _expanded(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts[i]`` items for each ``i``, in order: each item's ``i`` and its number among
    the items of its ``i`` (0, 1, ...)."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    within = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, within


@dataclass(frozen=True)
class _Index:
    """The older runs of ``n`` keys: how many each has (``runs``), and their row counts
    (``counts``, oldest first, key ``i``'s from ``starts[i]`` on)."""

    runs: np.ndarray
    starts: np.ndarray
    counts: np.ndarray

    @classmethod
    def split(cls, values: pa.Array) -> tuple[pa.Array, _Index]:
        """The rows keys' values ``values`` (null: none) cut into their newest run's rows (a
        large_binary array, empty where none) and the index in their tails (module docstring).
        A tail of no run, longer than its value or with a count that is not positive is
        refused."""
        values = pc.fill_null(values, b"")  # once: later fills of it cost nothing
        offsets, data = binary_layout(values)
        lengths = np.diff(offsets)
        tailed = np.flatnonzero(lengths % _WORD.itemsize == 1)
        n = len(lengths)
        if not len(tailed):
            empty = np.zeros(n, dtype=np.int64)
            return values, cls(empty, empty, np.zeros(0, dtype=np.int64))
        raw = memoryview(data)
        runs = np.zeros(n, dtype=np.int64)
        runs[tailed] = np.frombuffer(raw, np.uint8)[offsets[tailed + 1] - 1]
        tails = runs * _WORD.itemsize + 1
        kept = lengths - np.where(lengths % _WORD.itemsize == 1, tails, 0)
        if np.any(runs[tailed] == 0) or np.any(kept < 0):
            raise KernelError(
                "a stored join index is empty or longer than its value: the store holds state "
                "of another layout or format"
            )
        rows: list[memoryview] = []
        words: list[memoryview] = []
        last = 0
        for i in tailed.tolist():  # keys with older runs: few, each with many rows
            end = int(offsets[i]) + int(kept[i])
            rows.append(raw[last:end])
            words.append(raw[end : int(offsets[i + 1]) - 1])
            last = int(offsets[i + 1])
        rows.append(raw[last:])
        counts = np.frombuffer(b"".join(words), _WORD).astype(np.int64)
        if np.any(counts <= 0):
            raise KernelError(
                "a stored join index holds a count that is not positive: the store holds "
                "state of another layout or format"
            )
        row_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(kept, out=row_offsets[1:])
        return _binary(row_offsets, b"".join(rows)), cls(runs, np.cumsum(runs) - runs, counts)

    def plan(self, newest: np.ndarray, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which runs each key's batch merges (module docstring): whether its newest run (of
        ``newest`` rows, 0: none), and how many of its older runs it keeps (the others, the
        newest ones, merge); ``batch``: the rows of the key's batch. One pass per run depth,
        over all keys still merging."""
        merged = batch.astype(np.int64)
        takes_newest = (newest > 0) & (newest <= np.maximum(2 * merged, INLINE_ROWS))
        merged += np.where(takes_newest, newest, 0)
        going = (newest == 0) | takes_newest
        kept = self.runs.copy()
        while True:
            at = np.flatnonzero(going & (kept > 0))
            if not len(at):
                return takes_newest, kept
            count = self.counts[self.starts[at] + kept[at] - 1]
            takes = count <= np.maximum(2 * merged[at], INLINE_ROWS)
            merged[at[takes]] += count[takes]
            kept[at[takes]] -= 1
            going[at[~takes]] = False

    def with_tails(self, rows: pa.Array, keep: np.ndarray, moved: np.ndarray) -> pa.Array:
        """The rows keys' new values: each key's newest run ``rows`` (null: none), then, if it
        keeps older runs, the index of its first ``keep`` older runs and of a run of ``moved``
        rows where that is > 0 (its newest run, moved); null where that is nothing at all."""
        lengths = keep + (moved > 0)
        if not lengths.any():
            return rows
        if lengths.max() > 255:
            raise KernelError("a join key would keep more than 255 runs of rows")
        key_of, within = _expanded(keep)
        ends = np.cumsum(lengths)
        words = np.zeros(int(ends[-1]), dtype=_WORD)
        words[ends[key_of] - lengths[key_of] + within] = self.counts[self.starts[key_of] + within]
        has_moved = np.flatnonzero(moved > 0)
        words[ends[has_moved] - 1] = moved[has_moved]
        index = _binary(np.concatenate([[0], ends]) * _WORD.itemsize, words)
        tailed = lengths > 0
        number = _binary(np.concatenate([[0], np.cumsum(tailed)]), lengths[tailed].astype(np.uint8))
        joined = pc.binary_join_element_wise(
            pc.fill_null(rows, b""), index, number, pa.scalar(b"", pa.large_binary())
        )
        return pc.if_else(
            pc.equal(pc.binary_length(joined), 0), pa.scalar(None, pa.large_binary()), joined
        )

    def older(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's older runs from number ``keep[i]`` on, as (key index, run number)
        pairs."""
        key_of, within = _expanded(self.runs - keep)
        return key_of, keep[key_of] + within


def _canonical(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` with every NaN as the same NaN (a float column; any other as it is)."""
    if not pa.types.is_floating(column.type):
        return column
    return pc.if_else(pc.is_nan(column), pa.scalar(math.nan, column.type), column)


def _is_text(arrow_type: pa.DataType) -> bool:
    return bool(pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type))


def _dense_ranks(texts: pa.Array) -> np.ndarray:
    """Each value's rank among the distinct values of ``texts`` in byte order (equal values,
    equal ranks): a canonical int64 stand-in for sorting and comparing them. One hash pass
    and one sort of the distinct values."""
    encoded = pc.dictionary_encode(texts)
    order = pc.sort_indices(encoded.dictionary).to_numpy()
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order), dtype=np.int64)
    ranks: np.ndarray = rank[encoded.indices.to_numpy(zero_copy_only=False)]
    return ranks


@dataclass(frozen=True)
class _Stored:
    """Stored rows of a side in the rows layout: each row's key index, its words with the
    multiplicity last, and the bytes of each string column (``large_binary``)."""

    owner: np.ndarray
    rows: np.ndarray
    texts: list[pa.Array]


class _Rows:
    """The rows layout of one side (see the module docstring), as int64 matrices.

    A *rows* matrix has ``width - 1`` columns (the ``c`` column words, then the null mask's);
    a stored row adds the multiplicity. A string column's word is its length in bytes; its
    bytes are held apart (``texts``), in the entry at the run's key plus the column's byte. Stored
    values that do not fit (a length that is not a whole number of rows, string bytes that do
    not add up) are refused with :class:`KernelError`: the store holds state of another layout
    or format.
    """

    def __init__(self, fields: list[pa.Field]) -> None:
        self.fields = fields
        self.text_columns = [i for i, f in enumerate(fields) if _is_text(f.type)]
        if len(self.text_columns) >= _INDEX[0]:
            raise OperatorSpecError(
                f"a join side has {len(self.text_columns)} string columns; at most "
                f"{_INDEX[0] - 1} fit its state layout"
            )
        self.width = len(fields) + (len(fields) + 63) // 64 + 1  # words, mask, multiplicity
        self.row_bytes = self.width * _WORD.itemsize

    def entry_keys(self, keys: pa.Array) -> list[pa.Array]:
        """The keys of the newest run's entries for rows keys ``keys``: the rows, then each
        string column's bytes at the key plus the column's number among them."""
        return [keys] + [
            pc.binary_join_element_wise(keys, pa.scalar(bytes([j]), pa.binary()), b"")
            for j in range(len(self.text_columns))
        ]

    def words(self, table: pa.Table) -> np.ndarray:
        """The rows matrix of ``table``'s columns named as the side's fields."""
        c = len(self.fields)
        rows = np.zeros((table.num_rows, self.width - 1), dtype=np.int64)
        for i, f in enumerate(self.fields):
            column = table.column(f.name).cast(f.type).combine_chunks()
            null = column.is_null().to_numpy(zero_copy_only=False)
            rows[:, i] = self._word(column)  # 0 where null
            rows[:, c + i // 64] |= null.astype(np.int64) << (i % 64)
        return rows

    def texts(self, table: pa.Table) -> list[pa.Array]:
        """The string columns of ``table`` as ``large_binary``, a null as no bytes."""
        out = []
        for i in self.text_columns:
            column = table.column(self.fields[i].name).combine_chunks().cast(pa.large_binary())
            out.append(pc.fill_null(column, b""))
        return out

    @staticmethod
    def _word(column: pa.Array) -> np.ndarray:
        t = column.type
        if _is_text(t):
            lengths: np.ndarray = pc.fill_null(pc.binary_length(column), 0).to_numpy(
                zero_copy_only=False
            )
            return lengths.astype(np.int64)
        if pa.types.is_floating(t):
            x: np.ndarray = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy(
                zero_copy_only=False
            )
            return x.view(np.int64)  # NaN canonical: the batch's are (``apply``)
        if pa.types.is_uint64(t):
            words: np.ndarray = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
            return words.view(np.int64)
        if pa.types.is_null(t):
            return np.zeros(len(column), dtype=np.int64)
        plain = column.cast(plain_type(t)) if plain_type(t) != t else column
        words = pc.fill_null(plain.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return words

    def table(self, stored: _Stored) -> pa.Table:
        """Stored rows as the side's columns, ``_OWNER`` and ``_MULT``."""
        c = len(self.fields)
        texts = dict(zip(self.text_columns, stored.texts, strict=True))
        arrays = []
        for i, f in enumerate(self.fields):
            null = (stored.rows[:, c + i // 64] >> (i % 64)) & 1 == 1
            if pa.types.is_null(f.type):
                arrays.append(pa.nulls(len(null)))
            elif i in texts:
                arrays.append(pc.if_else(null, None, texts[i]).cast(f.type))
            else:
                arrays.append(self._column(stored.rows[:, i], null if null.any() else None, f.type))
        arrays += [pa.array(stored.owner, pa.int64()), pa.array(stored.rows[:, -1], pa.int64())]
        return pa.Table.from_arrays(arrays, names=[*(f.name for f in self.fields), _OWNER, _MULT])

    @staticmethod
    def _column(words: np.ndarray, null: np.ndarray | None, t: pa.DataType) -> pa.Array:
        if pa.types.is_floating(t):
            return pa.array(words.view(np.float64), pa.float64(), mask=null).cast(t)
        if pa.types.is_uint64(t):
            return pa.array(words.view(np.uint64), pa.uint64(), mask=null)
        if pa.types.is_boolean(t):
            return pa.array(words != 0, pa.bool_(), mask=null)
        array = pa.array(words, pa.int64(), mask=null)
        if plain_type(t) != pa.int64():
            array = array.cast(plain_type(t))
        return array.cast(t) if array.type != t else array

    def row_counts(self, rows: pa.Array) -> np.ndarray:
        """The rows of each run whose rows entries are ``rows`` (0 where null); a value that is
        not a whole number of rows is refused."""
        lengths = np.diff(binary_layout(pc.fill_null(rows, b""))[0])
        if np.any(lengths % self.row_bytes):
            raise KernelError(
                f"a stored join multiset is not made of {self.row_bytes}-byte rows: the store "
                "holds state of another layout or format"
            )
        counts: np.ndarray = lengths // self.row_bytes
        return counts

    def decode(self, values: list[pa.Array], owners: np.ndarray | None = None) -> _Stored:
        """The stored rows of runs ``values`` (per entry of a run, as :meth:`entry_keys` orders
        them: binary arrays aligned by run, null where a run has none), run ``i`` being of the
        key of index ``owners[i]`` (default ``i``). Not consolidated: a key with two runs has
        both's rows, and the rows are in the runs' order."""
        count = self.row_counts(values[0])
        data = binary_layout(pc.fill_null(values[0], b""))[1]
        rows = np.frombuffer(data, _WORD).astype(np.int64, copy=False).reshape(-1, self.width)
        run = np.repeat(np.arange(len(count), dtype=np.int64), count)
        texts = []
        for i, stored in zip(self.text_columns, values[1:], strict=True):
            text_offsets, text_data = binary_layout(pc.fill_null(stored, b""))
            per_run = np.bincount(run, weights=rows[:, i], minlength=len(count))
            if not np.array_equal(per_run.astype(np.int64), np.diff(text_offsets)):
                raise KernelError(
                    "a stored join multiset's string bytes do not match its rows: the store "
                    "holds state of another layout or format"
                )
            starts = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(rows[:, i], out=starts[1:])
            texts.append(
                pa.LargeBinaryArray.from_buffers(
                    pa.large_binary(),
                    len(rows),
                    [None, pa.py_buffer(starts), pa.py_buffer(text_data)],
                )
            )
        return _Stored(run if owners is None else owners[run], rows, texts)

    def consolidated(
        self, owner: np.ndarray, rows: np.ndarray, mult: np.ndarray, texts: list[pa.Array]
    ) -> _Stored:
        """Rows of key index ``owner`` (``rows``: their words without the multiplicity, which
        is ``mult``; ``texts``: their string columns) as one run per key: equal rows summed,
        zeros dropped, sorted by key, then words, then the byte order of their strings."""
        ranks = [_dense_ranks(t) for t in texts]
        order = rows_order([owner, *rows.T, *ranks])
        owner, rows, mult = owner[order], rows[order], mult[order]
        if len(owner):
            new = np.ones(len(owner), dtype=bool)
            new[1:] = (owner[1:] != owner[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
            for rank in ranks:
                new[1:] |= rank[order[1:]] != rank[order[:-1]]
            first = np.flatnonzero(new)
            owner, rows, mult = owner[first], rows[first], np.add.reduceat(mult, first)
            order = order[first]
        kept = mult != 0
        owner, rows, mult, order = owner[kept], rows[kept], mult[kept], order[kept]
        out = np.empty((len(rows), self.width), dtype=_WORD)
        out[:, :-1], out[:, -1] = rows, mult
        return _Stored(owner, out, [text.take(order) for text in texts])

    def merge(
        self,
        stored: _Stored,
        owner: np.ndarray,
        rows: np.ndarray,
        texts: list[pa.Array],
        weight: np.ndarray,
        n: int,
    ) -> list[pa.Array]:
        """The new run of each of ``n`` keys (per entry of :meth:`entry_keys`, null for none):
        the ``stored`` rows plus the batch's ``rows`` (and ``texts``) of key ``owner`` with
        multiplicity ``weight``, as :meth:`consolidated` makes them."""
        run = self.consolidated(
            np.concatenate([stored.owner, owner]),
            np.concatenate([stored.rows[:, :-1], rows]),
            np.concatenate([stored.rows[:, -1], weight]),
            [pa.concat_arrays([a, b]) for a, b in zip(stored.texts, texts, strict=True)],
        )
        written = [
            self._per_key(run.owner, np.full(len(run.rows), self.row_bytes), run.rows.tobytes(), n)
        ]
        for i, text in zip(self.text_columns, run.texts, strict=True):
            written.append(self._per_key(run.owner, run.rows[:, i], binary_layout(text)[1], n))
        return written

    def run_keys(self, keys: pa.Array, runs: np.ndarray) -> list[pa.Array]:
        """The entries' keys of older run ``runs[i]`` of rows key ``keys[i]``, in the order of
        :meth:`entry_keys`."""
        return [_suffixed(keys, runs, None)] + [
            _suffixed(keys, runs, j) for j in range(len(self.text_columns))
        ]

    @staticmethod
    def _per_key(owner: np.ndarray, sizes: np.ndarray, data: Any, n: int) -> pa.Array:
        """``data`` (the bytes of rows of key ``owner``, ascending, ``sizes`` bytes each) cut
        into one value per key of ``n``, null where a key has no bytes."""
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, weights=sizes, minlength=n).astype(np.int64), out=offsets[1:])
        values = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
        )
        empty = pc.equal(pc.binary_length(values), 0)
        return pc.if_else(empty, pa.scalar(None, pa.large_binary()), values)


def _runs(
    newest: list[pa.Array],
    older: list[pa.Array],
    older_keys: np.ndarray,
    keys: np.ndarray | None,
) -> tuple[list[pa.Array], np.ndarray | None]:
    """:meth:`_Rows.decode`'s arguments for the newest runs of ``keys`` (None: of every key, in
    order) and the ``older`` runs, of keys ``older_keys``: per entry, the runs' values one
    after another, and each run's key (None: the newest runs of every key and nothing else)."""
    if keys is None and not len(older_keys):
        return newest, None
    if keys is not None:
        newest = [values.take(keys) for values in newest]
    else:
        keys = np.arange(len(newest[0]), dtype=np.int64)
    runs = [pa.concat_arrays([a, b]) for a, b in zip(newest, older, strict=True)]
    return runs, np.concatenate([keys, older_keys])


def _changes(
    keys: pa.Array, old: pa.Array | None, new: pa.Array, at: np.ndarray, *, strings: bool
) -> StateChanges:
    """``keys -> new`` (null: deleted), ``at`` their positions among the apply's reads (-1:
    not read). A string column's entry (``strings``) changes only where it had bytes
    (``old``, None: none) or has some now: a run whose strings are all empty has none."""
    if strings:
        there = pc.is_valid(new) if old is None else pc.or_(pc.is_valid(old), pc.is_valid(new))
        keys, new, at = (
            keys.filter(there),
            new.filter(there),
            at[there.to_numpy(zero_copy_only=False)],
        )
    return StateChanges(keys, new, at)


class JoinKernel(Kernel):
    """The ``join`` kernel for one :class:`OperatorSpec` of kind ``join``."""

    inputs = 2

    def __init__(self, spec: OperatorSpec, shard_width: int) -> None:
        self.name = spec.name
        self.shard_width = shard_width
        self.key = list(spec.key)
        left, right = spec.inputs
        self.key_fields = [left.field(c) for c in self.key]
        self.side_fields = [
            [s.field(c) for c in user_columns(s) if c not in self.key] for s in (left, right)
        ]
        self.output_schema = pa.schema(
            [
                *self.key_fields,
                *self.side_fields[0],
                *self.side_fields[1],
                pa.field(WEIGHT, pa.int64()),
            ]
        )
        self.layouts = [_Rows(fields) for fields in self.side_fields]

    def apply(self, rows: pa.Table, state: StateReader, ctx: ApplyContext) -> KernelResult:
        side = ctx.input_index
        other = 1 - side
        own_cols = [f.name for f in self.side_fields[side]]
        rows = self.check_input(rows, [*self.key, *own_cols])
        if rows.num_rows == 0:
            return KernelResult(self.empty_delta())
        # Step 1. Consolidate the batch (vectorised): net weight per (shard, key, row), and each
        # row's key among the batch's distinct keys.
        for f in self.side_fields[side]:
            index = rows.schema.get_field_index(f.name)
            rows = rows.set_column(index, f.name, _canonical(rows.column(index)))
        grouped = (
            rows.select([*self.key, *own_cols, SHARD, WEIGHT])
            .group_by([*self.key, SHARD, *own_cols], use_threads=False)
            .aggregate([(WEIGHT, "sum")])
        )
        grouped = grouped.filter(pc.not_equal(grouped.column(f"{WEIGHT}_sum"), 0))
        if grouped.num_rows == 0:
            return KernelResult(self.empty_delta())
        row_keys = state_keys(
            grouped.column(SHARD), [grouped.column(c) for c in self.key], self.shard_width
        )
        encoded = pc.unique(row_keys)
        owner = pc.index_in(row_keys, value_set=encoded).to_numpy(zero_copy_only=False)
        first = pc.index_in(encoded, value_set=row_keys)  # a row of each key
        key_table = grouped.select(self.key).take(first)
        n = len(encoded)
        prefix = pc.binary_slice(encoded, 0, self.shard_width)
        rest = pc.binary_slice(encoded, self.shard_width, 2**31 - 1)
        own_keys, other_keys = (
            pc.binary_join_element_wise(prefix, pa.scalar(_SIDES[i], pa.binary()), rest, b"")
            for i in (side, other)
        )
        layout, other_layout = self.layouts[side], self.layouts[other]
        # Step 2. Read each side's newest run and index for the batch's keys (one read), then
        # the older runs the step needs: this side's that the batch merges, every one of the
        # other side's (a second read, only for keys with older runs).
        own_entries = layout.entry_keys(own_keys)
        other_entries = other_layout.entry_keys(other_keys)
        newest_read = state.get_array(
            pa.concat_arrays([k.cast(pa.large_binary()) for k in [*own_entries, *other_entries]])
        )
        e = len(own_entries)
        values = [newest_read.slice(i * n, n) for i in range(e + len(other_entries))]
        own_newest, other_newest = values[:e], values[e:]
        own_newest[0], own_index = _Index.split(own_newest[0])
        other_newest[0], other_index = _Index.split(other_newest[0])
        newest_rows = layout.row_counts(own_newest[0])
        takes_newest, keep = own_index.plan(newest_rows, np.bincount(owner, minlength=n))
        own_key_of, own_run_of = own_index.older(keep)
        other_key_of, other_run_of = other_index.older(np.zeros(n, dtype=np.int64))
        own_older_keys = layout.run_keys(own_keys.take(own_key_of), own_run_of)
        other_older_keys = other_layout.run_keys(other_keys.take(other_key_of), other_run_of)
        second_keys = [*own_older_keys, *other_older_keys]
        second_at = len(newest_read)  # where the second read's keys start among the reads
        own_older: list[pa.Array] = [k.slice(0, 0) for k in own_older_keys]
        other_older: list[pa.Array] = [k.slice(0, 0) for k in other_older_keys]
        if len(own_key_of) or len(other_key_of):
            second = state.get_array(pa.concat_arrays(second_keys))
            ours, theirs = len(own_key_of), len(other_key_of)
            own_older = [second.slice(i * ours, ours) for i in range(e)]
            other_older = [
                second.slice(e * ours + i * theirs, theirs) for i in range(len(other_entries))
            ]

        # Step 3. This side's new newest run (vectorised): the batch merged with the runs it
        # reaches; every key of the batch changes, its weights being != 0. A run's rows are
        # sorted, so that its bytes do not depend on the order the rows came in (one NaN stands
        # for every NaN).
        merging = np.flatnonzero(takes_newest)
        written = layout.merge(
            layout.decode(
                *_runs(own_newest, own_older, own_key_of, None if len(merging) == n else merging)
            ),
            owner,
            layout.words(grouped),
            layout.texts(grouped),
            grouped.column(f"{WEIGHT}_sum").to_numpy(),
            n,
        )
        # The rows keys: the new newest run, and the index of the older runs kept and of the
        # newest run when the batch does not merge it: that one moves, bytes unchanged, to a
        # new older run (never read: no key has a run of that number). Merged older runs are
        # deleted.
        moved_rows = np.where(takes_newest, 0, newest_rows)
        written[0] = own_index.with_tails(written[0], keep, moved_rows)
        parts = []
        for i, (keys, old, new) in enumerate(zip(own_entries, own_newest, written, strict=True)):
            parts.append(_changes(keys, old, new, np.arange(i * n, (i + 1) * n), strings=i > 0))
        moved = np.flatnonzero(moved_rows > 0)
        moved_keys = layout.run_keys(own_keys.take(moved), own_index.runs[moved])
        for i, (keys, old) in enumerate(zip(moved_keys, own_newest, strict=True)):
            unread = np.full(len(moved), -1, dtype=np.int64)
            parts.append(_changes(keys, None, old.take(moved), unread, strings=i > 0))
        for i, (keys, old) in enumerate(zip(own_older_keys, own_older, strict=True)):
            at = second_at + i * len(own_key_of) + np.arange(len(own_key_of))
            gone = pa.nulls(len(old), pa.large_binary())
            parts.append(_changes(keys, old, gone, at, strings=i > 0))
        changes = StateChanges.concat(parts)

        # Step 4. The join (vectorised): each batch row with each of the other side's rows of
        # its key, matched by key index (no hashing); a null key matches nothing. The batch's
        # rows are distinct per key and so are the other side's (both consolidated, NaN
        # canonical), so every joined row is distinct: the delta is consolidated as it is.
        other_stored = other_layout.decode(*_runs(other_newest, other_older, other_key_of, None))
        if len(other_key_of):  # a key's runs summed into one, in key order
            other_stored = other_layout.consolidated(
                other_stored.owner,
                other_stored.rows[:, :-1],
                other_stored.rows[:, -1],
                other_stored.texts,
            )
        other_rows = other_layout.table(other_stored)
        counts = np.bincount(other_rows.column(_OWNER).to_numpy(), minlength=n)
        for column in key_table.columns:
            counts[column.is_null().to_numpy(zero_copy_only=False)] = 0
        starts = np.cumsum(counts) - counts  # the other side's rows are in key order
        repeats = counts[owner]
        mine, within = _expanded(repeats)
        theirs = starts[owner[mine]] + within
        joined = {c: grouped.column(c).take(mine) for c in [*self.key, *own_cols]}
        for f in self.side_fields[other]:
            joined[f.name] = other_rows.column(f.name).take(theirs)
        weight = pc.multiply_checked(
            grouped.column(f"{WEIGHT}_sum").take(mine), other_rows.column(_MULT).take(theirs)
        )
        out = pa.Table.from_arrays(
            [*(joined[name] for name in self.output_schema.names[:-1]), weight],
            schema=self.output_schema,
        )
        return KernelResult(out, changes)
