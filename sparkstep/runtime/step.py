"""One step on Spark: read the division's ranges, decode, run the user's code, collect.

:meth:`StepRunner.run` takes a division and a way to make the step's
:class:`~sparkstep.runtime.dataflow.StageTarget`, and returns what the writer needs, as Arrow on
the driver:

1. The ranges become a DataFrame with one partition per non-empty range; one ``mapInArrow``
   on the executors (:func:`sparkstep.io.ranges.map_read`) reads each range once, exactly
   ``[start, end)`` read_committed, or for a tentative division up to the range's share of the
   step's byte budget, and emits its records followed by one summary row (where the read
   stopped, count, hash, largest timestamp). The result is persisted for the step and released
   after it, so the Kafka read is not repeated by the uses below; a lost block or a retried
   task re-reads the same records (and cuts at the same offset).
2. The summaries are collected: counts and hashes travel as data, never in accumulators (a
   re-run task would add to an accumulator twice). They give the final division
   (:meth:`~sparkstep.io.division.Division.cut`), which is the step's from here on: the
   workers' target is made for it, and it is what the step log records.
3. Each input's records are decoded (:mod:`sparkstep.runtime.decode`); the dead-letter rows of
   all inputs are collected.
4. The pipeline's transform is built over the decoded inputs with the step's target, so its
   sparkstep operators call the workers, and the output is collected with ``toArrow()``.

The output table has the user's columns and ``weight`` (the writer's weight column); other
``__`` columns are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
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
        the workers' target for the final division (called once, before any worker is).

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
        # Step 1. Read every non-empty range once, on the executors; kept for this step only.
        read = self._read(division)
        try:
            # Step 2. The summaries, as data; the final division.
            division, summaries, max_input_ts = self._summaries(division, read)
            return self._process(division, layout, target(division), read, summaries, max_input_ts)
        finally:
            read.unpersist()

    def _process(
        self,
        division: Division,
        layout: Layout,
        target: StageTarget,
        read: DataFrame,
        summaries: tuple[RangeSummary, ...],
        max_input_ts: int | None,
    ) -> StepOutput:
        # Step 3. Decode each input; collect the dead letters.
        inputs: dict[str, DataFrame] = {}
        dead: list[DataFrame] = []
        records = read.where("not __summary").select(*RECORD_SCHEMA.names)
        for name, topic in self.topics.items():
            good, bad = decode_json(
                records.where(records.topic == topic), self.pipeline.schema(name)
            )
            inputs[name] = good.alias(boundary_alias(f"source_{name}"))
            dead.append(bad)
        letters: list[DeadLetter] = []
        for frame in dead:
            letters.extend(dead_letters_from_arrow(frame.select(*DEAD_LETTER_COLUMNS).toArrow()))
        # Step 4. The user's code with the workers behind its operators; collect the output.
        with building(BuildContext(self.spark, layout, target)):
            out = self.pipeline.build(inputs)
            check_linear(out, f"the output of pipeline {self.pipeline.name!r}")
        columns = [c for c in out.columns if not c.startswith("__")]
        table = out.select(*columns, out[WEIGHT].cast("long").alias(OUTPUT_WEIGHT)).toArrow()
        return StepOutput(
            division=division,
            output=table,
            dead_letters=sorted(letters),
            summaries=summaries,
            max_input_ts=max_input_ts,
        )

    def _read(self, division: Division) -> DataFrame:
        budget = division.range_byte_budget()
        rows = [(r.topic, r.partition, r.start, r.end, budget) for r in division.ranges]
        rows = [row for row, r in zip(rows, division.ranges, strict=True) if not r.is_empty]
        if rows:
            rdd = self.spark.sparkContext.parallelize(rows, len(rows))
            frame = self.spark.createDataFrame(rdd, RANGES_DDL)
        else:
            frame = self.spark.createDataFrame([], RANGES_DDL)
        # Persisted, not checkpointed: a lost block is recomputed by reading the same range
        # again, which gives the same records. Materialised now, so the uses below share one
        # read.
        read = frame.mapInArrow(map_read(self.kafka), READ_DDL).persist(
            StorageLevel.MEMORY_AND_DISK
        )
        read.count()
        return read

    def _summaries(
        self, division: Division, read: DataFrame
    ) -> tuple[Division, tuple[RangeSummary, ...], int | None]:
        """The final division, every range's logged summary in division order, and the largest
        input timestamp."""
        found = {s.range.key: s for s in read_summaries(read.where("__summary").toArrow())}
        missing = [r for r in division.ranges if not r.is_empty and r.key not in found]
        if missing:
            raise StageFailedError(
                f"step {division.step}: no read summary for {missing[0].topic}"
                f"[{missing[0].partition}] {missing[0].span}"
            )
        final = division.cut({key: s.range.end for key, s in found.items()})
        summaries = tuple(
            RangeSummary(r.topic, r.partition, r.start, r.end, *_count_hash(found.get(r.key)))
            for r in final.ranges
        )
        stamps = [s.max_timestamp for s in found.values() if s.max_timestamp is not None]
        return final, summaries, max(stamps) if stamps else None


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
