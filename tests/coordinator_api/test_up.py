"""``sparkstep up`` driven as a subprocess: it starts a broker, the example pipeline and a
demo producer, shows live progress, and stops everything cleanly on SIGINT."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sparkstep.failpoints import ENV_VAR
from sparkstep.io.broker import find_free_port
from tests.coordinator_api.fixtures import pid_alive

PROGRESS = re.compile(r"state (\w+)\s+step\s+(\d+)\s+(\d+) records/s\s+last checkpoint (.+)")


def _lines_until(proc: subprocess.Popen[bytes], pattern: re.Pattern[str], timeout: float,
                 seen: list[str]) -> re.Match[str]:  # fmt: skip
    """Read stdout lines until one matches ``pattern``; every line is kept in ``seen``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            assert proc.poll() is None, "\n".join(seen)
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, "sparkstep up exited:\n" + "\n".join(seen)
        buffer += chunk
        *lines, rest = buffer.split(b"\n")
        buffer = rest
        for raw in lines:
            line = raw.decode(errors="replace")
            seen.append(line)
            match = pattern.search(line)
            if match:
                return match
    raise AssertionError(f"no line matching {pattern.pattern} in {timeout}s:\n" + "\n".join(seen))


def test_up_starts_shows_progress_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    kafka_port = find_free_port()
    with (tmp_path / "up.err").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkstep.cli", "up", "--dir", str(tmp_path / "up"),
             "--kafka-port", str(kafka_port), "--api-port", "0", "--rate", "100"],
            stdout=subprocess.PIPE, stderr=err, env=env,
        )  # fmt: skip
    seen: list[str] = []
    try:
        url = _lines_until(proc, re.compile(r"dashboard: (http://127\.0\.0\.1:\d+)/"), 180, seen)
        base = url.group(1)
        # Progress: running, steps advancing, records flowing, a checkpoint taken.
        moving = re.compile(r"state running\s+step\s+([1-9]\d*)\s+([1-9]\d*) records/s")
        _lines_until(proc, moving, 300, seen)
        _lines_until(proc, re.compile(r"last checkpoint v[1-9]\d* at step [1-9]"), 120, seen)
        # The checkpoint timer pauses the loop for a moment every 10 s: wait for it to run.
        deadline = time.monotonic() + 60
        status = httpx.get(f"{base}/api/v1/status", timeout=30).json()
        while status["state"] == "paused" and time.monotonic() < deadline:
            time.sleep(0.2)
            status = httpx.get(f"{base}/api/v1/status", timeout=30).json()
        assert status["state"] == "running" and status["pipeline"] == "keyed_sum"
        children = [status["processes"]["runtime"], *status["processes"]["workers"].values()]
        broker_pid = int((tmp_path / "up" / "kafka" / "broker.pid").read_text())

        proc.send_signal(signal.SIGINT)
        _lines_until(proc, re.compile(r"stopped: produced (\d+) records"), 180, seen)
        assert proc.wait(60) == 0, "\n".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert not any(pid_alive(p) for p in children)
    assert not pid_alive(broker_pid)
    assert not (tmp_path / "up" / "kafka" / "broker.pid").exists()
    errors = (tmp_path / "up.err").read_text(errors="replace")
    assert "Traceback" not in errors, errors[-3000:]
    # The final checkpoint is the manifest's: nothing is replayed at the next start.
    manifest = (tmp_path / "up" / "state" / "manifest.json").read_text()
    assert '"version"' in manifest
