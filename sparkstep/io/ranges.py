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

import bisect
import dataclasses
import gc
import hashlib
import operator
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
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
#: :data:`_HEAD` as a numpy record, to pack the heads of many records at once.
_HEAD_DTYPE = np.dtype([("offset", ">i8"), ("key", ">i4"), ("value", ">i4")])
#: A block of records as :class:`_Read` takes it: :data:`RECORD_SCHEMA` with 64-bit offsets
#: for the keys and values, so a block is never refused for its size (it holds what one
#: ``consume()`` gave, which no batch bound limits).
_BLOCK_SCHEMA = pa.schema(
    [
        pa.field(f.name, pa.large_binary()) if f.name in ("key", "value") else f
        for f in RECORD_SCHEMA
    ]
)


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


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (and back on after it if it was on).

    A consumed block is thousands of :class:`~confluent_kafka.Message` objects, which the
    collector tracks, alive at once: each block set off several young collections and moved
    its messages into the older generations, whose collections then walk every object of the
    process (pyarrow's and pandas' modules included). Measured: a third of a 200k-record range
    read's CPU (0.33 s against 0.21 s with the collector off). The block holds no reference
    cycle (its messages are freed by reference counting when it is dropped), so pausing the
    collector around it frees the same memory. Never held across a ``yield``: the code
    between two batches runs with the collector as it found it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _consume_blocks(
    consumer: Consumer, config: KafkaConfig, rng: PartitionRange
) -> Iterator[tuple[list[Message], list[int]]]:
    """Yield the records of ``rng`` in offset order, a block at a time (the records one
    ``consume()`` call gave, with their offsets); see the stop rules in the module docstring."""
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
        plain = _plain_records(batch, rng, last)
        if plain is not None:
            block, offsets, done = plain
            last = offsets[-1] if offsets else last
        else:  # message by message
            block, offsets, done = [], [], False
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
                        raise MissingTopicError(
                            f"input topic of {where} does not exist: {error.str()}"
                        )
                    if error.fatal():
                        raise RangeReadError(f"reading input {where} failed: {error.str()}")
                    continue  # transient: librdkafka retries by itself
                offset = msg.offset()
                # Below the start or seen (last >= start - 1): a duplicate, or a message fetched
                # for an earlier assignment of this consumer, as is one of another partition.
                if offset is None or offset <= last:
                    continue
                if msg.topic() != rng.topic or msg.partition() != rng.partition:
                    continue
                if offset >= rng.end:
                    done = True
                    break
                last = offset
                block.append(msg)
                offsets.append(offset)
                if offset == rng.end - 1:
                    done = True
                    break
        if block:
            progress_at = time.monotonic()
            yield block, offsets
        if done or eof_at >= rng.end:
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


def _plain_records(
    batch: list[Message], rng: PartitionRange, last: int
) -> tuple[list[Message], list[int], bool] | None:
    """:func:`_consume_blocks`' fast path, for a batch of records only (no error or event), all
    of ``rng``'s partition, in strictly increasing offsets: its records after ``last`` and
    below ``rng.end``, their offsets, and whether the range is done (a record at or past its
    end came, or its last offset). None for any other batch, which is taken message by
    message. The per-message calls run in C (``map`` of the method)."""
    if any(error is not None for error in map(Message.error, batch)):
        return None
    found: list[int | None] = list(map(Message.offset, batch))
    if None in found:
        return None
    offsets = cast(list[int], found)
    if (
        set(map(Message.topic, batch)) != {rng.topic}
        or set(map(Message.partition, batch)) != {rng.partition}
        or not all(map(operator.lt, offsets, offsets[1:]))
    ):
        return None
    low = bisect.bisect_right(offsets, last)
    high = bisect.bisect_left(offsets, rng.end)
    taken = offsets[low:high]
    done = high < len(offsets) or (bool(taken) and taken[-1] == rng.end - 1)
    return batch[low:high], taken, done


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
        return [msg for block, _ in _consume_blocks(consumer, config, rng) for msg in block]


class _Read:
    """One range's read: :meth:`batches` gives the records; then :meth:`summary` what it gave.

    Block by block (the records of one ``consume()`` call): each field of the block's records is
    taken with one ``map`` of its ``Message`` method (the calls run in C), and the byte
    budget's cut, the hash and the batches are computed over the block's Arrow columns, so no
    Python runs per record. The hash is of the same bytes :func:`range_hash` feeds it, a block
    at a time.
    """

    def __init__(
        self, config: KafkaConfig, rng: PartitionRange, max_bytes: int | None, batch_bytes: int
    ) -> None:
        self.config = config
        self.rng = rng
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self.end = rng.end
        self.count = 0
        self.taken = 0  # key and value bytes read
        self.max_timestamp: int | None = None
        self._hasher = _new_hasher()

    def batches(self) -> Iterator[pa.RecordBatch]:
        if self.rng.is_empty:
            return
        batcher = _Batcher(self.batch_bytes)
        with _POOL.borrow(self.config) as consumer:
            blocks = _consume_blocks(consumer, self.config, self.rng)
            while True:
                with _collector_paused():
                    consumed = next(blocks, None)
                    if consumed is None:
                        break
                    messages, offsets = consumed
                    block = self._block(messages, offsets)
                    del consumed, messages  # before the collector runs again
                keys = pc.fill_null(pc.binary_length(block.column("key")), -1).to_numpy()
                values = pc.fill_null(pc.binary_length(block.column("value")), -1).to_numpy()
                sizes = np.maximum(keys, 0).astype(np.int64) + np.maximum(values, 0)
                cut = self._cut(sizes)
                if cut is not None:
                    self.end = offsets[cut]
                    block, keys, values, sizes = (
                        block.slice(0, cut),
                        keys[:cut],
                        values[:cut],
                        sizes[:cut],
                    )
                self._take(block, keys, values, sizes)
                yield from batcher.add(block, sizes)
                if cut is not None:
                    break
        yield from batcher.rest()

    def _block(self, messages: list[Message], offsets: list[int]) -> pa.RecordBatch:
        """The records of ``messages`` as a batch of :data:`_BLOCK_SCHEMA`."""
        n = len(messages)
        times = list(map(Message.timestamp, messages))
        return pa.RecordBatch.from_arrays(
            [
                pa.array(list(map(Message.key, messages)), pa.large_binary()),
                pa.array(list(map(Message.value, messages)), pa.large_binary()),
                pa.repeat(pa.scalar(self.rng.topic, pa.string()), n),
                pa.repeat(pa.scalar(self.rng.partition, pa.int32()), n),
                pa.array(offsets, pa.int64()),
                pa.array(
                    [None if kind == TIMESTAMP_NOT_AVAILABLE else ts for kind, ts in times],
                    pa.int64(),
                ),
            ],
            schema=_BLOCK_SCHEMA,
        )

    def _cut(self, sizes: npt.NDArray[np.int64]) -> int | None:
        """Where the byte budget cuts a block of records of ``sizes`` (None: it takes them all):
        before the first record that would take the bytes read past the budget, but never
        before the range's first record."""
        if self.max_bytes is None:
            return None
        over = np.flatnonzero(self.taken + np.cumsum(sizes) > self.max_bytes)
        if over.size == 0:
            return None
        first = int(over[0])
        if first == 0 and self.count == 0:
            # The range's first record is read, whatever its size; the running sum only grows,
            # so the record after it is over the budget too.
            return 1 if sizes.size > 1 else None
        return first

    def _take(
        self,
        block: pa.RecordBatch,
        keys: npt.NDArray[np.int32],
        values: npt.NDArray[np.int32],
        sizes: npt.NDArray[np.int64],
    ) -> None:
        """Count ``block``, hash it and note its largest timestamp; ``keys`` and ``values``
        are the lengths of its keys and values (-1 for null)."""
        n = block.num_rows
        if n == 0:
            return
        head = np.empty(n, _HEAD_DTYPE)
        head["offset"] = block.column("offset").to_numpy()
        head["key"] = keys
        head["value"] = values
        heads = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(_HEAD.size), n, [None, pa.py_buffer(head)]
        )
        nothing = pa.scalar(b"", pa.large_binary())
        stream = pc.binary_join_element_wise(
            heads.cast(pa.large_binary()),
            pc.fill_null(block.column("key"), nothing),
            pc.fill_null(block.column("value"), nothing),
            nothing,
        )
        taken = int(sizes.sum())
        self._hasher.update(stream.buffers()[2][: _HEAD.size * n + taken])
        self.count += n
        self.taken += taken
        stamp = pc.max(block.column("timestamp")).as_py()
        if stamp is not None and (self.max_timestamp is None or stamp > self.max_timestamp):
            self.max_timestamp = stamp

    def summary(self) -> ReadSummary:
        """What the read gave; call after :meth:`batches` is exhausted."""
        rng = dataclasses.replace(self.rng, end=self.end)
        return ReadSummary(rng, self.count, self._hasher.hexdigest(), self.max_timestamp)


class _Batcher:
    """Cuts a read's records into Arrow batches, greedily: a batch takes the records in order
    while it holds fewer than :data:`BATCH_RECORDS` and their key and value bytes stay within
    ``batch_bytes``; a record larger than that is a batch of its own."""

    def __init__(self, batch_bytes: int) -> None:
        self.batch_bytes = batch_bytes
        self._held: list[pa.RecordBatch] = []  # the batch being filled, in pieces
        self._rows = 0
        self._bytes = 0

    def add(self, block: pa.RecordBatch, sizes: npt.NDArray[np.int64]) -> Iterator[pa.RecordBatch]:
        """The batches ``block`` (records of ``sizes`` bytes) completes; the rest is held."""
        ends = np.cumsum(sizes)
        i, n = 0, len(sizes)
        while i < n:
            before = int(ends[i - 1]) if i else 0
            fit = int(np.searchsorted(ends, before + self.batch_bytes - self._bytes, "right"))
            j = min(fit, i + BATCH_RECORDS - self._rows)
            if j == i:  # the next record does not fit
                if self._rows:
                    yield self._close()
                    continue
                j = i + 1  # larger than a batch: alone
            self._held.append(block.slice(i, j - i))
            self._rows += j - i
            self._bytes += int(ends[j - 1]) - before
            i = j
            if i < n:  # the batch is full, or the next record does not fit
                yield self._close()

    def rest(self) -> Iterator[pa.RecordBatch]:
        """The last batch, if any records are held."""
        if self._rows:
            yield self._close()

    def _close(self) -> pa.RecordBatch:
        """The held records as one batch of :data:`RECORD_SCHEMA` (whose ``binary`` keys and
        values the batch's bound keeps far below 2 GiB)."""
        held = self._held
        self._held, self._rows, self._bytes = [], 0, 0
        if len(held) > 1:
            held = pa.Table.from_batches(held).combine_chunks().to_batches()
        return held[0].cast(RECORD_SCHEMA)


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
