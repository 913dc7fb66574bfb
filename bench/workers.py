"""Benchmark: rows/s through a state worker's ``apply`` for ``aggregate`` over 100k keys.

    .venv/bin/python -m bench.workers [--keys 100000] [--steps 3]

Measures, for two aggregate specs (all five functions; count and sum only) and batches of 10k
and 100k rows (keys uniform over ``--keys``, so the state grows to
about ``--keys`` entries; later batches mostly update existing keys):

- ``apply (Flight)``: a real worker process (``python -m sparkstep.runtime.worker``) on a real
  store, called through :class:`WorkerClient` (rows out, delta back, one ``db.write``);
- ``apply (in process)``: the same :class:`StateWorker` without Flight (kernel + store);
- ``pyarrow ceiling``: the same aggregation of the same batch with ``Table.group_by`` alone
  (no state, no retraction bookkeeping): the ceiling;

and the round trip of an ``apply`` with an empty batch and of a ``status`` action. Then a
cProfile of one in-process apply of 100k rows (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.worker import StateWorker, WorkerClient
from sparkstep.storage import RocksDBStore

S = 256
SCHEMA = pa.schema([("k", pa.int64()), ("x", pa.int64())])
AGGS = [
    Agg("count", None, "n"),
    Agg("sum", "x", "s"),
    Agg("min", "x", "lo"),
    Agg("max", "x", "hi"),
    Agg("avg", "x", "mean"),
]


def make_batch(rng: np.random.Generator, rows: int, keys: int) -> pa.Table:
    k = rng.integers(0, keys, rows)
    return pa.table(
        {
            "k": pa.array(k, pa.int64()),
            "x": pa.array(rng.integers(-1000, 1000, rows), pa.int64()),
            "__weight": pa.array(np.ones(rows, dtype=np.int64)),
            "__shard": pa.array(k % S, pa.int64()),
        }
    )


_ARROW_FN = {"count": "sum", "sum": "sum", "min": "min", "max": "max", "avg": "mean"}


def ceiling(batch: pa.Table, aggs: list[Agg]) -> None:
    """The same aggregation of one batch with pyarrow alone (count(*) = sum of weights)."""
    specs = [("__weight", "sum") if a.column is None else (a.column, _ARROW_FN[a.fn]) for a in aggs]
    batch.group_by(["k", "__shard"]).aggregate(specs)


def start_worker(store: Path, token_file: Path) -> tuple[subprocess.Popen[bytes], WorkerClient]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sparkstep.runtime.worker",
            "--store",
            str(store),
            "--port",
            "0",
            "--token-file",
            str(token_file),
            "--shards",
            str(S),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    port = json.loads(proc.stdout.readline())["port"]
    return proc, WorkerClient(f"127.0.0.1:{port}", token_file.read_text().strip())


def run_config(
    name: str, aggs: list[Agg], root: Path, token_file: Path, keys: int, steps: int
) -> tuple[list[tuple[str, str, int, float]], float, float]:
    """Ceiling, in-process and Flight applies for one aggregate spec; plus round trips."""
    spec = OperatorSpec.aggregate("agg", SCHEMA, ["k"], aggs)
    rng = np.random.default_rng(1)
    results: list[tuple[str, str, int, float]] = []
    empty_ms = status_ms = 0.0
    for size in (10_000, 100_000):
        batches = [make_batch(rng, size, keys) for _ in range(steps)]
        t0 = time.perf_counter()
        for b in batches:
            ceiling(b, aggs)
        results.append((name, "pyarrow ceiling", size, time.perf_counter() - t0))
        worker = StateWorker(RocksDBStore(root / f"inproc-{name}-{size}"), shards=S)
        worker.configure([spec], S)
        inc = worker.open(0)
        t0 = time.perf_counter()
        for step, b in enumerate(batches):
            worker.apply(inc, step, "agg", "d", b)
        results.append((name, "apply (in process)", size, time.perf_counter() - t0))
        worker.close()
        proc, client = start_worker(root / f"flight-{name}-{size}", token_file)
        client.configure([spec], S)
        inc = client.open(0)
        t0 = time.perf_counter()
        for step, b in enumerate(batches):
            client.apply(inc, step, "agg", "d", b)
        results.append((name, "apply (Flight)", size, time.perf_counter() - t0))
        if size == 100_000:
            empty = batches[0].slice(0, 0)
            rounds = 200
            t0 = time.perf_counter()
            for i in range(rounds):
                client.apply(inc, steps + i, "agg", "d", empty)
            empty_ms = (time.perf_counter() - t0) / rounds * 1000
            t0 = time.perf_counter()
            for _ in range(rounds):
                client.status()
            status_ms = (time.perf_counter() - t0) / rounds * 1000
        client.shutdown()
        proc.wait(30)
    return results, empty_ms, status_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results: list[tuple[str, str, int, float]] = []
    with tempfile.TemporaryDirectory() as root_s:
        root = Path(root_s)
        token_file = root / "token"
        token_file.write_text("bench-token\n")
        full, empty_ms, status_ms = run_config(
            "count,sum,min,max,avg", AGGS, root, token_file, args.keys, args.steps
        )
        lean, _, _ = run_config("count,sum", AGGS[:2], root, token_file, args.keys, args.steps)
        results = full + lean
        # Profile: one in-process apply of 100k rows into a state of ~keys entries.
        rng = np.random.default_rng(2)
        spec = OperatorSpec.aggregate("agg", SCHEMA, ["k"], AGGS)
        worker = StateWorker(RocksDBStore(root / "profile"), shards=S)
        worker.configure([spec], S)
        inc = worker.open(0)
        worker.apply(inc, 0, "agg", "d", make_batch(rng, 100_000, args.keys))
        prof = cProfile.Profile()
        prof.enable()
        worker.apply(inc, 1, "agg", "d", make_batch(rng, 100_000, args.keys))
        prof.disable()
        worker.close()

    print(f"aggregate over {args.keys} keys (int64 key and value), {args.steps} batches each")
    print(f"{'aggs':<24}{'path':<21}{'batch':>8}{'rows/s':>12}{'ms/batch':>10}{'vs ceiling':>11}")
    ceilings = {(a, size): secs for a, p, size, secs in results if p == "pyarrow ceiling"}
    for aggs, path, size, secs in results:
        rate = size * args.steps / secs
        ratio = ceilings[(aggs, size)] / secs
        print(
            f"{aggs:<24}{path:<21}{size:>8}{rate:>12,.0f}"
            f"{secs / args.steps * 1000:>10.1f}{ratio:>10.3f}x"
        )
    print(f"empty-batch apply round trip: {empty_ms:.2f} ms; status action: {status_ms:.2f} ms")
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(12)
    print("\nprofile of one in-process apply of 100k rows, all five aggregates (by own time):")
    print("\n".join(stream.getvalue().splitlines()[:30]))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
