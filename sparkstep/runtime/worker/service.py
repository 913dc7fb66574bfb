"""The state worker's logic, independent of the wire: one store, one incarnation, the apply rules.

:class:`StateWorker` owns one :class:`~sparkstep.storage.base.Store` for the life of the process
and at most one open :class:`~sparkstep.storage.base.Database` (seed 004's worker database)::

         StateWorker(store)          [store lock held]
                |
                v
     +-----> CLOSED ---- open(v) ----> OPEN(v, incarnation)  -- apply(...)* --+
     |                                   |        ^                          |
     +------------- commit(step) --------+        +--------------------------+
     +------------- close_db() ----------+
                          (export / import / drop / set_layout while OPEN)

Layout. Each version of the store holds the worker's layout (``{"worker": w, "layout":
{"epoch", "workers", "owners"}}``, JSON, :meth:`StateWorker.set_layout`): the runtime writes it
at recovery into a store that has none (a new one) and a rescale writes the new one into every
new-layout store before committing. It is read back at every ``open(v)``, so it always describes
the data of the open version.

Apply rules (ARCHITECTURE.md "State workers"), for ``apply(incarnation, step, operator, input,
division_digest, rows, layout_epoch)``:

1. ``incarnation`` must be the current one (else :class:`FencedError`; no store open:
   :class:`WorkerClosedError`). ``layout_epoch`` must be the store's layout epoch (else
   :class:`WrongLayoutError`) and every row's ``__shard`` a shard the layout gives this worker
   (else :class:`ShardNotOwnedError`). The runtime always sends the epoch; a store that was never
   given a layout (used standalone, e.g. by the worker's own tests) accepts only applies without
   one, and without a layout there are no shard checks.
2. The marker of ``(operator, input)`` holds the last step the open session applied: the same
   step with the same division digest returns the recorded delta and state digest (a re-run
   task), with another digest raises :class:`DivisionMismatchError`; an older step, or a step
   below the store's ``get_step()``, raises :class:`StaleStepError`.
3. Otherwise the kernel runs; its state changes and the shard digests they move are ONE write
   into the open database's write buffer (:mod:`.buffer`), and the new marker ``(operator,
   input) -> (step, division digest, delta, state digest)`` is set under the same hold of the
   database lock, after the changes are buffered and before the buffer may flush: a failed
   flush keeps both, so a re-run never applies twice. The buffer reaches RocksDB (one
   ``write_sorted`` per table) when it is flushed: before any other call reads or moves the
   database's contents (commit, export, import, drop, ...), before a kernel's range scan, and
   when it passes ``buffer_bytes``. Only the latest step's delta per operator input is kept
   (the marker is replaced).

**Markers live in the worker's memory, for its open session** (dropped at every open, commit
and close), not in the store: the design brief writes the marker into the same ``db.write`` as
the state, but a marker is only ever read by its own session. Every version ``v`` a later
``open(v)`` starts from has ``get_step()`` above every step its markers could name, so those
steps are stale (rule 2) whatever a stored marker said, and a crash discards the working copy
with the markers. Kept in the store, a marker cost a copy of each step's delta as an Arrow IPC
stream in the buffer, read back (whole) at every apply and written to RocksDB at every flush:
a join's delta is tens of MB a step, which passed the buffer's bound between two checkpoints
and made it flush and drop its read cache. What the brief's one write is for still holds: the
state changes and the marker appear together (one lock hold) and vanish together.

Calls for one operator are serialised by a lock per operator, so two concurrent attempts of the
same task apply once and both get the same answer. Database calls are serialised by one lock
(the store is single-threaded). Control calls (open, commit, export, import, drop) take every
operator lock. The exception is a hot rescale's live export (``export_shards(live=True)``,
``export_changes``): it holds only the control lock, so applies go on while it reads (RocksDB
iterators read a consistent view; :mod:`.changes` says why the copy is still exact), and no
control call can close the database under it.

Tables: operator ``name`` keeps its state in table ``state.<name>`` (layouts in the kernels'
modules; the bare shard prefix is the shard digest, :mod:`.digest`). Table ``markers`` holds
the store's state format record (:data:`STATE_FORMAT_KEY`) under the all-ones shard prefix
``b"\\xff" * 4``, shard 2**32-1, which no pipeline has (``S`` is far smaller), so it is never
exported or dropped with shards. Stores written before markers moved to memory also hold a
marker per operator input there (``b"\\xff" * 4 + b"<name>/<input>"``: a JSON header line, then
the delta as an Arrow IPC stream); nothing reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.failpoints import failpoint
from sparkstep.ids import WorkerId
from sparkstep.runtime.errors import (
    DivisionMismatchError,
    FencedError,
    PathRefusedError,
    ShardNotOwnedError,
    StaleStepError,
    StateFormatError,
    UnknownOperatorError,
    WorkerClosedError,
    WorkerError,
    WrongLayoutError,
    WrongOperatorsError,
)
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.operators import (
    ApplyContext,
    Kernel,
    OperatorSpec,
    StateChanges,
    fingerprint,
    make_kernel,
)
from sparkstep.runtime.operators.base import ABSENT, SHARD
from sparkstep.runtime.worker.buffer import (
    DEFAULT_LIMIT_BYTES,
    HashedEntries,
    ReadCache,
    Write,
    WriteBuffer,
)
from sparkstep.runtime.worker.changes import ChangeTracker
from sparkstep.runtime.worker.digest import (
    DIGEST_FORMAT,
    MASK,
    digest_value,
    entry_hash_deltas,
    format_digest,
    hash_bytes,
    read_digest_value,
    shard_sums,
)
from sparkstep.storage.base import Database, ExportedShards, Store
from sparkstep.storage.keys import SHARD_PREFIX_BYTES, shard_prefix

_LARGE = pa.large_binary()

__all__ = [
    "ApplyResult",
    "EXPORTS_DIR",
    "IMPORTS_DIR",
    "MARKER_TABLE",
    "STATE_FORMAT",
    "STATE_FORMAT_KEY",
    "StateWorker",
    "WorkerLayout",
    "file_sha256",
    "path_component",
    "state_table",
]

MARKER_TABLE = "markers"
EXPORTS_DIR = "exports"
"""The directory in a worker's store directory where it exports shards (emptied at open)."""
IMPORTS_DIR = "imports"
"""The directory in a worker's store directory where it receives fetched exports (emptied at
open and after each import)."""
_EXPORT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_MARKER_PREFIX = b"\xff" * SHARD_PREFIX_BYTES
STATE_FORMAT = 6
"""The format of a worker's state: the digest's ``entry_hash`` (:data:`DIGEST_FORMAT`) and the
kernels' state layouts. Format 1 (BLAKE2b digests, no format record), format 2 (min/max of
integer columns as a per-key multiset in marshal, distinct's multiplicities as ASCII decimal,
a join key's rows one list per row), format 3 (a join key's rows as marshal lists, one per
column, not rows of int64 words), format 4 (a join key's rows one run, never an index of older
runs) and format 5 (a columnar aggregate's min/max multiset one entry per key and column,
rewritten whole at every touch, not chunks beside a record that holds the extremes; see
``operators/``) are refused at open: format 6 cannot tell a format 5 store's multisets from
its own chunks without reading every key, and reading them as chunks would be wrong."""
#: Where a store records its state format (in :data:`MARKER_TABLE`).
STATE_FORMAT_KEY = _MARKER_PREFIX + b"\x00state-format"
_FORMAT_VALUE = json.dumps({"state_format": STATE_FORMAT, "digest_format": DIGEST_FORMAT}).encode()


def path_component(value: str, what: str) -> str:
    """``value`` if it is one plain path component, else :class:`PathRefusedError`."""
    if not _EXPORT_NAME.fullmatch(value) or value in (".", ".."):
        raise PathRefusedError(
            f"{what} {value!r} must be one path component of letters, digits, '_', '-' and '.': "
            "a worker reads and writes only inside its own store directory"
        )
    return value


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _exported_file(path: Path) -> dict[str, Any]:
    return {"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def state_table(operator: str) -> str:
    """The table holding ``operator``'s state."""
    return f"state.{operator}"


@dataclass(frozen=True)
class WorkerLayout:
    """The layout a store holds and which of its workers the store is."""

    layout: Layout
    worker: int

    def __post_init__(self) -> None:
        if not 0 <= self.worker < self.layout.workers:
            raise WorkerError(
                f"worker {self.worker} is outside the {self.layout.workers} workers of layout "
                f"epoch {self.layout.epoch}"
            )

    @property
    def owned(self) -> list[int]:
        """The shards this worker owns, ascending."""
        return [int(s) for s in self.layout.shards_of(WorkerId(self.worker))]

    def to_bytes(self) -> bytes:
        doc = {"worker": self.worker, "layout": json.loads(self.layout.to_json())}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> WorkerLayout:
        doc = json.loads(raw)
        return cls(Layout.from_json(json.dumps(doc["layout"])), int(doc["worker"]))


@dataclass(frozen=True)
class _Marker:
    """The last apply of one (operator, input) in the open session (module doc, rule 2)."""

    step: int
    division_digest: str
    delta: pa.Table
    state_digest: str


@dataclass(frozen=True)
class ApplyResult:
    """What ``apply`` answers: the delta, the state digest, and whether it was a recorded one."""

    delta: pa.Table
    state_digest: str
    replayed: bool


class _Reader:
    """The :class:`StateReader` a kernel gets: reads one table through the write buffer and
    remembers what it read, as Arrow arrays with the keys' hashes, so :meth:`olds` finds the
    value each changed key had before the apply without a Python object per key. A scan
    flushes the buffer first: it reads the database's order.

    Every read of one apply sees the same values (nothing is written until the kernel
    returns), so a key read twice has one old value."""

    def __init__(self, worker: StateWorker, buffer: WriteBuffer, table: str) -> None:
        self.worker = worker
        self.buffer = buffer
        self.table = table
        self._reads: list[tuple[pa.Array, pa.Array, np.ndarray]] = []

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.get_array(pa.array(list(keys), _LARGE)).to_pylist()  # type: ignore[no-any-return]

    def get_array(self, keys: pa.Array) -> pa.Array:
        keys = keys.cast(_LARGE)
        hashes = hash_bytes(keys)
        with self.worker.db_lock:
            found = self.buffer.get_array(self.table, keys, hashes)
        self._reads.append((keys, found, hashes))
        return found

    def scan(self, start: bytes, end: bytes) -> list[tuple[bytes, bytes]]:
        with self.worker.db_lock:
            self.buffer.flush()
            entries = list(self.buffer.db.items(self.table, start=start, end=end))
        keys = pa.array([k for k, _ in entries], _LARGE)
        self._reads.append((keys, pa.array([v for _, v in entries], _LARGE), hash_bytes(keys)))
        return entries

    def _all_reads(self) -> tuple[pa.Array, pa.Array, np.ndarray]:
        """Every read of this apply in call order, as one (keys, values, hashes)."""
        if len(self._reads) == 1:
            return self._reads[0]
        return (
            pa.concat_arrays([k for k, _, _ in self._reads] or [pa.array([], _LARGE)]),
            pa.concat_arrays([v for _, v, _ in self._reads] or [pa.array([], _LARGE)]),
            np.concatenate([h for _, _, h in self._reads] or [np.zeros(0, np.uint64)]),
        )

    def olds_and_hashes(self, changes: StateChanges) -> tuple[pa.Array, np.ndarray]:
        """Each changed key's value before this apply (null where absent) and its
        ``hash_bytes``: taken from the reads by the kernel's ``read_at`` when it gives them and
        the keys there are the changed keys, else by hashing and :meth:`olds`; the keys whose
        ``read_at`` is -1 (not read) by one more read, those at ``ABSENT`` taken as absent."""
        at = changes.read_at
        if at is not None and self._reads:
            keys, values, hashes = self._all_reads()
            read = np.flatnonzero(at >= 0)
            inside = not len(read) or at[read].max() < len(keys)
            if inside and keys.take(at[read]).equals(changes.keys.take(read)):
                if len(read) == len(at):
                    return values.take(at), hashes[at]
                unread = np.flatnonzero(at == -1)
                absent = np.flatnonzero(at == ABSENT)
                where = np.concatenate([read, unread, absent])
                olds = [values.take(at[read])]
                both = [hashes[at[read]]]
                if len(unread):
                    # Read now: nothing is written before the kernel returns, so this is the
                    # value the key had before the apply; the read recorded the keys' hashes.
                    olds.append(self.get_array(changes.keys.take(unread)))
                    both.append(self._reads[-1][2])
                if len(absent):
                    olds.append(pa.nulls(len(absent), _LARGE))
                    both.append(hash_bytes(changes.keys.take(absent)))
                inverse = np.empty(len(at), dtype=np.int64)
                inverse[where] = np.arange(len(at), dtype=np.int64)
                return pa.concat_arrays(olds).take(inverse), np.concatenate(both)[inverse]
        hashes = hash_bytes(changes.keys)
        return self.olds(changes.keys, hashes), hashes

    def olds(self, keys: pa.Array, hashes: np.ndarray) -> pa.Array:
        """The value each of ``keys`` (large_binary, ``hashes`` theirs) had before this apply,
        null where absent: from the reads, after one more read of the keys the kernel did not
        read."""
        read = HashedEntries.of(*self._all_reads())
        values, present = read.lookup(hashes, keys)
        if present.all():
            return values
        unread = np.flatnonzero(~present)
        self.get_array(keys.take(unread))
        return self.olds(keys, hashes)


class StateWorker:
    """One state worker: a store, the operators it runs, and the open database (see module doc).

    ``shards`` is ``S``. Operators come from :meth:`configure` (the runtime calls it after each
    start of the process; specs are not stored, the store keeps only the fingerprint and the
    deployment). Applies write into a :class:`~.buffer.WriteBuffer` of at most
    ``buffer_bytes`` over the open database (0: straight through), flushed before any other
    call touches the database (:meth:`_flushed_db`). What a commit flushed stays the next
    buffer's read cache when the next ``open`` opens the version that commit made.
    """

    def __init__(
        self, store: Store, shards: int = 256, buffer_bytes: int = DEFAULT_LIMIT_BYTES
    ) -> None:
        self.store = store
        self.shards = shards
        self._buffer_bytes = buffer_bytes
        self.db_lock = threading.RLock()
        self._control = threading.Lock()
        self._fence = threading.Lock()
        self._specs: dict[str, OperatorSpec] = {}
        self._kernels: dict[str, Kernel] = {}
        self._op_locks: dict[str, threading.Lock] = {}
        self._buffer: WriteBuffer | None = None
        # The read cache of the last commit's buffer and the version it made (buffer.py).
        self._kept: tuple[int, ReadCache] | None = None
        self._incarnation: str | None = None
        self._digests: dict[str, int] = {}
        # The open session's last apply of each (operator, input): what a re-run gets back.
        self._markers: dict[tuple[str, int], _Marker] = {}
        self._layout: WorkerLayout | None = None
        self._owned: pa.Array | None = None
        self._tracker: ChangeTracker | None = None

    # -- control ------------------------------------------------------------------------------

    def configure(
        self, specs: Sequence[OperatorSpec], shards: int, deployment: str | None = None
    ) -> str:
        """Set the operators and ``S`` (replacing any earlier ones); returns their fingerprint.

        Their fingerprint (and ``deployment``, when given) must equal what the store records
        (:class:`WrongOperatorsError`, storage's ``WrongDeploymentError``). With a
        ``deployment`` (the runtime always sends its manifest's) the store records both if it
        has none yet, so it is never read by other operators or another deployment; without
        one (standalone use, tests) nothing is recorded.
        """
        fp = fingerprint(specs, shards)
        if self.store.fingerprint is not None and self.store.fingerprint != fp:
            raise WrongOperatorsError(
                f"the store {self.store.path} belongs to operators with fingerprint "
                f"{self.store.fingerprint}, these have {fp}: the pipeline's stateful operators, "
                "their key types or S changed; run the pipeline the state was made by, or start "
                "a new deployment with a new --state-dir and --name (or `sparkstep reset`)"
            )
        with self._all_locks(), self.db_lock:
            if deployment is not None:
                self.store.record_identity(deployment, fp)
            self.shards = shards
            self._specs = {s.name: s for s in specs}
            self._kernels = {s.name: make_kernel(s, SHARD_PREFIX_BYTES, shards) for s in specs}
            for name in self._specs:
                self._op_locks.setdefault(name, threading.Lock())
            self._digests.clear()
        return fp

    @contextmanager
    def fenced(self, generation: int | None) -> Iterator[None]:
        """Admit a store-changing call of the runtime of ``generation`` (``Store.admit``: a
        newer one is recorded in the store first; an older one raises ``StoreFencedError``),
        and hold the admission for the call: fenced calls run one at a time, so a call that
        was admitted cannot run after a newer generation's."""
        with self._fence:
            with self.db_lock:
                self.store.admit(generation)
            yield

    def versions(self) -> range:
        """The store's versions (seed 004)."""
        with self.db_lock:
            return self.store.versions()

    def open(self, version: int) -> str:
        """Open the store at ``version`` (closing any open database); returns a new incarnation."""
        with self._all_locks(), self.db_lock:
            kept, self._kept = self._kept, None
            self._end_session()
            # A rescale's exports were imported before any store reopens; a cut-short one's
            # exports and fetched files are never used again.
            shutil.rmtree(self.store.path / EXPORTS_DIR, ignore_errors=True)
            shutil.rmtree(self.store.path / IMPORTS_DIR, ignore_errors=True)
            db = self.store.open(version)
            try:
                self._check_format(db)
            except StateFormatError:
                db.close()
                raise
            raw = db.get_layout()
            self._use_layout(None if raw is None else WorkerLayout.from_bytes(raw))
            cache = kept[1] if kept is not None and kept[0] == version else None
            self._buffer = WriteBuffer(db, self._buffer_bytes, cache)
            self._incarnation = uuid.uuid4().hex
            return self._incarnation

    def _check_format(self, db: Database) -> None:
        """Refuse a store whose state is in another format than ours (:data:`STATE_FORMAT`);
        record ours in a new store.

        A store without a format record is new only if it holds nothing (no step, layout,
        marker or state); anything else was written by a sparkstep of format 1.
        """
        raw = db.get(MARKER_TABLE, STATE_FORMAT_KEY)
        if raw is None:
            used = db.get_step() > 0 or db.get_layout() is not None
            for table in db.tables() if not used else ():
                used = next(iter(db.items(table)), None) is not None
                if used:
                    break
            if not used:
                db.put(MARKER_TABLE, STATE_FORMAT_KEY, _FORMAT_VALUE)
                return
            found = "1"
        else:
            try:
                found = str(json.loads(raw)["state_format"])
            except (ValueError, KeyError, TypeError):
                found = repr(raw[:40])
            if found == str(STATE_FORMAT):
                return
        raise StateFormatError(
            f"the store {self.store.path} holds worker state format {found}, this sparkstep "
            f"reads format {STATE_FORMAT} only: run the sparkstep version "
            "that wrote it, or start a new deployment with a new --state-dir (or `sparkstep "
            "reset`)"
        )

    def set_layout(self, layout: Layout, worker: int) -> None:
        """Write ``layout`` (this store being worker ``worker``) into the open working state.

        It becomes part of version ``v + 1`` at the next commit, together with the data; until
        then applies are checked against it.
        """
        chosen = WorkerLayout(layout, worker)
        if layout.shards != self.shards:
            raise WorkerError(
                f"layout epoch {layout.epoch} has {layout.shards} shards, this worker "
                f"S={self.shards}"
            )
        with self._all_locks(), self.db_lock:
            self._flushed_db().set_layout(chosen.to_bytes())
            self._use_layout(chosen)

    def layout(self) -> WorkerLayout | None:
        """The layout of the open state (None if it has none or no store is open)."""
        return self._layout

    def _use_layout(self, chosen: WorkerLayout | None) -> None:
        self._layout = chosen
        self._owned = None if chosen is None else pa.array(chosen.owned, type=pa.int64())

    def commit(self, step: int) -> None:
        """``set_step(step)`` and commit; the worker is closed until the next :meth:`open`."""
        with self._all_locks(), self.db_lock:
            db = self._flushed_db()
            cache = self._require_buffer().cache()
            db.set_step(step)
            failpoint("worker.commit.before_commit")
            db.commit()
            failpoint("worker.commit.after_commit")
            self._end_session()
            self._kept = (int(db.base_version) + 1, cache)

    def close_db(self) -> None:
        """Close the open database without commit (the store keeps what ``open`` left); the
        process and its store lock stay. A rescale does this to the workers it retires: any
        later apply is refused (:class:`WorkerClosedError`)."""
        with self._all_locks(), self.db_lock:
            self._end_session()

    def close(self) -> None:
        """Close the open database without commit (keeps what ``open`` left), then the store."""
        with self._all_locks(), self.db_lock:
            self._end_session()
            self.store.close()

    def track(self, shards: Sequence[int]) -> None:
        """Record, from now until the database is reopened, committed or closed, every key of
        ``shards`` the applies write (:mod:`.changes`; an empty ``shards`` stops tracking).
        A hot rescale's sources call it before copying the moving shards while running."""
        with self._all_locks(), self.db_lock:
            self._flushed_db()
            self._tracker = ChangeTracker(shards) if shards else None

    def export_shards(
        self, shards: Sequence[int], name: str, *, live: bool = False
    ) -> dict[str, Any]:
        """Export ``shards`` (every table) into SST files under ``<store>/exports/<name>/``.

        ``name`` must be one plain path component (:class:`PathRefusedError` otherwise): the
        worker writes only inside its own store directory. JSON-able answer ``{"shards",
        "files": {table: [{"file", "sha256", "bytes"}]}, "keys", "bytes"}``: ``file`` is the
        file's name in the export (what a receiver fetches, :meth:`export_file`), ``sha256`` its
        hex digest computed here (what the receiver verifies).

        ``live``: export while applies go on (a hot rescale's pre-copy). Only control calls
        wait for it (no reopen or commit can close the database under the read); the shards
        must be tracked (:meth:`track`, else :class:`WorkerError`), since the keys an apply
        writes during the export may be read before or after the write: the tracker has them.
        """
        directory = self.store.path / EXPORTS_DIR / path_component(name, "export name")
        if not live:
            with self._all_locks(), self.db_lock:
                exported = self._flushed_db().export_shards(shards, directory)
            return self._export_answer(exported)
        with self._control:
            with self.db_lock:
                db = self._flushed_db()
                self._tracking(shards)
            return self._export_answer(db.export_shards(shards, directory))

    def export_changes(self, shards: Sequence[int], name: str) -> dict[str, Any]:
        """Export the keys of ``shards`` the applies wrote since :meth:`track` or this call's
        last time for them, with their values now (absent: a deletion), into
        ``<store>/exports/<name>/``; the answer as :meth:`export_shards` (``keys`` counts the
        changed keys). Ingested after the earlier exports of those shards, in order, the files
        bring a copy to the state now; what the applies write meanwhile is recorded again.
        """
        directory = self.store.path / EXPORTS_DIR / path_component(name, "export name")
        with self._control:
            with self.db_lock:
                db = self._flushed_db()
                changed = self._tracking(shards).take(shards)
            answer = self._export_answer(db.export_keys(changed, directory))
        answer["shards"] = sorted(int(s) for s in shards)
        return answer

    def _tracking(self, shards: Sequence[int]) -> ChangeTracker:
        tracker = self._tracker
        if tracker is None or not set(int(s) for s in shards) <= tracker.shards:
            raise WorkerError(
                f"shards {sorted(shards)[:10]} are not tracked since the store was opened: a "
                "live export needs track() first (a hot rescale's step)"
            )
        return tracker

    @staticmethod
    def _export_answer(exported: ExportedShards) -> dict[str, Any]:
        files = {
            table: [
                {
                    "file": Path(f).name,
                    "sha256": file_sha256(Path(f)),
                    "bytes": Path(f).stat().st_size,
                }
                for f in paths
            ]
            for table, paths in exported.files.items()
        }
        return {
            "shards": list(exported.shards),
            "files": files,
            "keys": exported.keys,
            "bytes": exported.bytes,
        }

    def export_file(self, name: str, file: str) -> Path:
        """The exported file ``<store>/exports/<name>/<file>``, to send to a receiver.

        Both must be plain path components naming a regular file (not a link) that an export
        made; anything else raises :class:`PathRefusedError`.
        """
        path = (
            self.store.path
            / EXPORTS_DIR
            / path_component(name, "export name")
            / path_component(file, "export file")
        )
        if path.is_symlink() or not path.is_file():
            raise PathRefusedError(
                f"{file!r} is not a file of export {name!r} of this worker: a worker sends only "
                "files it exported since its store was last opened"
            )
        return path

    def import_dir(self, name: str) -> Path:
        """An empty ``<store>/imports/<name>/`` to fetch a sender's export ``name`` into."""
        directory = self.store.path / IMPORTS_DIR / path_component(name, "export name")
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        return directory

    def import_files(self, name: str, files: Mapping[str, Sequence[str]]) -> None:
        """Ingest the files fetched into :meth:`import_dir` ``(name)`` (``{table: [file]}``),
        then delete that directory."""
        directory = self.store.path / IMPORTS_DIR / path_component(name, "export name")
        paths = {
            table: [str(directory / path_component(f, "export file")) for f in names]
            for table, names in files.items()
        }
        with self._all_locks(), self.db_lock:
            self._flushed_db(changing=True).import_files(paths, move=True)
            self._digests.clear()
        shutil.rmtree(directory, ignore_errors=True)

    def drop_shards(self, shards: Sequence[int]) -> None:
        """Delete every key of ``shards``."""
        with self._all_locks(), self.db_lock:
            self._flushed_db(changing=True).drop_shards(shards)
            self._digests.clear()

    def status(self) -> dict[str, Any]:
        """A JSON-able summary: pid, store, versions, open version, incarnation, step, operators,
        and the open state's layout (``layout_epoch``, ``layout_worker``, ``owned_shards``:
        None without one)."""
        with self.db_lock:
            buffer = self._buffer
            db = None if buffer is None else buffer.db
            chosen = self._layout
            return {
                "layout_epoch": None if chosen is None else int(chosen.layout.epoch),
                "layout_worker": None if chosen is None else chosen.worker,
                "owned_shards": None if chosen is None else len(chosen.owned),
                "pid": os.getpid(),
                "store": str(self.store.path),
                "versions": [self.store.versions().start, self.store.versions().stop],
                "open_version": None if db is None else int(db.base_version),
                "incarnation": self._incarnation,
                "step": None if db is None else int(db.get_step()),
                "operators": sorted(self._specs),
                "shards": self.shards,
                "fingerprint": self.store.fingerprint,
                "deployment": self.store.deployment,
                "state_digest": None if buffer is None else self._state_digest(buffer),
                "tracked_keys": None if self._tracker is None else self._tracker.count(),
            }

    def inspect(self) -> dict[str, Any]:
        """Per state table, the number of keys in each shard of the open state (scans it all;
        tests and benchmarks). Shard digests (the bare shard prefix) are not counted; markers
        (which belong to the worker, not a shard) are left out.
        ``{"layout_epoch", "owned": [shards], "tables": {table: {shard: keys}}}``."""
        with self.db_lock:
            db = self._flushed_db()
            tables: dict[str, dict[str, int]] = {}
            for table in db.tables():
                if table == MARKER_TABLE:
                    continue
                counts: dict[str, int] = {}
                for key, _ in db.items(table):
                    if len(key) > SHARD_PREFIX_BYTES:
                        shard = str(int.from_bytes(key[:SHARD_PREFIX_BYTES], "big"))
                        counts[shard] = counts.get(shard, 0) + 1
                tables[table] = counts
            chosen = self._layout
            return {
                "layout_epoch": None if chosen is None else int(chosen.layout.epoch),
                "owned": None if chosen is None else chosen.owned,
                "tables": tables,
            }

    def dump(self, operator: str) -> dict[bytes, bytes]:
        """Every entry of ``operator``'s state table (tests and debugging; scans the table)."""
        with self.db_lock:
            return dict(self._flushed_db().items(state_table(operator)))

    # -- apply --------------------------------------------------------------------------------

    def apply(
        self,
        incarnation: str,
        step: int,
        operator: str,
        division_digest: str,
        rows: pa.Table,
        *,
        input_index: int = 0,
        step_time_ms: int = 0,
        layout_epoch: int | None = None,
    ) -> ApplyResult:
        """Apply ``rows`` for ``(operator, step)`` under the rules of the module docstring."""
        lock = self._op_locks.get(operator)
        kernel = self._kernels.get(operator)
        if lock is None or kernel is None:
            raise UnknownOperatorError(
                f"worker has no operator {operator!r} (configured: {sorted(self._specs)}): "
                "call configure with the pipeline's operator specs"
            )
        if not 0 <= input_index < kernel.inputs:
            raise WorkerError(f"operator {operator!r} has no input {input_index}")
        with lock:
            # Step 1. Fencing.
            with self.db_lock:
                buffer = self._require_buffer()
                if incarnation != self._incarnation:
                    raise FencedError(
                        f"apply from incarnation {incarnation}, but the worker is at "
                        f"{self._incarnation}: the store was reopened; this task belongs to a "
                        "dead runtime"
                    )
                self._check_layout(layout_epoch, rows)
                # Step 2. The marker: re-run, mismatch or stale.
                marker = self._markers.get((operator, input_index))
                committed_step = int(buffer.db.get_step())
            if marker is not None:
                if marker.step == step:
                    if marker.division_digest != division_digest:
                        raise DivisionMismatchError(
                            f"operator {operator!r} step {step} was applied with division "
                            f"{marker.division_digest}, now asked with {division_digest}: a "
                            "step's division never changes within an incarnation"
                        )
                    return ApplyResult(marker.delta, marker.state_digest, True)
                if marker.step > step:
                    raise StaleStepError(
                        f"operator {operator!r}: step {step} is older than the last applied "
                        f"step {marker.step}"
                    )
            if step < committed_step:
                raise StaleStepError(
                    f"operator {operator!r}: step {step} is below the store's next step "
                    f"{committed_step} (already committed)"
                )
            # Step 3. The kernel.
            table = state_table(operator)
            reader = _Reader(self, buffer, table)
            ctx = ApplyContext(step=step, step_time_ms=step_time_ms, input_index=input_index)
            result = kernel.apply(rows, reader, ctx)
            # Step 4. Shard digests moved by the changes (vectorised, digest.py).
            # A change that leaves an entry as it was moves its shard's digest by 0.
            changes = result.changes
            olds, hashes = reader.olds_and_hashes(changes)
            deltas = entry_hash_deltas(changes.keys, olds, changes.values, hashes)
            moved = shard_sums(changes.keys, deltas, SHARD_PREFIX_BYTES, self.shards)
            prefixes = sorted(moved)
            with self.db_lock:
                current = buffer.get_many(table, prefixes)
                total = self._total_digest(buffer, operator)
            digests: dict[bytes, bytes | None] = {}
            for prefix, raw in zip(prefixes, current, strict=True):
                digests[prefix] = digest_value(read_digest_value(raw) + moved[prefix])
                total += moved[prefix]
            total &= MASK
            state_digest = format_digest(total)
            # Step 5. ONE write into the buffer and the marker, under one hold of the lock;
            # then the flush a full buffer needs (a failed flush keeps both: buffer.py).
            failpoint("worker.apply.before_write")
            with self.db_lock:
                if self._buffer is not buffer or self._incarnation != incarnation:
                    raise FencedError(
                        f"the store was reopened while applying {operator!r} step {step}"
                    )
                buffer.write(
                    [
                        Write(table, changes.keys, changes.values, hashes),
                        Write(table, list(digests), list(digests.values())),
                    ],
                    flush=False,
                )
                self._markers[(operator, input_index)] = _Marker(
                    step, division_digest, result.delta, state_digest
                )
                if self._tracker is not None:  # after the write: see changes.py
                    self._tracker.record(table, changes.keys.to_pylist())
                    self._tracker.record(table, prefixes)
                self._digests[operator] = total
                buffer.flush_if_full()
            failpoint("worker.apply.after_write")
            return ApplyResult(result.delta, state_digest, False)

    # -- helpers ------------------------------------------------------------------------------

    def _check_layout(self, layout_epoch: int | None, rows: pa.Table) -> None:
        """Rule 1's layout part: the step's epoch is the store's, and every row is ours."""
        chosen, owned = self._layout, self._owned
        if chosen is None or owned is None:
            if layout_epoch is not None:
                raise WrongLayoutError(
                    f"apply for layout epoch {layout_epoch}, but the store {self.store.path} "
                    "holds no layout: the runtime writes it at recovery; recover first"
                )
            return
        epoch = int(chosen.layout.epoch)
        if layout_epoch != epoch:
            raise WrongLayoutError(
                f"apply for layout epoch {layout_epoch}, but the store {self.store.path} is "
                f"worker {chosen.worker} of layout epoch {epoch}: the task belongs to a step of "
                "another layout (a runtime from before or after a rescale)"
            )
        if rows.num_rows and SHARD in rows.column_names:
            shards = rows.column(SHARD).cast(pa.int64())
            inside = pc.is_in(shards, value_set=owned)
            if not pc.all(inside).as_py():
                stray = pc.unique(pc.filter(shards, pc.invert(inside))).to_pylist()
                raise ShardNotOwnedError(
                    f"worker {chosen.worker} of layout epoch {epoch} got rows of shards "
                    f"{sorted(stray)[:10]} it does not own: the rows were routed with another "
                    "layout"
                )

    def _state_digest(self, buffer: WriteBuffer) -> str:
        """The digest of the worker's whole state: the operators' digests summed mod 2**64."""
        return format_digest(sum(self._total_digest(buffer, op) for op in self._specs) & MASK)

    def _total_digest(self, buffer: WriteBuffer, operator: str) -> int:
        cached = self._digests.get(operator)
        if cached is not None:
            return cached
        prefixes = [shard_prefix(s) for s in range(self.shards)]
        raws = buffer.get_many(state_table(operator), prefixes)
        total = sum(read_digest_value(v) for v in raws) & MASK
        self._digests[operator] = total
        return total

    def _end_session(self) -> None:
        """Forget the open database (closing it unless it was committed) and what belongs to
        its session: the write buffer, unflushed (a close discards the working copy anyway),
        the read cache a commit kept, the incarnation, the tracker, the cached digests and the
        layout. Call under every lock."""
        buffer, self._buffer = self._buffer, None
        self._kept = None
        if buffer is not None and not buffer.db.closed:
            buffer.db.close()
        self._incarnation = None
        self._tracker = None
        self._digests.clear()
        self._markers.clear()
        self._use_layout(None)

    def _require_buffer(self) -> WriteBuffer:
        """The open database's write buffer (what applies read and write)."""
        if self._buffer is None:
            raise WorkerClosedError("the worker has no open store: call open(v) first")
        return self._buffer

    def _flushed_db(self, *, changing: bool = False) -> Database:
        """The open database with every buffered write in it: what every call but ``apply``
        and ``status`` uses, so commits, exports, imports, drops and scans see all applies.
        ``changing``: the caller changes the database's state other than through the buffer
        (an import, a drop), so the buffer forgets its read cache. Call under ``db_lock``."""
        buffer = self._require_buffer()
        buffer.flush()
        if changing:
            buffer.forget_cache()
        return buffer.db

    @contextmanager
    def _all_locks(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self._control)
            for name in sorted(self._op_locks):
                stack.enter_context(self._op_locks[name])
            yield
