"""Each output record's partition: Kafka's murmur2, checked against Kafka's own test vectors, a
plain-Python reading of the algorithm, and the partitions librdkafka's ``murmur2_random`` picks
on a real broker."""

from __future__ import annotations

import numpy as np
import pytest
from confluent_kafka import Producer

from sparkstep.io.config import KafkaConfig
from sparkstep.io.partitioner import murmur2, record_partitions

from .fixtures import read_committed

# org.apache.kafka.common.utils.UtilsTest.testMurmur2 (signed 32-bit results).
KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def reference_murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2``, word by word, as unsigned 32 bits."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    whole = len(data) // 4
    for i in range(whole):
        k = (int.from_bytes(data[4 * i : 4 * i + 4], "little") * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[4 * whole :]
    if tail:
        for byte in reversed(range(len(tail))):
            h ^= tail[byte] << (8 * byte)
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def test_murmur2_gives_kafkas_own_test_vectors() -> None:
    found = murmur2(list(KAFKA_VECTORS)).astype(np.int64)
    signed = np.where(found >= 1 << 31, found - (1 << 32), found)
    assert signed.tolist() == list(KAFKA_VECTORS.values())


def test_murmur2_of_keys_of_every_length_is_the_definition() -> None:
    rng = np.random.default_rng(7)
    keys = [rng.integers(0, 256, n % 37, dtype=np.uint8).tobytes() for n in range(400)]
    assert murmur2(keys).tolist() == [reference_murmur2(k) for k in keys]
    assert murmur2([]).tolist() == []


def test_keyless_records_take_the_partitions_in_turn() -> None:
    keys = [None, b"a", None, None, b"a"]
    chosen = record_partitions(keys, 3).tolist()
    assert [chosen[0], chosen[2], chosen[3]] == [0, 1, 2]
    assert chosen[1] == chosen[4] == (reference_murmur2(b"a") & 0x7FFFFFFF) % 3
    with pytest.raises(ValueError, match="at least one partition"):
        record_partitions([b"a"], 0)


def test_record_partitions_are_where_the_producers_partitioner_puts_the_keys(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("parts", partitions=5)
    keys = [f"key-{i}".encode() * (i % 4 + 1) for i in range(300)]
    producer = Producer(kafka_config.producer())  # partitioner murmur2_random, as the writer's
    for key in keys:
        producer.produce(topic, value=b"v", key=key)
    assert producer.flush(30) == 0
    landed = {seen.key: seen.partition for seen in read_committed(bootstrap_servers, topic)}
    assert [landed[k] for k in keys] == record_partitions(keys, 5).tolist()
