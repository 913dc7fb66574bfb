"""A step's plan is built once and run for many steps (``sparkstep.runtime.step``).

Real broker, real SparkSession. The pipeline here has no stateful operator (so no state
workers): what is under test is the read, the reuse of the plan and the parameters that reach
the tasks through the step's local property.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sparkstep import Pipeline
from sparkstep.examples import keyed_sum
from sparkstep.ids import Step
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import Division, PartitionRange, StepTime
from sparkstep.runtime.dataflow import STEP_PROPERTY, StageTarget
from sparkstep.runtime.layout import initial_layout
from sparkstep.runtime.pipeline import resolve_topics
from sparkstep.runtime.step import STEP_SQL_CONF, StepRunner, _fresh, session_conf
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import produce_keyed

passthrough = Pipeline(
    name="passthrough",
    inputs=keyed_sum.pipeline.inputs,
    transform=lambda events: events,
    output_key=["key"],
)
# A plan with an exchange: planned every step, never rerun.
shuffled = Pipeline(
    name="shuffled",
    inputs=keyed_sum.pipeline.inputs,
    transform=lambda events: events.repartition(2, "key"),
    output_key=["key"],
)


class CountingRunner(StepRunner):
    """A StepRunner that counts how often it builds its plan (and builds it as usual)."""

    builds = 0

    def _build(self, *args: Any, **kwargs: Any) -> Any:
        self.builds += 1
        return super()._build(*args, **kwargs)


def _target(division: Division) -> StageTarget:
    return StageTarget(
        routes=(), step=division.step, division_digest="-", step_time_ms=0, layout_epoch=0
    )


def _division(step: int, topic: str, spans: dict[int, tuple[int, int]]) -> Division:
    ranges = tuple(
        PartitionRange(topic, p, start, end) for p, (start, end) in sorted(spans.items())
    )
    return Division(Step(step), ranges, StepTime(None, 0))


def _values(output: pa.Table) -> list[tuple[str, int]]:
    keys, values = output.column("key").to_pylist(), output.column("value").to_pylist()
    return sorted(zip(keys, values, strict=True))


@pytest.fixture
def runner(spark: SparkSession, bootstrap_servers: str) -> CountingRunner:
    topics = resolve_topics(passthrough, [])
    return CountingRunner(spark, passthrough, topics, KafkaConfig(bootstrap_servers), "t")


def test_one_plan_serves_every_step_with_its_own_ranges(
    runner: CountingRunner, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("plan-in", partitions=2)
    # One partition at a time, so that the offsets of each record are known.
    sent: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    producer = Producer({"bootstrap.servers": bootstrap_servers, "acks": "all"})
    for i in range(12):
        doc = {"key": f"k{i}", "value": i}
        producer.produce(topic, value=json.dumps(doc).encode(), partition=i % 2)
        sent[i % 2].append(doc)
    assert producer.flush(30) == 0
    runner.topics = {"events": topic}
    layout = initial_layout(passthrough.shards, 1)

    def expected(spans: dict[int, tuple[int, int]]) -> list[tuple[str, int]]:
        rows = [d for p, (a, b) in spans.items() for d in sent[p][a:b]]
        return sorted((d["key"], d["value"]) for d in rows)

    steps = [{0: (0, 2), 1: (0, 3)}, {0: (2, 2), 1: (3, 4)}, {0: (2, 6), 1: (4, 6)}]
    for step, spans in enumerate(steps):
        out = runner.run(_division(step, topic, spans), layout, _target)
        assert _values(out.output) == expected(spans), step
        assert [(s.start, s.end, s.count) for s in out.summaries] == [
            (a, b, b - a) for a, b in spans.values()
        ]
    assert runner.builds == 1

    # Another layout is another plan; so is another set of slots (only partition 1 here).
    runner.run(
        _division(3, topic, {0: (6, 6), 1: (6, 6)}), initial_layout(passthrough.shards, 2), _target
    )
    assert runner.builds == 2
    out = runner.run(
        _division(4, topic, {1: (5, 6)}), initial_layout(passthrough.shards, 2), _target
    )
    assert _values(out.output) == expected({1: (5, 6)})
    assert runner.builds == 3

    # A step above narrow_offsets runs the wide plan; both are kept.
    runner.narrow_offsets = 0
    out = runner.run(
        _division(5, topic, {1: (4, 6)}), initial_layout(passthrough.shards, 2), _target
    )
    assert _values(out.output) == expected({1: (4, 6)})
    runner.narrow_offsets = 10
    runner.run(_division(6, topic, {1: (6, 6)}), initial_layout(passthrough.shards, 2), _target)
    assert runner.builds == 4


def test_the_read_is_cached_for_its_step_only_and_a_plan_needs_its_step(
    runner: CountingRunner, spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    topic = topic_factory("plan-cached", partitions=1)
    produce_keyed(bootstrap_servers, topic, 3, keys=3, seed=1)
    runner.topics = {"events": topic}
    layout = initial_layout(passthrough.shards, 1)
    runner.run(_division(0, topic, {0: (0, 1)}), layout, _target)
    plan = runner._plans[True, 0]  # a one-record step is narrow

    # Outside a step its tasks find no parameters, and say so.
    with pytest.raises(Exception, match=STEP_PROPERTY):
        _fresh(spark, plan.query).toArrow()

    # The step's query reads the persisted read: Kafka is read once for records and summaries.
    stale = plan.fresh_read(spark)
    executed = _fresh(spark, plan.query)._jdf.queryExecution().executedPlan().toString()
    assert executed.count("InMemoryTableScan") >= 2, executed
    # A read some step left cached (same plan) would stand in for the next step's read when
    # the plan plans a Dataset (its first step, or the step after a failed rerun): it is
    # dropped, and the step reads its own range.
    plan.rerun = None
    out = runner.run(_division(1, topic, {0: (1, 3)}), layout, _target)
    assert out.output.num_rows == 2
    assert [(s.start, s.end, s.count) for s in out.summaries] == [(1, 3, 2)]
    assert stale.storageLevel == _fresh(spark, plan.read).storageLevel  # neither cached now
    assert not stale.storageLevel.useMemory and not stale.storageLevel.useDisk


def _cached_rdds(spark: SparkSession) -> list[int]:
    """The ids of the RDDs that hold cached blocks now."""
    infos = spark.sparkContext._jsc.sc().getRDDStorageInfo()
    return [info.id() for info in infos if info.numCachedPartitions() > 0]


def test_a_narrow_plan_is_rerun_each_step_with_its_read_cached_for_the_step_only(
    runner: CountingRunner, spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    topic = topic_factory("plan-rerun", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 6, keys=6, seed=2)  # offsets 0..5
    runner.topics = {"events": topic}
    layout = initial_layout(passthrough.shards, 1)
    runner.run(_division(0, topic, {0: (0, 2)}), layout, _target)
    plan = runner._plans[True, 0]
    rerun = plan.rerun
    assert rerun is not None, "the narrow plan of a passthrough pipeline was not kept to rerun"
    for step, (a, b) in enumerate([(2, 3), (3, 6), (0, 1)], start=1):
        out = runner.run(_division(step, topic, {0: (a, b)}), layout, _target)
        assert plan.rerun is rerun  # run again, not planned again
        assert _values(out.output) == sorted((d["key"], d["value"]) for d in sent[a:b])
        assert [(s.start, s.end, s.count) for s in out.summaries] == [(a, b, b - a)]
        # The RDD of the read's cached batches holds blocks during a step only.
        assert not rerun.buffers.getStorageLevel().useMemory()
        assert rerun.buffers.id() not in _cached_rdds(spark)
    assert runner.builds == 1


def test_the_plan_built_to_describe_the_pipeline_runs_the_first_wide_step(
    spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    """Recovery takes the operator specs from building the wide plan over every input
    partition (``describe``); the first wide step over those partitions runs that plan, it
    builds none of its own."""
    topic = topic_factory("plan-described", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 10, keys=10, seed=6)
    config = KafkaConfig(bootstrap_servers)
    runner = CountingRunner(spark, passthrough, {"events": topic}, config, "t", narrow_offsets=0)
    layout = initial_layout(passthrough.shards, 1)
    assert runner.describe(layout, [(topic, 0), (topic, 1)]) == {}
    described = runner._plans[False, 0]
    assert runner.builds == 1
    ends = {p: high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    out = runner.run(_division(0, topic, {p: (0, end) for p, end in ends.items()}), layout, _target)
    assert _values(out.output) == sorted((d["key"], d["value"]) for d in sent)
    assert runner._plans[False, 0] is described and runner.builds == 1
    runner.close()


def test_a_plan_with_an_exchange_is_planned_every_step(
    spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    """A rerun would reuse an exchange's output (see the next test): such a plan is not kept."""
    topic = topic_factory("plan-exchange", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 5, keys=5, seed=4)
    runner = CountingRunner(spark, shuffled, {"events": topic}, KafkaConfig(bootstrap_servers), "t")
    layout = initial_layout(shuffled.shards, 1)
    for step, (a, b) in enumerate([(0, 2), (2, 5)]):
        out = runner.run(_division(step, topic, {0: (a, b)}), layout, _target)
        assert _values(out.output) == sorted((d["key"], d["value"]) for d in sent[a:b])
        assert [(s.start, s.end, s.count) for s in out.summaries] == [(a, b, b - a)]
        assert runner._plans[True, 0].rerun is None
    assert runner.builds == 2  # and its twin, to plan steps ahead (the next test)
    runner.close()


def test_a_plan_planned_every_step_plans_the_next_step_on_its_twin_while_a_step_runs(
    spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    topic = topic_factory("plan-ahead", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 12, keys=12, seed=5)
    runner = CountingRunner(spark, shuffled, {"events": topic}, KafkaConfig(bootstrap_servers), "t")
    layout = initial_layout(shuffled.shards, 1)
    spans = [(0, 2), (2, 5), (5, 5), (5, 9), (9, 12), (0, 12)]
    for step, (a, b) in enumerate(spans):
        out = runner.run(_division(step, topic, {0: (a, b)}), layout, _target)
        assert _values(out.output) == sorted((d["key"], d["value"]) for d in sent[a:b]), step
        assert [(s.start, s.end, s.count) for s in out.summaries] == [(a, b, b - a)]
        # The twins alternate: step 0 planned its own, each step planned the next one's.
        ran, next_ = runner._plans[True, step % 2], runner._plans[True, (step + 1) % 2]
        assert ran.prepared is None
        assert next_.prepared is not None, f"step {step + 1} was not planned ahead"
        # Planned under the step's SQL settings (adaptive execution off), not the session's.
        executed = next_.prepared[1]._jdf.queryExecution().executedPlan().toString()
        assert "AdaptiveSparkPlan" not in executed, executed
    assert runner.builds == 2
    # The twins' reads are never the same plan to Spark's cache.
    twins = [runner._plans[True, twin].read for twin in (0, 1)]
    assert not twins[0].sameResult(twins[1])
    ahead = runner._plans[True, len(spans) % 2].prepared
    assert ahead is not None
    runner.close()
    assert runner._plans[True, len(spans) % 2].prepared is None
    assert not ahead[0].storageLevel.useMemory and not ahead[0].storageLevel.useDisk


def test_running_the_same_dataset_again_would_skip_its_shuffle(spark: SparkSession) -> None:
    """Why each step makes a new Dataset: Spark reuses a Dataset's physical plan, shuffle
    outputs included, so a source that changes between runs is not read again past a
    shuffle. If this test fails, Spark changed and ``step.py``'s docstring is out of date."""

    def numbers(batches: Any) -> Any:
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        n = int(str(context.getLocalProperty("test.n")))
        for _ in batches:
            yield pa.record_batch({"v": pa.array(range(n), pa.int64())})

    source = spark.createDataFrame([(0,)], "slot int").mapInArrow(numbers, "v long")
    query: DataFrame = source.repartition(2).agg(F.count("*").alias("n"))
    sc = spark.sparkContext
    try:
        sc.setLocalProperty("test.n", "3")
        assert query.toArrow().column("n").to_pylist() == [3]
        sc.setLocalProperty("test.n", "5")
        assert query.toArrow().column("n").to_pylist() == [3]  # the shuffle output of run 1
        logical = query._jdf.queryExecution().logical()
        assert _fresh(spark, logical).toArrow().column("n").to_pylist() == [5]
    finally:
        sc.setLocalProperty("test.n", None)  # type: ignore[arg-type]


def test_session_conf_holds_for_the_block_and_puts_back_what_was_there(
    spark: SparkSession,
) -> None:
    adaptive = "spark.sql.adaptive.enabled"
    compressed = "spark.sql.inMemoryColumnarStorage.compressed"
    assert {adaptive, compressed} <= set(STEP_SQL_CONF)
    session_had = {key: spark.conf.get(key, None) for key in (adaptive, compressed)}
    try:
        spark.conf.set(adaptive, "true")  # a value of the session's own
        spark.conf.unset(compressed)  # no value of its own
        with session_conf(spark, STEP_SQL_CONF):
            assert {key: spark.conf.get(key) for key in STEP_SQL_CONF} == STEP_SQL_CONF
        assert spark.conf.get(adaptive) == "true"
        assert spark.conf.get(compressed, None) is None  # unset again, not pinned to a value
        with pytest.raises(RuntimeError, match="boom"), session_conf(spark, {adaptive: "false"}):
            raise RuntimeError("boom")
        assert spark.conf.get(adaptive) == "true"
    finally:
        for key, value in session_had.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def test_a_step_leaves_the_sessions_settings_as_it_found_them(
    runner: CountingRunner, spark: SparkSession, topic_factory, bootstrap_servers: str
) -> None:
    topic = topic_factory("plan-conf", partitions=1)
    produce_keyed(bootstrap_servers, topic, 2, keys=2, seed=3)
    runner.topics = {"events": topic}
    before = {key: spark.conf.get(key, None) for key in STEP_SQL_CONF}
    out = runner.run(
        _division(0, topic, {0: (0, 2)}), initial_layout(passthrough.shards, 1), _target
    )
    assert out.output.num_rows == 2
    assert {key: spark.conf.get(key, None) for key in STEP_SQL_CONF} == before


def test_a_plan_whose_spark_classes_cannot_be_read_is_planned_every_step(
    runner: CountingRunner, topic_factory, bootstrap_servers: str, monkeypatch, caplog
) -> None:
    """Should another Spark version lack an internal class the rerun reads, small steps are
    planned every step: slower, never wrong, never failed."""
    from py4j.protocol import Py4JError

    from sparkstep.runtime import step as step_module

    def unreadable(cls: type, query: DataFrame) -> None:
        raise Py4JError("no such method")  # the fault: Spark's internals changed

    monkeypatch.setattr(step_module._Rerun, "_of", classmethod(unreadable))
    topic = topic_factory("plan-unreadable", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 3, keys=3, seed=5)
    runner.topics = {"events": topic}
    layout = initial_layout(passthrough.shards, 1)
    for step, (a, b) in enumerate([(0, 1), (1, 3)]):
        out = runner.run(_division(step, topic, {0: (a, b)}), layout, _target)
        assert _values(out.output) == sorted((d["key"], d["value"]) for d in sent[a:b])
        assert runner._plans[True, step % 2].rerun is None
    assert "their plan could not be read" in caplog.text
    runner.close()
