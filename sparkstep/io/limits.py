"""The size limit of the records a step writes, and what happens to a record over it.

Kafka refuses a record batch bigger than the topic's ``max.message.bytes`` (by default the
broker's ``message.max.bytes``), and librdkafka refuses a record bigger than the producer's
``message.max.bytes``. Such a record would fail its step's transaction on every rerun, so the
output writer checks every record BEFORE producing it, by size, against one limit:

- :class:`RecordLimit` ``max_bytes``: the smallest of the producer's ``message.max.bytes``
  (``--kafka-config``, librdkafka's default 1,000,000) and the ``max.message.bytes`` of the output,
  dead-letter and step log topics, read once with the admin client when the writer opens;
- a record *fits* when its size bound (:meth:`RecordLimit.record_bytes`: key, value, header names
  and values, plus :data:`RECORD_OVERHEAD` and :data:`HEADER_OVERHEAD` per header for the record
  format's length fields) plus :data:`BATCH_OVERHEAD` (the record batch header, with slack) is at
  most ``max_bytes``. The bound never undercounts an uncompressed record, and compression only
  shrinks a batch;
- the producer's ``batch.size`` is capped at ``max_bytes - BATCH_OVERHEAD``, so librdkafka never
  puts records that fit one by one into a batch that does not.

:func:`fit_step` replaces what does not fit, deterministically (the result is a function of the
records and ``max_bytes`` only, so a replayed step writes the same thing):

- an output record -> a :class:`~sparkstep.io.deadletter.RejectedOutput` dead letter;
- a dead letter -> the same dead letter with key and value truncated;

each with at most :data:`KEY_PREVIEW` bytes of key, :data:`VALUE_PREVIEW` bytes of value (less
if the limit requires) and :data:`REASON_PREVIEW` characters of reason, the original value's size
and the reason (format in
:mod:`sparkstep.io.deadletter`).

Changing a topic's ``max.message.bytes`` changes which records are replaced from the next writer
on; a replay compares the step's whole output (written and replaced records alike), so it still
matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from sparkstep.io.config import ClientSettings
from sparkstep.io.deadletter import DeadLetter, DlqRecord, RejectedOutput
from sparkstep.io.encoding import EncodedRecords, step_header
from sparkstep.io.errors import RecurringWriteError
from sparkstep.io.topics import TopicAdmin

__all__ = [
    "BATCH_OVERHEAD",
    "FittedStep",
    "HEADER_OVERHEAD",
    "KEY_PREVIEW",
    "REASON_PREVIEW",
    "RECORD_OVERHEAD",
    "RecordLimit",
    "VALUE_PREVIEW",
    "fit_step",
]

#: The record batch header (61 bytes in format v2), with slack.
BATCH_OVERHEAD = 128
#: A record's own fields (length, attributes, timestamp and offset deltas, key and value
#: lengths, header count), at their largest varint sizes.
RECORD_OVERHEAD = 40
#: One header's two length fields, at their largest varint sizes.
HEADER_OVERHEAD = 10
#: The most of a replaced record's key a dead letter keeps.
KEY_PREVIEW = 1024
#: The most of a replaced record's value a dead letter keeps.
VALUE_PREVIEW = 16 * 1024
#: The most characters of a replaced record's reason a dead letter keeps.
REASON_PREVIEW = 1024
#: librdkafka's default ``message.max.bytes`` and ``batch.size``.
_LIBRDKAFKA_DEFAULT = 1_000_000


@dataclass(frozen=True)
class RecordLimit:
    """The size limit of the records of a step (module docstring); ``source`` says whose it is."""

    max_bytes: int
    source: str

    @classmethod
    def read(
        cls, admin: TopicAdmin, producer: ClientSettings, topics: Iterable[str]
    ) -> RecordLimit:
        """The limit of ``producer`` writing to ``topics`` (which must exist)."""
        limit = cls(
            int(producer.get("message.max.bytes", _LIBRDKAFKA_DEFAULT)),
            "the producer's message.max.bytes",
        )
        for topic in topics:
            value = admin.topic_config(topic).get("max.message.bytes")
            if value is not None and int(value) < limit.max_bytes:
                limit = cls(int(value), f"max.message.bytes of topic {topic}")
        return limit

    @property
    def batch_size(self) -> int:
        """The largest ``batch.size`` the producer may use."""
        return max(1, self.max_bytes - BATCH_OVERHEAD)

    @staticmethod
    def record_bytes(
        key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]
    ) -> int:
        """An upper bound of the record's size in a record batch."""
        size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
        for name, header in headers:
            size += HEADER_OVERHEAD + len(name.encode("utf-8")) + len(header)
        return size

    def payload_room(self, headers: Sequence[tuple[str, bytes]]) -> int:
        """How many key and value bytes together a record with ``headers`` can have: a record
        fits exactly when ``len(key) + len(value)`` is at most this (for checking many records
        with the same headers)."""
        return self.max_bytes - BATCH_OVERHEAD - self.record_bytes(None, None, headers)

    def room(self, key: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
        """How many value bytes a record with ``key`` and ``headers`` can have (may be < 0)."""
        return self.max_bytes - BATCH_OVERHEAD - self.record_bytes(key, b"", headers)

    def fits(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]]
    ) -> bool:
        """True when the record can be written."""
        return len(value or b"") <= self.room(key, headers)

    def too_large(self, size: int) -> str:
        """The reason text of a replaced record of ``size`` bytes."""
        return f"the record is {size} bytes, over the {self.max_bytes}-byte limit ({self.source})"


@dataclass(frozen=True)
class FittedStep:
    """A step's records after :func:`fit_step`: what goes to the output and dead-letter topics."""

    records: EncodedRecords
    dead_letters: list[DlqRecord]
    replaced: int


def _truncate(limit: RecordLimit, letter: DlqRecord, step: int, where: str) -> DlqRecord:
    """``letter`` with key and value cut to fit ``limit`` (at most their previews)."""
    key = None if letter.key is None else letter.key[:KEY_PREVIEW]
    value = letter.value or b""
    shrunk = replace(letter, key=key, value=b"", value_size=len(value))
    room = limit.room(key, shrunk.headers(step))
    if room < 0:
        raise RecurringWriteError(
            f"step {step}: {where} does not fit even truncated into {limit.max_bytes} bytes "
            f"({limit.source}): raise it to at least 64 KiB"
        )
    return replace(shrunk, value=value[: min(room, VALUE_PREVIEW)])


def fit_step(
    limit: RecordLimit,
    step: int,
    output_topic: str,
    records: EncodedRecords,
    dead_letters: Sequence[DeadLetter],
    extra_headers: Sequence[tuple[str, bytes]] = (),
) -> FittedStep:
    """Replace the records of ``step`` that do not fit ``limit`` (module docstring).

    ``extra_headers`` are the output records' headers besides the step's. The dead letters come
    back in their order, followed by the output records replaced, in the output's order; when
    every output record fits, the result's records are ``records`` itself.
    Raises :class:`~sparkstep.io.errors.RecurringWriteError` when not even a truncated dead
    letter fits.
    """
    headers = [step_header(step), *extra_headers]
    over = np.flatnonzero(records.payload > limit.payload_room(headers))
    kept = records
    rejected: list[DlqRecord] = []
    if len(over):
        for index in over:
            key, value = records.keys[index], records.values[index]
            size = limit.record_bytes(key, value, headers)
            letter = RejectedOutput(output_topic, key, value, limit.too_large(size))
            rejected.append(_truncate(limit, letter, step, f"an output record of {size} bytes"))
        fits = np.ones(len(records), dtype=bool)
        fits[over] = False
        kept = records.take(np.flatnonzero(fits))
    letters: list[DlqRecord] = []
    truncated = 0
    for dead in dead_letters:
        if limit.fits(dead.key, dead.value, dead.headers(step)):
            letters.append(dead)
            continue
        truncated += 1
        size = limit.record_bytes(dead.key, dead.value, dead.headers(step))
        reason = f"{dead.reason[:REASON_PREVIEW]}; {limit.too_large(size)}"
        grown = replace(dead, reason=reason)
        where = f"the dead letter of {dead.topic}[{dead.partition}]@{dead.offset}"
        letters.append(_truncate(limit, grown, step, where))
    return FittedStep(kept, letters + rejected, len(rejected) + truncated)
