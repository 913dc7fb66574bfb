"""The columnar output encoder writes exactly the documented record format."""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Sequence

import pyarrow as pa
import pytest

from sparkstep.io.encoding import EncodedRecord, EncodedRecords, encode_json, encode_output
from sparkstep.io.errors import StreamIOError


def _oracle(
    table: pa.Table, key_columns: Sequence[str] | None, weight_column: str = "weight"
) -> list[tuple[bytes | None, bytes]]:
    """The record format of sparkstep.io.encoding's docstring, row by row: each row a dict
    encoded whole by ``encode_json`` (its type conversions are the format's)."""
    row_names = [n for n in table.column_names if n != weight_column]
    records: list[tuple[bytes | None, bytes]] = []
    for row, weight in zip(
        table.select(row_names).to_pylist(), table.column(weight_column).to_pylist(), strict=True
    ):
        if key_columns is None:
            key = encode_json(row)
        elif len(key_columns) == 1:
            only = row[key_columns[0]]
            key = (
                only.encode()
                if isinstance(only, str)
                else only
                if isinstance(only, bytes)
                else encode_json(only)
            )
        else:
            key = encode_json([row[k] for k in key_columns])
        row["weight"] = weight
        records.append((key, encode_json(row)))
    return records


TEXTS = ["plain", 'q"uote', "back\\slash", "line\nbreak", "\x00\x01\x1f", "ünï 😀", "", None]
N = len(TEXTS)

WIDE = pa.table(
    {
        "s": pa.array(TEXTS),
        "large": pa.array(TEXTS, pa.large_string()),
        "dict": pa.array(TEXTS).dictionary_encode(),
        "i": pa.array([1, -2, None, 2**62, 0, 5, 6, 7], pa.int64()),
        "small": pa.array([1, 2, 3, 4, 5, 6, 7, -8], pa.int8()),
        "u": pa.array([2**64 - 1] * N, pa.uint64()),
        "b": pa.array([True, False, None, True, True, False, True, False]),
        "f": pa.array([1.0, 0.1, None, 1e16, float("nan"), float("inf"), -0.0, 2.5]),
        "ts": pa.array([datetime.datetime(2026, 1, 1, 1, 2, 3, 456)] * (N - 1) + [None]),
        "date": pa.array([datetime.date(2026, 11, 25)] * N),
        "dec": pa.array([decimal.Decimal("1.50")] * N, pa.decimal128(5, 2)),
        "bin": pa.array([b"\x00\xff", b"", None, b"k", b"k", b"k", b"k", b"k"]),
        "struct": pa.array([{"x": 1, "y": 'a"b'}] * N),
        "list": pa.array([[1, 2], [], None, [3], [3], [3], [3], [3]]),
        "null": pa.array([None] * N, pa.null()),
        "weight": pa.array([1, -1] * (N // 2), pa.int32()),
    }
)


@pytest.mark.parametrize(
    "key_columns",
    [None, ["s"], ["large"], ["dict"], ["bin"], ["i"], ["f"], ["struct"], ["s", "i", "ts"]],
)
def test_every_type_is_encoded_as_the_record_format_says(key_columns: list[str] | None) -> None:
    records = encode_output(WIDE, key_columns)
    assert [(r.key, r.value) for r in records] == _oracle(WIDE, key_columns)
    # The sizes the limits are checked against are the records' own, as a row-wise count.
    assert records.payload.tolist() == [len(k or b"") + len(v) for k, v in records]


def test_encoded_records_are_columns_that_read_as_records() -> None:
    records = EncodedRecords.of([(b"a", b"1"), (None, b"22"), (b"ccc", b"")])
    assert records.keys == [b"a", None, b"ccc"] and records.values == [b"1", b"22", b""]
    assert records[1] == EncodedRecord(None, b"22") and records[-1].key == b"ccc"
    assert records.payload.tolist() == [2, 2, 3]
    assert list(records.take([2, 0])) == [(b"ccc", b""), (b"a", b"1")]
    assert records.take([2, 0]).payload.tolist() == [3, 2]
    assert records[1:] == EncodedRecords([None, b"ccc"], [b"22", b""])
    assert records != EncodedRecords.of([(b"a", b"1")])
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        EncodedRecords([b"a", b"b"], [b"1"])


def test_chunked_columns_and_a_row_column_named_weight() -> None:
    chunked = pa.concat_tables([WIDE.slice(0, 3), WIDE.slice(3)])
    assert chunked.column("s").num_chunks == 2
    assert [(r.key, r.value) for r in encode_output(chunked, ["s"])] == _oracle(chunked, ["s"])
    # The weight column is "w" and a row column is called "weight": the weight takes its place.
    table = pa.table({"weight": ["x"], "a": [1], "w": pa.array([-1], pa.int64())})
    assert [r.value for r in encode_output(table, None, "w")] == [b'{"weight":-1,"a":1}']
    bare = pa.table({"weight": pa.array([1, -1], pa.int64())})
    assert [(r.key, r.value) for r in encode_output(bare, None)] == _oracle(bare, None)
    assert len(encode_output(WIDE.slice(0, 0), ["s"])) == 0
    # No rows, no records, whatever the weight column's type (as the row-wise encoder did).
    empty = pa.table({"s": pa.array([], pa.string()), "weight": pa.array([], pa.float64())})
    assert len(encode_output(empty, ["s"])) == 0


@pytest.mark.parametrize(
    ("weights", "shown"),
    [
        (pa.array([1, None], pa.int64()), "None"),
        (pa.array([1.0, 2.0]), "1.0"),
        (pa.array([True, False]), "True"),
    ],
)
def test_a_weight_that_is_not_an_integer_is_refused(weights: pa.Array, shown: str) -> None:
    table = pa.table({"key": ["a", "b"], "weight": weights})
    with pytest.raises(StreamIOError, match=f"has a non-integer weight {shown}"):
        encode_output(table, ["key"])
