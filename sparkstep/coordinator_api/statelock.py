"""Who uses a state dir: ``<state_dir>/sparkstep.lock``, ``flock()``ed by its one user.

A coordinator (:func:`~sparkstep.coordinator_api.serve.serve`) holds it from before it reads
the manifest until every child is gone; ``sparkstep reset`` holds it while it deletes. The file
holds the holder's pid, for messages. It follows the stores' convention (each store directory
has its own ``sparkstep.lock``, held by the worker that owns the store), so a second coordinator
on the same state dir, or a reset under a running pipeline, is refused instead of racing.

``flock`` locks belong to the open file description and the kernel drops them when the holder
dies (SIGKILL included): a dead coordinator never blocks the next one. The descriptor is
close-on-exec, so the coordinator's children never hold it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from sparkstep.errors import ConfigError

__all__ = ["DirectoryLock", "LOCK_FILE"]

#: The lock file's name, in the state dir and in every store directory.
LOCK_FILE = "sparkstep.lock"


class DirectoryLock:
    """An exclusive lock on ``<directory>/sparkstep.lock``, held until :meth:`release`.

    Raises :class:`~sparkstep.errors.ConfigError` at once if another process (or another
    object of this one) holds it: ``"<what> is in use by pid N: <then>"``. With ``create``
    false a missing lock file means nobody holds the directory: :attr:`held` is then False.
    """

    def __init__(self, directory: Path, what: str, then: str, create: bool = True) -> None:
        path = directory / LOCK_FILE
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            self._fd: int | None = None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{what} is in use by {_holder(path)}: {then}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let go (idempotent)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid else "another process"
