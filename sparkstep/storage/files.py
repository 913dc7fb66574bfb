"""Small file-system helpers of the store: fsync a file or a directory, remove, copy a checkpoint.

Durability rule the store relies on: a file or directory entry is on disk only once the file
*and* the directory that names it are fsynced (:func:`fsync_path` of each).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["copy_checkpoint", "fsync_path", "fsync_tree", "remove_path"]


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file of ``directory`` (not recursive), then the directory itself."""
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            fsync_path(Path(entry.path))
    fsync_path(directory)


def remove_path(path: Path) -> None:
    """Delete a file or a whole directory tree; a missing path is not an error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def copy_checkpoint(source: Path, target: Path) -> None:
    """A working copy of a checkpoint: immutable files hard-linked, the rest copied.

    RocksDB never rewrites SST or blob files, so both directories can share them; MANIFEST,
    CURRENT, OPTIONS and WAL files are rewritten or appended by an open database, so they are
    copied (they are small). Not fsynced: a working copy does not survive a crash.
    """
    target.mkdir()
    for entry in os.scandir(source):
        destination = target / entry.name
        if entry.name.endswith((".sst", ".blob")):
            os.link(entry.path, destination)
        else:
            shutil.copyfile(entry.path, destination)
