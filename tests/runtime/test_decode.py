"""Decoding: every record is either an input row or a dead letter with a reason, never both."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from pyspark.sql import SparkSession

from sparkstep.runtime.decode import decode_json, parse_schema
from sparkstep.runtime.errors import PipelineDefinitionError

RECORDS_DDL = "key binary, value binary, topic string, partition int, offset long, timestamp long"


def _records(spark: SparkSession, values: Sequence[bytes | None]):
    rows = [(b"k", v, "in", 0, i, 1_700_000_000_000 + i) for i, v in enumerate(values)]
    return spark.createDataFrame(rows, RECORDS_DDL)


def test_good_and_bad_records_are_split_with_reasons(spark: SparkSession) -> None:
    values = [
        json.dumps({"key": "a", "value": 1}).encode(),
        b"not json at all",
        None,
        json.dumps({"key": "b", "value": "not a number"}).encode(),
        b"[1, 2]",
        json.dumps({"key": "c"}).encode(),
        b"\xff\xfe",
    ]
    good, dead = decode_json(_records(spark, values), parse_schema("key string, value long"))
    rows = sorted(good.collect(), key=lambda r: r["__offset"])
    assert [(r["key"], r["value"], r["__offset"], r["__weight"]) for r in rows] == [
        ("a", 1, 0, 1),
        ("c", None, 5, 1),
    ]
    assert good.columns == [
        "key", "value", "__topic", "__partition", "__offset", "__timestamp", "__weight"
    ]  # fmt: skip
    assert rows[0]["__timestamp"].year == 2023
    letters = {r["offset"]: r for r in dead.collect()}
    assert sorted(letters) == [1, 2, 3, 4, 6]
    assert letters[2]["reason"] == "the value is null (a tombstone)"
    assert "not valid JSON" in letters[1]["reason"]
    assert "not valid JSON" in letters[3]["reason"]
    # A reason never grows with the schema (it becomes a header of every dead letter).
    assert all("bigint" not in letter["reason"] for letter in letters.values())
    assert letters[1]["value"] == b"not json at all"
    assert letters[6]["value"] == b"\xff\xfe"


def test_each_branch_parses_a_record_once(spark: SparkSession) -> None:
    # from_json runs interpreted; the optimizer used to inline it into the filters that split
    # good from bad records and into the projection of the fields (3 parses per good record).
    good, dead = decode_json(_records(spark, [b"{}"]), parse_schema("key string, value long"))
    for frame in (good.select("key", "value"), dead):
        plan = frame._jdf.queryExecution().executedPlan().toString()
        assert plan.count("from_json(") == 1, plan


def test_weight_field_carries_retractions(spark: SparkSession) -> None:
    values = [
        json.dumps({"key": "a", "__weight": -1}).encode(),
        json.dumps({"key": "b"}).encode(),
    ]
    good, dead = decode_json(_records(spark, values), parse_schema("key string, __weight int"))
    assert [(r["key"], r["__weight"]) for r in good.orderBy("__offset").collect()] == [
        ("a", -1),
        ("b", 1),
    ]
    assert "__weight" in good.columns and good.columns.count("__weight") == 1
    assert dead.count() == 0


@pytest.mark.parametrize(
    ("ddl", "message"),
    [
        ("key strin", "cannot parse the value schema"),
        ("__offset long", "collides with sparkstep's columns"),
        ("__weight string", "must be an integer"),
    ],
)
def test_bad_schemas_are_refused(ddl: str, message: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=message):
        parse_schema(ddl)
