"""Crash tests of the runtime process: killed at every named failpoint and at random instants,
its stateful-stage tasks killed after their apply (Spark retries them), its workers SIGKILLed
mid-step; every restart recovers and the output matches the oracle with every step exactly
once. Every other start of the runtime runs every step wide (``--narrow-step-offsets 0``: the
plan with exchanges, planned ahead on its twin while a step runs), the others narrow, so a
replay also runs its steps the other way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sparkstep.failpoints import FAILPOINT_EXIT_CODE
from sparkstep.runtime.control import ControlError
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import (
    RuntimeFactory,
    RuntimeProcess,
    assert_keyed_sum_exactly_once,
    produce_keyed,
    wait_until,
)
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess

# (failpoint, needs a checkpoint request to be reached)
FAILPOINTS = [
    ("runtime.after_division@3", False),
    ("runtime.after_stage@2", False),
    ("runtime.after_write@2", False),
    ("checkpoint.between_commits", True),
    ("checkpoint.after_write", True),
    ("checkpoint.after_commits", True),
    ("checkpoint.after_reopen", True),
    ("checkpoint.after_manifest", True),
]
# Every failpoint of the step loop, and the checkpoint's riskiest instants: one store committed,
# the other not; and the stores reopened at v+1 and the loop running on them, the log holding
# every step below the checkpoint, while the manifest still names v. --long adds the other
# checkpoint failpoints (the coordinator's tests checkpoint and crash around checkpoints too).
DEFAULT_FAILPOINTS = FAILPOINTS[:5]


class Cluster:
    """Two workers and the runtime process on one state dir, restarted at will."""

    def __init__(
        self,
        tmp: Path,
        workers: WorkerFactory,
        runtimes: RuntimeFactory,
        token_file: Path,
        args: list[str],
    ) -> None:
        self.tmp = tmp
        self.runtime_factory = runtimes
        self.worker_factory = workers
        self.token_file = token_file
        self.token = token_file.read_text().strip()
        self.stores = [tmp / "state" / "workers" / f"w{i}" for i in range(2)]
        self.stores[0].parent.mkdir(parents=True, exist_ok=True)
        self.workers: list[WorkerProcess] = [workers(store=s, shards=256) for s in self.stores]
        self.args = args
        self.runtime: RuntimeProcess | None = None
        self.starts = 0

    def start_runtime(self, failpoint: str | None = None) -> RuntimeProcess:
        addresses = [arg for w in self.workers for arg in ("--worker", f"127.0.0.1:{w.port}")]
        self.starts += 1
        wide = ["--narrow-step-offsets", "0"] if self.starts % 2 == 0 else []
        self.runtime = self.runtime_factory(
            [*self.args, *wide, *addresses, "--token-file", str(self.token_file)],
            self.tmp / "runtime.log",
            failpoint,
        ).start()
        return self.runtime

    def restart_worker(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i] = self.worker_factory(store=self.stores[i], shards=256)


def _step(runtime: RuntimeProcess, token: str) -> int:
    return int(runtime.control(token).status()["step"])


def _crash_at_failpoint(cluster: Cluster, point: str, needs_checkpoint: bool) -> None:
    runtime = cluster.start_runtime(point)
    if needs_checkpoint and runtime.port is not None:
        with pytest.raises(ControlError):
            runtime.control(cluster.token).checkpoint()
    code = runtime.wait(240)
    assert code == FAILPOINT_EXIT_CODE, f"{point}: exit {code}\n{runtime.tail()}"


def _tasks_die_after_apply(cluster: Cluster) -> None:
    """Every stateful-stage task dies after its apply succeeded, on its first attempt only;
    Spark retries it, the worker answers with the recorded delta, state is applied once."""
    runtime = cluster.start_runtime("stage.after_apply")
    first = _step(runtime, cluster.token)
    wait_until(lambda: _step(runtime, cluster.token) > first + 2, 240, "three steps")
    runtime.kill()
    assert "failpoint stage.after_apply fired" in runtime.log.read_text(errors="replace")


def _kill_a_worker_mid_run(cluster: Cluster, rng: random.Random) -> None:
    runtime = cluster.start_runtime()
    first = _step(runtime, cluster.token)
    wait_until(lambda: _step(runtime, cluster.token) > first + 1, 120, "two steps")
    victim = rng.randrange(len(cluster.workers))
    cluster.workers[victim].kill()
    assert runtime.wait(240) != 0, runtime.tail()
    cluster.restart_worker(victim)


def _kill_runtime_at_a_random_step(cluster: Cluster, rng: random.Random) -> None:
    runtime = cluster.start_runtime()
    target = _step(runtime, cluster.token) + rng.randrange(1, 5)
    wait_until(lambda: _step(runtime, cluster.token) >= target, 120, f"step {target}")
    runtime.kill()


def _consumed(runtime: RuntimeProcess, token: str, ends: dict[str, int]) -> bool:
    status = runtime.control(token).status()
    got = status["input_ends"]
    return all(got.get(k, 0) >= v for k, v in ends.items())


def test_runtime_crashes_everywhere_and_output_stays_exactly_once(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
    long_run: bool,
) -> None:
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 400, keys=25, seed=7)
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(tmp_path / "state"),
        "--name", unique_name,
        "--input-topic", topic,
        "--output-topic", out,
        "--max-records-per-step", "20",
    ]  # fmt: skip
    cluster = Cluster(tmp_path, worker_factory, runtime_factory, token_file, args)
    rng = random.Random(11)
    for point, needs_checkpoint in FAILPOINTS if long_run else DEFAULT_FAILPOINTS:
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=25, seed=rng.randrange(1 << 30))
        _crash_at_failpoint(cluster, point, needs_checkpoint)
    sent += produce_keyed(bootstrap_servers, topic, 60, keys=25, seed=rng.randrange(1 << 30))
    _tasks_die_after_apply(cluster)
    if long_run:  # by default the coordinator's end-to-end test SIGKILLs a worker mid-run
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=25, seed=rng.randrange(1 << 30))
        _kill_a_worker_mid_run(cluster, rng)
    # Random kills of the runtime: many with --long; by default the coordinator's end-to-end
    # test and the rescale crash test kill it at random instants.
    for _ in range(20 if long_run else 0):
        sent += produce_keyed(bootstrap_servers, topic, 60, keys=25, seed=rng.randrange(1 << 30))
        _kill_runtime_at_a_random_step(cluster, rng)

    runtime = cluster.start_runtime()
    ends = {f"{topic}/{p}": high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    wait_until(lambda: _consumed(runtime, cluster.token, ends), 300, "all input consumed")
    stopped = runtime.control(cluster.token).stop()
    assert stopped["state"] == "stopped"
    assert runtime.wait(60) == 0

    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
