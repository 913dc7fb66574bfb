"""The per-worker two-version store (seed 004, "Database") on RocksDB.

Imports nothing of sparkstep but the shared :mod:`sparkstep.errors`, :mod:`sparkstep.ids` and
:mod:`sparkstep.failpoints`. The contract is :mod:`sparkstep.storage.base`, the on-disk format
:mod:`sparkstep.storage.layout` (the store itself: :mod:`sparkstep.storage.rocksdb`, which
lists the module of each part), the shard key rule :mod:`sparkstep.storage.keys`::

    from sparkstep.storage import RocksDBStore, shard_key

    with RocksDBStore(path, deployment=dep, fingerprint=fp, lock_timeout=10) as store:
        v = store.versions()[-1]
        db = store.open(v)                      # working copy of v; the version above discarded
        batch = db.batch()
        batch.put("sums", shard_key(3, b"alice"), b"42")
        batch.delete("markers", shard_key(3, b"old"))
        db.write(batch)                         # atomic across tables
        db.set_step(17)
        db.commit()                             # versions() == range(v, v + 2)

Only what sparkstep created is ever deleted: ``is_store(path)`` is true only for a directory
made as a store (it holds the marker ``SPARKSTEP_STORE``, :mod:`sparkstep.storage.marker`).
"""

from sparkstep.storage.base import Database, DatabaseStatus, ExportedShards, Store, WriteBatch
from sparkstep.storage.database import RocksDBDatabase, RocksDBWriteBatch
from sparkstep.storage.errors import (
    CorruptStoreError,
    InvalidShardError,
    InvalidTableError,
    NotAStoreError,
    RocksDBError,
    StorageError,
    StoreBusyError,
    StoreClosedError,
    StoreExistsError,
    StoreFencedError,
    StoreLockedError,
    VersionNotAvailableError,
    WrongDeploymentError,
    WrongFingerprintError,
)
from sparkstep.storage.keys import (
    MAX_SHARDS,
    SHARD_PREFIX_BYTES,
    shard_key,
    shard_of,
    shard_prefix,
    shard_ranges,
)
from sparkstep.storage.marker import is_store
from sparkstep.storage.options import RocksDBOptions
from sparkstep.storage.rocksdb import RocksDBStore, StoreInfo

__all__ = [
    "CorruptStoreError",
    "Database",
    "DatabaseStatus",
    "ExportedShards",
    "InvalidShardError",
    "InvalidTableError",
    "MAX_SHARDS",
    "NotAStoreError",
    "RocksDBDatabase",
    "RocksDBError",
    "RocksDBOptions",
    "RocksDBStore",
    "RocksDBWriteBatch",
    "SHARD_PREFIX_BYTES",
    "StorageError",
    "Store",
    "StoreBusyError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreFencedError",
    "StoreInfo",
    "StoreLockedError",
    "VersionNotAvailableError",
    "WriteBatch",
    "WrongDeploymentError",
    "WrongFingerprintError",
    "is_store",
    "shard_key",
    "shard_of",
    "shard_prefix",
    "shard_ranges",
]
