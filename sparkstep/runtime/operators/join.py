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
    value = enc [[row values (the side's non-key user columns)..., multiplicity], ...]
            sorted by the encoded row

The join itself runs in Arrow (``Table.join`` of the consolidated batch against the other side's
rows for the batch's keys, rebuilt from state); Python runs once per distinct key of the batch
and once per stored row of the other side for those keys (decoding state).
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
    arrays_from_plain,
    decode_value,
    encode_value,
    shard_prefix,
    to_plain,
    user_columns,
)
from sparkstep.runtime.operators.spec import OperatorSpec

__all__ = [
    "JoinKernel",
]

_SIDES = (b"L", b"R")


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
        # Step 1. Consolidate the batch (vectorised): net weight per (shard, key, row).
        grouped = (
            rows.select([*self.key, *own_cols, SHARD, WEIGHT])
            .group_by([*self.key, SHARD, *own_cols], use_threads=False)
            .aggregate([(WEIGHT, "sum")])
        )
        grouped = grouped.filter(pc.not_equal(grouped.column(f"{WEIGHT}_sum"), 0))
        key_vals = [to_plain(grouped.column(c)) for c in self.key]
        row_vals = [to_plain(grouped.column(c)) for c in own_cols]
        weights = grouped.column(f"{WEIGHT}_sum").to_pylist()
        shards = grouped.column(SHARD).to_pylist()
        per_key: dict[bytes, list[tuple[list[Any], int]]] = {}
        key_of: dict[bytes, tuple[int, list[Any]]] = {}
        for j, (shard, w) in enumerate(zip(shards, weights, strict=True)):
            kv = [col[j] for col in key_vals]
            kj = encode_value(kv)
            per_key.setdefault(kj, []).append(([col[j] for col in row_vals], w))
            key_of.setdefault(kj, (shard, kv))
        encoded = list(per_key)
        prefixes = [shard_prefix(key_of[k][0], self.shard_width) for k in encoded]
        own_keys = [p + _SIDES[side] + k for p, k in zip(prefixes, encoded, strict=True)]
        other_keys = [p + _SIDES[other] + k for p, k in zip(prefixes, encoded, strict=True)]
        values = state.get_many(own_keys + other_keys)
        own_old, other_old = values[: len(encoded)], values[len(encoded) :]

        # Step 2. Per key (Python): update this side's multiset; rebuild the other side's rows.
        changes: dict[bytes, bytes | None] = {}
        other_cols: list[list[Any]] = [[] for _ in [*self.key, *self.side_fields[other]]]
        other_w: list[int] = []
        for idx, kj in enumerate(encoded):
            multiset: dict[bytes, int] = {}
            if own_old[idx] is not None:
                for entry in decode_value(own_old[idx]):  # type: ignore[arg-type]
                    multiset[encode_value(entry[:-1])] = entry[-1]
            for row, w in per_key[kj]:
                enc = encode_value(row)
                multiset[enc] = multiset.get(enc, 0) + w
            kept = sorted((enc, m) for enc, m in multiset.items() if m != 0)
            changes[own_keys[idx]] = (
                encode_value([[*decode_value(enc), m] for enc, m in kept]) if kept else None
            )
            raw = other_old[idx]
            if raw is None:
                continue
            kv = key_of[kj][1]
            for entry in decode_value(raw):
                for c, value in enumerate(kv):
                    other_cols[c].append(value)
                for c, value in enumerate(entry[:-1]):
                    other_cols[len(kv) + c].append(value)
                other_w.append(entry[-1])

        # Step 3. The join (vectorised): batch rows x the other side's rows for the same keys.
        if not other_w:
            return KernelResult(self.empty_delta(), changes)
        other_fields = [*self.key_fields, *self.side_fields[other]]
        other_table = pa.Table.from_arrays(
            [arrays_from_plain(v, f.type) for v, f in zip(other_cols, other_fields, strict=True)]
            + [pa.array(other_w, type=pa.int64())],
            names=[*(f.name for f in other_fields), "__w_other"],
        )
        batch = grouped.select([*self.key, *own_cols, f"{WEIGHT}_sum"]).rename_columns(
            [*self.key, *own_cols, "__w_own"]
        )
        joined = batch.join(other_table, keys=self.key, join_type="inner", use_threads=False)
        weight = pc.multiply_checked(joined.column("__w_own"), joined.column("__w_other"))
        out_names = [f.name for f in self.output_schema][:-1]
        out = joined.select(out_names).append_column(WEIGHT, weight)
        out = out.group_by(out_names, use_threads=False).aggregate([(WEIGHT, "sum")])
        out = out.filter(pc.not_equal(out.column(f"{WEIGHT}_sum"), 0))
        out = out.rename_columns([*out_names, WEIGHT]).select([*out_names, WEIGHT])
        return KernelResult(out.cast(self.output_schema), changes)
