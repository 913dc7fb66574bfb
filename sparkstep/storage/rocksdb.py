"""The two-version store on RocksDB (rocksdict): committed versions are checkpoints.

The contract is :mod:`sparkstep.storage.base`; this module is how it is kept on disk.

On-disk layout of a store at ``<path>``::

    <path>/
      sparkstep.lock     flock()ed by the RocksDBStore object that owns the store (never deleted;
                         holds the owner's pid, for error messages)
      VERSION            THE COMMIT POINT. JSON {"format": 1, "versions": [v] or [v, v+1],
                         "deployment", "fingerprint", "checksum"}; replaced only atomically
                         (write VERSION.tmp, fsync, rename over VERSION, fsync <path>)
      VERSION.tmp        a version file being written; ignored, removed by the next open
      CREATING           JSON {"version": v} while a new store is being made; a crash leaves it
                         and the next RocksDBStore(path) finishes the creation from scratch
      versions/<n>/      committed version n: a RocksDB checkpoint (SST files are hard links,
                         MANIFEST/OPTIONS/WAL copied), fsynced, never opened for writing
      versions/<other>   any entry not listed in VERSION (a checkpoint cut short by a crash, a
                         discarded version, RocksDB's "<n>.tmp"): an orphan, deleted by open()
      work/              the working copy: a RocksDB database opened by open(v) and written
                         until commit; rebuilt from versions/<v> by every open(v)

Why it is crash safe. VERSION is the only thing that says which versions exist, and it changes
by one atomic rename. A committed version's directory is complete and fsynced before VERSION
names it, and is never written again (the working copy is a separate directory; RocksDB never
modifies an SST file, it only creates and unlinks them, so sharing SSTs through hard links is
safe). Writes to the working copy skip the WAL: after a crash the working copy is thrown away
anyway, and ``commit`` flushes every memtable before taking the checkpoint.

``open(v)`` (numbered as in the code):

1. publish ``VERSION = [v]`` (discards the other version) - failpoints
   ``store.open.after_version_tmp`` (only when there is a version to discard) and
   ``store.open.after_discard``;
2. delete orphans: every ``versions/`` entry but ``v``, ``work/``, ``VERSION.tmp`` -
   ``store.open.after_cleanup``;
3. build ``work/`` from ``versions/<v>``: hard-link SST and blob files, copy the rest (a few
   small files) - ``store.open.after_copy``;
4. open RocksDB on ``work/`` and check the version recorded inside it is ``v`` -
   ``store.open.after_open``.

``commit()`` (the database was opened at ``v``):

1. record ``v + 1`` in the working state's metadata - ``store.commit.before_flush``;
2. flush every column family - ``store.commit.after_flush``;
3. checkpoint the working copy into ``versions/<v+1>`` (hard links: cost grows with the number
   of changed files, not with the data) and fsync it - ``store.commit.after_checkpoint``;
4. publish ``VERSION = [v, v+1]``: ``store.commit.after_version_tmp`` (temp file written, not
   renamed), ``store.commit.after_version_file`` (renamed and directory fsynced);
5. close the working copy - ``store.commit.after_close``.

A crash before step 4's rename leaves ``{v}``; after it, ``{v, v+1}``. Either is allowed.

Creating a store (``store.create.*`` failpoints) writes ``CREATING``, builds an empty checkpoint,
publishes ``VERSION`` and removes the marker; recording an identity given to a store that had
none rewrites ``VERSION`` the same atomic way (``store.identity.after_version_tmp``).

Tables are RocksDB column families named ``"t." + table``, created on first write. Internal
metadata (the step, the layout, the version a checkpoint holds) lives in the ``default`` column
family, which no table can map to, so user table names have no reserved values and shard
export/import/drop, which walk the ``t.`` families only, never touch metadata.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn, cast

import rocksdict

from sparkstep.failpoints import failpoint
from sparkstep.ids import ShardId, Step, Version
from sparkstep.storage.base import Database, DatabaseStatus, ExportedShards, Store, WriteBatch
from sparkstep.storage.errors import (
    CorruptStoreError,
    InvalidTableError,
    RocksDBError,
    StorageError,
    StoreBusyError,
    StoreClosedError,
    StoreExistsError,
    StoreLockedError,
    VersionNotAvailableError,
    WrongDeploymentError,
    WrongFingerprintError,
)
from sparkstep.storage.keys import shard_ranges

__all__ = [
    "FAILPOINTS",
    "RocksDBDatabase",
    "RocksDBOptions",
    "RocksDBStore",
    "RocksDBWriteBatch",
    "StoreInfo",
    "translate_errors",
]

FAILPOINTS: Final = (
    "store.commit.after_checkpoint",
    "store.commit.after_close",
    "store.commit.after_flush",
    "store.commit.after_version_file",
    "store.commit.after_version_tmp",
    "store.commit.before_flush",
    "store.create.after_checkpoint",
    "store.create.after_version_file",
    "store.create.after_version_tmp",
    "store.identity.after_version_tmp",
    "store.open.after_cleanup",
    "store.open.after_copy",
    "store.open.after_discard",
    "store.open.after_open",
    "store.open.after_version_tmp",
)
"""Every failpoint inside create, open and commit (see the module docstring for the instants)."""

_FORMAT = 1
_LOCK_FILE = "sparkstep.lock"
_VERSION_FILE = "VERSION"
_VERSION_TMP = "VERSION.tmp"
_CREATING = "CREATING"
_VERSIONS_DIR = "versions"
_WORK_DIR = "work"
_TABLE_PREFIX = "t."
_MAX_TABLE_NAME = 200
_META_STEP = b"step"
_META_LAYOUT = b"layout"
_META_VERSION = b"version"
_LOCK_POLL_SECONDS = 0.02


# --------------------------------------------------------------------------------------------
# Foreign errors: the one place where rocksdict and OS errors become storage errors.
# --------------------------------------------------------------------------------------------


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
def _translated(action: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, TypeError, ValueError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise translate_errors(exc, action) from exc


def _raise_translated(exc: Exception, action: str) -> NoReturn:
    """Re-raise ``exc`` from a hot path: a non-bytes key is a caller bug (``TypeError``)."""
    if isinstance(exc, KeyError) and "bytes" in str(exc):
        raise TypeError(f"{action}: keys and values must be bytes") from exc
    raise translate_errors(exc, action) from exc


# --------------------------------------------------------------------------------------------
# Options and small file-system helpers.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RocksDBOptions:
    """RocksDB tuning of a store's working copy (committed versions are only read by open).

    The defaults suit one state worker on a small machine; they are not part of the on-disk
    format, so a store can be reopened with other values.
    """

    write_buffer_size: int = 64 << 20
    max_write_buffer_number: int = 3
    target_file_size_base: int = 64 << 20
    max_background_jobs: int = 2
    compression: str = "lz4"

    def to_options(self) -> rocksdict.Options:
        """The rocksdict ``Options`` (raw bytes mode) for the database and each column family."""
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_max_write_buffer_number(self.max_write_buffer_number)
        options.set_target_file_size_base(self.target_file_size_base)
        options.set_max_background_jobs(self.max_background_jobs)
        try:
            compression = getattr(rocksdict.DBCompressionType, self.compression)()
        except AttributeError:
            raise ValueError(f"unknown RocksDB compression {self.compression!r}") from None
        options.set_compression_type(compression)
        return options


@dataclass(frozen=True)
class StoreInfo:
    """What ``VERSION`` says about a store, read without taking its lock (see ``inspect``)."""

    path: Path
    versions: range
    deployment: str | None
    fingerprint: str | None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """fsync every file of ``directory`` (not recursive), then the directory itself."""
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            _fsync_path(Path(entry.path))
    _fsync_path(directory)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _encode_u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


def _decode_u64(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


def _table_cf(table: str) -> str:
    if not isinstance(table, str) or not table or len(table) > _MAX_TABLE_NAME:
        raise InvalidTableError(
            f"table name {table!r} is invalid: use a non-empty string of at most "
            f"{_MAX_TABLE_NAME} characters"
        )
    return _TABLE_PREFIX + table


# --------------------------------------------------------------------------------------------
# The version file.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _VersionFile:
    versions: range
    deployment: str | None
    fingerprint: str | None

    def _body(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "versions": list(self.versions),
            "deployment": self.deployment,
            "fingerprint": self.fingerprint,
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: Path) -> _VersionFile:
        def bad(why: str) -> CorruptStoreError:
            return CorruptStoreError(
                f"version file {where} is garbled ({why}): the store cannot say which versions "
                "it holds; restore the state directory from a backup or recreate it"
            )

        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise bad("not a JSON object")
        checksum = data.pop("checksum", None)
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        if checksum != hashlib.sha256(canonical.encode()).hexdigest():
            raise bad("checksum mismatch")
        if data.get("format") != _FORMAT:
            raise bad(f"unknown format {data.get('format')!r}")
        versions = data.get("versions")
        if (
            not isinstance(versions, list)
            or len(versions) not in (1, 2)
            or not all(type(v) is int and v >= 0 for v in versions)
            or (len(versions) == 2 and versions[1] != versions[0] + 1)
        ):
            raise bad(f"versions {versions!r} are not one or two consecutive versions")
        deployment, fingerprint = data.get("deployment"), data.get("fingerprint")
        if not all(x is None or isinstance(x, str) for x in (deployment, fingerprint)):
            raise bad("deployment and fingerprint must be strings or null")
        return cls(range(versions[0], versions[-1] + 1), deployment, fingerprint)


# --------------------------------------------------------------------------------------------
# The directory lock.
# --------------------------------------------------------------------------------------------


class _DirectoryLock:
    """An exclusive ``flock`` on ``<path>/sparkstep.lock``, released by ``release`` or by GC.

    ``flock`` locks belong to an open file description, so a second object in the same process
    conflicts exactly like another process does, and the kernel releases the lock when its
    holder dies (SIGKILL included): a dead owner never blocks its successor.
    """

    def __init__(self, directory: Path, timeout: float) -> None:
        if timeout < 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds, not {timeout}")
        path = directory / _LOCK_FILE
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
        if self._finalizer.alive:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._finalizer()


# --------------------------------------------------------------------------------------------
# The store.
# --------------------------------------------------------------------------------------------


class RocksDBStore(Store):
    """A worker's two-version store in the directory ``path`` (see the module docstring).

    ``RocksDBStore(path)`` takes the directory lock (waiting up to ``lock_timeout`` seconds for
    a previous owner, 0 = fail at once with :class:`StoreLockedError`), creates a new store
    holding only version 0 if ``path`` holds none (a missing or empty directory), and checks the
    identity: ``deployment`` and ``fingerprint``, when given, must equal what the store
    recorded (:class:`WrongDeploymentError`, :class:`WrongFingerprintError`); a store that has
    recorded none records what it is first given. ``None`` skips the check.

    The object owns the store until :meth:`close` (also as a context manager).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        deployment: str | None = None,
        fingerprint: str | None = None,
        lock_timeout: float = 0.0,
        options: RocksDBOptions | None = None,
        _new_version: int | None = None,
        _replace: bool = False,
    ) -> None:
        self._path = Path(path)
        self._options = options or RocksDBOptions()
        self._db: RocksDBDatabase | None = None
        self._closed = False
        with _translated(f"opening store {self._path}"):
            self._path.mkdir(parents=True, exist_ok=True)
            self._lock = _DirectoryLock(self._path, lock_timeout)
        try:
            with _translated(f"opening store {self._path}"):
                self._state = self._load_or_create(_new_version, _replace)
                self._check_identity(deployment, fingerprint)
        except BaseException:
            self._lock.release()
            self._closed = True
            raise

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        version: int,
        deployment: str | None = None,
        fingerprint: str | None = None,
        lock_timeout: float = 0.0,
        options: RocksDBOptions | None = None,
        replace: bool = False,
    ) -> RocksDBStore:
        """A new empty store at ``path`` whose only version is ``version`` (rescale adds workers).

        Raises :class:`StoreExistsError` if ``path`` already holds a store (or other files),
        unless ``replace`` is true, in which case that store is deleted first (under the lock).
        A creation cut short by a crash is not a store: it is redone.
        """
        if type(version) is not int or version < 0:
            raise ValueError(f"version must be an int >= 0, not {version!r}")
        return cls(
            path,
            deployment=deployment,
            fingerprint=fingerprint,
            lock_timeout=lock_timeout,
            options=options,
            _new_version=version,
            _replace=replace,
        )

    @staticmethod
    def inspect(path: str | os.PathLike[str]) -> StoreInfo:
        """Read a store's version file without taking its lock (for observers, e.g. status).

        The answer can be stale as soon as it returns if an owner is working on the store.
        """
        where = Path(path) / _VERSION_FILE
        with _translated(f"inspecting store {path}"):
            if not where.exists():
                raise CorruptStoreError(f"{path} holds no store (no {_VERSION_FILE} file)")
            state = _VersionFile.parse(where.read_bytes(), where)
        return StoreInfo(Path(path), state.versions, state.deployment, state.fingerprint)

    # ---- properties and Store API ---------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def deployment(self) -> str | None:
        return self._state.deployment

    @property
    def fingerprint(self) -> str | None:
        return self._state.fingerprint

    @property
    def options(self) -> RocksDBOptions:
        """The RocksDB tuning used for working copies."""
        return self._options

    def versions(self) -> range:
        self._check_not_closed()
        return self._state.versions

    def open(self, version: int) -> RocksDBDatabase:
        self._check_not_closed()
        if self._db is not None and not self._db.closed:
            raise StoreBusyError(
                f"store {self._path} already has a database open at version "
                f"{self._db.base_version}: commit or close it first"
            )
        self._db = None
        available = self._state.versions
        if type(version) is not int or version not in available:
            raise VersionNotAvailableError(
                f"store {self._path} cannot open version {version}: it holds versions "
                f"{list(available)} (seed 004: only the last one or two commits are kept)",
                requested=version,
                available=available,
            )
        with _translated(f"opening version {version} of store {self._path}"):
            # Step 1. Publish VERSION = [version]: the other version is gone from here on.
            if available != range(version, version + 1):
                self._publish(range(version, version + 1), "store.open")
            failpoint("store.open.after_discard")
            # Step 2. Collect orphans: other version dirs, the old working copy, temp files.
            self._collect_orphans(keep=version)
            failpoint("store.open.after_cleanup")
            # Step 3. Build the working copy from the checkpoint of `version`.
            work = self._path / _WORK_DIR
            self._copy_checkpoint(self._version_dir(version), work)
            failpoint("store.open.after_copy")
            # Step 4. Open RocksDB on it and check it holds what it claims.
            db = RocksDBDatabase(self, work, Version(version), self._options)
            failpoint("store.open.after_open")
        self._db = db
        return db

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._db is not None:
                self._db.close()
        finally:
            self._db = None
            self._closed = True
            self._lock.release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"versions={list(self._state.versions)}"
        return f"RocksDBStore({str(self._path)!r}, {state})"

    # ---- internals used by RocksDBDatabase --------------------------------------------------

    def _version_dir(self, version: int) -> Path:
        return self._path / _VERSIONS_DIR / str(version)

    def _committed(self, base: Version, checkpoint: Path) -> None:
        """Steps 3 (fsync) and 4 of commit: make ``checkpoint`` durable and publish it."""
        _fsync_tree(checkpoint)
        _fsync_path(checkpoint.parent)
        failpoint("store.commit.after_checkpoint")
        self._publish(range(base, base + 2), "store.commit")
        failpoint("store.commit.after_version_file")

    def _reload_versions(self) -> None:
        """Re-read VERSION after a failed commit (it may or may not have been published)."""
        path = self._path / _VERSION_FILE
        with contextlib.suppress(OSError, StorageError):
            self._state = _VersionFile.parse(path.read_bytes(), path)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self._path} is closed: make a new RocksDBStore")

    # ---- creation, loading, identity ---------------------------------------------------------

    def _load_or_create(self, new_version: int | None, replace: bool) -> _VersionFile:
        version_file = self._path / _VERSION_FILE
        creating = self._path / _CREATING
        if version_file.exists() and not creating.exists():
            if new_version is not None:
                if not replace:
                    raise StoreExistsError(
                        f"{self._path} already holds a store (versions "
                        f"{list(self._read_version_file().versions)}): pass replace=True to "
                        "delete it, or choose another path"
                    )
                return self._create(new_version)  # CREATING first: a crash redoes it
            state = self._read_version_file()
            self._check_version_dirs(state)
            return state
        if creating.exists():
            # A creation was cut short: redo it at the version it was making.
            target = new_version
            if target is None:
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    target = int(json.loads(creating.read_bytes())["version"])
            return self._create(0 if target is None else target)
        others = [p.name for p in self._path.iterdir() if p.name != _LOCK_FILE]
        if not others:
            return self._create(0 if new_version is None else new_version)
        if new_version is not None and replace:
            return self._create(new_version)
        if new_version is not None:
            raise StoreExistsError(
                f"{self._path} is not empty ({', '.join(sorted(others)[:5])}) and holds no "
                "store: choose an empty path or pass replace=True"
            )
        raise CorruptStoreError(
            f"store {self._path} has no {_VERSION_FILE} file but holds {sorted(others)[:5]}: "
            "the version file was deleted or this is not a sparkstep store; restore it from a "
            "backup or delete the directory to start empty"
        )

    def _read_version_file(self) -> _VersionFile:
        path = self._path / _VERSION_FILE
        return _VersionFile.parse(path.read_bytes(), path)

    def _check_version_dirs(self, state: _VersionFile) -> None:
        for version in state.versions:
            if not (self._version_dir(version) / "CURRENT").is_file():
                raise CorruptStoreError(
                    f"store {self._path} lists version {version} but its checkpoint "
                    f"{self._version_dir(version)} is missing or incomplete: the directory was "
                    "damaged outside sparkstep; restore it from a backup"
                )

    def _create(self, version: int) -> _VersionFile:
        """Make a store whose only version is ``version``, empty; crash safe via CREATING."""
        creating = self._path / _CREATING
        # Step 1. Mark the directory as being created, durably.
        creating.write_bytes(json.dumps({"version": version}).encode())
        _fsync_path(creating)
        _fsync_path(self._path)
        # Step 2. Remove anything an earlier attempt left behind.
        for entry in self._path.iterdir():
            if entry.name not in (_LOCK_FILE, _CREATING):
                _remove(entry)
        # Step 3. An empty database whose metadata says `version`, checkpointed as that version.
        (self._path / _VERSIONS_DIR).mkdir()
        work = self._path / _WORK_DIR
        options = self._options.to_options()
        rdb = rocksdict.Rdict(str(work), options)
        try:
            write_options = rocksdict.WriteOptions()
            rdb.put(_META_VERSION, _encode_u64(version), write_options)
            rdb.put(_META_STEP, _encode_u64(0), write_options)
            rdb.flush(True)
            rocksdict.Checkpoint(rdb).create_checkpoint(str(self._version_dir(version)))
        finally:
            rdb.close()
        _fsync_tree(self._version_dir(version))
        _fsync_path(self._path / _VERSIONS_DIR)
        failpoint("store.create.after_checkpoint")
        # Step 4. Publish it; from here on the store exists.
        state = _VersionFile(range(version, version + 1), None, None)
        self._write_version_file(state, "store.create")
        failpoint("store.create.after_version_file")
        # Step 5. Done: drop the marker and the scratch working copy.
        creating.unlink()
        _remove(work)
        _fsync_path(self._path)
        return state

    def _check_identity(self, deployment: str | None, fingerprint: str | None) -> None:
        recorded = self._state
        if deployment is not None and recorded.deployment not in (None, deployment):
            raise WrongDeploymentError(
                f"store {self._path} belongs to deployment {recorded.deployment}, not "
                f"{deployment}: use the state directory of this deployment, another --name, "
                "or `sparkstep reset`",
                expected=deployment,
                found=str(recorded.deployment),
            )
        if fingerprint is not None and recorded.fingerprint not in (None, fingerprint):
            raise WrongFingerprintError(
                f"store {self._path} was made for fingerprint {recorded.fingerprint}, not "
                f"{fingerprint}: the pipeline's state schema, shard count or operators changed; "
                "the old state cannot be read by this pipeline (`sparkstep reset` starts "
                "empty)",
                expected=fingerprint,
                found=str(recorded.fingerprint),
            )
        new_deployment = recorded.deployment if deployment is None else deployment
        new_fingerprint = recorded.fingerprint if fingerprint is None else fingerprint
        if (new_deployment, new_fingerprint) != (recorded.deployment, recorded.fingerprint):
            state = _VersionFile(recorded.versions, new_deployment, new_fingerprint)
            self._write_version_file(state, "store.identity")
            self._state = state

    # ---- version file and orphans ------------------------------------------------------------

    def _publish(self, versions: range, point: str) -> None:
        state = _VersionFile(versions, self._state.deployment, self._state.fingerprint)
        self._write_version_file(state, point)
        self._state = state

    def _write_version_file(self, state: _VersionFile, point: str) -> None:
        """Atomically replace VERSION: write a temp file, fsync, rename, fsync the directory."""
        tmp = self._path / _VERSION_TMP
        with open(tmp, "wb") as out:
            out.write(state.to_bytes())
            out.flush()
            os.fsync(out.fileno())
        failpoint(f"{point}.after_version_tmp")
        os.replace(tmp, self._path / _VERSION_FILE)
        _fsync_path(self._path)

    def _collect_orphans(self, keep: int) -> None:
        versions_dir = self._path / _VERSIONS_DIR
        for entry in versions_dir.iterdir():
            if entry.name != str(keep):
                _remove(entry)
        for name in (_WORK_DIR, _VERSION_TMP, _CREATING):
            _remove(self._path / name)
        _fsync_path(versions_dir)
        _fsync_path(self._path)

    @staticmethod
    def _copy_checkpoint(source: Path, target: Path) -> None:
        """A working copy of a checkpoint: immutable files hard-linked, the rest copied.

        RocksDB never rewrites SST or blob files, so both directories can share them; MANIFEST,
        CURRENT, OPTIONS and WAL files are rewritten or appended by an open database, so they
        are copied (they are small). Not fsynced: a working copy does not survive a crash.
        """
        target.mkdir()
        for entry in os.scandir(source):
            destination = target / entry.name
            if entry.name.endswith((".sst", ".blob")):
                os.link(entry.path, destination)
            else:
                shutil.copyfile(entry.path, destination)


# --------------------------------------------------------------------------------------------
# The open database and its write batch.
# --------------------------------------------------------------------------------------------


class RocksDBWriteBatch(WriteBatch):
    """A :class:`~sparkstep.storage.base.WriteBatch` over one rocksdict ``WriteBatch``.

    Each operation goes straight into the RocksDB batch, naming the table's column family, so
    the whole batch commits in one RocksDB write (atomic across column families). A table
    first named here is created when the operation is added; if the batch is then dropped, an
    empty table remains, which reads exactly like no table.
    """

    __slots__ = ("_db", "_handles", "_wb")

    def __init__(self, db: RocksDBDatabase) -> None:
        self._db = db
        self._handles = db._handles  # the same dict object: cleared when the db ends
        self._wb = rocksdict.WriteBatch(raw_mode=True)

    def put(self, table: str, key: bytes, value: bytes) -> None:
        handle = self._handles.get(table)
        if handle is None:
            handle = self._db._family(table)[1]
        try:
            self._wb.put(key, value, handle)
        except Exception as exc:
            _raise_translated(exc, f"batch put into table {table!r}")

    def delete(self, table: str, key: bytes) -> None:
        handle = self._handles.get(table)
        if handle is None:
            handle = self._db._family(table)[1]
        try:
            self._wb.delete(key, handle)
        except Exception as exc:
            _raise_translated(exc, f"batch delete from table {table!r}")

    def delete_range(self, table: str, begin: bytes, end: bytes) -> None:
        handle = self._handles.get(table)
        if handle is None:
            handle = self._db._family(table)[1]
        try:
            self._wb.delete_range(begin, end, handle)
        except Exception as exc:
            _raise_translated(exc, f"batch delete_range in table {table!r}")

    def __len__(self) -> int:
        return int(self._wb.len())


class RocksDBDatabase(Database):
    """A :class:`RocksDBStore` opened at ``base_version``: its working copy, until commit/close.

    Made only by :meth:`RocksDBStore.open`. Status (:class:`DatabaseStatus`): ``OPEN`` until
    :meth:`commit` (``COMMITTED``) or :meth:`close` (``CLOSED``); both end it and every later
    call raises :class:`StoreClosedError`. Writes skip the RocksDB WAL (see the module
    docstring).
    """

    def __init__(
        self, store: RocksDBStore, work: Path, base_version: Version, options: RocksDBOptions
    ) -> None:
        self._store: RocksDBStore | None = store
        self._work = work
        self._base = base_version
        self._status = DatabaseStatus.OPEN
        self._create_lock = threading.Lock()
        self._write_options = rocksdict.WriteOptions()
        # rocksdict's stub declares disable_wal a method; at runtime it is a property.
        setattr(self._write_options, "disable_wal", True)  # noqa: B010
        self._options = options
        rocks_options = options.to_options()
        rocks_options.create_if_missing(False)
        families = rocksdict.Rdict.list_cf(str(work), rocks_options)
        self._rdb: rocksdict.Rdict | None = rocksdict.Rdict(
            str(work),
            rocks_options,
            column_families={name: options.to_options() for name in families if name != "default"},
        )
        # table -> (column family view, column family handle); empty once closed, so the hot
        # paths need no separate closed check: a miss goes to _family(), which checks.
        self._families: dict[str, tuple[rocksdict.Rdict, rocksdict.ColumnFamily]] = {}
        self._handles: dict[str, rocksdict.ColumnFamily] = {}
        try:
            for name in families:
                if name.startswith(_TABLE_PREFIX):
                    self._remember(name[len(_TABLE_PREFIX) :], name)
            recorded = self._rdb.get(_META_VERSION)
            if recorded is None or _decode_u64(recorded) != base_version:
                found = None if recorded is None else _decode_u64(recorded)
                raise CorruptStoreError(
                    f"checkpoint of version {base_version} in store {store.path} holds version "
                    f"{found}: the directory was altered outside sparkstep"
                )
        except BaseException:
            self._drop_handles()
            raise

    # ---- status --------------------------------------------------------------------------------

    @property
    def base_version(self) -> Version:
        return self._base

    @property
    def status(self) -> DatabaseStatus:
        return self._status

    def _live(self) -> rocksdict.Rdict:
        if self._rdb is None:
            raise StoreClosedError(
                f"the database opened at version {self._base} is {self._status.value}: "
                "open the store again"
            )
        return self._rdb

    def _remember(self, table: str, name: str) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        rdb = self._live()
        entry = (rdb.get_column_family(name), rdb.get_column_family_handle(name))
        self._families[table] = entry
        self._handles[table] = entry[1]
        return entry

    def _family(self, table: str) -> tuple[rocksdict.Rdict, rocksdict.ColumnFamily]:
        """The column family of ``table``, created on first use (the slow path of every call)."""
        with self._create_lock:
            entry = self._families.get(table)
            if entry is not None:
                return entry
            name = _table_cf(table)
            rdb = self._live()
            with _translated(f"creating table {table!r}"):
                rdb.create_column_family(name, self._options.to_options())
                return self._remember(table, name)

    def _drop_handles(self) -> None:
        for view, _ in self._families.values():
            with contextlib.suppress(Exception):
                view.close()
        # Cleared, not rebound: batches hold the same dict and must see the db end.
        self._families.clear()
        self._handles.clear()
        rdb, self._rdb = self._rdb, None
        if rdb is not None:
            with contextlib.suppress(Exception):
                rdb.close()

    # ---- reads and writes --------------------------------------------------------------------

    def get(self, table: str, key: bytes) -> bytes | None:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return None
        try:
            value: bytes | None = entry[0].get(key)
        except Exception as exc:
            _raise_translated(exc, f"get from table {table!r}")
        return value

    def get_many(self, table: str, keys: Sequence[bytes]) -> list[bytes | None]:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return [None] * len(keys)
        try:
            values = cast(list[bytes | None], entry[0].get(list(keys)))
        except Exception as exc:
            _raise_translated(exc, f"get_many from table {table!r}")
        return values

    def put(self, table: str, key: bytes, value: bytes) -> None:
        entry = self._families.get(table) or self._family(table)
        try:
            entry[0].put(key, value, self._write_options)
        except Exception as exc:
            _raise_translated(exc, f"put into table {table!r}")

    def delete(self, table: str, key: bytes) -> None:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return
        try:
            entry[0].delete(key, self._write_options)
        except Exception as exc:
            _raise_translated(exc, f"delete from table {table!r}")

    def batch(self) -> RocksDBWriteBatch:
        self._live()
        return RocksDBWriteBatch(self)

    def write(self, batch: WriteBatch) -> None:
        if not isinstance(batch, RocksDBWriteBatch) or batch._db is not self:
            raise TypeError("write() takes a batch made by this database's batch()")
        rdb = self._live()
        try:
            rdb.write(batch._wb, self._write_options)
        except Exception as exc:
            _raise_translated(exc, "write batch")
        batch._wb = rocksdict.WriteBatch(raw_mode=True)

    def items(
        self, table: str, *, start: bytes | None = None, end: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        entry = self._families.get(table)
        if entry is None:
            self._live()
            _table_cf(table)
            return iter(())
        return self._iterate(entry[0], table, start, end)

    @staticmethod
    def _iterate(
        view: rocksdict.Rdict, table: str, start: bytes | None, end: bytes | None
    ) -> Iterator[tuple[bytes, bytes]]:
        read_options = rocksdict.ReadOptions()
        if end is not None:
            read_options.set_iterate_upper_bound(end)
        try:
            if start is None:
                yield from view.items(read_opt=read_options)
            else:
                yield from view.items(from_key=start, read_opt=read_options)
        except Exception as exc:
            _raise_translated(exc, f"iterating table {table!r}")

    def tables(self) -> list[str]:
        self._live()
        return sorted(self._families)

    # ---- metadata ----------------------------------------------------------------------------

    def get_step(self) -> Step:
        with _translated("get_step"):
            raw = self._live().get(_META_STEP)
        return Step(0 if raw is None else _decode_u64(raw))

    def set_step(self, step: int) -> None:
        if type(step) is not int or not 0 <= step < 1 << 64:
            raise ValueError(f"step must be an int in 0..2**64-1, not {step!r}")
        with _translated("set_step"):
            self._live().put(_META_STEP, _encode_u64(step), self._write_options)

    def get_layout(self) -> bytes | None:
        with _translated("get_layout"):
            raw: bytes | None = self._live().get(_META_LAYOUT)
        return raw

    def set_layout(self, layout: bytes) -> None:
        if not isinstance(layout, bytes):
            raise TypeError(f"layout must be bytes (e.g. JSON encoded), not {type(layout)}")
        with _translated("set_layout"):
            self._live().put(_META_LAYOUT, layout, self._write_options)

    # ---- shards -------------------------------------------------------------------------------

    def export_shards(self, shards: Iterable[int], directory: str | Path) -> ExportedShards:
        chosen = tuple(ShardId(s) for s in sorted(set(shards)))
        ranges = shard_ranges(chosen)
        self._live()
        target = Path(directory)
        token = uuid.uuid4().hex[:12]
        files: dict[str, tuple[str, ...]] = {}
        keys = size = 0
        with _translated(f"exporting shards to {target}"):
            target.mkdir(parents=True, exist_ok=True)
            for index, table in enumerate(sorted(self._families)):
                view = self._families[table][0]
                path = target / f"export-{token}-{index:04d}.sst"
                writer: rocksdict.SstFileWriter | None = None
                for begin, end in ranges:
                    for key, value in self._iterate(view, table, begin, end):
                        if writer is None:
                            writer = rocksdict.SstFileWriter(options=self._options.to_options())
                            writer.open(str(path))
                        writer[key] = value
                        keys += 1
                if writer is not None:
                    writer.finish()
                    size += path.stat().st_size
                    files[table] = (str(path),)
        return ExportedShards(shards=chosen, files=files, keys=keys, bytes=size)

    def import_files(
        self, files: Mapping[str, Sequence[str | Path]], *, move: bool = False
    ) -> None:
        ingest = rocksdict.IngestExternalFileOptions()
        ingest.set_move_files(move)
        for table in sorted(files):
            paths = [str(p) for p in files[table]]
            if not paths:
                continue
            view = self._family(table)[0]
            with _translated(f"importing {len(paths)} file(s) into table {table!r}"):
                view.ingest_external_file(paths, ingest)

    def drop_shards(self, shards: Iterable[int]) -> None:
        ranges = shard_ranges(shards)
        batch = self.batch()
        for table in sorted(self._families):
            for begin, end in ranges:
                batch.delete_range(table, begin, end)
        if len(batch):
            self.write(batch)

    # ---- commit and close ----------------------------------------------------------------------

    def commit(self) -> None:
        rdb = self._live()
        store = self._store
        assert store is not None
        new = self._base + 1
        checkpoint = store._version_dir(new)
        try:
            with _translated(f"committing version {new} of store {store.path}"):
                # Step 1. Record the version this state becomes.
                rdb.put(_META_VERSION, _encode_u64(new), self._write_options)
                failpoint("store.commit.before_flush")
                # Step 2. Flush every memtable (writes skip the WAL).
                for view, _ in self._families.values():
                    view.flush(True)
                rdb.flush(True)
                failpoint("store.commit.after_flush")
                # Step 3. Checkpoint into versions/<v+1> (hard links), durably.
                _remove(checkpoint)
                _remove(checkpoint.with_name(checkpoint.name + ".tmp"))
                rocksdict.Checkpoint(rdb).create_checkpoint(str(checkpoint))
                # Step 4. Publish VERSION = [v, v+1] (fsyncs the checkpoint first).
                store._committed(self._base, checkpoint)
        except BaseException:
            self._status = DatabaseStatus.CLOSED
            self._drop_handles()
            store._reload_versions()
            raise
        # Step 5. Close the working copy.
        self._status = DatabaseStatus.COMMITTED
        self._drop_handles()
        failpoint("store.commit.after_close")

    def close(self) -> None:
        if self._status is not DatabaseStatus.OPEN:
            return
        self._status = DatabaseStatus.CLOSED
        self._drop_handles()

    def __repr__(self) -> str:
        return f"RocksDBDatabase(base_version={self._base}, status={self._status.name})"
