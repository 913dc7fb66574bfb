"""The REST token opens the REST API only: ``sparkstep run`` with ``SPARKSTEP_API_TOKEN`` gives
its runtime and workers a secret of their own (the token file, 0600), and the REST token is
refused by the runtime's control endpoint and by a worker, which take the secret."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparkstep.runtime.errors import WorkerAuthError
from sparkstep.runtime.worker.client import WorkerClient
from tests.coordinator_api.fixtures import CoordinatorProcess, wait_until

API_TOKEN = "rest-users-token"


def _port(out_file: Path) -> int:
    """The port of a child's ready line (the first JSON line of its ``.out`` file)."""
    for line in out_file.read_text().splitlines():
        if line.startswith("{") and '"port"' in line:
            return int(json.loads(line)["port"])
    raise AssertionError(f"no ready line in {out_file}")


def test_the_rest_token_is_refused_by_the_runtime_and_the_workers(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str
) -> None:
    state_dir = tmp_path / "state"
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(state_dir),
        "--workers", "1",
        "--api-port", "0",
        "--name", unique_name,
        "--input-topic", topic_factory("numbers", partitions=1),
        "--output-topic", topic_factory("out", partitions=1),
        "--checkpoint-interval", "0",
    ]  # fmt: skip
    coordinator = CoordinatorProcess(args, tmp_path / "coordinator.log")
    coordinator.env["SPARKSTEP_API_TOKEN"] = API_TOKEN
    coordinator.start()
    try:
        rest = {"authorization": f"Bearer {API_TOKEN}"}

        def status() -> dict[str, Any]:
            answer = httpx.get(f"{coordinator.url}/api/v1/status", headers=rest, timeout=30)
            assert answer.status_code == 200, answer.text
            doc: dict[str, Any] = answer.json()
            assert doc["state"] != "failed", (doc, coordinator.tail())
            return doc

        wait_until(lambda: status()["state"] == "running", 300, "running")

        token_file = state_dir / "coordinator" / "token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        secret = token_file.read_text().strip()
        assert secret and secret != API_TOKEN

        runtime = f"http://127.0.0.1:{_port(state_dir / 'logs' / 'runtime.out')}/status"
        refused = httpx.get(runtime, headers=rest, timeout=30)
        assert refused.status_code == 401, refused.text
        allowed = httpx.get(runtime, headers={"authorization": f"Bearer {secret}"}, timeout=30)
        assert allowed.status_code == 200, allowed.text

        worker = f"127.0.0.1:{_port(state_dir / 'logs' / 'worker-w0.out')}"
        with pytest.raises(WorkerAuthError):
            WorkerClient(worker, API_TOKEN).status()
        assert WorkerClient(worker, secret).status()

        stopped = httpx.post(f"{coordinator.url}/api/v1/stop", headers=rest, timeout=300)
        assert stopped.status_code == 200, stopped.text
        assert coordinator.wait(120) == 0, coordinator.tail()
    finally:
        if coordinator.proc is not None and coordinator.proc.poll() is None:
            coordinator.kill()
