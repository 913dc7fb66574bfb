"""Reading offset ranges: exact, repeatable, read_committed, never hanging on markers."""

from __future__ import annotations

import itertools
import pickle

import pyarrow as pa
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import PartitionRange
from sparkstep.io.errors import InputLostError, KafkaUnavailableError
from sparkstep.io.ranges import (
    RANGES_DDL,
    RECORD_SCHEMA,
    RECORDS_DDL,
    SUMMARIES_DDL,
    map_range_summaries,
    map_ranges,
    range_hash,
    read_range,
)
from sparkstep.io.steplog import RangeSummary, summaries_from_arrow
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
    joined = pa.Table.from_batches([p.records for p in reversed(pieces)])
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


def test_map_functions_run_in_spark_executors(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig, spark
) -> None:
    topic = topic_factory("in", partitions=2)
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"p0-%d" % i for i in range(7)], partition=0)
    txn.batch([b"p1-%d" % i for i in range(5)], partition=1)
    txn.batch([b"dead"], commit=False, partition=1)
    ends = [high_watermark(bootstrap_servers, topic, p) for p in (0, 1)]
    config = pickle.loads(pickle.dumps(kafka_config))
    rows = [(topic, 0, 0, ends[0]), (topic, 1, 0, ends[1])]
    ranges = spark.createDataFrame(rows, RANGES_DDL).repartition(2)
    records = ranges.mapInArrow(map_ranges(config), RECORDS_DDL).collect()
    assert sorted(r["value"] for r in records) == sorted(
        [b"p0-%d" % i for i in range(7)] + [b"p1-%d" % i for i in range(5)]
    )
    summary_table = ranges.mapInArrow(map_range_summaries(config), SUMMARIES_DDL).toArrow()
    summaries, max_ts = summaries_from_arrow(summary_table)
    locals_ = [
        read_range(kafka_config, PartitionRange(topic, partition, 0, end))
        for partition, end in enumerate(ends)
    ]
    assert summaries == tuple(RangeSummary.from_read(read) for read in locals_)
    assert max_ts == max(read.max_timestamp or 0 for read in locals_)
