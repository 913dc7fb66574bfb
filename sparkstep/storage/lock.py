"""The store's directory lock: one owner per store, across processes and inside one process."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import weakref
from pathlib import Path
from typing import Final

from sparkstep.storage.errors import StoreLockedError
from sparkstep.storage.layout import LOCK_FILE

__all__ = ["DirectoryLock"]

_LOCK_POLL_SECONDS: Final = 0.02


class DirectoryLock:
    """An exclusive ``flock`` on ``<path>/sparkstep.lock``, released by ``release`` or by GC.

    ``flock`` locks belong to an open file description, so a second object in the same process
    conflicts exactly like another process does, and the kernel releases the lock when its
    holder dies (SIGKILL included): a dead owner never blocks its successor. Waits up to
    ``timeout`` seconds (0 = not at all) for the holder, then raises :class:`StoreLockedError`
    naming the holder's pid. The lock file is never deleted: deleting it would let two owners
    lock two different files of the same name.
    """

    def __init__(self, directory: Path, timeout: float) -> None:
        if timeout < 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds, not {timeout}")
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._finalizer = weakref.finalize(self, os.close, fd)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    holder = self._holder(path)
                    self._finalizer()
                    waited = f" after waiting {timeout:g} s" if timeout else ""
                    raise StoreLockedError(
                        f"store {directory} is open elsewhere ({holder}){waited}: one process "
                        "owns a store; stop the other owner or pass lock_timeout to wait for it"
                    ) from None
                time.sleep(min(_LOCK_POLL_SECONDS, remaining))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @staticmethod
    def _holder(path: Path) -> str:
        try:
            pid = path.read_text().strip()
        except OSError:
            pid = ""
        if not pid:
            return "held by another store object or process"
        if pid == str(os.getpid()):
            return f"held by another store object of this process, pid {pid}"
        return f"held by pid {pid}"

    def release(self) -> None:
        """Release the lock and close the file; idempotent."""
        if self._finalizer.alive:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._finalizer()
