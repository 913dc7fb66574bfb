"""Helpers of the Kafka tests: transactional input, independent read_committed reading.

Verification reads with a plain confluent-kafka consumer, not with sparkstep's reader, so a bug
in the reader cannot hide a bug in the writer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import Consumer, IsolationLevel, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec


@dataclass(frozen=True)
class Seen:
    """One record as a read_committed consumer saw it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes  # b"" for a null value
    headers: tuple[tuple[str, bytes], ...]


class TxnInput:
    """Writes input in committed and aborted transactions (and leaves some open)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "transactional.id": f"test-input-{uuid.uuid4().hex}",
                "linger.ms": 1,
            }
        )
        self.producer.init_transactions(30)

    def batch(
        self, values: list[bytes], commit: bool = True, partition: int = 0, keep_open: bool = False
    ) -> None:
        self.producer.begin_transaction()
        for value in values:
            self.producer.produce(self.topic, value=value, key=value[:4], partition=partition)
        self.producer.flush(30)
        if keep_open:
            return
        if commit:
            self.producer.commit_transaction(30)
        else:
            self.producer.abort_transaction(30)

    def finish(self, commit: bool = True) -> None:
        if commit:
            self.producer.commit_transaction(30)
        else:
            self.producer.abort_transaction(30)


def high_watermark(bootstrap: str, topic: str, partition: int = 0) -> int:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "test-watermarks",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
        return int(high)
    finally:
        consumer.close()


def read_committed(bootstrap: str, topic: str, timeout: float = 60.0) -> list[Seen]:
    """Every committed record of ``topic`` (all partitions), up to each partition's LSO."""
    return read_committed_many(bootstrap, [topic], timeout)[topic]


def _settle(admin: AdminClient, partitions: list[TopicPartition], timeout: float = 5.0) -> None:
    """Wait (bounded) until no partition has a transaction in flight: a commit returns before
    its markers are written, and a read_committed reader stops at the LSO it sees. A
    transaction a test leaves open on purpose just costs the timeout."""
    latest_spec: OffsetSpec = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    requests = {TopicPartition(tp.topic, tp.partition): latest_spec for tp in partitions}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stable = admin.list_offsets(requests, isolation_level=IsolationLevel.READ_COMMITTED)
        latest = admin.list_offsets(requests, isolation_level=IsolationLevel.READ_UNCOMMITTED)
        if all(
            stable[tp].result(timeout=30).offset == latest[tp].result(timeout=30).offset
            for tp in requests
        ):
            return
        time.sleep(0.1)


def read_committed_many(
    bootstrap: str, topics: list[str], timeout: float = 60.0
) -> dict[str, list[Seen]]:
    """Every committed record of each topic, read with one consumer."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    metadata = admin.list_topics(timeout=30).topics
    assignment = [
        TopicPartition(topic, p, 0) for topic in topics for p in sorted(metadata[topic].partitions)
    ]
    _settle(admin, assignment)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-reader-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 10,
        }
    )
    seen: dict[str, list[Seen]] = {topic: [] for topic in topics}
    try:
        consumer.assign(assignment)
        done: set[tuple[str, int]] = set()
        deadline = time.monotonic() + timeout
        while len(done) < len(assignment):
            assert time.monotonic() < deadline, f"reading {topics} did not reach the end"
            msg = consumer.poll(0.1)
            if msg is None:
                continue
            error = msg.error()
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            assert topic is not None and partition is not None
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    done.add((topic, partition))
                    continue
                raise AssertionError(error.str())
            assert offset is not None
            done.discard((topic, partition))
            headers: list[tuple[str, bytes]] = list(msg.headers() or [])  # type: ignore[arg-type]
            seen[topic].append(
                Seen(
                    topic,
                    partition,
                    offset,
                    msg.key(),
                    msg.value() or b"",
                    tuple(headers),
                )
            )
    finally:
        consumer.close()
    for records in seen.values():
        records.sort(key=lambda r: (r.partition, r.offset))
    return seen


# -- deterministic step output, shared by the tests and the writer child process -------------


def step_rows(step: int, rows: int = 4) -> list[tuple[str, int, int]]:
    """The output rows (key, sum, weight) of ``step``."""
    return [(f"k{step}-{i}", step * 100 + i, 1 if i % 3 else -1) for i in range(rows)]


def step_table(step: int, rows: int = 4, shuffle: bool = False):
    import random

    import pyarrow as pa

    items = step_rows(step, rows)
    if shuffle:
        random.Random().shuffle(items)
    return pa.table(
        {
            "key": [k for k, _, _ in items],
            "sum": pa.array([s for _, s, _ in items], pa.int64()),
            "weight": pa.array([w for _, _, w in items], pa.int64()),
        }
    )


def step_facts(step: int):
    from sparkstep.io.division import StepTime
    from sparkstep.io.output import StepFacts
    from sparkstep.io.steplog import RangeSummary

    return StepFacts(
        epoch=0,
        time=StepTime(max_input_ts=10_000 + step, wall=20_000 + step),
        division=(RangeSummary("input", 0, step * 10, step * 10 + 10, 10, f"hash{step}"),),
        state_digests={"0": f"state{step}"},
    )


def step_letters(step: int):
    from sparkstep.io.deadletter import DeadLetter

    return [DeadLetter("input", 0, step * 10 + 9, b"k", b"not json %d" % step, "bad JSON")]
