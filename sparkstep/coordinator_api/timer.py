"""The checkpoint timer: a checkpoint every ``checkpoint_interval_s`` while the pipeline runs.

A turn is skipped when the pipeline is not up (recovering, rescaling, failed), and the
checkpoint it asks for is itself skipped when a procedure runs, when the loop is paused, or
when no step was taken since the last checkpoint (see
:meth:`~sparkstep.coordinator_api.procedures.Procedures.checkpoint`). A failed turn is logged
and the next one comes at the next interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sparkstep.errors import SparkstepError

__all__ = ["CheckpointTimer"]

log = logging.getLogger("sparkstep.coordinator")


class CheckpointTimer:
    """Calls ``checkpoint()`` every ``interval_s`` while ``is_up()``, until ``stop`` is set."""

    def __init__(
        self,
        interval_s: float,
        stop: threading.Event,
        is_up: Callable[[], bool],
        checkpoint: Callable[[], object],
    ) -> None:
        self.interval_s = interval_s
        self._stop = stop
        self._is_up = is_up
        self._checkpoint = checkpoint
        self._thread = threading.Thread(target=self._run, name="checkpoint-timer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self._is_up():
                continue
            try:
                self._checkpoint()
            except SparkstepError as exc:
                log.info("timer checkpoint skipped: %s", exc)
