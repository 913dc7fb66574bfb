"""Restart strategies: whether, and after how long, the supervisor restarts a failed pipeline.

The names and meanings are Flink's (``restart-strategy.type``):

- :class:`FixedDelay` (``fixed-delay``): at most ``attempts`` restarts in the coordinator's
  life, each after ``delay_s``.
- :class:`FailureRate` (``failure-rate``): restart after ``delay_s`` while at most
  ``max_failures`` failures fall within the last ``interval_s`` seconds; the failure that makes
  it ``max_failures + 1`` is final.
- :class:`NoRestart` (``none``): the first failure is final.

A strategy is told of every failure with :meth:`RestartStrategy.on_failure` and answers the
delay before the restart, or None to give up (the pipeline is then ``failed``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from sparkstep.coordinator_api.settings import CoordinatorSettings

__all__ = ["FailureRate", "FixedDelay", "NoRestart", "RestartStrategy", "restart_strategy"]


class RestartStrategy(Protocol):
    """Decides after each failure: restart after a delay (seconds), or give up (None)."""

    def on_failure(self, now: float) -> float | None: ...

    def describe(self) -> str: ...


@dataclass
class FixedDelay:
    attempts: int
    delay_s: float
    failures: int = 0

    def on_failure(self, now: float) -> float | None:
        self.failures += 1
        return self.delay_s if self.failures <= self.attempts else None

    def describe(self) -> str:
        return f"fixed-delay: {self.attempts} restarts, {self.delay_s:g}s apart"


@dataclass
class FailureRate:
    max_failures: int
    interval_s: float
    delay_s: float
    recent: deque[float] = field(default_factory=deque)

    def on_failure(self, now: float) -> float | None:
        self.recent.append(now)
        while self.recent and self.recent[0] <= now - self.interval_s:
            self.recent.popleft()
        return self.delay_s if len(self.recent) <= self.max_failures else None

    def describe(self) -> str:
        return (
            f"failure-rate: at most {self.max_failures} failures in {self.interval_s:g}s, "
            f"restarts {self.delay_s:g}s apart"
        )


@dataclass
class NoRestart:
    def on_failure(self, now: float) -> float | None:
        return None

    def describe(self) -> str:
        return "none: no restarts"


def restart_strategy(settings: CoordinatorSettings) -> RestartStrategy:
    """The strategy the settings name, with its parameters."""
    if settings.restart_strategy == "fixed-delay":
        return FixedDelay(settings.restart_attempts, settings.restart_delay_s)
    if settings.restart_strategy == "failure-rate":
        return FailureRate(
            settings.max_failures_per_interval,
            settings.failure_rate_interval_s,
            settings.restart_delay_s,
        )
    return NoRestart()
