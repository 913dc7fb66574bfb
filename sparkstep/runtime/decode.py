"""Decoding a step's read into the pipeline's input DataFrames, and the dead letters.

A step's read (:data:`sparkstep.io.ranges.READ_DDL`: the records ``key, value, topic,
partition, offset, timestamp``, and a summary row per range) is decoded with Spark's
``from_json`` in PERMISSIVE mode with a corrupt-record column, on the executors, never row by
row in Python. Per input (a topic and a value schema) the result is:

- the *input DataFrame* the user's code sees: the value schema's fields, then ``__topic``,
  ``__partition``, ``__offset``, ``__timestamp`` (timestamp type, from the record's timestamp)
  and ``__weight``;
- the *dead-letter rows*: ``topic, partition, offset, key, value, reason`` of every record of
  the input's topic that does not decode: a null value (a tombstone), text that is not JSON,
  JSON that is not an object, or a field whose value does not fit its type.

The ``__weight`` convention: a value schema may declare an integer field ``__weight``; a record
that carries it adds that weight (``-1`` retracts a row inserted earlier); a record without it,
or a schema without it, has weight ``+1``. A record whose ``__weight`` is 0 is kept (it changes
nothing). Missing fields of the schema decode as null, as in Spark.

**Records whose result is certain are parsed in the read's Python, the rest by Spark.** The
read's task runs :class:`~sparkstep.runtime.predecode.Predecoder` over its batches, so the read
(:func:`read_schema`) carries, per input whose schema is eligible, a column ``__pre<i>`` with
the parsed fields of the records Arrow's JSON reader decides (where ``from_json`` certainly
gives the same; :mod:`sparkstep.runtime.predecode` says when), and :func:`decode_read` runs
``from_json`` only on the others. Which records are input rows, their fields and the dead
letters with their reasons are exactly ``from_json``'s either way.

**Each record is parsed once per input, before the branches split.** :func:`decode_read` gives
one *decoded read*: the read's rows with, per input, the parsed fields and the reason a record
is rejected (null when it decodes) as columns of their own; a record's ``key`` and ``value``
are kept only where some input rejects it (a dead letter needs them, an input row does not).
The step persists the decoded read, and its branches (every input's rows, every input's dead
letters, the summaries) are filters and projections over it, so they parse nothing: a record is
either input or a dead letter of an input because both branches test the same column, never
both and never neither. (Decoding each branch from the raw read parsed every record once more
for its dead-letter branch: about a sixth of a 200k-record step's Spark work.)

from_json runs interpreted, so where it runs matters: the parse is a column of a projection
that also holds a nondeterministic column (the partition id, which an always-true filter
tests, so that it is not pruned). Spark neither pushes a filter through such a projection nor
merges it into the next one. The step's branches sit on the persisted decoded read, which the
optimizer cannot see into; the barrier keeps the parse in place where the branches are used
without it (``describe``, tests): there the optimizer inlined the parse into every filter and
projection that uses a field (three parses per good record when the branches were split
before the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkstep.io.ranges import READ_DDL
from sparkstep.runtime.errors import PipelineDefinitionError
from sparkstep.runtime.plan_check import WEIGHT
from sparkstep.runtime.predecode import Predecoder, arrow_type, column

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = [
    "DEAD_LETTER_COLUMNS",
    "DecodedRead",
    "decode_read",
    "parse_schema",
    "predecoder",
    "read_schema",
]

DEAD_LETTER_COLUMNS = ("topic", "partition", "offset", "key", "value", "reason")

_CORRUPT = "__corrupt_record"
_SUMMARY = "__summary"
_BARRIER = "__parse_barrier"
_INTEGER_TYPES = ("tinyint", "smallint", "int", "bigint")


def parse_schema(ddl: str | StructType) -> StructType:
    """The value schema from a DDL string (``"key string, value long"``) or a StructType.

    Raises :class:`PipelineDefinitionError` for an unparsable schema, a field that collides with
    the input DataFrame's metadata columns, or a non-integer ``__weight``.
    """
    from pyspark.sql.types import StructType

    if isinstance(ddl, StructType):
        schema = ddl
    else:
        try:
            parsed = StructType.fromDDL(ddl)
        except Exception as exc:  # pyspark raises its own parse errors of several kinds
            raise PipelineDefinitionError(f"cannot parse the value schema {ddl!r}: {exc}") from exc
        if not isinstance(parsed, StructType):
            raise PipelineDefinitionError(f"the value schema {ddl!r} is not a list of fields")
        schema = parsed
    for field in schema.fields:
        if field.name == WEIGHT:
            if field.dataType.simpleString() not in _INTEGER_TYPES:
                raise PipelineDefinitionError(
                    f"the value schema's {WEIGHT} must be an integer, not "
                    f"{field.dataType.simpleString()}"
                )
        elif field.name.startswith("__"):
            raise PipelineDefinitionError(
                f"the value schema's field {field.name!r} collides with sparkstep's columns "
                "(names starting with __ are reserved)"
            )
    return schema


@dataclass(frozen=True)
class DecodedRead:
    """A step's read with every input's records decoded (see the module docstring).

    ``frame`` has the read's columns (``key`` and ``value`` null but where an input rejects the
    record) and, for input ``i``, the columns ``__in<i>_<j>`` (field ``j`` of its schema,
    null on rows of other topics and on summary rows) and ``__in<i>_reason`` (null unless the
    record is of the input's topic and does not decode). :meth:`good` and :meth:`dead` are
    filters and projections of ``frame``: built over it, they use it where it is persisted.
    """

    frame: DataFrame
    inputs: tuple[tuple[str, StructType], ...]

    def good(self, index: int) -> DataFrame:
        """Input ``index``'s input DataFrame: its topic's records that decode."""
        from pyspark.sql import functions as F

        topic, schema = self.inputs[index]
        fields = {f.name: F.col(_field(index, j)) for j, f in enumerate(schema.fields)}
        weight = (
            F.coalesce(fields[WEIGHT].cast("long"), F.lit(1).cast("long"))
            if WEIGHT in fields
            else F.lit(1).cast("long")
        )
        rows = self.frame.where(
            (F.col("topic") == topic) & ~F.col(_SUMMARY) & F.col(_reason(index)).isNull()
        )
        return rows.select(
            *[column.alias(name) for name, column in fields.items() if name != WEIGHT],
            F.col("topic").alias("__topic"),
            F.col("partition").alias("__partition"),
            F.col("offset").alias("__offset"),
            F.timestamp_millis(F.col("timestamp")).alias("__timestamp"),
            weight.alias(WEIGHT),
        )

    def dead(self, index: int) -> DataFrame:
        """Input ``index``'s dead-letter rows (:data:`DEAD_LETTER_COLUMNS`)."""
        from pyspark.sql import functions as F

        reason = F.col(_reason(index))
        return self.frame.where(reason.isNotNull()).select(
            *DEAD_LETTER_COLUMNS[:-1], reason.alias(DEAD_LETTER_COLUMNS[-1])
        )


def predecoder(inputs: Sequence[tuple[str, StructType]]) -> Predecoder:
    """The fast path for ``inputs`` (each a topic and a value schema), to run over the read's
    batches in its task; it adds the columns :func:`read_schema` names."""
    return Predecoder(
        tuple(
            (topic, arrow_type([(f.name, f.dataType.simpleString()) for f in schema.fields]))
            for topic, schema in inputs
        )
    )


def read_schema(inputs: Sequence[tuple[str, StructType]]) -> StructType:
    """The schema of a read that :func:`decode_read` takes for ``inputs``: the rows of
    :data:`~sparkstep.io.ranges.READ_DDL`, then :func:`predecoder`'s columns."""
    from pyspark.sql.types import StructField, StructType

    read = StructType.fromDDL(READ_DDL)
    assert isinstance(read, StructType)
    for index in _predecoded(inputs):
        fields = [StructField(f.name, f.dataType, True) for f in inputs[index][1].fields]
        read = read.add(column(index), StructType(fields), True)
    return read


def _predecoded(inputs: Sequence[tuple[str, StructType]]) -> list[int]:
    """The inputs the fast path decides records of (those with a ``__pre`` column)."""
    return [i for i, (_, struct) in enumerate(predecoder(inputs).inputs) if struct is not None]


def decode_read(read: DataFrame, inputs: Sequence[tuple[str, StructType]]) -> DecodedRead:
    """Decode ``read`` (rows of :func:`read_schema` for ``inputs``: what :func:`predecoder`
    made of a step's read) for ``inputs``, each a topic and a value schema
    (:func:`parse_schema`'s): ``from_json`` parses each record the fast path left, once per
    input of its topic; see the module docstring."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    # Per input: its parse (a column of the projection with the barrier), then, over the
    # parsed struct, its fields and its reject reason (a column of the projection after it).
    parses, fields, reasons = [], [], []
    rejected = F.lit(False)
    predecoded = _predecoded(inputs)
    pre_columns = {column(index) for index in predecoded}
    for index, (topic, schema) in enumerate(inputs):
        mine = ~F.col(_SUMMARY) & (F.col("topic") == topic)
        with_corrupt = StructType([*schema.fields, StructField(_CORRUPT, StringType(), True)])
        parse = F.from_json(
            F.col("value").cast("string"),
            with_corrupt,
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT},
        )
        # A decided record (its __pre column is not null) is not parsed again: then the parse
        # is null, so each field is the one of the two that is there.
        pre = F.col(column(index)) if index in predecoded else None
        decided = F.lit(False) if pre is None else pre.isNotNull()
        parses.append(F.when(mine & ~decided, parse).alias(_parsed(index)))
        struct = F.col(_parsed(index))
        fields += [
            (struct[f.name] if pre is None else F.coalesce(pre[f.name], struct[f.name])).alias(
                _field(index, j)
            )
            for j, f in enumerate(schema.fields)
        ]
        # The reasons name no schema: a dead letter must not grow with the schema's size.
        reason = (
            F.when(~mine | decided, F.lit(None).cast("string"))
            .when(F.col("value").isNull(), F.lit("the value is null (a tombstone)"))
            .when(struct.isNull(), F.lit("the value is not a JSON object"))
            .when(
                struct[_CORRUPT].isNotNull(),
                F.lit("the value is not valid JSON of the input's schema"),
            )
        )
        reasons.append(reason.alias(_reason(index)))
        rejected = rejected | reason.isNotNull()
    parsed = read.select("*", *parses, F.spark_partition_id().alias(_BARRIER))
    parsed = parsed.where(F.col(_BARRIER) >= 0)  # always true: keeps the barrier column
    kept = [
        F.when(rejected, F.col(name)).alias(name) if name in ("key", "value") else F.col(name)
        for name in read.columns
        if name not in pre_columns
    ]
    return DecodedRead(parsed.select(*kept, *fields, *reasons), tuple(inputs))


def _parsed(index: int) -> str:
    return f"__parsed{index}"


def _field(index: int, field: int) -> str:
    return f"__in{index}_{field}"


def _reason(index: int) -> str:
    return f"__in{index}_reason"
