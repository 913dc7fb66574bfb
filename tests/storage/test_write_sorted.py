"""``Database.write_sorted`` on real rocksdict stores: the batch path and the SST-ingest path
give the state a write batch gives, the ingested files survive commit, and nothing is left in
``load/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkstep.storage import RocksDBStore
from sparkstep.storage import database as database_module
from sparkstep.storage.errors import StorageError
from sparkstep.storage.keys import shard_key
from sparkstep.storage.layout import LOAD_DIR

KEYS = sorted(shard_key(s, b"k%d" % i) for s in range(3) for i in range(30))


def _values(round_: int) -> list[bytes | None]:
    """Puts and deletions that differ from round to round (so later rounds overwrite)."""
    return [None if (i + round_) % 5 == 0 else b"v%d-%d" % (round_, i) for i in range(len(KEYS))]


@pytest.mark.parametrize("ingest", [False, True], ids=["batch", "ingested SST"])
def test_write_sorted_gives_what_a_batch_gives(
    tmp_path: Path, ingest: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "INGEST_MIN_ENTRIES", 1 if ingest else 10**9)
    sorted_store = RocksDBStore(tmp_path / "sorted")
    batch_store = RocksDBStore(tmp_path / "batch")
    for round_ in range(3):
        db, reference = sorted_store.open(round_), batch_store.open(round_)
        if round_ == 1:  # a range tombstone and a memtable entry under the ingested keys
            for d in (db, reference):
                d.put("t", KEYS[3], b"memtable")
                wb = d.batch()
                wb.delete_range("t", KEYS[10], KEYS[20])
                d.write(wb)
        values = _values(round_)
        db.write_sorted("t", KEYS, values)
        wb = reference.batch()
        for key, value in zip(KEYS, values, strict=True):
            if value is None:
                wb.delete("t", key)
            else:
                wb.put("t", key, value)
        reference.write(wb)
        assert list(db.items("t")) == list(reference.items("t"))
        db.commit()
        reference.commit()
        assert not any((tmp_path / "sorted" / LOAD_DIR).glob("*"))
    db, reference = sorted_store.open(3), batch_store.open(3)
    assert list(db.items("t")) == list(reference.items("t"))
    assert db.get_many("t", KEYS) == [v for v in _values(2)]
    db.close()
    reference.close()
    sorted_store.close()
    batch_store.close()


def test_an_unsorted_large_write_is_refused_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "INGEST_MIN_ENTRIES", 1)
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    with pytest.raises(StorageError):
        db.write_sorted("t", [KEYS[1], KEYS[0]], [b"a", b"b"])
    assert db.get_many("t", KEYS[:2]) == [None, None]
    assert not any((tmp_path / "s" / LOAD_DIR).glob("*"))
    db.close()
    store.close()


def test_open_removes_what_a_crash_left_in_load(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "s")
    store.open(0).close()
    load = tmp_path / "s" / LOAD_DIR
    load.mkdir(exist_ok=True)
    (load / "export-leftover-0000.sst").write_bytes(b"half a file")
    store.open(0).close()
    assert not load.exists()
    store.close()
