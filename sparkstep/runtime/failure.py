"""The failure record: recognising a step failure that will recur on every replay.

A step is a function of its logged division and the checkpointed state, so a failure inside it
(a user function that raises for one key, a kernel that cannot apply a batch, output that cannot
be written) happens again when recovery reruns the step. Restarting cannot help; it would burn
the coordinator's restarts until the pipeline is failed anyway, without saying why.

When a step fails, the runtime records ``{step, cause}`` in the state dir before it exits
(:func:`record_failure`). If the record already held the same step and the same cause, the
failure recurred on replay: :func:`record_failure` says so, and the runtime process exits with
``EXIT_PERMANENT`` (:mod:`sparkstep.runtime.process`), which the coordinator never restarts.
A failure whose cause can pass (a worker or Kafka unreachable, a fenced incarnation: the
:data:`TRANSIENT` classes) is never recorded. A checkpoint past the recorded step removes the
record (:func:`clear_failure`).

On disk: ``<state_dir>/failure.json``, replaced atomically (temp file, fsync, rename, fsync of
the directory)::

    {"format": 1, "step": s, "cause": "<ErrorClass>: <message>", "at": <unix seconds>}

An unreadable record counts as none (it is only ever a hint to stop restarting).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sparkstep.ids import Step
from sparkstep.io.errors import KafkaUnavailableError
from sparkstep.runtime.errors import (
    FencedError,
    StateMachineError,
    WorkerClosedError,
    WorkerUnavailableError,
)

__all__ = ["FAILURE_FILE", "StepFailure", "TRANSIENT", "clear_failure", "record_failure"]

FAILURE_FILE = "failure.json"
_FORMAT = 1
_CAUSE_CHARS = 1000

TRANSIENT: tuple[type[BaseException], ...] = (
    FencedError,
    KafkaUnavailableError,
    StateMachineError,
    WorkerClosedError,
    WorkerUnavailableError,
)
"""Failures that can pass on their own; never recorded."""


@dataclass(frozen=True)
class StepFailure:
    """Step ``step`` failed with ``cause`` (``"<ErrorClass>: <message>"``, one line)."""

    step: Step
    cause: str

    @classmethod
    def of(cls, step: Step, exc: BaseException) -> StepFailure:
        lines = str(exc).strip().splitlines() or [""]
        return cls(step, f"{type(exc).__name__}: {lines[0]}"[:_CAUSE_CHARS])


def _read(state_dir: Path) -> StepFailure | None:
    try:
        doc = json.loads((state_dir / FAILURE_FILE).read_text())
        if doc.get("format") != _FORMAT:
            return None
        return StepFailure(Step(int(doc["step"])), str(doc["cause"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def record_failure(state_dir: Path, failure: StepFailure) -> bool:
    """Record ``failure`` durably; True if the record already held the same step and cause."""
    recurred = _read(state_dir) == failure
    doc = {"format": _FORMAT, "step": failure.step, "cause": failure.cause, "at": time.time()}
    temp = state_dir / f"{FAILURE_FILE}.tmp"
    with temp.open("w") as out:
        out.write(json.dumps(doc))
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, state_dir / FAILURE_FILE)
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return recurred


def clear_failure(state_dir: Path, checkpoint_step: Step) -> None:
    """Remove the record if a checkpoint at ``checkpoint_step`` is past its step."""
    recorded = _read(state_dir)
    if recorded is not None and recorded.step < checkpoint_step:
        (state_dir / FAILURE_FILE).unlink(missing_ok=True)
