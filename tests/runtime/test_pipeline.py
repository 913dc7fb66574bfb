"""Pipeline definitions: loading, topics, and refusal of non-linear user code when described."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sparkstep import Pipeline, aggregate
from sparkstep.examples import keyed_sum, orders
from sparkstep.io.config import KafkaConfig
from sparkstep.runtime.errors import NonLinearPlanError, PipelineDefinitionError
from sparkstep.runtime.layout import initial_layout
from sparkstep.runtime.pipeline import load_pipeline, resolve_topics
from sparkstep.runtime.step import StepRunner


def _runner(spark: SparkSession, pipeline: Pipeline) -> StepRunner:
    topics = resolve_topics(pipeline, [])
    return StepRunner(spark, pipeline, topics, KafkaConfig("127.0.0.1:1"), token="unused")


def test_load_and_describe_the_example(spark: SparkSession) -> None:
    pipeline = load_pipeline("sparkstep.examples.keyed_sum:pipeline")
    assert pipeline is keyed_sum.pipeline
    specs = _runner(spark, pipeline).describe(initial_layout(pipeline.shards, 2))
    assert list(specs) == ["sums"]
    assert [a.output for a in specs["sums"].aggs] == ["sum", "count"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("sparkstep.examples.keyed_sum", "must be MODULE:ATTR"),
        ("no_such_module_xyz:pipeline", "cannot import the pipeline module"),
        ("sparkstep.examples.keyed_sum:transform", "not a sparkstep Pipeline"),
    ],
)
def test_bad_pipeline_targets_are_clear(target: str, message: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=message):
        load_pipeline(target)


def test_a_pipeline_module_that_raises_on_import_is_a_definition_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raises_on_import_xyz.py").write_text("raise RuntimeError('no config here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PipelineDefinitionError, match="RuntimeError: no config here"):
        load_pipeline("raises_on_import_xyz:pipeline")


def test_topics_default_to_input_names_and_can_be_overridden() -> None:
    assert resolve_topics(keyed_sum.pipeline, []) == {"events": "events"}
    assert resolve_topics(keyed_sum.pipeline, ["numbers"]) == {"events": "numbers"}
    assert resolve_topics(orders.pipeline, ["orders=o", "customers=c"]) == {
        "orders": "o",
        "customers": "c",
    }
    with pytest.raises(PipelineDefinitionError, match="write NAME=TOPIC"):
        resolve_topics(orders.pipeline, ["o"])
    with pytest.raises(PipelineDefinitionError, match="no input 'nope'"):
        resolve_topics(orders.pipeline, ["nope=x"])


def test_transform_must_take_the_inputs_by_name() -> None:
    with pytest.raises(PipelineDefinitionError, match="keyword arguments"):
        Pipeline(name="bad", inputs={"events": "k string"}, transform=lambda other: other)


def _per_step_sum(events: DataFrame) -> DataFrame:
    return events.groupBy("key").agg(F.sum("value").alias("sum"), F.lit(1).alias("__weight"))


def _random_sample(events: DataFrame) -> DataFrame:
    picked = events.where(F.rand() < 0.5)
    return aggregate(picked, name="sums", key=["key"], aggs={"n": "count(*)"})


@pytest.mark.parametrize(
    ("transform", "message"),
    [
        (_per_step_sum, r"output of pipeline 'bad': Aggregate .*use sparkstep\.aggregate"),
        (_random_sample, r"input of aggregate 'sums': the expression .*rand.* not deterministic"),
    ],
)
def test_non_linear_user_code_is_refused_when_described(
    spark: SparkSession, transform, message: str
) -> None:
    pipeline = Pipeline(
        name="bad", inputs={"events": "key string, value long"}, transform=transform
    )
    with pytest.raises(NonLinearPlanError, match=message):
        _runner(spark, pipeline).describe(initial_layout(pipeline.shards, 1))
