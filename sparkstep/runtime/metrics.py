"""The runtime's own metrics: what the step loop did, kept in memory for the control endpoint.

One :class:`RuntimeMetrics` per :class:`~sparkstep.runtime.driver.Runtime`. The driver reports
to it at four points, from the step loop's thread and the procedures' threads (it is
thread-safe); the control endpoint's ``GET /status`` returns :meth:`RuntimeMetrics.snapshot`
under ``"metrics"``, and the coordinator turns that into Prometheus text and its dashboard.

- :meth:`~RuntimeMetrics.observe_plan`: a division was planned, with the last stable offsets
  (LSO) the planner used and the high watermarks read just before;
- :meth:`~RuntimeMetrics.replay_until`: recovery will replay the steps below this one;
- :meth:`~RuntimeMetrics.step_finished`: a step's transaction committed (or, for a replayed
  step, its output was compared and discarded);
- :meth:`~RuntimeMetrics.checkpoint_finished`: a checkpoint's manifest was written and the
  stores reopened.

Invariants:

- counters only grow, and start at zero with the process (Prometheus treats a restart as a
  counter reset);
- ``steps``, ``records_in``, ``records_out``, ``dead_letters`` and the step latency count new
  steps only; a replayed step counts in ``replayed_steps`` alone (its output was written by the
  process that crashed, and is discarded now);
- a partition's ``end`` is the first offset after the last logged step (before any, where
  the first planned step starts), so ``lag = stable - end`` is the stable input not yet in a
  logged step, never negative. A planned step's ``start`` does not move it: the runtime plans
  step s + 1 while step s is still being written, and ``end`` must not pass a step whose
  ``records_in`` is not yet counted;
- an LSO stall is a planned division during which the partition's high watermark, read before
  its LSO, was above the LSO: records below the high watermark were still in an open (or not
  yet completed) transaction and held the step back. Reading the high watermark first means a
  record that arrives in between can never look like a stall.

The snapshot (JSON-able; every time in seconds; documented for the control endpoint)::

    {"started_at": unix s, "steps": n, "last_step": s or null, "last_step_at": unix s or null,
     "replayed_steps": n, "records_in": n, "records_out": n, "dead_letters": n,
     "step_rate": steps/s and "records_in_rate": records/s over the last rate window (or
     since the start when that is younger, at least 1 s),
     "step_latency_seconds": {"buckets": {"0.01": n, ..., "+Inf": n} (cumulative), "sum", "count"},
     "recent_steps": [{"step", "at": unix s, "seconds"}, ...] (the last new steps, oldest first),
     "checkpoints": {"count": n, "sum_seconds": s,
                     "recent": [{"version", "step", "seconds", "at"}, ...] (oldest first)},
     "partitions": {"topic/partition": {"topic", "partition", "end", "stable", "high",
                                        "lag", "lso_stalls", "stalled"}}}
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sparkstep.errors import SparkstepError
from sparkstep.ids import Step, Version
from sparkstep.io.division import Division, DivisionPlanner
from sparkstep.io.topics import TopicPartitionKey

__all__ = [
    "RuntimeMetrics",
    "STEP_LATENCY_BUCKETS",
    "bucket_label",
    "read_high_watermarks",
]

log = logging.getLogger(__name__)

#: Upper bounds (seconds) of the step latency histogram's buckets; ``+Inf`` follows implicitly.
STEP_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


_MIN_RATE_SPAN_S = 1.0


def bucket_label(bound: float) -> str:
    """A bucket bound as Prometheus writes it in ``le``: ``"0.25"``, ``"1.0"``, ``"+Inf"``."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def read_high_watermarks(planner: DivisionPlanner) -> dict[TopicPartitionKey, int] | None:
    """The input partitions' high watermarks, or None when Kafka does not answer.

    Metrics only inform: a failure here is logged and the stall check skipped for this plan;
    the planner itself reports a broker that is really gone.
    """
    try:
        return planner.high_watermarks()
    except SparkstepError as exc:
        log.warning("high watermarks not read (LSO stall check skipped): %s", exc)
        return None


@dataclass
class _Partition:
    """What the metrics know of one input partition."""

    end: int | None = None
    stable: int | None = None
    high: int | None = None
    stalls: int = 0
    stalled: bool = False

    def doc(self, topic: str, partition: int) -> dict[str, Any]:
        lag = None
        if self.end is not None and self.stable is not None:
            lag = max(0, self.stable - self.end)
        return {
            "topic": topic,
            "partition": partition,
            "end": self.end,
            "stable": self.stable,
            "high": self.high,
            "lag": lag,
            "lso_stalls": self.stalls,
            "stalled": self.stalled,
        }


class RuntimeMetrics:
    """Counters, the step latency histogram and per-partition input figures; see the module
    docstring. ``clock`` (monotonic seconds) and ``wall`` (unix seconds) are injectable so rates
    can be tested without sleeping."""

    def __init__(
        self,
        *,
        rate_window_s: float = 10.0,
        checkpoints_kept: int = 20,
        steps_kept: int = 128,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if rate_window_s <= 0:
            raise ValueError(f"rate_window_s must be positive, got {rate_window_s}")
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall
        self._window = rate_window_s
        self._started = clock()
        self._started_at = wall()
        self._replay_below = Step(0)
        self._steps = 0
        self._last_step: Step | None = None
        self._last_step_at: float | None = None
        self._replayed = 0
        self._records_in = 0
        self._records_out = 0
        self._dead_letters = 0
        self._bucket_counts = [0] * (len(STEP_LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self._latency_sum = 0.0
        self._recent: deque[tuple[float, int]] = deque()  # (clock, records_in) of new steps
        # The coordinator's history takes each interval's latency percentiles from these.
        self._recent_steps: deque[dict[str, Any]] = deque(maxlen=steps_kept)
        self._checkpoints = 0
        self._checkpoint_sum = 0.0
        self._checkpoint_recent: deque[dict[str, Any]] = deque(maxlen=checkpoints_kept)
        self._partitions: dict[TopicPartitionKey, _Partition] = {}

    # -- what the driver reports -------------------------------------------------------------

    def replay_until(self, step: Step) -> None:
        """Steps below ``step`` that finish from now on are replays (recovery's step 6)."""
        with self._lock:
            self._replay_below = Step(max(self._replay_below, step))

    def observe_plan(
        self,
        division: Division,
        stable: Mapping[TopicPartitionKey, int],
        high: Mapping[TopicPartitionKey, int] | None,
    ) -> None:
        """A division was planned from the LSOs ``stable``; ``high`` was read just before them
        (None: not known, no stall check)."""
        with self._lock:
            for rng in division.ranges:
                part = self._partitions.setdefault(rng.key, _Partition())
                if part.end is None:  # where the first step starts, until a step is logged
                    part.end = rng.start
                if rng.key in stable:
                    part.stable = stable[rng.key]
                if high is not None and rng.key in high:
                    part.high = high[rng.key]
                    part.stalled = part.stable is not None and part.high > part.stable
                    if part.stalled:
                        part.stalls += 1

    def step_finished(
        self,
        division: Division,
        seconds: float,
        *,
        records_in: int,
        records_out: int,
        dead_letters: int,
    ) -> None:
        """Step ``division.step`` is logged (a new step) or verified (a replayed one)."""
        now = self._clock()
        with self._lock:
            for rng in division.ranges:
                self._partitions.setdefault(rng.key, _Partition()).end = rng.end
            if division.step < self._replay_below:
                self._replayed += 1
                return
            self._steps += 1
            self._last_step = division.step
            self._last_step_at = self._wall()
            self._records_in += records_in
            self._records_out += records_out
            self._dead_letters += dead_letters
            self._bucket_counts[bisect.bisect_left(STEP_LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum += seconds
            self._recent.append((now, records_in))
            self._recent_steps.append(
                {"step": division.step, "at": self._last_step_at, "seconds": seconds}
            )
            self._prune(now)

    def checkpoint_finished(self, version: Version, step: Step, seconds: float) -> None:
        """The checkpoint at ``step`` committed as ``version`` in ``seconds``."""
        with self._lock:
            self._checkpoints += 1
            self._checkpoint_sum += seconds
            self._checkpoint_recent.append(
                {"version": version, "step": step, "seconds": seconds, "at": self._wall()}
            )

    # -- what the control endpoint reads -----------------------------------------------------

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window:
            self._recent.popleft()

    def snapshot(self) -> dict[str, Any]:
        """Everything, as the JSON-able dict shown in the module docstring."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            # Over the window, or the time since the start when younger (at least a second,
            # so one step right after the start is not a huge rate).
            span = max(_MIN_RATE_SPAN_S, min(self._window, now - self._started))
            step_rate = len(self._recent) / span
            records_rate = sum(n for _, n in self._recent) / span
            cumulative = 0
            buckets: dict[str, int] = {}
            for bound, count in zip(
                (*STEP_LATENCY_BUCKETS, float("inf")), self._bucket_counts, strict=True
            ):
                cumulative += count
                buckets[bucket_label(bound)] = cumulative
            return {
                "started_at": self._started_at,
                "steps": self._steps,
                "last_step": self._last_step,
                "last_step_at": self._last_step_at,
                "replayed_steps": self._replayed,
                "records_in": self._records_in,
                "records_out": self._records_out,
                "dead_letters": self._dead_letters,
                "step_rate": step_rate,
                "records_in_rate": records_rate,
                "step_latency_seconds": {
                    "buckets": buckets,
                    "sum": self._latency_sum,
                    "count": self._steps,
                },
                "recent_steps": [dict(s) for s in self._recent_steps],
                "checkpoints": {
                    "count": self._checkpoints,
                    "sum_seconds": self._checkpoint_sum,
                    "recent": [dict(c) for c in self._checkpoint_recent],
                },
                "partitions": {
                    f"{topic}/{partition}": part.doc(topic, partition)
                    for (topic, partition), part in sorted(self._partitions.items())
                },
            }
