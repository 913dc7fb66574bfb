"""``python -m bench.timed_worker --apply-log FILE <worker args>``: a state worker that logs
the wall time of every ``apply``.

The benchmarks' stand-in for ``python -m sparkstep.runtime.worker`` (same arguments, same
behaviour): ``StateWorker.apply`` is wrapped so each call appends one JSON line to ``FILE``,
``{"step": s, "start": unix s, "end": unix s}``, flushed at once (the worker leaves with
``os._exit``). Unix time, so the lines of several workers can be laid side by side: whether
their applies of one step overlapped is whether the stateful stage ran in parallel.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def read_apply_log(path: Path) -> list[tuple[int, float, float]]:
    """The ``(step, start, end)`` of every apply logged in ``path`` (none if it is missing)."""
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        if line.strip():
            doc = json.loads(line)
            calls.append((int(doc["step"]), float(doc["start"]), float(doc["end"])))
    return calls


def _wrap_apply(out: TextIO) -> None:
    from sparkstep.runtime.worker.service import StateWorker

    apply = StateWorker.apply
    lock = threading.Lock()

    def timed_apply(self: StateWorker, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return apply(self, *args, **kwargs)
        finally:
            end = time.time()
            step = kwargs["step"] if "step" in kwargs else args[1]
            with lock:
                out.write(json.dumps({"step": int(step), "start": start, "end": end}) + "\n")
                out.flush()

    StateWorker.apply = timed_apply  # type: ignore[method-assign]


def main() -> int:
    from sparkstep.runtime.worker.__main__ import main as worker_main

    argv = sys.argv[1:]
    if len(argv) < 2 or argv[0] != "--apply-log":
        sys.stderr.write("usage: python -m bench.timed_worker --apply-log FILE <worker args>\n")
        return 2
    _wrap_apply(open(argv[1], "a"))  # noqa: SIM115 - open for the worker's whole life
    return worker_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main())
