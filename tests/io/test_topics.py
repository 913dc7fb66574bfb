"""Topic administration: creation, group offsets for lag tools, retention warnings."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import DivisionOptions, DivisionPlanner
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
