"""Crash tests of rescale, cold and hot: the runtime as a child process driven through its
control endpoint.

The test plays the coordinator: pause, checkpoint, start the added workers, ``POST /rescale``.
The runtime dies at every rescale failpoint, and at random instants (SIGKILL of the runtime or
of a worker) during rescales. After each crash the test restarts like the coordinator: read the
manifest, delete store directories it does not list, start its workers on its stores in order,
then the runtime. The manifest must name the old layout at ``v`` or the new one at ``v + 1``;
recovery checks every store's layout epoch against it (a mix would be refused); the output
integrated at the end equals the oracle with every step exactly once.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from sparkstep.failpoints import FAILPOINT_EXIT_CODE
from sparkstep.ids import WorkerId
from sparkstep.runtime.control import ControlError
from sparkstep.runtime.layout import plan_rescale, shard_column
from sparkstep.runtime.manifest import Manifest, read_manifest
from sparkstep.runtime.rescale import new_store_path
from sparkstep.runtime.worker.service import EXPORTS_DIR, IMPORTS_DIR
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import (
    RuntimeFactory,
    RuntimeProcess,
    assert_keyed_sum_exactly_once,
    keyed_sum_oracle,
    produce_keyed,
    wait_until,
)
from tests.runtime.rescale.test_rescale_runtime import Producer
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess

S = 256
FAILPOINTS = [
    "rescale.after_plan",
    "rescale.after_export",
    "rescale.between_imports",
    "rescale.after_import",
    "rescale.after_drop",
    "rescale.after_layout",
    "rescale.between_commits",
    "rescale.after_commits",
    "rescale.after_manifest",
]
# The default run crashes at these (one store committed and not the other, just after the
# commit point); --long crashes at every failpoint of the procedure.
DEFAULT_FAILPOINTS = [
    "rescale.between_commits",
    "rescale.after_manifest",
]
AFTER_COMMIT_POINT = {"rescale.after_manifest"}
# W cycles through layouts whose changes move shards between at least two (source, target)
# pairs, so the failpoint between imports is reached.
TARGETS = {2: 3, 3: 2}


class Cluster:
    """The processes of one state dir, restarted the coordinator's way."""

    def __init__(
        self,
        tmp: Path,
        factory: WorkerFactory,
        runtimes: RuntimeFactory,
        token_file: Path,
        args: list[str],
    ) -> None:
        self.tmp = tmp
        self.runtime_factory = runtimes
        self.state_dir = tmp / "state"
        (self.state_dir / "workers").mkdir(parents=True)
        self.factory = factory
        self.token_file = token_file
        self.token = token_file.read_text().strip()
        self.args = args
        self.workers: list[WorkerProcess] = []
        self.runtime: RuntimeProcess | None = None

    def manifest(self) -> Manifest | None:
        return read_manifest(self.state_dir)

    def restart_workers(self) -> None:
        """Kill every worker; delete unlisted store dirs; start the manifest's workers."""
        for proc in self.workers:
            proc.kill()
        manifest = self.manifest()
        stores = list(manifest.stores) if manifest else ["workers/w0", "workers/w1"]
        for path in (self.state_dir / "workers").iterdir():
            if path.is_dir() and f"workers/{path.name}" not in stores:
                shutil.rmtree(path)
        self.workers = [self.factory(store=self.state_dir / s, shards=S) for s in stores]

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{w.port}" for w in self.workers]

    def start_runtime(self, failpoint: str | None = None) -> RuntimeProcess:
        args = [arg for a in self.addresses() for arg in ("--worker", a)]
        runtime = self.runtime_factory(
            [*self.args, *args, "--token-file", str(self.token_file)],
            self.tmp / "runtime.log",
            failpoint,
        ).start()
        assert runtime.port is not None, runtime.tail()
        self.runtime = runtime
        status = runtime.control(self.token).status()
        manifest = self.manifest()
        assert manifest is not None
        assert status["layout"] == {
            "epoch": manifest.epoch,
            "workers": manifest.workers,
            "shards_per_worker": manifest.layout.shard_counts(),
        }
        return runtime

    def prepare_rescale(
        self, runtime: RuntimeProcess, ends: dict[str, int] | None = None
    ) -> tuple[Manifest, int, list[str]]:
        """Wait until the input reaches ``ends`` (if given), pause, checkpoint, start the added
        workers; returns (the checkpoint's manifest, N, the new layout's addresses)."""
        control = runtime.control(self.token)
        if ends is not None:
            wait_until(lambda: consumed(control.status(), ends), 300, "input consumed")
        control.pause()
        control.checkpoint()
        manifest = self.manifest()
        assert manifest is not None
        n = TARGETS[manifest.workers]
        added = [
            self.factory(
                store=self.state_dir / new_store_path(i, manifest.epoch + 1),
                shards=S,
                args=("--create-version", str(manifest.version)),
            )
            for i in range(manifest.workers, n)
        ]
        self.workers += added
        return manifest, n, self.addresses()[:n]

    def check_outcome(self, before: Manifest, n: int, new: bool | None) -> None:
        """The manifest is the old layout at v or the new one at v + 1 (``new`` None: either)."""
        after = self.manifest()
        assert after is not None
        old_one = (before.epoch, before.workers, before.version, before.layout)
        new_one = (
            before.epoch + 1,
            n,
            before.version + 1,
            plan_rescale(before.layout, n),
        )
        got = (after.epoch, after.workers, after.version, after.layout)
        assert got in (old_one, new_one)
        if new is not None:
            assert got == (new_one if new else old_one)
        assert after.step == before.step


def consumed(status: dict[str, Any], ends: dict[str, int]) -> bool:
    return all(status["input_ends"].get(k, 0) >= v for k, v in ends.items())


def _failpoint_trial(
    cluster: Cluster, point: str, ends: dict[str, int] | None, requests: bool
) -> float:
    """One rescale killed at ``point``; returns the seconds the call ran before the crash.

    ``requests``: also check the refusals of the control endpoint (409 when not paused, 422
    for bad bodies and a kept worker at another address), which change nothing."""
    runtime = cluster.start_runtime(point)
    control = runtime.control(cluster.token)
    if requests:
        with pytest.raises(ControlError) as running:
            control.rescale(2, cluster.addresses())
        assert running.value.status == 409  # not paused
    before, n, addresses = cluster.prepare_rescale(runtime, ends)
    if requests:
        for workers, given in ((S + 1, addresses), (n, addresses[:-1]), (0, [])):
            with pytest.raises(ControlError) as refused:
                control.rescale(workers, given)
            assert refused.value.status == 422
        with pytest.raises(ControlError) as swapped:
            control.rescale(n, [addresses[1], addresses[0], *addresses[2:]])
        assert swapped.value.status == 422 and "must keep its address" in str(swapped.value)
    started = time.monotonic()
    with pytest.raises(ControlError):
        control.rescale(n, addresses)
    elapsed = time.monotonic() - started
    code = runtime.wait(120)
    assert code == FAILPOINT_EXIT_CODE, f"{point}: exit {code}\n{runtime.tail()}"
    cluster.check_outcome(before, n, point in AFTER_COMMIT_POINT)
    cluster.restart_workers()
    return elapsed


def _random_kill_trial(
    cluster: Cluster, rng: random.Random, window: float, ends: dict[str, int] | None
) -> None:
    runtime = cluster.start_runtime()
    before, n, addresses = cluster.prepare_rescale(runtime, ends)
    answers: list[object] = []

    def call() -> None:
        try:
            answers.append(runtime.control(cluster.token).rescale(n, addresses))
        except ControlError as exc:
            answers.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    time.sleep(rng.uniform(0, window))  # the instant of the kill is the trial's random input
    victims: list[RuntimeProcess | WorkerProcess] = [runtime, *cluster.workers]
    victim = victims[rng.randrange(len(victims))]
    victim.kill()
    thread.join(120)
    assert answers, "the rescale call never returned"
    if victim is not runtime:
        runtime.kill()
    cluster.check_outcome(before, n, None)
    cluster.restart_workers()


def _held_keys(cluster: Cluster, manifest: Manifest) -> Counter[int]:
    total: Counter[int] = Counter()
    for w, proc in enumerate(cluster.workers):
        doc = proc.client().inspect()
        assert doc["layout_epoch"] == manifest.epoch
        owned = set(manifest.layout.shards_of(WorkerId(w)))
        held = {int(s): c for s, c in doc["tables"].get("state.sums", {}).items()}
        assert set(held) <= owned
        total.update(held)
    return total


def test_rescale_crashes_recover_old_or_new_layout_exactly_once(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
    spark: SparkSession,
    long_run: bool,
) -> None:
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(tmp_path / "state"),
        "--name", unique_name,
        "--input-topic", topic,
        "--output-topic", out,
        "--max-records-per-step", "40",
    ]  # fmt: skip
    cluster = Cluster(tmp_path, worker_factory, runtime_factory, token_file, args)
    cluster.restart_workers()
    rng = random.Random(23)

    def more_input(n: int) -> dict[str, int]:
        seed = rng.randrange(1 << 30)
        sent.extend(produce_keyed(bootstrap_servers, topic, n, keys=60, seed=seed))
        return {f"{topic}/{p}": high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}

    # Input is consumed before the first trial (the state to move); the other trials find no
    # new input, so pausing does not wait for a step (each trial is one runtime start).
    sent: list[dict[str, Any]] = []
    ends: dict[str, int] | None = more_input(200)
    window = 0.0
    for point in FAILPOINTS if long_run else DEFAULT_FAILPOINTS:
        elapsed = _failpoint_trial(cluster, point, ends, requests=ends is not None)
        if point in AFTER_COMMIT_POINT:
            window = elapsed  # the procedure up to its manifest
        ends = None
    # Random kills: the loop is paused during a rescale, so new input only matters between
    # trials (the long run adds some before each; it is consumed by the next start's steps).
    for _ in range(20 if long_run else 1):
        ends = more_input(40) if long_run else None
        _random_kill_trial(cluster, rng, window, ends)

    ends = more_input(100)
    runtime = cluster.start_runtime()
    control = runtime.control(cluster.token)
    wait_until(lambda: consumed(control.status(), ends), 300, "all input consumed")
    assert control.stop()["state"] == "stopped"
    assert runtime.wait(60) == 0
    manifest = read_manifest(cluster.state_dir)
    assert manifest is not None
    assert not any((cluster.state_dir / s / EXPORTS_DIR).exists() for s in manifest.stores)

    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
    oracle = keyed_sum_oracle(sent)
    manifest = cluster.manifest()
    assert manifest is not None and manifest.epoch > 0
    # The stores (open after the final checkpoint) hold exactly the keys of their shards.
    keys = spark.createDataFrame([(k,) for k in oracle], "key string")
    shards = keys.select(shard_column(["key"], S).alias("s")).collect()
    assert _held_keys(cluster, manifest) == Counter(int(row["s"]) for row in shards)


# -- hot ----------------------------------------------------------------------------------------

HOT_FAILPOINTS = [
    "rescale.after_plan",
    "rescale.after_track",
    "rescale.after_precopy",
    # A round needs a step between the copy and the check: the copy's end waits 3 s first.
    "rescale.after_precopy:sleep=3,rescale.after_round",
    "rescale.after_pause",
    "rescale.after_import",
    "rescale.after_drop",
    "rescale.between_commits",
    "rescale.after_manifest",
]
# The default run: while copying, at the start of the pause, just after the commit point.
DEFAULT_HOT_FAILPOINTS = [
    "rescale.after_precopy",
    "rescale.after_pause",
    "rescale.after_manifest",
]


def _hot_outcome(cluster: Cluster, before: Manifest, n: int, new: bool | None) -> None:
    """The manifest is the old layout at v (its step) or the new one at v + 1, whose step is
    the pause's, at or after the old one (``new`` None: either)."""
    after = cluster.manifest()
    assert after is not None
    old_one = (before.epoch, before.workers, before.version, before.layout)
    new_one = (before.epoch + 1, n, before.version + 1, plan_rescale(before.layout, n))
    got = (after.epoch, after.workers, after.version, after.layout)
    assert got in (old_one, new_one)
    if new is not None:
        assert got == (new_one if new else old_one)
    assert after.step == before.step if got == old_one else after.step >= before.step


def _prepare_hot(cluster: Cluster, runtime: RuntimeProcess) -> tuple[Manifest, int, list[str]]:
    """With the loop running and a step taken: start the added workers at the last checkpoint;
    returns (that manifest, N, the new layout's addresses)."""
    control = runtime.control(cluster.token)
    first = control.status()["step"]
    wait_until(lambda: control.status()["step"] > first, 300, "a step under input")
    manifest = cluster.manifest()
    assert manifest is not None
    n = TARGETS[manifest.workers]
    cluster.workers += [
        cluster.factory(
            store=cluster.state_dir / new_store_path(i, manifest.epoch + 1),
            shards=S,
            args=("--create-version", str(manifest.version)),
        )
        for i in range(manifest.workers, n)
    ]
    return manifest, n, cluster.addresses()[:n]


def _hot_random_kill_trial(cluster: Cluster, rng: random.Random, window: float) -> None:
    """A hot rescale; at a random instant of its first ``window`` seconds (copying, or paused)
    the runtime or one of the workers is killed."""
    runtime = cluster.start_runtime()
    before, n, addresses = _prepare_hot(cluster, runtime)
    answers: list[object] = []

    def call() -> None:
        try:
            answers.append(runtime.control(cluster.token).rescale(n, addresses, mode="hot"))
        except ControlError as exc:
            answers.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    time.sleep(rng.uniform(0, window))  # the trial's random instant
    victims: list[RuntimeProcess | WorkerProcess] = [runtime, *cluster.workers]
    victims[rng.randrange(len(victims))].kill()
    thread.join(120)
    assert answers, "the rescale call never returned"
    runtime.kill()
    _hot_outcome(cluster, before, n, None)
    cluster.restart_workers()


def test_hot_rescale_crashes_under_input_recover_exactly_once(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
    spark: SparkSession,
    long_run: bool,
) -> None:
    """Input keeps arriving; hot rescales die at each failpoint of the hot procedure, and at
    random instants while copying and while paused (SIGKILL of the runtime or a worker).
    Rounds of changes run whenever anything changed (``--rescale-catchup-keys 0``)."""
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(tmp_path / "state"),
        "--name", unique_name,
        "--input-topic", topic,
        "--output-topic", out,
        "--max-records-per-step", "40",
        "--rescale-catchup-keys", "0",
    ]  # fmt: skip
    cluster = Cluster(tmp_path, worker_factory, runtime_factory, token_file, args)
    cluster.restart_workers()
    producer = Producer(bootstrap_servers, topic)
    producer.start()
    rng = random.Random(29)
    window = 0.0
    try:
        for point in HOT_FAILPOINTS if long_run else DEFAULT_HOT_FAILPOINTS:
            runtime = cluster.start_runtime(point)
            before, n, addresses = _prepare_hot(cluster, runtime)
            started = time.monotonic()
            with pytest.raises(ControlError):
                runtime.control(cluster.token).rescale(n, addresses, mode="hot")
            if point == "rescale.after_manifest":
                window = time.monotonic() - started  # the procedure up to its commit point
            code = runtime.wait(120)
            assert code == FAILPOINT_EXIT_CODE, f"{point}: exit {code}\n{runtime.tail()}"
            _hot_outcome(cluster, before, n, point == "rescale.after_manifest")
            cluster.restart_workers()
        for _ in range(20 if long_run else 2):
            _hot_random_kill_trial(cluster, rng, window)
    finally:
        sent = producer.stop()

    ends = {f"{topic}/{p}": high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    runtime = cluster.start_runtime()
    control = runtime.control(cluster.token)
    wait_until(lambda: consumed(control.status(), ends), 300, "all input consumed")
    assert control.stop()["state"] == "stopped"
    assert runtime.wait(60) == 0
    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", sent)
    manifest = cluster.manifest()
    assert manifest is not None and manifest.epoch > 0
    for store in manifest.stores:  # nothing staged or exported is left
        for leftover in (EXPORTS_DIR, IMPORTS_DIR):
            path = cluster.state_dir / store / leftover
            assert not path.exists() or not any(path.iterdir()), path
    oracle = keyed_sum_oracle(sent)
    keys = spark.createDataFrame([(k,) for k in oracle], "key string")
    shards = keys.select(shard_column(["key"], S).alias("s")).collect()
    assert _held_keys(cluster, manifest) == Counter(int(row["s"]) for row in shards)
