"""The coordinator's history: the retained checkpoints and the rescales of this coordinator.

Checkpoints are kept in memory (the last ``retained`` of them, oldest first) and appended to
``<state_dir>/coordinator/checkpoints.jsonl``, one JSON object a line::

    {"version": v, "step": s, "at": "2026-01-02T03:04:05.678Z", "duration_ms": n | null}

so that a restarted coordinator lists the checkpoints its predecessor took (a line torn by a
crash is skipped). The manifest's checkpoint is always in the list, even when no coordinator
recorded it (the runtime's first manifest, or a history file lost). Rescales (``GET /metrics``
and the dashboard) are this coordinator's only. Every checkpoint and rescale recorded here is
also an event of the :class:`~sparkstep.coordinator_api.timeline.Timeline` when one is given.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from sparkstep.coordinator_api.state import iso, now_iso
from sparkstep.coordinator_api.timeline import Timeline
from sparkstep.runtime.manifest import Manifest

__all__ = ["History"]

log = logging.getLogger("sparkstep.coordinator")


class History:
    """The checkpoints (persisted in ``history_file``, ``retained`` kept) and rescales."""

    def __init__(self, history_file: Path, retained: int, timeline: Timeline | None = None) -> None:
        self.history_file = history_file
        self.retained = retained
        self.timeline = timeline
        self._lock = threading.Lock()
        self._checkpoints: list[dict[str, Any]] = []
        self._rescales: list[dict[str, Any]] = []

    def load(self, manifest: Manifest | None) -> None:
        """Read the history file (what a previous coordinator recorded), then :meth:`seed`."""
        entries: list[dict[str, Any]] = []
        try:
            for line in self.history_file.read_text().splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash
                if isinstance(doc, dict) and {"version", "step", "at"} <= doc.keys():
                    entries.append(doc)
        except FileNotFoundError:
            pass
        with self._lock:
            self._checkpoints = entries[-self.retained :]
        self.seed(manifest)

    def seed(self, manifest: Manifest | None) -> None:
        """Put the manifest's checkpoint in the list if it is not there yet."""
        if manifest is None:
            return
        with self._lock:
            if any(c["version"] == manifest.version for c in self._checkpoints):
                return
            self._checkpoints.append(
                {
                    "version": int(manifest.version),
                    "step": int(manifest.step),
                    "at": iso(manifest.written_at),
                    "duration_ms": None,
                }
            )
            self._checkpoints.sort(key=lambda c: int(c["version"]))
            del self._checkpoints[: -self.retained]

    def record_checkpoint(
        self, answer: Mapping[str, Any], duration_ms: int | Literal["answer"] | None = "answer"
    ) -> None:
        """Record the checkpoint of a runtime's ``answer`` (``version``, ``step``, and its
        ``duration_ms`` unless another one, or None, is given) and append it to the file."""
        entry = {
            "version": int(answer["version"]),
            "step": int(answer["step"]),
            "at": now_iso(),
            "duration_ms": answer.get("duration_ms") if duration_ms == "answer" else duration_ms,
        }
        with self._lock:
            self._checkpoints.append(entry)
            del self._checkpoints[: -self.retained]
            try:
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                with self.history_file.open("a") as fh:
                    fh.write(json.dumps(entry) + "\n")
            except OSError as exc:
                log.warning("checkpoint history not saved: %s", exc)
        if self.timeline is not None:
            self.timeline.event(
                "checkpoint",
                version=entry["version"],
                step=entry["step"],
                duration_ms=entry["duration_ms"],
            )

    def record_rescale(self, entry: Mapping[str, Any]) -> None:
        """Record a finished rescale: ``{"at", "from_workers", "workers", "layout_epoch",
        "shards_moved", "bytes_moved", "pause_ms"}``."""
        with self._lock:
            self._rescales.append(dict(entry))
        if self.timeline is not None:
            self.timeline.event("rescale", **{k: v for k, v in entry.items() if k != "at"})

    def checkpoints(self) -> list[dict[str, Any]]:
        """The retained checkpoints, oldest first; the last one is the manifest's."""
        with self._lock:
            return [dict(c) for c in self._checkpoints]

    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return dict(self._checkpoints[-1]) if self._checkpoints else None

    def rescales(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._rescales]
