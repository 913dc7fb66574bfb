"""The compose test's oracle: run inside the compose network (``kafka:9092``) with the image's
Python. Reads the input topic and the output topic (read_committed) to their ends, integrates
the output Z-set (weights added up per row) and checks it against keyed_sum computed from the
input: exactly one row per key, weight 1, the true sum and count. Prints one line; exit 1 on a
difference.

    python compose_check.py BOOTSTRAP INPUT_TOPIC OUTPUT_TOPIC
"""

from __future__ import annotations

import json
import sys
import uuid
from collections import Counter

from confluent_kafka import Consumer, TopicPartition


def read_all(bootstrap: str, topic: str) -> list[bytes]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex}",
         "isolation.level": "read_committed", "enable.auto.commit": False}
    )  # fmt: skip
    partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), 30)[1] for p in partitions}
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    values: list[bytes] = []

    def behind() -> bool:
        at = consumer.position([TopicPartition(topic, p) for p in partitions])
        return any(tp.offset < ends[tp.partition] for tp in at if ends[tp.partition] > 0)

    while behind():
        for msg in consumer.consume(10_000, 1.0):
            if msg.error() is None and msg.value() is not None:
                values.append(msg.value())
    consumer.close()
    return values


def main() -> int:
    bootstrap, input_topic, output_topic = sys.argv[1:4]
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for value in read_all(bootstrap, input_topic):
        doc = json.loads(value)
        sums[doc["key"]] += int(doc["value"])
        counts[doc["key"]] += 1
    weights: Counter[tuple[str, int, int]] = Counter()
    for value in read_all(bootstrap, output_topic):
        doc = json.loads(value)
        weights[(doc["key"], int(doc["sum"]), int(doc["count"]))] += int(doc["weight"])
    rows = {row: w for row, w in weights.items() if w != 0}
    got = {key: (s, c) for (key, s, c), w in rows.items() if w == 1}
    expected = {key: (sums[key], counts[key]) for key in counts}
    bad_weights = [row for row, w in rows.items() if w != 1]
    wrong = [k for k in expected if got.get(k) != expected[k]]
    extra = [k for k in got if k not in expected]
    records = sum(counts.values())
    if bad_weights or wrong or extra or len(got) != len(rows):
        print(
            f"NOT exactly once: {len(wrong)} keys wrong (e.g. {wrong[:3]}), {len(extra)} extra, "
            f"{len(bad_weights)} rows of weight other than 1, over {records} input records"
        )
        return 1
    print(f"exactly once: {len(expected)} keys, {records} input records, output integrated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
