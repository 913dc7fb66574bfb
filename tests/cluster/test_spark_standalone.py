"""keyed_sum on a Spark standalone cluster of real processes: ``sparkstep spark-master`` and two
``sparkstep spark-worker``s on 127.0.0.1, and ``sparkstep run --spark-master spark://...`` whose
children listen on every interface and are dialled by the name they advertise (the executors,
in JVMs of their own, dial the state workers and the driver by it). An executor JVM is
SIGKILLed mid-run: Spark starts another and retries the lost tasks, the state workers
deduplicate the applies that had already happened, and the integrated output equals the
oracle with every step once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.cluster.fixtures import SparkStandalone
from tests.coordinator_api.fixtures import CoordinatorProcess, metric_samples, wait_until
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import assert_keyed_sum_exactly_once, produce_keyed


def _logged_up_to(coordinator: CoordinatorProcess, topic: str, ends: dict[int, int]) -> bool:
    """The last logged step's division reaches ``ends`` (from ``/metrics``)."""
    text = httpx.get(f"{coordinator.url}/metrics", timeout=30).text
    got = metric_samples(text, "sparkstep_input_end_offset")
    return all(
        got.get(f'{{topic="{topic}",partition="{p}"}}', -1) >= end for p, end in ends.items()
    )


def test_keyed_sum_on_a_standalone_cluster_survives_an_executor_kill(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    unique_name: str,
    spark_standalone: SparkStandalone,
) -> None:
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 150, keys=20, seed=61)
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(tmp_path / "state"),
        "--workers", "2",
        "--api-port", "0",
        "--name", unique_name,
        "--input-topic", topic,
        "--output-topic", out,
        "--max-records-per-step", "25",
        "--checkpoint-interval", "5",
        "--restart-strategy", "none",  # the executor's death must not fail the pipeline
        "--spark-master", spark_standalone.url,
        "--bind", "0.0.0.0",
        "--advertise", "localhost",
    ]  # fmt: skip
    coordinator = CoordinatorProcess(args, tmp_path / "coordinator.log").start()
    try:
        first = coordinator.wait_state("running", 600)["step"] or 0
        wait_until(
            lambda: (coordinator.status()["step"] or 0) >= first + 2,
            600,
            f"two steps on the cluster:\n{coordinator.tail()}\n{spark_standalone.tail()}",
        )
        executors = spark_standalone.executor_pids()
        assert len(executors) == 2, spark_standalone.tail()  # one per worker, 1 core each

        os.kill(executors[0], signal.SIGKILL)
        sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=62)
        ends = {p: high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
        wait_until(
            lambda: _logged_up_to(coordinator, topic, ends),
            600,
            f"all input in logged steps:\n{coordinator.tail()}\n{spark_standalone.tail()}",
        )
        assert coordinator.status()["state"] == "running"
        assert coordinator.status()["last_failure"] is None
        replacement = set(spark_standalone.executor_pids()) - set(executors)
        assert replacement, "Spark did not start an executor in place of the killed one"

        stopped = httpx.post(f"{coordinator.url}/api/v1/stop", timeout=300)
        assert stopped.status_code == 200, stopped.text
        assert coordinator.wait(120) == 0, coordinator.tail()
    finally:
        coordinator.kill()
    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
