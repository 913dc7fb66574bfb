"""Child processes that announce readiness with one JSON line on stdout (workers, runtime)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from typing import Any


def ready_line(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
    """The child's JSON ready line; None if it exited first. Raises TimeoutError after
    ``timeout`` seconds without one."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no ready line within {timeout}s")
        ready, _, _ = select.select([proc.stdout], [], [], min(remaining, 1.0))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            line += chunk
    doc: dict[str, Any] = json.loads(line)
    return doc
