"""``stateful_map``: a user function per key over the key's new rows, its state and step time.

The user function is called once per key of the batch::

    fn(key: tuple, rows: pyarrow.Table, state: dict | None, ctx: MapContext)
        -> (rows_out, new_state)

- ``key``: the key values (Python values of the key columns' types).
- ``rows``: the key's rows of this batch in input order, i.e. sorted by
  (``__topic``, ``__partition``, ``__offset``) when the batch carries those columns, then by
  the rows' own values (the user columns in order, then ``__weight``): rows of one input record
  (after an explode) and a batch without those columns (after another operator, or a select
  that dropped them) come in an order fixed by their values, never in the order Spark's
  exchange happened to deliver them, so a replay calls the function with the same rows in the
  same order. Every column of the batch is there (``__weight`` included: a -1 row is a
  retraction; what it means is the function's business).
- ``state``: the previous state as a dict of the ``state_schema`` fields, ``None`` for a new key.
- ``ctx``: :class:`MapContext` with the step, the logged step time and ``timed_out``.
- ``rows_out``: a list of dicts or a ``pyarrow.Table`` with the ``output_schema`` columns and
  optionally ``__weight`` (default +1). The operator's output rows are the key columns, then the
  ``output_schema`` columns, then ``__weight``.
- ``new_state``: a dict with exactly the ``state_schema`` fields, or ``None`` to forget the key.

Timeout (sessionization): with ``timeout_ms``, a call with rows sets the key's deadline to
``step_time + timeout_ms``. When a later step's logged time reaches the deadline and the key got
no rows since, ``fn`` is called with empty ``rows`` and ``ctx.timed_out = True``; afterwards the
key has no deadline until it gets rows again (its state, if kept, stays). Timers use only the
logged step time, so replay fires them at the same steps. For timers to fire, the runtime calls
``apply`` for a timed operator on every worker at every step, with an empty batch if need be.

State layout:

    key   = shard prefix + enc([key values...])
    value = enc {"s": [state values in state_schema order, after to_plain], "d": deadline|null}
    timer = shard prefix + b"\\x00" + deadline (8 bytes, big-endian ms) + enc([key values...])
            -> b"" (an index: due timers of a shard are one range scan)

Finding due timers costs one range scan per shard ``0 <= shard < S`` (shards this worker does not
hold are empty ranges); Python runs once per key (the user function, by its nature) and the
state encoding is vectorised per field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sparkstep.runtime.errors import KernelError
from sparkstep.runtime.operators.base import (
    ORDER_COLUMNS,
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
    shard_prefix,
    to_plain,
    user_columns,
)
from sparkstep.runtime.operators.spec import OperatorSpec

__all__ = [
    "MapContext",
    "StatefulMapKernel",
]

_TIMER = b"\x00"


@dataclass(frozen=True)
class MapContext:
    """What the user function knows about the call: the step, its logged time, and the timeout."""

    step: int
    step_time_ms: int
    timed_out: bool


class StatefulMapKernel(Kernel):
    """The ``stateful_map`` kernel for one :class:`OperatorSpec` of kind ``stateful_map``."""

    def __init__(self, spec: OperatorSpec, shard_width: int, shards: int) -> None:
        assert spec.state_schema is not None and spec.output_schema is not None
        self.name = spec.name
        self.shard_width = shard_width
        self.shards = shards
        self.key = list(spec.key)
        self.key_fields = [spec.inputs[0].field(c) for c in self.key]
        self.state_schema = spec.state_schema
        self.user_schema = spec.output_schema
        self.timeout_ms = spec.timeout_ms
        self.fn: Callable[..., Any] = spec.user_fn()
        self.output_schema = pa.schema(
            [*self.key_fields, *spec.output_schema, pa.field(WEIGHT, pa.int64())]
        )

    def _timer_key(self, shard: int, deadline: int, key_json: bytes) -> bytes:
        return (
            shard_prefix(shard, self.shard_width) + _TIMER + deadline.to_bytes(8, "big") + key_json
        )

    def apply(self, rows: pa.Table, state: StateReader, ctx: ApplyContext) -> KernelResult:
        rows = self.check_input(rows, self.key)
        # Step 1. Sort into input order, ties broken by the rows' values (module docstring),
        # and group row indices by key (vectorised).
        order = [c for c in ORDER_COLUMNS if c in rows.schema.names]
        order += [*user_columns(rows.schema), WEIGHT]
        if rows.num_rows:
            rows = rows.sort_by([(c, "ascending") for c in order])
        indexed = rows.select([*self.key, SHARD]).append_column(
            "__idx", pa.array(range(rows.num_rows), type=pa.int64())
        )
        groups = indexed.group_by([*self.key, SHARD], use_threads=False).aggregate(
            [("__idx", "list")]
        )
        plain_keys = [to_plain(groups.column(c)) for c in self.key]
        typed_keys = [groups.column(c).to_pylist() for c in self.key]
        work: dict[bytes, tuple[int, list[Any], tuple[Any, ...], list[int] | None]] = {}
        for j, (shard, idx) in enumerate(
            zip(
                groups.column(SHARD).to_pylist(),
                groups.column("__idx_list").to_pylist(),
                strict=True,
            )
        ):
            kj = encode_value([col[j] for col in plain_keys])
            work[shard_prefix(shard, self.shard_width) + kj] = (
                shard,
                [col[j] for col in plain_keys],
                tuple(col[j] for col in typed_keys),
                sorted(idx),
            )
        # Step 2. Due timers: keys whose deadline <= step time and that got no rows now.
        changes: dict[bytes, bytes | None] = {}
        if self.timeout_ms is not None:
            limit = (ctx.step_time_ms + 1).to_bytes(8, "big", signed=False)
            for shard in range(self.shards):
                start = shard_prefix(shard, self.shard_width) + _TIMER
                for tkey, _ in state.scan(start, start + limit):
                    kj = tkey[len(start) + 8 :]
                    skey = shard_prefix(shard, self.shard_width) + kj
                    if skey in work:
                        continue
                    plain = decode_value(kj)
                    typed = tuple(
                        arrays_from_plain([v], f.type).to_pylist()[0]
                        for v, f in zip(plain, self.key_fields, strict=True)
                    )
                    work[skey] = (shard, plain, typed, None)
        if not work:
            return KernelResult(self.empty_delta(), StateChanges.of(changes))

        # Step 3. Previous states, decoded per field (vectorised).
        skeys = list(work)
        raws = state.get_many(skeys)
        olds = [decode_value(r) if r is not None else None for r in raws]
        fields = list(self.state_schema)
        decoded_cols = [
            arrays_from_plain(
                [o["s"][i] if o is not None else None for o in olds], f.type
            ).to_pylist()
            for i, f in enumerate(fields)
        ]

        # Step 4. The user function, once per key, in key order of first appearance.
        empty = rows.slice(0, 0)
        out_cols: list[list[Any]] = [[] for _ in self.output_schema]
        new_states: list[dict[str, Any] | None] = []
        for j, skey in enumerate(skeys):
            shard, _plain, typed, idx = work[skey]
            prev = (
                None
                if olds[j] is None
                else {f.name: decoded_cols[i][j] for i, f in enumerate(fields)}
            )
            key_rows = empty if idx is None else rows.take(pa.array(idx, type=pa.int64()))
            mctx = MapContext(ctx.step, ctx.step_time_ms, timed_out=idx is None)
            try:
                result = self.fn(typed, key_rows, prev, mctx)
                produced, new_state = result
            except Exception as exc:
                raise KernelError(
                    f"stateful_map {self.name!r}: the user function failed for key {typed!r}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if new_state is not None and set(new_state) != set(self.state_schema.names):
                raise KernelError(
                    f"stateful_map {self.name!r}: the new state for key {typed!r} has fields "
                    f"{sorted(new_state)}, the state schema {sorted(self.state_schema.names)}"
                )
            new_states.append(new_state)
            out_rows = produced.to_pylist() if isinstance(produced, pa.Table) else list(produced)
            for row in out_rows:
                for c, value in enumerate(typed):
                    out_cols[c].append(value)
                for c, f in enumerate(self.user_schema):
                    out_cols[len(typed) + c].append(row.get(f.name))
                out_cols[-1].append(int(row.get(WEIGHT, 1)))

        # Step 5. New states encoded per field (vectorised), deadlines and the timer index.
        try:
            encoded_cols = [
                to_plain(
                    pa.array([s[f.name] if s is not None else None for s in new_states], f.type)
                )
                for f in fields
            ]
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise KernelError(
                f"stateful_map {self.name!r}: a new state does not match the state schema: {exc}"
            ) from exc
        for j, skey in enumerate(skeys):
            shard, plain, _typed, idx = work[skey]
            kj = encode_value(plain)
            old = olds[j]
            old_deadline = old["d"] if old is not None else None
            new_state = new_states[j]
            deadline = None
            if new_state is not None and self.timeout_ms is not None and idx is not None:
                deadline = ctx.step_time_ms + self.timeout_ms
            if old_deadline is not None and old_deadline != deadline:
                changes[self._timer_key(shard, old_deadline, kj)] = None
            if deadline is not None and deadline != old_deadline:
                changes[self._timer_key(shard, deadline, kj)] = b""
            if new_state is None:
                if raws[j] is not None:
                    changes[skey] = None
                continue
            value = encode_value({"s": [col[j] for col in encoded_cols], "d": deadline})
            if value != raws[j]:
                changes[skey] = value
        try:
            arrays = [
                pa.array(vals, f.type) for vals, f in zip(out_cols, self.output_schema, strict=True)
            ]
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise KernelError(
                f"stateful_map {self.name!r}: output rows do not match the output schema: {exc}"
            ) from exc
        return KernelResult(
            pa.Table.from_arrays(arrays, schema=self.output_schema), StateChanges.of(changes)
        )
