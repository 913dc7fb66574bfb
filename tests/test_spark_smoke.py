"""The SparkSession is real and runs Python on executors through Arrow, both ways we rely on."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession


def test_map_in_arrow_runs_python_over_arrow_batches(spark: SparkSession) -> None:
    df = spark.range(0, 1000, numPartitions=3)

    def double(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield pa.RecordBatch.from_arrays([pc.multiply(batch.column(0), 2)], names=["id"])

    total = df.mapInArrow(double, "id long").groupBy().sum("id").collect()[0][0]
    assert total == 2 * sum(range(1000))


def test_grouped_apply_in_arrow_sees_each_group_whole(spark: SparkSession) -> None:
    rows = [(f"k{i % 7}", i) for i in range(500)]
    df = spark.createDataFrame(rows, "key string, value long")

    def summarise(table: pa.Table) -> pa.Table:
        keys = pc.unique(table.column("key"))
        assert len(keys) == 1
        return pa.table(
            {"key": keys, "total": [pc.sum(table.column("value")).as_py()], "n": [table.num_rows]}
        )

    out = df.groupBy("key").applyInArrow(summarise, "key string, total long, n long").collect()
    expected = {f"k{k}": (sum(v for _, v in rows if _ == f"k{k}"), 0) for k in range(7)}
    assert {r["key"]: r["total"] for r in out} == {k: t for k, (t, _) in expected.items()}
    assert sum(r["n"] for r in out) == 500
    assert spark.sparkContext.master == "local[2,3]"
