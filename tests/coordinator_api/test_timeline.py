"""The coordinator's timeline (``GET /api/v1/history``'s data): rates, latency per interval,
lag per topic, events, bounds, ``since`` and a runtime restart; on an injected clock, with
the runtime's status documents made by the real :class:`RuntimeMetrics`."""

from __future__ import annotations

from typing import Any

import pytest

from sparkstep.coordinator_api.models import HistoryAnswer
from sparkstep.coordinator_api.timeline import EVENTS_KEPT, Timeline
from sparkstep.ids import Step
from sparkstep.io.division import Division, PartitionRange, StepTime
from sparkstep.runtime.metrics import RuntimeMetrics


class Wall:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Runtime:
    """A runtime's metrics and the status document the coordinator would read."""

    def __init__(self, wall: Wall) -> None:
        self.metrics = RuntimeMetrics(wall=wall)
        self.step = 0

    def run_step(self, seconds: float, records_in: int, records_out: int) -> None:
        ranges = (
            PartitionRange("in", 0, 10 * self.step, 10 * self.step + 10),
            PartitionRange("other", 0, 0, 0),
        )
        d = Division(Step(self.step), ranges, StepTime(None, 0))
        self.metrics.observe_plan(d, {("in", 0): 10 * self.step + 25, ("other", 0): 3}, None)
        self.metrics.step_finished(
            d, seconds, records_in=records_in, records_out=records_out, dead_letters=0
        )
        self.step += 1

    def status(self) -> dict[str, Any]:
        return {"state": "running", "step": self.step, "metrics": self.metrics.snapshot()}


def test_samples_have_rates_latency_per_interval_and_lag_per_topic() -> None:
    wall = Wall()
    timeline = Timeline(interval_s=2.0, span_s=60.0, wall=wall)
    runtime = Runtime(wall)
    wall.now += 1
    timeline.sample("running", 0, runtime.status())
    for seconds in (0.1, 0.3, 0.2):
        runtime.run_step(seconds, records_in=10, records_out=4)
    wall.now += 2
    timeline.sample("running", 3, runtime.status())
    runtime.run_step(0.5, records_in=10, records_out=4)
    wall.now += 2
    timeline.sample("paused", 4, runtime.status())
    wall.now += 2
    timeline.sample("paused", 4, runtime.status())
    samples = HistoryAnswer.model_validate(timeline.answer()).samples
    first, second, third, fourth = samples
    assert (first.input_rate, first.output_rate, first.steps) == (None, None, 0)
    assert second.input_rate == pytest.approx(15.0)
    assert second.output_rate == pytest.approx(6.0)
    assert second.steps == 3
    assert (second.latency_p50_ms, second.latency_max_ms) == (200.0, 300.0)
    # The lag is summed per topic: the stable offset 45 minus the end of the last step 30.
    assert second.lag == {"in": 15, "other": 3}
    # Each step's latency counts in one interval only.
    assert (third.steps, third.latency_p50_ms, third.latency_max_ms) == (1, 500.0, 500.0)
    assert (fourth.steps, fourth.latency_p50_ms, fourth.input_rate) == (0, None, 0.0)
    assert [s.state for s in samples] == ["running", "running", "paused", "paused"]
    assert [s.time for s in samples] == sorted(s.time for s in samples)


def test_no_rate_across_a_runtime_restart_or_without_the_runtime() -> None:
    wall = Wall()
    timeline = Timeline(wall=wall)
    runtime = Runtime(wall)
    runtime.run_step(0.1, records_in=50, records_out=50)
    timeline.sample("running", 1, runtime.status())
    wall.now += 2
    timeline.sample("recovering", 1, None)  # the runtime died
    wall.now += 2
    restarted = Runtime(wall)  # counters from zero again, another started_at
    restarted.step = 5
    restarted.run_step(0.1, records_in=10, records_out=1)
    timeline.sample("running", 6, restarted.status())
    wall.now += 2
    restarted.run_step(0.1, records_in=10, records_out=1)
    timeline.sample("running", 7, restarted.status())
    rates = [s["input_rate"] for s in timeline.answer()["samples"]]
    assert rates == [None, None, None, pytest.approx(5.0)]
    assert timeline.answer()["samples"][1]["lag"] == {}


def test_steps_before_the_coordinator_started_are_not_counted() -> None:
    wall = Wall()
    runtime = Runtime(wall)
    runtime.run_step(9.0, records_in=1, records_out=1)  # before this coordinator's time
    wall.now += 1
    timeline = Timeline(wall=wall)
    timeline.sample("running", 1, runtime.status())
    assert timeline.answer()["samples"][0]["steps"] == 0


def test_events_since_and_bounds() -> None:
    wall = Wall()
    timeline = Timeline(interval_s=2.0, span_s=10.0, wall=wall)
    assert timeline.answer()["samples"] == []
    for _ in range(8):
        wall.now += 2
        timeline.sample("running", None, None)
    timeline.event("checkpoint", version=3, step=40, duration_ms=120)
    timeline.event(
        "rescale",
        from_workers=2,
        workers=3,
        layout_epoch=1,
        shards_moved=85,
        bytes_moved=4096,
        pause_ms=800,
        mode="hot",
        bytes_precopied=4000,
        bytes_paused=96,
        rounds=2,
    )
    timeline.event("restart", reason="worker 1 exited with status -9")
    doc = HistoryAnswer.model_validate(timeline.answer())
    assert len(doc.samples) == 5  # span / interval
    assert [e.kind for e in doc.events] == ["checkpoint", "rescale", "restart"]
    seen = doc.events[0].time
    later = timeline.answer(since=seen)
    assert [e["kind"] for e in later["events"]] == ["rescale", "restart"]
    assert later["samples"] == []
    # The same wall time for both: still strictly ordered, so since= never loses one.
    times = [e.time for e in doc.events]
    assert times == sorted(set(times))
    wall.now += 11  # older than the span: gone with the next record
    timeline.event("checkpoint", version=4, step=41, duration_ms=None)
    assert [e["version"] for e in timeline.answer()["events"]] == [4]
    for n in range(EVENTS_KEPT + 5):
        timeline.event("checkpoint", version=n, step=n, duration_ms=1)
    assert len(timeline.answer()["events"]) == EVENTS_KEPT


def test_the_wall_clock_stepping_back_never_reorders() -> None:
    wall = Wall()
    timeline = Timeline(wall=wall)
    timeline.sample("running", None, None)
    wall.now -= 30
    timeline.sample("running", None, None)
    first, second = timeline.answer()["samples"]
    assert second["time"] > first["time"]
