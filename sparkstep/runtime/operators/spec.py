"""Operator specs: the small, picklable description of a stateful operator a worker runs.

An :class:`OperatorSpec` travels from the pipeline builder to every state worker (``configure``)
and into Spark tasks (pickled). It names the operator (stable: part of the fingerprint and of
the state layout), its kind (``aggregate``, ``distinct``, ``stateful_map``, ``join``), its key
columns, the Arrow schema of each input, and what the kind needs: aggregates, a user function
(serialised with ``pyspark.cloudpickle``, so lambdas and closures travel), a state schema, an
output schema and a timeout.

:func:`fingerprint` hashes what the state layout depends on: ``S``, and per operator its name,
kind, key columns with their Arrow types, aggregates, input and state schemas and timeout. The
user function's code is *not* part of it (changing code that keeps the state layout is allowed);
the store keeps the fingerprint and refuses to be opened for another one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
from pyspark import cloudpickle

from sparkstep.runtime.errors import OperatorSpecError
from sparkstep.runtime.operators.base import check_supported_type

__all__ = [
    "AGG_FUNCTIONS",
    "Agg",
    "KINDS",
    "OperatorSpec",
    "fingerprint",
]

AGG_FUNCTIONS = ("avg", "count", "max", "min", "sum")
KINDS = ("aggregate", "distinct", "join", "stateful_map")

Kind = Literal["aggregate", "distinct", "join", "stateful_map"]


@dataclass(frozen=True)
class Agg:
    """One aggregate: ``fn`` over ``column`` (``None`` only for ``count``: count(*)) as ``output``.

    SQL semantics: ``count(column)``, ``sum``, ``min``, ``max`` and ``avg`` ignore nulls; ``sum``,
    ``min``, ``max`` and ``avg`` of a key with no non-null value are null.
    """

    fn: Literal["avg", "count", "max", "min", "sum"]
    column: str | None
    output: str


@dataclass(frozen=True)
class OperatorSpec:
    """A stateful operator, as built by the ``OperatorSpec.<kind>`` constructors.

    ``inputs`` holds one schema (two for ``join``: left, right) of the operator's user columns;
    ``__`` columns in it are ignored. ``fn`` is the cloudpickled user function of
    ``stateful_map``; ``timeout_ms`` its timeout in milliseconds of logged step time.
    """

    name: str
    kind: Kind
    key: tuple[str, ...]
    inputs: tuple[pa.Schema, ...]
    aggs: tuple[Agg, ...] = ()
    state_schema: pa.Schema | None = None
    output_schema: pa.Schema | None = None
    fn: bytes | None = field(default=None, repr=False)
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise OperatorSpecError(f"operator name {self.name!r} must be non-empty, without '/'")
        if self.kind not in KINDS:
            raise OperatorSpecError(f"operator {self.name!r}: unknown kind {self.kind!r}")
        for schema in self.inputs:
            for fld in schema:
                if not fld.name.startswith("__"):
                    check_supported_type(fld.name, fld.type)
            for column in self.key:
                if column not in schema.names:
                    raise OperatorSpecError(
                        f"operator {self.name!r}: key column {column!r} is not in its input"
                    )

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def aggregate(
        cls, name: str, schema: pa.Schema, key: Sequence[str], aggs: Sequence[Agg]
    ) -> OperatorSpec:
        """``aggregate(df, name, key, aggs)``: count, sum, min, max, avg per key."""
        if not key:
            raise OperatorSpecError(f"aggregate {name!r} needs at least one key column")
        outputs = list(key)
        for agg in aggs:
            if agg.fn not in AGG_FUNCTIONS:
                raise OperatorSpecError(
                    f"aggregate {name!r}: unknown function {agg.fn!r} (use one of "
                    f"{', '.join(AGG_FUNCTIONS)})"
                )
            if agg.column is None and agg.fn != "count":
                raise OperatorSpecError(f"aggregate {name!r}: {agg.fn} needs a column")
            if agg.column is not None and agg.column not in schema.names:
                raise OperatorSpecError(f"aggregate {name!r}: no input column {agg.column!r}")
            if agg.fn in ("sum", "avg") and agg.column is not None:
                ctype = schema.field(agg.column).type
                if not (pa.types.is_integer(ctype) or pa.types.is_floating(ctype)):
                    raise OperatorSpecError(
                        f"aggregate {name!r}: {agg.fn} of {agg.column!r} needs a numeric "
                        f"column, not {ctype}"
                    )
            outputs.append(agg.output)
        if len(set(outputs)) != len(outputs) or any(o.startswith("__") for o in outputs):
            raise OperatorSpecError(
                f"aggregate {name!r}: output names {outputs} must be distinct and not start "
                "with '__'"
            )
        return cls(name=name, kind="aggregate", key=tuple(key), inputs=(schema,), aggs=tuple(aggs))

    @classmethod
    def distinct(cls, name: str, schema: pa.Schema) -> OperatorSpec:
        """``distinct(df, name)``: the set of distinct rows (over the user columns)."""
        return cls(name=name, kind="distinct", key=(), inputs=(schema,))

    @classmethod
    def join(cls, name: str, left: pa.Schema, right: pa.Schema, on: Sequence[str]) -> OperatorSpec:
        """``join(left, right, name, on)``: incremental inner equi-join on ``on``.

        The non-key user columns of the two sides must have distinct names (rename first), and
        the key columns must have the same type on both sides.
        """
        if not on:
            raise OperatorSpecError(f"join {name!r} needs at least one key column")
        for column in on:
            if (
                column in left.names
                and column in right.names
                and left.field(column).type != right.field(column).type
            ):
                raise OperatorSpecError(
                    f"join {name!r}: key {column!r} is {left.field(column).type} on the "
                    f"left and {right.field(column).type} on the right: cast one side"
                )
        lcols = {c for c in left.names if not c.startswith("__")} - set(on)
        rcols = {c for c in right.names if not c.startswith("__")} - set(on)
        if lcols & rcols:
            raise OperatorSpecError(
                f"join {name!r}: columns {sorted(lcols & rcols)} are on both sides: rename them"
            )
        return cls(name=name, kind="join", key=tuple(on), inputs=(left, right))

    @classmethod
    def stateful_map(
        cls,
        name: str,
        schema: pa.Schema,
        key: Sequence[str],
        fn: Callable[..., Any],
        state_schema: pa.Schema,
        output_schema: pa.Schema,
        timeout_ms: int | None = None,
    ) -> OperatorSpec:
        """``stateful_map(df, name, key, fn, state_schema, timeout)``; see the kernel's docs."""
        if not key:
            raise OperatorSpecError(f"stateful_map {name!r} needs at least one key column")
        for fld in [*state_schema, *output_schema]:
            check_supported_type(fld.name, fld.type)
        if any(n.startswith("__") for n in output_schema.names):
            raise OperatorSpecError(f"stateful_map {name!r}: output columns may not start '__'")
        if timeout_ms is not None and timeout_ms <= 0:
            raise OperatorSpecError(f"stateful_map {name!r}: timeout must be positive")
        return cls(
            name=name,
            kind="stateful_map",
            key=tuple(key),
            inputs=(schema,),
            state_schema=state_schema,
            output_schema=output_schema,
            fn=cloudpickle.dumps(fn),  # type: ignore[no-untyped-call]
            timeout_ms=timeout_ms,
        )

    # -- helpers ------------------------------------------------------------------------------

    def user_fn(self) -> Callable[..., Any]:
        """The unpickled user function (``stateful_map`` only)."""
        if self.fn is None:
            raise OperatorSpecError(f"operator {self.name!r} has no user function")
        loaded: Callable[..., Any] = cloudpickle.loads(self.fn)
        return loaded

    def describe(self) -> dict[str, Any]:
        """The canonical, JSON-able description the fingerprint hashes."""

        def schema_desc(schema: pa.Schema | None) -> list[list[str]] | None:
            if schema is None:
                return None
            return [[f.name, str(f.type)] for f in schema if not f.name.startswith("__")]

        return {
            "name": self.name,
            "kind": self.kind,
            "key": [[c, str(self.inputs[0].field(c).type)] for c in self.key],
            "inputs": [schema_desc(s) for s in self.inputs],
            "aggs": [[a.fn, a.column, a.output] for a in self.aggs],
            "state_schema": schema_desc(self.state_schema),
            "output_schema": schema_desc(self.output_schema),
            "timeout_ms": self.timeout_ms,
        }


def fingerprint(specs: Sequence[OperatorSpec], shards: int) -> str:
    """The hex SHA-256 of ``S`` and the specs' descriptions, sorted by operator name."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise OperatorSpecError(f"operator names must be unique, got {names}")
    doc = {"S": shards, "operators": [s.describe() for s in sorted(specs, key=lambda s: s.name)]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
