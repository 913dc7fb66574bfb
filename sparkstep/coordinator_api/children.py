"""The coordinator's child processes (state workers, the runtime): start, readiness, exit.

Each child gets a pipe on stdin that the coordinator never writes to and never closes while it
wants the child alive: the child exits at EOF, so it dies with the coordinator even when the
coordinator is SIGKILLed (and the children also set the parent-death signal themselves).
stdout goes to ``<log_dir>/<slug>.out`` (the child's ready line,
``{"port": P, "pid": PID, "address": "HOST:PORT", ...}``, is its first JSON line there; a file
never fills up and blocks the child the way an unread pipe would), stderr to
``<log_dir>/<slug>.log`` (appended across restarts). ``address`` is the one the child
advertises (:mod:`sparkstep.net`); the coordinator and the other children dial it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sparkstep.coordinator_api.errors import LaunchError
from sparkstep.errors import ConfigError

__all__ = ["Child", "read_token", "spawn", "wait_ready", "write_token_file"]


@dataclass
class Child:
    """One started child process; ``ready`` is its ready line once it said it."""

    role: str
    proc: subprocess.Popen[bytes]
    out_path: Path
    log_path: Path
    ready: dict[str, Any] | None = field(default=None)
    store: str | None = field(default=None)  # a worker's store, as the manifest names it
    host: str | None = field(default=None)  # a child runs on the coordinator's host
    log_offset: int = 0  # where this incarnation's stderr starts in log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """The ``HOST:PORT`` it advertised in its ready line (what the others dial)."""
        assert self.ready is not None, f"{self.role} is not ready"
        return str(self.ready["address"])

    def poll_ready(self) -> bool:
        """True once the ready line is there; raises :class:`LaunchError` if the child exited."""
        if self.ready is not None:
            return True
        try:
            text = self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            if line.startswith("{") and '"port"' in line:
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if isinstance(doc, dict):
                    self.ready = doc
                    return True
        if self.proc.poll() is not None:
            raise LaunchError(f"{self.role} {self.describe_exit()} before it was ready")
        return False

    def describe_exit(self) -> str:
        """``exited with status 3: <its last message>`` or ``was killed by SIGKILL``."""
        code = self.proc.returncode
        if code is None:
            return "is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name}"  # whatever it logged last is not why
        what = f"exited with status {code}"
        last = self.last_message()
        return f"{what}: {last}" if last else what

    def last_message(self) -> str:
        """The last ``sparkstep:`` (or logged ERROR) line this incarnation wrote to stderr."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self.log_offset)
                text = fh.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        lines = [ln for ln in text.splitlines()[-500:] if ln]
        ours = [ln for ln in lines if ln.startswith("sparkstep:") or " ERROR " in ln]
        return ours[-1][:500] if ours else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, timeout: float = 30.0) -> None:
        """Close its stdin (EOF), SIGKILL it if still alive, and reap it."""
        stdin = self.proc.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
            self.proc.wait(timeout)

    def release(self, timeout: float) -> bool:
        """Close its stdin and wait up to ``timeout`` for it to exit by itself; True if it did."""
        stdin = self.proc.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def spawn(
    role: str, slug: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str]
) -> Child:
    """Start ``argv`` as the child ``role`` with its stdin pipe and its output files."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = log_dir / f"{slug}.out"
    log_path = log_dir / f"{slug}.log"
    with out_path.open("wb") as out, log_path.open("ab") as err:
        err.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {role}\n".encode())
        err.flush()
        offset = err.tell()
        # A session of its own: Ctrl-C in the coordinator's terminal reaches the coordinator
        # only, which then stops the children in order (a final checkpoint first).
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            env=dict(env),
            start_new_session=True,
        )
    return Child(role=role, proc=proc, out_path=out_path, log_path=log_path, log_offset=offset)


class Starting(Protocol):
    """A process that says when it is ready (a :class:`Child`, or a worker on a state host)."""

    role: str

    def poll_ready(self) -> bool: ...


def wait_ready(children: Sequence[Starting], timeout: float) -> None:
    """Until every child said it is ready; :class:`LaunchError` if one exits or time is up."""
    deadline = time.monotonic() + timeout
    while True:
        ready = [child.poll_ready() for child in children]
        if all(ready):
            return
        if time.monotonic() > deadline:
            silent = [c.role for c, r in zip(children, ready, strict=True) if not r]
            raise LaunchError(f"{', '.join(silent)} not ready within {timeout:.0f}s")
        time.sleep(0.1)


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, readable by the owner only (0600) from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def read_token(path: Path) -> str:
    """The first line of a token file; :class:`ConfigError` (one line) if it cannot be read."""
    try:
        token = path.read_text().splitlines()[0].strip() if path.stat().st_size else ""
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"the token file {path} is empty: put the token on its first line")
    return token
