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
sum modulo 2**64 of a 64-bit hash of each record's key and value. Its text names its format
(:func:`output_digest_format`), so that a step log keeps being checked by the digest its steps
were logged with:

- format 2 (:data:`OUTPUT_DIGEST_FORMAT`, what sparkstep writes): ``v2:`` and 16 hex digits;
  a record's hash is ``pair_hash(key, value)`` of :mod:`sparkstep.hashing`
  (a missing key hashes as ``H = 0``), for all records at once with numpy;
- format 1: 16 hex digits; a record's hash is the 64-bit BLAKE2b of its key (4-byte big-endian
  length, then the bytes; ``ff ff ff ff`` for no key) followed by its value, one Python call per
  record (about 85 ms of the writer's thread for a 170k-record step; format 2 takes 40 ms).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.hashing import MASK, pair_hashes
from sparkstep.io.errors import StreamIOError

__all__ = [
    "EncodedRecord",
    "EncodedRecords",
    "HEADER_STEP",
    "OUTPUT_DIGEST_FORMAT",
    "encode_json",
    "encode_output",
    "output_digest",
    "output_digest_format",
    "step_header",
]

#: The header naming the step a record belongs to (ASCII decimal), on every record of a step.
HEADER_STEP = "sparkstep.step"
#: The format of the output digests sparkstep writes (see the module docstring).
OUTPUT_DIGEST_FORMAT = 2
_FORMAT_PREFIX = "v2:"


def step_header(step: int) -> tuple[str, bytes]:
    """The :data:`HEADER_STEP` header of ``step``."""
    return (HEADER_STEP, str(step).encode("ascii"))


class EncodedRecord(NamedTuple):
    """One output record as it goes to Kafka."""

    key: bytes | None
    value: bytes


class EncodedRecords(Sequence[EncodedRecord]):
    """A step's output records, column by column: record ``i`` is ``keys[i]``, ``values[i]``.

    Columns, not a tuple per record: a 200k-record step makes ~170k records, and their tuples
    cost the writer thread about as much as the Arrow encoding (their allocation, and the
    garbage collector's full passes over them once they outlived its young generations; the
    columns hold bytes objects, which it does not track). Indexing and iterating give
    :class:`EncodedRecord` s; the hot paths read the columns.

    :attr:`payload` is each record's key plus value size in bytes, what a size limit is checked
    against (:mod:`sparkstep.io.limits`) in one comparison for the whole step.
    """

    __slots__ = ("_payload", "keys", "values")

    def __init__(
        self,
        keys: list[bytes | None],
        values: list[bytes],
        payload: npt.NDArray[np.int64] | None = None,
    ) -> None:
        if len(keys) != len(values) or (payload is not None and len(payload) != len(values)):
            raise ValueError(
                f"{len(keys)} keys and {len(values)} values do not make records of one length"
            )
        self.keys = keys
        self.values = values
        self._payload = payload

    @classmethod
    def of(cls, records: Iterable[tuple[bytes | None, bytes]]) -> EncodedRecords:
        """The records of ``records`` ((key, value) pairs), in order."""
        keys: list[bytes | None] = []
        values: list[bytes] = []
        for key, value in records:
            keys.append(key)
            values.append(value)
        return cls(keys, values)

    @property
    def payload(self) -> npt.NDArray[np.int64]:
        """Per record, the bytes of its key (0 for none) and value."""
        if self._payload is None:
            sizes = (len(k or b"") + len(v) for k, v in zip(self.keys, self.values, strict=True))
            self._payload = np.fromiter(sizes, dtype=np.int64, count=len(self.values))
        return self._payload

    def take(self, indices: Sequence[int] | npt.NDArray[np.intp]) -> EncodedRecords:
        """The records at ``indices``, in that order."""
        return EncodedRecords(
            [self.keys[i] for i in indices],
            [self.values[i] for i in indices],
            self.payload[np.asarray(indices, dtype=np.intp)],
        )

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, index: int) -> EncodedRecord: ...

    @overload
    def __getitem__(self, index: slice) -> EncodedRecords: ...

    def __getitem__(self, index: int | slice) -> EncodedRecord | EncodedRecords:
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        return EncodedRecord(self.keys[index], self.values[index])

    def __iter__(self) -> Iterator[EncodedRecord]:
        return map(EncodedRecord, self.keys, self.values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EncodedRecords):
            return self.keys == other.keys and self.values == other.values
        return NotImplemented

    def __repr__(self) -> str:
        return f"EncodedRecords({len(self)} records)"


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
) -> EncodedRecords:
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
        return EncodedRecords([], [], np.zeros(0, dtype=np.int64))
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
        keys = (
            _binary(_json_object(row_names, texts))
            if row_names
            else pa.chunked_array([pa.repeat(pa.scalar(b"{}", pa.large_binary()), table.num_rows)])
        )
    elif len(key_columns) == 1:
        keys = _key_bytes(columns[key_columns[0]], texts[key_columns[0]])
    else:
        items = pc.binary_join_element_wise(*[texts[k] for k in key_columns], ",")
        keys = _binary(_concat(["[", items, "]"]))
    # As ``row["weight"] = weight`` on the row's dict: a row column named "weight" keeps its
    # place and takes the weight's value; otherwise "weight" comes last.
    texts["weight"] = pc.cast(weights, pa.string())
    value_names = row_names if "weight" in row_names else [*row_names, "weight"]
    values = _binary(_json_object(value_names, texts))
    payload = pc.add(pc.binary_length(keys), pc.binary_length(values))
    return EncodedRecords(
        keys.to_pylist(),
        values.to_pylist(),
        payload.combine_chunks().to_numpy(zero_copy_only=False).astype(np.int64),
    )


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


def _key_bytes(column: pa.ChunkedArray, texts: pa.ChunkedArray) -> pa.ChunkedArray:
    """The record keys of a one-column key: a text's or bytes' own bytes, else its JSON."""
    kind = column.type
    text_or_bytes = (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )
    if not text_or_bytes:
        return _binary(texts)
    raw = pc.cast(column, pa.large_binary())
    return pc.if_else(pc.is_null(column), pa.scalar(b"null", pa.large_binary()), raw)


def _json_object(names: Sequence[str], texts: dict[str, pa.ChunkedArray]) -> pa.ChunkedArray:
    """Per row, the JSON object of ``names`` with their ``texts``."""
    parts: list[object] = []
    for i, name in enumerate(names):
        parts += [("," if i else "") + encode_json(name).decode("utf-8") + ":", texts[name]]
    return _concat(["{", *parts, "}"])


def _concat(parts: Sequence[object]) -> pa.ChunkedArray:
    """Per row, the concatenation of ``parts`` (string arrays and str constants)."""
    return pc.binary_join_element_wise(*parts, "")


def _binary(texts: pa.ChunkedArray) -> pa.ChunkedArray:
    """The UTF-8 bytes of each text (or binary value), as large binary."""
    return pc.cast(texts, pa.large_binary())


_NULL_KEY = b"\xff\xff\xff\xff"
_HEX16 = re.compile(r"[0-9a-f]{16}")


def output_digest(records: EncodedRecords, digest_format: int = OUTPUT_DIGEST_FORMAT) -> str:
    """The order-independent digest of a step's output records in ``digest_format`` (the
    module docstring); ValueError for a format there is none of."""
    if digest_format == 2:
        keys = pa.array(records.keys, pa.binary())
        values = pa.array(records.values, pa.binary())
        total = int(pair_hashes(keys, values).sum(dtype=np.uint64)) if len(values) else 0
        return f"{_FORMAT_PREFIX}{total:016x}"
    if digest_format == 1:
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        total = 0
        for key, value in zip(records.keys, records.values, strict=True):
            head = _NULL_KEY if key is None else len(key).to_bytes(4, "big") + key
            total += from_bytes(blake2b(head + value, digest_size=8).digest(), "big")
        return f"{total & MASK:016x}"
    raise ValueError(f"there is no output digest format {digest_format}")


def output_digest_format(digest: str) -> int:
    """The format of an output digest's text (the module docstring): 2 for ``v2:`` and 16 hex
    digits, 1 for 16 hex digits; ValueError for any other text (a step log record of a later
    sparkstep, or a damaged one: never read as either; the step log refuses the record)."""
    if digest.startswith(_FORMAT_PREFIX) and _HEX16.fullmatch(digest[len(_FORMAT_PREFIX) :]):
        return 2
    if _HEX16.fullmatch(digest):
        return 1
    raise ValueError(
        f"output digest {digest!r:.40} is of no format this sparkstep knows (16 hex digits, "
        f"or {_FORMAT_PREFIX!r} and 16 hex digits): written by a later sparkstep?"
    )
