"""The users' producer helper and ``sparkstep produce``: acks=all, idempotence, honest reports."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from sparkstep.cli import main
from sparkstep.errors import ConfigError
from sparkstep.io.config import KafkaConfig, parse_kafka_settings
from sparkstep.io.errors import MissingTopicError, StreamIOError
from sparkstep.io.producer import produce_json_lines

from .fixtures import high_watermark, read_committed


def test_kafka_settings_are_parsed_and_protected() -> None:
    assert parse_kafka_settings(["sasl.mechanism=PLAIN", "security.protocol=SASL_SSL"]) == (
        ("sasl.mechanism", "PLAIN"),
        ("security.protocol", "SASL_SSL"),
    )
    for bad in ["novalue", "=x", "isolation.level=read_uncommitted", "acks=1"]:
        with pytest.raises(ConfigError):
            parse_kafka_settings([bad])
    config = KafkaConfig.from_args("h:1", ["client.id=me"])
    assert config.consumer("g")["client.id"] == "me"
    assert config.consumer("g")["isolation.level"] == "read_committed"
    assert config.producer()["acks"] == "all"
    assert config.producer()["enable.idempotence"] is True
    assert config.transactional_producer("sparkstep.x")["transactional.id"] == "sparkstep.x"


def test_json_lines_are_recorded_and_reported(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in", partitions=2)
    lines = [json.dumps({"key": f"k{i % 3}", "value": i}) for i in range(10)] + ["", "  "]
    report = produce_json_lines(kafka_config, topic, lines)
    assert report.recorded == 10
    assert report.failed == 0
    assert sum(report.by_partition.values()) == 10
    seen = read_committed(bootstrap_servers, topic)
    assert sorted(json.loads(r.value)["value"] for r in seen) == list(range(10))
    assert all(r.key == json.loads(r.value)["key"].encode() for r in seen)
    with pytest.raises(StreamIOError, match=r"line 2 is not JSON.*recorded 1"):
        produce_json_lines(kafka_config, topic, ['{"a": 1}', "{oops"])
    with pytest.raises(MissingTopicError, match="no-such-topic"):
        produce_json_lines(kafka_config, "no-such-topic", ["{}"])


def test_sparkstep_produce_command(
    bootstrap_servers: str, topic_factory, tmp_path: Path, capsys
) -> None:
    topic = topic_factory("in")
    data = tmp_path / "input.jsonl"
    data.write_text("".join(json.dumps({"key": "a", "value": i}) + "\n" for i in range(4)))
    code = main(
        ["produce", "--bootstrap-servers", bootstrap_servers, "--topic", topic,
         "--file", str(data), "--kafka-config", "client.id=sparkstep-test"]
    )  # fmt: skip
    assert code == 0
    assert "recorded 4 records" in capsys.readouterr().out
    done = subprocess.run(
        [sys.executable, "-m", "sparkstep.cli", "produce", "--bootstrap-servers",
         bootstrap_servers, "--topic", topic],
        input='{"key": "b", "value": 9}\n',
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "recorded 1 records" in done.stdout
    assert len(read_committed(bootstrap_servers, topic)) == 5
    assert main(["produce", "--bootstrap-servers", bootstrap_servers, "--topic", topic,
                 "--kafka-config", "acks=0"]) == 2  # fmt: skip
    assert "acks" in capsys.readouterr().err


def test_sparkstep_produce_demo_makes_the_topic_and_sends_until_sigterm(
    bootstrap_servers: str, unique_name: str
) -> None:
    """``sparkstep produce --demo`` (the compose file's producer): the topic is made with the
    partitions asked for, keyed_sum records flow until SIGTERM, and it says how many it sent."""
    topic = f"{unique_name}-demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkstep.cli", "produce", "--demo", "--bootstrap-servers",
         bootstrap_servers, "--topic", topic, "--partitions", "2", "--rate", "200"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while min(_watermark(bootstrap_servers, topic, p) for p in (0, 1)) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "no demo records"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    sent = int(out.strip().splitlines()[-1].split()[1])
    assert sent >= sum(high_watermark(bootstrap_servers, topic, p) for p in (0, 1)) > 0
    doc = json.loads(read_committed(bootstrap_servers, topic)[0].value)
    assert set(doc) == {"key", "value"} and doc["key"].startswith("k")


def _watermark(bootstrap: str, topic: str, partition: int) -> int:
    """The high watermark, 0 while the topic does not exist yet."""
    try:
        return high_watermark(bootstrap, topic, partition)
    except KafkaException:
        return 0
