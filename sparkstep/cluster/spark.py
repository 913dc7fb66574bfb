"""Spark's own standalone cluster daemons, from the installed pyspark.

``sparkstep spark-master`` and ``sparkstep spark-worker`` run Spark's
``org.apache.spark.deploy.master.Master`` and ``org.apache.spark.deploy.worker.Worker`` in the
foreground, through the ``bin/spark-class`` launcher of the pyspark package (the same Spark
version as the driver, so no separate Spark download): what a ``spark-master`` or
``spark-worker`` container runs, and what the cluster tests start on 127.0.0.1.

The process replaces itself with the JVM (``exec``): signals reach Spark directly and the exit
status is Spark's. Before that, a missing Java 17+ is one line (:class:`MissingToolError`).

Settings that differ from Spark's defaults, and why:

- the master's REST submission server is off (``spark.master.rest.enabled=false``): sparkstep
  runs its driver in client mode and never submits through it, and its fixed port 6066 would
  collide between two masters on one host;
- a worker offers ``--cores`` and ``--memory`` (defaults: 1 core, 1g), not all of the host,
  so several workers and the driver share a small machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sparkstep.io.broker import java_executable

__all__ = ["master_argv", "spark_env", "spark_home", "worker_argv"]

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def spark_home() -> Path:
    """The installed pyspark package, which holds Spark's jars and ``bin/spark-class``."""
    import pyspark

    return Path(pyspark.__file__).parent


def spark_env(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with ``SPARK_HOME`` set, the daemons in the foreground, and the master's REST
    submission server off. Raises :class:`MissingToolError` without Java 17+."""
    java = java_executable()
    env = dict(base)
    env["SPARK_HOME"] = str(spark_home())
    env["SPARK_NO_DAEMONIZE"] = "1"
    env.setdefault("JAVA_HOME", str(Path(os.path.realpath(java)).parents[1]))
    opts = env.get("SPARK_MASTER_OPTS", "")
    env["SPARK_MASTER_OPTS"] = f"{opts} -Dspark.master.rest.enabled=false".strip()
    return env


def master_argv(host: str, port: int, webui_port: int) -> list[str]:
    """The command of a master listening on ``host:port``, its web UI on ``webui_port``."""
    return [
        str(spark_home() / "bin" / "spark-class"), MASTER_CLASS,
        "--host", host, "--port", str(port), "--webui-port", str(webui_port),
    ]  # fmt: skip


def worker_argv(
    master: str, host: str, cores: int, memory: str, work_dir: Path, webui_port: int
) -> list[str]:
    """The command of a worker of ``master`` (``spark://HOST:PORT``) offering ``cores`` and
    ``memory`` to executors, advertised as ``host``, running them under ``work_dir``."""
    return [
        str(spark_home() / "bin" / "spark-class"), WORKER_CLASS, master,
        "--host", host, "--cores", str(cores), "--memory", memory,
        "--work-dir", str(work_dir), "--webui-port", str(webui_port),
    ]  # fmt: skip
