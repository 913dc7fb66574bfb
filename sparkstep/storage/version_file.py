"""The store's ``VERSION`` file: which versions exist, and the identity; the commit point.

Format (JSON, :data:`FORMAT` 1)::

    {"checksum": "<sha256>", "deployment": str | null, "fingerprint": str | null,
     "fence": int, "format": 1, "versions": [v] or [v, v + 1]}

``fence`` is the highest fencing token the store has admitted (:meth:`~sparkstep.storage.base.
Store.admit`); a file written before the key existed has none and reads as 0.

``checksum`` is the SHA-256 of the other keys as canonical JSON (sorted keys, no spaces), so a
garbled or hand-edited file is refused (:class:`~sparkstep.storage.errors.CorruptStoreError`)
rather than trusted. The file is only ever replaced atomically by :func:`write_version_file`:
write ``VERSION.tmp``, fsync it, rename it over ``VERSION``, fsync the directory. A crash leaves
the old or the new file, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sparkstep.failpoints import failpoint
from sparkstep.storage.errors import CorruptStoreError
from sparkstep.storage.files import fsync_path
from sparkstep.storage.layout import VERSION_FILE, VERSION_TMP

__all__ = ["FORMAT", "VersionFile", "read_version_file", "write_version_file"]

FORMAT: Final = 1


@dataclass(frozen=True)
class VersionFile:
    """The contents of ``VERSION``: the versions ``open`` accepts and the recorded identity."""

    versions: range
    deployment: str | None
    fingerprint: str | None
    fence: int = 0

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "versions": list(self.versions),
            "deployment": self.deployment,
            "fingerprint": self.fingerprint,
            "fence": self.fence,
        }

    def to_bytes(self) -> bytes:
        """The file's bytes, checksum included."""
        body = self._body()
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: Path) -> VersionFile:
        """Parse and check ``raw`` (read from ``where``); :class:`CorruptStoreError` if bad."""

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
        if data.get("format") != FORMAT:
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
        fence = data.get("fence", 0)
        if type(fence) is not int or fence < 0:
            raise bad(f"fence {fence!r} is not an integer >= 0")
        return cls(range(versions[0], versions[-1] + 1), deployment, fingerprint, fence)


def read_version_file(directory: Path) -> VersionFile:
    """Read and check ``<directory>/VERSION`` (``OSError`` if it cannot be read)."""
    path = directory / VERSION_FILE
    return VersionFile.parse(path.read_bytes(), path)


def write_version_file(directory: Path, state: VersionFile, point: str) -> None:
    """Atomically replace ``<directory>/VERSION``: write a temp file, fsync, rename, fsync.

    Fires the failpoint ``<point>.after_version_tmp`` between the temp file and the rename.
    """
    tmp = directory / VERSION_TMP
    with open(tmp, "wb") as out:
        out.write(state.to_bytes())
        out.flush()
        os.fsync(out.fileno())
    failpoint(f"{point}.after_version_tmp")
    os.replace(tmp, directory / VERSION_FILE)
    fsync_path(directory)
