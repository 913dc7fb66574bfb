"""The step log: exact JSON, creation, reading back with every record checked."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import AlterConfigOpType, ConfigEntry, ConfigResource
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewTopic

from sparkstep.errors import ConfigError
from sparkstep.ids import Step
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import StepTime
from sparkstep.io.errors import (
    DeploymentMismatchError,
    StepLogError,
    StepLogGapError,
    UndurableStepLogError,
    WrongStepError,
)
from sparkstep.io.steplog import (
    OutputRange,
    OutputSummary,
    RangeSummary,
    StepLog,
    StepRecord,
    steps_topic,
)
from sparkstep.io.topics import TopicAdmin


def record(step: int, deployment: str = "dep") -> StepRecord:
    return StepRecord(
        deployment=deployment,
        step=Step(step),
        epoch=1,
        time=StepTime(max_input_ts=None if step == 0 else 1000 + step, wall=2000 + step),
        division=(RangeSummary("in", 0, step, step + 1, 1, "ab" * 16),),
        output=OutputSummary(3, "00ff" * 4, (OutputRange("out", 1, 7, 10),)),
        state_digests={"0": "d0", "1": "d1"},
        dlq_count=2,
    )


def test_json_has_exactly_the_design_fields_and_round_trips() -> None:
    doc = json.loads(record(5).to_json())
    assert doc == {
        "deployment": "dep",
        "step": 5,
        "epoch": 1,
        "time": {"max_input_ts": 1005, "wall": 2005},
        "division": [
            {"topic": "in", "partition": 0, "start": 5, "end": 6, "count": 1, "hash": "ab" * 16}
        ],
        "output": {
            "count": 3,
            "digest": "00ff" * 4,
            "ranges": [{"topic": "out", "partition": 1, "start": 7, "end": 10}],
        },
        "state_digests": {"0": "d0", "1": "d1"},
        "dlq_count": 2,
    }
    assert StepRecord.from_json(record(5).to_json()) == record(5)
    assert StepRecord.from_json(record(0).to_json()).time.max_input_ts is None
    assert record(5).to_division().ranges[0].end == 6


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("dlq_count"),
        lambda d: d.update(extra=1),
        lambda d: d.update(step="5"),
        lambda d: d["output"].pop("ranges"),
        lambda d: d["division"][0].update(count=True),
        lambda d: d["output"].update(digest="v3:" + "00ff" * 4),  # a later sparkstep's
    ],
)
def test_malformed_records_are_refused(change) -> None:
    doc = json.loads(record(5).to_json())
    change(doc)
    with pytest.raises(StepLogError, match="not valid"):
        StepRecord.from_json(json.dumps(doc))


def _write(bootstrap: str, topic: str, records: list[StepRecord]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for rec in records:
        producer.produce(topic, value=rec.to_json())
    assert producer.flush(30) == 0


def test_topic_is_created_to_keep_every_step(
    unique_name: str, kafka_config: KafkaConfig, admin: TopicAdmin
) -> None:
    log = StepLog(kafka_config, unique_name, "dep")
    log.ensure()
    log.ensure()
    assert admin.partitions(steps_topic(unique_name)) == [0]
    config = admin.topic_config(steps_topic(unique_name))
    assert config["retention.ms"] == "-1"
    assert config["retention.bytes"] == "-1"
    assert config["cleanup.policy"] == "delete"
    assert log.last() is None


def test_reading_back_last_given_and_ranges_of_steps(
    bootstrap_servers: str, unique_name: str, kafka_config: KafkaConfig
) -> None:
    log = StepLog(kafka_config, unique_name, "dep")
    log.ensure()
    _write(bootstrap_servers, log.topic, [record(s) for s in range(300)])
    assert log.last() == record(299)
    for step in (0, 1, 150, 298, 299):
        assert log.record(step) == record(step)
    assert [r.step for r in log.records(290)] == list(range(290, 300))
    assert [r.step for r in log.records(10, 12)] == [10, 11, 12]
    with pytest.raises(StepLogError, match="step 300 is not in step log"):
        log.record(300)


def test_gap_duplicate_and_other_deployment_are_errors_naming_both(
    bootstrap_servers: str, unique_name: str, kafka_config: KafkaConfig
) -> None:
    log = StepLog(kafka_config, unique_name, "dep")
    log.ensure()
    _write(bootstrap_servers, log.topic, [record(0), record(1), record(3)])
    with pytest.raises(StepLogGapError, match="step 3 follows step 1"):
        list(log.records(0))
    with pytest.raises(StepLogGapError):
        log.last()

    twice = StepLog(kafka_config, unique_name + "x", "dep")
    twice.ensure()
    _write(bootstrap_servers, twice.topic, [record(0), record(1), record(1)])
    with pytest.raises(WrongStepError) as info:
        list(twice.records(0))
    assert (info.value.expected, info.value.found) == (2, 1)

    with pytest.raises(DeploymentMismatchError, match=r"other.*dep") as mismatch:
        StepLog(kafka_config, unique_name, "other").last()
    assert (mismatch.value.expected, mismatch.value.found) == ("other", "dep")


def test_a_step_log_with_two_partitions_is_refused(
    topic_factory, kafka_config: KafkaConfig
) -> None:
    name = topic_factory("bad", partitions=2)
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_config.bootstrap_servers})
    admin.create_topics([NewTopic(steps_topic(name), 2, 1)])[steps_topic(name)].result(30)
    with pytest.raises(StepLogError, match="exactly one"):
        StepLog(kafka_config, name, "dep").ensure()


def _create(bootstrap: str, topic: str, config: dict[str, str]) -> None:
    """Create ``topic`` and wait until its configuration can be described."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1, config=config)])[topic].result(timeout=30)
    TopicAdmin(KafkaConfig(bootstrap, timeout_s=30))._wait_until_known(topic)


@pytest.mark.parametrize(
    ("config", "found"),
    [
        ({"retention.ms": "60000"}, "retention.ms=60000"),
        ({"retention.ms": "-1", "retention.bytes": "1000000"}, "retention.bytes=1000000"),
        # Created by hand with the broker's defaults: retention.ms=604800000 is inherited.
        ({}, "retention.ms=604800000"),
    ],
)
def test_a_step_log_that_can_delete_records_is_refused_with_the_fix(
    bootstrap_servers: str,
    unique_name: str,
    kafka_config: KafkaConfig,
    config: dict[str, str],
    found: str,
) -> None:
    topic = steps_topic(unique_name)
    _create(bootstrap_servers, topic, config)
    with pytest.raises(UndurableStepLogError) as info:
        StepLog(kafka_config, unique_name, "dep").ensure()
    message = str(info.value)
    assert found in message
    setting = found.split("=")[0]
    assert (
        f"kafka-configs.sh --bootstrap-server {bootstrap_servers} --alter --entity-type topics "
        f"--entity-name {topic} --add-config {setting}=-1"
    ) in message
    assert isinstance(info.value, ConfigError)  # the runtime exits as misconfigured
    assert TopicAdmin(kafka_config).topic_config(topic)[setting] != "-1"  # left as it was


@pytest.fixture
def finite_broker_retention_bytes(bootstrap_servers: str) -> Iterator[str]:
    """The (only) broker's ``log.retention.bytes`` set to 1 TiB for the test (the value a topic
    inherits unless it sets ``retention.bytes``); restored afterwards."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    (broker,) = admin.list_topics(timeout=30).brokers

    def alter(op: AlterConfigOpType) -> None:
        entry = ConfigEntry("log.retention.bytes", str(1 << 40), incremental_operation=op)
        resource = ConfigResource(ResourceType.BROKER, str(broker), incremental_configs=[entry])
        admin.incremental_alter_configs([resource])[resource].result(timeout=30)

    alter(AlterConfigOpType.SET)
    try:
        yield str(1 << 40)
    finally:
        alter(AlterConfigOpType.DELETE)


def test_a_sparkstep_step_log_inheriting_finite_retention_is_fixed(
    bootstrap_servers: str,
    unique_name: str,
    kafka_config: KafkaConfig,
    admin: TopicAdmin,
    finite_broker_retention_bytes: str,
) -> None:
    # A step log as sparkstep creates it, but without retention.bytes: the broker's default
    # applies, and it deletes records once the log is that large.
    topic = steps_topic(unique_name)
    _create(bootstrap_servers, topic, {"retention.ms": "-1", "cleanup.policy": "delete"})
    assert admin.topic_config(topic)["retention.bytes"] == finite_broker_retention_bytes
    StepLog(kafka_config, unique_name, "dep").ensure()
    assert admin.topic_overrides(topic)["retention.bytes"] == "-1"
    assert admin.topic_config(topic)["retention.ms"] == "-1"
    # Created now, while the broker's default is finite: created to keep every record.
    StepLog(kafka_config, unique_name + "x", "dep").ensure()
    assert admin.topic_config(steps_topic(unique_name + "x"))["retention.bytes"] == "-1"
    # A topic someone else made inherits the same default: refused, not altered.
    other = steps_topic(unique_name + "y")
    _create(bootstrap_servers, other, {"retention.ms": "-1"})
    with pytest.raises(UndurableStepLogError, match=r"retention\.bytes=1099511627776"):
        StepLog(kafka_config, unique_name + "y", "dep").ensure()
    assert "retention.bytes" not in admin.topic_overrides(other)


def test_replication_is_read(topic_factory, admin: TopicAdmin) -> None:
    topic = topic_factory("r", partitions=2)
    admin._wait_until_known(topic)
    assert admin.replication(topic) == (1, 1)
