"""One step on Spark: read the division's ranges, decode, run the user's code, collect.

:meth:`StepRunner.run` takes a division and a way to make the step's
:class:`~sparkstep.runtime.dataflow.StageTarget`, and returns what the writer needs, as Arrow on
the driver. A step is ONE Spark job, whether its division is final (a replay) or tentative (the
planner's). Its jobs are in the job group :meth:`StepRunner.job_group`.

1. The non-empty ranges become a DataFrame parallelized from the driver (no job);
   one ``mapInArrow`` on the executors (:func:`sparkstep.io.ranges.map_read`) reads each range
   once, exactly ``[start, end)`` read_committed, or for a tentative division up to the range's
   share of the step's byte budget, and emits its records followed by one summary row (where
   the read stopped, count, hash, largest timestamp). The result is persisted for the step and
   released after it, so the Kafka read is not repeated by its two uses (the records, the
   summaries); a lost block or a retried task re-reads the same records and cuts at the same
   offset, because the records of a range and their sizes never change.
2. The workers' target is made for the division as given, before the job. For a tentative
   division its digest covers the byte budget: that and the ranges fix which records the read
   takes, so every attempt of the step's stateful stage applies the same rows. A step is run
   once per runtime incarnation, so the workers never see the same step with two targets; after
   a crash the stores reopen at a checkpoint, which holds no marker of an unlogged step.
3. Each input's records are decoded (:mod:`sparkstep.runtime.decode`), and the pipeline's
   transform is built over them with the step's target, so its sparkstep operators call the
   workers.
4. One collected table carries the output, every input's dead-letter rows and the summary rows,
   told apart by a ``__part`` column. Counts and hashes travel as data, never in accumulators
   (a re-run task would add to an accumulator twice). The summaries give the final division
   (:meth:`~sparkstep.io.division.Division.cut`, for a final division a check that every range
   was read whole), which is what the step log records.

The output table has the user's columns and ``weight`` (the writer's weight column); other
``__`` columns are dropped.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel

from sparkstep.errors import SparkstepError
from sparkstep.io.config import KafkaConfig
from sparkstep.io.deadletter import DeadLetter, dead_letters_from_arrow
from sparkstep.io.division import Division
from sparkstep.io.ranges import (
    RANGES_DDL,
    READ_DDL,
    RECORD_SCHEMA,
    RECORDS_DDL,
    ReadSummary,
    map_read,
    range_hash,
    read_summaries,
)
from sparkstep.io.steplog import RangeSummary
from sparkstep.runtime.dataflow import BuildContext, StageTarget, building
from sparkstep.runtime.decode import DEAD_LETTER_COLUMNS, decode_json
from sparkstep.runtime.errors import StageFailedError
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.pipeline import Pipeline
from sparkstep.runtime.plan_check import WEIGHT, boundary_alias, check_linear

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["OUTPUT_WEIGHT", "StepOutput", "StepRunner"]

OUTPUT_WEIGHT = "weight"


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, on the driver; ``division`` is the final division read."""

    division: Division
    output: pa.Table
    dead_letters: list[DeadLetter]
    summaries: tuple[RangeSummary, ...]
    max_input_ts: int | None


class StepRunner:
    """Runs steps of one pipeline on one SparkSession."""

    def __init__(
        self,
        spark: SparkSession,
        pipeline: Pipeline,
        topics: Mapping[str, str],
        kafka: KafkaConfig,
    ) -> None:
        self.spark = spark
        self.pipeline = pipeline
        self.topics = dict(topics)
        self.kafka = kafka
        self._id = uuid.uuid4().hex[:12]

    def job_group(self, step: int) -> str:
        """The Spark job group of this runner's jobs of ``step`` (for
        ``SparkContext.statusTracker().getJobIdsForGroup``)."""
        return f"sparkstep.{self._id}.step.{step}"

    def describe(self, layout: Layout) -> BuildContext:
        """Build the pipeline over empty inputs: its operator specs, without touching workers."""
        ctx = BuildContext(self.spark, layout)
        with building(ctx):
            out = self.pipeline.build(self._empty_inputs())
            check_linear(out, f"the output of pipeline {self.pipeline.name!r}")
        return ctx

    def _empty_inputs(self) -> dict[str, DataFrame]:
        empty = self.spark.createDataFrame([], RECORDS_DDL)
        return {
            name: decode_json(empty, self.pipeline.schema(name))[0].alias(
                boundary_alias(f"source_{name}")
            )
            for name in self.pipeline.inputs
        }

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
        sc = self.spark.sparkContext
        sc.setJobGroup(self.job_group(division.step), f"sparkstep step {division.step}")
        # A step's plan is row-wise but for the stateful stages' exchanges, whose partitioning
        # is fixed (one partition per worker): adaptive execution has nothing to improve there
        # and would run every exchange as a job of its own. Off for the step's queries only.
        adaptive = str(self.spark.conf.get(_ADAPTIVE))
        self.spark.conf.set(_ADAPTIVE, "false")
        try:
            read = self._read(division)
            try:
                return self._process(division, layout, target(division), read)
            finally:
                read.unpersist()
        finally:
            self.spark.conf.set(_ADAPTIVE, adaptive)
            sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
            sc.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]

    def _process(
        self,
        division: Division,
        layout: Layout,
        target: StageTarget,
        read: DataFrame,
    ) -> StepOutput:
        """The step's one job: output rows, dead letters and the read summaries, tagged by
        ``__part`` in one collected table."""
        from pyspark.sql import functions as F

        inputs: dict[str, DataFrame] = {}
        dead: list[DataFrame] = []
        records = read.where("not __summary").select(*RECORD_SCHEMA.names)
        for name, topic in self.topics.items():
            good, bad = decode_json(
                records.where(records.topic == topic), self.pipeline.schema(name)
            )
            inputs[name] = good.alias(boundary_alias(f"source_{name}"))
            dead.append(bad)
        with building(BuildContext(self.spark, layout, target)):
            out = self.pipeline.build(inputs)
            check_linear(out, f"the output of pipeline {self.pipeline.name!r}")
        columns = [c for c in out.columns if not c.startswith("__")]
        parts = [
            out.select(
                *columns, out[WEIGHT].cast("long").alias(OUTPUT_WEIGHT), F.lit(_OUTPUT).alias(_PART)
            )
        ]
        parts += [
            frame.select(
                *[F.col(c).alias(f"__dead_{c}") for c in DEAD_LETTER_COLUMNS],
                F.lit(_DEAD).alias(_PART),
            )
            for frame in dead
        ]
        parts.append(
            read.where("__summary").select(
                *[F.col(c).alias(_read_column(c)) for c in _SUMMARY_COLUMNS],
                F.lit(_SUMMARY).alias(_PART),
            )
        )
        union = parts[0]
        for part in parts[1:]:
            union = union.unionByName(part, allowMissingColumns=True)
        table = union.toArrow()
        kind = table.column(_PART)
        found = read_summaries(
            table.filter(pc.equal(kind, _SUMMARY))
            .select([_read_column(c) for c in _SUMMARY_COLUMNS])
            .rename_columns(list(_SUMMARY_COLUMNS))
        )
        division = self._final(division, found)
        letters = dead_letters_from_arrow(
            table.filter(pc.equal(kind, _DEAD))
            .select([f"__dead_{c}" for c in DEAD_LETTER_COLUMNS])
            .rename_columns(list(DEAD_LETTER_COLUMNS))
        )
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

    def _read(self, division: Division) -> DataFrame:
        """Every non-empty range's records and summary row, persisted for the step: a lost
        block or a retried task reads the same range again, which gives the same records (and
        cuts at the same offset). Nothing runs yet."""
        budget = division.range_byte_budget()
        rows = [
            (r.topic, r.partition, r.start, r.end, budget)
            for r in division.ranges
            if not r.is_empty
        ]
        # Parallelized from the driver (no Spark job) into the default parallelism's partitions,
        # but no more than one per range: an empty partition would still be a task of the read,
        # and two of the step's other stage.
        frame = self.spark.createDataFrame(rows, RANGES_DDL).coalesce(max(1, len(rows)))
        return frame.mapInArrow(map_read(self.kafka), READ_DDL).persist(
            StorageLevel.MEMORY_AND_DISK
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


_ADAPTIVE = "spark.sql.adaptive.enabled"
# The kinds of rows in a step's one collected table (its __part column).
_PART = "__part"
_OUTPUT, _DEAD, _SUMMARY = 0, 1, 2
#: The columns of :data:`~sparkstep.io.ranges.READ_DDL` a summary row fills.
_SUMMARY_COLUMNS = (
    "topic",
    "partition",
    "timestamp",
    "__summary",
    "__start",
    "__end",
    "__count",
    "__hash",
)


def _read_column(name: str) -> str:
    return f"__read_{name.lstrip('_')}"


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
