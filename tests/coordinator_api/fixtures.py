"""Helpers of the coordinator tests: the coordinator as a child process, REST calls in process.

- :class:`CoordinatorProcess`: ``sparkstep run ...`` as a child (the real command, a real
  uvicorn on a free port), its URL from its first stdout line, SIGKILL and restart.
- :func:`asgi_call`: one request to a FastAPI app in process through ``httpx.ASGITransport``.
- :func:`sparkstep_cli`: the ``sparkstep`` command as a child, its exit status and output.
- :func:`metric_samples`: the samples of one family of a Prometheus text.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from sparkstep.failpoints import ENV_VAR

URL_LINE = re.compile(r"at (http://127\.0\.0\.1:\d+)/")


def asgi_call(
    app: FastAPI,
    method: str,
    path: str,
    token: str | None = None,
    json: Any = None,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One request to ``app`` in process (``httpx.ASGITransport``)."""
    all_headers = dict(headers or {})
    if token is not None:
        all_headers["authorization"] = f"Bearer {token}"

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
            return await c.request(
                method, path, json=json, content=content, headers=all_headers, timeout=600
            )

    return asyncio.run(go())


def sparkstep_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[int, str, str]:
    """``sparkstep ARGS`` as a child; (exit status, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sparkstep.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc.returncode, proc.stdout, proc.stderr


def metric_samples(text: str, family: str) -> dict[str, float]:
    """``{labels: value}`` of the samples of ``family`` in a Prometheus text."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            name, _, value = line.rpartition(" ")
            samples[name[len(family) :]] = float(value)
    return samples


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.5)


class CoordinatorProcess:
    """``sparkstep run ARGS`` as a child process, restartable on the same arguments."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self.env = dict(env if env is not None else os.environ)
        self.env.pop(ENV_VAR, None)
        self.proc: subprocess.Popen[str] | None = None
        self.url: str | None = None

    def start(self, timeout: float = 120) -> CoordinatorProcess:
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sparkstep.cli", "run", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the first line says where the API is
        match = URL_LINE.search(line)
        assert match, f"no URL line from the coordinator: {line!r}\n{self.tail()}"
        self.url = match.group(1)
        return self

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def status(self) -> dict[str, Any]:
        assert self.url is not None
        response = httpx.get(f"{self.url}/api/v1/status", timeout=30)
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc

    def wait_state(self, state: str, timeout: float = 300) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def reached() -> bool:
            nonlocal found
            found = self.status()
            assert found["state"] != "failed", f"{found}\n{self.tail()}"
            return bool(found["state"] == state)

        wait_until(reached, timeout, f"state {state} ({found}):\n{self.tail()}")
        return found

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait(30)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
