"""The on-disk layout of a RocksDB store: every name the store gives to a file or directory.

A store at ``<path>``::

    <path>/
      SPARKSTEP_STORE    the marker: this directory is a store sparkstep created. Written and
                         fsynced (file and <path>) before anything else in <path>, never removed;
                         sparkstep deletes or replaces only directories that hold it (or a store
                         made before the marker existed); :mod:`.marker`
      sparkstep.lock     flock()ed by the RocksDBStore object that owns the store (never deleted;
                         holds the owner's pid, for error messages); :mod:`.lock`
      VERSION            THE COMMIT POINT. JSON {"format": 1, "versions": [v] or [v, v+1],
                         "deployment", "fingerprint", "checksum"}; replaced only atomically
                         (write VERSION.tmp, fsync, rename over VERSION, fsync <path>);
                         :mod:`.version_file`
      VERSION.tmp        a version file being written; ignored, removed by the next open
      CREATING           JSON {"version": v} while a new store is being made (after the marker
                         and the lock); a crash leaves it and the next RocksDBStore(path)
                         finishes the creation from scratch
      versions/<n>/      committed version n: a RocksDB checkpoint (SST files are hard links,
                         MANIFEST/OPTIONS/WAL copied), fsynced, never opened for writing
      versions/<other>   any entry not listed in VERSION (a checkpoint cut short by a crash, a
                         discarded version, RocksDB's "<n>.tmp"): an orphan, deleted by open()
      work/              the working copy: a RocksDB database opened by open(v) and written
                         until commit; rebuilt from versions/<v> by every open(v)
      load/              SST files a large write_sorted builds, moved into work/ when
                         ingested; anything left (a crash between the two) is removed by
                         open(v)

Inside each RocksDB database (checkpoint or working copy): tables are column families named
``"t." + table`` (:data:`TABLE_PREFIX`), created on first write. Internal metadata (the step,
the layout, the version a checkpoint holds) lives in the ``default`` column family under the keys
:data:`META_STEP`, :data:`META_LAYOUT`, :data:`META_VERSION` (integers as 8 bytes big-endian),
which no table can map to, so user table names have no reserved values and shard
export/import/drop, which walk the ``t.`` families only, never touch metadata.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CREATING",
    "LOAD_DIR",
    "LOCK_FILE",
    "MARKER",
    "MARKER_TEXT",
    "MAX_TABLE_NAME",
    "META_LAYOUT",
    "META_STEP",
    "META_VERSION",
    "TABLE_PREFIX",
    "VERSIONS_DIR",
    "VERSION_FILE",
    "VERSION_TMP",
    "WORK_DIR",
    "decode_u64",
    "encode_u64",
]

MARKER: Final = "SPARKSTEP_STORE"
MARKER_TEXT: Final = b"sparkstep store: this directory and everything in it belong to sparkstep\n"
LOCK_FILE: Final = "sparkstep.lock"
VERSION_FILE: Final = "VERSION"
VERSION_TMP: Final = "VERSION.tmp"
CREATING: Final = "CREATING"
VERSIONS_DIR: Final = "versions"
WORK_DIR: Final = "work"
LOAD_DIR: Final = "load"

TABLE_PREFIX: Final = "t."
MAX_TABLE_NAME: Final = 200
META_STEP: Final = b"step"
META_LAYOUT: Final = b"layout"
META_VERSION: Final = b"version"


def encode_u64(value: int) -> bytes:
    """An integer of the metadata as stored: 8 bytes, big-endian."""
    return value.to_bytes(8, "big")


def decode_u64(raw: bytes) -> int:
    """The integer :func:`encode_u64` stored."""
    return int.from_bytes(raw, "big")
