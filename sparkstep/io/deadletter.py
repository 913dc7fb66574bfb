"""Dead-letter records: input that could not be decoded, kept with where it came from.

The runtime decodes input with Spark's ``from_json`` in PERMISSIVE mode; rows that do not decode
become :class:`DeadLetter` values and go to the topic ``<name>.dlq`` (:func:`dlq_topic`) as:

- value: the original value bytes, unchanged (null stays null); key: the original key;
- headers: ``sparkstep.step`` (ASCII decimal), ``sparkstep.reason`` (UTF-8 text),
  ``sparkstep.source.topic``, ``sparkstep.source.partition``, ``sparkstep.source.offset``
  (ASCII decimal).

Invariant: dead-letter records are written only inside their step's transaction by
:class:`~sparkstep.io.output.OutputWriter`, so a replayed or retried step never duplicates them
and a consumer with ``isolation.level=read_committed`` sees each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

__all__ = [
    "DEFAULT_REASON",
    "DeadLetter",
    "HEADER_REASON",
    "HEADER_SOURCE_OFFSET",
    "HEADER_SOURCE_PARTITION",
    "HEADER_SOURCE_TOPIC",
    "HEADER_STEP",
    "dead_letters_from_arrow",
    "dlq_topic",
]

HEADER_STEP = "sparkstep.step"
HEADER_REASON = "sparkstep.reason"
HEADER_SOURCE_TOPIC = "sparkstep.source.topic"
HEADER_SOURCE_PARTITION = "sparkstep.source.partition"
HEADER_SOURCE_OFFSET = "sparkstep.source.offset"

DEFAULT_REASON = "the value is not a JSON object of the input schema"


def dlq_topic(name: str) -> str:
    """The dead-letter topic of pipeline ``name``."""
    return f"{name}.dlq"


@dataclass(frozen=True, order=True)
class DeadLetter:
    """One input record that could not be decoded, and why."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str = DEFAULT_REASON

    def headers(self, step: int) -> list[tuple[str, bytes]]:
        """The Kafka headers of this record when written for ``step``."""
        return [
            (HEADER_STEP, str(step).encode("ascii")),
            (HEADER_REASON, self.reason.encode("utf-8")),
            (HEADER_SOURCE_TOPIC, self.topic.encode("utf-8")),
            (HEADER_SOURCE_PARTITION, str(self.partition).encode("ascii")),
            (HEADER_SOURCE_OFFSET, str(self.offset).encode("ascii")),
        ]


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
