"""Benchmark of the two-version store against raw rocksdict, in one run.

    .venv/bin/python -m bench.storage            # stores of 10k and 1M keys
    .venv/bin/python -m bench.storage --big      # also a 10M-key store for commit latency

Measures, each against a baseline measured in the same run:

- batched put rate (``db.batch`` + ``db.write``) and point get rate vs raw rocksdict on the same
  options (column family, raw mode, WAL off: the store's working copy also skips the WAL);
- ``commit()`` latency after 10k changed keys, for stores of 10k and 1M keys (10M with
  ``--big``): it should stay flat as the store grows;
- shard export + import throughput vs a plain range copy (iterate the shards, put into the other
  store in batches);
- ``write_sorted`` of a large sorted set (one SST file ingested) + ``commit()`` vs the same keys
  as one write batch (``Database.write_sorted``'s default) + ``commit()``: what a state
  worker's buffer pays at each checkpoint, with its memtable flush.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import rocksdict

from sparkstep.storage import RocksDBDatabase, RocksDBOptions, RocksDBStore, shard_key
from sparkstep.storage.base import Database

VALUE = b"v" * 100
BATCH = 1000
SHARDS = 64


def _key(i: int) -> bytes:
    return shard_key(i % SHARDS, i.to_bytes(8, "big"))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fill(db: RocksDBDatabase, start: int, count: int, value: bytes = VALUE) -> None:
    batch = db.batch()
    for i in range(start, start + count):
        batch.put("state", _key(i), value)
        if len(batch) >= BATCH:
            db.write(batch)
    if len(batch):
        db.write(batch)


def bench_put_get(root: Path, n: int) -> list[tuple[str, float, float]]:
    keys = [_key(i) for i in range(n)]
    lookups = random.Random(1).sample(keys, min(n, 100_000))

    # Raw rocksdict: same options, one column family, WAL off.
    options = RocksDBOptions().to_options()
    raw = rocksdict.Rdict(str(root / "raw"), options)
    family = raw.create_column_family("t.state", RocksDBOptions().to_options())
    handle = raw.get_column_family_handle("t.state")
    write_options = rocksdict.WriteOptions()
    setattr(write_options, "disable_wal", True)  # noqa: B010 (the stub calls it a method)

    def raw_put() -> None:
        for start in range(0, n, BATCH):
            wb = rocksdict.WriteBatch(raw_mode=True)
            for key in keys[start : start + BATCH]:
                wb.put(key, VALUE, handle)
            raw.write(wb, write_options)

    def raw_get() -> None:
        get = family.get
        for key in lookups:
            get(key)

    store = RocksDBStore(root / "store")
    db = store.open(0)

    def store_put() -> None:
        batch = db.batch()
        for start in range(0, n, BATCH):
            for key in keys[start : start + BATCH]:
                batch.put("state", key, VALUE)
            db.write(batch)

    def store_get() -> None:
        get = db.get
        for key in lookups:
            get("state", key)

    # Interleaved and repeated, best of 3 each: the machine is shared, so a slow moment must
    # not land on one side only.
    raw_put_s = store_put_s = raw_get_s = store_get_s = float("inf")
    for _ in range(3):
        raw_put_s = min(raw_put_s, _timed(raw_put))
        store_put_s = min(store_put_s, _timed(store_put))
        raw_get_s = min(raw_get_s, _timed(raw_get))
        store_get_s = min(store_get_s, _timed(store_get))
    family.close()
    raw.close()
    db.close()
    store.close()
    return [
        ("batched put (keys/s)", n / store_put_s, n / raw_put_s),
        ("point get (keys/s)", len(lookups) / store_get_s, len(lookups) / raw_get_s),
    ]


def bench_commit(root: Path, size: int, changed: int = 10_000, rounds: int = 5) -> float:
    """Median commit() latency (s) after ``changed`` keys changed, in a store of ``size`` keys."""
    store = RocksDBStore(root / f"commit-{size}")
    db = store.open(0)
    _fill(db, 0, size)
    db.commit()
    latencies = []
    rng = random.Random(size)
    for round_ in range(rounds):
        version = store.versions()[-1]
        db = store.open(version)
        start = rng.randrange(max(1, size - changed))
        _fill(db, start, changed, value=b"w%d" % round_ * 30)
        latencies.append(_timed(db.commit))
    store.close()
    return statistics.median(latencies)


def bench_shards(root: Path, n: int, moving: int) -> tuple[float, float, float]:
    """(MB moved, export+import MB/s, range copy MB/s) for ``moving`` of 64 shards."""
    source_store = RocksDBStore(root / "shard-source")
    source = source_store.open(0)
    _fill(source, 0, n)
    shards = range(moving)
    moved_bytes = sum(
        len(k) + len(v)
        for s in shards
        for k, v in source.items("state", start=shard_key(s, b""), end=shard_key(s + 1, b""))
    )
    mb = moved_bytes / 1e6

    def export_import(attempt: int) -> float:
        with RocksDBStore(root / f"shard-target-{attempt}") as target_store:
            target = target_store.open(0)
            start = time.perf_counter()
            exported = source.export_shards(shards, root / f"export-{attempt}")
            target.import_files(exported.files, move=True)
            elapsed = time.perf_counter() - start
            target.close()
        return elapsed

    def range_copy(attempt: int) -> float:
        with RocksDBStore(root / f"shard-copy-{attempt}") as copy_store:
            copy = copy_store.open(0)
            start = time.perf_counter()
            batch = copy.batch()
            for table in source.tables():
                for shard in shards:
                    begin, end = shard_key(shard, b""), shard_key(shard + 1, b"")
                    for key, value in source.items(table, start=begin, end=end):
                        batch.put(table, key, value)
                        if len(batch) >= BATCH:
                            copy.write(batch)
            if len(batch):
                copy.write(batch)
            elapsed = time.perf_counter() - start
            copy.close()
        return elapsed

    # Interleaved, best of 3 (see bench_put_get).
    sst_s = copy_s = float("inf")
    for attempt in range(3):
        sst_s = min(sst_s, export_import(attempt))
        copy_s = min(copy_s, range_copy(attempt))
    source.close()
    source_store.close()
    return mb, mb / sst_s, mb / copy_s


def bench_write_sorted(root: Path, n: int) -> tuple[float, float]:
    """(batch s, ingest s): ``write_sorted`` of ``n`` sorted keys over a store holding them
    already (every key rewritten, as a checkpoint of a hot state does), then ``commit()``;
    interleaved, best of 3."""
    keys = sorted(_key(i) for i in range(n))
    store = RocksDBStore(root / f"sorted-{n}")
    db = store.open(0)
    db.write_sorted("state", keys, [VALUE] * n)
    db.commit()

    def timed(round_: int, write: Callable[[RocksDBDatabase, list[bytes | None]], None]) -> float:
        db = store.open(store.versions()[-1])
        values: list[bytes | None] = [b"w%d" % round_ * 30] * n
        start = time.perf_counter()
        write(db, values)
        db.commit()
        return time.perf_counter() - start

    batch_s = ingest_s = float("inf")
    for round_ in range(3):
        batch_s = min(
            batch_s, timed(2 * round_, lambda db, v: Database.write_sorted(db, "state", keys, v))
        )
        ingest_s = min(
            ingest_s, timed(2 * round_ + 1, lambda db, v: db.write_sorted("state", keys, v))
        )
    store.close()
    return batch_s, ingest_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also a 10M-key store for commit()")
    parser.add_argument("--keys", type=int, default=500_000, help="keys for put/get rates")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sparkstep-bench-storage-"))
    try:
        print(
            f"put/get: {args.keys} keys, 16-byte keys, 100-byte values, batches of {BATCH}, "
            "best of 3 interleaved runs"
        )
        print(f"{'measure':<28}{'store':>14}{'raw rocksdict':>16}{'ratio':>8}")
        for name, ours, raw in bench_put_get(root, args.keys):
            print(f"{name:<28}{ours:>14,.0f}{raw:>16,.0f}{ours / raw:>8.2f}")

        sizes = [10_000, 1_000_000] + ([10_000_000] if args.big else [])
        print("\ncommit() after 10k changed keys (median of 5)")
        print(f"{'store size (keys)':<28}{'commit ms':>14}{'vs 10k':>16}")
        base = None
        for size in sizes:
            latency = bench_commit(root, size)
            base = base or latency
            print(f"{size:<28,}{latency * 1e3:>14.1f}{latency / base:>16.2f}")

        mb, sst, copy = bench_shards(root, 1_000_000, moving=16)
        print(f"\nshard move: 16 of {SHARDS} shards of a 1M-key store, {mb:.1f} MB of keys+values")
        print(f"{'method (best of 3)':<28}{'MB/s':>14}{'ratio':>16}")
        print(f"{'export+import (SST)':<28}{sst:>14.1f}{sst / copy:>16.2f}")
        print(f"{'range copy (iterate+put)':<28}{copy:>14.1f}{1.0:>16.2f}")

        print("\nwrite_sorted + commit() of n sorted keys, every key rewritten (best of 3)")
        print(f"{'keys':<28}{'one batch ms':>14}{'SST ingested ms':>16}{'ratio':>8}")
        for n in (100_000, 1_000_000):
            batch_s, ingest_s = bench_write_sorted(root, n)
            print(
                f"{n:<28,}{batch_s * 1e3:>14.1f}{ingest_s * 1e3:>16.1f}{batch_s / ingest_s:>8.2f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
