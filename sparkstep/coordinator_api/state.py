"""What the supervisor's parts share: the supervision phase, the last failure, the manifest.

The launcher (:mod:`~sparkstep.coordinator_api.launcher`), the procedures
(:mod:`~sparkstep.coordinator_api.procedures`) and the supervisor itself read and write one
:class:`SupervisorState`, always under its ``lock``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from sparkstep.runtime.manifest import Manifest, read_manifest

__all__ = ["Phase", "SupervisorState", "iso", "now_iso"]

Phase = Literal["recovering", "up", "rescaling", "stopping", "stopped", "failed"]
"""The supervision phase; ``GET /api/v1/status`` derives its ``state`` from it (and, while
``up``, from the runtime's own state)."""


def now_iso() -> str:
    """Now as ``2026-01-02T03:04:05.678Z``."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def iso(ts: float) -> str:
    """Unix seconds ``ts`` as ``2026-01-02T03:04:05.678Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(eq=False)
class SupervisorState:
    """The supervision facts of one coordinator; read and write them under ``lock``.

    ``manifest`` is the manifest as last read (refreshed after every launch, checkpoint and
    rescale); ``last_step`` the runtime's step as last seen; ``stop_requested`` is set once a
    stop (or the coordinator's exit) is under way and is never cleared but by a stop the
    runtime refused.
    """

    state_dir: Path
    lock: threading.RLock = field(default_factory=threading.RLock)
    phase: Phase = "recovering"
    manifest: Manifest | None = None
    last_step: int | None = None
    last_failure: dict[str, str] | None = None
    stop_requested: threading.Event = field(default_factory=threading.Event)

    def set_phase(self, phase: Phase) -> None:
        with self.lock:
            self.phase = phase

    def set_failure(self, reason: str) -> None:
        """Record ``reason`` as the last failure, stamped now."""
        with self.lock:
            self.last_failure = {"at": now_iso(), "reason": reason}

    def failure_reason(self) -> str:
        with self.lock:
            return "" if self.last_failure is None else self.last_failure["reason"]

    def reread_manifest(self) -> Manifest | None:
        """Read the durable manifest again, remember it and return it."""
        manifest = read_manifest(self.state_dir)
        with self.lock:
            self.manifest = manifest
        return manifest

    def saw_step(self, step: int) -> None:
        """The runtime reached ``step`` (the step never goes back)."""
        with self.lock:
            self.last_step = max(self.last_step or 0, step)
