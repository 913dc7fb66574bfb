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

State layout (per side and key with a non-empty multiset)::

    key              = shard prefix + side byte (b"L" or b"R") + enc([key values...])
    value            = rows of w little-endian int64 words each: the row's c column words, its
                       null mask (ceil(c / 64) words), its multiplicity (!= 0)
    key + bytes([j]) = the bytes of string column j (numbered among the side's string
                       columns) of the key's rows, one after another in row order; no entry
                       when they are all empty

A column's word: a signed integer, date, time, timestamp or duration by its value (temporal
types by their integer storage), a uint64 by its bits, a bool as 0 or 1, a float as the bits
of the float64 it widens to exactly (every NaN as Python's NaN), a string as its length in
bytes (UTF-8), a null-typed column 0. A null column's word is 0 and bit ``i % 64`` of mask
word ``i // 64`` says column ``i`` is null. The key's record is marshal's self-delimiting
encoding, so no key is a prefix of another key's string entry. Rows are sorted by their words
(column words then mask, as signed integers) and then their strings in byte order: a
canonical order, so the bytes do not depend on the order of the rows that made them; 0.0 and
-0.0 are two rows, as they are two groups to Arrow. (State format 2 held a list of ``[row
values..., multiplicity]`` per key sorted by encoded row; format 3 one marshal list per
column plus one of multiplicities.)

The work is vectorised, no Python per key or row: the batch is consolidated with ``group_by``
(its NaNs made one NaN first); the stored entries of the batch's keys, both sides, are read as
one Arrow array; a side's rows are one numpy view of the values' bytes, its strings one Arrow
array over the string entries' bytes (``_Rows.decode``); this side's rows are merged with the
batch by one sort of packed words and string ranks and a segmented sum, and cut back into one
value per key and entry (``_Rows.merge``); the batch joins the other side's rows by key index
(``np.repeat``, no hashing). Both sides' rows being distinct per key, the joined rows are too,
so the delta needs no further consolidation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.errors import KernelError
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
    """Stored rows of a side in the rows layout: each row's key index (ascending), its words
    with the multiplicity last, and the bytes of each string column (``large_binary``)."""

    owner: np.ndarray
    rows: np.ndarray
    texts: list[pa.Array]


class _Rows:
    """The rows layout of one side (see the module docstring), as int64 matrices.

    A *rows* matrix has ``width - 1`` columns (the ``c`` column words, then the null mask's);
    a stored row adds the multiplicity. A string column's word is its length in bytes; its
    bytes are held apart (``texts``), in the entry at the key plus the column's byte. Stored
    values that do not fit (a length that is not a whole number of rows, string bytes that do
    not add up) are refused with :class:`KernelError`: the store holds state of another layout
    or format.
    """

    def __init__(self, fields: list[pa.Field]) -> None:
        self.fields = fields
        self.text_columns = [i for i, f in enumerate(fields) if _is_text(f.type)]
        self.width = len(fields) + (len(fields) + 63) // 64 + 1  # words, mask, multiplicity
        self.row_bytes = self.width * _WORD.itemsize

    def entry_keys(self, keys: pa.Array) -> list[pa.Array]:
        """The keys of a side's entries for its rows keys ``keys``: the rows, then each string
        column's bytes at the key plus the column's number among them."""
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

    def decode(self, values: list[pa.Array]) -> _Stored:
        """The stored rows of ``values`` (per entry of :meth:`entry_keys`, binary arrays aligned
        with the keys, null where a key has none)."""
        offsets, data = binary_layout(pc.fill_null(values[0], b""))
        lengths = np.diff(offsets)
        if np.any(lengths % self.row_bytes):
            raise KernelError(
                f"a stored join multiset is not made of {self.row_bytes}-byte rows: the store "
                "holds state of another layout or format"
            )
        rows = np.frombuffer(data, _WORD).astype(np.int64, copy=False).reshape(-1, self.width)
        count = lengths // self.row_bytes
        owner = np.repeat(np.arange(len(count), dtype=np.int64), count)
        texts = []
        for i, stored in zip(self.text_columns, values[1:], strict=True):
            text_offsets, text_data = binary_layout(pc.fill_null(stored, b""))
            per_key = np.bincount(owner, weights=rows[:, i], minlength=len(count))
            if not np.array_equal(per_key.astype(np.int64), np.diff(text_offsets)):
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
        return _Stored(owner, rows, texts)

    def merge(
        self,
        stored: _Stored,
        owner: np.ndarray,
        rows: np.ndarray,
        texts: list[pa.Array],
        weight: np.ndarray,
        n: int,
    ) -> list[pa.Array]:
        """The new values of each of ``n`` keys' entries (per entry of :meth:`entry_keys`, null
        for none): the stored rows plus the batch's ``rows`` (and ``texts``) of key ``owner``
        with multiplicity ``weight``, equal rows summed, zeros dropped, sorted by their words
        and the byte order of their strings."""
        owner = np.concatenate([stored.owner, owner])
        rows = np.concatenate([stored.rows[:, :-1], rows])
        mult = np.concatenate([stored.rows[:, -1], weight])
        texts = [pa.concat_arrays([a, b]) for a, b in zip(stored.texts, texts, strict=True)]
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
        out = np.empty((len(rows), rows.shape[1] + 1), dtype=_WORD)
        out[:, :-1], out[:, -1] = rows, mult
        written = [self._per_key(owner, np.full(len(rows), self.row_bytes), out.tobytes(), n)]
        for i, text in zip(self.text_columns, texts, strict=True):
            data = binary_layout(text.take(order))[1]
            written.append(self._per_key(owner, rows[:, i], data, n))
        return written

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
        own_entries, other_entries = (
            layout.entry_keys(own_keys),
            other_layout.entry_keys(other_keys),
        )
        read = state.get_array(pa.concat_arrays([*own_entries, *other_entries]))
        values = [read.slice(i * n, n) for i in range(len(own_entries) + len(other_entries))]
        own_values, other_values = values[: len(own_entries)], values[len(own_entries) :]

        # Step 2. This side's multisets merged with the batch (vectorised): every key of the
        # batch changes, its weights being != 0. A key's rows are sorted, so that its bytes do
        # not depend on the order the rows came in (one NaN stands for every NaN).
        written = layout.merge(
            layout.decode(own_values),
            owner,
            layout.words(grouped),
            layout.texts(grouped),
            grouped.column(f"{WEIGHT}_sum").to_numpy(),
            n,
        )
        parts = []
        for i, (keys, old, new) in enumerate(zip(own_entries, own_values, written, strict=True)):
            at = np.arange(i * n, (i + 1) * n, dtype=np.int64)
            if i:  # a string column's bytes: only where it had some or has some now
                there = pc.or_(pc.is_valid(old), pc.is_valid(new))
                keys, new, at = (
                    keys.filter(there),
                    new.filter(there),
                    at[there.to_numpy(zero_copy_only=False)],
                )
            parts.append(StateChanges(keys, new, at))
        changes = StateChanges.concat(parts)

        # Step 3. The join (vectorised): each batch row with each of the other side's rows of
        # its key, matched by key index (no hashing); a null key matches nothing. The batch's
        # rows are distinct per key and so are the other side's (both consolidated, NaN
        # canonical), so every joined row is distinct: the delta is consolidated as it is.
        other_rows = other_layout.table(other_layout.decode(other_values))
        counts = np.bincount(other_rows.column(_OWNER).to_numpy(), minlength=n)
        for column in key_table.columns:
            counts[column.is_null().to_numpy(zero_copy_only=False)] = 0
        starts = np.cumsum(counts) - counts  # the other side's rows are in key order
        repeats = counts[owner]
        mine = np.repeat(np.arange(len(owner), dtype=np.int64), repeats)
        within = np.arange(len(mine), dtype=np.int64) - np.repeat(
            np.cumsum(repeats) - repeats, repeats
        )
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
