"""rocksdict is real and durable: data written, closed and reopened from disk is still there."""

from __future__ import annotations

from pathlib import Path

from rocksdict import Rdict


def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    db = Rdict(path)
    for i in range(1000):
        db[f"key-{i:04d}".encode()] = f"value-{i}".encode()
    del db[b"key-0500"]
    db.close()

    reopened = Rdict(path)
    try:
        assert reopened[b"key-0000"] == b"value-0"
        assert reopened[b"key-0999"] == b"value-999"
        assert reopened.get(b"key-0500") is None
        assert len(list(reopened.keys())) == 999
    finally:
        reopened.close()
    assert any(p.suffix == ".sst" or p.name.endswith(".log") for p in Path(path).iterdir())
