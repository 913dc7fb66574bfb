"""Decoding: every record is either an input row or a dead letter with a reason, never both."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import StructType

from sparkstep.io.ranges import READ_DDL
from sparkstep.runtime.decode import (
    DecodedRead,
    decode_read,
    parse_schema,
    predecoder,
    read_schema,
)
from sparkstep.runtime.errors import PipelineDefinitionError

Inputs = Sequence[tuple[str, StructType]]


def _read(spark: SparkSession, values: Sequence[bytes | None], inputs: Inputs, topic: str = "in"):
    """A step's read of ``values`` (offsets 0, 1, ...) in ``topic``, then its summary row, as
    the read's task gives it for ``inputs`` (through the fast path)."""
    rows: list[tuple[object, ...]] = [
        (b"k", v, topic, 0, i, 1_700_000_000_000 + i, False, None, None, None, None)
        for i, v in enumerate(values)
    ]
    rows.append((None, None, topic, 0, None, None, True, 0, len(values), len(values), "h"))
    raw = spark.createDataFrame(rows, READ_DDL).toArrow()
    predecode = predecoder(inputs)
    read = pa.Table.from_batches([predecode(batch) for batch in raw.to_batches()])
    # From rows, as before the fast path: not a local relation, which the optimizer would
    # evaluate on the driver (a step's read is not one either).
    return spark.createDataFrame(read.to_pylist(), read_schema(inputs))


def _decoded(spark: SparkSession, values: Sequence[bytes | None], ddl: str) -> DecodedRead:
    inputs = [("in", parse_schema(ddl))]
    return decode_read(_read(spark, values, inputs), inputs)


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
    decoded = _decoded(spark, values, "key string, value long")
    good, dead = decoded.good(0), decoded.dead(0)
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
    # The summary row is neither; an input row keeps no copy of its record's bytes.
    kept = {r["offset"]: (r["key"], r["value"]) for r in decoded.frame.collect()}
    assert kept[None] == (None, None) and kept[0] == (None, None) and kept[5] == (None, None)
    assert kept[1] == (b"k", b"not json at all")


def test_each_record_is_parsed_once_for_all_branches(spark: SparkSession) -> None:
    # from_json runs interpreted. The optimizer used to inline it into the filters that split
    # good from bad records and into the projection of the fields (3 parses per good record),
    # and each branch parsed the records again (a dead-letter branch: once more).
    decoded = _decoded(spark, [b"{}"], "key string, value long")
    plan = decoded.frame._jdf.queryExecution().executedPlan().toString()
    assert plan.count("from_json(") == 1, plan
    decoded.frame.persist()
    try:
        # Over the persisted decoded read, the only parse is the one that fills the cache.
        for frame, rows in ((decoded.good(0).select("key", "value"), 1), (decoded.dead(0), 0)):
            plan = frame._jdf.queryExecution().executedPlan().toString()
            assert "InMemoryTableScan" in plan and plan.count("from_json(") == 1, plan
            assert frame.count() == rows
    finally:
        decoded.frame.unpersist()


def test_inputs_decode_only_their_own_topic(spark: SparkSession) -> None:
    inputs = [("one", parse_schema("key string, value long")), ("two", parse_schema("name string"))]
    read = _read(spark, [json.dumps({"key": "a", "value": 1}).encode()], inputs, "one")
    read = read.unionByName(
        _read(spark, [json.dumps({"name": "n", "value": 1}).encode(), b"{"], inputs, "two")
    )
    decoded = decode_read(read, inputs)
    assert [tuple(r) for r in decoded.good(0).select("key", "value", "__topic").collect()] == [
        ("a", 1, "one")
    ]
    assert [tuple(r) for r in decoded.good(1).select("name", "__topic").collect()] == [("n", "two")]
    assert decoded.dead(0).count() == 0
    assert [(r["topic"], r["offset"]) for r in decoded.dead(1).collect()] == [("two", 1)]


def test_weight_field_carries_retractions(spark: SparkSession) -> None:
    values = [
        json.dumps({"key": "a", "__weight": -1}).encode(),
        json.dumps({"key": "b"}).encode(),
    ]
    decoded = _decoded(spark, values, "key string, __weight int")
    good, dead = decoded.good(0), decoded.dead(0)
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
