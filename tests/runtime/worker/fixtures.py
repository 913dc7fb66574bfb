"""Factories for the worker tests: real worker processes on real stores.

- :class:`WorkerProcess`: ``python -m sparkstep.runtime.worker`` as a child with a stdin pipe,
  its ready line parsed, SIGKILL and restart helpers, an optional armed failpoint.
- ``worker_factory``: starts workers for a test and stops (SIGKILLs if need be) every one at the
  end.
- ``token_file``: a bearer token on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sparkstep.failpoints import ENV_VAR
from sparkstep.runtime.worker import WorkerClient
from tests.children import ready_line

READY_TIMEOUT = 60.0


class WorkerProcess:
    """One worker child process on ``store`` (started by :meth:`start`)."""

    def __init__(
        self,
        store: Path,
        token_file: Path,
        shards: int,
        failpoint: str | None = None,
        args: tuple[str, ...] = (),
    ):
        self.args = args
        self.store = store
        self.token_file = token_file
        self.shards = shards
        self.failpoint = failpoint
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.address: str | None = None  # HOST:PORT from the ready line: what clients dial
        self.log = store.parent / f"{store.name}.{uuid.uuid4().hex[:6]}.log"

    def start(self) -> WorkerProcess:
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        if self.failpoint:
            env[ENV_VAR] = self.failpoint
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sparkstep.runtime.worker",
                    "--store",
                    str(self.store),
                    "--port",
                    "0",
                    "--token-file",
                    str(self.token_file),
                    "--shards",
                    str(self.shards),
                    "--lock-timeout",
                    "30",
                    *self.args,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        try:
            ready = ready_line(self.proc, READY_TIMEOUT)
        except TimeoutError:
            raise TimeoutError(
                f"worker not ready in {READY_TIMEOUT}s: {self.log.read_text()}"
            ) from None
        if ready is None:
            raise RuntimeError(f"worker exited before ready: {self.log.read_text()}")
        self.port = int(ready["port"])
        self.address = str(ready["address"])
        return self

    def client(self, token: str | None = None) -> WorkerClient:
        assert self.address is not None
        tok = token if token is not None else self.token_file.read_text().strip()
        return WorkerClient(self.address, tok, timeout=60.0)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait(30)

    def wait(self, timeout: float) -> int:
        """Wait for the exit (bounded) and return the exit code."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        return code

    def close_stdin(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


WorkerFactory = Callable[..., WorkerProcess]


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def token_file(module_dir: Path) -> Path:
    path = module_dir / "token"
    path.write_text(uuid.uuid4().hex + "\n")
    return path


@pytest.fixture(scope="module")
def worker_factory(module_dir: Path, token_file: Path) -> Iterator[WorkerFactory]:
    started: list[WorkerProcess] = []

    def make(
        store: Path | None = None,
        shards: int = 8,
        failpoint: str | None = None,
        args: tuple[str, ...] = (),
    ) -> WorkerProcess:
        path = store if store is not None else module_dir / f"store-{uuid.uuid4().hex[:8]}"
        proc = WorkerProcess(path, token_file, shards, failpoint, args).start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()
