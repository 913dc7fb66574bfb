"""``distinct``: the set of distinct rows of a Z-set (over the user columns).

State layout (one entry per row with a non-zero multiplicity):

    key   = shard prefix + enc([row values...])  (user columns in schema order, after to_plain)
    value = the multiplicity, int64 LE (may be negative: Z-set arithmetic)

(State format 2 held the multiplicity as ASCII decimal.) Output: ``+1`` for a row whose
multiplicity goes from <= 0 to > 0, ``-1`` for one that goes from > 0 to <= 0, nothing
otherwise. Rows are consolidated with one vectorised ``group_by`` over all user columns; the
keys are built with Arrow (``base.state_keys``), the multiplicities read, updated and written
back as Arrow arrays and numpy (``StateReader.get_array``, ``StateChanges``): no Python per
row in the kernel.
"""

from __future__ import annotations

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
    fixed_rows,
    fixed_values,
    state_keys,
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
        keys = state_keys(
            grouped.column(SHARD), [grouped.column(c) for c in self.columns], self.shard_width
        )
        # Step 2. Multiplicities (numpy): update, and the 0 <-> positive edges.
        old, _ = fixed_values(state.get_array(keys), np.dtype("<i8"))
        new = old + grouped.column(f"{WEIGHT}_sum").to_numpy()
        kept = np.flatnonzero(new != 0)  # every weight is != 0: every key changes
        gone = np.flatnonzero(new == 0)
        changes = StateChanges.concat(
            [
                StateChanges(
                    keys.take(pa.array(kept)),
                    fixed_rows(new[kept].astype("<i8").view(np.uint8).reshape(-1, 8)),
                    kept,
                ),
                StateChanges(
                    keys.take(pa.array(gone)), pa.nulls(len(gone), pa.large_binary()), gone
                ),
            ]
        )
        rising = (old <= 0) & (new > 0)
        take = np.flatnonzero(rising | ((new <= 0) & (old > 0)))
        picked = grouped.select(self.columns).take(pa.array(take, type=pa.int64()))
        weights = np.where(rising[take], 1, -1).astype(np.int64)
        arrays: list[Any] = [*picked.columns, pa.array(weights, type=pa.int64())]
        return KernelResult(pa.Table.from_arrays(arrays, schema=self.output_schema), changes)
