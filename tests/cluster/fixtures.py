"""A Spark standalone cluster of real processes on 127.0.0.1: ``sparkstep spark-master`` and
``sparkstep spark-worker``s, each in a process group of its own so that the executors a worker
started end with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.coordinator_api.fixtures import wait_until

EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class SparkStandalone:
    """The master (``url``: ``spark://127.0.0.1:P``) and its workers, started by :meth:`start`."""

    root: Path
    workers: int = 2
    url: str = ""
    webui: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> SparkStandalone:
        port, ui = free_port(), free_port()
        self.url = f"spark://127.0.0.1:{port}"
        self.webui = f"http://127.0.0.1:{ui}/json/"
        self._spawn("master", "spark-master", "--port", str(port), "--webui-port", str(ui))
        wait_until(lambda: self._state() is not None, 120, f"the Spark master:\n{self.tail()}")
        for i in range(self.workers):
            self._spawn(
                f"worker{i}", "spark-worker", self.url, "--cores", "1", "--memory", "1g",
                "--work-dir", str(self.root / f"worker{i}"), "--webui-port", "0",
            )  # fmt: skip
        wait_until(
            lambda: (self._state() or {}).get("aliveworkers") == self.workers,
            120,
            f"{self.workers} alive Spark workers:\n{self.tail()}",
        )
        return self

    def _spawn(self, name: str, *args: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f"{name}.log").open("ab") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "sparkstep.cli", *args],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )

    def _state(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.webui, timeout=5) as answer:
                doc: dict[str, Any] = json.load(answer)
                return doc
        except OSError:
            return None

    def executor_pids(self) -> list[int]:
        """The executor JVMs this cluster's workers run now: in a worker's process group."""
        groups = {proc.pid for proc in self.procs}
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                group = os.getpgid(int(entry.name))
            except OSError:  # gone meanwhile
                continue
            if EXECUTOR_CLASS.encode() in cmdline and group in groups:
                pids.append(int(entry.name))
        return pids

    def tail(self) -> str:
        lines = []
        for log in sorted(self.root.glob("*.log")):
            last = log.read_text(errors="replace").splitlines()[-8:]
            lines += [f"{log.name}: {line}" for line in last]
        return "\n".join(lines)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def spark_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkStandalone]:
    cluster = SparkStandalone(tmp_path_factory.mktemp("spark-standalone"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


HOST_TOKEN = "state-host-token-for-the-tests-0123456789"


@dataclass
class StateHostProcess:
    """``sparkstep state-host`` as a child on 127.0.0.1, restartable on the same data dir and
    port (:meth:`restart`); ``token_file`` holds :data:`HOST_TOKEN`."""

    root: Path
    slots: int = 2
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> StateHostProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(HOST_TOKEN + "\n")
        if not self.port:
            self.port = free_port()
        out = self.root / "host.out"
        out.write_bytes(b"")
        with (self.root / "host.log").open("ab") as log, out.open("ab") as stdout:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "sparkstep.cli", "state-host",
                    "--data-dir", str(self.data_dir),
                    "--token-file", str(self.token_file),
                    "--slots", str(self.slots),
                    "--port", str(self.port),
                ],
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=log,
                start_new_session=True,
            )  # fmt: skip
        wait_until(
            lambda: b'"address"' in out.read_bytes() or self.proc.poll() is not None,  # type: ignore[union-attr]
            60,
            f"the state host's ready line:\n{self.tail()}",
        )
        assert self.proc.poll() is None, self.tail()
        return self

    def kill(self) -> None:
        """SIGKILL the state host (its workers die with it: parent-death signal)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def restart(self) -> StateHostProcess:
        self.kill()
        return self.start()

    def tail(self) -> str:
        log = self.root / "host.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@pytest.fixture
def state_host_factory(tmp_path: Path) -> Iterator[Callable[..., StateHostProcess]]:
    """Start state hosts (``factory(name, slots=2)``); every one is killed afterwards."""
    hosts: list[StateHostProcess] = []

    def factory(name: str, slots: int = 2) -> StateHostProcess:
        host = StateHostProcess(tmp_path / name, slots=slots).start()
        hosts.append(host)
        return host

    yield factory
    for host in hosts:
        host.kill()
