"""Pipelined writes: step s+1 runs on Spark while step s's transaction is written, and a pause,
a stop or a failure never leaves a write behind (driver module docstring, "Pipelined writes").

The hooks below wrap the real OutputWriter.write and StepRunner.run to observe and delay them;
the broker, Spark, the workers and the step log are real.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from sparkstep.examples import keyed_sum
from sparkstep.io.errors import StreamIOError
from sparkstep.io.output import OutputWriter
from sparkstep.runtime.runstate import LoopPhase, RunState
from sparkstep.runtime.step import StepRunner
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
)

_WAIT_S = 120.0


def _last_logged_step(bootstrap: str, name: str) -> int | None:
    records = read_committed_many(bootstrap, [f"{name}.steps"])[f"{name}.steps"]
    steps = [int(json.loads(r.value)["step"]) for r in records if r.value]
    return max(steps, default=None)


def test_next_step_runs_while_a_write_is_in_flight_and_a_pause_waits_for_it(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory, monkeypatch
) -> None:
    topic = topic_factory("numbers", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 200, keys=9, seed=21)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic}, max_records_per_step=25)

    staged = {step: threading.Event() for step in range(10)}
    seen: dict[str, Any] = {}
    pausing: list[threading.Thread] = []
    real_run, real_write = StepRunner.run, OutputWriter.write

    def pause() -> None:
        assert harness.state is not None
        seen["paused_at"] = harness.state.pause(timeout=_WAIT_S)

    def wait_phase(*phases: LoopPhase, timeout: float) -> LoopPhase:
        assert harness.state is not None
        deadline = time.monotonic() + timeout
        while harness.state.snapshot().phase not in phases and time.monotonic() < deadline:
            time.sleep(0.05)
        return harness.state.snapshot().phase

    def observed_run(self: StepRunner, division: Any, *args: Any, **kw: Any) -> Any:
        if division.step == 3:  # a pause asked while step 3 is on Spark, before its write
            pausing.append(threading.Thread(target=pause))
            pausing[0].start()
        if division.step in staged:  # after the pause started: the test thread joins it
            staged[division.step].set()
        if division.step == 3:
            assert wait_phase(LoopPhase.PAUSE, timeout=_WAIT_S) is LoopPhase.PAUSE
        return real_run(self, division, *args, **kw)

    def delayed_write(self: OutputWriter, step: int, *args: Any, **kw: Any) -> Any:
        if step == 1:  # hold step 1's write until step 2 is on Spark: only a pipeline gets there
            seen["overlapped"] = staged[2].wait(_WAIT_S)
        if step == 3:  # the loop is at its top with this write in flight: it must not pause yet
            seen["phase_during_write"] = wait_phase(LoopPhase.PAUSED, timeout=5)
        return real_write(self, step, *args, **kw)

    monkeypatch.setattr(StepRunner, "run", observed_run)
    monkeypatch.setattr(OutputWriter, "write", delayed_write)
    harness.build()
    harness.start()
    assert harness.state is not None

    assert staged[3].wait(_WAIT_S), "step 3 never ran"
    pausing[0].join(_WAIT_S)
    assert seen["overlapped"], "step 2 did not start on Spark while step 1 was being written"
    assert seen["phase_during_write"] is LoopPhase.PAUSE, "paused with a write in flight"
    assert seen["paused_at"] == 4
    assert _last_logged_step(bootstrap_servers, harness.name) == 3

    harness.state.resume()
    harness.wait_consumed({(topic, 0): high_watermark(bootstrap_servers, topic, 0)})
    harness.stop()
    assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )


def test_a_checkpoint_lets_the_next_step_run_while_the_write_in_flight_commits(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory, monkeypatch
) -> None:
    """The checkpoint pauses at step 3 with step 2's write in flight; step 3 runs on the
    reopened stores before that write commits, and the manifest waits for it (driver module
    docstring, "Checkpoint")."""
    topic = topic_factory("numbers", partitions=1)
    sent = produce_keyed(bootstrap_servers, topic, 200, keys=9, seed=23)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic}, max_records_per_step=25)
    runtime = harness.build()
    assert runtime.manifest is not None
    before = runtime.manifest.version
    step3_on_spark = threading.Event()
    seen: dict[str, Any] = {}
    checkpointing: list[threading.Thread] = []
    real_top, real_run, real_write = RunState.at_top, StepRunner.run, OutputWriter.write

    def checkpoint() -> None:
        seen["manifest"] = runtime.checkpoint(harness.state)

    def observed_top(self: RunState, step: Any, *args: Any, **kw: Any) -> Any:
        if step == 3 and not checkpointing:  # the checkpoint asked at step 3's top
            checkpointing.append(threading.Thread(target=checkpoint))
            checkpointing[0].start()
            while self.snapshot().phase is not LoopPhase.PAUSE:
                time.sleep(0.01)
        return real_top(self, step, *args, **kw)

    def observed_run(self: StepRunner, division: Any, *args: Any, **kw: Any) -> Any:
        if division.step == 3:
            assert runtime.manifest is not None
            seen["manifest_version_during_step_3"] = runtime.manifest.version
            step3_on_spark.set()
        return real_run(self, division, *args, **kw)

    def held_write(self: OutputWriter, step: int, *args: Any, **kw: Any) -> Any:
        if step == 2:  # held until step 3 is on Spark: only a checkpoint that resumed gets there
            seen["overlapped"] = step3_on_spark.wait(_WAIT_S / 2)
        return real_write(self, step, *args, **kw)

    monkeypatch.setattr(RunState, "at_top", observed_top)
    monkeypatch.setattr(StepRunner, "run", observed_run)
    monkeypatch.setattr(OutputWriter, "write", held_write)
    harness.start()
    assert step3_on_spark.wait(_WAIT_S), "step 3 never ran"
    checkpointing[0].join(_WAIT_S)
    assert seen["overlapped"], "the checkpoint held step 3 until step 2's write had committed"
    assert seen["manifest_version_during_step_3"] == before  # the manifest waited for the write
    assert (seen["manifest"].version, seen["manifest"].step) == (before + 1, 3)

    harness.wait_consumed({(topic, 0): high_watermark(bootstrap_servers, topic, 0)})
    harness.stop()
    assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )


def test_a_failed_pipelined_write_fails_the_loop_as_its_own_step(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory, monkeypatch
) -> None:
    topic = topic_factory("numbers", partitions=1)
    produce_keyed(bootstrap_servers, topic, 100, keys=5, seed=22)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic}, max_records_per_step=25)
    real_write = OutputWriter.write

    def failing_write(self: OutputWriter, step: int, *args: Any, **kw: Any) -> Any:
        if step == 1:
            raise StreamIOError("injected write failure of step 1")
        return real_write(self, step, *args, **kw)

    monkeypatch.setattr(OutputWriter, "write", failing_write)
    runtime = harness.build()
    harness.start()
    assert harness.thread is not None
    harness.thread.join(_WAIT_S)
    assert not harness.thread.is_alive()
    assert [str(e) for e in harness.errors] == ["injected write failure of step 1"]
    assert runtime.failing_step == 1
    assert runtime.last_logged is not None and runtime.last_logged.step == 0
    assert _last_logged_step(bootstrap_servers, harness.name) == 0
