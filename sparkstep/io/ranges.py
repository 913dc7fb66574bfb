"""Reading input offset ranges exactly: in the driver, or in Spark executors via ``mapInArrow``.

:func:`read_range` reads the committed records of ``[start, end)`` of one topic-partition, in
offset order, as an Arrow table of :data:`RECORD_SCHEMA`, with the record count, a hash of what
was read and the largest record timestamp. Invariants:

- read_committed: records of aborted transactions are skipped, records of open transactions are
  never returned (a division never reaches past the last stable offset anyway);
- the same range always gives the same records and the same hash (the hash covers offsets, keys
  and values, in offset order), whatever the consumer read before;
- the read ends when the consumer's position reaches ``end``, or a record at or after ``end``
  arrives, or the partition's end is reached: a range can end on a transaction marker or an
  aborted batch, so offset ``end - 1`` may never arrive as a record and is never waited for;
- with a byte budget ``max_bytes``, the read stops before the first record that would take the
  keys and values read past it, except the range's first record (so a read always progresses);
  the read's range then ends at that record's offset. The cut is a function of the range's
  records, so a retried task cuts at the same offset. Without a budget the read is exact;
- the records come in Arrow batches of at most :data:`BATCH_RECORDS` records and
  ``batch_bytes`` (:data:`BATCH_BYTES`) of keys and values, or one record larger than that, so
  no binary column nears Arrow's 2 GiB limit however much a range holds;
- offsets below the log start (deleted by retention) raise
  :class:`~sparkstep.io.errors.InputLostError`, never a silent jump; no progress for
  ``KafkaConfig.timeout_s`` raises :class:`~sparkstep.io.errors.KafkaUnavailableError`, or
  :class:`~sparkstep.io.errors.InputRewoundError` when the partition ended below ``end``.

Consumers: a throwaway ``group.id`` that is never joined (``assign`` + seek, no subscribe), auto
commit and offset store off. They are kept per Python process (Spark reuses its Python workers)
in a small pool keyed by the :class:`~sparkstep.io.config.KafkaConfig`, so a task does not pay
for a new connection per range.

Spark use (the runtime's step): one row of :data:`RANGES_DDL` per non-empty range, each with its
byte budget (null: read exactly), and one read for records and summaries::

    ranges = spark.createDataFrame(rows, RANGES_DDL)
    read = ranges.mapInArrow(map_read(config), READ_DDL)   # records, then a summary row each
    summaries = read_summaries(read.where("__summary").toArrow())

A range is never split across tasks; counts and hashes travel as rows, never as accumulators, so
a re-run task cannot count twice.
"""

from __future__ import annotations

import dataclasses
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
    InputRewoundError,
    KafkaUnavailableError,
    MissingTopicError,
    RangeReadError,
    StreamIOError,
)

__all__ = [
    "BATCH_BYTES",
    "BATCH_RECORDS",
    "RANGES_DDL",
    "READ_DDL",
    "READ_SCHEMA",
    "RECORDS_DDL",
    "RECORD_SCHEMA",
    "RangeRead",
    "ReadSummary",
    "SUMMARY_SCHEMA",
    "map_read",
    "range_hash",
    "range_messages",
    "read_range",
    "read_summaries",
]

#: The rows of a ranges DataFrame (the input of :func:`map_read`): a range and its byte budget
#: (null: read exactly).
RANGES_DDL = "topic string, partition int, start bigint, end bigint, max_bytes bigint"

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

#: The rows :func:`map_read` gives: each range's records (``__summary`` false, the ``__``
#: columns null), then one summary row (``__summary`` true; ``topic``, ``partition``, the range
#: as read in ``__start``/``__end``, ``__count``, ``__hash``, and the largest record timestamp
#: in ``timestamp``; ``key``, ``value`` and ``offset`` null).
READ_DDL = (
    f"{RECORDS_DDL}, __summary boolean, __start bigint, __end bigint, __count bigint, __hash string"
)
#: :data:`READ_DDL` as Arrow: the schema of :func:`map_read`'s batches.
READ_SCHEMA = pa.schema(
    [
        *RECORD_SCHEMA,
        ("__summary", pa.bool_()),
        ("__start", pa.int64()),
        ("__end", pa.int64()),
        ("__count", pa.int64()),
        ("__hash", pa.string()),
    ]
)
#: The columns of :data:`READ_DDL` that a summary row fills (what :func:`read_summaries` reads).
SUMMARY_SCHEMA = pa.schema(
    [
        READ_SCHEMA.field(name)
        for name in (
            *("topic", "partition", "timestamp"),
            *("__summary", "__start", "__end", "__count", "__hash"),
        )
    ]
)

#: The most records in one Arrow batch of a read.
BATCH_RECORDS = 5000
#: The most key and value bytes in one Arrow batch of a read (unless one record is larger).
BATCH_BYTES = 64 << 20

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
class ReadSummary:
    """What reading one range gave but its records: the range as read (its ``end`` is where a
    byte budget cut the read, else the range's own end), the records' count and hash, and the
    largest record timestamp (None without one)."""

    range: PartitionRange
    count: int
    hash: str
    max_timestamp: int | None


@dataclass(frozen=True)
class RangeRead(ReadSummary):
    """A range read in process: its summary and its records (a table of RECORD_SCHEMA)."""

    records: pa.Table


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
    ended_below = -1  # the partition's end when last seen (below rng.end, else we returned)
    while True:
        # consume() blocks until it has num_messages or the timeout passed: ask for no more
        # than the offsets left, and wait briefly, longer only while nothing comes.
        want = max(1, min(BATCH_RECORDS, rng.end - (last + 1)))
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
                    ended_below = eof_at
                    continue
                if code in (KafkaError.OFFSET_OUT_OF_RANGE, KafkaError._AUTO_OFFSET_RESET):
                    raise _out_of_range(consumer, config, rng, f"{error.str()}")
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
            if ended_below >= 0:
                # Ranges end at most at an LSO, and a partition's LSO never goes down.
                raise InputRewoundError(
                    f"input {where} ends at offset {ended_below} now: topic {rng.topic} was "
                    "deleted and recreated (or truncated) since the range was taken; restore "
                    "the topic, or start over with a new --name and --state-dir"
                )
            raise KafkaUnavailableError(
                f"reading input {where} made no progress for {config.timeout_s:.0f}s "
                f"(at offset {last + 1}); check that the broker runs"
            )


def _out_of_range(
    consumer: Consumer, config: KafkaConfig, rng: PartitionRange, detail: str
) -> StreamIOError:
    """The error for a read whose start Kafka does not hold: below the log start, retention
    deleted it; past the log end, the topic was recreated or truncated."""
    where = f"{rng.topic}[{rng.partition}] {rng.span}"
    try:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(rng.topic, rng.partition), timeout=config.timeout_s
        )
    except KafkaException:
        low, high = -1, -1
    if high >= 0 and rng.start > high:
        return InputRewoundError(
            f"input {where} starts past the partition's end ({high}): topic {rng.topic} was "
            "deleted and recreated (or truncated) since the range was taken; restore the topic, "
            "or start over with a new --name and --state-dir"
        )
    return InputLostError(
        f"input {where} is no longer in Kafka (log start {low}, deleted by retention?): "
        f"{detail}; raise retention.ms of {rng.topic}"
    )


def range_messages(config: KafkaConfig, rng: PartitionRange) -> list[Message]:
    """The committed records of ``rng`` as confluent-kafka messages (with their headers), read
    like :func:`read_range`; for small ranges read in process (a step's output)."""
    if rng.is_empty:
        return []
    with _POOL.borrow(config) as consumer:
        return list(_consume(consumer, config, rng))


class _Read:
    """One range's read: :meth:`batches` gives the records; then :meth:`summary` what it gave."""

    def __init__(
        self, config: KafkaConfig, rng: PartitionRange, max_bytes: int | None, batch_bytes: int
    ) -> None:
        self.config = config
        self.rng = rng
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.end = rng.end
        self.count = 0
        self.max_timestamp: int | None = None
        self._hasher = _new_hasher()

    def batches(self) -> Iterator[pa.RecordBatch]:
        if self.rng.is_empty:
            return
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        offsets: list[int] = []
        stamps: list[int | None] = []
        taken = pending = 0
        with _POOL.borrow(self.config) as consumer:
            for msg in _consume(consumer, self.config, self.rng):
                offset: int = msg.offset()  # type: ignore[assignment]  # a record has one
                key, value = msg.key(), msg.value()
                size = (len(key) if key else 0) + (len(value) if value else 0)
                if self.max_bytes is not None and self.count and taken + size > self.max_bytes:
                    self.end = offset
                    break
                if offsets and (len(offsets) >= BATCH_RECORDS or pending + size > self.batch_bytes):
                    yield self._batch(keys, values, offsets, stamps)
                    keys, values, offsets, stamps = [], [], [], []
                    pending = 0
                ts_type, ts = msg.timestamp()
                stamp = None if ts_type == TIMESTAMP_NOT_AVAILABLE else ts
                _feed(self._hasher, offset, key, value)
                keys.append(key)
                values.append(value)
                offsets.append(offset)
                stamps.append(stamp)
                taken += size
                pending += size
                self.count += 1
                if stamp is not None and (self.max_timestamp is None or stamp > self.max_timestamp):
                    self.max_timestamp = stamp
        if offsets:
            yield self._batch(keys, values, offsets, stamps)

    def _batch(
        self,
        keys: list[bytes | None],
        values: list[bytes | None],
        offsets: list[int],
        stamps: list[int | None],
    ) -> pa.RecordBatch:
        n = len(offsets)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(keys, pa.binary()),
                pa.array(values, pa.binary()),
                pa.array([self.rng.topic] * n, pa.string()),
                pa.array([self.rng.partition] * n, pa.int32()),
                pa.array(offsets, pa.int64()),
                pa.array(stamps, pa.int64()),
            ],
            schema=RECORD_SCHEMA,
        )

    def summary(self) -> ReadSummary:
        """What the read gave; call after :meth:`batches` is exhausted."""
        rng = dataclasses.replace(self.rng, end=self.end)
        return ReadSummary(rng, self.count, self._hasher.hexdigest(), self.max_timestamp)


def read_range(
    config: KafkaConfig,
    rng: PartitionRange,
    max_bytes: int | None = None,
    *,
    batch_bytes: int = BATCH_BYTES,
) -> RangeRead:
    """Read the committed records of ``rng`` in process, all of them or up to ``max_bytes`` of
    keys and values (see the module docstring)."""
    read = _Read(config, rng, max_bytes, batch_bytes)
    records = pa.Table.from_batches(list(read.batches()), schema=RECORD_SCHEMA)
    summary = read.summary()
    return RangeRead(
        summary.range, summary.count, summary.hash, summary.max_timestamp, records=records
    )


def map_read(
    config: KafkaConfig, batch_bytes: int = BATCH_BYTES
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: rows of :data:`RANGES_DDL` in, rows of :data:`READ_DDL` out
    (each range's records, then its summary row)."""

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for row in batch.to_pylist():
                rng = PartitionRange(row["topic"], row["partition"], row["start"], row["end"])
                reader = _Read(config, rng, row["max_bytes"], batch_bytes)
                for records in reader.batches():
                    n = records.num_rows
                    nulls = pa.nulls(n)
                    yield pa.RecordBatch.from_arrays(
                        [
                            *records.columns,
                            pa.array([False] * n),
                            nulls.cast(pa.int64()),
                            nulls.cast(pa.int64()),
                            nulls.cast(pa.int64()),
                            nulls.cast(pa.string()),
                        ],
                        schema=READ_SCHEMA,
                    )
                got = reader.summary()
                yield pa.RecordBatch.from_pylist(
                    [
                        {
                            "topic": rng.topic,
                            "partition": rng.partition,
                            "timestamp": got.max_timestamp,
                            "__summary": True,
                            "__start": got.range.start,
                            "__end": got.range.end,
                            "__count": got.count,
                            "__hash": got.hash,
                        }
                    ],
                    schema=READ_SCHEMA,
                )

    return read


def read_summaries(rows: pa.Table) -> list[ReadSummary]:
    """The summary rows of :func:`map_read`'s output (others are skipped), sorted by range."""
    summaries = [
        ReadSummary(
            PartitionRange(row["topic"], row["partition"], row["__start"], row["__end"]),
            row["__count"],
            row["__hash"],
            row["timestamp"],
        )
        for row in rows.to_pylist()
        if row["__summary"]
    ]
    return sorted(summaries, key=lambda summary: summary.range)
