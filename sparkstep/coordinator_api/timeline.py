"""The coordinator's recent history over time: samples every few seconds, and events.

``GET /api/v1/history`` serves it (:class:`~sparkstep.coordinator_api.models.HistoryAnswer`)
and the dashboard draws its charts from it. It lives in memory only, so a restarted
coordinator starts a new one (``started_at`` changes).

- A **sample** (:meth:`Timeline.sample`, every ``interval_s`` by the supervisor's sampler
  thread) is the coordinator's state and the runtime's figures for the interval since the
  previous sample: input and output records/s from the runtime's counters, the p50 and the
  max of the latencies of the new steps that finished in the interval (from the runtime's
  ``recent_steps``), and the input lag per topic at the end of the interval (the sum over its
  partitions).
- An **event** (:meth:`Timeline.event`) is a checkpoint, a restart or a rescale, with its
  figures, when it happened.

Invariants:

- bounded: the last ``span_s / interval_s`` samples and the last :data:`EVENTS_KEPT` events
  no older than ``span_s``; both oldest first, times in unix seconds, never going back;
- a rate is None (unknown, never a guess) for the first sample, when the runtime could not be
  read at either end of the interval, and across a runtime restart (its counters start again
  at zero: ``started_at`` changed or a counter went down);
- each new step's latency counts in exactly one interval: the one in which the sampler first
  saw it (steps are taken by number, above the highest number seen before).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["EVENTS_KEPT", "EventKind", "Timeline"]

#: Events kept at most (a checkpoint every second for an hour would be more).
EVENTS_KEPT = 1000

#: The least step between two recorded times (well above a float's resolution of unix seconds).
_TICK_S = 1e-6

EventKind = Literal["checkpoint", "restart", "rescale"]


@dataclass(frozen=True)
class _Counters:
    """The runtime's figures at the previous sample."""

    time: float
    started_at: object
    records_in: int
    records_out: int


def _count(metrics: Mapping[str, Any], key: str) -> int | None:
    value = metrics.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _p50(values: list[float]) -> float:
    """The nearest-rank median (a latency that was really observed)."""
    ordered = sorted(values)
    return ordered[math.ceil(len(ordered) / 2) - 1]


class Timeline:
    """The bounded samples and events; see the module docstring. Thread-safe."""

    def __init__(
        self,
        interval_s: float = 2.0,
        span_s: float = 3600.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or span_s < interval_s:
            raise ValueError(f"need 0 < interval_s <= span_s, got {interval_s} and {span_s}")
        self.interval_s = interval_s
        self.span_s = span_s
        self._wall = wall
        self.started_at = wall()
        self._lock = threading.Lock()
        self._samples: deque[dict[str, Any]] = deque(maxlen=max(1, round(span_s / interval_s)))
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._previous: _Counters | None = None
        self._last_step_seen = -1
        self._last_time = self.started_at - _TICK_S

    def _now(self) -> float:
        """Now, after the last sample or event even when the wall clock steps back (so that
        ``since`` = the last time a reader saw always excludes exactly what it saw)."""
        self._last_time = max(self._last_time + _TICK_S, self._wall())
        return self._last_time

    def sample(
        self, state: str, step: int | None, runtime_status: Mapping[str, Any] | None
    ) -> None:
        """Record a sample now: the coordinator's ``state`` and ``step`` and the runtime's
        status document (None when it cannot be read)."""
        metrics = {} if runtime_status is None else runtime_status.get("metrics")
        if not isinstance(metrics, Mapping):
            metrics = {}
        with self._lock:
            now = self._now()
            doc: dict[str, Any] = {
                "time": now,
                "state": state,
                "step": step,
                "input_rate": None,
                "output_rate": None,
                "steps": 0,
                "latency_p50_ms": None,
                "latency_max_ms": None,
                "lag": self._lag(metrics),
            }
            records_in, records_out = _count(metrics, "records_in"), _count(metrics, "records_out")
            counters = None
            if records_in is not None and records_out is not None:
                counters = _Counters(now, metrics.get("started_at"), records_in, records_out)
            before = self._previous
            if (
                counters is not None
                and before is not None
                and counters.started_at == before.started_at
                and counters.records_in >= before.records_in
                and counters.records_out >= before.records_out
                and counters.time > before.time
            ):
                span = counters.time - before.time
                doc["input_rate"] = (counters.records_in - before.records_in) / span
                doc["output_rate"] = (counters.records_out - before.records_out) / span
            self._previous = counters
            latencies = self._new_latencies(metrics)
            if latencies:
                doc["steps"] = len(latencies)
                doc["latency_p50_ms"] = _p50(latencies) * 1000
                doc["latency_max_ms"] = max(latencies) * 1000
            self._samples.append(doc)
            self._prune(now)

    def _new_latencies(self, metrics: Mapping[str, Any]) -> list[float]:
        """The latencies (s) of the listed steps above the last one seen; marks them seen."""
        recent = metrics.get("recent_steps")
        latencies: list[float] = []
        highest = self._last_step_seen
        for entry in recent if isinstance(recent, list) else ():
            if not isinstance(entry, Mapping):
                continue
            step, seconds = entry.get("step"), entry.get("seconds")
            at = entry.get("at")
            if (
                isinstance(step, int)
                and step > self._last_step_seen
                and isinstance(seconds, int | float)
                # A new coordinator counts only what happened in its own time.
                and isinstance(at, int | float)
                and at >= self.started_at
            ):
                latencies.append(float(seconds))
                highest = max(highest, step)
        self._last_step_seen = highest
        return latencies

    @staticmethod
    def _lag(metrics: Mapping[str, Any]) -> dict[str, int]:
        partitions = metrics.get("partitions")
        lag: dict[str, int] = {}
        for part in partitions.values() if isinstance(partitions, Mapping) else ():
            if not isinstance(part, Mapping):
                continue
            topic, value = part.get("topic"), part.get("lag")
            if isinstance(topic, str) and isinstance(value, int):
                lag[topic] = lag.get(topic, 0) + value
        return lag

    def event(self, kind: EventKind, **figures: Any) -> None:
        """Record a ``kind`` event now with its ``figures`` (see
        :class:`~sparkstep.coordinator_api.models.HistoryEvent`)."""
        with self._lock:
            now = self._now()
            self._events.append({"kind": kind, "time": now, **figures})
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._events and self._events[0]["time"] < now - self.span_s:
            self._events.popleft()

    def answer(self, since: float | None = None) -> dict[str, Any]:
        """The ``GET /api/v1/history`` document: everything, or only what is newer than
        ``since`` (unix seconds)."""
        with self._lock:
            samples = [dict(s, lag=dict(s["lag"])) for s in self._samples]
            events = [dict(e) for e in self._events]
        if since is not None:
            samples = [s for s in samples if s["time"] > since]
            events = [e for e in events if e["time"] > since]
        return {
            "started_at": self.started_at,
            "interval_s": self.interval_s,
            "span_s": self.span_s,
            "samples": samples,
            "events": events,
        }
