"""Kafka client settings (SASL passwords) never reach a child's command line, which every user
of the machine can read in ``/proc/<pid>/cmdline`` (``ps``): a real coordinator gives them to
its runtime in a 0600 file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparkstep.io.config import read_kafka_settings_file
from tests.coordinator_api.fixtures import CoordinatorProcess, wait_until
from tests.runtime.driver.fixtures import produce_keyed

SECRET = "secretvalue123"


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren: the Spark JVM, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == pid]
        found += kids
        frontier += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_kafka_settings_reach_the_runtime_in_a_private_file_not_its_argv(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str
) -> None:
    topic = topic_factory("numbers", partitions=2)
    produce_keyed(bootstrap_servers, topic, 50, keys=5, seed=3)
    state = tmp_path / "state"
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers, "--state-dir", str(state),
        "--workers", "1", "--api-port", "0", "--name", unique_name, "--input-topic", topic,
        "--output-topic", topic_factory("out", partitions=2), "--checkpoint-interval", "0",
        "--restart-strategy", "none", "--kafka-config", f"client.id={SECRET}",
    ]  # fmt: skip
    coordinator = CoordinatorProcess(args, tmp_path / "coordinator.log").start()
    try:
        first = coordinator.wait_state("running")
        # The runtime connected with the settings: steps advance.
        wait_until(
            lambda: (coordinator.status()["step"] or 0) > (first["step"] or 0),
            300,
            f"a step\n{coordinator.tail()}",
        )
        assert coordinator.proc is not None
        assert SECRET in _cmdline(coordinator.proc.pid)  # where the user put it
        children = _descendants(coordinator.proc.pid)
        runtime = coordinator.status()["processes"]["runtime"]
        assert runtime in children and len(children) >= 3  # the worker, the runtime, its JVM
        cmdlines = {pid: _cmdline(pid) for pid in children}
        assert not [c for c in cmdlines.values() if SECRET in c], cmdlines
        settings_file = state / "coordinator" / "kafka-settings.json"
        assert f"--kafka-settings-file {settings_file}" in cmdlines[runtime]
        assert settings_file.stat().st_mode & 0o777 == 0o600
        assert json.loads(settings_file.read_text()) == {"client.id": SECRET}
        assert read_kafka_settings_file(settings_file) == (f"client.id={SECRET}",)
    finally:
        coordinator.kill()
