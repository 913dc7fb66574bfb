"""``Database.write_sorted`` on real rocksdict stores: the batch path and the SST-ingest path
give the state a write batch gives, the ingested files survive commit, and nothing is left in
``load/``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from sparkstep.storage import RocksDBStore
from sparkstep.storage import database as database_module
from sparkstep.storage.errors import StorageError
from sparkstep.storage.keys import shard_key
from sparkstep.storage.layout import LOAD_DIR
from sparkstep.storage.options import RocksDBOptions

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


def _filtered_entries(db: Any, table: str) -> int:
    """How many entries the table's files hold in bloom filters (RocksDB's aggregated table
    properties; the database's column family handle, read-only)."""
    props = db._families[table][0].property_value("rocksdb.aggregated-table-properties")
    found = re.search(r"# entries for filter=(\d+)", props)
    assert found is not None, props
    return int(found.group(1))


@pytest.mark.parametrize("bits", [10, 0], ids=["default", "off"])
def test_table_files_carry_a_bloom_filter_unless_turned_off(
    tmp_path: Path, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways into a file (a memtable flushed at commit, an SST file written and ingested)
    give it a filter of every key with the default options, and none with 0 bits."""
    monkeypatch.setattr(database_module, "INGEST_MIN_ENTRIES", 50)
    store = RocksDBStore(tmp_path / "s", options=RocksDBOptions(bloom_bits_per_key=bits))
    db = store.open(0)
    db.write_sorted("small", KEYS[:40], [b"v"] * 40)  # a batch: a memtable, flushed at commit
    db.write_sorted("large", KEYS, [b"v"] * len(KEYS))  # an ingested file
    db.commit()
    db = store.open(1)
    assert _filtered_entries(db, "small") == (40 if bits else 0)
    assert _filtered_entries(db, "large") == (len(KEYS) if bits else 0)
    db.close()
    store.close()
