"""Crash safety with real processes: a child commits in a loop; the parent kills it.

Deterministic: every named failpoint of create/open/commit (``SPARKSTEP_FAILPOINT``) ends the
child at that instant. Randomised: SIGKILL after a random number of commits plus a random
delay. After every kill the parent checks seed 004's promise on the real directory:

- ``versions()`` holds one or two versions: the last the child reported (committed ``n``, or
  opening ``n``, which may be a rollback to the older version) and nothing beyond ``n + 1``;
- no version is torn: each version, opened (in a copy of the directory, since opening the
  older version discards the newer), holds exactly ``expected_state(version)``.
"""

from __future__ import annotations

import contextlib
import os
import random
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


Report = list[tuple[str, int]]  # the child's lines: ("opening" | "committed", version)


def _report(text: str) -> Report:
    """The child's complete lines (a line cut by the kill is not one)."""
    words = (line.split() for line in text.split("\n")[:-1])
    return [(w[0], int(w[1])) for w in words if len(w) == 2 and w[0] in ("opening", "committed")]


def _commits(report: Report) -> list[int]:
    return [version for what, version in report if what == "committed"]


class _Child:
    """A ``commit-loop`` child. Its stdout goes to a file, so everything it printed is there
    after a kill (lines read from a pipe through a buffer could stay in that buffer)."""

    def __init__(self, path: Path, failpoint: str | None = None) -> None:
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        if failpoint is not None:
            env[ENV_VAR] = failpoint
        self.out = path.parent / "child.out"
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.storage.store_child", "commit-loop", str(path)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
            )

    def report(self) -> Report:
        return _report(self.out.read_text())

    def wait_for_commits(self, count: int) -> None:
        """Until the child reported ``count`` commits (deadline), or exited."""
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while len(_commits(self.report())) < count and self.proc.poll() is None:
            assert time.monotonic() < deadline, f"child reported {self.report()} and then nothing"
            time.sleep(0.005)

    def kill(self) -> Report:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=CHILD_DEADLINE_S)
        return self.report()

    def run_to_failpoint(self, spec: str) -> Report:
        try:
            _, err = self.proc.communicate(timeout=CHILD_DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        assert self.proc.returncode == FAILPOINT_EXIT_CODE, f"{spec} did not fire: {err}"
        return self.report()


def _last_version(newest: int, report: Report) -> int:
    """The version the child last reported, checking the report is a possible history: each
    open names the newest version or the one below it, each commit the version above the last
    open."""
    last = newest
    for what, version in report:
        if what == "opening":
            assert version in (last - 1, last), f"opened {version} after {last}: {report}"
        else:
            assert version == last + 1, f"committed {version} after {last}: {report}"
        last = version
    return last


def _check_store(path: Path, newest: int, report: Report, work: Path) -> int:
    """Check the rules after a kill; returns the newest version (the next trial's ``newest``).

    ``newest`` is the newest version the store held before the child started.
    """
    last = _last_version(newest, report)
    store = RocksDBStore(path, deployment=DEPLOYMENT, fingerprint=FINGERPRINT)
    try:
        versions = store.versions()
    finally:
        store.close()
    assert len(versions) in (1, 2)
    assert last in versions, f"the child reported {last} but versions() is {versions}"
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


def _run_to_failpoint(path: Path, spec: str) -> Report:
    return _Child(path, spec).run_to_failpoint(spec)


def _newest(path: Path) -> int:
    with RocksDBStore(path) as store:
        return store.versions()[-1]


STEADY_POINTS = [p for p in FAILPOINTS if not p.startswith(("store.create.", "store.identity."))]


@pytest.mark.parametrize("point", STEADY_POINTS)
def test_kill_at_each_failpoint_of_open_and_commit(point: str, tmp_path: Path) -> None:
    path = tmp_path / "store"
    # The second hit: the first open/commit ran whole, so a version >= 1 exists and, for the
    # open points, there is a newer version to discard (the child's rollbacks).
    reported = _run_to_failpoint(path, f"{point}@2")
    _check_store(path, 0, reported, tmp_path)
    # And the store goes on: another child commits on top of what the crash left.
    newest = _newest(path)
    again = _Child(path)
    try:
        again.wait_for_commits(2)
    finally:
        more = again.kill()
    _check_store(path, newest, more, tmp_path)


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
    newest = 0
    for trial in range(trials):
        child = _Child(path)
        try:
            child.wait_for_commits(rng.randint(0, 3))
            # The random instant: the child keeps committing while we wait.
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=rng.uniform(0.0, 0.08))
        finally:
            reported = child.kill()
        assert child.proc.returncode == -signal.SIGKILL, f"trial {trial} (seed {seed}): died"
        newest = _check_store(path, newest, reported, tmp_path)


def test_sigkill_at_random_instants(tmp_path: Path) -> None:
    _random_trials(tmp_path, trials=20, seed=random.randrange(1 << 30))


@pytest.mark.long
def test_sigkill_at_random_instants_long(tmp_path: Path) -> None:
    _random_trials(tmp_path, trials=500, seed=random.randrange(1 << 30))
