"""The REST API's bodies and answers (ARCHITECTURE.md "Coordinator REST API (v1)").

Times (``at``) are ISO 8601 in UTC (``2026-11-22T19:50:01.123Z``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "CheckpointAnswer",
    "CheckpointEntry",
    "CheckpointRef",
    "CheckpointsAnswer",
    "ErrorAnswer",
    "Failure",
    "PauseAnswer",
    "Processes",
    "RescaleAnswer",
    "RescaleRequest",
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
    """Process ids: the coordinator, the runtime (null while recovering), the workers by index."""

    coordinator: int
    runtime: int | None
    workers: dict[str, int]


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
    """``POST /api/v1/rescale``: the new number of workers (a JSON integer, 1..1024)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    workers: int = Field(ge=1, le=MAX_WORKERS)


class RescaleAnswer(_Answer):
    """``POST /api/v1/rescale``: what moved, and how long the pipeline was paused."""

    layout_epoch: int
    workers: int
    shards_moved: int
    bytes_moved: int
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


class ErrorAnswer(_Answer):
    """Every error: what went wrong and what to do."""

    detail: str
