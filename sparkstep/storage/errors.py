"""Errors of the storage layer (the two-version worker store).

Every error this layer raises derives from :class:`StorageError`. Each can be rebuilt from its
message alone (``cls(message)``; the keyword details are optional), so errors can cross a
process boundary (the state worker's RPC) or be pickled. Errors raised by rocksdict
(plain ``Exception`` with RocksDB's status text, ``rocksdict.DbClosedError``) and by the file
system while the store manipulates its directory are translated in one place,
:func:`sparkstep.storage.translate.translate_errors`, and re-raised with ``from exc``.
"""

from __future__ import annotations

from sparkstep.errors import SparkstepError

__all__ = [
    "CorruptStoreError",
    "InvalidShardError",
    "InvalidTableError",
    "NotAStoreError",
    "RocksDBError",
    "StorageError",
    "StoreBusyError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreFencedError",
    "StoreLockedError",
    "VersionNotAvailableError",
    "WrongDeploymentError",
    "WrongFingerprintError",
]


class StorageError(SparkstepError):
    """Raised for every failure of the worker store; the base of this layer's errors."""


class StoreLockedError(StorageError):
    """Raised when another process or store object holds the store's directory lock."""


class StoreExistsError(StorageError):
    """Raised when ``RocksDBStore.create`` finds a store already at the path (and not replace)."""


class NotAStoreError(StorageError):
    """Raised when a store is opened or created in a non-empty directory sparkstep did not make."""


class StoreBusyError(StorageError):
    """Raised when ``open`` is called while a database of the same store is still open."""


class StoreClosedError(StorageError):
    """Raised when a closed (committed, closed or abandoned) store or database is used."""


class VersionNotAvailableError(StorageError):
    """Raised when ``open(v)`` names a version outside ``versions()``."""

    def __init__(
        self, message: str, *, requested: int | None = None, available: range | None = None
    ) -> None:
        super().__init__(message)
        self.requested = requested
        self.available = available


class WrongDeploymentError(StorageError):
    """Raised when a store that belongs to one deployment is opened for another."""

    def __init__(
        self, message: str, *, expected: str | None = None, found: str | None = None
    ) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class WrongFingerprintError(StorageError):
    """Raised when a store's fingerprint (schema, S, operators) differs from the caller's."""

    def __init__(
        self, message: str, *, expected: str | None = None, found: str | None = None
    ) -> None:
        super().__init__(message)
        self.expected = expected
        self.found = found


class StoreFencedError(StorageError):
    """Raised when a caller presents a fencing token below the highest the store admitted, or
    none to a store that admitted one: a newer owner has taken the store over."""


class CorruptStoreError(StorageError):
    """Raised when the store's directory is missing, garbled or inconsistent with itself."""


class InvalidTableError(StorageError):
    """Raised when a table name is empty, not a string or too long."""


class InvalidShardError(StorageError):
    """Raised when a shard number is outside ``0 <= shard < 2**32`` or a key has no shard."""


class RocksDBError(StorageError):
    """Raised when RocksDB or the file system fails for a reason not covered above (I/O, space)."""
