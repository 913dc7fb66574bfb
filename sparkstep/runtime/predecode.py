"""The decode's columnar fast path: records whose ``from_json`` result is certain, parsed in the
read's Python with Arrow's JSON reader.

What a record decodes to is defined by Spark's ``from_json`` (PERMISSIVE), as
:mod:`sparkstep.runtime.decode` says. Spark parses each record on its own, interpreted, with a
new Jackson parser and an 8 KB buffer per record: about a third of the Spark JVM's CPU in a
200k-record step. Arrow's JSON reader parses a whole batch in C++ for about a tenth of that.
Its rules are not Spark's, so it only *decides* a record where both certainly give the same
result, and leaves every other record to ``from_json``, as before:

A record of input ``i`` is **decided** (its parsed fields are in column ``__pre<i>``) when

- the input's schema is *eligible*: every field is ``string``, ``tinyint``, ``smallint``,
  ``int``, ``bigint``, ``double`` or ``boolean`` and the names are distinct (dates, timestamps,
  decimals, floats, binary and nested types follow Spark's own conversion rules, which this
  path does not reproduce);
- its value is at most :data:`MAX_VALUE_BYTES` bytes (so no Jackson limit applies: 1,000
  digits in a number, 1,000 levels of nesting, 50,000 characters in a name), holds no line
  break (each record is one line of the parse) and none of the texts ``NaN`` and ``Inf``
  (Jackson and Arrow do not take the same non-numeric number literals);
- Arrow's reader takes it as strict JSON (RFC 8259, valid UTF-8) whose first value is an
  object with no repeated name, every field of the schema absent, null or of its exact JSON
  kind: a string for ``string`` (Spark also takes any other token as its text), an integer in
  the type's range for the integer types, a number for ``double``, ``true``/``false`` for
  ``boolean``; names that are not in the schema are skipped whatever their value;
- no ``double`` field is negative zero (Spark reads the integer ``-0`` as ``+0.0`` and Arrow as
  ``-0.0``; ``-0.0`` itself is left to Spark too).

For such a record, Spark's result is the same: both parse the first JSON value of the text and
ignore what follows it (Spark never reads past it; here it must be further members of the
line's wrapper object, see :func:`_parse_lines`), both match names exactly, both convert
numbers with correct rounding. ``tests/runtime/test_predecode.py`` checks every decided record
of a fuzzed corpus against Spark's ``from_json`` on a real SparkSession.

Every other record of the input's topic has a null ``__pre<i>``, and the decode parses it with
``from_json``, which also gives the reject reasons: a record is never a dead letter because of
this path. A record decided for every input of its topic needs no value after the read, so its
``value`` is nulled (it never crosses to the JVM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

__all__ = ["MAX_VALUE_BYTES", "Predecoder", "arrow_type", "column"]

#: The largest value the fast path decides (see the module docstring).
MAX_VALUE_BYTES = 1000

#: Spark's simple type names the fast path decides, and their Arrow types.
_ARROW_TYPES = {
    "string": pa.string(),
    "tinyint": pa.int8(),
    "smallint": pa.int16(),
    "int": pa.int32(),
    "bigint": pa.int64(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
}
_WRAPPER = "v"
_PREFIX = b'{"' + _WRAPPER.encode() + b'":'
_SUFFIX = b"}\n"
_UNDECIDABLE = (b"\n", b"\r", b"NaN", b"Inf")
#: How many times its lines :func:`_parse` reads a batch at most, splitting what fails.
_PARSE_BUDGET = 4


def column(index: int) -> str:
    """The read's column of input ``index``'s decided records."""
    return f"__pre{index}"


def arrow_type(fields: Sequence[tuple[str, str]]) -> pa.StructType | None:
    """The Arrow struct of a schema given as (name, Spark simple type name) pairs, or ``None``
    when the schema is not eligible (see the module docstring)."""
    names = [name for name, _ in fields]
    if len(set(names)) != len(names) or any(t not in _ARROW_TYPES for _, t in fields):
        return None
    return pa.struct([pa.field(name, _ARROW_TYPES[t]) for name, t in fields])


@dataclass(frozen=True)
class Predecoder:
    """Adds the decided records' columns to a step's read batches (runs in the read's task).

    ``inputs``: per input, its topic and its :func:`arrow_type` (``None``: not eligible, no
    column). :meth:`__call__` takes a batch of the read (records and summary rows) and returns
    it with ``__pre<i>`` appended for every eligible input ``i``, in input order; it never
    fails because of a record's bytes.
    """

    inputs: tuple[tuple[str, pa.StructType | None], ...]

    @property
    def columns(self) -> tuple[tuple[str, pa.StructType], ...]:
        """The appended columns and their types, in order."""
        return tuple((column(i), t) for i, (_, t) in enumerate(self.inputs) if t is not None)

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        columns = self.columns
        if not columns:
            return batch
        values, topics = batch.column("value"), batch.column("topic")
        records = pc.invert(pc.fill_null(batch.column("__summary"), False))
        candidates = pc.and_(records, _decidable(values))
        added: list[pa.Array] = []
        # Per topic, the records every input of the topic decided: their values are not needed.
        undecided_anywhere = np.zeros(len(batch), dtype=bool)
        for topic, struct in self.inputs:
            mine = pc.fill_null(pc.and_(records, pc.equal(topics, topic)), False)
            if struct is None:
                undecided_anywhere |= mine.to_numpy(zero_copy_only=False)
                continue
            decided = self._decide(values, pc.and_(mine, candidates), struct)
            added.append(decided)
            undecided_anywhere |= pc.and_(mine, decided.is_null()).to_numpy(zero_copy_only=False)
        keep = pa.array(undecided_anywhere | ~records.to_numpy(zero_copy_only=False))
        arrays = [
            pc.if_else(keep, col, pa.scalar(None, col.type)) if name == "value" else col
            for name, col in zip(batch.schema.names, batch.columns, strict=True)
        ]
        names = [*batch.schema.names, *(name for name, _ in columns)]
        return pa.RecordBatch.from_arrays([*arrays, *added], names=names)

    @staticmethod
    def _decide(values: pa.Array, mine: pa.Array, struct: pa.StructType) -> pa.Array:
        """One input's column: its struct where ``mine`` and decided, else null."""
        where = pc.indices_nonzero(mine)
        if len(where) == 0:
            return pa.nulls(len(values), struct)
        lines = pc.binary_join_element_wise(_PREFIX, pc.take(values, where), _SUFFIX, b"")
        parsed = _without_negative_zero(_parse(lines, struct))
        # Scatter back: row r takes parsed[k] where where[k] == r, else the null row at the end.
        position = np.full(len(values), len(parsed), dtype=np.int64)
        position[where.to_numpy()] = np.arange(len(parsed))
        padded = pa.concat_arrays([parsed, pa.nulls(1, struct)])
        return pc.take(padded, pa.array(position))


def _decidable(values: pa.Array) -> pa.Array:
    """Values the fast path may try: present, short enough, no line break or non-numeric
    number literal in their bytes."""
    ok = pc.and_(pc.is_valid(values), pc.less_equal(pc.binary_length(values), MAX_VALUE_BYTES))
    for text in _UNDECIDABLE:
        ok = pc.and_(ok, pc.invert(pc.match_substring(values, text.decode())))
    return pc.fill_null(ok, False)


def _parse(lines: pa.Array, struct: pa.StructType) -> pa.StructArray:
    """Each line's wrapped value as ``struct``, null where Arrow's reader does not take it.

    A batch that fails is split in halves, level by level, until the lines that fail are alone
    or the parses have read :data:`_PARSE_BUDGET` times the batch's lines; the lines of a piece
    still failing then are null (undecided). So a few bad records in a batch of 5,000 cost
    only themselves the fast path, and a batch of mostly bad records (numbers for a string
    field, which Spark takes as their text) costs a bounded number of parses of each line on
    top of ``from_json``, never one parse per line.
    """
    budget = _PARSE_BUDGET * len(lines)
    found: dict[int, pa.Array] = {}
    pieces = [(0, len(lines))]
    while pieces:
        failed = []
        for low, high in pieces:
            parsed = None
            if high - low <= budget:
                budget -= high - low
                parsed = _parse_lines(lines[low:high], struct)
                if parsed is None and high - low > 1:
                    middle = (low + high) // 2
                    failed += [(low, middle), (middle, high)]
                    continue
            found[low] = pa.nulls(high - low, struct) if parsed is None else parsed
        pieces = failed
    return pa.concat_arrays([found[low] for low in sorted(found)])


def _parse_lines(lines: pa.Array, struct: pa.StructType) -> pa.StructArray | None:
    """The lines' wrapped values as ``struct``, or ``None`` if Arrow's reader fails any.

    A line is ``{"v":<value>}``: with no line break in a value, a line that parses gives one
    row, so the rows line up with the lines when their counts agree. A value that is an object
    followed by more members (``{...},"x":1``) parses as its first object, as Spark's does; a
    repeated ``v`` fails the line.
    """
    _, offsets_buffer, data = lines.buffers()
    assert offsets_buffer is not None and data is not None
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)
    start, end = int(offsets[lines.offset]), int(offsets[lines.offset + len(lines)])
    schema = pa.schema([pa.field(_WRAPPER, struct)])
    try:
        lines.cast(pa.string())  # Arrow's reader does not check UTF-8; Spark's replaces bad bytes
        table = pj.read_json(
            pa.BufferReader(data.slice(start, end - start)),
            read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, end - start)),
            parse_options=pj.ParseOptions(
                explicit_schema=schema, unexpected_field_behavior="ignore"
            ),
        )
    except pa.ArrowException:  # whatever Arrow refuses is left to from_json
        return None
    if table.num_rows != len(lines):
        return None
    return table.column(_WRAPPER).combine_chunks()


def _without_negative_zero(parsed: pa.StructArray) -> pa.StructArray:
    """``parsed`` with the rows that hold a negative zero in a double field made null."""
    bad = None
    for index, field in enumerate(parsed.type):
        if field.type == pa.float64():
            values = parsed.field(index)
            zero = pc.and_(pc.equal(values, 0.0), pc.less(pc.divide(1.0, values), 0.0))
            bad = zero if bad is None else pc.or_(bad, zero)
    if bad is None:
        return parsed
    bad = pc.fill_null(bad, False)
    if not pc.any(bad).as_py():
        return parsed
    return pc.if_else(bad, pa.nulls(len(parsed), parsed.type), parsed)
