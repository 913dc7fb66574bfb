"""The worker's state format record and the vectorised state digest, on real rocksdict stores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from sparkstep.runtime.errors import StateFormatError
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.worker import StateWorker
from sparkstep.runtime.worker.digest import MASK, entry_hash, format_digest
from sparkstep.runtime.worker.service import MARKER_TABLE, STATE_FORMAT, state_table
from sparkstep.storage import RocksDBStore
from sparkstep.storage.keys import SHARD_PREFIX_BYTES, shard_prefix

S = 8
SCHEMA = pa.schema([("k", pa.int64()), ("x", pa.int64())])
SPEC = OperatorSpec.aggregate("agg", SCHEMA, ["k"], [Agg("count", None, "n"), Agg("sum", "x", "s")])


def rows(keys: list[int], xs: list[int], weights: list[int] | None = None) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "x": pa.array(xs, pa.int64()),
            "__weight": pa.array(weights or [1] * len(keys), pa.int64()),
            "__shard": pa.array([k % S for k in keys], pa.int64()),
        }
    )


def worker(path: Path) -> StateWorker:
    w = StateWorker(RocksDBStore(path), shards=S)
    w.configure([SPEC], S)
    return w


def test_a_store_without_a_format_record_but_with_state_is_refused(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "old")
    db = store.open(0)
    # What a format-1 worker left: state, a marker, a step; no format record.
    db.put(state_table("agg"), shard_prefix(1) + b"key", b"blob")
    db.put(MARKER_TABLE, b"\xff" * SHARD_PREFIX_BYTES + b"agg/0", b"{}\n")
    db.set_step(3)
    db.commit()
    store.close()
    w = worker(tmp_path / "old")
    with pytest.raises(StateFormatError) as err:
        w.open(1)
    message = str(err.value)
    assert "\n" not in message and "format 1" in message and "new --state-dir" in message
    with pytest.raises(StateFormatError):  # refused every time, nothing was written
        w.open(1)
    w.close()


def _record_format(path: Path, state_format: int) -> None:
    """Make the store at ``path`` (committed at version 1) say it holds ``state_format``."""
    store = RocksDBStore(path)
    db = store.open(1)
    key = b"\xff" * SHARD_PREFIX_BYTES + b"\x00state-format"
    assert json.loads(db.get(MARKER_TABLE, key) or b"")["state_format"] == STATE_FORMAT
    db.put(MARKER_TABLE, key, json.dumps({"state_format": state_format}).encode())
    db.commit()
    store.close()


@pytest.mark.parametrize("older", [STATE_FORMAT - 1, STATE_FORMAT - 2])
def test_a_store_of_another_recorded_format_is_refused(older: int, tmp_path: Path) -> None:
    """Format 5 kept a key's min/max multiset whole in one entry, where format 6 keeps chunks
    beside the record (operators/aggregate.py): a format 5 store is refused, not misread."""
    assert STATE_FORMAT == 6
    w = worker(tmp_path / "s")
    w.open(0)
    w.commit(1)
    w.close()
    _record_format(tmp_path / "s", older)
    w = worker(tmp_path / "s")
    with pytest.raises(StateFormatError, match=f"holds worker state format {older}"):
        w.open(2)
    with pytest.raises(StateFormatError, match="reads format 6 only"):
        w.open(2)
    w.close()


def _digest_of_dump(w: StateWorker) -> str:
    total = 0
    for key, value in w.dump("agg").items():
        if len(key) > SHARD_PREFIX_BYTES:
            total += entry_hash(key, value)
    return format_digest(total & MASK)


def test_digest_is_the_sum_of_entry_hashes_whatever_the_batching(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 50, 400).tolist()
    xs = rng.integers(-9, 9, 400).tolist()
    one = worker(tmp_path / "one")
    inc = one.open(0)
    whole = one.apply(inc, 0, "agg", "d", rows(keys, xs)).state_digest
    many = worker(tmp_path / "many")
    inc = many.open(0)
    # The same rows in other batches, with an insert and its retraction in between.
    many.apply(inc, 0, "agg", "d", rows([*keys[:150], 7], [*xs[:150], 1000]))
    many.apply(inc, 1, "agg", "d", rows([7], [1000], [-1]))
    last = many.apply(inc, 2, "agg", "d", rows(keys[150:], xs[150:])).state_digest
    assert whole == last == _digest_of_dump(one) == _digest_of_dump(many)
    assert one.status()["state_digest"] == whole
    # Retracting everything empties the state and its digest.
    emptied = one.apply(inc_of(one), 1, "agg", "d", rows(keys, xs, [-1] * len(keys)))
    assert emptied.state_digest == format_digest(0)
    one.close()
    many.close()


def inc_of(w: StateWorker) -> str:
    incarnation = w.status()["incarnation"]
    assert isinstance(incarnation, str)
    return incarnation
