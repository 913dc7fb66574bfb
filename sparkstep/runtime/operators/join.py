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

State layout (per side and key with a non-empty multiset; the key is the same in both layouts):

    key   = shard prefix + side byte (b"L" or b"R") + enc([key values...])

Two value layouts, chosen per side by its columns (so one side of an operator always uses the
same one):

**Fixed** (every non-key user column of the side is an integer, float, bool, date, time,
timestamp or duration, at most 63 of them, or the side has none)::

    value = rows of c + 2 little-endian int64 words each: the row's c columns, its null mask,
            its multiplicity (!= 0)

A column's word: a signed integer, date, time, timestamp or duration by its value (temporal
types by their integer storage), a uint64 by its bits, a bool as 0 or 1, a float as the bits
of the float64 it widens to exactly, every NaN as Python's NaN; a null column's
word is 0 and bit ``i`` of the null mask says column ``i`` is null. Rows are sorted by their
c + 1 words (the mask last) as signed integers: a canonical order, so the bytes do not depend
on the order of the rows that made them; 0.0 and -0.0 are two rows, as they are two groups to
Arrow. A key's rows are decoded, merged with the batch and encoded again with numpy
(``_FixedRows``), no Python per key or row.

**General** (any other side: a string column, or more than 63 columns)::

    value = enc([[column 1 values...], ..., [column c values...], [multiplicities...]])

one list per non-key user column of the side (plain values, ``base.to_plain``) and one of
multiplicities (!= 0), rows sorted by their columns in order (Arrow's ascending order, nulls
last, 0.0 before -0.0; every NaN is stored as Python's NaN), so the bytes do not depend on the
order of the rows that made them. Decoded with ``marshal.loads`` and ``list.extend`` per key,
encoded with ``marshal.dumps`` per key. (State format 2 held a list of ``[row values...,
multiplicity]`` sorted by encoded row; format 3 kept a fixed side in this layout too.)

The work is vectorised: the batch is consolidated with ``group_by`` (its NaNs made one NaN
first); the stored multisets of the batch's keys, both sides, are read as one Arrow array and
decoded (fixed: one numpy view; general: ``marshal.loads`` per key); this side's multisets are
merged with the batch (fixed: one sort of packed words and a segmented sum; general: one
``group_by`` and one sort) and cut back into one value per key; the batch joins the other
side's rows by key index (``np.repeat``, no hashing). Both sides' rows being distinct per key,
the joined rows are too, so the delta needs no further consolidation.
"""

from __future__ import annotations

import math
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
    arrays_from_plain,
    binary_layout,
    decode_value,
    encode_value,
    plain_type,
    rows_order,
    state_keys,
    to_plain,
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


def _is_fixed(arrow_type: pa.DataType) -> bool:
    """Whether a column of ``arrow_type`` fits one int64 word of the fixed layout."""
    return bool(
        pa.types.is_integer(arrow_type)
        or pa.types.is_floating(arrow_type)
        or pa.types.is_boolean(arrow_type)
        or pa.types.is_date(arrow_type)
        or pa.types.is_time(arrow_type)
        or pa.types.is_timestamp(arrow_type)
        or pa.types.is_duration(arrow_type)
    )


class _FixedRows:
    """The fixed layout of one side (see the module docstring): its rows as int64 matrices.

    A *rows* matrix has ``c + 1`` columns (the words, then the null mask); a stored value adds
    the multiplicity as word ``c + 2``. Stored values of another length are refused
    (:class:`KernelError`): the store holds state of another layout or format.
    """

    def __init__(self, fields: list[pa.Field]) -> None:
        self.fields = fields
        self.row_bytes = (len(fields) + 2) * _WORD.itemsize

    def words(self, table: pa.Table) -> np.ndarray:
        """The rows matrix of ``table``'s columns named as the side's fields."""
        rows = np.zeros((table.num_rows, len(self.fields) + 1), dtype=np.int64)
        for i, f in enumerate(self.fields):
            column = table.column(f.name).cast(f.type).combine_chunks()
            null = column.is_null().to_numpy(zero_copy_only=False)
            rows[:, i] = self._word(column)  # 0 where null
            rows[:, -1] |= null.astype(np.int64) << i
        return rows

    @staticmethod
    def _word(column: pa.Array) -> np.ndarray:
        t = column.type
        if pa.types.is_floating(t):
            x: np.ndarray = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy(
                zero_copy_only=False
            )
            return x.view(np.int64)  # NaN canonical: the batch's are (``apply``)
        if pa.types.is_uint64(t):
            words: np.ndarray = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
            return words.view(np.int64)
        plain = column.cast(plain_type(t)) if plain_type(t) != t else column
        words = pc.fill_null(plain.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
        return words

    def table(self, owner: np.ndarray, stored: np.ndarray) -> pa.Table:
        """Stored rows (``decode``'s) as the side's columns, ``_OWNER`` and ``_MULT``."""
        mask = stored[:, -2]
        arrays = []
        for i, f in enumerate(self.fields):
            null = (mask >> i) & 1 == 1
            arrays.append(self._column(stored[:, i], null if null.any() else None, f.type))
        arrays += [pa.array(owner, pa.int64()), pa.array(stored[:, -1], pa.int64())]
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

    def decode(self, values: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """The stored rows of ``values`` (a binary array, null where a key has none): each row's
        index in ``values`` (ascending) and the rows with their multiplicities, one per line."""
        offsets, data = binary_layout(pc.fill_null(values, b""))
        lengths = np.diff(offsets)
        if np.any(lengths % self.row_bytes):
            raise KernelError(
                f"a stored join multiset is not made of {self.row_bytes}-byte rows: the store "
                "holds state of another layout or format"
            )
        width = len(self.fields) + 2
        stored = np.frombuffer(data, _WORD).astype(np.int64, copy=False).reshape(-1, width)
        owner = np.repeat(np.arange(len(values), dtype=np.int64), lengths // self.row_bytes)
        return owner, stored

    def merge(
        self,
        stored: tuple[np.ndarray, np.ndarray],
        owner: np.ndarray,
        rows: np.ndarray,
        weight: np.ndarray,
        n: int,
    ) -> pa.Array:
        """The new value of each of ``n`` keys (null for an empty multiset): the stored rows
        (``decode``'s) plus the batch's ``rows`` of key ``owner`` with multiplicity ``weight``,
        equal rows summed, zeros dropped, sorted."""
        stored_owner, stored_rows = stored
        owner = np.concatenate([stored_owner, owner])
        rows = np.concatenate([stored_rows[:, :-1], rows])
        mult = np.concatenate([stored_rows[:, -1], weight])
        order = rows_order([owner, *rows.T])
        owner, rows, mult = owner[order], rows[order], mult[order]
        if len(owner):
            new = np.ones(len(owner), dtype=bool)
            new[1:] = (owner[1:] != owner[:-1]) | np.any(rows[1:] != rows[:-1], axis=1)
            first = np.flatnonzero(new)
            owner, rows, mult = owner[first], rows[first], np.add.reduceat(mult, first)
        kept = mult != 0
        out = np.empty((int(kept.sum()), rows.shape[1] + 1), dtype=_WORD)
        out[:, :-1], out[:, -1] = rows[kept], mult[kept]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner[kept], minlength=n) * self.row_bytes, out=offsets[1:])
        merged = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(out.tobytes())]
        )
        empty = pc.equal(pc.binary_length(merged), 0)
        return pc.if_else(empty, pa.scalar(None, pa.large_binary()), merged)


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
        # Each side's layout: fixed when every one of its columns is (and the null mask has a
        # bit for each), else general.
        self.fixed = [
            _FixedRows(fields)
            if len(fields) < 64 and all(_is_fixed(f.type) for f in fields)
            else None
            for fields in self.side_fields
        ]

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
        values = state.get_array(pa.concat_arrays([own_keys, other_keys]))

        # Step 2. This side's multisets merged with the batch (vectorised): every key of the
        # batch changes, its weights being != 0. Both layouts sort a key's rows so that its
        # bytes do not depend on the order the rows came in (one NaN stands for every NaN).
        layout = self.fixed[side]
        if layout is not None:
            batch_weight = grouped.column(f"{WEIGHT}_sum").to_numpy()
            stored = layout.decode(values.slice(0, n))
            written = layout.merge(stored, owner, layout.words(grouped), batch_weight, n)
        else:
            written = self._merged_general(values.slice(0, n), grouped, owner, side)
        changes = StateChanges(own_keys, written, np.arange(n, dtype=np.int64))

        # Step 3. The join (vectorised): each batch row with each of the other side's rows of
        # its key, matched by key index (no hashing); a null key matches nothing. The batch's
        # rows are distinct per key and so are the other side's (both consolidated, NaN
        # canonical), so every joined row is distinct: the delta is consolidated as it is.
        other_layout = self.fixed[other]
        if other_layout is not None:
            other_rows = other_layout.table(*other_layout.decode(values.slice(n)))
        else:
            other_rows = self._stored_rows(values.slice(n).to_pylist(), other)
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

    def _stored_rows(self, raw: list[bytes | None], side: int) -> pa.Table:
        """The stored multisets of ``side`` for the batch's keys (``raw[i]`` is key ``i``'s, or
        ``None``) as one table: the side's columns, ``_OWNER`` (the key's index), ``_MULT``."""
        fields = self.side_fields[side]
        columns: list[list[Any]] = [[] for _ in fields]
        counts: list[int] = []
        sizes = np.zeros(len(raw), dtype=np.int64)
        for i, blob in enumerate(raw):
            if blob is None:
                continue
            *values, mults = decode_value(blob)
            for column, part in zip(columns, values, strict=True):
                column.extend(part)
            counts.extend(mults)
            sizes[i] = len(mults)
        arrays = [arrays_from_plain(c, f.type) for c, f in zip(columns, fields, strict=True)]
        arrays.append(pa.array(np.repeat(np.arange(len(raw), dtype=np.int64), sizes)))
        arrays.append(pa.array(counts, type=pa.int64()))
        return pa.Table.from_arrays(arrays, names=[*(f.name for f in fields), _OWNER, _MULT])

    def _merged_general(
        self, values: pa.Array, grouped: pa.Table, owner: np.ndarray, side: int
    ) -> pa.Array:
        """The general layout's :meth:`_FixedRows.merge`: the new value of each key of
        ``values`` (its stored multiset, null where none) after the batch's ``grouped`` rows of
        key ``owner``; null for a key left without rows."""
        own_fields = self.side_fields[side]
        own_cols = [f.name for f in own_fields]
        batch = pa.Table.from_arrays(
            [
                *(_canonical(grouped.column(f.name).cast(f.type)) for f in own_fields),
                pa.array(owner, pa.int64()),
                grouped.column(f"{WEIGHT}_sum"),
            ],
            names=[*own_cols, _OWNER, _MULT],
        )
        merged = (
            pa.concat_tables([self._stored_rows(values.to_pylist(), side), batch])
            .group_by([_OWNER, *own_cols], use_threads=False)
            .aggregate([(_MULT, "sum")])
        )
        merged = merged.filter(pc.not_equal(merged.column(f"{_MULT}_sum"), 0))
        # Sorted by the row's columns and, for a float column, its sign (0.0 and -0.0 compare
        # equal).
        order: list[tuple[str, str]] = [(_OWNER, "ascending")]
        for f in own_fields:
            order.append((f.name, "ascending"))
            if pa.types.is_floating(f.type):
                signs = np.signbit(merged.column(f.name).fill_null(0).to_numpy())
                merged = merged.append_column(f"__sign_{f.name}", pa.array(signs))
                order.append((f"__sign_{f.name}", "ascending"))
        merged = merged.sort_by(order)
        lists = [to_plain(merged.column(c)) for c in own_cols]
        mults = merged.column(f"{_MULT}_sum").to_pylist()
        ends = np.cumsum(np.bincount(merged.column(_OWNER).to_numpy(), minlength=len(values)))
        written: list[bytes | None] = []
        start = 0
        for end in ends.tolist():
            if end == start:
                written.append(None)
                continue
            written.append(encode_value([*(c[start:end] for c in lists), mults[start:end]]))
            start = end
        return pa.array(written, pa.large_binary())
