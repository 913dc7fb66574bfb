"""The two-version store's contract on real RocksDB files: versions, writes, errors, identity."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from sparkstep.errors import SparkstepError
from sparkstep.storage import (
    CorruptStoreError,
    InvalidTableError,
    RocksDBStore,
    StorageError,
    StoreBusyError,
    StoreClosedError,
    StoreExistsError,
    StoreFencedError,
    StoreLockedError,
    VersionNotAvailableError,
    WrongDeploymentError,
    WrongFingerprintError,
    shard_key,
)
from sparkstep.storage import errors as storage_errors
from tests.storage.fixtures import StoreFactory

REPO = Path(__file__).resolve().parents[2]
K1, K2, K3 = shard_key(1, b"one"), shard_key(2, b"two"), shard_key(3, b"three")


def _commit_one(store: RocksDBStore, version: int, table: str, key: bytes, value: bytes) -> None:
    db = store.open(version)
    db.put(table, key, value)
    db.commit()


# ---- seed 004 semantics ---------------------------------------------------------------------


def test_new_store_has_only_empty_version_zero(store_factory: StoreFactory) -> None:
    store = store_factory()
    assert store.versions() == range(0, 1)
    db = store.open(0)
    assert db.get_step() == 0
    assert db.get("any", K1) is None
    assert db.tables() == []
    assert db.get_layout() is None
    db.close()
    assert store.versions() == range(0, 1)


def test_commit_makes_v_plus_one_and_keeps_v(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    db.put("t", K1, b"a")
    db.set_step(7)
    db.commit()
    assert db.closed
    assert store.versions() == range(0, 2)

    old = store.open(0)  # discards 1
    assert old.get("t", K1) is None
    assert old.get_step() == 0
    old.close()
    assert store.versions() == range(0, 1)


def test_open_newer_keeps_older_until_the_next_commit(store_factory: StoreFactory) -> None:
    store = store_factory()
    _commit_one(store, 0, "t", K1, b"a")
    db = store.open(1)
    assert store.versions() == range(0, 2)  # a manifest may still name 0 (storage.base)
    assert db.get("t", K1) == b"a"
    db.delete("t", K1)
    db.put("u", K2, b"b")
    db.commit()
    assert store.versions() == range(1, 3)  # the commit discarded 0
    db = store.open(2)
    assert db.get("t", K1) is None
    assert db.get("u", K2) == b"b"
    assert db.tables() == ["t", "u"]
    db.close()


def test_open_keeps_the_older_version_readable_and_commit_deletes_its_files(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path)
    _commit_one(store, 0, "t", K1, b"a")
    _commit_one(store, 1, "t", K1, b"b")  # open(1) kept 0, the commit dropped it: {1, 2}
    assert store.versions() == range(1, 3)
    db = store.open(2)  # {1, 2}: 1 is what a manifest written before this open names
    db.put("t", K1, b"lost")
    db.close()
    older = store.open(1)  # a recovery from that manifest: discards 2
    assert (older.get("t", K1), store.versions()) == (b"a", range(1, 2))
    older.commit()
    store.open(2).close()
    assert sorted(p.name for p in (store_path / "versions").iterdir()) == ["1", "2"]


def test_close_without_commit_drops_writes(store_factory: StoreFactory) -> None:
    store = store_factory()
    _commit_one(store, 0, "t", K1, b"a")
    db = store.open(1)
    db.put("t", K1, b"changed")
    db.put("t", K2, b"new")
    db.set_step(99)
    db.close()
    assert store.versions() == range(0, 2)
    db = store.open(1)
    assert db.get("t", K1) == b"a"
    assert db.get("t", K2) is None
    assert db.get_step() == 0
    db.close()


def test_state_survives_a_new_store_object(store_factory: StoreFactory, store_path: Path) -> None:
    store = store_factory(store_path)
    db = store.open(0)
    db.put("t", K1, b"a")
    db.set_step(3)
    db.set_layout(b'{"epoch": 2}')
    db.commit()
    store.close()
    again = store_factory(store_path)
    assert again.versions() == range(0, 2)
    db = again.open(1)
    assert (db.get("t", K1), db.get_step(), db.get_layout()) == (b"a", 3, b'{"epoch": 2}')
    db.close()


def test_write_batch_is_atomic_across_tables_and_ordered(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    db.put("a", K1, b"old")
    batch = db.batch()
    batch.delete("a", K1)
    batch.put("a", K1, b"new")  # later op wins
    batch.put("b", K2, b"x")
    batch.put("c", K3, b"y")
    batch.delete_range("c", shard_key(3, b""), shard_key(4, b""))
    assert len(batch) == 5
    assert db.get("b", K2) is None  # nothing visible before write
    db.write(batch)
    assert len(batch) == 0
    assert (db.get("a", K1), db.get("b", K2), db.get("c", K3)) == (b"new", b"x", None)
    batch.put("b", K2, b"reused")
    db.write(batch)
    assert db.get("b", K2) == b"reused"
    db.commit()


def test_put_many_puts_and_deletes_in_order(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    db.put("t", K1, b"old")
    db.put("t", K3, b"gone")
    batch = db.batch()
    batch.put_many("t", {K1: b"new", K2: b"x", K3: None})
    batch.put_many("u", {K2: b"y"})  # a table first named by put_many
    assert len(batch) == 4
    db.write(batch)
    assert db.get_many("t", [K1, K2, K3]) == [b"new", b"x", None]
    assert db.get("u", K2) == b"y"
    db.commit()


def test_batch_of_another_database_is_refused(store_factory: StoreFactory) -> None:
    first, second = store_factory(), store_factory()
    db1, db2 = first.open(0), second.open(0)
    with pytest.raises(TypeError):
        db2.write(db1.batch())
    db1.close()
    db2.close()


def test_get_many_items_and_ranges(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    for shard in range(5):
        db.put("t", shard_key(shard, b"k"), bytes([shard]))
    wanted = [shard_key(1, b"k"), K1, shard_key(4, b"k")]
    assert db.get_many("t", wanted) == [b"\x01", None, b"\x04"]
    assert db.get_many("missing", [K1]) == [None]
    got = list(db.items("t", start=shard_key(1, b""), end=shard_key(3, b"")))
    assert got == [(shard_key(1, b"k"), b"\x01"), (shard_key(2, b"k"), b"\x02")]
    assert len(list(db.items("t"))) == 5
    assert list(db.items("missing")) == []
    db.close()


def test_a_large_get_many_answers_in_the_callers_order_sorted_or_not(
    store_factory: StoreFactory,
) -> None:
    """Past 64 keys the multi-get is read in key order: sorted by the database, or as given
    with ``ascending=True``; either way each answer is its key's, whatever order the keys
    came in (also when a caller's "ascending" keys are not)."""
    store = store_factory()
    db = store.open(0)
    keys = [shard_key(s % 5, b"k%03d" % s) for s in range(200)]
    for i, key in enumerate(keys[::2]):
        db.put("t", key, b"v%d" % i)
    expected = {key: (b"v%d" % (i // 2) if i % 2 == 0 else None) for i, key in enumerate(keys)}
    shuffled = list(np.random.default_rng(1).permutation(keys))
    ordered = sorted(keys)
    assert db.get_many("t", shuffled) == [expected[k] for k in shuffled]
    assert db.get_many("t", ordered, ascending=True) == [expected[k] for k in ordered]
    assert db.get_many("t", shuffled, ascending=True) == [expected[k] for k in shuffled]
    db.close()


def test_create_makes_a_store_at_a_given_version(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    store = RocksDBStore.create(tmp_path / "new", version=41, deployment="d", fingerprint="f")
    try:
        assert store.versions() == range(41, 42)
        db = store.open(41)
        assert db.get_step() == 0
        db.put("t", K1, b"x")
        db.commit()
        assert store.versions() == range(41, 43)
    finally:
        store.close()
    with pytest.raises(StoreExistsError):
        RocksDBStore.create(tmp_path / "new", version=5)
    replaced = RocksDBStore.create(tmp_path / "new", version=5, replace=True)
    try:
        assert replaced.versions() == range(5, 6)
        assert replaced.deployment is None
    finally:
        replaced.close()


def test_inspect_reads_versions_without_the_lock(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path, deployment="d", fingerprint="f")
    _commit_one(store, 0, "t", K1, b"a")
    info = RocksDBStore.inspect(store_path)
    assert (info.versions, info.deployment, info.fingerprint) == (range(0, 2), "d", "f")


# ---- state errors -----------------------------------------------------------------------------


def test_open_outside_versions_names_what_is_available(store_factory: StoreFactory) -> None:
    store = store_factory()
    _commit_one(store, 0, "t", K1, b"a")
    with pytest.raises(VersionNotAvailableError, match=r"cannot open version 2.*\[0, 1\]") as info:
        store.open(2)
    assert (info.value.requested, info.value.available) == (2, range(0, 2))
    store.open(0).close()
    with pytest.raises(VersionNotAvailableError):
        store.open(1)  # discarded by open(0)


def test_second_open_while_open_is_refused(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    with pytest.raises(StoreBusyError):
        store.open(0)
    db.close()
    store.open(0).close()


def test_closed_database_and_store_refuse_calls(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    db.put("t", K1, b"a")
    db.commit()
    for call in (
        lambda: db.get("t", K1),
        lambda: db.put("t", K1, b"x"),
        lambda: db.put("new", K1, b"x"),
        lambda: db.delete("t", K1),
        lambda: db.get_step(),
        lambda: db.set_step(1),
        lambda: db.batch(),
        lambda: db.commit(),
        lambda: db.tables(),
    ):
        with pytest.raises(StoreClosedError):
            call()
    db.close()  # idempotent after commit
    store.close()
    with pytest.raises(StoreClosedError):
        store.versions()
    with pytest.raises(StoreClosedError):
        store.open(0)


def test_closing_the_store_closes_its_database(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path)
    _commit_one(store, 0, "t", K1, b"a")
    db = store.open(1)
    db.put("t", K1, b"lost")
    store.close()
    assert db.closed
    again = store_factory(store_path)
    assert again.versions() == range(0, 2)
    db = again.open(1)
    assert db.get("t", K1) == b"a"
    db.close()


def test_invalid_table_names_and_arguments(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    for bad in ("", "x" * 201):
        with pytest.raises(InvalidTableError):
            db.put(bad, K1, b"v")
        with pytest.raises(InvalidTableError):
            db.get(bad, K1)
    with pytest.raises(TypeError):
        db.put("t", "not bytes", b"v")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        db.set_step(-1)
    with pytest.raises(TypeError):
        db.set_layout("not bytes")  # type: ignore[arg-type]
    db.close()


# ---- identity ---------------------------------------------------------------------------------


def test_identity_is_recorded_once_and_checked(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store_factory(store_path).close()  # a new store without identity
    first = store_factory(store_path, deployment="dep-A", fingerprint="fp-1")
    assert (first.deployment, first.fingerprint) == ("dep-A", "fp-1")
    first.close()
    with pytest.raises(WrongDeploymentError, match=r"dep-A.*dep-B") as dep:
        store_factory(store_path, deployment="dep-B", fingerprint="fp-1")
    assert (dep.value.expected, dep.value.found) == ("dep-B", "dep-A")
    with pytest.raises(WrongFingerprintError, match=r"fp-1.*fp-2") as fp:
        store_factory(store_path, deployment="dep-A", fingerprint="fp-2")
    assert (fp.value.expected, fp.value.found) == ("fp-2", "fp-1")
    # Without identity there is nothing to check; the recorded one stays.
    unchecked = store_factory(store_path)
    assert unchecked.deployment == "dep-A"
    unchecked.close()
    # The lock was released by the refused constructors.
    store_factory(store_path, deployment="dep-A", fingerprint="fp-1").close()


def test_identity_survives_commits(store_factory: StoreFactory, store_path: Path) -> None:
    store = store_factory(store_path, deployment="d", fingerprint="f")
    _commit_one(store, 0, "t", K1, b"a")
    store.open(1).close()
    store.close()
    with pytest.raises(WrongDeploymentError):
        store_factory(store_path, deployment="other")


def test_fencing_tokens_only_rise_and_survive_commits_and_reopening(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path, deployment="d", fingerprint="f")
    assert store.fence == 0
    store.admit(None)  # never fenced: standalone use
    store.admit(3)
    store.admit(3)  # the same owner again
    with pytest.raises(StoreFencedError, match=r"fenced at token 3.*token 2"):
        store.admit(2)
    with pytest.raises(StoreFencedError, match="without a fencing token"):
        store.admit(None)
    _commit_one(store, 0, "t", K1, b"a")  # a commit rewrites VERSION and keeps the fence
    store.close()
    reopened = store_factory(store_path, deployment="d", fingerprint="f")
    assert (reopened.fence, reopened.versions()) == (3, range(0, 2))
    with pytest.raises(StoreFencedError):
        reopened.admit(1)
    reopened.admit(4)
    assert reopened.fence == 4
    with pytest.raises(ValueError):
        reopened.admit(0)


def test_a_version_file_without_a_fence_reads_as_never_fenced(
    store_factory: StoreFactory, store_path: Path
) -> None:
    """A store written before the fence existed: its VERSION has no "fence" key."""
    store_factory(store_path, deployment="d").close()
    path = store_path / "VERSION"
    data = json.loads(path.read_text())
    del data["checksum"], data["fence"]
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    data["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
    path.write_text(json.dumps(data))
    old = store_factory(store_path, deployment="d")
    assert old.fence == 0 and old.deployment == "d"
    old.admit(1)
    assert old.fence == 1


# ---- the directory lock -----------------------------------------------------------------------


def test_second_object_in_the_same_process_is_locked_out(
    store_factory: StoreFactory, store_path: Path
) -> None:
    first = store_factory(store_path)
    with pytest.raises(StoreLockedError, match="open elsewhere"):
        RocksDBStore(store_path)
    first.close()
    store_factory(store_path).close()


def _start_holder(path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.storage.store_child", "hold", str(path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "the holder process did not start"
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_another_process_gets_locked_error_at_once(store_path: Path) -> None:
    holder = _start_holder(store_path)
    try:
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            RocksDBStore(store_path)
    finally:
        holder.kill()
        holder.communicate()
    RocksDBStore(store_path).close()


def test_bounded_wait_takes_the_lock_when_the_owner_dies(store_path: Path) -> None:
    holder = _start_holder(store_path)
    outcome: list[object] = []

    def waiter() -> None:
        try:
            outcome.append(RocksDBStore(store_path, lock_timeout=60))
        except BaseException as exc:  # reported to the main thread below
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    holder.kill()  # SIGKILL: the kernel releases the flock
    holder.communicate()
    thread.join(timeout=90)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RocksDBStore), outcome
    outcome[0].close()


def test_bounded_wait_gives_up_with_locked_error(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store_factory(store_path)
    with pytest.raises(StoreLockedError, match="after waiting"):
        RocksDBStore(store_path, lock_timeout=0.2)


# ---- a damaged directory ------------------------------------------------------------------------


def _two_versions(store_factory: StoreFactory, path: Path) -> None:
    store = store_factory(path)
    _commit_one(store, 0, "t", K1, b"a")
    store.close()


def test_missing_version_file_is_corruption(store_factory: StoreFactory, store_path: Path) -> None:
    _two_versions(store_factory, store_path)
    (store_path / "VERSION").unlink()
    with pytest.raises(CorruptStoreError, match="no VERSION file"):
        RocksDBStore(store_path)


@pytest.mark.parametrize(
    "garble",
    [
        lambda raw: raw[: len(raw) // 2],
        lambda raw: b"\x00\xff garbage",
        lambda raw: raw.replace(b'"versions": [\n  0,', b'"versions": [\n  7,'),
        lambda raw: b"",
    ],
    ids=["truncated", "binary", "edited-without-checksum", "empty"],
)
def test_garbled_version_file_is_corruption(
    store_factory: StoreFactory, store_path: Path, garble
) -> None:
    _two_versions(store_factory, store_path)
    version_file = store_path / "VERSION"
    raw = version_file.read_bytes()
    garbled = garble(raw)
    assert garbled != raw
    version_file.write_bytes(garbled)
    with pytest.raises(CorruptStoreError, match="garbled"):
        RocksDBStore(store_path)


def test_deleted_version_directory_is_corruption(
    store_factory: StoreFactory, store_path: Path
) -> None:
    _two_versions(store_factory, store_path)
    shutil.rmtree(store_path / "versions" / "1")
    with pytest.raises(CorruptStoreError, match="version 1"):
        RocksDBStore(store_path)


def test_missing_sst_file_is_corruption_at_open(
    store_factory: StoreFactory, store_path: Path
) -> None:
    _two_versions(store_factory, store_path)
    ssts = list((store_path / "versions" / "1").glob("*.sst"))
    assert ssts
    for sst in ssts:
        sst.unlink()
    store = store_factory(store_path)
    with pytest.raises(CorruptStoreError):
        store.open(1)


def test_swapped_version_directory_is_caught_by_its_own_record(
    store_factory: StoreFactory, store_path: Path
) -> None:
    _two_versions(store_factory, store_path)
    versions = store_path / "versions"
    shutil.rmtree(versions / "1")
    shutil.copytree(versions / "0", versions / "1")
    store = store_factory(store_path)
    with pytest.raises(CorruptStoreError, match="holds version 0"):
        store.open(1)


def test_orphans_of_a_crash_are_collected_at_open(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path)
    store.close()
    (store_path / "versions" / "1").mkdir()  # a checkpoint cut short
    (store_path / "versions" / "1" / "000009.sst").write_bytes(b"partial")
    (store_path / "versions" / "1.tmp").mkdir()
    (store_path / "VERSION.tmp").write_bytes(b"half")
    store = store_factory(store_path)
    assert store.versions() == range(0, 1)
    store.open(0).close()
    assert sorted(os.listdir(store_path / "versions")) == ["0"]
    assert not (store_path / "VERSION.tmp").exists()


def test_interrupted_creation_is_redone(store_path: Path) -> None:
    store_path.mkdir()
    (store_path / "SPARKSTEP_STORE").write_bytes(b"")  # a crash can leave the marker short
    (store_path / "CREATING").write_text(json.dumps({"version": 12}))
    (store_path / "versions").mkdir()
    store = RocksDBStore(store_path)
    try:
        assert store.versions() == range(12, 13)
        assert not (store_path / "CREATING").exists()
    finally:
        store.close()


# ---- the error classes ---------------------------------------------------------------------------


def test_every_error_derives_from_storage_error_and_says_when() -> None:
    for name in storage_errors.__all__:
        cls = getattr(storage_errors, name)
        assert issubclass(cls, StorageError) and issubclass(cls, SparkstepError)
        assert (cls.__doc__ and cls.__doc__.startswith("Raised when")) or name == "StorageError"


def test_user_tables_never_collide_with_metadata(store_factory: StoreFactory) -> None:
    store = store_factory()
    db = store.open(0)
    db.set_step(5)
    db.set_layout(b"L")
    for table in ("default", "t.default", "step"):
        db.put(table, b"step", b"\xff" * 8)
        db.put(table, b"layout", b"user")
        db.put(table, b"version", b"\x00" * 8)
    assert (db.get_step(), db.get_layout()) == (5, b"L")
    assert db.tables() == ["default", "step", "t.default"]
    db.commit()
    db = store.open(1)  # the recorded version is intact too
    assert (db.get_step(), db.get_layout(), db.get("default", b"layout")) == (5, b"L", b"user")
    db.close()
