"""The local broker is a real Kafka broker: transactions, isolation, start/stop, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from sparkstep.io.broker import (
    LocalBroker,
    find_free_port,
    install_kafka,
    install_maven_jars,
    installed_kafka_libs,
)
from sparkstep.io.errors import BrokerError


def _read_all(bootstrap: str, topic: str, isolation: str) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{uuid.uuid4().hex}",
            "isolation.level": isolation,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        _low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        values: list[bytes] = []
        while consumer.position([TopicPartition(topic, 0)])[0].offset < high:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            value = msg.value()
            assert value is not None
            values.append(value)
        return values
    finally:
        consumer.close()


def test_committed_transaction_is_visible_and_aborted_one_is_not(
    bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("txn")
    producer = Producer(
        {"bootstrap.servers": bootstrap_servers, "transactional.id": f"tx-{uuid.uuid4().hex}"}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"committed-1")
    producer.produce(topic, b"committed-2")
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, b"committed-3")
    producer.commit_transaction(30)

    assert _read_all(bootstrap_servers, topic, "read_committed") == [
        b"committed-1",
        b"committed-2",
        b"committed-3",
    ]
    # The aborted record is really in the log: a read_uncommitted reader sees it.
    assert b"aborted" in _read_all(bootstrap_servers, topic, "read_uncommitted")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkstep.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )


def _alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (exited, not yet reaped by a foreign parent) does not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_cli_starts_reports_and_stops_a_second_broker(tmp_path: Path, kafka_libs: Path) -> None:
    port = find_free_port()
    data = str(tmp_path / "kafka")
    common = ["--port", str(port), "--data-dir", data]
    started = _cli("kafka", "start", *common)
    assert started.returncode == 0, started.stderr
    broker = LocalBroker(Path(data), port, kafka_libs)
    pid = broker.pid()
    try:
        assert pid is not None
        status = _cli("kafka", "status", *common)
        assert status.returncode == 0
        assert f"pid {pid} on 127.0.0.1:{port} answers" in status.stdout
    finally:
        stopped = _cli("kafka", "stop", *common)
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid)
    after = _cli("kafka", "status", *common)
    assert after.returncode == 1
    assert "no broker running" in after.stdout


def test_cli_runs_a_broker_in_the_foreground_on_the_address_it_is_told(
    tmp_path: Path, kafka_libs: Path
) -> None:
    """``sparkstep kafka run`` (a container's broker): the process becomes the JVM, listens on
    the bind address and tells clients the advertised host; SIGTERM ends it."""
    port = find_free_port()
    data = tmp_path / "kafka"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkstep.cli", "kafka", "run", "--port", str(port),
         "--data-dir", str(data), "--bind", "0.0.0.0", "--advertise", "localhost"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "log_level": 0})
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (data / "broker.out").read_text(errors="replace")
            try:
                brokers = admin.list_topics(timeout=2).brokers
                break
            except Exception:
                assert time.monotonic() < deadline, "the foreground broker did not answer"
                time.sleep(0.5)
        assert [(str(b.host), b.port) for b in brokers.values()] == [("localhost", port)]
        assert LocalBroker(data, port, kafka_libs).pid() == proc.pid  # it became the JVM
        assert "listeners=PLAINTEXT://0.0.0.0:" in (data / "server.properties").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, 143)


def test_missing_java_is_one_clear_line(tmp_path: Path) -> None:
    # Fault injection: a PATH without java (python is called by its absolute path).
    env = dict(os.environ, PATH=str(tmp_path))
    done = _cli("kafka", "start", "--port", str(find_free_port()), "--data-dir",
                str(tmp_path / "k"), "--cache-dir", str(tmp_path / "cache"), env=env)  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("sparkstep: Java 17+ is required")
    assert "Traceback" not in done.stderr


def test_port_in_use_is_a_clear_error(tmp_path: Path, kafka_broker: LocalBroker) -> None:
    done = _cli("kafka", "start", "--port", str(kafka_broker.port), "--data-dir",
                str(tmp_path / "k"))  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"sparkstep: port {kafka_broker.port} on 127.0.0.1 is already in use: "
        "choose another with --port"
    )


def test_a_failed_maven_install_says_so_and_leaves_nothing_installed(tmp_path: Path) -> None:
    # A real Maven run against Maven Central, for an artifact that does not exist.
    pom = b"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.sparkstep</groupId><artifactId>missing</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies><dependency>
    <groupId>dev.sparkstep.does-not-exist</groupId><artifactId>nothing</artifactId>
    <version>0.0.1</version>
  </dependency></dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId><artifactId>maven-dependency-plugin</artifactId>
    <version>3.8.1</version>
  </plugin></plugins></build>
</project>
"""
    with pytest.raises(BrokerError, match=r"^Maven could not fetch the missing jars from Maven"):
        install_maven_jars(tmp_path, "missing", pom, "the missing jars")
    assert list(tmp_path.iterdir()) == []


def test_installed_jars_are_reused_by_pom(tmp_path: Path, kafka_libs: Path) -> None:
    # The broker's install is keyed by its pom: asking again finds the same directory at once.
    cache = kafka_libs.parent.parent
    assert installed_kafka_libs(cache) == kafka_libs
    assert install_kafka(cache) == kafka_libs


def test_a_relative_cache_dir_installs_the_jars_where_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Maven resolves a relative output directory against the pom's directory: the install
    # must hand it an absolute one, or the jars land elsewhere under a COMPLETE marker.
    monkeypatch.chdir(tmp_path)
    libs = install_kafka(Path("cache"))
    assert libs == (tmp_path / "cache").resolve() / libs.parent.name / "libs"
    assert any(p.name.startswith("kafka_2.13-") for p in libs.iterdir())
    assert installed_kafka_libs(Path("cache")).resolve() == libs  # type: ignore[union-attr]
