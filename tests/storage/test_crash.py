"""Crash safety with real processes: a child commits in a loop; the parent kills it.

Deterministic: every named failpoint of create/open/commit (``SPARKSTEP_FAILPOINT``) ends the
child at that instant. Randomised: SIGKILL after a random number of commits plus a random
delay. After every kill the parent checks seed 004's promise on the real directory:

- ``versions()`` is ``{v}`` or ``{v, v+1}``: it holds the last version the child reported as
  committed ``n`` and nothing beyond ``n + 1``;
- no version is torn: each version, opened (in a copy of the directory, since opening one
  version discards the other), holds exactly ``expected_state(version)``.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkstep.failpoints import ENV_VAR, FAILPOINT_EXIT_CODE
from sparkstep.storage import RocksDBStore, is_store
from sparkstep.storage.rocksdb import FAILPOINTS
from tests.storage.store_child import DEPLOYMENT, FINGERPRINT, expected_state

REPO = Path(__file__).resolve().parents[2]
CHILD_DEADLINE_S = 60.0


def _spawn(path: Path, failpoint: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if failpoint is not None:
        env[ENV_VAR] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage.store_child", "commit-loop", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _committed(lines: str) -> list[int]:
    return [int(line.split()[1]) for line in lines.splitlines() if line.startswith("committed ")]


def _read_commits(proc: subprocess.Popen[str], count: int) -> list[int]:
    """Read ``committed n`` lines until ``count`` arrived (deadline), or the child exited."""
    assert proc.stdout is not None
    seen: list[int] = []
    deadline = time.monotonic() + CHILD_DEADLINE_S
    while len(seen) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"child reported {seen} and then nothing"
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            break  # the child exited
        seen.extend(_committed(line))
    return seen


def _check_store(path: Path, floor: int, reported: list[int], work: Path) -> int:
    """Check the rules after a kill; returns the newest version (the next trial's floor).

    ``floor`` is the version the store held alone before the child started.
    """
    last = reported[-1] if reported else floor
    assert reported == list(range(floor + 1, last + 1)), reported
    store = RocksDBStore(path, deployment=DEPLOYMENT, fingerprint=FINGERPRINT)
    try:
        versions = store.versions()
    finally:
        store.close()
    assert len(versions) in (1, 2)
    assert last in versions, f"commit {last} returned but versions() is {versions}"
    assert versions[-1] <= last + 1, f"versions() {versions} beyond {last} + 1"
    for version in versions:
        copy = work / f"copy-{version}"
        shutil.copytree(path, copy)
        try:
            _check_version(copy, version)
        finally:
            shutil.rmtree(copy)
    return versions[-1]


def _check_version(path: Path, version: int) -> None:
    store = RocksDBStore(path)
    try:
        db = store.open(version)
        step, layout, expected = expected_state(version)
        contents = {(t, k): v for t in db.tables() for k, v in db.items(t)}
        assert contents == expected, f"version {version} is torn"
        assert (db.get_step(), db.get_layout()) == (step, layout), f"version {version} metadata"
        db.close()
    finally:
        store.close()


def _kill(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=CHILD_DEADLINE_S)
    return out


def _run_to_failpoint(path: Path, spec: str) -> list[int]:
    proc = _spawn(path, spec)
    try:
        out, err = proc.communicate(timeout=CHILD_DEADLINE_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise
    assert proc.returncode == FAILPOINT_EXIT_CODE, f"{spec} did not fire: {err}"
    return _committed(out)


def _newest(path: Path) -> int:
    with RocksDBStore(path) as store:
        return store.versions()[-1]


STEADY_POINTS = [p for p in FAILPOINTS if not p.startswith(("store.create.", "store.identity."))]


@pytest.mark.parametrize("point", STEADY_POINTS)
def test_kill_at_each_failpoint_of_open_and_commit(point: str, tmp_path: Path) -> None:
    path = tmp_path / "store"
    # The second hit: the first open/commit ran whole, so a version >= 1 exists and, for the
    # open points, there is an older version to discard.
    reported = _run_to_failpoint(path, f"{point}@2")
    _check_store(path, 0, reported, tmp_path)
    # And the store goes on: another child commits on top of what the crash left.
    floor = _newest(path)
    again = _spawn(path)
    try:
        more = _read_commits(again, 2)
    finally:
        more += _committed(_kill(again))
    _check_store(path, floor, more, tmp_path)


@pytest.mark.parametrize(
    "point", [p for p in FAILPOINTS if p.startswith(("store.create.", "store.identity."))]
)
def test_kill_while_creating_a_store(point: str, tmp_path: Path) -> None:
    path = tmp_path / "store"
    assert _run_to_failpoint(path, point) == []
    # Half created, it is still recognisably sparkstep's (its leftovers may be deleted).
    assert is_store(path)
    if point == "store.create.after_marker":
        assert [p.name for p in path.iterdir()] == ["SPARKSTEP_STORE"]  # before anything else
    _check_store(path, 0, [], tmp_path)
    with RocksDBStore(path) as store:
        assert store.versions() == range(0, 1)


def _random_trials(tmp_path: Path, trials: int, seed: int) -> None:
    print(f"random trials with seed {seed}")  # shown by pytest when a trial fails
    rng = random.Random(seed)
    path = tmp_path / "store"
    floor = 0
    for trial in range(trials):
        proc = _spawn(path)
        try:
            reported = _read_commits(proc, rng.randint(0, 3))
            # The random instant: the child keeps committing while we wait.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=rng.uniform(0.0, 0.08))
        finally:
            reported += _committed(_kill(proc))
        assert proc.returncode == -signal.SIGKILL, f"trial {trial} (seed {seed}): child died"
        floor = _check_store(path, floor, reported, tmp_path)


def test_sigkill_at_random_instants(tmp_path: Path) -> None:
    _random_trials(tmp_path, trials=20, seed=random.randrange(1 << 30))


@pytest.mark.long
def test_sigkill_at_random_instants_long(tmp_path: Path) -> None:
    _random_trials(tmp_path, trials=500, seed=random.randrange(1 << 30))
