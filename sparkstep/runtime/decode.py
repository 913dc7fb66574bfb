"""Decoding input records into the pipeline's input DataFrame, and the dead letters.

Input records (``key, value, topic, partition, offset, timestamp``, as
:mod:`sparkstep.io.ranges` reads them) are decoded with Spark's ``from_json`` in PERMISSIVE mode
with a corrupt-record column, on the executors, never row by row in Python. The result is:

- the *input DataFrame* the user's code sees: the value schema's fields, then ``__topic``,
  ``__partition``, ``__offset``, ``__timestamp`` (timestamp type, from the record's timestamp)
  and ``__weight``;
- the *dead-letter rows*: ``topic, partition, offset, key, value, reason`` of every record that
  does not decode: a null value (a tombstone), text that is not JSON, JSON that is not an object,
  or a field whose value does not fit its type.

The ``__weight`` convention: a value schema may declare an integer field ``__weight``; a record
that carries it adds that weight (``-1`` retracts a row inserted earlier); a record without it,
or a schema without it, has weight ``+1``. A record whose ``__weight`` is 0 is kept (it changes
nothing). Missing fields of the schema decode as null, as in Spark.

Both DataFrames come from one parse of the same records, so a record is either input or a dead
letter, never both and never neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparkstep.runtime.errors import PipelineDefinitionError
from sparkstep.runtime.plan_check import WEIGHT

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["DEAD_LETTER_COLUMNS", "decode_json", "parse_schema"]

DEAD_LETTER_COLUMNS = ("topic", "partition", "offset", "key", "value", "reason")

_CORRUPT = "__corrupt_record"
_PARSED = "__parsed"
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


def decode_json(records: DataFrame, schema: StructType) -> tuple[DataFrame, DataFrame]:
    """Split ``records`` into (the input DataFrame, the dead-letter rows); see the module doc."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    with_corrupt = StructType([*schema.fields, StructField(_CORRUPT, StringType(), True)])
    # The parse is a column of a projection that also holds a nondeterministic column (the
    # partition id, which an always-true filter below tests, so that it is not pruned): Spark
    # neither pushes a filter through such a projection nor merges it into the next one, so
    # each branch parses a record once. Without it, the optimizer inlines the parse into the
    # filters that split good from bad records and into the field projection: from_json is
    # interpreted (no code generation) and ran 3 times per record in the input branch and
    # twice in the dead-letter branch.
    parsed = records.select(
        "*",
        F.from_json(
            F.col("value").cast("string"),
            with_corrupt,
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT},
        ).alias(_PARSED),
        F.spark_partition_id().alias(_BARRIER),
    )
    is_null = F.col("value").isNull()
    not_object = F.col(_PARSED).isNull()
    corrupt = F.col(f"{_PARSED}.{_CORRUPT}").isNotNull()
    # The reasons name no schema: a dead letter must not grow with the schema's size.
    reason = (
        F.when(is_null, F.lit("the value is null (a tombstone)"))
        .when(not_object, F.lit("the value is not a JSON object"))
        .otherwise(F.lit("the value is not valid JSON of the input's schema"))
    )
    bad = is_null | not_object | corrupt
    parsed = parsed.where(F.col(_BARRIER) >= 0)  # always true: keeps the barrier column
    dead = parsed.where(bad).select(*DEAD_LETTER_COLUMNS[:-1], reason.alias("reason"))

    names = [f.name for f in schema.fields if f.name != WEIGHT]
    weight = (
        F.coalesce(F.col(f"{_PARSED}.{WEIGHT}").cast("long"), F.lit(1).cast("long"))
        if WEIGHT in schema.fieldNames()
        else F.lit(1).cast("long")
    )
    good = parsed.where(~bad).select(
        *[F.col(f"{_PARSED}.{name}").alias(name) for name in names],
        F.col("topic").alias("__topic"),
        F.col("partition").alias("__partition"),
        F.col("offset").alias("__offset"),
        F.timestamp_millis(F.col("timestamp")).alias("__timestamp"),
        weight.alias(WEIGHT),
    )
    return good, dead
