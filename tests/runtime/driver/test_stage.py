"""How a step runs on Spark: its jobs; a wide step's stateful stage is one task per worker, a
small (narrow) step is one stage in one task."""

from __future__ import annotations

import json

from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType

from sparkstep import Pipeline, aggregate
from sparkstep.runtime.driver import Runtime
from sparkstep.runtime.layout import shard_column
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import (
    Harness,
    HarnessFactory,
    integrate,
    keyed_sum_oracle,
    produce_keyed,
)

WORKERS = 3


def _partition_id() -> int:
    context = TaskContext.get()
    assert context is not None
    return context.partitionId()


def _sums_with_task(events: DataFrame) -> DataFrame:
    sums = aggregate(events, name="sums", key=["key"], aggs={"sum": "sum(value)"})
    # Evaluated in the task that ran the stateful stage (no exchange between them), and
    # deterministic for a given plan, so a replayed step gives the same rows.
    task = F.udf(_partition_id, IntegerType())
    return sums.withColumn("task", task())


PIPELINE = Pipeline(
    name="sums_with_task",
    inputs={"events": "key string, value long"},
    transform=_sums_with_task,
    output_key=["key"],
)


def _jobs(spark: SparkSession, runtime: Runtime, step: int) -> int:
    tracker = spark.sparkContext.statusTracker()
    return len(tracker.getJobIdsForGroup(runtime.runner.job_group(step)))


def _stages(spark: SparkSession, runtime: Runtime, step: int) -> list[int]:
    """The number of stages of each job of ``step``."""
    tracker = spark.sparkContext.statusTracker()
    jobs = [
        tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(runtime.runner.job_group(step))
    ]
    return [len(job.stageIds) for job in jobs if job is not None]


def _run_through(harness: Harness, bootstrap_servers: str, topic: str) -> Runtime:
    """Build and start the harness's runtime, run it until both partitions of ``topic`` are
    consumed, stop it; the runtime, which took at least two steps."""
    runtime = harness.build()
    harness.start()
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    harness.stop()
    assert runtime.next_step >= 2
    return runtime


def test_a_step_is_one_job_and_each_worker_runs_in_its_own_task(
    spark: SparkSession, harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    produce_keyed(bootstrap_servers, topic, 120, keys=30, seed=4)
    harness = harness_factory(PIPELINE, {"events": topic}, workers=WORKERS)
    harness.narrow_step_offsets = 0  # every step wide, however small; the replay too
    runtime = _run_through(harness, bootstrap_servers, topic)
    steps = range(runtime.next_step)
    # A new step's division is tentative; the step is still one job (the read summaries that
    # make it final are collected with the output).
    assert [_jobs(spark, runtime, s) for s in steps] == [1] * len(steps)
    assert all(_stages(spark, runtime, s) == [2] for s in steps)  # the read; the stateful stage

    # Worker w's rows are applied in partition (task) w of the stateful stage.
    assert runtime.manifest is not None
    owners = runtime.manifest.layout.owners
    rows = [json.loads(r.value or b"{}") for r in harness.output()]
    keys = sorted({row["key"] for row in rows})
    shards: dict[str, int] = dict(
        spark.createDataFrame([(k,) for k in keys], "key string")
        .select("key", shard_column(["key"], PIPELINE.shards).alias("shard"))
        .collect()
    )
    assert {row["task"] for row in rows} == set(range(WORKERS))
    assert all(row["task"] == owners[shards[row["key"]]] for row in rows)

    # A replayed step's division is final: the whole step is one job.
    replayed = harness.build()
    assert replayed.next_step == runtime.next_step
    assert [_jobs(spark, replayed, s) for s in steps] == [1] * len(steps)


def test_a_small_step_is_one_stage_and_one_task_calls_every_worker(
    spark: SparkSession, harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers-narrow", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 120, keys=30, seed=5)
    harness = harness_factory(PIPELINE, {"events": topic}, workers=WORKERS)
    assert harness.narrow_step_offsets >= harness.max_records_per_step  # every step narrow
    runtime = _run_through(harness, bootstrap_servers, topic)
    steps = range(runtime.next_step)
    assert all(_stages(spark, runtime, s) == [1] for s in steps)

    # One task (partition 0) applied every worker's rows, and each worker got its own keys:
    # the output integrates to the true sums, as a wide step's would.
    rows = [json.loads(r.value or b"{}") for r in harness.output()]
    assert {row["task"] for row in rows} == {0}
    totals = {key: total for key, (total, _) in keyed_sum_oracle(sent).items()}
    live = integrate(harness.output())
    assert all(weight == 1 for weight in live.values())
    assert {dict(row)["key"]: dict(row)["sum"] for row in live} == totals
