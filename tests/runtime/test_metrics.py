"""RuntimeMetrics: counters, the latency histogram, per-partition lag and LSO stalls.

The last test checks the planner's high watermark / LSO accessors and the stall rule against the
real broker with a real open transaction.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from sparkstep.ids import Step, Version
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import (
    Division,
    DivisionOptions,
    DivisionPlanner,
    PartitionRange,
    StepTime,
)
from sparkstep.runtime.metrics import (
    STEP_LATENCY_BUCKETS,
    RuntimeMetrics,
    bucket_label,
    read_high_watermarks,
)
from tests.io.fixtures import TxnInput, high_watermark
from tests.runtime.driver.fixtures import produce_raw


class Clock:
    """A hand-moved clock: rates are tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def division(step: int, *ranges: tuple[str, int, int, int]) -> Division:
    return Division(
        Step(step),
        tuple(PartitionRange(t, p, s, e) for t, p, s, e in ranges),
        StepTime(max_input_ts=None, wall=0),
    )


def finish(m: RuntimeMetrics, d: Division, seconds: float, n: int = 1) -> None:
    m.step_finished(d, seconds, records_in=n, records_out=2 * n, dead_letters=n // 10)


def test_a_fresh_snapshot_is_all_zero_and_json() -> None:
    snap = RuntimeMetrics().snapshot()
    assert snap["steps"] == snap["records_in"] == snap["replayed_steps"] == 0
    assert snap["last_step"] is None and snap["partitions"] == {}
    assert snap["step_latency_seconds"]["count"] == 0
    assert list(snap["step_latency_seconds"]["buckets"]) == [
        *(bucket_label(b) for b in STEP_LATENCY_BUCKETS),
        "+Inf",
    ]
    assert set(snap["step_latency_seconds"]["buckets"].values()) == {0}
    json.dumps(snap, allow_nan=False)


def test_counters_and_cumulative_latency_buckets() -> None:
    m = RuntimeMetrics()
    latencies = [0.001, 0.01, 0.0100001, 0.3, 59.0, 61.0, 3600.0]
    for step, seconds in enumerate(latencies):
        finish(m, division(step, ("in", 0, step, step + 1)), seconds, n=10)
    snap = m.snapshot()
    assert (snap["steps"], snap["last_step"]) == (7, 6)
    assert (snap["records_in"], snap["records_out"], snap["dead_letters"]) == (70, 140, 7)
    latency = snap["step_latency_seconds"]
    assert latency["count"] == 7 and latency["sum"] == pytest.approx(sum(latencies))
    buckets = latency["buckets"]
    # le is inclusive: 0.01 falls into the 0.01 bucket, 0.0100001 into the next one.
    assert buckets["0.01"] == 2
    assert buckets["0.025"] == 3
    assert buckets["0.25"] == 3
    assert buckets["0.5"] == 4
    assert buckets["60.0"] == 5
    assert buckets["+Inf"] == 7
    counts = list(buckets.values())
    assert counts == sorted(counts)


def test_a_step_planned_while_the_one_before_is_written_does_not_move_the_end() -> None:
    """The runtime plans step s + 1 before step s is logged (its output is written beside the
    next step's Spark job): the end stays at the last logged step until s is counted, so an
    end past a step's records always comes with them in ``records_in``."""
    m = RuntimeMetrics()
    first = division(0, ("in", 0, 0, 41))
    m.observe_plan(first, {("in", 0): 41}, None)
    finish(m, first, 0.1, n=41)
    second = division(1, ("in", 0, 41, 56))
    m.observe_plan(second, {("in", 0): 56}, None)
    m.observe_plan(division(2, ("in", 0, 56, 56)), {("in", 0): 56}, None)
    snap = m.snapshot()
    assert (snap["partitions"]["in/0"]["end"], snap["records_in"]) == (41, 41)
    finish(m, second, 0.1, n=15)
    snap = m.snapshot()
    assert (snap["partitions"]["in/0"]["end"], snap["records_in"]) == (56, 56)


def test_replayed_steps_count_only_as_replays() -> None:
    m = RuntimeMetrics()
    m.replay_until(Step(3))
    for step in range(5):
        finish(m, division(step, ("in", 0, step * 10, step * 10 + 10)), 0.1, n=10)
    snap = m.snapshot()
    assert snap["replayed_steps"] == 3
    assert (snap["steps"], snap["records_in"], snap["last_step"]) == (2, 20, 4)
    assert snap["step_latency_seconds"]["count"] == 2
    # A replayed step still moves the partition's end: it is logged.
    assert snap["partitions"]["in/0"]["end"] == 50


def test_lag_is_lso_minus_logged_end_never_negative() -> None:
    m = RuntimeMetrics()
    planned = division(0, ("a", 0, 0, 40), ("a", 1, 5, 5))
    m.observe_plan(planned, {("a", 0): 100, ("a", 1): 5}, {("a", 0): 100, ("a", 1): 5})
    parts = m.snapshot()["partitions"]
    assert parts["a/0"]["end"] == 0 and parts["a/0"]["lag"] == 100  # before the step is logged
    assert parts["a/1"]["lag"] == 0
    finish(m, planned, 0.2)
    parts = m.snapshot()["partitions"]
    assert parts["a/0"] == {
        "topic": "a",
        "partition": 0,
        "end": 40,
        "stable": 100,
        "high": 100,
        "lag": 60,
        "lso_stalls": 0,
        "stalled": False,
    }
    # A step logged past the LSO seen at planning (a replayed division): lag clamps at 0.
    finish(m, division(1, ("a", 0, 40, 150)), 0.2)
    assert m.snapshot()["partitions"]["a/0"]["lag"] == 0


def test_lso_stalls_count_divisions_held_back_by_an_open_transaction() -> None:
    m = RuntimeMetrics()
    d = division(0, ("t", 0, 0, 10), ("t", 1, 0, 0))
    m.observe_plan(d, {("t", 0): 10, ("t", 1): 0}, {("t", 0): 10, ("t", 1): 4})
    m.observe_plan(d, {("t", 0): 10, ("t", 1): 0}, {("t", 0): 10, ("t", 1): 4})
    m.observe_plan(d, {("t", 0): 10, ("t", 1): 0}, None)  # not known: no check, no change
    parts = m.snapshot()["partitions"]
    assert (parts["t/0"]["lso_stalls"], parts["t/0"]["stalled"]) == (0, False)
    assert (parts["t/1"]["lso_stalls"], parts["t/1"]["stalled"]) == (2, True)
    m.observe_plan(d, {("t", 0): 10, ("t", 1): 6}, {("t", 0): 10, ("t", 1): 6})
    parts = m.snapshot()["partitions"]
    assert (parts["t/1"]["lso_stalls"], parts["t/1"]["stalled"]) == (2, False)


def test_rates_cover_the_trailing_window() -> None:
    clock = Clock()
    m = RuntimeMetrics(rate_window_s=10.0, clock=clock)
    clock.now += 2.0
    for step in range(4):
        finish(m, division(step, ("in", 0, step, step + 1)), 0.1, n=25)
    snap = m.snapshot()
    # Younger than the window: the rate is over the 2 s since the start.
    assert snap["step_rate"] == pytest.approx(2.0)
    assert snap["records_in_rate"] == pytest.approx(50.0)
    clock.now += 9.0  # the four steps are 9 s old: still in the window of 10 s
    assert m.snapshot()["step_rate"] == pytest.approx(0.4)
    clock.now += 1.5  # now older than the window
    snap = m.snapshot()
    assert (snap["step_rate"], snap["records_in_rate"]) == (0.0, 0.0)
    assert snap["steps"] == 4  # counters never shrink


def test_a_step_right_after_the_start_is_not_a_huge_rate() -> None:
    clock = Clock()
    m = RuntimeMetrics(clock=clock)
    clock.now += 0.001
    finish(m, division(0, ("in", 0, 0, 1)), 0.1, n=5)
    snap = m.snapshot()
    assert (snap["step_rate"], snap["records_in_rate"]) == (1.0, 5.0)  # over at least 1 s


def test_checkpoints_keep_totals_and_the_recent_ones() -> None:
    m = RuntimeMetrics(checkpoints_kept=3)
    for v in range(1, 6):
        m.checkpoint_finished(Version(v), Step(10 * v), 0.5 * v)
    snap = m.snapshot()["checkpoints"]
    assert snap["count"] == 5 and snap["sum_seconds"] == pytest.approx(7.5)
    assert [c["version"] for c in snap["recent"]] == [3, 4, 5]
    assert snap["recent"][-1]["step"] == 50 and snap["recent"][-1]["seconds"] == 2.5


def test_the_last_new_steps_are_kept_with_their_latency() -> None:
    m = RuntimeMetrics(steps_kept=3, wall=lambda: 1000.0)
    m.replay_until(Step(1))
    for step in range(5):
        finish(m, division(step, ("in", 0, step, step + 1)), 0.1 * (step + 1))
    recent = m.snapshot()["recent_steps"]
    # Step 0 was a replay: never listed; of the new ones, the last three.
    assert [s["step"] for s in recent] == [2, 3, 4]
    assert [s["seconds"] for s in recent] == pytest.approx([0.3, 0.4, 0.5])
    assert {s["at"] for s in recent} == {1000.0}


def test_concurrent_updates_are_not_lost() -> None:
    m = RuntimeMetrics()
    per_thread = 500

    def work(t: int) -> None:
        for i in range(per_thread):
            finish(m, division(t * per_thread + i, (f"t{t}", 0, i, i + 1)), 0.05, n=3)
            m.snapshot()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snap = m.snapshot()
    assert snap["steps"] == 4 * per_thread
    assert snap["records_in"] == 3 * 4 * per_thread
    assert snap["step_latency_seconds"]["buckets"]["+Inf"] == 4 * per_thread
    assert all(p["end"] == per_thread for p in snap["partitions"].values())


def test_planner_accessors_and_a_real_open_transaction(
    bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("stall", partitions=1)
    produce_raw(bootstrap_servers, topic, [b"a", b"b"])
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"open-1", b"open-2"], keep_open=True)
    produce_raw(bootstrap_servers, topic, [b"c"])  # after the open transaction: not stable yet
    planner = DivisionPlanner(
        KafkaConfig(bootstrap_servers, timeout_s=30), DivisionOptions((topic,))
    )
    metrics = RuntimeMetrics()
    try:
        assert planner.last_stable_offsets() == {}
        high = read_high_watermarks(planner)
        assert high == {(topic, 0): 5} == {(topic, 0): high_watermark(bootstrap_servers, topic)}
        first = planner.plan(None)
        assert planner.last_stable_offsets() == {(topic, 0): 2}
        assert first.ranges == (PartitionRange(topic, 0, 0, 2),)
        metrics.observe_plan(first, planner.last_stable_offsets(), high)
        part = metrics.snapshot()["partitions"][f"{topic}/0"]
        assert (part["stalled"], part["lso_stalls"], part["lag"]) == (True, 1, 2)
        metrics.step_finished(first, 0.1, records_in=2, records_out=2, dead_letters=0)
        assert metrics.snapshot()["partitions"][f"{topic}/0"]["lag"] == 0
    finally:
        txn.finish(commit=True)
    # Committed: the LSO passes the marker, up to the high watermark (the marker included). The
    # commit returns before the broker has written the marker: wait for it.
    deadline = time.monotonic() + 60
    while planner.stable_offsets() != {(topic, 0): 6}:
        assert time.monotonic() < deadline, planner.stable_offsets()
        time.sleep(0.05)
    high = read_high_watermarks(planner)
    second = planner.plan(first)
    metrics.observe_plan(second, planner.last_stable_offsets(), high)
    part = metrics.snapshot()["partitions"][f"{topic}/0"]
    assert second.ranges == (PartitionRange(topic, 0, 2, 6),)
    assert (part["stalled"], part["lso_stalls"], part["stable"], part["high"]) == (False, 1, 6, 6)
