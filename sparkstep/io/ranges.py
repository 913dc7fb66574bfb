"""Reading input offset ranges exactly: in the driver, or in Spark executors via ``mapInArrow``.

:func:`read_range` returns exactly the committed records of ``[start, end)`` of one
topic-partition, in offset order, as an Arrow record batch of :data:`RECORD_SCHEMA`, with the
record count, a hash of what was read and the largest record timestamp. Invariants:

- read_committed: records of aborted transactions are skipped, records of open transactions are
  never returned (a division never reaches past the last stable offset anyway);
- the same range always gives the same records and the same hash (the hash covers offsets, keys
  and values, in offset order), whatever the consumer read before;
- the read ends when the consumer's position reaches ``end``, or a record at or after ``end``
  arrives, or the partition's end is reached: a range can end on a transaction marker or an
  aborted batch, so offset ``end - 1`` may never arrive as a record and is never waited for;
- offsets below the log start (deleted by retention) raise
  :class:`~sparkstep.io.errors.InputLostError`, never a silent jump; no progress for
  ``KafkaConfig.timeout_s`` raises :class:`~sparkstep.io.errors.KafkaUnavailableError`.

Consumers: a throwaway ``group.id`` that is never joined (``assign`` + seek, no subscribe), auto
commit and offset store off. They are kept per Python process (Spark reuses its Python workers)
in a small pool keyed by the :class:`~sparkstep.io.config.KafkaConfig`, so a task does not pay
for a new connection per range.

Spark use (the runtime's step 3)::

    ranges = spark.createDataFrame([(r.topic, r.partition, r.start, r.end) for r in div.ranges],
                                   RANGES_DDL)
    records = ranges.mapInArrow(map_ranges(config), RECORDS_DDL)          # the input rows
    summaries = ranges.mapInArrow(map_range_summaries(config), SUMMARIES_DDL)  # count/hash/ts

Each function reads whole ranges (a range is never split across tasks); counts and hashes travel
as rows, never as accumulators, so a re-run task cannot count twice.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from sparkstep.io.config import KafkaConfig, translate_kafka_error
from sparkstep.io.division import PartitionRange
from sparkstep.io.errors import (
    InputLostError,
    KafkaUnavailableError,
    MissingTopicError,
    RangeReadError,
)

__all__ = [
    "RANGES_DDL",
    "RANGES_SCHEMA",
    "RECORDS_DDL",
    "RECORD_SCHEMA",
    "RangeRead",
    "SUMMARIES_DDL",
    "SUMMARY_SCHEMA",
    "map_range_summaries",
    "map_ranges",
    "range_hash",
    "range_messages",
    "read_range",
    "read_ranges",
]

#: The rows of a ranges DataFrame (the input of the ``mapInArrow`` functions).
RANGES_DDL = "topic string, partition int, start bigint, end bigint"
RANGES_SCHEMA = pa.schema(
    [("topic", pa.string()), ("partition", pa.int32()), ("start", pa.int64()), ("end", pa.int64())]
)

#: One input record. ``timestamp`` is milliseconds since the epoch, null when the record has none.
RECORDS_DDL = (
    "key binary, value binary, topic string, partition int, offset bigint, timestamp bigint"
)
RECORD_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.int64()),
    ]
)

#: One read range: what the step log records per range (``max_timestamp`` null when empty).
SUMMARIES_DDL = (
    "topic string, partition int, start bigint, end bigint, count bigint, hash string, "
    "max_timestamp bigint"
)
SUMMARY_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("count", pa.int64()),
        ("hash", pa.string()),
        ("max_timestamp", pa.int64()),
    ]
)

_BATCH = 5000

#: librdkafka settings of the range readers. A short broker long-poll, so the partition's end
#: is seen soon; a deep prefetch queue; and a short pause when it is full (librdkafka's default
#: fetch.queue.backoff.ms of 1s would throttle a long range to a few MB/s).
_READER_SETTINGS = {
    "fetch.wait.max.ms": 10,
    "queued.min.messages": 100_000,
    "fetch.queue.backoff.ms": 5,
}
_MIN_WAIT = 0.005
_MAX_WAIT = 0.2


@dataclass(frozen=True)
class RangeRead:
    """What reading one range gave: its records, their count and hash, the largest timestamp."""

    range: PartitionRange
    records: pa.RecordBatch
    count: int
    hash: str
    max_timestamp: int | None


def _new_hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


_HEAD = struct.Struct(">qii")


def _feed(hasher: Any, offset: int, key: bytes | None, value: bytes | None) -> None:
    # offset, key length, value length (-1 for null), then the key and value bytes.
    hasher.update(
        _HEAD.pack(offset, -1 if key is None else len(key), -1 if value is None else len(value))
    )
    if key:
        hasher.update(key)
    if value:
        hasher.update(value)


def range_hash(records: Iterable[tuple[int, bytes | None, bytes | None]]) -> str:
    """The hash of a range's ``(offset, key, value)`` records in offset order (hex, 32 chars)."""
    hasher = _new_hasher()
    for offset, key, value in records:
        _feed(hasher, offset, key, value)
    digest: str = hasher.hexdigest()
    return digest


class _ConsumerPool:
    """Consumers kept per process and config; one borrower at a time per consumer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[KafkaConfig, list[Consumer]] = {}

    @contextmanager
    def borrow(self, config: KafkaConfig) -> Iterator[Consumer]:
        with self._lock:
            idle = self._idle.setdefault(config, [])
            consumer = idle.pop() if idle else None
        if consumer is None:
            consumer = Consumer(
                config.consumer(
                    f"sparkstep.reader.{uuid.uuid4().hex}",
                    **_READER_SETTINGS,
                )
            )
        healthy = False
        try:
            yield consumer
            healthy = True
        finally:
            if healthy:
                try:
                    consumer.unassign()
                except KafkaException:
                    healthy = False
            if healthy:
                with self._lock:
                    self._idle.setdefault(config, []).append(consumer)
            else:
                _known_topics.pop(id(consumer), None)
                consumer.close()


_POOL = _ConsumerPool()
# Topics whose metadata each pooled consumer (by id) has fetched.
_known_topics: dict[int, set[str]] = {}


def read_range(config: KafkaConfig, rng: PartitionRange) -> RangeRead:
    """Read exactly the committed records of ``rng`` (see the module docstring)."""
    hasher = _new_hasher()
    keys: list[bytes | None] = []
    values: list[bytes | None] = []
    offsets: list[int] = []
    stamps: list[int | None] = []
    if not rng.is_empty:
        with _POOL.borrow(config) as consumer:
            feed = _feed
            for msg in _consume(consumer, config, rng):
                offset: int = msg.offset()  # type: ignore[assignment]  # a record has one
                key, value = msg.key(), msg.value()
                ts_type, ts = msg.timestamp()
                feed(hasher, offset, key, value)
                keys.append(key)
                values.append(value)
                offsets.append(offset)
                stamps.append(None if ts_type == TIMESTAMP_NOT_AVAILABLE else ts)
    count = len(offsets)
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array([rng.topic] * count, pa.string()),
            pa.array([rng.partition] * count, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(stamps, pa.int64()),
        ],
        schema=RECORD_SCHEMA,
    )
    present = [s for s in stamps if s is not None]
    return RangeRead(rng, batch, count, hasher.hexdigest(), max(present) if present else None)


def _consume(consumer: Consumer, config: KafkaConfig, rng: PartitionRange) -> Iterator[Message]:
    """Yield the records of ``rng`` in offset order; see the stop rules in the module docstring."""
    where = f"{rng.topic}[{rng.partition}] {rng.span}"
    tp = TopicPartition(rng.topic, rng.partition)
    try:
        if rng.topic not in _known_topics.setdefault(id(consumer), set()):
            # Ask for the topic's metadata now: otherwise librdkafka finds the partition's
            # leader only at its next periodic scan, up to a second after assign().
            consumer.list_topics(rng.topic, timeout=config.timeout_s)
            _known_topics[id(consumer)].add(rng.topic)
        consumer.assign([TopicPartition(rng.topic, rng.partition, rng.start)])
    except KafkaException as exc:
        raise translate_kafka_error(exc, f"assigning input {where}", config) from exc
    progress_at = time.monotonic()
    last = rng.start - 1
    wait = _MIN_WAIT
    while True:
        # consume() blocks until it has num_messages or the timeout passed: ask for no more
        # than the offsets left, and wait briefly, longer only while nothing comes.
        want = max(1, min(_BATCH, rng.end - (last + 1)))
        try:
            batch = consumer.consume(num_messages=want, timeout=wait)
        except KafkaException as exc:
            raise translate_kafka_error(exc, f"reading input {where}", config) from exc
        eof_at = -1
        for msg in batch:
            error = msg.error()
            if error is not None:
                code = error.code()
                if code == KafkaError._PARTITION_EOF:
                    # The end of the partition (the LSO, read_committed): its offset.
                    eof_at = max(eof_at, msg.offset() or -1)
                    continue
                if code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    raise InputLostError(
                        f"input {where} is no longer in Kafka (deleted by retention?): "
                        f"{error.str()}; raise retention.ms of {rng.topic}"
                    )
                if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                    raise MissingTopicError(f"input topic of {where} does not exist: {error.str()}")
                if error.fatal():
                    raise RangeReadError(f"reading input {where} failed: {error.str()}")
                continue  # transient: librdkafka retries by itself
            offset = msg.offset()
            if offset is None or msg.topic() != rng.topic or msg.partition() != rng.partition:
                continue
            if offset < rng.start or offset <= last:
                continue  # a message fetched for an earlier assignment or a duplicate
            if offset >= rng.end:
                return
            progress_at = time.monotonic()
            last = offset
            yield msg
            if offset == rng.end - 1:
                return
        if eof_at >= rng.end:
            return
        wait = _MIN_WAIT if batch else min(_MAX_WAIT, wait * 2)
        if eof_at >= 0 or not batch:
            # The position passes transaction markers and aborted batches without a record.
            position = consumer.position([tp])[0].offset
            if position >= rng.end:
                return
            if position > last + 1:
                progress_at = time.monotonic()
                last = position - 1
        if time.monotonic() - progress_at > config.timeout_s:
            raise KafkaUnavailableError(
                f"reading input {where} made no progress for {config.timeout_s:.0f}s "
                f"(at offset {last + 1}); check that the broker runs"
            )


def range_messages(config: KafkaConfig, rng: PartitionRange) -> list[Message]:
    """The committed records of ``rng`` as confluent-kafka messages (with their headers), read
    like :func:`read_range`; for small ranges read in process (a step's output)."""
    if rng.is_empty:
        return []
    with _POOL.borrow(config) as consumer:
        return list(_consume(consumer, config, rng))


def read_ranges(config: KafkaConfig, ranges: Iterable[PartitionRange]) -> list[RangeRead]:
    """:func:`read_range` of each range, in the given order (in-process convenience)."""
    return [read_range(config, rng) for rng in ranges]


def _ranges_in(batches: Iterable[pa.RecordBatch]) -> Iterator[PartitionRange]:
    for batch in batches:
        columns = batch.to_pydict()
        for topic, partition, start, end in zip(
            columns["topic"], columns["partition"], columns["start"], columns["end"], strict=True
        ):
            yield PartitionRange(str(topic), int(partition), int(start), int(end))


def map_ranges(
    config: KafkaConfig,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: rows of :data:`RANGES_DDL` in, their records (RECORDS_DDL) out."""

    def records(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rng in _ranges_in(batches):
            read = read_range(config, rng)
            if read.count:
                yield read.records

    return records


def map_range_summaries(
    config: KafkaConfig,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: rows of :data:`RANGES_DDL` in, one SUMMARIES_DDL row each out."""

    def summaries(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for rng in _ranges_in(batches):
            read = read_range(config, rng)
            yield pa.RecordBatch.from_pylist(
                [
                    {
                        "topic": rng.topic,
                        "partition": rng.partition,
                        "start": rng.start,
                        "end": rng.end,
                        "count": read.count,
                        "hash": read.hash,
                        "max_timestamp": read.max_timestamp,
                    }
                ],
                schema=SUMMARY_SCHEMA,
            )

    return summaries
