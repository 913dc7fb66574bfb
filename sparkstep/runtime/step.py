"""One step on Spark: read the division's ranges, decode, run the user's code, collect.

:meth:`StepRunner.run` takes a division and a way to make the step's
:class:`~sparkstep.runtime.dataflow.StageTarget`, and returns what the writer needs, as Arrow on
the driver. A step is ONE Spark job, whether its division is final (a replay) or tentative (the
planner's). Its jobs are in the job group :meth:`StepRunner.job_group`.

1. One row per input partition (a *slot*: topic, partition) is a DataFrame parallelized from
   the driver (no job); one ``mapInArrow`` on the executors reads each slot's range of the step
   with :func:`sparkstep.io.ranges.map_read`: exactly ``[start, end)`` read_committed, or for a
   tentative division up to the range's share of the step's byte budget, its records followed
   by one summary row (where the read stopped, count, hash, largest timestamp); an empty range
   is not read. The read's task decides the records it can with the decode's fast path
   (:func:`~sparkstep.runtime.decode.predecoder`), the read is decoded for every input
   (:func:`~sparkstep.runtime.decode.decode_read`: one parse of each other record), and the decoded
   read is persisted for the step and released after it, so neither the Kafka read nor the
   parse is repeated by its uses (the input rows, the dead letters, the summaries); a lost
   block or a retried task re-reads the same records and cuts at the same offset, because the
   records of a range and their sizes never change.
2. The workers' target is made for the division as given, before the job. For a tentative
   division its digest covers the byte budget: that and the ranges fix which records the read
   takes, so every attempt of the step's stateful stage applies the same rows. A step is run
   once per runtime incarnation, so the workers never see the same step with two targets; after
   a crash the stores reopen at a checkpoint, which holds no marker of an unlogged step.
3. The pipeline's transform is built over the inputs' rows of the decoded read, so its
   sparkstep operators call the workers.
4. One collected table carries the output, every input's dead-letter rows and the summary rows,
   told apart by a ``__part`` column. A dead letter or a summary (a *side row*) is one JSON
   text in the ``__side`` column (Spark's ``to_json`` of its fields, binary fields as base64),
   null on output rows, so an output row carries one null besides its own columns; with a column
   per side field it carried 14, two thirds of a 200k-record step's collected bytes (Arrow
   keeps a buffer slot for every null). Counts and hashes travel as data, never in accumulators
   (a re-run task would add to an accumulator twice). The summaries give the final division
   (:meth:`~sparkstep.io.division.Division.cut`, for a final division a check that every range
   was read whole), which is what the step log records.

The output table has the user's columns and ``weight`` (the writer's weight column); other
``__`` columns are dropped.

**Small steps are one Spark stage.** A division of at most :attr:`StepRunner.narrow_offsets`
offsets (:data:`NARROW_STEP_OFFSETS` by default) runs a *narrow* plan: one task reads every
range and calls every worker in turn, with no exchange before the stateful stages
(:attr:`~sparkstep.runtime.dataflow.BuildContext.narrow`). Each worker gets the same rows
either way (in an order neither plan fixes), so the choice changes no state and no output; it
saves one stage (about 150 ms of Spark's task plumbing) per operator on a step that has little
to read. Larger steps run the
*wide* plan, whose stateful stages are W tasks in parallel.

**The plan is built once and run for many steps.** Building it (steps 1 and 3: about 1,200
py4j calls and as many eager analyses) cost about half of a small step. So the plan holds
nothing that changes between steps: a :class:`_StepPlan` is built for a layout and a set of
slots, narrow or wide (both are kept), and is built again only when the layout or the slots
change (a rescale, an input partition added).
What a step changes travels as data: the step's ranges, byte budget and
:class:`~sparkstep.runtime.dataflow.StageTarget` are the job's Spark local property
:data:`~sparkstep.runtime.dataflow.STEP_PROPERTY`, which every task of the job (and every
retry of one) reads.

A step of a plan with an exchange (every wide step's) runs a *new* ``Dataset`` made from the
plan's analyzed logical plan (``Dataset.ofRows``), optimized and planned again (JVM only, about
95 ms). It must be: executing the same ``Dataset`` object twice reuses its physical plan,
shuffle ids included, and Spark would skip the shuffle map stages whose outputs it already has:
the stateful stage would get the previous step's rows. A read still cached from an earlier step
(same plan) is dropped before the step, never used. A plan without an exchange (a narrow one)
plans its Dataset at its first step and *reruns* that Dataset's physical plan for every later
step, if none of its operators keeps anything from one run to the next (:class:`_Rerun`); a
one-record step spends its time in the job, not in planning it.
``tests/runtime/test_step_plan.py`` shows all three.

**Planned ahead.** A plan that is planned every step is kept as two *twins*, built alike but
for one value in their slot rows (the plan's key). While a step's job runs on one twin, a
background thread plans the next step's Dataset on the other (:meth:`_StepPlan.prepare`:
persist a fresh read, make the query, force its physical plan; at the plan's first step it
builds twin 1 first), and the next step runs that one: the twins alternate, and the next step
starts with its job. In the loop that planning took 0.2-0.75 s between two jobs (the writer
thread and the workers compete for the driver's CPU). The twins' reads differ,
so the query planned ahead never binds to the running step's persisted read, which Spark's
cache would otherwise substitute for its own; and nothing of a step's parameters is in a plan,
so a Dataset planned before its step's division is known computes that step. The thread ends
before the step's SQL settings are put back (it plans under them). A failure to plan ahead is
logged and the step plans as before.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from py4j.protocol import Py4JError
from pyspark import StorageLevel

from sparkstep.errors import SparkstepError
from sparkstep.io.config import KafkaConfig
from sparkstep.io.deadletter import DeadLetter, dead_letters_from_arrow
from sparkstep.io.division import Division
from sparkstep.io.ranges import (
    RECORD_SCHEMA,
    SUMMARY_SCHEMA,
    ReadSummary,
    map_read,
    range_hash,
    read_summaries,
)
from sparkstep.io.steplog import RangeSummary
from sparkstep.runtime.dataflow import (
    STEP_PROPERTY,
    BuildContext,
    StageTarget,
    building,
    step_parameters,
    step_property,
)
from sparkstep.runtime.decode import (
    DEAD_LETTER_COLUMNS,
    DecodedRead,
    decode_read,
    predecoder,
    read_schema,
)
from sparkstep.runtime.errors import StageFailedError
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.operators import OperatorSpec
from sparkstep.runtime.pipeline import Pipeline
from sparkstep.runtime.plan_check import WEIGHT, boundary_alias, check_linear, scala_seq
from sparkstep.runtime.predecode import Predecoder

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = [
    "NARROW_STEP_OFFSETS",
    "OUTPUT_WEIGHT",
    "STEP_SQL_CONF",
    "StepOutput",
    "StepRunner",
    "session_conf",
]

log = logging.getLogger(__name__)

OUTPUT_WEIGHT = "weight"


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, on the driver; ``division`` is the final division read."""

    division: Division
    output: pa.Table
    dead_letters: list[DeadLetter]
    summaries: tuple[RangeSummary, ...]
    max_input_ts: int | None


@dataclass
class _StepPlan:
    """A step's query for one layout, one set of slots, narrow or wide, kept as analyzed logical
    plans (JVM objects) from which each step makes new Datasets; see the module docstring.

    ``rerun`` is set once a step has run the plan and found it rerunnable (:class:`_Rerun`):
    the later steps run that step's physical plan again instead of planning a new Dataset.
    ``plans_every_step`` is set once a step has found it not rerunnable: before the job of its
    first step when an operator is not (every wide plan: from its first step the next one is
    planned ahead), or after it when its cached read cannot be rerun. Its operators are the
    plan's, so the later steps do not look again.
    """

    key: tuple[bool, int]  # (narrow, twin): where StepRunner keeps it
    layout: Layout
    slots: tuple[tuple[str, int], ...]
    columns: tuple[str, ...]
    specs: dict[str, OperatorSpec]  # the pipeline's operators, as its build registered them
    read: Any
    query: Any
    rerun: _Rerun | None = None
    plans_every_step: bool = False
    prepared: tuple[DataFrame, DataFrame] | None = None  # (read persisted, query planned)

    def execute(self, spark: SparkSession, planned: Callable[[], None]) -> pa.Table:
        """Run the step whose parameters are the job's local property; its collected table.

        The first run plans a new Dataset of the query over a freshly persisted read
        (:meth:`fresh_read`, :meth:`fresh_query`) and keeps it as :attr:`rerun` if it is
        rerunnable; later runs rerun it, or plan again if it is not (:attr:`plans_every_step`),
        or run what :meth:`prepare` planned ahead. A failed rerun drops it, so the next step
        plans afresh. ``planned`` is called once the step's plan is made and
        :attr:`plans_every_step` is known, before the job starts.
        """
        if self.rerun is not None:
            planned()
            try:
                return self.rerun.run(spark)
            except BaseException:
                self.rerun = None
                raise
        prepared, self.prepared = self.prepared, None
        read = self.fresh_read(spark) if prepared is None else prepared[0]
        rerun = None
        try:
            query = self.fresh_query(spark) if prepared is None else prepared[1]
            if not self.plans_every_step and not _Rerun.may_rerun(query):
                self.plans_every_step = True
            planned()
            table = query.toArrow()
            if not self.plans_every_step:
                rerun = _Rerun.of(query)
                self.plans_every_step = rerun is None
        finally:
            # Blocking when the cached batches' RDD lives on in a rerun: the next step persists
            # that same RDD again, and a block of this step left behind would stand in for the
            # next step's read.
            read.unpersist(blocking=rerun is not None)
        self.rerun = rerun
        return table

    def fresh_read(self, spark: SparkSession) -> DataFrame:
        """A new Dataset of the decoded read, persisted for this step (the caller unpersists it).

        Every step's read has the same plan, so a read still cached from an earlier step (its
        unpersist failed) would be used in place of this one's: it is dropped first, never
        used.
        """
        read = _fresh(spark, self.read)
        if read.storageLevel != StorageLevel.NONE:
            log.warning("a read of an earlier step was still cached: dropped before this step")
            read.unpersist(blocking=True)
        return read.persist(StorageLevel.MEMORY_AND_DISK)

    def fresh_query(self, spark: SparkSession) -> DataFrame:
        """A new Dataset of the step's query (after :meth:`fresh_read`, so that it reads the
        persisted read)."""
        return _fresh(spark, self.query)

    def prepare(self, spark: SparkSession) -> None:
        """Plan the next run's Dataset now (:attr:`prepared`): persist a fresh read, make the
        query over it and force its physical plan. Called while another plan's step runs
        (:meth:`StepRunner.run`, "planned ahead"); never while this plan's read is in use.
        A failure is logged and leaves nothing prepared: the run plans as usual."""
        self.release()
        read = None
        try:
            read = self.fresh_read(spark)
            query = self.fresh_query(spark)
            query._jdf.queryExecution().executedPlan()
        except Exception as exc:  # planning ahead only saves time: the run plans as usual
            if read is not None:
                read.unpersist(blocking=False)
            log.warning("the next step's plan could not be made ahead: %s", _cause(exc))
            return
        self.prepared = (read, query)

    def release(self) -> None:
        """Drop what :meth:`prepare` made, if anything (its read was never computed). Never
        raises: a read left persisted is dropped by the next :meth:`fresh_read` of its plan."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            try:
                prepared[0].unpersist(blocking=False)
            except Exception as exc:  # the JVM may be gone: nothing else to drop then
                log.warning("a step planned ahead could not be dropped: %s", _cause(exc))


#: The physical operators a rerun may hold: each computes its rows from its children, its own
#: parameters and the task's local properties alone, and keeps nothing from one run of the plan
#: to the next. An exchange is not here (a rerun would reuse its shuffle output: the previous
#: step's rows), nor a broadcast, nor a file scan (it lists its files once). The read's cached
#: batches (``InMemoryTableScanExec``) are a rerun's own business, see :class:`_Rerun`.
RERUNNABLE_OPERATORS = frozenset(
    {
        "ArrowEvalPythonExec",
        "BatchEvalPythonExec",
        "CoalesceExec",
        "ColumnarToRowExec",
        "FilterExec",
        "GenerateExec",
        "InMemoryTableScanExec",
        "InputAdapter",
        "LocalTableScanExec",
        "MapInArrowExec",
        "MapInPandasExec",
        "ProjectExec",
        "RangeExec",
        "RDDScanExec",
        "UnionExec",
        "WholeStageCodegenExec",
    }
)


@dataclass(frozen=True)
class _Rerun:
    """A step's executed Dataset, run again for each later step of its plan.

    Planning a Dataset of the step's query (optimizing it, persisting its read, making its
    physical plan) took about 95 ms of a one-record step. Running an executed Dataset again
    reruns its physical plan: every task reads the step's parameters from the new job's local
    property, so the plan computes the new step. That is exact only for a plan none of whose
    operators keeps anything between runs (:data:`RERUNNABLE_OPERATORS`, no subquery); a plan
    with an exchange (every wide step's) is planned afresh each step, as the module docstring
    says.

    The read is cached for a step as before, but by hand: the query's scans of the cached read
    hold the RDD of its cached batches (``buffers``) from their first run, so a rerun persists
    that RDD for the step and unpersists it, blocking, after; the job's tasks then compute its
    blocks once, from the step's ranges. Its blocking unpersist is what keeps one step's blocks
    from standing in for the next step's read (the RDD, and so its block ids, are the same).
    """

    query: DataFrame
    buffers: Any  # JVM RDD[CachedBatch]

    @classmethod
    def of(cls, query: DataFrame) -> _Rerun | None:
        """``query``, executed once with its read persisted, as a rerun; None if its physical
        plan is not rerunnable or does not scan exactly one cached relation (the step's read).

        The plan is read through Spark's internal classes; should another Spark version not
        have one of them, the plan is planned every step (a warning says so), never rerun on a
        guess.
        """
        try:
            return cls._of(query)
        except Py4JError as exc:
            cls._unreadable(exc)
            return None

    @classmethod
    def may_rerun(cls, query: DataFrame) -> bool:
        """Whether every operator of ``query``'s physical plan (made now if it is not yet) is
        rerunnable: before the first run of a plan, so that a plan that is not is planned
        ahead from its first step (:meth:`StepRunner.run`). False, with :meth:`of`'s warning,
        when the plan cannot be read."""
        try:
            return cls._cached_builders(query) is not None
        except Py4JError as exc:
            cls._unreadable(exc)
            return False

    @staticmethod
    def _unreadable(exc: Py4JError) -> None:
        log.warning("small steps are planned every step: their plan could not be read: %s", exc)

    @classmethod
    def _of(cls, query: DataFrame) -> _Rerun | None:
        builders = cls._cached_builders(query)
        if builders is None or len(builders) != 1 or not builders[0].isCachedColumnBuffersLoaded():
            return None
        return cls(query, builders[0].cachedColumnBuffers())

    @staticmethod
    def _cached_builders(query: DataFrame) -> list[Any] | None:
        """The distinct cache builders ``query``'s physical plan scans, or None if it holds an
        operator that is not rerunnable (or a subquery)."""
        builders: list[Any] = []
        pending = [query._jdf.queryExecution().executedPlan()]
        while pending:
            node = pending.pop()
            name = node.getClass().getSimpleName()
            if name not in RERUNNABLE_OPERATORS or node.subqueries().size():
                log.debug("a step's plan is planned every step: it holds %s", name)
                return None
            if name == "InMemoryTableScanExec":
                builder = node.relation().cacheBuilder()
                if not any(builder.equals(b) for b in builders):
                    builders.append(builder)
                pending.append(node.relation().cachedPlan())
            pending.extend(scala_seq(node.children()))
        return builders

    def run(self, spark: SparkSession) -> pa.Table:
        """Run the query for the step of the job's local property; its collected table."""
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        self.buffers.persist(jvm.org.apache.spark.storage.StorageLevel.MEMORY_AND_DISK())
        try:
            return self.query.toArrow()
        finally:
            self.buffers.unpersist(True)


def _fresh(spark: SparkSession, logical: Any) -> DataFrame:
    """A new Dataset, with a QueryExecution of its own, of the analyzed plan ``logical``."""
    from pyspark.sql import DataFrame

    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jdf = jvm.org.apache.spark.sql.classic.Dataset.ofRows(spark._jsparkSession, logical)
    return DataFrame(jdf, spark)


#: The most offsets a step may cover to run as one Spark stage (see the module docstring).
NARROW_STEP_OFFSETS = 10_000


class StepRunner:
    """Runs steps of one pipeline on one SparkSession; ``token`` is the workers' token.

    ``narrow_offsets``: steps of at most that many offsets run the narrow plan (0: never).
    Narrow and wide steps give the same state and output, so a replay may run a step the
    other way.
    """

    def __init__(
        self,
        spark: SparkSession,
        pipeline: Pipeline,
        topics: Mapping[str, str],
        kafka: KafkaConfig,
        token: str,
        narrow_offsets: int = NARROW_STEP_OFFSETS,
    ) -> None:
        self.spark = spark
        self.pipeline = pipeline
        self.topics = dict(topics)
        self.kafka = kafka
        self.token = token
        self._id = uuid.uuid4().hex[:12]
        self._plans: dict[tuple[bool, int], _StepPlan] = {}  # by (narrow, twin)
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="sparkstep-plan-ahead")
        self.narrow_offsets = narrow_offsets

    def job_group(self, step: int) -> str:
        """The Spark job group of this runner's jobs of ``step`` (for
        ``SparkContext.statusTracker().getJobIdsForGroup``)."""
        return f"sparkstep.{self._id}.step.{step}"

    def describe(
        self, layout: Layout, slots: Sequence[tuple[str, int]] = ()
    ) -> dict[str, OperatorSpec]:
        """The pipeline's operator specs (by name), from the wide step plan for ``layout`` and
        the input partitions ``slots`` (topic, partition; in a division's order), built now if
        the runner does not hold it. Nothing runs and no worker is called.

        The plan is kept, so that a wide step of that layout and those slots (a backlog's first
        step, a replay's) starts with its job: recovery needs the specs before any step, and
        building the plan is most of what describing it costs (a second or more at a runtime's
        start, while the JVM is cold).
        """
        return self._plan(False, 0, layout, tuple(slots)).specs

    def _inputs(self) -> list[tuple[str, StructType]]:
        """Every input's topic and value schema, in the pipeline's input order."""
        return [(self.topics[name], self.pipeline.schema(name)) for name in self.pipeline.inputs]

    def _decoded(self, read: DataFrame) -> tuple[dict[str, DataFrame], DecodedRead]:
        """The pipeline's input DataFrames (by input name) over ``read`` (of
        :func:`~sparkstep.runtime.decode.read_schema`), and the decoded read they are built
        on."""
        names = list(self.pipeline.inputs)
        decoded = decode_read(read, self._inputs())
        inputs = {
            name: decoded.good(index).alias(boundary_alias(f"source_{name}"))
            for index, name in enumerate(names)
        }
        return inputs, decoded

    def run(
        self, division: Division, layout: Layout, target: Callable[[Division], StageTarget]
    ) -> StepOutput:
        """Run ``division`` through the pipeline; see the module docstring. ``target`` makes
        the workers' target for ``division`` (called once, before any worker is called); the
        returned :attr:`StepOutput.division` is the final division read.

        A failed Spark job (every attempt of a task failed: a worker unreachable or fenced, a
        Kafka read that failed) raises :class:`StageFailedError` with the cause in one line.
        """
        try:
            return self._run(division, layout, target)
        except SparkstepError:
            raise
        except Exception as exc:  # py4j and pyspark wrap the executors' errors in their own
            raise StageFailedError(f"step {division.step} failed in Spark: {_cause(exc)}") from exc

    def _run(
        self, division: Division, layout: Layout, target: Callable[[Division], StageTarget]
    ) -> StepOutput:
        plan = self._plan_for(division, layout)
        parameters = step_property(
            target(division),
            read={
                "max_bytes": division.range_byte_budget(),
                "ranges": [[r.topic, r.partition, r.start, r.end] for r in division.ranges],
            },
        )
        sc = self.spark.sparkContext
        sc.setJobGroup(self.job_group(division.step), f"sparkstep step {division.step}")
        sc.setLocalProperty(STEP_PROPERTY, parameters)
        try:
            ahead: list[Future[_StepPlan]] = []

            def planned() -> None:
                future = self._plan_ahead(plan)
                if future is not None:
                    ahead.append(future)

            with session_conf(self.spark, STEP_SQL_CONF):
                try:
                    table = plan.execute(self.spark, planned)
                finally:
                    for future in ahead:
                        self._keep(future)
            return self._collected(division, plan.columns, table)
        finally:
            for key in ("spark.jobGroup.id", "spark.job.description", STEP_PROPERTY):
                sc.setLocalProperty(key, None)  # type: ignore[arg-type]

    def close(self) -> None:
        """Drop every Dataset planned ahead (their reads stay persisted until then) and end
        the thread that plans ahead; the runner stays usable (a later step starts another)."""
        self._ahead.shutdown(wait=True)
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="sparkstep-plan-ahead")
        for plan in self._plans.values():
            plan.release()

    def _plan_for(self, division: Division, layout: Layout) -> _StepPlan:
        """The plan for ``division`` and ``layout``: the last one, or a new one; for a plan
        that is planned every step, twin 1 when it was planned ahead for this step, else twin
        0 (module docstring, "Planned ahead")."""
        slots = tuple(r.key for r in division.ranges)
        narrow = division.offset_count <= self.narrow_offsets
        plan = self._plan(narrow, 0, layout, slots)
        twin = self._plans.get((narrow, 1))
        if (
            plan.plans_every_step
            and twin is not None
            and twin.prepared is not None
            and (twin.layout, twin.slots) == (layout, slots)
        ):
            return twin
        return plan

    def _plan(
        self, narrow: bool, twin: int, layout: Layout, slots: tuple[tuple[str, int], ...]
    ) -> _StepPlan:
        plan = self._plans.get((narrow, twin))
        if plan is None or (plan.layout, plan.slots) != (layout, slots):
            gone = self._plans.pop((narrow, twin), None)  # a failed build leaves no plan behind
            if gone is not None:
                gone.release()
            plan = self._plans[narrow, twin] = self._build(layout, slots, narrow, twin)
        return plan

    def _plan_ahead(self, plan: _StepPlan) -> Future[_StepPlan] | None:
        """While ``plan`` runs a step: if it is planned every step, plan the next step's
        Dataset on its twin (built first if there is none yet: at the plan's first step) in
        the background; the caller waits for it once the step's job has ended, still under
        the step's SQL settings. None when there is nothing to plan ahead."""
        if not plan.plans_every_step:
            return None
        narrow, twin = plan.key[0], 1 - plan.key[1]
        current = self._plans.get((narrow, twin))

        def prepare() -> _StepPlan:
            other = current
            if other is None or (other.layout, other.slots) != (plan.layout, plan.slots):
                if other is not None:
                    other.release()
                other = self._build(plan.layout, plan.slots, narrow, twin)
                other.plans_every_step = True
            other.prepare(self.spark)
            return other

        return self._ahead.submit(prepare)

    def _keep(self, ahead: Future[_StepPlan]) -> None:
        """Keep the twin :meth:`_plan_ahead` prepared; a failure to build it is logged (the
        next step builds it again, in its own time)."""
        try:
            twin = ahead.result()
        except Exception as exc:  # planning ahead only saves time
            log.warning("the next step's plan could not be built ahead: %s", _cause(exc))
            return
        self._plans[twin.key] = twin

    def _build(
        self, layout: Layout, slots: tuple[tuple[str, int], ...], narrow: bool, twin: int
    ) -> _StepPlan:
        """The step's query for ``layout``, ``slots`` and ``narrow``: output rows, dead letters
        and the read summaries, tagged by ``__part`` (nothing runs). The plan's key (narrow,
        ``twin``) is part of the slot rows, so that no two plans the runner keeps have the same
        read to Spark's cache: a query planned while another plan's read is persisted (planned
        ahead) cannot read that one."""
        from pyspark.sql import functions as F

        # Parallelized from the driver (no Spark job). Wide: one partition per slot, the ranges
        # of a step are read in parallel up to the executor cores; narrow: all in one.
        plan = 2 * narrow + twin
        slot_rows = self.spark.createDataFrame(
            [(topic, partition, plan) for topic, partition in slots], _SLOTS_DDL
        )
        partitions = 1 if narrow else max(1, len(slots))
        sources = self._inputs()
        read = slot_rows.coalesce(partitions).mapInArrow(
            _read_step_ranges(self.kafka, predecoder(sources)), read_schema(sources)
        )
        inputs, decoded = self._decoded(read)
        with building(BuildContext(self.spark, layout, self.token, narrow)) as ctx:
            out = self.pipeline.build(inputs)
            check_linear(out, f"the output of pipeline {self.pipeline.name!r}")
        columns = tuple(c for c in out.columns if not c.startswith("__"))
        parts = [
            out.select(
                *columns, out[WEIGHT].cast("long").alias(OUTPUT_WEIGHT), F.lit(_OUTPUT).alias(_PART)
            )
        ]
        parts += [_side_part(decoded.dead(index), _DEAD) for index in range(len(inputs))]
        parts.append(_side_part(decoded.frame.where("__summary"), _SUMMARY))
        union = parts[0]
        for part in parts[1:]:
            union = union.unionByName(part, allowMissingColumns=True)
        return _StepPlan(
            key=(narrow, twin),
            layout=layout,
            slots=slots,
            columns=columns,
            specs=ctx.specs,
            read=decoded.frame._jdf.queryExecution().analyzed(),
            query=union._jdf.queryExecution().analyzed(),
        )

    def _collected(
        self, division: Division, columns: tuple[str, ...], table: pa.Table
    ) -> StepOutput:
        """The step's output from its one collected table."""
        kind = table.column(_PART)
        found = read_summaries(_side_rows(table, _SUMMARY))
        division = self._final(division, found)
        letters = dead_letters_from_arrow(_side_rows(table, _DEAD))
        output = table.filter(pc.equal(kind, _OUTPUT)).select([*columns, OUTPUT_WEIGHT])
        summaries = self._logged(division, found)
        stamps = [s.max_timestamp for s in found if s.max_timestamp is not None]
        return StepOutput(
            division=division,
            output=output,
            dead_letters=sorted(letters),
            summaries=summaries,
            max_input_ts=max(stamps) if stamps else None,
        )

    def _final(self, division: Division, found: list[ReadSummary]) -> Division:
        """The final division: ``division`` cut where each range's read stopped."""
        ends = {s.range.key: s.range.end for s in found}
        missing = [r for r in division.ranges if not r.is_empty and r.key not in ends]
        if missing:
            raise StageFailedError(
                f"step {division.step}: no read summary for {missing[0].topic}"
                f"[{missing[0].partition}] {missing[0].span}"
            )
        return division.cut(ends)

    @staticmethod
    def _logged(division: Division, found: list[ReadSummary]) -> tuple[RangeSummary, ...]:
        """Every range's logged summary, in division order."""
        by_key = {s.range.key: s for s in found}
        return tuple(
            RangeSummary(r.topic, r.partition, r.start, r.end, *_count_hash(by_key.get(r.key)))
            for r in division.ranges
        )


#: The SQL settings of a step's queries, set for their run only (:func:`session_conf`):
#:
#: - adaptive execution off: a step's plan is row-wise but for the stateful stages' exchanges,
#:   whose partitioning is fixed (one partition per worker), so it has nothing to improve there,
#:   and it would run every exchange as a job of its own;
#: - the persisted read uncompressed: it lives for one step, and choosing an encoding for every
#:   column of every cached batch was a seventh of the Spark JVM's CPU samples of a 200k-record
#:   step (Java Flight Recorder); the read of one step fits in memory either way;
#: - Arrow batches to Python bounded by their record count only: a byte bound makes Spark
#:   measure the batch after every row it adds, walking every column vector, which was a
#:   twentieth of the JVM's samples (the rows to the stateful stages travel as one struct
#:   column). ``Int.MaxValue`` is Spark's "no bound", the one value for which it skips the
#:   measuring; ``spark.sql.execution.arrow.maxRecordsPerBatch`` (10,000) still bounds a batch.
STEP_SQL_CONF = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    "spark.sql.execution.arrow.maxBytesPerBatch": str(2**31 - 1),
}


@contextlib.contextmanager
def session_conf(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Set the SQL ``settings`` on ``spark`` for the block, then put back what was there: the
    former value, or none (unset) where the key had no value of its own. Restored on error too.

    The session's settings are shared by its threads: the runtime runs one step at a time, and
    nothing else queries its session meanwhile.
    """
    former: dict[str, str | None] = {key: spark.conf.get(key, None) for key in settings}
    try:
        for key, value in settings.items():
            spark.conf.set(key, value)
        yield
    finally:
        for key, was in former.items():
            if was is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, was)


# The kinds of rows in a step's one collected table (its __part column), and the column that
# carries a side row (a dead letter, a read summary) as JSON.
_PART = "__part"
_OUTPUT, _DEAD, _SUMMARY = 0, 1, 2
_SIDE = "__side"
#: The fields of each kind of side row, as the driver reads them back: a dead letter's are the
#: record's columns it keeps and its reason; a read summary's those a summary row fills.
_SIDE_SCHEMAS = {
    _DEAD: pa.schema(
        [
            *(RECORD_SCHEMA.field(name) for name in DEAD_LETTER_COLUMNS[:-1]),
            pa.field(DEAD_LETTER_COLUMNS[-1], pa.string()),
        ]
    ),
    _SUMMARY: SUMMARY_SCHEMA,
}


def _side_part(frame: DataFrame, kind: int) -> DataFrame:
    """``frame``'s rows as side rows of ``kind``: its fields of that kind as one JSON text."""
    from pyspark.sql import functions as F

    fields = F.struct(*_SIDE_SCHEMAS[kind].names)
    return frame.select(F.to_json(fields).alias(_SIDE), F.lit(kind).alias(_PART))


def _side_rows(table: pa.Table, kind: int) -> pa.Table:
    """The side rows of ``kind`` in a collected step, decoded (a null field is absent from
    ``to_json``'s text and null here; binary fields come back from base64)."""
    schema = _SIDE_SCHEMAS[kind]
    texts = table.filter(pc.equal(table.column(_PART), kind)).column(_SIDE).to_pylist()
    binary = [f.name for f in schema if pa.types.is_binary(f.type)]
    rows = []
    for text in texts:
        row = json.loads(text)
        for name in binary:
            if row.get(name) is not None:
                row[name] = base64.b64decode(row[name])
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema)


_SLOTS_DDL = "topic string, partition int, plan int"


def _read_step_ranges(
    kafka: KafkaConfig, predecode: Predecoder
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: slot rows (:data:`_SLOTS_DDL`) in, the step's read of each
    slot out (:func:`~sparkstep.io.ranges.map_read`'s rows, with ``predecode``'s columns). The
    slot's range and the byte budget are the step's (:data:`STEP_PROPERTY`'s ``read``); an
    empty range is not read, and a slot the step has no range for fails the task."""
    read = map_read(kafka)

    def step_ranges(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        parameters: dict[str, Any] = step_parameters()["read"]
        ranges = {(t, p): (start, end) for t, p, start, end in parameters["ranges"]}

        def rows() -> Iterator[pa.RecordBatch]:
            for batch in batches:
                for slot in batch.to_pylist():
                    key = (slot["topic"], slot["partition"])
                    if key not in ranges:
                        raise StageFailedError(f"the step has no range for {key[0]}[{key[1]}]")
                    start, end = ranges[key]
                    if end > start:
                        budget = parameters["max_bytes"]
                        row = {**slot, "start": start, "end": end, "max_bytes": budget}
                        yield pa.RecordBatch.from_pylist([row])

        for batch in read(rows()):
            yield predecode(batch)

    return step_ranges


def _count_hash(read: ReadSummary | None) -> tuple[int, str]:
    """A range's logged count and hash (an empty range is not read)."""
    return (0, range_hash([])) if read is None else (read.count, read.hash)


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$", re.MULTILINE)


def _cause(exc: BaseException) -> str:
    """The innermost ``SomeError: message`` line of a (JVM-wrapped) Python traceback."""
    text = str(exc)
    found = [m for m in _ERROR_LINE.finditer(text) if "py4j" not in m.group(0)]
    if found:
        sparkstep = [m for m in found if m.group(0).startswith("sparkstep.")]
        match = (sparkstep or found)[-1]
        return f"{match.group(1)}: {match.group(2).strip()[:500]}"
    return text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
