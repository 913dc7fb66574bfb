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

__all__ = ["ENV_VAR", "FAILPOINT_EXIT_CODE", "armed", "failpoint"]

ENV_VAR = "SPARKSTEP_FAILPOINT"
FAILPOINT_EXIT_CODE = 86

_lock = threading.Lock()
_armed: dict[str, int] | None = None
_sleeps: dict[str, float] = {}
_hits: dict[str, int] = {}


def _parse(spec: str) -> tuple[dict[str, int], dict[str, float]]:
    points: dict[str, int] = {}
    sleeps: dict[str, float] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        point, _, action = item.partition(":")
        name, _, nth = point.partition("@")
        points[name] = int(nth) if nth else 1
        if action:
            kind, _, seconds = action.partition("=")
            if kind != "sleep":
                raise ValueError(f"{ENV_VAR}: unknown failpoint action {action!r}")
            sleeps[name] = float(seconds)
    return points, sleeps


def armed() -> dict[str, int]:
    """The armed failpoints of this process: name -> the hit that fires it (1 = the first)."""
    global _armed
    with _lock:
        if _armed is None:
            _armed, sleeps = _parse(os.environ.get(ENV_VAR, ""))
            _sleeps.update(sleeps)
        return dict(_armed)


def failpoint(name: str) -> None:
    """Exit the process at once with :data:`FAILPOINT_EXIT_CODE` if ``name`` is armed and due
    (or sleep there, if it is armed with ``:sleep=S``)."""
    points = armed()
    if name not in points:
        return
    with _lock:
        hit = _hits.get(name, 0) + 1
        _hits[name] = hit
    if hit == points[name]:
        sleep_s = _sleeps.get(name)
        if sleep_s is not None:
            sys.stderr.write(f"sparkstep: failpoint {name} sleeps {sleep_s:g}s (hit {hit})\n")
            sys.stderr.flush()
            time.sleep(sleep_s)
            return
        sys.stderr.write(f"sparkstep: failpoint {name} fired (hit {hit})\n")
        sys.stderr.flush()
        os._exit(FAILPOINT_EXIT_CODE)
