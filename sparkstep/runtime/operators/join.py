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

State layout (per side and key with a non-empty multiset):

    key   = shard prefix + side byte (b"L" or b"R") + enc([key values...])
    value = enc([[column 1 values...], ..., [column c values...], [multiplicities...]])

one list per non-key user column of the side (plain values, ``base.to_plain``) and one of
multiplicities (!= 0), rows sorted by their columns in order (Arrow's ascending order, nulls
last, 0.0 before -0.0; every NaN is stored as Python's NaN), so the bytes do not depend on the
order of the rows that made them. (State format 2 held a list of ``[row values...,
multiplicity]`` sorted by encoded row.)

The work is vectorised: the batch is consolidated with ``group_by``; the stored multisets of the
batch's keys are decoded into one Arrow table per side (``marshal.loads`` and ``list.extend``
per key, no Python per row); the batch joins the other side's table with ``Table.join``; this
side's multisets are merged with the batch by one ``group_by`` and one sort, then cut back into
one value per key. Python runs per distinct key of the batch, never per stored row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.operators.base import (
    SHARD,
    WEIGHT,
    ApplyContext,
    Kernel,
    KernelResult,
    StateChanges,
    StateReader,
    arrays_from_plain,
    decode_value,
    encode_value,
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


def _canonical(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` with every NaN as the same NaN (a float column; any other as it is)."""
    if not pa.types.is_floating(column.type):
        return column
    return pc.if_else(pc.is_nan(column), pa.scalar(math.nan, column.type), column)


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

    def apply(self, rows: pa.Table, state: StateReader, ctx: ApplyContext) -> KernelResult:
        side = ctx.input_index
        other = 1 - side
        own_cols = [f.name for f in self.side_fields[side]]
        rows = self.check_input(rows, [*self.key, *own_cols])
        if rows.num_rows == 0:
            return KernelResult(self.empty_delta())
        # Step 1. Consolidate the batch (vectorised): net weight per (shard, key, row), and each
        # row's key among the batch's distinct keys.
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
        width = self.shard_width
        plain_keys: list[bytes] = encoded.to_pylist()
        own_keys = [k[:width] + _SIDES[side] + k[width:] for k in plain_keys]
        other_keys = [k[:width] + _SIDES[other] + k[width:] for k in plain_keys]
        values = state.get_many(own_keys + other_keys)
        n = len(plain_keys)

        # Step 2. This side's multisets merged with the batch (vectorised). Sorted by the row's
        # columns and, for a float column, its sign (0.0 and -0.0 compare equal), so a multiset's
        # bytes do not depend on the order its rows came in (one NaN stands for every NaN).
        own_fields = self.side_fields[side]
        batch = pa.Table.from_arrays(
            [
                *(_canonical(grouped.column(f.name).cast(f.type)) for f in own_fields),
                pa.array(owner, pa.int64()),
                grouped.column(f"{WEIGHT}_sum"),
            ],
            names=[*own_cols, _OWNER, _MULT],
        )
        merged = (
            pa.concat_tables([self._stored_rows(values[:n], side), batch])
            .group_by([_OWNER, *own_cols], use_threads=False)
            .aggregate([(_MULT, "sum")])
        )
        merged = merged.filter(pc.not_equal(merged.column(f"{_MULT}_sum"), 0))
        order: list[tuple[str, str]] = [(_OWNER, "ascending")]
        for f in own_fields:
            order.append((f.name, "ascending"))
            if pa.types.is_floating(f.type):
                signs = np.signbit(merged.column(f.name).fill_null(0).to_numpy())
                merged = merged.append_column(f"__sign_{f.name}", pa.array(signs))
                order.append((f"__sign_{f.name}", "ascending"))
        merged = merged.sort_by(order)
        merged = pa.Table.from_arrays(
            [merged.column(c) for c in [_OWNER, *own_cols, f"{_MULT}_sum"]],
            names=[_OWNER, *own_cols, _MULT],
        )
        changes = self._multisets(merged, own_keys, own_cols)

        # Step 3. The join (vectorised): batch rows x the other side's rows for the same keys.
        other_rows = self._stored_rows(values[n:], other)
        if other_rows.num_rows == 0:
            return KernelResult(self.empty_delta(), changes)
        owner_of = other_rows.column(_OWNER)
        other_table = pa.Table.from_arrays(
            [*key_table.take(owner_of).columns, *other_rows.drop_columns([_OWNER]).columns],
            names=[*self.key, *(f.name for f in self.side_fields[other]), "__w_other"],
        )
        mine = grouped.select([*self.key, *own_cols, f"{WEIGHT}_sum"]).rename_columns(
            [*self.key, *own_cols, "__w_own"]
        )
        joined = mine.join(other_table, keys=self.key, join_type="inner", use_threads=False)
        weight = pc.multiply_checked(joined.column("__w_own"), joined.column("__w_other"))
        out_names = [f.name for f in self.output_schema][:-1]
        out = joined.select(out_names).append_column(WEIGHT, weight)
        out = out.group_by(out_names, use_threads=False).aggregate([(WEIGHT, "sum")])
        out = out.filter(pc.not_equal(out.column(f"{WEIGHT}_sum"), 0))
        out = out.rename_columns([*out_names, WEIGHT]).select([*out_names, WEIGHT])
        return KernelResult(out.cast(self.output_schema), changes)

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

    def _multisets(self, merged: pa.Table, keys: list[bytes], columns: list[str]) -> StateChanges:
        """Each key's value from ``merged`` (rows sorted by ``_OWNER`` then row), ``None`` for a
        key without rows: every key of the batch changes, the batch's weights being != 0."""
        lists = [to_plain(merged.column(c)) for c in columns]
        mults = merged.column(_MULT).to_pylist()
        ends = np.cumsum(np.bincount(merged.column(_OWNER).to_numpy(), minlength=len(keys)))
        changes: dict[bytes, bytes | None] = {}
        start = 0
        for key, end in zip(keys, ends.tolist(), strict=True):
            if end == start:
                changes[key] = None
                continue
            changes[key] = encode_value([*(c[start:end] for c in lists), mults[start:end]])
            start = end
        return StateChanges.of(changes)
