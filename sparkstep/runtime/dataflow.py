"""sparkstep's stateful operators as PySpark functions, and the stateful stage that runs them.

A user's ``transform`` calls :func:`aggregate`, :func:`distinct`, :func:`stateful_map` and
:func:`join` like any DataFrame function. Each call:

1. checks the user code that produced its input
   (:func:`~sparkstep.runtime.plan_check.check_linear`);
2. registers the operator's :class:`~sparkstep.runtime.operators.OperatorSpec` with the build
   (the specs make the fingerprint and configure the workers);
3. adds ``__shard = pmod(xxhash64(key), S)`` (Spark, JVM side) and ``__worker`` (the layout's
   owner of the shard), and shuffles the rows with ``repartitionById(W, __worker)``: partition
   ``w`` of the exchange holds exactly worker ``w``'s rows, so the stateful stage
   (``mapInArrow``) is W tasks, one per worker, running in parallel up to the executor cores
   (an exchange with a fixed partition count is never coalesced by AQE). A join's two sides
   travel in the same exchange, each side's rows in its own struct column. A *narrow* build
   (:attr:`BuildContext.narrow`, for small steps) has no exchange: ``coalesce(1)`` keeps every
   row in one task, which calls each worker in turn with its rows, so the whole step is one
   Spark stage instead of one more per operator;
4. returns the operator's Z-set delta, marked as a sparkstep boundary.

Every worker is called for every operator in every step, with or without rows: one *tick* row
per worker is added to the stage's rows and removed before the call. So every worker records a
marker for every (operator, step), and ``stateful_map`` timeouts fire on steps without input. Rows
whose ``__weight`` is 0 change nothing and are dropped before the call.

The stage function runs in Spark's Python workers and calls :meth:`WorkerClient.apply`; a re-run
task gets the recorded delta back, so Spark's task retries apply state once. A join applies the
left rows (input 0) before the right rows (input 1), so the bilinear rule ``dL*R + L'*dR`` sees
a fixed order.

The plan of a step is built once and run for many steps (:mod:`sparkstep.runtime.step`), so
nothing that changes from step to step is in it. The stage function carries only the workers'
token; the step's :class:`StageTarget` (worker addresses and incarnations, the step, the
division digest, the step time, the layout epoch) reaches every task as the Spark local property
:data:`STEP_PROPERTY` of the step's job (:func:`step_property`), read in the task with
:meth:`StageTarget.current`. Local properties are fixed when a job is submitted and sent with
each of its tasks, so every attempt of a task of step ``s`` sees step ``s``'s target, and a
task that finds none (or another layout epoch than its plan's) fails instead of guessing. The
token stays out of the property: local properties are written to Spark's event log.

Outside a step (``describe`` mode, :class:`BuildContext` without a token) the operators return
empty DataFrames of their output schema: building the pipeline over empty inputs lists its
operators and schemas without touching a worker.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.failpoints import failpoint
from sparkstep.runtime.errors import PipelineDefinitionError, StageFailedError
from sparkstep.runtime.layout import Layout, shard_column
from sparkstep.runtime.operators import Agg, OperatorSpec, make_kernel
from sparkstep.runtime.operators.spec import AGG_FUNCTIONS
from sparkstep.runtime.plan_check import WEIGHT, boundary_alias, check_linear
from sparkstep.runtime.worker.client import WorkerClient
from sparkstep.storage.keys import SHARD_PREFIX_BYTES

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BuildContext",
    "STEP_PROPERTY",
    "StageTarget",
    "WorkerRoute",
    "aggregate",
    "building",
    "distinct",
    "join",
    "stateful_map",
]

#: The Spark local property that carries a step's parameters to its tasks (JSON; see the module
#: docstring and :func:`step_property`).
STEP_PROPERTY = "sparkstep.step"

SHARD = "__shard"
WORKER = "__worker"
TICK = "__tick"

_current: contextvars.ContextVar[BuildContext | None] = contextvars.ContextVar(
    "sparkstep_build", default=None
)
_AGG = re.compile(r"^\s*(\w+)\s*\(\s*(\*|[A-Za-z_][\w]*)\s*\)\s*$")


@dataclass(frozen=True)
class WorkerRoute:
    """Where worker ``w`` listens and the incarnation its current ``open(v)`` returned."""

    address: str
    incarnation: str


@dataclass(frozen=True)
class StageTarget:
    """What a stateful-stage task needs, besides the token, to call the workers for one step.

    ``layout_epoch`` is the epoch of the layout the step's rows were routed with; every apply
    carries it and a worker whose store holds another epoch refuses the call.
    """

    routes: tuple[WorkerRoute, ...]
    step: int
    division_digest: str
    step_time_ms: int
    layout_epoch: int
    timeout_s: float = 120.0

    def to_json(self) -> dict[str, Any]:
        return {
            "routes": [[r.address, r.incarnation] for r in self.routes],
            "step": self.step,
            "division_digest": self.division_digest,
            "step_time_ms": self.step_time_ms,
            "layout_epoch": self.layout_epoch,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StageTarget:
        return cls(
            routes=tuple(
                WorkerRoute(address, incarnation) for address, incarnation in doc["routes"]
            ),
            step=int(doc["step"]),
            division_digest=str(doc["division_digest"]),
            step_time_ms=int(doc["step_time_ms"]),
            layout_epoch=int(doc["layout_epoch"]),
            timeout_s=float(doc["timeout_s"]),
        )

    @classmethod
    def current(cls, layout_epoch: int) -> StageTarget:
        """The target of the step whose task this is (in a Spark task only).

        Raises :class:`StageFailedError` when the task's job carries no step, or a step of
        another layout epoch than ``layout_epoch``, the one its plan routed the rows with.
        """
        target = cls.from_json(step_parameters()["target"])
        if target.layout_epoch != layout_epoch:
            raise StageFailedError(
                f"step {target.step} runs with layout epoch {target.layout_epoch}, but its plan "
                f"routed the rows for epoch {layout_epoch}"
            )
        return target


def step_property(target: StageTarget, **more: Any) -> str:
    """The value of :data:`STEP_PROPERTY` for a step: its target and ``more`` (other stages'
    parameters, e.g. the read's ranges), as JSON."""
    return json.dumps({"target": target.to_json(), **more}, separators=(",", ":"))


def step_parameters() -> dict[str, Any]:
    """The parameters of the step whose task this is (in a Spark task only; see
    :func:`step_property`). Raises :class:`StageFailedError` outside a sparkstep step."""
    from pyspark import TaskContext

    context = TaskContext.get()
    raw = None if context is None else context.getLocalProperty(STEP_PROPERTY)
    if not raw:
        raise StageFailedError(
            f"a sparkstep stage ran in a Spark job without the {STEP_PROPERTY!r} property: its "
            "plan can only run inside a step"
        )
    doc: dict[str, Any] = json.loads(raw)
    return doc


@dataclass
class BuildContext:
    """One build of the pipeline's plan: to run steps (``token`` set: the workers' token) or to
    describe it (``token`` None)."""

    spark: SparkSession
    layout: Layout
    token: str | None = None
    #: Route each stateful stage's rows without an exchange, all in one task (small steps).
    narrow: bool = False
    specs: dict[str, OperatorSpec] = field(default_factory=dict)

    def register(self, spec: OperatorSpec) -> None:
        if spec.name in self.specs:
            raise PipelineDefinitionError(
                f"two operators are named {spec.name!r}: every sparkstep operator needs its own "
                "stable name="
            )
        self.specs[spec.name] = spec


@contextmanager
def building(ctx: BuildContext) -> Iterator[BuildContext]:
    """Make ``ctx`` the build the operators called inside the block register with."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def _context(operator: str) -> BuildContext:
    ctx = _current.get()
    if ctx is None:
        raise PipelineDefinitionError(
            f"sparkstep.{operator}() was called outside a pipeline step: call it inside the "
            "pipeline's transform, which sparkstep runs"
        )
    return ctx


# -- the operators users call ------------------------------------------------------------------


def aggregate(
    df: DataFrame,
    name: str,
    key: Sequence[str],
    aggs: Mapping[str, str] | Sequence[Agg],
) -> DataFrame:
    """Per key, ``count``, ``sum``, ``min``, ``max`` and ``avg`` over the whole stream.

    ``aggs`` maps each output column to ``"fn(column)"`` (``"count(*)"`` counts rows), e.g.
    ``{"total": "sum(amount)", "n": "count(*)"}``. Output: the key columns, the aggregates and
    ``__weight``; a changed key retracts its old row (-1) and inserts the new one (+1).
    """
    ctx = _context("aggregate")
    check_linear(df, f"the input of aggregate {name!r}")
    spec = OperatorSpec.aggregate(name, _arrow_schema(df), list(key), _parse_aggs(name, aggs))
    return _stateful(ctx, spec, [(df, list(key))])


def distinct(df: DataFrame, name: str) -> DataFrame:
    """The distinct rows (user columns) of the stream, as a Z-set: each row once while present."""
    ctx = _context("distinct")
    check_linear(df, f"the input of distinct {name!r}")
    spec = OperatorSpec.distinct(name, _arrow_schema(df))
    columns = [c for c in df.columns if not c.startswith("__")]
    return _stateful(ctx, spec, [(df, columns)])


def stateful_map(
    df: DataFrame,
    name: str,
    key: Sequence[str],
    fn: Callable[..., Any],
    state_schema: str | pa.Schema,
    output_schema: str | pa.Schema,
    timeout: float | None = None,
) -> DataFrame:
    """A user function per key over its new rows, its previous state and the step time.

    See :class:`~sparkstep.runtime.operators.StatefulMapKernel` for ``fn``'s contract.
    ``timeout`` (seconds of logged step time) fires ``fn`` for a key without new rows.
    Schemas are Spark DDL strings (``"count long, last string"``) or Arrow schemas.
    """
    ctx = _context("stateful_map")
    check_linear(df, f"the input of stateful_map {name!r}")
    spec = OperatorSpec.stateful_map(
        name,
        _arrow_schema(df),
        list(key),
        fn,
        _schema(state_schema),
        _schema(output_schema),
        timeout_ms=None if timeout is None else round(timeout * 1000),
    )
    return _stateful(ctx, spec, [(df, list(key))])


def join(left: DataFrame, right: DataFrame, name: str, on: Sequence[str]) -> DataFrame:
    """The incremental inner equi-join of two streams on the columns ``on``."""
    ctx = _context("join")
    check_linear(left, f"the left input of join {name!r}")
    check_linear(right, f"the right input of join {name!r}")
    spec = OperatorSpec.join(name, _arrow_schema(left), _arrow_schema(right), list(on))
    return _stateful(ctx, spec, [(left, list(on)), (right, list(on))])


# -- building the stage ------------------------------------------------------------------------


def _parse_aggs(name: str, aggs: Mapping[str, str] | Sequence[Agg]) -> list[Agg]:
    if not isinstance(aggs, Mapping):
        return list(aggs)
    parsed = []
    for output, text in aggs.items():
        match = _AGG.match(text)
        if match is None or match.group(1).lower() not in AGG_FUNCTIONS:
            raise PipelineDefinitionError(
                f"aggregate {name!r}: {output}={text!r} must be fn(column) with fn one of "
                f"{', '.join(AGG_FUNCTIONS)}, e.g. 'sum(value)' or 'count(*)'"
            )
        fn, column = match.group(1).lower(), match.group(2)
        if column == "*" and fn != "count":
            raise PipelineDefinitionError(f"aggregate {name!r}: {text!r}: only count takes *")
        parsed.append(Agg(fn, None if column == "*" else column, output))  # type: ignore[arg-type]
    return parsed


def _schema(value: str | pa.Schema) -> pa.Schema:
    if isinstance(value, pa.Schema):
        return value
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    struct = StructType.fromDDL(value)
    if not isinstance(struct, StructType):
        raise PipelineDefinitionError(f"schema {value!r} is not a list of fields")
    return to_arrow_schema(struct, timezone="UTC")


def _arrow_schema(df: DataFrame) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    timezone = df.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC"
    return to_arrow_schema(df.schema, timezone=timezone)


def _stateful(
    ctx: BuildContext, spec: OperatorSpec, inputs: list[tuple[DataFrame, list[str]]]
) -> DataFrame:
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    ctx.register(spec)
    kernel = make_kernel(spec, SHARD_PREFIX_BYTES, ctx.layout.shards)
    out_schema = from_arrow_schema(kernel.output_schema, prefer_timestamp_ntz=False)
    alias = boundary_alias(f"op_{spec.name}")
    if ctx.token is None:
        return ctx.spark.createDataFrame([], out_schema).alias(alias)

    workers = ctx.layout.workers
    # One SQL literal for the S owners: a Column per shard would cost S JVM calls every step.
    owners = F.expr(f"array({','.join(str(int(w)) for w in ctx.layout.owners)})")
    ticks = ctx.spark.range(0, workers, 1, numPartitions=1).select(
        F.col("id").cast("int").alias(WORKER), F.lit(True).alias(TICK)
    )
    routed = []
    for index, (df, key) in enumerate(inputs):
        # Only the columns the kernel reads cross the exchange and reach the workers: for the
        # keyed_sum example that leaves out __topic, __partition, __offset and __timestamp,
        # half of each row's bytes.
        columns = [*spec.read_columns(index), WEIGHT]
        rows = (
            df.select(*columns)
            .withColumn(SHARD, shard_column(key, ctx.layout.shards))
            .withColumn(WORKER, F.element_at(owners, F.col(SHARD) + 1))
            .where(F.col(WEIGHT) != 0)
        )
        if len(inputs) > 1:
            # Both sides of a join travel in one exchange, each side's row in its own struct.
            rows = rows.select(F.struct(*columns, SHARD).alias(_side(index)), WORKER)
        routed.append(rows.withColumn(TICK, F.lit(False)))
    union = routed[0]
    for more in routed[1:]:
        union = union.unionByName(more, allowMissingColumns=True)
    # Wide: partition w holds exactly worker w's rows and its tick row, W tasks, one per worker,
    # that run in parallel up to the executor cores (a shuffle with a fixed partition count is
    # never coalesced by AQE). Narrow: one task, no exchange; it calls every worker in turn
    # (_by_worker groups its rows).
    stage = union.unionByName(ticks, allowMissingColumns=True)
    stage = stage.coalesce(1) if ctx.narrow else stage.repartitionById(workers, WORKER)
    call = _single_call if len(inputs) == 1 else _pair_call
    out = stage.mapInArrow(call(ctx.token, ctx.layout.epoch, spec.name), out_schema)
    return out.alias(alias)


# -- the stage function (runs in Spark's Python workers) ---------------------------------------

_clients: dict[tuple[str, str], WorkerClient] = {}
_clients_lock = threading.Lock()


def _client(token: str, target: StageTarget, worker: int) -> WorkerClient:
    """One client per worker address and token in each Python worker process, reused."""
    address = target.routes[worker].address
    with _clients_lock:
        client = _clients.get((address, token))
        if client is None:
            client = WorkerClient(address, token, timeout=target.timeout_s)
            _clients[(address, token)] = client
        return client


def _side(index: int) -> str:
    """The struct column that carries a join side's rows through the stage's exchange."""
    return f"__input{index}"


def _by_worker(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, pa.Table]]:
    """A stage partition's rows, per worker in the partition (one: partition ``w`` holds worker
    ``w``'s rows and tick; grouping here keeps a call exact however Spark partitioned)."""
    chunks = list(batches)
    if not chunks:
        return
    table = pa.Table.from_batches(chunks)
    for worker in sorted(pc.unique(table.column(WORKER)).to_pylist()):
        yield int(worker), table.filter(pc.equal(table.column(WORKER), worker))


def _rows(table: pa.Table) -> pa.Table:
    """The real rows of a worker's part: tick rows removed, routing columns dropped."""
    real = table.filter(pc.invert(pc.fill_null(table.column(TICK), True)))
    return real.drop_columns([TICK, WORKER])


def _side_rows(table: pa.Table, index: int) -> pa.Table:
    """The rows of join side ``index`` in a worker's part, as the side's own columns."""
    column = table.column(_side(index))
    return pa.Table.from_struct_array(column.filter(pc.is_valid(column)))


def _apply(
    token: str, target: StageTarget, operator: str, worker: int, rows: pa.Table, index: int
) -> pa.Table:
    result = _client(token, target, worker).apply(
        target.routes[worker].incarnation,
        target.step,
        operator,
        target.division_digest,
        rows,
        input=index,
        step_time_ms=target.step_time_ms,
        layout_epoch=target.layout_epoch,
    )
    delta: pa.Table = result.delta
    if _first_attempt():
        # Crash tests: the task dies after its apply succeeded; Spark retries it and the retry
        # gets the recorded delta (state applied once).
        failpoint("stage.after_apply")
    return delta


def _first_attempt() -> bool:
    from pyspark import TaskContext

    context = TaskContext.get()
    return context is not None and context.attemptNumber() == 0


Stage = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


def _single_call(token: str, layout_epoch: int, operator: str) -> Stage:
    def call(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        target = StageTarget.current(layout_epoch)
        for worker, table in _by_worker(batches):
            yield from _apply(token, target, operator, worker, _rows(table), 0).to_batches()

    return call


def _pair_call(token: str, layout_epoch: int, operator: str) -> Stage:
    def call(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        target = StageTarget.current(layout_epoch)
        for worker, table in _by_worker(batches):
            for index in (0, 1):
                rows = _side_rows(table, index)
                yield from _apply(token, target, operator, worker, rows, index).to_batches()

    return call
