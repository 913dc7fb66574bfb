"""Topic administration: creation, group offsets for lag tools, retention warnings, offsets."""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import DivisionOptions, DivisionPlanner
from sparkstep.io.errors import StreamIOError
from sparkstep.io.topics import TopicAdmin

from .fixtures import TxnInput


def test_missing_topic_is_created_with_partitions(unique_name: str, admin: TopicAdmin) -> None:
    topic = f"{unique_name}-new"
    assert admin.ensure_topic(topic, 3, {"retention.ms": "3600000"})
    assert not admin.ensure_topic(topic, 3)
    assert admin.partitions(topic) == [0, 1, 2]
    assert admin.topic_config(topic)["retention.ms"] == "3600000"


def test_group_offsets_are_committed_for_lag_tools(
    bootstrap_servers: str, topic_factory, unique_name: str, admin: TopicAdmin
) -> None:
    topic = topic_factory("in", partitions=2)
    group = f"sparkstep.{unique_name}"
    admin.commit_group_offsets(group, {(topic, 0): 5, (topic, 1): 7})
    client = AdminClient({"bootstrap.servers": bootstrap_servers})
    from confluent_kafka import ConsumerGroupTopicPartitions

    futures = client.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0), TopicPartition(topic, 1)])]
    )
    result = futures[group].result(timeout=30)
    assert {(tp.partition, tp.offset) for tp in result.topic_partitions} == {(0, 5), (1, 7)}


def test_retention_that_could_delete_uncheckpointed_input_is_warned(
    bootstrap_servers: str, topic_factory, admin: TopicAdmin, caplog: pytest.LogCaptureFixture
) -> None:
    kept = topic_factory("kept", config={"retention.ms": "-1"})
    short = topic_factory("short", config={"retention.ms": "1000000"})
    for topic in (kept, short):
        TxnInput(bootstrap_servers, topic).batch([b"a", b"b", b"c"])
    now = 10**13  # far in the future: every record is older than half the retention
    with caplog.at_level(logging.WARNING, logger="sparkstep.io.topics"):
        warnings = admin.retention_warnings({(kept, 0): 0, (short, 0): 1}, now_ms=now)
    assert len(warnings) == 1
    assert short in warnings[0] and "retention" in warnings[0]
    assert warnings[0] in caplog.text
    # Checkpointed up to the end: nothing to warn about.
    assert admin.retention_warnings({(short, 0): 4}, now_ms=now) == []
    # Input already deleted below the checkpoint is reported as lost for recovery.
    client = AdminClient({"bootstrap.servers": bootstrap_servers})
    for future in client.delete_records([TopicPartition(kept, 0, 2)]).values():
        future.result(timeout=30)
    lost = admin.retention_warnings({(kept, 0): 1})
    assert len(lost) == 1 and "deleted by retention" in lost[0]


def test_retention_by_size_is_warned_once_at_start(
    topic_factory, kafka_config: KafkaConfig, caplog: pytest.LogCaptureFixture
) -> None:
    sized = topic_factory("sized", config={"retention.bytes": "1000000"})
    kept = topic_factory("kept", config={"retention.ms": "-1"})
    planner = DivisionPlanner(kafka_config, DivisionOptions(topics=(sized, kept)))
    with caplog.at_level(logging.WARNING, logger="sparkstep.io.topics"):
        planner.check_inputs()
    assert f"input topic {sized} has retention.bytes=1000000" in caplog.text
    assert kept not in caplog.text


class _FailingListOffsets:
    """An ``AdminClient`` whose ``list_offsets`` answers ``code`` for ``partition`` the first
    ``times`` calls (fault injection); every other request goes to the real client."""

    def __init__(self, real: AdminClient, partition: int, code: int, times: int) -> None:
        self._real = real
        self._partition = partition
        self._code = code
        self._left = times
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def list_offsets(self, request: dict[Any, Any], **kwargs: Any) -> dict[Any, Any]:
        self.calls += 1
        futures = self._real.list_offsets(request, **kwargs)
        if self._left == 0:
            return futures
        self._left -= 1
        for tp in futures:
            if tp.partition == self._partition:
                failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
                failed.set_exception(KafkaException(KafkaError(self._code)))
                futures[tp] = failed
        return futures


def _with_records(bootstrap_servers: str, topic: str, counts: dict[int, int]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for partition, count in counts.items():
        for i in range(count):
            producer.produce(topic, value=b"%d" % i, partition=partition)
    assert producer.flush(30) == 0


def test_offsets_of_a_partition_whose_leadership_settles_are_asked_again(
    bootstrap_servers: str, topic_factory, admin: TopicAdmin
) -> None:
    # CI met UNKNOWN_LEADER_EPOCH listing the offsets of a step log topic just created.
    topic = topic_factory("settling", partitions=2)
    _with_records(bootstrap_servers, topic, {0: 2, 1: 3})
    failing = _FailingListOffsets(admin._admin, 1, KafkaError.UNKNOWN_LEADER_EPOCH, times=2)
    admin._admin = failing  # type: ignore[assignment]
    assert admin.offsets([(topic, 0), (topic, 1)], "latest") == {(topic, 0): 2, (topic, 1): 3}
    assert failing.calls == 3


def test_offsets_of_a_partition_that_never_settles_fail_within_the_timeout(
    bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("unsettled")
    admin = TopicAdmin(KafkaConfig(bootstrap_servers, timeout_s=1.0))
    failing = _FailingListOffsets(admin._admin, 0, KafkaError.LEADER_NOT_AVAILABLE, times=-1)
    admin._admin = failing  # type: ignore[assignment]
    with pytest.raises(StreamIOError, match=rf"latest offsets of {topic}\[0\] failed"):
        admin.offsets([(topic, 0)], "latest")
    assert failing.calls > 1


def test_offsets_failing_for_another_cause_fail_at_once(
    bootstrap_servers: str, topic_factory, admin: TopicAdmin
) -> None:
    topic = topic_factory("refused")
    failing = _FailingListOffsets(admin._admin, 0, KafkaError.TOPIC_AUTHORIZATION_FAILED, times=1)
    admin._admin = failing  # type: ignore[assignment]
    with pytest.raises(StreamIOError, match="Topic authorization failed"):
        admin.offsets([(topic, 0)], "earliest")
    assert failing.calls == 1
