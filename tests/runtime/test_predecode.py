"""The decode's fast path decides a record only where Spark's from_json gives the same."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField

from sparkstep.io.ranges import READ_SCHEMA
from sparkstep.runtime.decode import parse_schema, predecoder
from sparkstep.runtime.predecode import MAX_VALUE_BYTES, Predecoder, arrow_type, column

DDL = "s string, i bigint, n int, h smallint, t tinyint, d double, b boolean"

#: Values where Arrow's and Jackson's rules part, or nearly: each must be left to Spark or
#: decoded as Spark does.
QUIRKS = [
    b'{"d":-0}',  # Spark: +0.0 (an integer token); Arrow: -0.0
    b'{"d":-0.0}',
    b'{"d":1}',
    b'{"d":1E2}',
    b'{"d":0.1e1}',
    b'{"d":4.9e-324}',
    b'{"d":2.5e-324}',
    b'{"d":1e-400}',
    b'{"d":1e400}',
    b'{"d":123456789012345678901234567890}',
    b'{"d":NaN}',
    b'{"d":Infinity}',
    b'{"d":-Infinity}',
    b'{"d":Inf}',
    b'{"x":Inf}',
    b'{"x":NaN}',
    b'{"x":-NaN}',
    b'{"x":-Inf}',
    b'{"d":"1.5"}',
    b'{"i":-0}',
    b'{"i":9223372036854775807}',
    b'{"i":9223372036854775808}',
    b'{"i":-9223372036854775808}',
    b'{"i":1.0}',
    b'{"i":1e2}',
    b'{"i":"1"}',
    b'{"i":01}',
    b'{"n":2147483648}',
    b'{"n":-2147483648}',
    b'{"h":32768}',
    b'{"t":128}',
    b'{"t":-128}',
    b'{"s":1}',
    b'{"s":true}',
    b'{"s":{"a":1}}',
    b'{"s":[1,2]}',
    b'{"s":"\\u0000"}',
    b'{"s":"\\ud800"}',
    b'{"s":"\\ud83d\\ude00"}',
    b'{"s":"\xff"}',
    b'{"s":"\xed\xa0\x80"}',
    b'{"s":"\xc3\xa9"}',
    b'{"s":"a\tb"}',
    b'{"s":"a\\tb"}',
    b'{"b":1}',
    b'{"b":"true"}',
    b'{"b":true,"b":false}',
    b'{"i":1,"i":2}',
    b'{"S":"a"}',
    b'{"\\u0073":"a"}',
    b'{"s":"a"} x',
    b'{"s":"a"}{"s":"b"}',
    b'{"s":"a"},"x":1',
    b'{"s":"a"},"v":{"s":"b"}',
    b'{"s":"a"}}',
    b'{"s":"a",}',
    b"{'s':'a'}",
    b'{"s":"a" /* c */}',
    b'\t{"i":3}\t ',
    b'\xef\xbb\xbf{"i":3}',
    b'{"i":3}\n',
    b'{\n"i":3}',
    b'{"i":3}\r',
    b"{}",
    b"[]",
    b'[{"i":1}]',
    b"null",
    b"5",
    b'"s"',
    b"",
    b" ",
    b'{"x":[1,{"y":[null,true]}],"i":4}',
    b'{"x":' + b"[" * 600 + b"]" * 600 + b',"i":4}',
    b'{"s":"' + b"a" * (MAX_VALUE_BYTES - 8) + b'"}',
    b'{"s":"' + b"a" * (MAX_VALUE_BYTES - 7) + b'"}',
]


def _fuzz(count: int, seed: int) -> list[bytes]:
    """Random values: objects over the schema's names and others, values of every JSON kind,
    some of the wrong kind, some broken by a random edit."""
    rng = random.Random(seed)
    names = ["s", "i", "n", "h", "t", "d", "b", "x", "S", "y"]
    strings = ["", "a", "é", "😀", "\n", '"', "\\", "\u0001", "\u2028", "x" * 40]
    numbers = [
        "0", "-0", "1", "-1", "127", "128", "-129", "32767", "32768", "2147483647", "2147483648",
        "9223372036854775807", "9223372036854775808", "1.5", "-0.0", "1e5", "1E-5", "2.5e-324",
        "1e309", "0.30000000000000004", "123456789012345678901234567890", "00", "1.", ".5",
    ]  # fmt: skip

    def value(depth: int) -> str:
        kind = rng.randrange(8)
        if kind == 0:
            return json.dumps(rng.choice(strings), ensure_ascii=rng.random() < 0.5)
        if kind in (1, 2):
            return rng.choice(numbers)
        if kind == 3:
            return rng.choice(["true", "false", "null"])
        if kind == 4 and depth < 3:
            return "[" + ",".join(value(depth + 1) for _ in range(rng.randrange(3))) + "]"
        if kind == 5 and depth < 3:
            return obj(depth + 1)
        return rng.choice(numbers[:12])

    def obj(depth: int) -> str:
        members = [
            f"{json.dumps(rng.choice(names))}{rng.choice([':', ' : '])}{value(depth)}"
            for _ in range(rng.randrange(5))
        ]
        return "{" + rng.choice([",", ", "]).join(members) + "}"

    values = []
    for _ in range(count):
        text = obj(0).encode()
        if rng.random() < 0.15 and text:
            at = rng.randrange(len(text))
            edit = rng.choice([b"", b"{", b"}", b",", b":", b'"', b"'", b" ", b"]", b"x"])
            text = text[:at] + edit + text[at + rng.randrange(2) :]
        values.append(text)
    return values


def _read_batch(values: Sequence[bytes | None], topic: str = "in") -> pa.RecordBatch:
    """A read's batch of ``values`` in ``topic`` (offsets 0, 1, ...), then a summary row."""
    count = len(values)
    rows: list[dict[str, Any]] = [
        {"key": b"k", "value": v, "topic": topic, "partition": 0, "offset": i, "__summary": False}
        for i, v in enumerate(values)
    ]
    rows.append({"topic": topic, "partition": 0, "__summary": True, "__count": count})
    return pa.RecordBatch.from_pylist(rows, schema=READ_SCHEMA)


def _spark_decode(spark: SparkSession, values: Sequence[bytes]) -> list[dict[str, Any] | None]:
    """Spark's from_json of each value (PERMISSIVE), None where the record is rejected."""
    schema = parse_schema(DDL)
    with_corrupt = schema.add(StructField("_c", StringType(), True))
    rows = (
        spark.createDataFrame([(i, v) for i, v in enumerate(values)], "i int, value binary")
        .select(
            "i",
            F.from_json(
                F.col("value").cast("string"),
                with_corrupt,
                {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_c"},
            ).alias("p"),
        )
        .collect()
    )
    parsed: list[dict[str, Any] | None] = [None] * len(values)
    for row in rows:
        if row["p"] is not None and row["p"]["_c"] is None:
            found = row["p"].asDict()
            del found["_c"]
            parsed[row["i"]] = found
    return parsed


def _bits(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with doubles as their bits (so -0.0 and 0.0 differ)."""
    return {k: struct.pack(">d", v) if isinstance(v, float) else v for k, v in row.items()}


def test_every_decided_record_is_what_spark_decodes(spark: SparkSession) -> None:
    values = QUIRKS + _fuzz(3000, seed=13)
    spark_rows = _spark_decode(spark, values)
    decode = predecoder([("in", parse_schema(DDL))])

    def mismatches(decided: Sequence[dict[str, Any] | None], at: Sequence[int]) -> list[Any]:
        found = []
        for i, mine in zip(at, decided, strict=True):
            theirs = spark_rows[i]
            if mine is not None and (theirs is None or _bits(mine) != _bits(theirs)):
                found.append((values[i], mine, theirs))
        return found

    # Each value alone: what the fast path decides of it.
    alone = [decode(_read_batch([v])).column(column(0))[0].as_py() for v in values]
    assert not mismatches(alone, range(len(values)))[:5]
    # The path is used: most values Spark decodes are decided, and none of the quirks that part.
    good = sum(row is not None for row in spark_rows[len(QUIRKS) :])
    fast = sum(row is not None for row in alone[len(QUIRKS) :])
    assert good > 1000 and fast > 0.75 * good, (fast, good)
    by_value = dict(zip(QUIRKS, alone, strict=False))
    assert by_value[b'{"d":-0}'] is None and by_value[b'{"d":-0.0}'] is None
    assert by_value[b'{"x":Inf}'] is None and by_value[b'{"i":3}\n'] is None
    assert by_value[b'{"i":-9223372036854775808}'] == {**dict.fromkeys("sinhtdb"), "i": -(2**63)}
    assert by_value[b'{"s":"a"},"x":1'] == {**dict.fromkeys("sinhtdb"), "s": "a"}
    # In one batch: the values decided alone, every 200th value one that is not. The rows line
    # up, and a bad record costs only itself the fast path.
    undecided = [i for i, row in enumerate(alone) if row is None]
    mixed = [i for i, row in enumerate(alone) if row is not None]
    for n, i in enumerate(undecided[: len(mixed) // 200]):
        mixed.insert(n * 200, i)
    batch = decode(_read_batch([values[i] for i in mixed])).column(column(0)).to_pylist()
    assert not mismatches(batch[: len(mixed)], mixed)[:5]
    assert [row is None for row in batch[: len(mixed)]] == [alone[i] is None for i in mixed]


def test_a_bad_record_leaves_the_rest_of_its_batch_decided() -> None:
    values: list[bytes | None] = [json.dumps({"s": f"k{i}", "i": i}).encode() for i in range(1000)]
    values[3], values[500], values[999] = b"not json", None, b'{"i":"x"}'
    decode = predecoder([("in", parse_schema(DDL))])
    out = decode(_read_batch(values))
    decided = out.column(column(0)).to_pylist()
    undecided = {i for i, row in enumerate(decided[:-1]) if row is None}
    assert undecided == {3, 500, 999}
    assert decided[7] == {**dict.fromkeys("sinhtdb"), "s": "k7", "i": 7}
    # A decided record's value is not needed after the read; the others keep theirs.
    kept = out.column("value").to_pylist()
    assert kept[7] is None and kept[3] == b"not json" and kept[999] == b'{"i":"x"}'
    assert decided[-1] is None  # the summary row


def test_a_record_keeps_its_value_while_another_input_of_its_topic_needs_it() -> None:
    decode = predecoder(
        [("in", parse_schema("s string")), ("in", parse_schema("s string, when timestamp"))]
    )
    assert [name for name, _ in decode.columns] == [column(0)]
    out = decode(_read_batch([b'{"s":"a"}']))
    assert out.column(column(0)).to_pylist()[0] == {"s": "a"}
    assert out.column("value").to_pylist()[0] == b'{"s":"a"}'
    # Another topic's records are not this input's.
    other = decode(_read_batch([b'{"s":"a"}'], topic="other"))
    assert other.column(column(0)).to_pylist()[0] is None


@pytest.mark.parametrize(
    ("fields", "eligible"),
    [
        ([("a", "string"), ("b", "bigint"), ("c", "double"), ("d", "boolean")], True),
        ([("a", "tinyint"), ("b", "smallint"), ("c", "int")], True),
        ([("a", "float")], False),
        ([("a", "timestamp")], False),
        ([("a", "decimal(10,2)")], False),
        ([("a", "array<int>")], False),
        ([("a", "string"), ("a", "string")], False),
    ],
)
def test_only_schemas_of_simple_types_are_decided(
    fields: list[tuple[str, str]], eligible: bool
) -> None:
    assert (arrow_type(fields) is not None) == eligible
    assert Predecoder((("in", arrow_type(fields)),)).columns == (
        ((column(0), arrow_type(fields)),) if eligible else ()
    )


def test_a_batch_of_records_arrow_refuses_is_left_to_spark() -> None:
    # Numbers for a string field: Spark takes them as their text, Arrow's reader fails them.
    values: list[bytes | None] = [json.dumps({"s": i}).encode() for i in range(1000)]
    out = predecoder([("in", parse_schema(DDL))])(_read_batch(values))
    assert out.column(column(0)).null_count == len(values) + 1
    assert out.column("value").to_pylist()[:-1] == values
