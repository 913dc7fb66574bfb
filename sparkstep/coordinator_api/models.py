"""The REST API's bodies and answers (ARCHITECTURE.md "Coordinator REST API (v1)").

Times (``at``) are ISO 8601 in UTC (``2026-11-22T19:50:01.123Z``); the history's times
(``time``, ``started_at``) are unix seconds, which is what charts and scripts plot.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CheckpointAnswer",
    "CheckpointEntry",
    "CheckpointEvent",
    "CheckpointRef",
    "CheckpointsAnswer",
    "ErrorAnswer",
    "Failure",
    "HistoryAnswer",
    "HistoryEvent",
    "HistorySample",
    "PauseAnswer",
    "Processes",
    "RescaleAnswer",
    "RescaleEvent",
    "RescaleRequest",
    "RestartEvent",
    "ResumeAnswer",
    "State",
    "StatusAnswer",
    "StopAnswer",
]

State = Literal["running", "paused", "stopped", "recovering", "rescaling", "failed"]

MAX_WORKERS = 1024


class _Answer(BaseModel):
    model_config = ConfigDict(frozen=True)


class CheckpointRef(_Answer):
    """The last complete checkpoint: the manifest's version and step."""

    version: int
    step: int
    at: str


class Failure(_Answer):
    """Why the pipeline last failed (a child died, recovery failed)."""

    at: str
    reason: str


class Processes(_Answer):
    """Process ids: the coordinator, the runtime (null while recovering), the workers by index;
    ``hosts``: the state host each worker runs on (empty when the workers are the
    coordinator's children)."""

    coordinator: int
    runtime: int | None
    workers: dict[str, int]
    hosts: dict[str, str] = {}


class StatusAnswer(_Answer):
    """``GET /api/v1/status``."""

    pipeline: str
    deployment: str | None
    state: State
    step: int | None = Field(description="the next step the runtime will run")
    checkpoint: CheckpointRef | None
    workers: int
    layout_epoch: int | None
    processes: Processes
    last_failure: Failure | None


class PauseAnswer(_Answer):
    """``POST /api/v1/pause``: every step below ``step`` is complete."""

    state: Literal["paused"]
    step: int


class ResumeAnswer(_Answer):
    """``POST /api/v1/resume``."""

    state: Literal["running"]


class CheckpointAnswer(_Answer):
    """``POST /api/v1/checkpoint``: the manifest now has ``version`` at ``step``."""

    version: int
    step: int
    duration_ms: int


class RescaleRequest(BaseModel):
    """``POST /api/v1/rescale``: the new number of workers (a JSON integer, 1..1024) and the
    mode: ``hot`` (default) copies the moving state while the pipeline runs and pauses only to
    ship what changed and switch; ``cold`` pauses for the whole move."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    workers: int = Field(ge=1, le=MAX_WORKERS)
    mode: Literal["hot", "cold"] = "hot"


class RescaleAnswer(_Answer):
    """``POST /api/v1/rescale``: what moved, and how long the pipeline was paused."""

    mode: Literal["hot", "cold"]
    layout_epoch: int
    workers: int
    shards_moved: int
    bytes_moved: int = Field(description="bytes of state sent between workers in all")
    bytes_precopied: int = Field(description="of them, while the pipeline ran (hot)")
    bytes_paused: int = Field(description="of them, while it was paused")
    rounds: int = Field(description="copy rounds while the pipeline ran (hot; cold: 0)")
    pause_ms: int


class StopAnswer(_Answer):
    """``POST /api/v1/stop``: the final checkpoint (null if the pipeline never checkpointed)."""

    state: Literal["stopped"]
    step: int | None
    version: int | None


class CheckpointEntry(_Answer):
    """One retained checkpoint; ``duration_ms`` is null when this coordinator did not take it."""

    version: int
    step: int
    at: str
    duration_ms: int | None


class CheckpointsAnswer(_Answer):
    """``GET /api/v1/checkpoints``: oldest first; the last one is the manifest's, the one
    recovery starts from (the stores keep only it and its predecessor)."""

    checkpoints: list[CheckpointEntry]


class HistorySample(_Answer):
    """The pipeline over one interval of the history, which ends at ``time``."""

    time: float = Field(description="the end of the interval (unix seconds)")
    state: str = Field(description="the coordinator's state then (as in GET /api/v1/status)")
    step: int | None = Field(description="the next step the runtime would run then")
    input_rate: float | None = Field(
        description="input records/s of new steps over the interval; null when unknown (the "
        "first sample, the runtime not readable, or restarted in the interval)"
    )
    output_rate: float | None = Field(
        description="output rows/s of new steps over the interval; null when unknown"
    )
    steps: int = Field(description="new steps whose latency is in this interval's figures")
    latency_p50_ms: float | None = Field(
        description="the median step latency (division to committed transaction) of those "
        "steps, ms; null without steps"
    )
    latency_max_ms: float | None = Field(
        description="the largest step latency of those steps, ms; null without steps"
    )
    lag: dict[str, int] = Field(
        description="input lag per topic at the end of the interval: stable records not yet "
        "in a logged step, summed over the topic's partitions; empty when unknown"
    )


class CheckpointEvent(_Answer):
    """A checkpoint was committed (by the API, the timer, a rescale or a stop)."""

    kind: Literal["checkpoint"]
    time: float = Field(description="when it was recorded (unix seconds)")
    version: int = Field(description="the manifest's version it wrote")
    step: int = Field(description="the step it was taken at")
    duration_ms: int | None = Field(
        description="how long it took; null for the commit of a rescale or a stop"
    )


class RestartEvent(_Answer):
    """The runtime and the workers were started again after a failure."""

    kind: Literal["restart"]
    time: float = Field(description="when they were started again (unix seconds)")
    reason: str = Field(description="the failure that caused it")


class RescaleEvent(_Answer):
    """A rescale finished."""

    kind: Literal["rescale"]
    time: float = Field(description="when it finished (unix seconds)")
    from_workers: int = Field(description="W before")
    workers: int = Field(description="W after")
    layout_epoch: int = Field(description="the new layout's epoch")
    shards_moved: int = Field(description="shards moved between workers")
    bytes_moved: int = Field(description="bytes of state moved")
    pause_ms: int = Field(description="how long no step ran")
    mode: Literal["hot", "cold"] = Field(description="how it moved the state")
    bytes_precopied: int = Field(description="bytes moved while the pipeline ran")
    bytes_paused: int = Field(description="bytes moved while it was paused")
    rounds: int = Field(description="copy rounds while the pipeline ran")


HistoryEvent = Annotated[CheckpointEvent | RestartEvent | RescaleEvent, Field(discriminator="kind")]


class HistoryAnswer(_Answer):
    """``GET /api/v1/history``: this coordinator's recent history, kept in memory only."""

    started_at: float = Field(
        description="when this history started (unix seconds); another value means another "
        "coordinator (a restart), whose history starts empty"
    )
    interval_s: float = Field(description="the time between samples")
    span_s: float = Field(description="how far back samples and events are kept")
    samples: list[HistorySample] = Field(description="oldest first")
    events: list[HistoryEvent] = Field(description="checkpoints, restarts, rescales; oldest first")


class ErrorAnswer(_Answer):
    """Every error: what went wrong and what to do."""

    detail: str
