"""The coordinator dies at each named point of its rescale flow (``sparkstep run`` with an armed
failpoint, cold and hot, or SIGKILLed at a random instant of a hot rescale under input; its
children die with it); running the command again recovers the layout of the
durable manifest (the old one before the runtime's commit point, the new one after), with no
store directory the manifest does not list, and the output stays exactly once. A runtime that
stalls in its part of a rescale past the rescale's deadline is stopped before the rescale is
undone, and no store its manifest names is deleted."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.failpoints import ENV_VAR, FAILPOINT_EXIT_CODE
from tests.coordinator_api.fixtures import (
    CoordinatorProcess,
    asgi_call,
    metric_samples,
    pid_alive,
    sparkstep_cli,
    wait_until,
)
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import assert_keyed_sum_exactly_once, produce_keyed

# (failpoint, whether the new layout is durable when it fires, the rescale's mode)
POINTS = [
    ("rescale.after_runtime", True, "hot"),
    ("rescale.after_checkpoint", False, "cold"),
    ("rescale.after_start", False, "hot"),
    ("rescale.before_resume", True, "cold"),
    ("rescale.after_runtime", True, "cold"),
]
RANDOM_KILL_WINDOW_S = 4.0
"""A hot rescale through the coordinator: starting the added worker (about 1 s), copying, the
pause; the random SIGKILLs of the coordinator fall in this window from the request."""


def _advanced(coordinator: CoordinatorProcess, step: int) -> Callable[[], bool]:
    return lambda: bool(coordinator.status()["step"] > step)


def _all_dead(pids: list[int]) -> Callable[[], bool]:
    return lambda: not any(pid_alive(p) for p in pids)


def _manifest(state_dir: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((state_dir / "manifest.json").read_text())
    return doc


def test_coordinator_crashes_in_rescale_recover_the_durable_layout(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str, long_run: bool
) -> None:
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    state_dir = tmp_path / "state"
    sent = produce_keyed(bootstrap_servers, topic, 100, keys=12, seed=1)

    def args(workers: int) -> list[str]:
        return [
            "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
            "--bootstrap-servers", bootstrap_servers,
            "--state-dir", str(state_dir),
            "--workers", str(workers),
            "--api-port", "0",
            "--name", unique_name,
            "--input-topic", topic,
            "--output-topic", out,
            "--max-records-per-step", "25",
            "--checkpoint-interval", "0",
        ]  # fmt: skip

    workers = 2
    points = POINTS if long_run else POINTS[:1]
    for n, (point, durable, mode) in enumerate(points):
        coordinator = CoordinatorProcess(args(workers), tmp_path / "coordinator.log")
        coordinator.env[ENV_VAR] = point  # the coordinator's own: its children do not get it
        coordinator.start()
        try:
            before = coordinator.wait_state("running", 300)
            assert before["workers"] == workers
            sent += produce_keyed(bootstrap_servers, topic, 50, keys=12, seed=10 + n)
            wait_until(_advanced(coordinator, before["step"]), 300, "a step")
            target = workers + 1
            code, _, err = sparkstep_cli(
                "rescale", str(target), "--mode", mode, "--api", str(coordinator.url)
            )
            assert code == 2 and err.startswith("sparkstep: "), err
            assert coordinator.wait(120) == FAILPOINT_EXIT_CODE, coordinator.tail()
            children = [before["processes"]["runtime"], *before["processes"]["workers"].values()]
            wait_until(_all_dead(children), 60, "the children to die")
        finally:
            if coordinator.proc is not None and coordinator.proc.poll() is None:
                coordinator.kill()
        manifest = _manifest(state_dir)
        expected = target if durable else workers
        assert manifest["layout"]["workers"] == expected, (point, manifest)
        workers = expected

    # SIGKILL the coordinator at random instants of hot rescales under input (its children
    # die with it): the layout is the old one or the new one.
    rng = random.Random(41)
    for n in range(3 if long_run else 1):
        coordinator = CoordinatorProcess(args(workers), tmp_path / "coordinator.log").start()
        try:
            before = coordinator.wait_state("running", 300)
            sent += produce_keyed(bootstrap_servers, topic, 50, keys=12, seed=50 + n)
            wait_until(_advanced(coordinator, before["step"]), 300, "a step")
            target = workers + 1 if workers < 3 else workers - 1
            thread = threading.Thread(
                target=sparkstep_cli,
                args=("rescale", str(target), "--api", str(coordinator.url)),
                daemon=True,
            )
            thread.start()
            time.sleep(rng.uniform(0, RANDOM_KILL_WINDOW_S))
            coordinator.kill()
            thread.join(120)
            children = [before["processes"]["runtime"], *before["processes"]["workers"].values()]
            wait_until(_all_dead(children), 60, "the children to die")
        finally:
            if coordinator.proc is not None and coordinator.proc.poll() is None:
                coordinator.kill()
        assert _manifest(state_dir)["layout"]["workers"] in (workers, target)
        workers = _manifest(state_dir)["layout"]["workers"]

    # Recover with the manifest's W: no unlisted store is left, and the pipeline runs on.
    coordinator = CoordinatorProcess(args(workers), tmp_path / "coordinator.log").start()
    try:
        status = coordinator.wait_state("running", 300)
        assert status["workers"] == workers
        listed = {Path(s).name for s in _manifest(state_dir)["stores"]}
        assert {p.name for p in (state_dir / "workers").iterdir()} == listed
        sent += produce_keyed(bootstrap_servers, topic, 50, keys=12, seed=99)
        ends = {p: high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}

        def consumed() -> bool:
            text = httpx.get(f"{coordinator.url}/metrics", timeout=30).text
            got = metric_samples(text, "sparkstep_input_end_offset")
            return all(
                got.get(f'{{topic="{topic}",partition="{p}"}}', -1) >= e for p, e in ends.items()
            )

        wait_until(consumed, 300, "all input consumed")
        code, _, err = sparkstep_cli("stop", "--api", str(coordinator.url))
        assert code == 0, err
        assert coordinator.wait(120) == 0
    finally:
        if coordinator.proc is not None and coordinator.proc.poll() is None:
            coordinator.kill()

    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)


def test_a_rescale_past_its_deadline_never_loses_a_store_the_manifest_names(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str
) -> None:
    """The runtime stalls in its part of a rescale, after the kept stores committed and before
    its manifest write (``rescale.after_commits`` sleeps far past the rescale's deadline). The
    rescale fails by its deadline, the runtime is stopped before anything is deleted, and the
    pipeline recovers at the old layout with every store its manifest names, exactly once."""
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    state_dir = tmp_path / "state"
    settings = CoordinatorSettings.model_validate(
        {
            "pipeline": "sparkstep.examples.keyed_sum:pipeline",
            "bootstrap_servers": bootstrap_servers,
            "state_dir": state_dir,
            "workers": 1,
            "name": unique_name,
            "input_topics": (topic,),
            "output_topic": out,
            "max_records_per_step": 25,
            "checkpoint_interval_s": 0,
            "restart_delay_s": 0.2,
            "rescale_timeout_s": 30,
        }
    )
    stall = settings.rescale_timeout_s * 10
    env = {**os.environ, ENV_VAR: f"rescale.after_commits:sleep={stall:g}"}
    supervisor = Supervisor(settings, env)
    supervisor.check()
    app = coordinator_app(supervisor, None)

    def status() -> dict[str, Any]:
        doc: dict[str, Any] = asgi_call(app, "GET", "/api/v1/status").json()
        assert doc["state"] != "failed", doc
        return doc

    supervisor.start()
    try:
        wait_until(lambda: status()["state"] == "running", 300, "running")
        sent = produce_keyed(bootstrap_servers, topic, 100, keys=12, seed=5)
        step = status()["step"]
        wait_until(lambda: status()["step"] > step, 300, "a step")

        refused = asgi_call(app, "POST", "/api/v1/rescale", json={"workers": 2})
        assert refused.status_code == 503, refused.text
        assert "deadline" in refused.json()["detail"]

        wait_until(lambda: status()["state"] == "running", 300, "running again")
        manifest = _manifest(state_dir)
        assert manifest["layout"]["workers"] == 1
        assert all((state_dir / store).is_dir() for store in manifest["stores"])

        sent += produce_keyed(bootstrap_servers, topic, 50, keys=12, seed=6)
        ends = {p: high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}

        def consumed() -> bool:
            text = asgi_call(app, "GET", "/metrics").text
            got = metric_samples(text, "sparkstep_input_end_offset")
            return all(
                got.get(f'{{topic="{topic}",partition="{p}"}}', -1) >= e for p, e in ends.items()
            )

        wait_until(consumed, 300, "all input consumed")
        assert asgi_call(app, "POST", "/api/v1/stop").status_code == 200
        assert supervisor.wait(120)
    finally:
        supervisor.close()
    listed = {Path(s).name for s in _manifest(state_dir)["stores"]}
    assert {p.name for p in (state_dir / "workers").iterdir()} == listed
    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
