"""Foreign errors: the one place where rocksdict and OS errors become storage errors.

Every module of the RocksDB store wraps calls into rocksdict and the file system with
:func:`translated` (or, on hot paths, catches and calls :func:`raise_translated`), so a caller of
:mod:`sparkstep.storage` only ever sees a :class:`~sparkstep.storage.errors.StorageError`, a
``TypeError``/``ValueError`` for its own bug, or ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import rocksdict

from sparkstep.storage.errors import (
    CorruptStoreError,
    RocksDBError,
    StorageError,
    StoreClosedError,
    StoreLockedError,
)

__all__ = ["raise_translated", "translate_errors", "translated"]


def translate_errors(exc: BaseException, action: str) -> StorageError:
    """The storage error for ``exc`` (raised by rocksdict or the OS while doing ``action``).

    Callers write ``raise translate_errors(exc, "...") from exc``. Storage errors pass through
    unchanged. RocksDB reports failures as plain ``Exception`` with its status text, so the
    category is read from that text: ``Corruption`` -> :class:`CorruptStoreError`, a RocksDB lock
    -> :class:`StoreLockedError`, a closed handle -> :class:`StoreClosedError`, anything else ->
    :class:`RocksDBError`.
    """
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, rocksdict.DbClosedError):
        return StoreClosedError(f"{action}: the database is closed")
    text = str(exc)
    if "Corruption" in text:
        return CorruptStoreError(f"{action}: RocksDB reports corruption: {text}")
    if "lock hold" in text or "LOCK" in text:
        return StoreLockedError(f"{action}: the RocksDB directory is locked: {text}")
    if isinstance(exc, FileNotFoundError):
        return CorruptStoreError(f"{action}: a file of the store is missing: {text}")
    return RocksDBError(f"{action}: {type(exc).__name__}: {text}")


@contextlib.contextmanager
def translated(action: str) -> Iterator[None]:
    """Translate every foreign error raised inside the block (caller bugs pass unchanged)."""
    try:
        yield
    except (StorageError, TypeError, ValueError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise translate_errors(exc, action) from exc


def raise_translated(exc: Exception, action: str) -> NoReturn:
    """Re-raise ``exc`` from a hot path: a non-bytes key is a caller bug (``TypeError``)."""
    if isinstance(exc, KeyError) and "bytes" in str(exc):
        raise TypeError(f"{action}: keys and values must be bytes") from exc
    raise translate_errors(exc, action) from exc
