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
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

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


class EncodedRecord(NamedTuple):
    """One output record as it goes to Kafka (a named tuple: a step makes one per output row,
    and a tuple is the cheapest record Python builds)."""

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


def encode_output(
    table: pa.Table,
    key_columns: Sequence[str] | None,
    weight_column: str = "weight",
) -> list[EncodedRecord]:
    """The Kafka records of an output table (format in the module docstring), in table order.

    Columnar: each column becomes one JSON text per row with Arrow compute (integers, booleans
    and strings without characters to escape never reach Python), and the rows' texts are joined
    with Arrow too. Columns of other types are encoded value by value with :func:`encode_json`.
    The bytes are exactly those of ``encode_json`` of the row as a dict (``"weight"`` set last).

    Raises :class:`~sparkstep.io.errors.StreamIOError` for a missing or non-integer weight
    column, a null weight, or key columns that are not output columns.
    """
    names = list(table.column_names)
    if weight_column not in names:
        raise StreamIOError(f"the output table has no {weight_column!r} column (columns: {names})")
    row_names = [n for n in names if n != weight_column]
    if key_columns is not None:
        unknown = [k for k in key_columns if k not in row_names]
        if unknown or not key_columns:
            raise StreamIOError(f"key columns {list(key_columns)} are not output columns {names}")
    if table.num_rows == 0:
        return []
    weights = table.column(weight_column)
    if not pa.types.is_integer(weights.type) or weights.null_count:
        bad = next(
            i
            for i, w in enumerate(weights.to_pylist())
            if not isinstance(w, int) or isinstance(w, bool)
        )
        row = table.select(row_names).slice(bad, 1).to_pylist()[0]
        raise StreamIOError(
            f"output row {row!r:.200} has a non-integer weight {weights[bad].as_py()!r}"
        )
    columns = {name: _decoded(table.column(name)) for name in row_names}
    texts = {name: _json_texts(column) for name, column in columns.items()}
    if key_columns is None:
        # A row without columns is ``{}``; there is nothing to join.
        keys: Sequence[bytes | None] = (
            _bytes(_json_object(row_names, texts)) if row_names else [b"{}"] * table.num_rows
        )
    elif len(key_columns) == 1:
        keys = _key_bytes(columns[key_columns[0]], texts[key_columns[0]])
    else:
        items = pc.binary_join_element_wise(*[texts[k] for k in key_columns], ",")
        keys = _bytes(_concat(["[", items, "]"]))
    # As ``row["weight"] = weight`` on the row's dict: a row column named "weight" keeps its
    # place and takes the weight's value; otherwise "weight" comes last.
    texts["weight"] = pc.cast(weights, pa.string())
    value_names = row_names if "weight" in row_names else [*row_names, "weight"]
    values = _bytes(_json_object(value_names, texts))
    return list(map(EncodedRecord, keys, values))


def _decoded(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """``column`` with a dictionary encoding undone (its values are what is written)."""
    if pa.types.is_dictionary(column.type):
        return pc.cast(column, column.type.value_type)
    return column


#: A string that JSON must escape: a quote, a backslash or a control character.
_NEEDS_ESCAPE = r'["\\\x00-\x1f]'


def _json_texts(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """One JSON text per value of ``column`` (``null`` for a null), as strings."""
    kind = column.type
    if pa.types.is_integer(kind):
        texts = pc.cast(column, pa.string())
    elif pa.types.is_boolean(kind):
        texts = pc.if_else(column, "true", "false")
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        texts = pa.chunked_array(
            [_string_texts(chunk) for chunk in pc.cast(column, pa.string()).chunks], pa.string()
        )
    else:
        texts = pa.array([encode_json(v).decode("utf-8") for v in column.to_pylist()], pa.string())
    return pc.fill_null(texts, "null")


def _string_texts(chunk: pa.Array) -> pa.Array:
    """The JSON strings of one chunk of a string column (nulls stay null). Chunk by chunk, so
    no result grows past what Spark sent in one batch; the rare text with a character to escape
    is encoded by :func:`encode_json`."""
    quoted = _concat(['"', chunk, '"'])
    escape = pc.fill_null(pc.match_substring_regex(chunk, _NEEDS_ESCAPE), False)
    if not pc.any(escape).as_py():
        return quoted
    escaped = [encode_json(v).decode("utf-8") for v in pc.filter(chunk, escape).to_pylist()]
    return pc.replace_with_mask(quoted, escape, pa.array(escaped, pa.string()))


def _key_bytes(column: pa.ChunkedArray, texts: pa.ChunkedArray) -> list[bytes]:
    """The record keys of a one-column key: a text's or bytes' own bytes, else its JSON."""
    kind = column.type
    text_or_bytes = (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )
    if not text_or_bytes:
        return _bytes(texts)
    raw = pc.cast(column, pa.large_binary())
    return _bytes(pc.if_else(pc.is_null(column), pa.scalar(b"null", pa.large_binary()), raw))


def _json_object(names: Sequence[str], texts: dict[str, pa.ChunkedArray]) -> pa.ChunkedArray:
    """Per row, the JSON object of ``names`` with their ``texts``."""
    parts: list[object] = []
    for i, name in enumerate(names):
        parts += [("," if i else "") + encode_json(name).decode("utf-8") + ":", texts[name]]
    return _concat(["{", *parts, "}"])


def _concat(parts: Sequence[object]) -> pa.ChunkedArray:
    """Per row, the concatenation of ``parts`` (string arrays and str constants)."""
    return pc.binary_join_element_wise(*parts, "")


def _bytes(texts: pa.ChunkedArray) -> list[bytes]:
    """The UTF-8 bytes of each text (or binary value)."""
    found: list[bytes] = pc.cast(texts, pa.large_binary()).to_pylist()
    return found


_NULL_KEY = b"\xff\xff\xff\xff"


def output_digest(records: Sequence[EncodedRecord]) -> str:
    """The order-independent digest of a step's output records (16 hex digits): the sum modulo
    2**64 of each record's 64-bit BLAKE2b of its key (4-byte big-endian length, then the bytes;
    ``ff ff ff ff`` for no key) followed by its value."""
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    total = 0
    for key, value in records:
        head = _NULL_KEY if key is None else len(key).to_bytes(4, "big") + key
        total += from_bytes(blake2b(head + value, digest_size=8).digest(), "big")
    return f"{total & _MASK:016x}"
