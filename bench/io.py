"""Kafka I/O: range reading, the exactly-once writer, and the cost of one step transaction.

    .venv/bin/python -m bench.io [--bootstrap-servers HOST:PORT] [--records N] [--value-bytes B]

Without ``--bootstrap-servers`` a private local broker is started in a temporary directory (and
stopped at the end). In one run it measures, against baselines measured in the same run:

- range reading (:func:`sparkstep.io.ranges.read_range`: read_committed, exact ``[start, end)``,
  Arrow batch, hash) vs a plain confluent-kafka consumer reading the same records (assign +
  ``consume`` batches, keeping key and value);
- the output writer (:class:`sparkstep.io.output.OutputWriter`: JSON encoding, digest, one
  transaction per step with the step log record) vs a plain idempotent ``acks=all`` producer
  sending the same already-encoded records;
- the output digest of the same records: format 2 (numpy, what the writer logs) vs format 1
  (BLAKE2b per record, how a step logged before is replayed);
- the cost of one step transaction: a write of a one-record step (begin, produce, delivery
  reports, step log record, commit), median and p90 in ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from confluent_kafka import Consumer, Producer, TopicPartition

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import PartitionRange, StepTime
from sparkstep.io.encoding import encode_output, output_digest
from sparkstep.io.output import OutputOptions, OutputWriter, StepFacts
from sparkstep.io.ranges import _READER_SETTINGS, read_range
from sparkstep.io.steplog import RangeSummary
from sparkstep.io.topics import TopicAdmin


def _best(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    """(best seconds, records) of ``repeat`` runs of ``fn`` (which returns its record count)."""
    best = float("inf")
    count = 0
    for _ in range(repeat):
        start = time.perf_counter()
        count = fn()
        best = min(best, time.perf_counter() - start)
    return best, count


def _fill(bootstrap: str, topic: str, records: int, value_bytes: int) -> None:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
         "linger.ms": 20, "batch.size": 1_000_000}
    )  # fmt: skip
    payload = b"x" * max(0, value_bytes - 20)
    for i in range(records):
        while True:
            try:
                producer.produce(topic, key=b"k%d" % (i % 1000), value=b"%08d" % i + payload)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def _plain_read(bootstrap: str, topic: str, end: int) -> int:
    # The same librdkafka tuning as sparkstep's readers: the ratio is the cost of sparkstep.
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
         "enable.auto.commit": False, "isolation.level": "read_committed",
         **_READER_SETTINGS}
    )  # fmt: skip
    keys: list[bytes | None] = []
    values: list[bytes | None] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        last = -1
        while last < end - 1:
            for msg in consumer.consume(num_messages=5000, timeout=0.1):
                if msg.error() is None:
                    keys.append(msg.key())
                    values.append(msg.value())
                    last = msg.offset() or last
    finally:
        consumer.close()
    return len(values)


def _table(step: int, rows: int) -> pa.Table:
    return pa.table(
        {
            "key": [f"key-{step}-{i}" for i in range(rows)],
            "sum": pa.array([step * rows + i for i in range(rows)], pa.int64()),
            "count": pa.array([i % 7 for i in range(rows)], pa.int64()),
            "weight": pa.array([1 if i % 2 else -1 for i in range(rows)], pa.int64()),
        }
    )


def _facts(step: int) -> StepFacts:
    return StepFacts(
        epoch=0,
        time=StepTime(max_input_ts=step, wall=step),
        division=(RangeSummary("input", 0, step, step + 1, 1, "0" * 32),),
    )


def run(bootstrap: str, records: int, value_bytes: int, steps: int, step_rows: int) -> None:
    config = KafkaConfig(bootstrap, timeout_s=60)
    admin = TopicAdmin(config)
    name = f"bench{uuid.uuid4().hex[:8]}"
    topic = f"{name}-in"
    admin.ensure_topic(topic, 1)
    _fill(bootstrap, topic, records, value_bytes)
    end = admin.offsets([(topic, 0)], "stable")[(topic, 0)]

    # 1. Reading a range.
    read_range(config, PartitionRange(topic, 0, 0, min(end, 10)))  # warm the pooled consumer
    ours_s, ours_n = _best(lambda: read_range(config, PartitionRange(topic, 0, 0, end)).count, 3)
    plain_s, plain_n = _best(lambda: _plain_read(bootstrap, topic, end), 3)
    assert ours_n == plain_n == records, (ours_n, plain_n, records)

    # 2. The output writer vs a plain idempotent producer, same records.
    out = f"{name}-out"
    admin.ensure_topic(out, 2)
    tables = [_table(s, step_rows) for s in range(steps)]
    writer = OutputWriter(config, OutputOptions(name, "bench", out, ("key",)))
    writer.open()

    def write_all() -> int:
        first = writer.next_step
        for i, table in enumerate(tables):
            writer.write(first + i, table, [], _facts(first + i))
        return steps * step_rows

    writer_s, writer_n = _best(write_all, 2)
    encoded = [encode_output(t, ("key",)) for t in tables]

    def digests(digest_format: int) -> Callable[[], int]:
        def run() -> int:
            for batch in encoded:
                output_digest(batch, digest_format)
            return sum(len(batch) for batch in encoded)

        return run

    digest2_s, digest_n = _best(digests(2), 3)
    digest1_s, _ = _best(digests(1), 3)
    producer = Producer(config.producer(**{"linger.ms": 5}))

    header: list[tuple[str, str | bytes | None]] = [("sparkstep.step", b"1")]

    def plain_write() -> int:
        n = 0
        for batch in encoded:
            for record in batch:
                while True:
                    try:
                        producer.produce(out, key=record.key, value=record.value, headers=header)
                        break
                    except BufferError:
                        producer.poll(0.05)
                n += 1
            producer.flush(60)
        return n

    plain_w_s, plain_w_n = _best(plain_write, 2)

    # 3. One step transaction (a one-record step), many times.
    tiny = _table(0, 1)
    costs = []
    for _ in range(50):
        step = writer.next_step
        start = time.perf_counter()
        writer.write(step, tiny, [], _facts(step))
        costs.append((time.perf_counter() - start) * 1000)
    writer.close()
    costs.sort()

    rows = [
        ("range read (read_range)", ours_n / ours_s, f"{ours_n} records in {ours_s:.3f}s"),
        ("plain consumer", plain_n / plain_s, f"{plain_n} records in {plain_s:.3f}s"),
        ("output writer", writer_n / writer_s, f"{steps} steps x {step_rows}, {writer_s:.3f}s"),
        ("plain idempotent producer", plain_w_n / plain_w_s, f"same records, {plain_w_s:.3f}s"),
        ("output digest, format 2", digest_n / digest2_s, f"same records, {digest2_s:.3f}s"),
        ("output digest, format 1", digest_n / digest1_s, f"same records, {digest1_s:.3f}s"),
    ]  # fmt: skip
    print(f"{'what':<28} {'records/s':>12}  detail")
    for what, rate, detail in rows:
        print(f"{what:<28} {rate:>12,.0f}  {detail}")
    print()
    read_ratio = (ours_n / ours_s) / (plain_n / plain_s)
    write_ratio = (writer_n / writer_s) / (plain_w_n / plain_w_s)
    print(f"range read / plain consumer:        {read_ratio:.2f}x")
    print(f"output writer / plain producer:     {write_ratio:.2f}x")
    print(f"output digest format 2 / format 1:  {digest1_s / digest2_s:.2f}x")
    print(
        f"one step transaction (1 record):    median {statistics.median(costs):.1f} ms, "
        f"p90 {costs[int(len(costs) * 0.9)]:.1f} ms, min {costs[0]:.1f} ms (n={len(costs)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-rows", type=int, default=10_000)
    args = parser.parse_args()
    if args.bootstrap_servers:
        run(args.bootstrap_servers, args.records, args.value_bytes, args.steps, args.step_rows)
        return
    from sparkstep.io.broker import LocalBroker, default_cache_dir, find_free_port, install_kafka

    with tempfile.TemporaryDirectory(prefix="sparkstep-bench-io-") as tmp:
        libs = install_kafka(default_cache_dir())
        broker = LocalBroker(Path(tmp) / "kafka", find_free_port(), libs)
        broker.start()
        try:
            run(broker.bootstrap_servers, args.records, args.value_bytes, args.steps,
                args.step_rows)  # fmt: skip
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
