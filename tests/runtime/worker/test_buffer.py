"""The worker's write buffer, on real rocksdict stores: what reads see, when it reaches RocksDB,
and that a buffered worker's state, deltas and digests are a write-through worker's."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from sparkstep.runtime.errors import StaleStepError
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.worker import StateWorker
from sparkstep.runtime.worker.buffer import ENTRY_OVERHEAD, Write, WriteBuffer, key_order
from sparkstep.runtime.worker.service import MARKER_TABLE, STATE_FORMAT_KEY, state_table
from sparkstep.storage import RocksDBStore
from sparkstep.storage.base import Database
from sparkstep.storage.keys import shard_prefix

S = 8
SCHEMA = pa.schema([("k", pa.int64()), ("x", pa.int64())])
AGG = OperatorSpec.aggregate(
    "agg", SCHEMA, ["k"], [Agg("count", None, "n"), Agg("sum", "x", "s"), Agg("min", "x", "lo")]
)
DISTINCT = OperatorSpec.distinct("dist", SCHEMA)


def _entries(table: str, changes: dict[bytes, bytes | None]) -> Write:
    """A ``WriteBuffer.write`` part from a mapping."""
    return Write(table, list(changes), list(changes.values()))


def batch(rng: np.random.Generator, n: int, keys: int = 50) -> pa.Table:
    k = rng.integers(0, keys, n)
    return pa.table(
        {
            "k": pa.array(k, pa.int64()),
            "x": pa.array(rng.integers(-5, 5, n), pa.int64()),
            "__weight": pa.array(rng.choice([1, 1, 1, -1], n), pa.int64()),
            "__shard": pa.array(k % S, pa.int64()),
        }
    )


def worker(path: Path, buffer_bytes: int) -> StateWorker:
    w = StateWorker(RocksDBStore(path), shards=S, buffer_bytes=buffer_bytes)
    w.configure([AGG, DISTINCT], S)
    return w


class _WriteFailsOnce:
    """A real database whose second ``write_sorted`` raises (fault injection: the first table
    of a flush is written, the next is not); all else is the real one."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.calls = 0

    def write_sorted(self, table: str, keys: list[bytes], values: list[bytes | None]) -> None:
        self.calls += 1
        if self.calls == 2:
            raise OSError("injected: disk full")
        self.db.write_sorted(table, keys, values)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


class _CountingReads:
    """A real database that counts the keys read from it (a spy: every call is the real
    one's)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.keys_read = 0

    def get_many(
        self, table: str, keys: Sequence[bytes], *, ascending: bool = False
    ) -> list[bytes | None]:
        self.keys_read += len(keys)
        return self.db.get_many(table, keys, ascending=ascending)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def _exchange(source: StateWorker, target: StateWorker, shards: list[int], name: str) -> None:
    """Move ``shards`` from ``source`` to ``target`` as a rescale does: export, copy, import."""
    answer = source.export_shards(shards, name)
    into = target.import_dir(name)
    for entries in answer["files"].values():
        for entry in entries:
            shutil.copy(source.export_file(name, entry["file"]), into / entry["file"])
    target.import_files(
        name, {table: [e["file"] for e in entries] for table, entries in answer["files"].items()}
    )


def test_reads_through_the_buffer_see_its_writes_and_deletions(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    db.put("t", b"a", b"db-a")
    db.put("t", b"b", b"db-b")
    buffer = WriteBuffer(db, limit_bytes=1 << 20)
    buffer.write(
        [_entries("t", {b"a": b"new-a", b"b": None, b"c": b"new-c"}), _entries("u", {b"a": b"u"})]
    )
    assert buffer.get_many("t", [b"a", b"b", b"c", b"d"]) == [b"new-a", None, b"new-c", None]
    assert [buffer.get("t", k) for k in (b"a", b"b", b"c")] == [b"new-a", None, b"new-c"]
    assert buffer.get_many("v", [b"a"]) == [None]
    # Nothing reached RocksDB: it still holds what it held.
    assert db.get_many("t", [b"a", b"b", b"c"]) == [b"db-a", b"db-b", None]
    assert len(buffer) == 4
    buffer.flush()
    assert len(buffer) == 0 and buffer.size == 0
    assert db.get_many("t", [b"a", b"b", b"c"]) == [b"new-a", None, b"new-c"]
    assert db.get("u", b"a") == b"u"
    db.close()
    store.close()


def test_flushed_entries_stay_a_read_cache_that_a_commit_can_hand_on(tmp_path: Path) -> None:
    """After a flush the buffer answers for what it wrote (values and deletions) without the
    database; its cache, given to a buffer over the version the commit made, does the same
    there; a forgotten cache reads the database again."""
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    db.put("t", b"gone", b"old")
    buffer = WriteBuffer(db, limit_bytes=1 << 20)
    buffer.write([_entries("t", {b"a": b"1", b"gone": None}), _entries("u", {b"a": b"u"})])
    with pytest.raises(ValueError, match="unflushed"):
        buffer.cache()
    buffer.flush()
    assert len(buffer) == 0 and buffer.cached_bytes > 0
    spy = _CountingReads(db)
    buffer.db = spy  # type: ignore[assignment]
    assert buffer.get_many("t", [b"a", b"gone"]) == [b"1", None]
    assert spy.keys_read == 0
    assert buffer.get_many("t", [b"a", b"never"]) == [b"1", None]
    assert spy.keys_read == 1  # only the key the buffer never wrote
    cache = buffer.cache()
    db.commit()
    db = store.open(1)
    spy = _CountingReads(db)
    reopened = WriteBuffer(spy, limit_bytes=1 << 20, cache=cache)  # type: ignore[arg-type]
    assert reopened.get_many("t", [b"a", b"gone"]) == [b"1", None]
    assert reopened.get_many("u", [b"a"]) == [b"u"]
    assert spy.keys_read == 0
    reopened.forget_cache()
    assert reopened.cached_bytes == 0
    assert reopened.get_many("t", [b"a", b"gone"]) == [b"1", None]
    assert spy.keys_read == 2
    db.close()
    store.close()


def test_a_failed_flush_keeps_every_entry_and_the_next_one_writes_them(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    faulty = _WriteFailsOnce(db)
    buffer = WriteBuffer(faulty, limit_bytes=1 << 20)  # type: ignore[arg-type]
    buffer.write(
        [
            _entries("t", {b"a": b"1"}),
            _entries("t", {b"b": b"2", b"a": b"3"}),
            _entries("u", {b"c": b"4"}),
        ]
    )
    with pytest.raises(OSError, match="injected"):
        buffer.flush()
    assert buffer.get_many("t", [b"a", b"b"]) == [b"3", b"2"]
    assert buffer.get_many("u", [b"c"]) == [b"4"]
    assert db.get_many("u", [b"c"]) == [None]  # the table after the failure: not written
    buffer.flush()
    assert len(buffer) == 0
    assert db.get_many("t", [b"a", b"b"]) == [b"3", b"2"]
    assert db.get_many("u", [b"c"]) == [b"4"]
    db.close()
    store.close()


def test_the_buffer_flushes_once_its_size_passes_the_limit(tmp_path: Path) -> None:
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    entry = ENTRY_OVERHEAD + 2 + 2  # a new 2-byte key with a 2-byte value
    buffer = WriteBuffer(db, limit_bytes=3 * entry)
    buffer.write([_entries("t", {b"k1": b"v1", b"k2": b"v2", b"k3": b"v3"})])
    assert buffer.size == 3 * entry and db.get("t", b"k1") is None  # at the limit: kept
    buffer.write(
        [_entries("t", {b"k1": b"w1"})]
    )  # a rewrite counts its bytes again: past the limit
    assert buffer.size == 0 and len(buffer) == 0
    assert buffer.cached_bytes == entry  # half the limit holds 1 of the 3 entries: cut to it
    assert db.get_many("t", [b"k1", b"k2", b"k3"]) == [b"w1", b"v2", b"v3"]
    through = WriteBuffer(db, limit_bytes=0)
    through.write([_entries("t", {b"k4": b"v4"})])
    assert db.get("t", b"k4") == b"v4" and len(through) == 0 and through.cached_bytes == 0
    # The cache counts towards the limit and keeps at most half of it: the largest table is
    # cut to what fits beside the others, or dropped.
    cached = WriteBuffer(db, limit_bytes=8 * entry)
    cached.write([_entries("t", {b"k1": b"x1", b"k2": b"x2", b"k3": b"x3"})])
    cached.flush()
    assert cached.cached_bytes == 3 * entry
    cached.write([_entries("u", {b"k1": b"y1", b"k2": b"y2"})])
    cached.flush()
    assert cached.cached_bytes == 4 * entry  # t cut to 2 entries beside u's 2
    cached.write([_entries("v", {b"k%d" % i: b"z%d" % i for i in range(1, 5)})])
    assert cached.size == 4 * entry  # with the 4 cached, at the limit: kept
    cached.write([_entries("v", {b"k5": b"z5"})])
    assert cached.size == 0  # past it: flushed, and v's 5 entries, the largest, dropped
    assert cached.cached_bytes == 4 * entry
    assert db.get_many("t", [b"k1"]) == [b"x1"] and db.get_many("v", [b"k5"]) == [b"z5"]
    db.close()
    store.close()


def test_a_cache_past_its_bound_keeps_the_part_that_fits(tmp_path: Path) -> None:
    """A flush of more than half the limit keeps as its cache the entries of its lowest
    hashes that fit in that half: reads of those touch no database, the others read it, and
    every read answers what the database holds."""
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    entry = ENTRY_OVERHEAD + 4 + 4
    buffer = WriteBuffer(db, limit_bytes=100 * entry)
    entries: dict[bytes, bytes | None] = {b"k%03d" % i: b"v%03d" % i for i in range(80)}
    buffer.write([_entries("t", entries)])
    buffer.flush()
    assert buffer.cached_bytes == 50 * entry
    spy = _CountingReads(db)
    buffer.db = spy  # type: ignore[assignment]
    assert buffer.get_many("t", list(entries)) == list(entries.values())
    assert spy.keys_read == 30
    db.close()
    store.close()


def test_a_merge_drops_dead_copies_that_hold_most_of_the_bytes(tmp_path: Path) -> None:
    """A few large values rewritten (a hot key's join rows or min/max multiset) are dropped by
    the merge that finds them most of the run's bytes, as many small ones are by the merge that
    finds them most of its entries."""
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    buffer = WriteBuffer(db, limit_bytes=1 << 30)
    buffer.write([_entries("t", {b"big": b"x" * 1000, b"s": b"v"})])
    buffer.write([_entries("t", {b"big": b"y" * 10})])  # merged: 1 dead entry of 3, 1003 bytes
    assert buffer.size == 2 * ENTRY_OVERHEAD + len(b"big") + 10 + len(b"sv")
    assert buffer.get_many("t", [b"big", b"s"]) == [b"y" * 10, b"v"]
    buffer.write([_entries("t", {b"s": b"w"})])  # 1 dead entry of 3, 2 bytes: kept
    assert buffer.size == 2 * ENTRY_OVERHEAD + len(b"big") + 10 + 2 * len(b"sv")
    db.close()
    store.close()


def test_a_buffered_worker_answers_and_commits_what_a_write_through_one_does(
    tmp_path: Path,
) -> None:
    """Same batches into a worker that buffers everything until its commit and one that writes
    every apply through: the same deltas and digests at every step, the same committed state.
    The buffered one's RocksDB holds none of a step's state before the commit."""
    rng = np.random.default_rng(7)
    steps = [(batch(rng, 300), batch(rng, 300)) for _ in range(6)]
    buffered, through = worker(tmp_path / "b", 1 << 30), worker(tmp_path / "t", 0)
    incs = [buffered.open(0), through.open(0)]
    for step, (a, d) in enumerate(steps):
        answers = [
            (w.apply(inc, step, "agg", "d", a), w.apply(inc, step, "dist", "d", d))
            for w, inc in zip((buffered, through), incs, strict=True)
        ]
        (agg_b, dist_b), (agg_t, dist_t) = answers
        assert agg_b.delta.equals(agg_t.delta) and dist_b.delta.equals(dist_t.delta)
        assert agg_b.state_digest == agg_t.state_digest
        assert dist_b.state_digest == dist_t.state_digest
        # A re-run task gets the recorded delta from the buffer.
        rerun = buffered.apply(incs[0], step, "agg", "d", a)
        assert rerun.replayed and rerun.delta.equals(answers[0][0].delta)
    assert buffered.status()["state_digest"] == through.status()["state_digest"]
    held = buffered._require_buffer()
    assert len(held) > 0
    prefixes = [shard_prefix(s) for s in range(S)]
    assert set(held.db.get_many(state_table("agg"), prefixes)) == {None}
    for w in (buffered, through):
        w.commit(len(steps))
        w.open(1)
    assert buffered.dump("agg") == through.dump("agg")
    assert buffered.dump("dist") == through.dump("dist")
    assert buffered.status()["state_digest"] == through.status()["state_digest"]
    for w in (buffered, through):
        w.close()


def test_a_drop_after_buffered_applies_drops_what_the_buffer_held(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    w = worker(tmp_path / "b", 1 << 30)
    inc = w.open(0)
    w.apply(inc, 0, "agg", "d", batch(rng, 400))
    w.drop_shards([1, 2])
    w.apply(inc, 1, "agg", "d", batch(rng, 400).filter(pc.field("__shard") > 2))
    w.commit(2)
    w.open(1)
    shards = {key[:4] for key in w.dump("agg")}
    assert shards and not shards & {shard_prefix(1), shard_prefix(2)}
    w.close()


def test_a_commit_keeps_its_cache_for_the_version_it_made_and_nothing_else(
    tmp_path: Path,
) -> None:
    """A buffered worker and a write-through one (no cache) get the same steps, with commits
    and reopens between. Reopened at the version its commit made, the buffered worker reads
    the committed keys from its cache, not RocksDB; reopened at an older version, or after a
    shard drop, it reads RocksDB again: every delta and digest stays the write-through
    worker's."""
    rng = np.random.default_rng(11)
    steps = [batch(rng, 300) for _ in range(3)]
    buffered, through = worker(tmp_path / "b", 1 << 30), worker(tmp_path / "t", 0)
    pair = (buffered, through)

    def reopen(version: int) -> list[str]:
        return [w.open(version) for w in pair]

    def apply(incs: list[str], step: int, rows: pa.Table) -> None:
        answers = [w.apply(inc, step, "agg", "d", rows) for w, inc in zip(pair, incs, strict=True)]
        assert not answers[0].replayed and not answers[1].replayed
        assert answers[0].delta.equals(answers[1].delta)
        assert answers[0].state_digest == answers[1].state_digest

    apply(reopen(0), 0, steps[0])
    for w in pair:
        w.commit(1)
    incs = reopen(1)
    spy = _CountingReads(buffered._require_buffer().db)
    buffered._require_buffer().db = spy  # type: ignore[assignment]
    apply(incs, 1, steps[1])
    assert spy.keys_read == 0  # every key of the step, its marker and digests: cached
    for w in pair:
        w.commit(2)
    # Version 1 again: the cache of version 2 must not answer for it.
    apply(reopen(1), 1, steps[1])
    for w in pair:
        w.commit(2)
    incs = reopen(2)
    for w in pair:
        w.drop_shards([1, 2])
    apply(incs, 2, steps[2])
    for w in pair:
        w.commit(3)
    reopen(3)
    assert buffered.dump("agg") == through.dump("agg")
    assert buffered.status()["state_digest"] == through.status()["state_digest"]
    for w in pair:
        w.close()


def test_a_rerun_after_a_failed_flush_gets_the_delta_of_the_apply_it_repeats(
    tmp_path: Path,
) -> None:
    """Every apply's write passes a 1-byte bound, so it flushes; the second flush fails
    (injected) after that apply's changes were buffered. The apply fails, but its marker is
    set with its changes, so the re-run task gets the recorded delta and the state is applied
    once: the next step's delta and every digest equal a worker's that never failed."""
    rng = np.random.default_rng(12)
    steps = [batch(rng, 300) for _ in range(3)]
    failing, plain = worker(tmp_path / "f", 1), worker(tmp_path / "p", 1 << 30)
    incs = [failing.open(0), plain.open(0)]
    buffer = failing._require_buffer()
    buffer.db = _WriteFailsOnce(buffer.db)  # type: ignore[assignment]
    for w, inc in zip((failing, plain), incs, strict=True):
        w.apply(inc, 0, "agg", "d0", steps[0])
    with pytest.raises(OSError, match="injected"):
        failing.apply(incs[0], 1, "agg", "d1", steps[1])
    rerun = failing.apply(incs[0], 1, "agg", "d1", steps[1])
    first = plain.apply(incs[1], 1, "agg", "d1", steps[1])
    assert rerun.replayed and rerun.delta.equals(first.delta)
    assert rerun.state_digest == first.state_digest
    pair = zip((failing, plain), incs, strict=True)
    after = [w.apply(inc, 2, "agg", "d2", steps[2]) for w, inc in pair]
    assert not after[0].replayed and after[0].delta.equals(after[1].delta)
    assert failing.status()["state_digest"] == plain.status()["state_digest"]
    for w in (failing, plain):
        w.close()


def test_a_marker_lives_as_long_as_its_session_and_never_reaches_the_store(
    tmp_path: Path,
) -> None:
    """A re-run within the session gets the recorded delta; after the commit and a reopen of
    the version it made, the same step is stale (it is below the store's step) and the store
    holds no marker: table ``markers`` has the format record only."""
    rng = np.random.default_rng(13)
    rows = batch(rng, 300)
    w = worker(tmp_path / "m", 1 << 30)
    inc = w.open(0)
    first = w.apply(inc, 0, "agg", "d0", rows)
    again = w.apply(inc, 0, "agg", "d0", rows)
    assert again.replayed and again.delta.equals(first.delta)
    w.commit(1)
    inc = w.open(1)
    with pytest.raises(StaleStepError, match="already committed"):
        w.apply(inc, 0, "agg", "d0", rows)
    assert [key for key, _ in w._flushed_db().items(MARKER_TABLE)] == [STATE_FORMAT_KEY]
    w.close()


def test_a_reopen_discards_buffered_applies(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    w = worker(tmp_path / "b", 1 << 30)
    inc = w.open(0)
    first = w.apply(inc, 0, "agg", "d", batch(rng, 100))
    inc = w.open(0)
    assert w.dump("agg") == {}
    again = w.apply(inc, 0, "agg", "d", batch(np.random.default_rng(9), 100))
    assert not again.replayed and again.state_digest == first.state_digest
    w.close()


def _weak_hash(values: pa.Array) -> np.ndarray:
    """A fault: a hash with four values, so most keys of a run collide."""
    return (pc.binary_length(values).to_numpy(zero_copy_only=False) % 4).astype(np.uint64)


@pytest.mark.parametrize("limit", [1 << 30, 3000], ids=["large", "small"])
@pytest.mark.parametrize("collisions", [False, True], ids=["hash", "colliding hash"])
def test_the_buffer_reads_what_a_dict_over_the_database_reads(
    tmp_path: Path, collisions: bool, limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model test: random writes (rewrites, deletions, repeated keys within one write, runs
    merged and not), reads after each, a flush at the end; the buffer's answers are those of a
    dict laid over the database's entries. With ``collisions`` the key hash is faulty (four
    values), so every lookup and merge goes through the collision paths. With a small
    ``limit``, and a flush now and then, reads also go through the read cache, unflushed runs
    over it, and a cache trimmed to half the limit."""
    if collisions:
        monkeypatch.setattr("sparkstep.runtime.worker.buffer.hash_bytes", _weak_hash)
    rng = np.random.default_rng(7)
    store = RocksDBStore(tmp_path / "s")
    db = store.open(0)
    domain = [b"k%d" % i for i in range(60)] + [b"", b"\x00", b"k1\x00"]
    stored = {k: b"db-" + k for k in domain[::3]}
    for key, value in stored.items():
        db.put("t", key, value)
    model: dict[bytes, bytes | None] = dict(stored)
    buffer = WriteBuffer(db, limit_bytes=limit)
    cached = 0
    for _ in range(40):
        if rng.random() < 0.2:
            buffer.flush()
        triples = []
        for _ in range(int(rng.integers(1, 3))):
            picked = [domain[i] for i in rng.integers(0, len(domain), int(rng.integers(0, 25)))]
            values = [None if rng.random() < 0.25 else b"v%d" % rng.integers(1000) for _ in picked]
            triples.append(Write("t", picked, values))
            model.update(zip(picked, values, strict=True))
        buffer.write(triples)
        expected = [model.get(k) for k in domain]
        assert buffer.get_many("t", domain) == expected
        assert buffer.get_array("t", pa.array(domain[::-1])).to_pylist() == expected[::-1]
        assert buffer.cached_bytes <= limit // 2
        cached += buffer.cached_bytes > 0 and buffer.size > 0
    assert len(buffer._runs["t"]) <= 7  # merged: O(log entries) runs
    assert cached > 5  # reads went through unflushed runs and the cache together
    buffer.flush()
    assert db.get_many("t", domain) == [model.get(k) for k in domain]
    db.close()
    store.close()


@pytest.mark.parametrize(
    "lengths",
    [[12], [1], [8], [9], [19], [32], [33], [0, 3, 8, 12, 40]],
    ids=["12", "1", "8", "9", "19", "32", "33 (Arrow)", "mixed (Arrow)"],
)
def test_key_order_sorts_bytewise(lengths: list[int]) -> None:
    """Keys of one length sorted as words, others by Arrow: each the order of Python's bytes,
    with keys that share words (the shard prefix), zero bytes, 0xff bytes and duplicates."""
    rng = np.random.default_rng(len(lengths) * 100 + lengths[0])
    keys = []
    for i in range(3000):
        length = lengths[i % len(lengths)]
        common = b"\x00\x00\x00\x07[\x01\x00"[:length]  # shared by many keys
        tail = bytes(rng.choice([0, 1, 0x7F, 0x80, 0xFF], max(length - len(common), 0)))
        keys.append(common + tail if i % 2 else bytes(rng.integers(0, 256, length).tolist()))
    keys += keys[:50]  # duplicates: ties keep the input order
    order = key_order(pa.array(keys, pa.large_binary()))
    assert [keys[i] for i in order] == sorted(keys)
    assert order.tolist() == sorted(range(len(keys)), key=lambda i: (keys[i], i))
