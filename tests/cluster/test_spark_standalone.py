"""keyed_sum on a cluster of real processes on 127.0.0.1: a Spark standalone master and two
workers (``sparkstep spark-master``, ``sparkstep spark-worker``), two ``sparkstep state-host``s
with their own data dirs, and ``sparkstep run --spark-master spark://... --state-hosts ...``,
whose runtime listens on every interface and is dialled by the name it advertises (the
executors, in JVMs of their own, dial the state workers and the driver).

Under input: an executor JVM is SIGKILLed mid-run (Spark starts another and retries the lost
tasks; the state workers deduplicate the applies that had already happened); a state host is
SIGKILLed, its workers with it, and restarted on the same dir; the coordinator is SIGKILLed and
its command run again; then a rescale 2 -> 3 -> 2 over REST moves shards between the hosts, and
one beyond the hosts' free slots is refused with 409. The integrated output equals the oracle,
every step once."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.cluster.fixtures import SparkStandalone, StateHostProcess
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
    state_host_factory: Callable[..., StateHostProcess],
) -> None:
    hosts = [state_host_factory("host-a", slots=2), state_host_factory("host-b", slots=2)]
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
        # The executor's death must not fail the pipeline; the state host's does.
        "--restart-strategy", "fixed-delay", "--restart-attempts", "5",
        "--spark-master", spark_standalone.url,
        "--state-hosts", ",".join(h.address for h in hosts),
        "--state-host-token-file", str(hosts[0].token_file),
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
        placed = coordinator.status()["processes"]["hosts"]
        assert placed == {"0": hosts[0].address, "1": hosts[1].address}, placed
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

        # A state host dies, its workers with it; it comes back on the same dir.
        hosts[0].kill()
        wait_until(
            lambda: coordinator.status()["last_failure"] is not None,
            60,
            f"the state host's loss noticed:\n{coordinator.tail()}",
        )
        assert "state host" in coordinator.status()["last_failure"]["reason"]
        hosts[0].start()
        coordinator.wait_state("running", 600)
        sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=63)

        # The coordinator dies; the same command again. Its workers on the hosts are replaced.
        coordinator.kill()
        coordinator.start()
        coordinator.wait_state("running", 600)

        # Rescale across the hosts: w2 goes to the freer host, shards cross hosts.
        grown = _rescale(coordinator, 3)
        assert grown["workers"] == 3 and grown["shards_moved"] > 0, grown
        sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=64)
        refused = httpx.post(f"{coordinator.url}/api/v1/rescale", json={"workers": 5}, timeout=60)
        assert refused.status_code == 409, refused.text
        assert "2 more workers need 2 free worker slots" in refused.json()["detail"]
        shrunk = _rescale(coordinator, 2)
        assert shrunk["workers"] == 2 and shrunk["shards_moved"] > 0, shrunk
        sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=65)
        ends = {p: high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
        wait_until(
            lambda: _logged_up_to(coordinator, topic, ends),
            600,
            f"all input in logged steps:\n{coordinator.tail()}\n{spark_standalone.tail()}",
        )

        stopped = httpx.post(f"{coordinator.url}/api/v1/stop", timeout=300)
        assert stopped.status_code == 200, stopped.text
        assert coordinator.wait(120) == 0, coordinator.tail()
    finally:
        coordinator.kill()
    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
    # The retired worker's store is gone from its host; the two left are one on each host.
    stores = sorted(
        f"{h.root.name}/{p.name}"
        for h in hosts
        for p in (h.data_dir / "pipelines" / unique_name / "workers").iterdir()
    )
    assert len(stores) == 2 and {s.split("/")[0] for s in stores} == {"host-a", "host-b"}, stores


def _rescale(coordinator: CoordinatorProcess, workers: int) -> dict[str, Any]:
    answer = httpx.post(f"{coordinator.url}/api/v1/rescale", json={"workers": workers}, timeout=600)
    assert answer.status_code == 200, f"{answer.text}\n{coordinator.tail()}"
    doc: dict[str, Any] = answer.json()
    return doc
