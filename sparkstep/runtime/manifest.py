"""The manifest: the durable record of the last complete checkpoint, and its commit point.

A checkpoint or a rescale is complete exactly when its manifest is durable: every store it
lists can open ``version``, and ``get_step() == step`` in all of them. The manifest is written
only after every listed store has committed ``version`` (so a crash before the write recovers
from the previous manifest, whose version the stores still hold: a two-version store keeps
``{v, v+1}`` after committing ``v+1``), and nothing reopens the stores at the new version before
the write returns.

On disk: ``<state_dir>/manifest.json``, replaced atomically: the new text is written to
``manifest.json.tmp``, fsynced, renamed over ``manifest.json``, and the directory is fsynced, so
a crash at any instant leaves either the old manifest or the new one, whole. Format::

    {"format": 1, "deployment": "<uuid>", "name": "<pipeline name>",
     "layout": {"epoch": e, "workers": W, "owners": [w, ...]},   # shard -> worker, S entries
     "stores": ["workers/w0-e0", ...],                             # W entries, relative paths
     "version": v, "step": s, "written_at": <unix seconds>,
     "operators": {"fingerprint": "<hex>", "specs": [OperatorSpec.describe(), ...]}}

``operators`` records the stateful operators the state was made by (their descriptions sorted
by name, and :func:`~sparkstep.runtime.operators.fingerprint` of them and ``S``); recovery
refuses a pipeline whose operators differ
(:class:`~sparkstep.runtime.errors.PipelineChangedError`, naming each operator and what
changed). A manifest written before the field existed has none: recovery records the
running pipeline's at the next checkpoint.

Reading checks the record against itself (layout balanced, one store per worker, non-negative
version and step) and, when asked, against the deployment of the caller.

Writers and fencing. One runtime process at a time may write the manifest: the holder of the
newest :class:`ManifestLease`. A runtime claims one at recovery, before any store call; its
generation (``<state_dir>/generation``, a decimal integer, replaced atomically like the manifest,
one more than the last claimed) is also the fencing token it presents to its workers on every
call that changes a store (``Store.admit``). :meth:`ManifestLease.write` is a compare-and-swap
under ``flock(<state_dir>/manifest.lock)``: it replaces the manifest only if no newer generation
was claimed and the durable manifest still has the version the writer read; otherwise it raises
:class:`~sparkstep.runtime.errors.ManifestConflictError` and writes nothing. So a runtime that
was replaced (partitioned, slow, presumed dead) can neither commit the stores its successor
opened nor make its own checkpoint the commit point. :func:`write_manifest` writes without
these checks: for tools and tests that set a state dir up, never for a running pipeline.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkstep.errors import ConfigError
from sparkstep.failpoints import failpoint
from sparkstep.ids import LayoutEpoch, Step, Version
from sparkstep.runtime.errors import ManifestConflictError, ManifestError
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.operators.spec import OperatorSpec, fingerprint

__all__ = [
    "GENERATION_FILE",
    "MANIFEST_FILE",
    "MANIFEST_FILES",
    "Manifest",
    "ManifestLease",
    "OperatorsRecord",
    "STORES_DIR",
    "read_manifest",
    "store_name",
    "write_manifest",
]

MANIFEST_FILE = "manifest.json"
STORES_DIR = "workers"
GENERATION_FILE = "generation"
_LOCK_FILE = "manifest.lock"
#: Every file the manifest and its writers make directly in a state dir (temporaries included).
MANIFEST_FILES = (
    MANIFEST_FILE,
    f"{MANIFEST_FILE}.tmp",
    GENERATION_FILE,
    f"{GENERATION_FILE}.tmp",
    _LOCK_FILE,
)
_FORMAT = 1


def store_name(path: str | Path) -> str:
    """The manifest's name of the store directory ``path``: ``workers/<its name>``.

    A store lives in a directory named ``workers`` under a root the manifest does not record:
    the state dir for the coordinator's own workers, ``<data_dir>/pipelines/<pipeline>`` on a
    state host. So the name is what identifies a store across hosts; the deployment each store
    records tells state dirs apart. Raises :class:`ValueError` for a path not in a
    ``workers`` directory.
    """
    store = Path(path)
    if store.parent.name != STORES_DIR:
        raise ValueError(f"the store {store} is not in a {STORES_DIR}/ directory")
    return f"{STORES_DIR}/{store.name}"


@dataclass(frozen=True)
class OperatorsRecord:
    """The stateful operators a state was made by: their fingerprint and descriptions."""

    fingerprint: str
    specs: tuple[Mapping[str, Any], ...]

    @classmethod
    def of(cls, specs: Sequence[OperatorSpec], shards: int) -> OperatorsRecord:
        """The record of ``specs`` at ``S = shards``."""
        ordered = sorted(specs, key=lambda spec: spec.name)
        return cls(fingerprint(ordered, shards), tuple(spec.describe() for spec in ordered))

    def changes_to(self, current: OperatorsRecord) -> list[str]:
        """What differs from this record to ``current``, one line per operator; [] if equal.

        ``S`` is not described (only fingerprinted): equal descriptions with another fingerprint
        say that ``S`` changed.
        """
        if self.fingerprint == current.fingerprint:
            return []
        old = {str(spec["name"]): spec for spec in self.specs}
        new = {str(spec["name"]): spec for spec in current.specs}
        lines = [f"operator {name!r} was removed" for name in sorted(old.keys() - new.keys())]
        lines += [f"operator {name!r} is new" for name in sorted(new.keys() - old.keys())]
        for name in sorted(old.keys() & new.keys()):
            changed = [
                f"{item} changed from {json.dumps(old[name].get(item))} to "
                f"{json.dumps(new[name].get(item))}"
                for item in sorted(set(old[name]) | set(new[name]))
                if old[name].get(item) != new[name].get(item)
            ]
            if changed:
                lines.append(f"operator {name!r}: {'; '.join(changed)}")
        return lines or ["the number of shards S changed"]

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "specs": [dict(spec) for spec in self.specs]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OperatorsRecord:
        specs = data["specs"]
        if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
            raise ManifestError("operators.specs must be a list of objects")
        return cls(str(data["fingerprint"]), tuple(specs))


@dataclass(frozen=True)
class Manifest:
    """``{deployment, epoch, W, stores, version, step, operators}`` of the last complete
    checkpoint (``operators`` None in a manifest written before the field existed)."""

    deployment: str
    name: str
    layout: Layout
    stores: tuple[str, ...]
    version: Version
    step: Step
    operators: OperatorsRecord | None = None
    written_at: float = field(default_factory=time.time, compare=False)

    def __post_init__(self) -> None:
        if len(self.stores) != self.layout.workers:
            raise ManifestError(
                f"manifest lists {len(self.stores)} stores for {self.layout.workers} workers"
            )
        if len(set(self.stores)) != len(self.stores):
            raise ManifestError(f"manifest lists a store twice: {list(self.stores)}")
        if self.version < 0 or self.step < 0:
            raise ManifestError(f"manifest has version {self.version} and step {self.step}")

    @property
    def epoch(self) -> LayoutEpoch:
        return self.layout.epoch

    @property
    def workers(self) -> int:
        return self.layout.workers

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": _FORMAT,
                "deployment": self.deployment,
                "name": self.name,
                "layout": json.loads(self.layout.to_json()),
                "stores": list(self.stores),
                "version": self.version,
                "step": self.step,
                "written_at": self.written_at,
                "operators": None if self.operators is None else self.operators.to_json(),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data: dict[str, Any] = json.loads(text)
        if data.get("format") != _FORMAT:
            raise ManifestError(f"unknown manifest format {data.get('format')!r}")
        return cls(
            deployment=str(data["deployment"]),
            name=str(data["name"]),
            layout=Layout.from_json(json.dumps(data["layout"])),
            stores=tuple(str(s) for s in data["stores"]),
            version=Version(int(data["version"])),
            step=Step(int(data["step"])),
            operators=None
            if data.get("operators") is None
            else OperatorsRecord.from_json(data["operators"]),
            written_at=float(data["written_at"]),
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_file(state_dir: Path, name: str, text: str, point: str) -> None:
    """Replace ``<state_dir>/<name>`` by ``text`` atomically and durably (temp file, fsync,
    rename, fsync the directory); failpoints ``<point>.before_rename`` and
    ``<point>.after_rename``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    temp = state_dir / f"{name}.tmp"
    with temp.open("w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    failpoint(f"{point}.before_rename")
    os.replace(temp, state_dir / name)
    _fsync_dir(state_dir)
    failpoint(f"{point}.after_rename")


def write_manifest(state_dir: Path, manifest: Manifest) -> None:
    """Make ``manifest`` the durable manifest of ``state_dir``, atomically, without the writer
    checks of :class:`ManifestLease` (see the module docstring: set-up tools and tests only)."""
    _replace_file(state_dir, MANIFEST_FILE, manifest.to_json(), "manifest.write")


@contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """``flock(<state_dir>/manifest.lock)``, exclusive, for the duration: the writers' lock."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_generation(state_dir: Path) -> int:
    path = state_dir / GENERATION_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise ManifestError(
            f"{path} holds {text[:40]!r}, not a generation: restore the state dir from a backup"
        ) from exc


@dataclass(frozen=True)
class ManifestLease:
    """The right of one runtime process to write the manifest of ``state_dir``, and its
    fencing token ``generation`` (see the module docstring)."""

    state_dir: Path
    generation: int

    @classmethod
    def claim(cls, state_dir: Path) -> ManifestLease:
        """Take the next generation, durably; every earlier lease is fenced from now on."""
        with _locked(state_dir):
            generation = _read_generation(state_dir) + 1
            _replace_file(state_dir, GENERATION_FILE, f"{generation}\n", "generation.write")
        return cls(state_dir, generation)

    def write(self, manifest: Manifest, *, expected: Version | None) -> None:
        """Make ``manifest`` the durable manifest (the commit point) if this lease is the newest
        and the durable manifest's version is still ``expected`` (None: there is none yet).

        Raises :class:`ManifestConflictError`, writing nothing, otherwise.
        """
        with _locked(self.state_dir):
            newest = _read_generation(self.state_dir)
            if newest != self.generation:
                raise ManifestConflictError(
                    f"the manifest of {self.state_dir} is not written: runtime generation "
                    f"{newest} has replaced this one ({self.generation}), which must stop"
                )
            durable = read_manifest(self.state_dir)
            found = None if durable is None else durable.version
            if found != expected:
                raise ManifestConflictError(
                    f"the manifest of {self.state_dir} is not written: it is at version {found}, "
                    f"not {expected} as this runtime read it; another writer changed it"
                )
            write_manifest(self.state_dir, manifest)


def read_manifest(state_dir: Path, *, deployment: str | None = None) -> Manifest | None:
    """The manifest of ``state_dir``, or None if no checkpoint was ever completed there.

    Raises :class:`ManifestError` if it is unreadable or invalid, or if ``deployment`` is given
    and the manifest belongs to another deployment.
    """
    path = state_dir / MANIFEST_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"cannot read the manifest {path}: {exc}") from exc
    try:
        manifest = Manifest.from_json(text)
    except (ManifestError, ConfigError) as exc:
        raise ManifestError(f"the manifest {path} is invalid: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(
            f"the manifest {path} is corrupt ({exc!r}): restore it from a backup, or start "
            "afresh with `sparkstep reset`"
        ) from exc
    if deployment is not None and manifest.deployment != deployment:
        raise ManifestError(
            f"state dir {state_dir} belongs to deployment {manifest.deployment}, not "
            f"{deployment}: use another --state-dir or `sparkstep reset`"
        )
    return manifest
