"""User code that is not linear over Z-sets is refused, naming the sparkstep operator to use."""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sparkstep.runtime.errors import NonLinearPlanError
from sparkstep.runtime.plan_check import boundary_alias, check_linear


@pytest.fixture
def source(spark: SparkSession) -> DataFrame:
    df = spark.createDataFrame(
        [("a", 1, 1), ("b", 2, 1), ("a", 3, -1)], "key string, value long, __weight long"
    )
    return df.alias(boundary_alias("source_test"))


def test_row_wise_code_passes(source: DataFrame) -> None:
    out = (
        source.filter(F.col("value") > 0)
        .withColumn("doubled", F.col("value") * 2)
        .select("key", "doubled", "__weight", F.explode(F.array(F.lit(1), F.lit(2))).alias("n"))
    )
    check_linear(out.unionByName(out), "the test")


@pytest.mark.parametrize(
    ("build", "node", "instead"),
    [
        (lambda df: df.groupBy("key").agg(F.sum("value")), "Aggregate", "sparkstep.aggregate"),
        (lambda df: df.join(df, "key"), "Join", "sparkstep.join"),
        (lambda df: df.distinct(), "Deduplicate", "sparkstep.distinct"),
        (lambda df: df.dropDuplicates(["key"]), "Deduplicate", "sparkstep.distinct"),
        (lambda df: df.limit(1), "Limit", "a filter"),
        (lambda df: df.sample(0.5, seed=1), "Sample", "a deterministic filter"),
    ],
)
def test_non_linear_nodes_are_refused_with_the_operator_to_use(
    source: DataFrame, build, node: str, instead: str
) -> None:
    df = build(source)
    if "__weight" not in df.columns:
        df = df.withColumn("__weight", F.lit(1))
    with pytest.raises(NonLinearPlanError, match=rf"^the test: \w*{node} .*use {instead}"):
        check_linear(df, "the test")


def test_window_is_refused(source: DataFrame) -> None:
    from pyspark.sql.window import Window

    df = source.withColumn("rank", F.row_number().over(Window.partitionBy("key").orderBy("value")))
    with pytest.raises(NonLinearPlanError, match=r"Window .*sparkstep\.stateful_map"):
        check_linear(df, "the test")


@pytest.mark.parametrize("make", [F.rand, F.uuid, F.current_timestamp])
def test_non_deterministic_expressions_are_refused(source: DataFrame, make) -> None:
    with pytest.raises(NonLinearPlanError, match="not deterministic"):
        check_linear(source.withColumn("x", make()), "the test")


def test_dropping_the_weight_is_refused(source: DataFrame) -> None:
    with pytest.raises(NonLinearPlanError, match="__weight was dropped"):
        check_linear(source.select("key", "value"), "the test")


def test_nothing_below_a_boundary_is_checked(source: DataFrame) -> None:
    # An aggregation sparkstep produced (below a boundary) is not the user's to answer for.
    produced = (
        source.groupBy("key")
        .agg(F.sum("value").alias("value"), F.lit(1).alias("__weight"))
        .alias(boundary_alias("op_sums"))
    )
    check_linear(produced.filter(F.col("value") > 0), "the test")
    with pytest.raises(NonLinearPlanError, match="Aggregate"):
        check_linear(produced.groupBy("__weight").count().withColumn("__weight", F.lit(1)), "x")
