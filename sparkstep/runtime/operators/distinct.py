"""``distinct``: the set of distinct rows of a Z-set (over the user columns).

State layout (one entry per row with a non-zero multiplicity):

    key   = shard prefix + enc([row values...])  (user columns in schema order, after to_plain)
    value = the multiplicity as ASCII decimal (may be negative: Z-set arithmetic)

Output: ``+1`` for a row whose multiplicity goes from <= 0 to > 0, ``-1`` for one that goes from
> 0 to <= 0, nothing otherwise. Rows are consolidated with one vectorised ``group_by`` over all
user columns; Python runs once per distinct row of the batch (state read and update).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.operators.base import (
    SHARD,
    WEIGHT,
    ApplyContext,
    Kernel,
    KernelResult,
    StateReader,
    encode_value,
    shard_prefix,
    to_plain,
    user_columns,
)
from sparkstep.runtime.operators.spec import OperatorSpec

__all__ = [
    "DistinctKernel",
]


class DistinctKernel(Kernel):
    """The ``distinct`` kernel for one :class:`OperatorSpec` of kind ``distinct``."""

    def __init__(self, spec: OperatorSpec, shard_width: int) -> None:
        self.name = spec.name
        self.shard_width = shard_width
        schema = spec.inputs[0]
        self.columns = user_columns(schema)
        self.output_schema = pa.schema(
            [*(schema.field(c) for c in self.columns), pa.field(WEIGHT, pa.int64())]
        )

    def apply(self, rows: pa.Table, state: StateReader, ctx: ApplyContext) -> KernelResult:
        rows = self.check_input(rows, self.columns)
        if rows.num_rows == 0:
            return KernelResult(self.empty_delta())
        # Step 1. Consolidate the batch (vectorised): net weight per (shard, row).
        grouped = (
            rows.select([*self.columns, SHARD, WEIGHT])
            .group_by([*self.columns, SHARD], use_threads=False)
            .aggregate([(WEIGHT, "sum")])
        )
        grouped = grouped.filter(pc.not_equal(grouped.column(f"{WEIGHT}_sum"), 0))
        values = [to_plain(grouped.column(c)) for c in self.columns]
        shards = grouped.column(SHARD).to_pylist()
        weights = grouped.column(f"{WEIGHT}_sum").to_pylist()
        keys = [
            shard_prefix(s, self.shard_width) + encode_value(list(vals))
            for s, *vals in zip(shards, *values, strict=True)
        ]
        # Step 2. Per distinct row (Python): multiplicity update and the 0 <-> positive edges.
        previous = state.get_many(keys)
        changes: dict[bytes, bytes | None] = {}
        take: list[int] = []
        out_w: list[int] = []
        for j, key in enumerate(keys):
            raw = previous[j]
            old = int(raw) if raw is not None else 0
            new = old + weights[j]
            changes[key] = None if new == 0 else str(new).encode()
            if old <= 0 < new:
                take.append(j)
                out_w.append(1)
            elif new <= 0 < old:
                take.append(j)
                out_w.append(-1)
        picked = grouped.select(self.columns).take(pa.array(take, type=pa.int64()))
        arrays: list[Any] = [*picked.columns, pa.array(out_w, type=pa.int64())]
        return KernelResult(pa.Table.from_arrays(arrays, schema=self.output_schema), changes)
