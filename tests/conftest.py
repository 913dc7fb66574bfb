"""Session-wide real components: one Kafka broker, one SparkSession, unique names per test.

- ``kafka_broker`` / ``bootstrap_servers``: a real single-node KRaft broker on a free port,
  started once per session from the jars ``./dev/test`` installs, stopped at the end even when
  tests fail.
- ``topic_factory``: creates topics with names no other test uses (a uuid suffix), so tests
  share the broker without sharing data.
- ``unique_name``: a pipeline ``--name`` no other test uses (namespaces the step log, the
  dead-letter topic, the transactional id and the consumer group).
- ``spark``: one SparkSession, ``local[2,3]`` (with plain ``local[N]`` Spark never retries a
  failed task, and retries are part of what we test), UI off, few shuffle partitions, Python
  workers on this interpreter.
- ``--long``: also run the tests marked ``long`` (soak and chaos runs with many trials).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from sparkstep.io.broker import LocalBroker, default_cache_dir, find_free_port, install_kafka
from sparkstep.runtime.jvm import driver_java_options

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long", action="store_true", help="also run long soak and chaos tests (marked long)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long run: pass --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under ``--long``: crash and chaos tests scale their trial counts with it."""
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="session")
def kafka_libs() -> Path:
    return install_kafka(default_cache_dir())


@pytest.fixture(scope="session")
def kafka_broker(
    tmp_path_factory: pytest.TempPathFactory, kafka_libs: Path
) -> Iterator[LocalBroker]:
    broker = LocalBroker(tmp_path_factory.mktemp("kafka"), find_free_port(), kafka_libs)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def bootstrap_servers(kafka_broker: LocalBroker) -> str:
    return kafka_broker.bootstrap_servers


TopicFactory = Callable[..., str]


@pytest.fixture
def topic_factory(bootstrap_servers: str) -> TopicFactory:
    """``topic_factory("input", partitions=2, config={...})`` -> a new, unique topic's name."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})

    def create(prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})]
        )
        futures[name].result(timeout=30)
        return name

    return create


@pytest.fixture
def unique_name() -> str:
    return f"p{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("sparkstep-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.speculation", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "2g")
        .config("spark.driver.extraJavaOptions", driver_java_options(default_cache_dir()))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
