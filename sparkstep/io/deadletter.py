"""Dead-letter records: what a step could not use or could not write, kept with why and where.

They go to the topic ``<name>.dlq`` (:func:`dlq_topic`). Two kinds:

:class:`DeadLetter`, an input record that could not be decoded (the runtime decodes input with
Spark's ``from_json`` in PERMISSIVE mode; rows that do not decode become dead letters):

- value: the original value bytes, unchanged (null stays null); key: the original key;
- headers: ``sparkstep.step`` (ASCII decimal), ``sparkstep.reason`` (UTF-8 text),
  ``sparkstep.source.topic``, ``sparkstep.source.partition``, ``sparkstep.source.offset``
  (ASCII decimal).

:class:`RejectedOutput`, an output record too large for the output topic (see
:mod:`sparkstep.io.limits`):

- value: the start of the record's value; key: the start of its key;
- headers: ``sparkstep.step``, ``sparkstep.reason``, ``sparkstep.output.topic`` (the topic it
  was meant for), ``sparkstep.value.size``. The step's input ranges are in its step log record.

A dead letter too large for the dead-letter topic is written with its key and value truncated
and the size added to its reason. A truncated record of either kind carries
``sparkstep.value.size``: the original value's length in bytes (ASCII decimal); a record
without it is whole.

Invariant: dead-letter records are written only inside their step's transaction by
:class:`~sparkstep.io.output.OutputWriter`, so a replayed or retried step never duplicates them
and a consumer with ``isolation.level=read_committed`` sees each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from sparkstep.io.encoding import step_header

__all__ = [
    "DEFAULT_REASON",
    "DeadLetter",
    "DlqRecord",
    "HEADER_OUTPUT_TOPIC",
    "HEADER_REASON",
    "HEADER_SOURCE_OFFSET",
    "HEADER_SOURCE_PARTITION",
    "HEADER_SOURCE_TOPIC",
    "HEADER_VALUE_SIZE",
    "RejectedOutput",
    "dead_letters_from_arrow",
    "dlq_topic",
]

HEADER_REASON = "sparkstep.reason"
HEADER_SOURCE_TOPIC = "sparkstep.source.topic"
HEADER_SOURCE_PARTITION = "sparkstep.source.partition"
HEADER_SOURCE_OFFSET = "sparkstep.source.offset"
HEADER_OUTPUT_TOPIC = "sparkstep.output.topic"
HEADER_VALUE_SIZE = "sparkstep.value.size"

DEFAULT_REASON = "the value is not a JSON object of the input schema"


def dlq_topic(name: str) -> str:
    """The dead-letter topic of pipeline ``name``."""
    return f"{name}.dlq"


def _size_header(value_size: int | None) -> list[tuple[str, bytes]]:
    return [] if value_size is None else [(HEADER_VALUE_SIZE, str(value_size).encode("ascii"))]


@dataclass(frozen=True, order=True)
class DeadLetter:
    """One input record that could not be decoded, and why.

    ``value_size`` is None for a whole record, else the original value's size (the value was
    truncated).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str = DEFAULT_REASON
    value_size: int | None = field(default=None, compare=False)

    def headers(self, step: int) -> list[tuple[str, bytes]]:
        """The Kafka headers of this record when written for ``step``."""
        return [
            step_header(step),
            (HEADER_REASON, self.reason.encode("utf-8")),
            (HEADER_SOURCE_TOPIC, self.topic.encode("utf-8")),
            (HEADER_SOURCE_PARTITION, str(self.partition).encode("ascii")),
            (HEADER_SOURCE_OFFSET, str(self.offset).encode("ascii")),
            *_size_header(self.value_size),
        ]


@dataclass(frozen=True)
class RejectedOutput:
    """One output record too large to write, kept (truncated) as a dead letter, and why."""

    output_topic: str
    key: bytes | None
    value: bytes | None
    reason: str
    value_size: int | None = None

    def headers(self, step: int) -> list[tuple[str, bytes]]:
        """The Kafka headers of this record when written for ``step``."""
        return [
            step_header(step),
            (HEADER_REASON, self.reason.encode("utf-8")),
            (HEADER_OUTPUT_TOPIC, self.output_topic.encode("utf-8")),
            *_size_header(self.value_size),
        ]


#: A record of the dead-letter topic.
DlqRecord = DeadLetter | RejectedOutput


def dead_letters_from_arrow(
    table: pa.Table | pa.RecordBatch, reason: str = DEFAULT_REASON
) -> list[DeadLetter]:
    """Dead letters from rows with ``topic, partition, offset, key, value`` (``reason`` optional).

    Column names may also carry the input DataFrame's double-underscore prefix (``__topic``...).
    Rows are returned sorted by (topic, partition, offset), so the order Spark collected them in
    does not matter.
    """
    columns = table.to_pydict()

    def column(name: str) -> list[object]:
        for candidate in (name, f"__{name}"):
            if candidate in columns:
                return list(columns[candidate])
        raise KeyError(f"dead-letter rows need a {name!r} column, got {sorted(columns)}")

    n = table.num_rows
    reasons = list(columns["reason"]) if "reason" in columns else [reason] * n
    letters = [
        DeadLetter(
            topic=str(t),
            partition=int(p),
            offset=int(o),
            key=k,
            value=v,
            reason=str(r) if r is not None else reason,
        )
        for t, p, o, k, v, r in zip(
            column("topic"),
            column("partition"),
            column("offset"),
            column("key"),
            column("value"),
            reasons,
            strict=True,
        )
    ]
    return sorted(letters)
