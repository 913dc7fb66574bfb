"""The manifest is replaced atomically, checks itself, and refuses another deployment."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from sparkstep.failpoints import ENV_VAR, FAILPOINT_EXIT_CODE
from sparkstep.ids import Step, Version
from sparkstep.runtime.errors import ManifestConflictError, ManifestError
from sparkstep.runtime.layout import initial_layout
from sparkstep.runtime.manifest import (
    GENERATION_FILE,
    MANIFEST_FILE,
    Manifest,
    ManifestLease,
    OperatorsRecord,
    read_manifest,
    write_manifest,
)
from sparkstep.runtime.operators import Agg, OperatorSpec


def _manifest(version: int, workers: int = 2, deployment: str = "d-1") -> Manifest:
    return Manifest(
        deployment=deployment,
        name="keyed_sum",
        layout=initial_layout(16, workers),
        stores=tuple(f"workers/w{w}" for w in range(workers)),
        version=Version(version),
        step=Step(10 * version),
    )


def test_round_trip_and_absent(tmp_path: Path) -> None:
    assert read_manifest(tmp_path) is None
    write_manifest(tmp_path, _manifest(3))
    assert read_manifest(tmp_path, deployment="d-1") == _manifest(3)
    write_manifest(tmp_path, _manifest(4, workers=3))
    got = read_manifest(tmp_path)
    assert got is not None and (got.version, got.step, got.workers) == (4, 40, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_FILE]


def test_other_deployment_is_refused_naming_both(tmp_path: Path) -> None:
    write_manifest(tmp_path, _manifest(1))
    with pytest.raises(ManifestError, match="belongs to deployment d-1, not d-2"):
        read_manifest(tmp_path, deployment="d-2")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "corrupt"),
        ('{"format": 1}', "corrupt"),
        ('{"format": 9}', "unknown manifest format 9"),
    ],
)
def test_corrupt_manifest_is_a_clear_error(tmp_path: Path, text: str, reason: str) -> None:
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(ManifestError, match=reason):
        read_manifest(tmp_path)


def test_inconsistent_manifest_is_refused(tmp_path: Path) -> None:
    good = _manifest(1)
    text = good.to_json().replace('"workers/w1"', '"workers/w0"')
    (tmp_path / MANIFEST_FILE).write_text(text)
    with pytest.raises(ManifestError, match="lists a store twice"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match="2 stores for 3 workers"):
        Manifest("d", "n", initial_layout(16, 3), ("a", "b"), Version(0), Step(0))


def test_a_lease_writes_only_while_newest_and_over_the_version_it_read(tmp_path: Path) -> None:
    """Fencing (issue 14 item 4): a manifest write that lost a race is refused, writing nothing."""
    first = ManifestLease.claim(tmp_path)
    assert first.generation == 1
    first.write(_manifest(0), expected=None)
    with pytest.raises(ManifestConflictError, match="at version 0, not None"):
        first.write(_manifest(0), expected=None)  # a second "initial" manifest
    first.write(_manifest(1), expected=Version(0))
    # A newer runtime claims the state dir: the older one can no longer write anything.
    second = ManifestLease.claim(tmp_path)
    assert second.generation == 2
    with pytest.raises(ManifestConflictError, match="generation 2 has replaced this one \\(1\\)"):
        first.write(_manifest(2), expected=Version(1))
    assert read_manifest(tmp_path) == _manifest(1)
    # The newer one writes over what it read, not over a version it did not see.
    with pytest.raises(ManifestConflictError, match="at version 1, not 5"):
        second.write(_manifest(6), expected=Version(5))
    second.write(_manifest(2), expected=Version(1))
    assert read_manifest(tmp_path) == _manifest(2)
    assert (tmp_path / GENERATION_FILE).read_text() == "2\n"


def test_a_garbled_generation_file_is_named(tmp_path: Path) -> None:
    (tmp_path / GENERATION_FILE).write_text("two")
    with pytest.raises(ManifestError, match="not a generation"):
        ManifestLease.claim(tmp_path)


_WRITER = """
import sys
from pathlib import Path
from tests.runtime.test_manifest import _manifest
from sparkstep.runtime.manifest import write_manifest
write_manifest(Path(sys.argv[1]), _manifest(int(sys.argv[2])))
"""


@pytest.mark.parametrize(
    ("point", "expected_version"),
    [("manifest.write.before_rename", 1), ("manifest.write.after_rename", 2)],
)
def test_crash_while_writing_leaves_the_old_or_the_new_manifest_whole(
    tmp_path: Path, point: str, expected_version: int
) -> None:
    write_manifest(tmp_path, _manifest(1))
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path), "2"],
        env={**os.environ, ENV_VAR: point},
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == FAILPOINT_EXIT_CODE, done.stderr
    got = read_manifest(tmp_path)
    assert got == _manifest(expected_version)


SCHEMA = pa.schema([("key", pa.string()), ("value", pa.int64())])
SUMS = OperatorSpec.aggregate("sums", SCHEMA, ["key"], [Agg("sum", "value", "sum")])
SEEN = OperatorSpec.distinct("seen", SCHEMA)


def test_the_operators_record_round_trips_and_names_each_change(tmp_path: Path) -> None:
    record = OperatorsRecord.of([SUMS, SEEN], 16)
    manifest = dataclasses.replace(_manifest(1), operators=record)
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest
    assert record.changes_to(OperatorsRecord.of([SEEN, SUMS], 16)) == []
    wider = OperatorSpec.aggregate(
        "sums", SCHEMA, ["key"], [Agg("sum", "value", "sum"), Agg("max", "value", "top")]
    )
    assert record.changes_to(OperatorsRecord.of([wider], 16)) == [
        "operator 'seen' was removed",
        'operator \'sums\': aggs changed from [["sum", "value", "sum"]] to [["sum", "value", '
        '"sum"], ["max", "value", "top"]]',
    ]
    assert record.changes_to(OperatorsRecord.of([SUMS, SEEN], 32)) == [
        "the number of shards S changed"
    ]


def test_a_manifest_from_before_the_operators_record_reads_without_one(tmp_path: Path) -> None:
    doc = json.loads(_manifest(2).to_json())
    del doc["operators"]
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(doc))
    read = read_manifest(tmp_path)
    assert read is not None and read.operators is None and read.version == 2
