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

import base64
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
from pyspark import cloudpickle

from sparkstep.runtime.errors import OperatorSpecError
from sparkstep.runtime.operators.base import ORDER_COLUMNS, check_supported_type, user_columns

__all__ = [
    "AGG_FUNCTIONS",
    "Agg",
    "KINDS",
    "OperatorSpec",
    "fingerprint",
    "spec_from_wire",
    "spec_to_wire",
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
        pickled: bytes = cloudpickle.dumps(fn)  # type: ignore[no-untyped-call]
        return cls.stateful_map_pickled(
            name, schema, key, pickled, state_schema, output_schema, timeout_ms
        )

    @classmethod
    def stateful_map_pickled(
        cls,
        name: str,
        schema: pa.Schema,
        key: Sequence[str],
        fn: bytes,
        state_schema: pa.Schema,
        output_schema: pa.Schema,
        timeout_ms: int | None = None,
    ) -> OperatorSpec:
        """:meth:`stateful_map` with the user function already pickled (as it travels)."""
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
            fn=fn,
            timeout_ms=timeout_ms,
        )

    # -- helpers ------------------------------------------------------------------------------

    def read_columns(self, index: int = 0) -> tuple[str, ...]:
        """The columns of input ``index`` the kernel reads, besides ``__weight`` and
        ``__shard``, in the input's order: an aggregate's key and aggregated columns; the user
        columns of a distinct or a join side; a stateful_map's user columns and the
        ``__topic``, ``__partition``, ``__offset`` it orders by (the kernel contract,
        :mod:`sparkstep.runtime.operators.base`). Only these need to travel to the workers."""
        schema = self.inputs[index]
        if self.kind == "aggregate":
            wanted = {*self.key, *(a.column for a in self.aggs if a.column is not None)}
        elif self.kind == "stateful_map":
            wanted = {*user_columns(schema), *ORDER_COLUMNS}
        else:
            wanted = set(user_columns(schema))
        return tuple(name for name in schema.names if name in wanted)

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


def _schema_to_wire(schema: pa.Schema | None) -> str | None:
    return None if schema is None else base64.b64encode(schema.serialize().to_pybytes()).decode()


def _schema_from_wire(name: str, text: object) -> pa.Schema | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise OperatorSpecError(f"operator {name!r}: a schema must be base64 text")
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))
    except (ValueError, pa.ArrowException) as exc:
        raise OperatorSpecError(f"operator {name!r}: not an Arrow schema ({exc})") from exc


def spec_to_wire(spec: OperatorSpec) -> dict[str, Any]:
    """``spec`` as the JSON object of the worker's ``configure`` action (:func:`spec_from_wire`).

    Everything is data: schemas as base64 Arrow IPC, aggregates as ``[fn, column, output]``;
    the one piece of code, ``stateful_map``'s user function, is ``fn`` (base64 cloudpickle,
    null for other kinds).
    """
    return {
        "name": spec.name,
        "kind": spec.kind,
        "key": list(spec.key),
        "inputs": [_schema_to_wire(schema) for schema in spec.inputs],
        "aggs": [[agg.fn, agg.column, agg.output] for agg in spec.aggs],
        "state_schema": _schema_to_wire(spec.state_schema),
        "output_schema": _schema_to_wire(spec.output_schema),
        "timeout_ms": spec.timeout_ms,
        "fn": None if spec.fn is None else base64.b64encode(spec.fn).decode(),
    }


def spec_from_wire(doc: Mapping[str, Any]) -> OperatorSpec:
    """The spec :func:`spec_to_wire` made, validated as its constructor validates it.

    Raises :class:`OperatorSpecError` for anything malformed. ``fn`` stays pickled bytes; it is
    unpickled only by the ``stateful_map`` kernel, and only for a ``stateful_map`` spec.
    """
    try:
        name, kind = str(doc["name"]), doc["kind"]
        key = [str(column) for column in doc["key"]]
        inputs = [_schema_from_wire(name, text) for text in doc["inputs"]]
        aggs = tuple(
            Agg(agg[0], None if agg[1] is None else str(agg[1]), str(agg[2])) for agg in doc["aggs"]
        )
        timeout, fn = doc.get("timeout_ms"), doc.get("fn")
        state = _schema_from_wire(name, doc.get("state_schema"))
        output = _schema_from_wire(name, doc.get("output_schema"))
    except (KeyError, IndexError, TypeError) as exc:
        raise OperatorSpecError(f"a malformed operator spec: {exc!r}") from exc
    schemas = [schema for schema in inputs if schema is not None]
    if timeout is not None and type(timeout) is not int:
        raise OperatorSpecError(f"operator {name!r}: timeout_ms must be an integer")
    if kind == "aggregate" and len(schemas) == len(inputs) == 1:
        return OperatorSpec.aggregate(name, schemas[0], key, aggs)
    if kind == "distinct" and len(schemas) == len(inputs) == 1:
        return OperatorSpec.distinct(name, schemas[0])
    if kind == "join" and len(schemas) == len(inputs) == 2:
        return OperatorSpec.join(name, schemas[0], schemas[1], key)
    if kind == "stateful_map" and len(schemas) == len(inputs) == 1 and isinstance(fn, str):
        if state is None or output is None:
            raise OperatorSpecError(f"stateful_map {name!r} needs its state and output schemas")
        try:
            pickled = base64.b64decode(fn, validate=True)
        except ValueError as exc:
            raise OperatorSpecError(f"stateful_map {name!r}: fn is not base64") from exc
        return OperatorSpec.stateful_map_pickled(
            name, schemas[0], key, pickled, state, output, timeout
        )
    raise OperatorSpecError(
        f"operator {name!r}: kind {kind!r} with {len(inputs)} input schemas is not an operator"
    )


def fingerprint(specs: Sequence[OperatorSpec], shards: int) -> str:
    """The hex SHA-256 of ``S`` and the specs' descriptions, sorted by operator name."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise OperatorSpecError(f"operator names must be unique, got {names}")
    doc = {"S": shards, "operators": [s.describe() for s in sorted(specs, key=lambda s: s.name)]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
