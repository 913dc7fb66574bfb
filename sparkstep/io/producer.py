"""The users' side: producing input with ``acks=all`` and idempotence, and saying what was recorded.

sparkstep's exactly once starts at the input log: a record counts as input once Kafka has
acknowledged it to all in-sync replicas. :class:`InputProducer` sends records with ``acks=all``
and ``enable.idempotence=true`` (no duplicates from retries, order kept per partition) and
counts delivery reports, so :meth:`InputProducer.flush` returns a :class:`ProduceReport` of what
Kafka really recorded, per partition, and of what failed. ``sparkstep produce`` uses
:func:`produce_json_lines`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from sparkstep.io.config import KafkaConfig, translate_kafka_error
from sparkstep.io.errors import KafkaUnavailableError, StreamIOError
from sparkstep.io.topics import TopicAdmin

__all__ = ["InputProducer", "ProduceReport", "produce_json_lines"]


@dataclass
class ProduceReport:
    """What Kafka acknowledged: counts per ``(topic, partition)``, and the failures."""

    recorded: int = 0
    failed: int = 0
    by_partition: dict[tuple[str, int], int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for people: ``recorded 10 records (t[0]: 6, t[1]: 4)``."""
        parts = ", ".join(f"{t}[{p}]: {n}" for (t, p), n in sorted(self.by_partition.items()))
        text = f"recorded {self.recorded} records" + (f" ({parts})" if parts else "")
        if self.failed:
            text += f"; {self.failed} FAILED (first error: {self.errors[0]})"
        return text


class InputProducer:
    """An ``acks=all``, idempotent producer that reports what was recorded."""

    def __init__(self, config: KafkaConfig, topic: str, check_topic: bool = True) -> None:
        self.config = config
        self.topic = topic
        if check_topic:
            admin = TopicAdmin(config)
            admin.wait_until_reachable()
            admin.partitions(topic)  # MissingTopicError, clearly, before any send
        self._producer = Producer(config.producer())
        self._report = ProduceReport()
        self._pending = 0

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        self._pending -= 1
        if err is not None:
            self._report.failed += 1
            if len(self._report.errors) < 5:
                self._report.errors.append(err.str())
            return
        topic, partition = msg.topic(), msg.partition()
        key = (topic or self.topic, partition if partition is not None else -1)
        self._report.recorded += 1
        self._report.by_partition[key] = self._report.by_partition.get(key, 0) + 1

    def send(self, value: bytes | None, key: bytes | None = None) -> None:
        """Queue one record (waiting while the local queue is full)."""
        while True:
            try:
                self._producer.produce(
                    self.topic, value=value, key=key, on_delivery=self._delivered
                )
                self._pending += 1
                break
            except BufferError:
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise translate_kafka_error(exc, f"producing to {self.topic}", self.config) from exc
        self._producer.poll(0)

    def flush(self) -> ProduceReport:
        """Wait for every delivery report (bounded by ``timeout_s`` without progress)."""
        progress_at = time.monotonic()
        while self._pending > 0:
            before = self._pending
            try:
                self._producer.poll(0.1)  # not flush(): see sparkstep.io.output._flush
            except KafkaException as exc:
                raise translate_kafka_error(exc, f"producing to {self.topic}", self.config) from exc
            if self._pending < before:
                progress_at = time.monotonic()
            elif time.monotonic() - progress_at > self.config.timeout_s:
                raise KafkaUnavailableError(
                    f"{self._pending} records to {self.topic} were not acknowledged within "
                    f"{self.config.timeout_s:.0f}s; {self._report.describe()}"
                )
        return self._report


def produce_json_lines(config: KafkaConfig, topic: str, lines: Iterable[str]) -> ProduceReport:
    """Send each non-blank line (which must be JSON) as one record's value; report what was kept.

    A line that is not JSON is refused before anything after it is sent (the records before it
    are flushed and reported in the error). A JSON object with a string ``"key"`` field gets that
    as the record key, so records of one key stay in one partition and in order.
    """
    producer = InputProducer(config, topic)
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            report = producer.flush()
            raise StreamIOError(
                f"line {number} is not JSON ({exc.msg}); {report.describe()} before it"
            ) from exc
        key = doc.get("key") if isinstance(doc, dict) else None
        producer.send(text.encode("utf-8"), key.encode("utf-8") if isinstance(key, str) else None)
    return producer.flush()
