"""Named failpoints: deterministic crash injection for the crash tests.

Code that must survive a crash at a given instant calls :func:`failpoint` with a stable name, for
example ``failpoint("store.commit.after_checkpoint")``. In production nothing happens. A test arms
failpoints for a child process through the environment variable ``SPARKSTEP_FAILPOINT``:

- ``SPARKSTEP_FAILPOINT=store.commit.after_checkpoint`` kills the process the first time the
  point is reached;
- ``SPARKSTEP_FAILPOINT=store.commit.after_checkpoint@3`` kills it the third time;
- ``SPARKSTEP_FAILPOINT=rescale.after_commits:sleep=60`` (or ``...@3:sleep=60``) does not kill:
  the process sleeps 60 s there once, then carries on (a slow disk or a stalled peer, for
  deadline tests);
- ``SPARKSTEP_FAILPOINT=worker.get.after_chunk:raise`` (or ``...@2:raise``) does not kill
  either: the call raises :class:`FailpointError` there once (a transient fault: a broken
  stream, a read that failed), and the caller's error handling takes over;
- several points are separated by commas; the first to fire wins.

"Kill" means ``os._exit(FAILPOINT_EXIT_CODE)``: no ``finally`` blocks, no atexit handlers, no
flushing of Python buffers, which is as close to SIGKILL as a process can do to itself while
still telling the test which point fired (the exit code).

This module is the one place that reads the environment outside the entry points: failpoints
must reach code deep in a child process without threading a test-only argument through every
constructor. The variable is read once, at the first call.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Literal

__all__ = ["ENV_VAR", "FAILPOINT_EXIT_CODE", "FailpointError", "armed", "failpoint"]

ENV_VAR = "SPARKSTEP_FAILPOINT"
FAILPOINT_EXIT_CODE = 86

_lock = threading.Lock()
_armed: dict[str, int] | None = None
_actions: dict[str, float | Literal["raise"]] = {}  # seconds to sleep, or "raise"
_hits: dict[str, int] = {}


class FailpointError(RuntimeError):
    """Raised by a failpoint armed with ``:raise``: an injected transient fault."""


def _parse(spec: str) -> tuple[dict[str, int], dict[str, float | Literal["raise"]]]:
    """``{name: the hit that fires it}`` and ``{name: seconds to sleep, or "raise"}``."""
    points: dict[str, int] = {}
    actions: dict[str, float | Literal["raise"]] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        point, _, action = item.partition(":")
        name, _, nth = point.partition("@")
        points[name] = int(nth) if nth else 1
        if action == "raise":
            actions[name] = "raise"
        elif action:
            kind, _, seconds = action.partition("=")
            if kind != "sleep":
                raise ValueError(f"{ENV_VAR}: unknown failpoint action {action!r}")
            actions[name] = float(seconds)
    return points, actions


def armed() -> dict[str, int]:
    """The armed failpoints of this process: name -> the hit that fires it (1 = the first)."""
    global _armed
    with _lock:
        if _armed is None:
            _armed, actions = _parse(os.environ.get(ENV_VAR, ""))
            _actions.update(actions)
        return dict(_armed)


def failpoint(name: str) -> None:
    """Exit the process at once with :data:`FAILPOINT_EXIT_CODE` if ``name`` is armed and due
    (or sleep there, if it is armed with ``:sleep=S``; or raise :class:`FailpointError`, if it
    is armed with ``:raise``)."""
    points = armed()
    if name not in points:
        return
    with _lock:
        hit = _hits.get(name, 0) + 1
        _hits[name] = hit
    if hit == points[name]:
        action = _actions.get(name)
        if action == "raise":
            sys.stderr.write(f"sparkstep: failpoint {name} raises (hit {hit})\n")
            sys.stderr.flush()
            raise FailpointError(f"failpoint {name} raised (hit {hit})")
        if action is not None:
            sys.stderr.write(f"sparkstep: failpoint {name} sleeps {action:g}s (hit {hit})\n")
            sys.stderr.flush()
            time.sleep(action)
            return
        sys.stderr.write(f"sparkstep: failpoint {name} fired (hit {hit})\n")
        sys.stderr.flush()
        os._exit(FAILPOINT_EXIT_CODE)
