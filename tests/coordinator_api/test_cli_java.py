"""Without ``java`` on PATH the commands that need it say what to install, in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.coordinator_api.fixtures import sparkstep_cli

INSTALL_JAVA = (
    "sparkstep: Java 17+ is required to run the Kafka broker and Spark, and `java` is not on "
    "PATH: install a JDK 17 or newer (e.g. `apt-get install openjdk-17-jdk-headless`)\n"
)


@pytest.fixture
def no_java_env(tmp_path: Path) -> dict[str, str]:
    """Our environment with a PATH that has no ``java`` (the commands run on sys.executable)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "SPARK_HOME")}
    env["PATH"] = str(empty)
    return env


def test_run_without_java_says_what_to_install(tmp_path: Path, no_java_env) -> None:
    code, out, err = sparkstep_cli(
        "run", "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", "127.0.0.1:9", "--state-dir", str(tmp_path / "state"),
        "--api-port", "0", "--restart-strategy", "none",
        env=no_java_env, timeout=120,
    )  # fmt: skip
    assert (code, err) == (2, INSTALL_JAVA), out
    assert not (tmp_path / "state").exists()


def test_kafka_start_without_java_says_what_to_install(tmp_path: Path, no_java_env) -> None:
    code, out, err = sparkstep_cli(
        "kafka", "start", "--port", "9", "--data-dir", str(tmp_path / "kafka"), env=no_java_env
    )
    assert (code, err) == (2, INSTALL_JAVA), out


@pytest.mark.parametrize(
    "command",
    [
        ["spark-master"],
        ["spark-worker", "spark://127.0.0.1:7077", "--work-dir", "spark-work"],
        ["spark-archive", "--cache-dir", "spark-work"],
    ],
    ids=["spark-master", "spark-worker", "spark-archive"],
)
def test_spark_daemons_without_java_say_what_to_install(
    tmp_path: Path, no_java_env, command: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = sparkstep_cli(*command, env=no_java_env)
    assert (code, err) == (2, INSTALL_JAVA), out
    assert not (tmp_path / "spark-work").exists()  # refused before it made anything
