"""The output record format: a row of the output table as a Kafka record, and the step digest.

Output records (the table passed to :meth:`~sparkstep.io.output.OutputWriter.write`): a
``pyarrow.Table`` whose columns are the output row plus an integer weight column
(``OutputOptions.weight_column``, default ``"weight"``; +1 insert, -1 retract). Each row becomes
one Kafka record:

- value: UTF-8 JSON object of the row's columns in table order (the weight column left out),
  then ``"weight": <int>``; timestamps and dates as ISO 8601, decimals as strings, bytes as
  base64, durations as seconds;
- key: ``OutputOptions.key_columns``: one column: its text (UTF-8) or bytes, or JSON for other
  types; several: a JSON array of their values; None: the row itself (JSON, without weight);
- header :data:`HEADER_STEP` (``sparkstep.step``): the step as ASCII decimal. Every record
  sparkstep writes for a step (output, dead letter, step log record) carries it.

The output digest is order independent (Spark does not promise row order across re-runs): the
sum modulo 2**64 of a 64-bit BLAKE2b hash of each record's key and value, as 16 hex digits.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from sparkstep.io.errors import StreamIOError

__all__ = [
    "EncodedRecord",
    "HEADER_STEP",
    "encode_json",
    "encode_output",
    "output_digest",
    "step_header",
]

#: The header naming the step a record belongs to (ASCII decimal), on every record of a step.
HEADER_STEP = "sparkstep.step"
_MASK = (1 << 64) - 1


def step_header(step: int) -> tuple[str, bytes]:
    """The :data:`HEADER_STEP` header of ``step``."""
    return (HEADER_STEP, str(step).encode("ascii"))


@dataclass(frozen=True)
class EncodedRecord:
    """One output record as it goes to Kafka."""

    key: bytes | None
    value: bytes


def _json_default(value: object) -> object:
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_json_default)


def encode_json(value: object) -> bytes:
    """``value`` as compact UTF-8 JSON, with the conversions of the module docstring."""
    return _ENCODER.encode(value).encode("utf-8")


def _key_bytes(values: Sequence[object]) -> bytes:
    if len(values) == 1:
        only = values[0]
        if isinstance(only, str):
            return only.encode("utf-8")
        if isinstance(only, bytes):
            return only
        return encode_json(only)
    return encode_json(list(values))


def encode_output(
    table: pa.Table,
    key_columns: Sequence[str] | None,
    weight_column: str = "weight",
) -> list[EncodedRecord]:
    """The Kafka records of an output table (format in the module docstring), in table order."""
    names = list(table.column_names)
    if weight_column not in names:
        raise StreamIOError(f"the output table has no {weight_column!r} column (columns: {names})")
    row_names = [n for n in names if n != weight_column]
    if key_columns is not None:
        unknown = [k for k in key_columns if k not in row_names]
        if unknown or not key_columns:
            raise StreamIOError(f"key columns {list(key_columns)} are not output columns {names}")
    rows = table.select(row_names).to_pylist()
    weights = table.column(weight_column).to_pylist()
    records = []
    for row, weight in zip(rows, weights, strict=True):
        if not isinstance(weight, int) or isinstance(weight, bool):
            raise StreamIOError(f"output row {row!r:.200} has a non-integer weight {weight!r}")
        key = encode_json(row) if key_columns is None else _key_bytes([row[k] for k in key_columns])
        row["weight"] = weight
        records.append(EncodedRecord(key, encode_json(row)))
    return records


_NULL_KEY = b"\xff\xff\xff\xff"


def _record_hash(key: bytes | None, value: bytes) -> int:
    head = _NULL_KEY if key is None else len(key).to_bytes(4, "big") + key
    return int.from_bytes(hashlib.blake2b(head + value, digest_size=8).digest(), "big")


def output_digest(records: Sequence[EncodedRecord]) -> str:
    """The order-independent digest of a step's output records (16 hex digits)."""
    total = 0
    for record in records:
        total = (total + _record_hash(record.key, record.value)) & _MASK
    return f"{total:016x}"
