"""The store marker: how sparkstep tells a directory it created as a store from anything else.

Every store directory holds ``SPARKSTEP_STORE`` (:data:`~sparkstep.storage.layout.MARKER`),
written and fsynced when the store is created, before any other file of it, and never removed.
Whoever deletes store directories (the coordinator's clean-up of leftover stores, ``replace`` of
:meth:`RocksDBStore.create`) deletes only a directory for which :func:`is_store` is true, so a
user's directory that happens to sit where a store is expected is never touched.

Stores made before the marker existed are recognised by what only sparkstep writes: a ``VERSION``
file that passes its checksum (:mod:`.version_file`), or a creation cut short (``CREATING``
holding ``{"version": <int>}`` next to ``sparkstep.lock``). Opening such a store adds the marker.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from sparkstep.storage.errors import StorageError
from sparkstep.storage.files import fsync_path
from sparkstep.storage.layout import CREATING, LOCK_FILE, MARKER, MARKER_TEXT
from sparkstep.storage.version_file import read_version_file

__all__ = ["has_marker", "is_legacy_store", "is_store", "write_marker"]


def has_marker(directory: Path) -> bool:
    """True if ``directory`` holds the marker as a regular file (its bytes are not checked:
    a crash while it is written can leave it short, and it is still sparkstep's)."""
    try:
        return stat.S_ISREG(os.lstat(directory / MARKER).st_mode)
    except OSError:
        return False


def is_store(path: str | os.PathLike[str]) -> bool:
    """True only for a directory sparkstep created as a store, complete or half created.

    That is a real directory (not a symlink) holding the marker, or a store made before the
    marker existed: a valid ``VERSION`` file, or ``CREATING`` with ``{"version": <int>}`` next to
    ``sparkstep.lock``. False for everything else: a missing path, a file, a symlink, an empty
    directory (sparkstep writes the marker first, so an empty directory holds nothing of a
    store), a directory that cannot be read. Reads only; takes no lock.
    """
    directory = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return False
    except OSError:
        return False
    return has_marker(directory) or is_legacy_store(directory)


def is_legacy_store(directory: Path) -> bool:
    """True if ``directory`` holds a store made before the marker existed (see the module)."""
    try:
        read_version_file(directory)
        return True
    except (OSError, StorageError):
        pass
    try:
        creating = json.loads((directory / CREATING).read_bytes())
    except (OSError, ValueError):
        return False
    return (
        isinstance(creating, dict)
        and type(creating.get("version")) is int
        and (directory / LOCK_FILE).is_file()
    )


def write_marker(directory: Path) -> None:
    """Write the marker into ``directory`` durably (the file, then the directory, fsynced).

    Idempotent (the bytes are always the same), so two processes creating the same store may
    both write it.
    """
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, MARKER_TEXT, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(directory)
