"""The store marker on real disk: sparkstep recognises the directories it made as stores, and
never writes into or deletes a directory it did not make."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkstep.storage import NotAStoreError, RocksDBStore, is_store, shard_key
from tests.storage.fixtures import StoreFactory

MARKER = "SPARKSTEP_STORE"
MARKER_TEXT = b"sparkstep store: this directory and everything in it belong to sparkstep\n"
K1 = shard_key(1, b"k")


def _user_directory(tmp_path: Path) -> Path:
    """A directory of a user's own files, one of them named like a store's file."""
    user = tmp_path / "photos"
    (user / "2024").mkdir(parents=True)
    (user / "2024" / "beach.jpg").write_bytes(b"\xff\xd8 a picture")
    (user / "notes.txt").write_text("keep me\n")
    (user / "VERSION").write_text("1.2.3\n")
    return user


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, ``None`` for a directory."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def test_a_new_store_holds_the_marker(store_factory: StoreFactory, tmp_path: Path) -> None:
    opened = store_factory(tmp_path / "opened")
    created = RocksDBStore.create(tmp_path / "created", version=7)
    created.close()
    for store_dir in (opened.path, tmp_path / "created"):
        assert (store_dir / MARKER).read_bytes() == MARKER_TEXT
        assert is_store(store_dir)
    opened.close()
    assert is_store(opened.path)


def test_a_user_directory_is_not_a_store_and_is_never_touched(tmp_path: Path) -> None:
    user = _user_directory(tmp_path)
    before = _snapshot(user)
    assert not is_store(user)
    with pytest.raises(NotAStoreError, match="is not a sparkstep store"):
        RocksDBStore(user)
    with pytest.raises(NotAStoreError):
        RocksDBStore.create(user, version=3)
    with pytest.raises(NotAStoreError):
        RocksDBStore.create(user, version=3, replace=True)
    assert _snapshot(user) == before  # nothing removed, nothing added (not even a lock file)


def test_is_store_is_false_for_everything_sparkstep_did_not_make(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    store = store_factory(tmp_path / "store")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_bytes(MARKER_TEXT)
    link = tmp_path / "link"
    link.symlink_to(store.path)
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "VERSION").write_text('{"format": 1, "versions": [0]}')  # no valid checksum
    creating_only = tmp_path / "creating-only"
    creating_only.mkdir()
    (creating_only / "CREATING").write_text('{"version": 0}')  # no sparkstep.lock next to it
    for path in (tmp_path / "missing", empty, a_file, link, garbled, creating_only):
        assert not is_store(path), path
    assert is_store(store.path)


def test_a_store_made_before_the_marker_is_recognised_and_marked_when_opened(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path, deployment="d")
    db = store.open(0)
    db.put("t", K1, b"a")
    db.commit()
    store.close()
    (store_path / MARKER).unlink()
    assert is_store(store_path)  # by its VERSION file, which passes its checksum
    with RocksDBStore(store_path, deployment="d") as reopened:
        assert (store_path / MARKER).read_bytes() == MARKER_TEXT
        assert reopened.versions() == range(0, 2)
        db = reopened.open(1)
        assert db.get("t", K1) == b"a"
        db.close()


def test_a_half_created_store_made_before_the_marker_is_recognised_and_finished(
    tmp_path: Path,
) -> None:
    half = tmp_path / "half"
    (half / "work").mkdir(parents=True)
    (half / "sparkstep.lock").write_bytes(b"")
    (half / "CREATING").write_text('{"version": 4}')
    assert is_store(half)
    with RocksDBStore(half) as store:
        assert store.versions() == range(4, 5)
    assert (half / MARKER).read_bytes() == MARKER_TEXT
    assert sorted(p.name for p in half.iterdir()) == [
        "SPARKSTEP_STORE",
        "VERSION",
        "sparkstep.lock",
        "versions",
    ]


def test_replace_deletes_a_store_but_keeps_it_marked(
    store_factory: StoreFactory, store_path: Path
) -> None:
    store = store_factory(store_path)
    db = store.open(0)
    db.put("t", K1, b"a")
    db.commit()
    store.close()
    with RocksDBStore.create(store_path, version=9, replace=True) as replaced:
        assert replaced.versions() == range(9, 10)
        assert replaced.open(9).get("t", K1) is None
    assert is_store(store_path)
