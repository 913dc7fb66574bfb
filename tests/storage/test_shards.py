"""Shard keys, and moving shards between real stores: export, import, drop."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkstep.storage import (
    MAX_SHARDS,
    InvalidShardError,
    RocksDBDatabase,
    RocksDBStore,
    shard_key,
    shard_of,
    shard_prefix,
    shard_ranges,
)
from tests.storage.fixtures import StoreFactory

Contents = dict[tuple[str, bytes], bytes]


def read_all(db: RocksDBDatabase) -> Contents:
    return {(table, key): value for table in db.tables() for key, value in db.items(table)}


# ---- keys ---------------------------------------------------------------------------------------


@given(st.integers(0, MAX_SHARDS - 1), st.binary(max_size=16))
def test_shard_key_round_trips_and_orders_by_shard(shard: int, key: bytes) -> None:
    full = shard_key(shard, key)
    assert shard_of(full) == shard
    assert full.startswith(shard_prefix(shard))
    ((begin, end),) = shard_ranges([shard])
    assert begin <= full < end


def test_shard_ranges_merge_consecutive_shards() -> None:
    assert shard_ranges([5, 3, 4, 9, 3]) == [
        (shard_prefix(3), shard_prefix(6)),
        (shard_prefix(9), shard_prefix(10)),
    ]
    assert shard_ranges([]) == []
    assert shard_ranges([MAX_SHARDS - 1])[0][1] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("bad", [-1, MAX_SHARDS])
def test_invalid_shards_are_refused(bad: int) -> None:
    with pytest.raises(InvalidShardError):
        shard_key(bad, b"k")
    with pytest.raises(InvalidShardError):
        shard_ranges([1, bad])
    with pytest.raises(InvalidShardError):
        shard_of(b"\x00\x01")


# ---- export / import / drop ----------------------------------------------------------------------

TABLES = ("counts", "markers", "timers")


def _fill(db: RocksDBDatabase, shards: range, tag: bytes) -> Contents:
    written: Contents = {}
    for t, table in enumerate(TABLES):
        for shard in shards:
            if (shard + t) % 4 == 3:
                continue  # some tables have no keys in some shards
            for suffix in (b"", b"a", b"\xff\xff", b"zz" * 10):
                key = shard_key(shard, suffix)
                value = tag + bytes([shard, t]) + suffix
                db.put(table, key, value)
                written[(table, key)] = value
    return written


def test_move_shards_between_stores_moves_exactly_those_keys(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    source_store, target_store = store_factory(), store_factory()
    source, target = source_store.open(0), target_store.open(0)
    source_all = _fill(source, range(0, 10), b"S")
    target_own = _fill(target, range(10, 14), b"T")
    source.set_step(9)
    source.set_layout(b"source-layout")
    target.set_layout(b"target-layout")
    moving = {2, 3, 7}

    exported = source.export_shards(moving, tmp_path / "export")
    moved = {k: v for k, v in source_all.items() if shard_of(k[1]) in moving}
    assert exported.shards == (2, 3, 7)
    assert exported.keys == len(moved)
    assert exported.bytes == sum(
        Path(f).stat().st_size for fs in exported.files.values() for f in fs
    )
    assert set(exported.files) == {table for table, _ in moved}
    assert read_all(source) == source_all  # export changes nothing

    target.import_files(exported.files)
    source.drop_shards(moving)
    assert read_all(target) == target_own | moved
    assert read_all(source) == {k: v for k, v in source_all.items() if k not in moved}
    # Metadata is not shard data: it stays where it was.
    assert (target.get_step(), target.get_layout()) == (0, b"target-layout")
    assert (source.get_step(), source.get_layout()) == (9, b"source-layout")

    # Durable through commit.
    source.commit()
    target.commit()
    for store, expected in (
        (source_store, {k: v for k, v in source_all.items() if k not in moved}),
        (target_store, target_own | moved),
    ):
        db = store.open(1)
        assert read_all(db) == expected
        db.close()


def test_import_with_move_and_into_new_tables(store_factory: StoreFactory, tmp_path: Path) -> None:
    source, target = store_factory().open(0), store_factory().open(0)
    written = _fill(source, range(0, 3), b"S")
    exported = source.export_shards(range(0, 3), tmp_path / "x")
    assert target.tables() == []
    target.import_files(exported.files, move=True)
    assert target.tables() == sorted(TABLES)
    assert read_all(target) == written
    source.close()
    target.close()


def test_exported_keys_catch_an_older_copy_up_with_puts_and_deletions(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    """A hot rescale's copy: the shards as they were, then the changed keys as they are now
    (changed, new, deleted), ingested after it, give exactly the shards now."""
    source, target = store_factory().open(0), store_factory().open(0)
    before = _fill(source, range(0, 4), b"S")
    moving = {1, 2}
    copy = source.export_shards(moving, tmp_path / "copy")
    (changed_key, deleted_key) = sorted(k for k in before if shard_of(k[1]) == 1)[:2]
    new_key = ("timers", shard_key(2, b"new"))
    source.put(changed_key[0], changed_key[1], b"changed")
    source.delete(deleted_key[0], deleted_key[1])
    source.put(new_key[0], new_key[1], b"new")
    unknown = ("nowhere", shard_key(1, b"never-written"))
    touched = [changed_key, deleted_key, new_key, unknown]
    keys: dict[str, list[bytes]] = {}
    for table, key in touched:
        keys.setdefault(table, []).append(key)
    delta = source.export_keys(keys, tmp_path / "delta")
    assert delta.keys == len(touched) and delta.shards == ()
    assert read_all(source)[changed_key] == b"changed"  # export changes nothing

    target.import_files(copy.files)
    target.import_files(delta.files)
    now = {k: v for k, v in read_all(source).items() if shard_of(k[1]) in moving}
    assert read_all(target) == now
    assert deleted_key not in now and now[new_key] == b"new"
    source.close()
    target.close()


def test_export_of_absent_shards_writes_nothing(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    db = store_factory().open(0)
    _fill(db, range(0, 3), b"S")
    exported = db.export_shards([50, 51], tmp_path / "none")
    assert (exported.files, exported.keys, exported.bytes) == ({}, 0, 0)
    db.drop_shards([50])
    assert len(read_all(db)) > 0
    db.close()


@settings(max_examples=15, deadline=None)
@given(
    keys=st.lists(
        st.tuples(st.sampled_from(TABLES), st.integers(0, 7), st.binary(max_size=4)),
        max_size=40,
    ),
    moving=st.sets(st.integers(0, 7)),
)
def test_export_import_drop_partition_the_keys(
    keys: list[tuple[str, int, bytes]], moving: set[int]
) -> None:
    root = Path(tempfile.mkdtemp(prefix="sparkstep-shards-"))
    try:
        with RocksDBStore(root / "a") as a, RocksDBStore(root / "b") as b:
            src, dst = a.open(0), b.open(0)
            everything: Contents = {}
            for table, shard, suffix in keys:
                src.put(table, shard_key(shard, suffix), suffix)
                everything[(table, shard_key(shard, suffix))] = suffix
            exported = src.export_shards(moving, root / "export")
            dst.import_files(exported.files)
            src.drop_shards(moving)
            inside = {k: v for k, v in everything.items() if shard_of(k[1]) in moving}
            assert read_all(dst) == inside
            assert read_all(src) == {k: v for k, v in everything.items() if k not in inside}
            src.close()
            dst.close()
    finally:
        shutil.rmtree(root)
