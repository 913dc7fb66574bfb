"""The two-version store on RocksDB (rocksdict): committed versions are checkpoints.

The contract is :mod:`sparkstep.storage.base`. The store is spread over a few modules, each
named after what it holds:

- :mod:`.layout` - the on-disk layout: every file and directory of a store, and the keys
  inside a checkpoint;
- :mod:`.version_file` - ``VERSION``, the commit point (atomic, checksummed);
- :mod:`.lock` - the directory lock (one owner per store);
- this module - :class:`RocksDBStore`: creating, loading, opening a version, the identity;
- :mod:`.database` - :class:`RocksDBDatabase`, the open working copy, and its write batch;
- :mod:`.shards` - shard export/import/drop (key ranges);
- :mod:`.translate` - the one place where rocksdict and OS errors become storage errors;
- :mod:`.files` - fsync and copy helpers; :mod:`.options` - RocksDB tuning.

Why it is crash safe. VERSION is the only thing that says which versions exist, and it changes
by one atomic rename. A committed version's directory is complete and fsynced before VERSION
names it, and is never written again (the working copy is a separate directory; RocksDB never
modifies an SST file, it only creates and unlinks them, so sharing SSTs through hard links is
safe). Writes to the working copy skip the WAL: after a crash the working copy is thrown away
anyway, and ``commit`` flushes every memtable before taking the checkpoint.

``open(v)`` (numbered as in the code):

1. publish ``VERSION`` without the version above ``v``, if there is one (``[v]`` or
   ``[v - 1, v]``; the version below stays until the next commit, see
   :mod:`sparkstep.storage.base`) - failpoints ``store.open.after_version_tmp`` (only when
   there is a version to discard) and ``store.open.after_discard``;
2. delete orphans: every ``versions/`` entry VERSION does not list, ``work/``, ``VERSION.tmp``
   - ``store.open.after_cleanup``;
3. build ``work/`` from ``versions/<v>``: hard-link SST and blob files, copy the rest (a few
   small files) - ``store.open.after_copy``;
4. open RocksDB on ``work/`` and check the version recorded inside it is ``v`` -
   ``store.open.after_open``.

``commit()`` (:meth:`RocksDBDatabase.commit`; the database was opened at ``v``):

1. record ``v + 1`` in the working state's metadata - ``store.commit.before_flush``;
2. flush every column family - ``store.commit.after_flush``;
3. checkpoint the working copy into ``versions/<v+1>`` (hard links: cost grows with the number
   of changed files, not with the data) and fsync it - ``store.commit.after_checkpoint``;
4. publish ``VERSION = [v, v+1]`` (the version below ``v``, if any, is gone from here on; its
   directory is an orphan the next ``open`` deletes): ``store.commit.after_version_tmp`` (temp
   file written, not renamed), ``store.commit.after_version_file`` (renamed and directory
   fsynced);
5. close the working copy - ``store.commit.after_close``.

A crash before step 4's rename leaves the versions ``open`` left (``{v}`` or ``{v-1, v}``);
after it, ``{v, v+1}``. Either is allowed.

Creating a store (``store.create.*`` failpoints): write the marker ``SPARKSTEP_STORE`` into the
empty directory before anything else (``store.create.after_marker``; :mod:`.marker`), take the
lock, write ``CREATING``, build an empty checkpoint, publish ``VERSION``, remove ``CREATING``.
A crash at any instant leaves a directory :func:`~sparkstep.storage.marker.is_store` recognises
(or an empty one), and the next ``RocksDBStore(path)`` finishes the creation. Recording an
identity given to a store that had none rewrites ``VERSION`` the same atomic way
(``store.identity.after_version_tmp``).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import rocksdict

from sparkstep.failpoints import failpoint
from sparkstep.ids import Version
from sparkstep.storage.base import Store
from sparkstep.storage.database import RocksDBDatabase
from sparkstep.storage.errors import (
    CorruptStoreError,
    NotAStoreError,
    StorageError,
    StoreBusyError,
    StoreClosedError,
    StoreExistsError,
    StoreFencedError,
    VersionNotAvailableError,
    WrongDeploymentError,
    WrongFingerprintError,
)
from sparkstep.storage.files import copy_checkpoint, fsync_path, fsync_tree, remove_path
from sparkstep.storage.layout import (
    CREATING,
    LOAD_DIR,
    LOCK_FILE,
    MARKER,
    META_STEP,
    META_VERSION,
    VERSION_FILE,
    VERSION_TMP,
    VERSIONS_DIR,
    WORK_DIR,
    encode_u64,
)
from sparkstep.storage.lock import DirectoryLock
from sparkstep.storage.marker import has_marker, is_legacy_store, write_marker
from sparkstep.storage.options import RocksDBOptions
from sparkstep.storage.translate import translated
from sparkstep.storage.version_file import VersionFile, read_version_file, write_version_file

__all__ = ["FAILPOINTS", "RocksDBStore", "StoreInfo"]

FAILPOINTS: Final = (
    "store.commit.after_checkpoint",
    "store.commit.after_close",
    "store.commit.after_flush",
    "store.commit.after_version_file",
    "store.commit.after_version_tmp",
    "store.commit.before_flush",
    "store.create.after_checkpoint",
    "store.create.after_marker",
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


@dataclass(frozen=True)
class StoreInfo:
    """What ``VERSION`` says about a store, read without taking its lock (see ``inspect``)."""

    path: Path
    versions: range
    deployment: str | None
    fingerprint: str | None


class RocksDBStore(Store):
    """A worker's two-version store in the directory ``path`` (see the module docstring).

    ``RocksDBStore(path)`` refuses a non-empty directory that is not a store
    (:class:`NotAStoreError`, without writing anything into it; :mod:`.marker`), takes the
    directory lock (waiting up to ``lock_timeout`` seconds for a previous owner, 0 = fail at once
    with :class:`StoreLockedError`), creates a new store holding only version 0 if ``path`` holds
    none (a missing or empty directory; the marker is written first), and checks the
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
        with translated(f"opening store {self._path}"):
            # Step 1. Claim the directory: refuse one sparkstep did not make, mark a new one.
            self._path.mkdir(parents=True, exist_ok=True)
            self._claim()
            # Step 2. Take the lock.
            self._lock = DirectoryLock(self._path, lock_timeout)
        try:
            with translated(f"opening store {self._path}"):
                # Step 3. Load the store, finish a creation cut short, or create it.
                self._state = self._load_or_create(_new_version, _replace)
                # Step 4. Check (or record) the identity.
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

        Raises :class:`StoreExistsError` if ``path`` already holds a store, unless ``replace`` is
        true, in which case that store is deleted first (under the lock). Raises
        :class:`NotAStoreError` if ``path`` holds files but no store, ``replace`` or not: only
        what sparkstep created is ever deleted. A creation cut short by a crash is redone.
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
        where = Path(path) / VERSION_FILE
        with translated(f"inspecting store {path}"):
            if not where.exists():
                raise CorruptStoreError(f"{path} holds no store (no {VERSION_FILE} file)")
            state = read_version_file(Path(path))
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

    def record_identity(self, deployment: str | None, fingerprint: str | None) -> None:
        self._check_not_closed()
        with translated(f"recording the identity of store {self._path}"):
            self._check_identity(deployment, fingerprint)

    @property
    def fence(self) -> int:
        return self._state.fence

    def admit(self, token: int | None) -> None:
        self._check_not_closed()
        fence = self._state.fence
        if token is None:
            if fence > 0:
                raise StoreFencedError(
                    f"store {self._path} is fenced at token {fence}: a call without a fencing "
                    "token is refused (only a store no owner ever fenced takes one)"
                )
            return
        if type(token) is not int or token < 1:
            raise ValueError(f"a fencing token is an int >= 1, not {token!r}")
        if token < fence:
            raise StoreFencedError(
                f"store {self._path} is fenced at token {fence}: a caller with token {token} "
                "was replaced by a newer owner and may not change the store"
            )
        if token > fence:
            with translated(f"recording fencing token {token} in store {self._path}"):
                state = replace(self._state, fence=token)
                write_version_file(self._path, state, "store.admit")
                self._state = state

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
        with translated(f"opening version {version} of store {self._path}"):
            # Step 1. Publish VERSION without the version above: it is gone from here on.
            kept = range(available.start, version + 1)
            if available != kept:
                self._publish(kept, "store.open")
            failpoint("store.open.after_discard")
            # Step 2. Collect orphans: unlisted version dirs, the old working copy, temp files.
            self._collect_orphans(keep=kept)
            failpoint("store.open.after_cleanup")
            # Step 3. Build the working copy from the checkpoint of `version`.
            work = self._path / WORK_DIR
            copy_checkpoint(self._version_dir(version), work)
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
        return self._path / VERSIONS_DIR / str(version)

    def _committed(self, base: Version, checkpoint: Path) -> None:
        """Steps 3 (fsync) and 4 of commit: make ``checkpoint`` durable and publish it."""
        fsync_tree(checkpoint)
        fsync_path(checkpoint.parent)
        failpoint("store.commit.after_checkpoint")
        self._publish(range(base, base + 2), "store.commit")
        failpoint("store.commit.after_version_file")

    def _reload_versions(self) -> None:
        """Re-read VERSION after a failed commit (it may or may not have been published)."""
        with contextlib.suppress(OSError, StorageError):
            self._state = read_version_file(self._path)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self._path} is closed: make a new RocksDBStore")

    # ---- creation, loading, identity ---------------------------------------------------------

    def _claim(self) -> None:
        """Step 1 of the constructor: a directory holding files sparkstep did not write is
        refused untouched; an empty one gets the marker before anything else."""
        if has_marker(self._path) or is_legacy_store(self._path):
            return  # a legacy store is marked under the lock, once it has been read
        foreign = sorted(p.name for p in self._path.iterdir() if p.name != LOCK_FILE)
        if foreign:
            raise NotAStoreError(
                f"{self._path} is not empty ({', '.join(foreign[:5])}) and is not a sparkstep "
                f"store (no {MARKER} file): sparkstep never writes into or deletes a directory "
                "it did not create; use a new or empty directory, or move those files away"
            )
        write_marker(self._path)
        failpoint("store.create.after_marker")

    def _load_or_create(self, new_version: int | None, replace: bool) -> VersionFile:
        version_file = self._path / VERSION_FILE
        creating = self._path / CREATING
        if version_file.exists() and not creating.exists():
            if new_version is not None:
                if not replace:
                    raise StoreExistsError(
                        f"{self._path} already holds a store (versions "
                        f"{list(read_version_file(self._path).versions)}): pass replace=True to "
                        "delete it, or choose another path"
                    )
                return self._create(new_version)  # CREATING first: a crash redoes it
            state = read_version_file(self._path)
            self._check_version_dirs(state)
            if not has_marker(self._path):
                write_marker(self._path)  # a store made before the marker existed
            return state
        if creating.exists():
            # A creation was cut short: redo it at the version it was making.
            target = new_version
            if target is None:
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    target = int(json.loads(creating.read_bytes())["version"])
            return self._create(0 if target is None else target)
        # The directory is marked as a store (step 1) but has neither VERSION nor CREATING.
        others = [p.name for p in self._path.iterdir() if p.name not in (LOCK_FILE, MARKER)]
        if not others:
            return self._create(0 if new_version is None else new_version)
        if new_version is not None and replace:
            return self._create(new_version)
        if new_version is not None:
            raise StoreExistsError(
                f"{self._path} holds a damaged store (no {VERSION_FILE} file; "
                f"{', '.join(sorted(others)[:5])}): pass replace=True to delete it, or choose "
                "another path"
            )
        raise CorruptStoreError(
            f"store {self._path} has no {VERSION_FILE} file but holds {sorted(others)[:5]}: "
            "the version file was deleted; restore the store from a backup or delete the "
            "directory to start empty"
        )

    def _check_version_dirs(self, state: VersionFile) -> None:
        for version in state.versions:
            if not (self._version_dir(version) / "CURRENT").is_file():
                raise CorruptStoreError(
                    f"store {self._path} lists version {version} but its checkpoint "
                    f"{self._version_dir(version)} is missing or incomplete: the directory was "
                    "damaged outside sparkstep; restore it from a backup"
                )

    def _create(self, version: int) -> VersionFile:
        """Make a store whose only version is ``version``, empty; crash safe via CREATING."""
        creating = self._path / CREATING
        # Step 1. Mark the directory as a store (if a creation of a store made before the marker
        # existed is being finished) and as being created, durably.
        if not has_marker(self._path):
            write_marker(self._path)
        creating.write_bytes(json.dumps({"version": version}).encode())
        fsync_path(creating)
        fsync_path(self._path)
        # Step 2. Remove anything an earlier attempt left behind.
        for entry in self._path.iterdir():
            if entry.name not in (LOCK_FILE, CREATING, MARKER):
                remove_path(entry)
        # Step 3. An empty database whose metadata says `version`, checkpointed as that version.
        (self._path / VERSIONS_DIR).mkdir()
        work = self._path / WORK_DIR
        options = self._options.to_options()
        rdb = rocksdict.Rdict(str(work), options)
        try:
            write_options = rocksdict.WriteOptions()
            rdb.put(META_VERSION, encode_u64(version), write_options)
            rdb.put(META_STEP, encode_u64(0), write_options)
            rdb.flush(True)
            rocksdict.Checkpoint(rdb).create_checkpoint(str(self._version_dir(version)))
        finally:
            rdb.close()
        fsync_tree(self._version_dir(version))
        fsync_path(self._path / VERSIONS_DIR)
        failpoint("store.create.after_checkpoint")
        # Step 4. Publish it; from here on the store exists.
        state = VersionFile(range(version, version + 1), None, None)
        write_version_file(self._path, state, "store.create")
        failpoint("store.create.after_version_file")
        # Step 5. Done: drop the marker and the scratch working copy.
        creating.unlink()
        remove_path(work)
        fsync_path(self._path)
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
            state = replace(recorded, deployment=new_deployment, fingerprint=new_fingerprint)
            write_version_file(self._path, state, "store.identity")
            self._state = state

    # ---- version file and orphans ------------------------------------------------------------

    def _publish(self, versions: range, point: str) -> None:
        state = replace(self._state, versions=versions)
        write_version_file(self._path, state, point)
        self._state = state

    def _collect_orphans(self, keep: range) -> None:
        versions_dir = self._path / VERSIONS_DIR
        names = {str(version) for version in keep}
        for entry in versions_dir.iterdir():
            if entry.name not in names:
                remove_path(entry)
        for name in (WORK_DIR, LOAD_DIR, VERSION_TMP, CREATING):
            remove_path(self._path / name)
        fsync_path(versions_dir)
        fsync_path(self._path)
