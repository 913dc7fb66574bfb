"""The step loop end to end: real broker, real Spark, real worker processes, an oracle."""

from __future__ import annotations

import json
import threading

import pytest

from sparkstep.examples import keyed_sum
from sparkstep.io.output import OutputWriter
from sparkstep.runtime.step import StepRunner
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
    produce_raw,
)


def test_keyed_sum_many_small_steps_checkpoint_and_in_process_recovery(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 300, keys=20, seed=1)
    produce_raw(bootstrap_servers, topic, [b"not json", None])
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    runtime = harness.build()
    harness.start()
    harness.wait_consumed({(topic, 0): 1, (topic, 1): 1})
    manifest = runtime.checkpoint(harness.state)
    assert (manifest.version, manifest.workers) == (1, 2)
    assert manifest.step > 0
    sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=2)
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    logged_before = runtime.next_step
    harness.stop()

    # A new runtime on the same stores and topics recovers from the checkpoint: it replays
    # (and discards) the steps logged after it, then goes on with new input.
    recovered = harness.build()
    assert recovered.manifest is not None and recovered.manifest.version == 1
    assert recovered.next_step == logged_before
    harness.start()
    sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=3)
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    harness.stop()

    logged = assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )
    seen = read_committed_many(bootstrap_servers, [harness.output_topic])
    assert len(logged) > 10  # many small steps (at most 50 records each)
    assert sum(r["dlq_count"] for r in logged) == 2
    assert all(
        json.loads(r.value or b"{}")["weight"] in (1, -1) for r in seen[harness.output_topic]
    )


def test_calls_on_every_worker_run_at_once_and_answer_in_worker_order() -> None:
    """A checkpoint's commits and reopens (``_on_each``): every worker's call runs at the same
    time as the others (here each waits for all of them at a barrier, which calls made one
    after the other never pass), the results come in worker order, and a failure is raised
    only once every call has ended, the first in worker order."""
    from sparkstep.runtime.driver import _on_each

    workers = [0, 1, 2]
    together = threading.Barrier(len(workers), timeout=30)
    ended: list[int] = []

    def call(worker: int) -> int:
        together.wait()
        return worker * 10

    assert _on_each(workers, call) == [0, 10, 20]

    second_failed = threading.Event()

    def failing(worker: int) -> int:
        try:
            together.wait()
            if worker == 1:  # fails last: after worker 2 has failed
                assert second_failed.wait(timeout=30)
            if worker > 0:
                raise ValueError(f"worker {worker} failed")
            return worker
        finally:
            ended.append(worker)
            if worker == 2:
                second_failed.set()

    with pytest.raises(ValueError, match="worker 1 failed"):
        _on_each(workers, failing)
    assert sorted(ended) == workers
    assert _on_each([7], lambda worker: worker + 1) == [8]


def test_recovery_opens_the_writer_while_it_describes_the_pipeline(
    harness_factory: HarnessFactory,
    bootstrap_servers: str,
    topic_factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Recovery's output writer takes over (Kafka) while the pipeline is described (Spark).
    Here the description waits until the writer's ``open`` has ended, which a recovery that
    opened the writer after describing the pipeline never lets happen; the run is then exactly
    once from a fresh state dir, whose deployment id the writer got before its manifest."""
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 40, keys=5, seed=7)
    opened = threading.Event()
    real_open, real_describe = OutputWriter.open, StepRunner.describe

    def open_then_tell(writer: OutputWriter):
        try:
            return real_open(writer)
        finally:
            opened.set()

    def describe_once_opened(runner: StepRunner, *args, **kwargs):
        assert opened.wait(timeout=60), "the writer did not open while the pipeline was described"
        return real_describe(runner, *args, **kwargs)

    monkeypatch.setattr(OutputWriter, "open", open_then_tell)
    monkeypatch.setattr(StepRunner, "describe", describe_once_opened)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    runtime = harness.build()
    assert runtime.manifest is not None and runtime.writer is not None
    assert runtime.writer.options.deployment == runtime.manifest.deployment
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()
    assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )
