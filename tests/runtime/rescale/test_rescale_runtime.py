"""Runtime.rescale in process: keyed_sum under continuous input, rescaled 2 -> 3 -> 1 -> 4,
cold and hot.

Real broker, real Spark, real worker processes. The test plays the coordinator around
``Runtime.rescale``: cold: pause, checkpoint, start the added workers with ``--create-version``,
rescale, stop and delete the retired workers, resume; hot: start the added workers at the last
checkpoint while the loop runs, rescale (the runtime pauses and resumes its loop itself), stop
and delete the retired workers.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from typing import Any

import pytest
from pyspark.sql import SparkSession

from sparkstep.examples import keyed_sum
from sparkstep.ids import WorkerId
from sparkstep.runtime.errors import RescaleRequestError
from sparkstep.runtime.layout import plan_rescale, shard_column
from sparkstep.runtime.manifest import read_manifest
from sparkstep.runtime.rescale import new_store_path
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    Harness,
    HarnessFactory,
    integrate,
    keyed_sum_oracle,
    produce_keyed,
    step_header,
    wait_until,
)
from tests.runtime.worker.fixtures import WorkerFactory


class Producer(threading.Thread):
    """Produces small keyed batches until stopped: input keeps arriving during rescales."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.sent: list[dict[str, Any]] = []
        self.halt = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        seed = 100
        try:
            while not self.halt.is_set():
                self.sent += produce_keyed(self.bootstrap, self.topic, 10, keys=40, seed=seed)
                seed += 1
                self.halt.wait(0.5)
        except BaseException as exc:
            self.failure = exc

    def stop(self) -> list[dict[str, Any]]:
        self.halt.set()
        self.join(60)
        assert self.failure is None, self.failure
        return self.sent


def held_keys(harness: Harness) -> Counter[int]:
    """Keys per shard over every worker; asserts each worker holds only shards it owns."""
    assert harness.runtime is not None and harness.runtime.manifest is not None
    layout = harness.runtime.manifest.layout
    total: Counter[int] = Counter()
    for w, client in enumerate(harness.runtime.workers):
        doc = client.inspect()
        assert doc["layout_epoch"] == layout.epoch
        owned = set(layout.shards_of(WorkerId(w)))
        held = {int(s): n for s, n in doc["tables"].get("state.sums", {}).items()}
        assert set(held) <= owned, f"worker {w} holds shards {sorted(set(held) - owned)}"
        total.update(held)
    return total


def rescale(
    harness: Harness,
    worker_factory: WorkerFactory,
    n: int,
    probe_refusal: bool = False,
    hot: bool = False,
) -> dict[str, Any]:
    """The coordinator's flow around Runtime.rescale (the loop is running)."""
    runtime, state = harness.runtime, harness.state
    assert runtime is not None and state is not None and runtime.manifest is not None
    if hot:
        manifest = runtime.manifest
        paused = runtime.next_step  # the rescale's step is at least this one
    else:
        paused = state.pause(120)
        manifest = runtime.checkpoint(state)
        assert manifest.step == paused
    old = runtime.manifest
    if probe_refusal:
        # An added worker at the wrong version is refused before anything changes.
        wrong = worker_factory(
            store=harness.state_dir / new_store_path(old.workers, old.epoch + 1),
            shards=harness.pipeline.shards,
            args=("--create-version", str(manifest.version + 5)),
        )
        clients = [*runtime.workers, *(wrong.client(harness.token) for _ in range(n - old.workers))]
        with pytest.raises(RescaleRequestError, match="--create-version"):
            runtime.rescale(state, clients[:n])
        assert state.failure is None and runtime.manifest == old
        wrong.client(harness.token).shutdown()
        assert wrong.wait(30) == 0
    added = [
        worker_factory(
            store=harness.state_dir / new_store_path(i, old.epoch + 1),
            shards=harness.pipeline.shards,
            args=("--create-version", str(manifest.version)),
        )
        for i in range(old.workers, n)
    ]
    clients = [*runtime.workers[:n], *(p.client(harness.token) for p in added)]
    retired = [client.address for client in runtime.workers[n:]]
    result = runtime.rescale(state, clients, hot=hot)
    assert result.mode == ("hot" if hot else "cold")
    assert read_manifest(harness.state_dir) == runtime.manifest
    assert runtime.manifest.layout == plan_rescale(old.layout, n)
    assert list(result.retired) == retired
    for proc, store in zip(harness.workers[n:], old.stores[n:], strict=True):
        proc.client(harness.token).shutdown()
        assert proc.wait(30) == 0
        shutil.rmtree(harness.state_dir / store)
    harness.workers = [*harness.workers[:n], *added]
    if hot:
        assert state.snapshot().phase.value == "running"  # resumed by the rescale itself
        assert result.step >= paused and result.rounds >= 1
        paused = result.step
    else:
        held_keys(harness)
        state.resume()
    return {"result": result, "before": (old.epoch, manifest.version, paused), "old": old.layout}


@pytest.mark.parametrize("hot", [False, True], ids=["cold", "hot"])
def test_keyed_sum_rescaled_2_3_1_4_under_input_is_exactly_once(
    hot: bool,
    harness_factory: HarnessFactory,
    worker_factory: WorkerFactory,
    bootstrap_servers: str,
    topic_factory,
    spark: SparkSession,
) -> None:
    topic = topic_factory("numbers", partitions=2)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic}, workers=2)
    harness.max_records_per_step = 200
    runtime = harness.build()
    harness.start()
    producer = Producer(bootstrap_servers, topic)
    producer.start()
    for n in (3, 1, 4):
        first = runtime.next_step
        wait_until(lambda: runtime.next_step >= first + 2, 240, "two steps")  # noqa: B023
        done = rescale(harness, worker_factory, n, probe_refusal=n == 3 and not hot, hot=hot)
        result = done["result"]
        epoch, version, paused = done["before"]
        assert (result.layout_epoch, result.workers) == (epoch + 1, n)
        assert (result.version, result.step) == (version + 1, paused)
        assert runtime.manifest is not None
        assert result.shards_moved == len(done["old"].moves_to(runtime.manifest.layout)) > 0
        assert result.bytes_moved > 0 and result.keys_moved > 0
    # Steps of the last layout, with input, before the input stops (a short hot pause and fast
    # small steps could otherwise leave every record to the steps before the last rescale).
    last = runtime.next_step
    wait_until(lambda: runtime.next_step >= last + 2, 240, "two steps after the rescales")
    sent = producer.stop()
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    harness.stop()

    seen = read_committed_many(bootstrap_servers, [harness.output_topic, f"{harness.name}.steps"])
    oracle = keyed_sum_oracle(sent)
    expected = {(("count", c), ("key", k), ("sum", s)): 1 for k, (s, c) in oracle.items()}
    assert integrate(seen[harness.output_topic]) == expected
    logged = [json.loads(r.value or b"{}") for r in seen[f"{harness.name}.steps"]]
    assert [r["step"] for r in logged] == list(range(len(logged)))
    assert {step_header(r) for r in seen[harness.output_topic]} <= {r["step"] for r in logged}
    epochs = [r["epoch"] for r in logged]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2, 3}
    # Each worker holds exactly the keys of its shards: the shard of every key (Spark's own
    # pmod(xxhash64)) and the keys per shard over all workers agree.
    keys = spark.createDataFrame([(k,) for k in oracle], "key string")
    shards = keys.select(shard_column(["key"], harness.pipeline.shards).alias("s")).collect()
    assert held_keys(harness) == Counter(int(row["s"]) for row in shards)
