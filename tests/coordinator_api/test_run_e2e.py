"""End to end through the command line: ``sparkstep run`` with keyed_sum and 2 workers as a
child process (real broker, real Spark, real workers, a real uvicorn), driven with the
``sparkstep`` client commands (pause, checkpoint twice, resume, rescale to 3); the runtime, a
worker and the coordinator itself are SIGKILLed at random moments, and the restarted command's
``--workers 2`` rescales the recovered 3 back to 2; at the end the integrated output equals the
oracle and every step is in the read_committed output exactly once."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from pathlib import Path

import httpx

from tests.coordinator_api.fixtures import (
    CoordinatorProcess,
    metric_samples,
    pid_alive,
    sparkstep_cli,
    wait_until,
)
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import assert_keyed_sum_exactly_once, produce_keyed

PARTITIONS = (0, 1)


def _consumed(coordinator: CoordinatorProcess, topic: str, ends: dict[int, int]) -> bool:
    """The last logged step's division reaches ``ends`` (from ``/metrics``)."""
    assert coordinator.url is not None
    text = httpx.get(f"{coordinator.url}/metrics", timeout=30).text
    got = metric_samples(text, "sparkstep_input_end_offset")
    return all(
        got.get(f'{{topic="{topic}",partition="{p}"}}', -1) >= end for p, end in ends.items()
    )


def _steps_advance(coordinator: CoordinatorProcess, steps: int, timeout: float = 300) -> int:
    first = coordinator.wait_state("running", timeout)["step"]
    wait_until(
        lambda: (coordinator.status()["step"] or 0) >= first + steps,
        timeout,
        f"{steps} steps after {first}:\n{coordinator.tail()}",
    )
    return int(coordinator.status()["step"])


def _kill_child_and_recover(coordinator: CoordinatorProcess, which: str, rng: random.Random):
    _steps_advance(coordinator, rng.randrange(1, 3))
    before = coordinator.status()
    pids = before["processes"]
    victim = pids["runtime"] if which == "runtime" else rng.choice(list(pids["workers"].values()))
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: coordinator.status()["last_failure"] not in (None, before["last_failure"]),
        120,
        f"the coordinator noticing {which} {victim} died",
    )
    failure = coordinator.status()["last_failure"]
    assert str(victim) in failure["reason"] and "SIGKILL" in failure["reason"], failure
    after = coordinator.wait_state("running")
    assert after["processes"]["runtime"] != pids["runtime"]
    assert not pid_alive(pids["runtime"]) and not any(
        pid_alive(p) for p in pids["workers"].values()
    )


def test_run_pause_checkpoint_resume_and_crashes_keep_output_exactly_once(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    unique_name: str,
    long_run: bool,
) -> None:
    rng = random.Random(int(time.time()))
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 200, keys=20, seed=rng.randrange(1 << 30))
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
        "--checkpoint-interval", "4",
        "--restart-delay", "0.2",
    ]  # fmt: skip
    coordinator = CoordinatorProcess(args, tmp_path / "coordinator.log").start()
    try:
        first = coordinator.wait_state("running", 300)
        assert first["workers"] == 2 and len(first["processes"]["workers"]) == 2
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=rng.randrange(1 << 30))
        _steps_advance(coordinator, 1)
        api = ["--api", str(coordinator.url)]

        # Pause: no step advances while paused (status polled a few times, new input waiting).
        code, text, err = sparkstep_cli("pause", *api)
        assert code == 0, err
        assert text.startswith("paused at step ")
        paused_at = int(text.split()[-1])
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=rng.randrange(1 << 30))
        for _ in range(4):
            status = coordinator.status()
            assert (status["state"], status["step"]) == ("paused", paused_at)
            time.sleep(0.5)
        code, again, _ = sparkstep_cli("pause", *api)
        assert (code, again) == (0, text)  # idempotent

        # Two checkpoints while paused: versions increase, both at the paused step.
        versions = []
        for _ in range(2):
            called = time.monotonic()
            code, doc, err = sparkstep_cli("checkpoint", "--json", *api)
            elapsed_ms = math.ceil((time.monotonic() - called) * 1000)
            assert code == 0, err
            answer = json.loads(doc)
            assert answer["step"] == paused_at
            assert 0 < answer["duration_ms"] <= elapsed_ms  # inside the call, in ms
            versions.append(answer["version"])
        assert versions[1] > versions[0]
        assert coordinator.status()["checkpoint"]["version"] == versions[1]
        code, listing, _ = sparkstep_cli("checkpoints", "--json", *api)
        assert [c["version"] for c in json.loads(listing)["checkpoints"]][-2:] == versions

        code, text, err = sparkstep_cli("resume", *api)
        assert (code, text.strip()) == (0, "running"), err
        _steps_advance(coordinator, 1)

        # Rescale to 3 workers while running; the crashes below happen at the new layout.
        code, text, err = sparkstep_cli("rescale", "3", *api)
        assert code == 0, err
        assert text.startswith("rescaled (hot) to 3 workers (layout epoch 1)"), text
        status = coordinator.status()
        assert (status["workers"], status["layout_epoch"]) == (3, 1)
        assert len(status["processes"]["workers"]) == 3

        # SIGKILL the runtime, then a worker, at random moments; input keeps arriving.
        for which in ["runtime", "worker"] * (4 if long_run else 1):
            sent += produce_keyed(
                bootstrap_servers, topic, 60, keys=20, seed=rng.randrange(1 << 30)
            )
            _kill_child_and_recover(coordinator, which, rng)

        # SIGKILL the coordinator: its children die with it; the same command recovers.
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=rng.randrange(1 << 30))
        _steps_advance(coordinator, rng.randrange(1, 3))
        pids = coordinator.status()["processes"]
        coordinator.kill()
        children = [pids["runtime"], *pids["workers"].values()]
        wait_until(lambda: not any(pid_alive(p) for p in children), 60, "children to die")
        coordinator = CoordinatorProcess(args, tmp_path / "coordinator.log").start()
        coordinator.wait_state("running", 300)
        # The command still says --workers 2: recovered at the checkpoint's 3, then rescaled.
        wait_until(lambda: coordinator.status()["workers"] == 2, 300, "the rescale to 2")
        assert coordinator.status()["layout_epoch"] == 2

        sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=rng.randrange(1 << 30))
        ends = {p: high_watermark(bootstrap_servers, topic, p) for p in PARTITIONS}
        wait_until(lambda: _consumed(coordinator, topic, ends), 300, "all input consumed")
        code, text, err = sparkstep_cli("stop", "--api", str(coordinator.url))
        assert code == 0, err
        assert text.startswith("stopped at step ")
        assert coordinator.wait(120) == 0, coordinator.tail()
    finally:
        if coordinator.proc is not None and coordinator.proc.poll() is None:
            coordinator.kill()

    # The stopped coordinator: the client says so in one line.
    code, _, err = sparkstep_cli("status", "--api", str(coordinator.url))
    assert code == 2 and err.startswith("sparkstep: cannot reach the coordinator")
    assert len(err.strip().splitlines()) == 1

    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
