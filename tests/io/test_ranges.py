"""Reading offset ranges: exact, repeatable, read_committed, never hanging on markers."""

from __future__ import annotations

import itertools
import pickle

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import PartitionRange
from sparkstep.io.errors import InputLostError, KafkaUnavailableError
from sparkstep.io.ranges import (
    BATCH_RECORDS,
    RANGES_DDL,
    READ_DDL,
    RECORD_SCHEMA,
    ReadSummary,
    map_read,
    range_hash,
    read_range,
    read_summaries,
)
from sparkstep.io.topics import TopicAdmin

from .fixtures import TxnInput, high_watermark, read_committed


def _interleaved(bootstrap: str, topic: str) -> dict[str, tuple[int, int]]:
    """Committed and aborted transactions; returns named offset landmarks."""
    txn = TxnInput(bootstrap, topic)
    marks: dict[str, tuple[int, int]] = {}
    txn.batch([b"c1-%d" % i for i in range(5)])  # 0..4, marker 5
    txn.batch([b"a1-%d" % i for i in range(3)], commit=False)  # 6..8, marker 9
    txn.batch([b"c2-%d" % i for i in range(4)])  # 10..13, marker 14
    txn.batch([b"a2-%d" % i for i in range(2)], commit=False)  # 15..16, marker 17
    txn.batch([b"c3-%d" % i for i in range(3)])  # 18..20, marker 21
    marks["first_marker"] = (5, 6)
    marks["aborted_batch"] = (6, 9)
    marks["aborted_and_marker"] = (6, 10)
    marks["end"] = (0, high_watermark(bootstrap, topic))
    return marks


def test_repeated_reads_are_identical_with_aborted_transactions(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in")
    marks = _interleaved(bootstrap_servers, topic)
    start, end = marks["end"]
    assert end == 22
    expected = [s for s in read_committed(bootstrap_servers, topic)]
    whole = read_range(kafka_config, PartitionRange(topic, 0, start, end))
    assert whole.count == 12
    values = whole.records.column("value").to_pylist()
    assert values == [s.value for s in expected]
    assert all(not v.startswith(b"a") for v in values)
    assert whole.records.column("offset").to_pylist() == [s.offset for s in expected]
    assert whole.records.schema == RECORD_SCHEMA
    assert whole.hash == range_hash((s.offset, s.key, s.value) for s in expected)
    # Repeated reads, and reads of pieces in another order, give the same records each time.
    for _ in range(3):
        again = read_range(kafka_config, PartitionRange(topic, 0, start, end))
        assert again.records.equals(whole.records)
        assert again.hash == whole.hash
    cuts = [0, 3, 7, 12, 16, 19, 22]
    pieces = [
        read_range(kafka_config, PartitionRange(topic, 0, a, b))
        for a, b in reversed(list(itertools.pairwise(cuts)))
    ]
    joined = pa.concat_tables([p.records for p in reversed(pieces)])
    assert joined.column("offset").to_pylist() == whole.records.column("offset").to_pylist()
    assert sum(p.count for p in pieces) == whole.count


@pytest.mark.parametrize("mark", ["first_marker", "aborted_batch", "aborted_and_marker"])
def test_range_ending_on_marker_or_aborted_batch_returns(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig, mark: str
) -> None:
    topic = topic_factory("in")
    marks = _interleaved(bootstrap_servers, topic)
    start, end = marks[mark]
    read = read_range(kafka_config, PartitionRange(topic, 0, start, end))
    assert read.count == 0
    assert read.max_timestamp is None
    # And a range that ends on a marker right after committed records.
    read = read_range(kafka_config, PartitionRange(topic, 0, 0, 6))
    assert read.count == 5


def test_range_ending_at_the_log_end_on_a_marker(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in")
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"x1", b"x2"])
    txn.batch([b"y1"], commit=False)
    end = high_watermark(bootstrap_servers, topic)
    read = read_range(kafka_config, PartitionRange(topic, 0, 0, end))
    assert read.records.column("value").to_pylist() == [b"x1", b"x2"]
    read = read_range(kafka_config, PartitionRange(topic, 0, 3, end))
    assert read.count == 0


def test_deleted_input_is_an_error_not_a_jump(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in")
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"v%d" % i for i in range(6)])
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    futures = admin.delete_records([TopicPartition(topic, 0, 4)])
    for future in futures.values():
        future.result(timeout=30)
    with pytest.raises(InputLostError, match=topic):
        read_range(kafka_config, PartitionRange(topic, 0, 0, 6))
    assert read_range(kafka_config, PartitionRange(topic, 0, 4, 6)).count == 2


def test_unreachable_broker_fails_in_bounded_time() -> None:
    from sparkstep.io.broker import find_free_port

    config = KafkaConfig(f"127.0.0.1:{find_free_port()}", timeout_s=2.0)
    with pytest.raises(KafkaUnavailableError):
        read_range(config, PartitionRange("nowhere", 0, 0, 10))
    with pytest.raises(KafkaUnavailableError):
        TopicAdmin(config).wait_until_reachable()


def test_many_blocks_of_null_and_empty_keys_and_values_read_and_hash_record_by_record(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    """The read takes records a ``consume()`` block at a time; the records, the hash, the
    batches and a budget's cut are those a record-by-record read gives."""
    from confluent_kafka import Producer

    topic = topic_factory("in")
    producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 5})
    shapes = [(None, b"v"), (b"", b"v"), (b"k", None), (b"k", b""), (None, None), (b"kk", b"vvv")]
    for i in range(3 * BATCH_RECORDS + 7):
        key, value = shapes[i % len(shapes)]
        producer.produce(topic, value=value, key=key and key + b"%d" % i, partition=0)
    producer.flush(30)
    end = high_watermark(bootstrap_servers, topic)
    seen = read_committed(bootstrap_servers, topic)
    # A tombstone (None) and an empty value both read back as b"" there; the read keeps them
    # apart.
    values = [shapes[i % len(shapes)][1] for i in range(end)]
    records = [(s.offset, s.key, v) for s, v in zip(seen, values, strict=True)]

    whole = read_range(kafka_config, PartitionRange(topic, 0, 0, end))
    assert whole.count == end
    assert whole.hash == range_hash(records)
    assert whole.records.column("key").to_pylist() == [key for _, key, _ in records]
    assert whole.records.column("value").to_pylist() == values
    assert all(b.num_rows <= BATCH_RECORDS for b in whole.records.to_batches())

    # A budget that ends inside the second block cuts where a running sum of the records'
    # key and value bytes first passes it.
    sizes = [len(key or b"") + len(value or b"") for _, key, value in records]
    budget = sum(sizes[: BATCH_RECORDS + 100]) + 1
    cut = read_range(kafka_config, PartitionRange(topic, 0, 0, end), max_bytes=budget)
    taken = next(i for i, total in enumerate(itertools.accumulate(sizes)) if total > budget)
    assert (cut.count, cut.range.end) == (taken, records[taken][0])
    assert cut.hash == range_hash(records[:taken])


def test_the_collector_is_paused_while_a_block_is_built_and_restored_after(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig, monkeypatch
) -> None:
    """Python's cyclic collector is off while a consumed block of messages is turned into Arrow
    (the messages are what it tracked), and as it was after the read: on, off, or after a
    failure inside a block."""
    import gc

    from sparkstep.io import ranges

    topic = topic_factory("in")
    TxnInput(bootstrap_servers, topic).batch([b"v%d" % i for i in range(50)])
    rng = PartitionRange(topic, 0, 0, high_watermark(bootstrap_servers, topic))
    built = ranges._Read._block
    seen: list[bool] = []

    def block(self, messages, offsets):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("injected")
        return built(self, messages, offsets)

    monkeypatch.setattr(ranges._Read, "_block", block)
    fail = False
    assert gc.isenabled()
    assert read_range(kafka_config, rng).count == 50
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        assert read_range(kafka_config, rng).count == 50
        assert not gc.isenabled()
    finally:
        gc.enable()
    fail = True
    with pytest.raises(RuntimeError, match="injected"):
        read_range(kafka_config, rng)
    assert gc.isenabled()


def _bytes(batch: pa.RecordBatch | pa.Table) -> int:
    """The key and value bytes of ``batch``."""
    return sum(
        len(item or b"") for column in ("key", "value") for item in batch.column(column).to_pylist()
    )


def test_arrow_batches_are_bounded_in_bytes(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in")
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"%04d" % i + b"x" * 36 for i in range(10)])  # 40 + a 4-byte key: 44 each
    txn.batch([b"huge" + b"y" * 496])  # 500 + 4: larger than a batch may be
    txn.batch([b"%04d" % i + b"z" * 36 for i in range(3)])
    end = high_watermark(bootstrap_servers, topic)
    whole = read_range(kafka_config, PartitionRange(topic, 0, 0, end))
    small = read_range(kafka_config, PartitionRange(topic, 0, 0, end), batch_bytes=100)
    assert small.records.equals(whole.records)
    assert (small.count, small.hash, small.range) == (whole.count, whole.hash, whole.range)
    batches = small.records.to_batches()
    assert [b.num_rows for b in batches] == [2, 2, 2, 2, 2, 1, 2, 1]
    assert all(_bytes(b) <= 100 or b.num_rows == 1 for b in batches)


def test_a_byte_budget_cuts_the_range_before_the_record_that_would_pass_it(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in")
    marks = _interleaved(bootstrap_servers, topic)  # committed records of 8 bytes each
    _, end = marks["end"]
    whole = read_range(kafka_config, PartitionRange(topic, 0, 0, end))
    first = read_range(kafka_config, PartitionRange(topic, 0, 0, end), max_bytes=20)
    assert first.range == PartitionRange(topic, 0, 0, 2)
    assert first.count == 2 and _bytes(first.records) == 16
    # Five records fill 40 bytes exactly; the cut is at the next committed record, past the
    # aborted transaction and the markers.
    cut = read_range(kafka_config, PartitionRange(topic, 0, 0, end), max_bytes=40)
    assert cut.range.end == 10 and cut.count == 5
    again = read_range(kafka_config, PartitionRange(topic, 0, 0, end), max_bytes=40)
    assert (again.range, again.hash) == (cut.range, cut.hash)
    # Reading on from each cut covers the whole range, each piece within its budget.
    pieces = []
    start = 0
    while start < end:
        piece = read_range(kafka_config, PartitionRange(topic, 0, start, end), max_bytes=20)
        assert piece.range.end > start and _bytes(piece.records) <= 20
        pieces.append(piece)
        start = piece.range.end
    assert pa.concat_tables([p.records for p in pieces]).equals(whole.records)
    # A record larger than the budget is read alone, never stuck.
    big = topic_factory("big")
    TxnInput(bootstrap_servers, big).batch([b"x" * 100, b"y" * 100])
    alone = read_range(kafka_config, PartitionRange(big, 0, 0, 3), max_bytes=10)
    assert (alone.range.end, alone.count) == (1, 1)


def test_map_read_runs_in_spark_executors_and_cuts_like_read_range(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig, spark
) -> None:
    topic = topic_factory("in", partitions=2)
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"p0-%d" % i for i in range(7)], partition=0)
    txn.batch([b"p1-%d" % i for i in range(5)], partition=1)
    txn.batch([b"dead"], commit=False, partition=1)
    ends = [high_watermark(bootstrap_servers, topic, p) for p in (0, 1)]
    config = pickle.loads(pickle.dumps(kafka_config))
    # Partition 0 within 20 bytes (records of 8 bytes: two of them), partition 1 exactly.
    budgets = [20, None]
    rows = [(topic, p, 0, ends[p], budgets[p]) for p in (0, 1)]
    ranges = spark.createDataFrame(rows, RANGES_DDL).repartition(2)
    read = ranges.mapInArrow(map_read(config), READ_DDL).toArrow()
    records = read.filter(pc.invert(read.column("__summary")))
    assert sorted(records.column("value").to_pylist()) == sorted(
        [b"p0-0", b"p0-1"] + [b"p1-%d" % i for i in range(5)]
    )
    locals_ = [
        read_range(kafka_config, PartitionRange(topic, p, 0, ends[p]), budgets[p]) for p in (0, 1)
    ]
    assert read_summaries(read) == [
        ReadSummary(local.range, local.count, local.hash, local.max_timestamp) for local in locals_
    ]
    assert [local.range.end for local in locals_] == [2, ends[1]]
