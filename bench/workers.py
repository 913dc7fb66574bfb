"""Benchmark: rows/s through a state worker's ``apply`` against the pyarrow ceiling.

    .venv/bin/python -m bench.workers [--keys 100000] [--values 2000] [--steps 3]
                                      [--checkpoints 1] [--sizes 100000] [--flight]
                                      [--profile] [--cases NAME...]

For each operator (``aggregate`` with count and sum; with all five functions; with all five
functions under updates, where each batch retracts half of the rows the batch before inserted;
with all five over 1,000 hot keys whose values are all distinct (2**40 of them), so each key
gains about 100 values a step (a max of a timestamp per user); ``distinct``; ``join``;
``join`` with a string column on the right), ``--steps`` batches of each size (keys uniform
over ``--keys``, so the state grows to about ``--keys`` keys per operator and later batches
mostly update existing keys; values uniform over ``--values`` integers, so a key's min/max
multiset holds at most that many values; ``--cases`` picks operators by name: ``join``'s
output grows with the square of the rows per key, and with ``--keys 1000`` one run held 19 GB
before it was stopped; ``join, hot keys`` feeds only the left side, keys over 1,000, so each
key gains about 100 rows a step and nothing is joined: the cost of keeping a growing side,
whose ceiling is the batch's consolidation, a ``group_by`` of all its columns):

- ``apply (in process)``: a :class:`StateWorker` on a real RocksDB store, without Flight
  (kernel, state reads, digest, the write into its write buffer), after one warm-up batch;
- ``apply, write-through``: the same with a worker whose buffer is 0 bytes, so every apply reads
  and writes RocksDB (one multi-get, one ``write_sorted`` per table): what every apply would
  cost without the buffer;
- ``pyarrow ceiling``: the same batch's work with pyarrow alone, no state, no retraction
  bookkeeping: ``Table.group_by`` of the aggregates (count(*) as the sum of weights), of all
  columns for distinct, and ``Table.join`` of the step's left and right batch for join; its
  fastest step counts for every step (a ceiling is the best case, and pyarrow's first calls
  in a process varied 3x between runs);
- ``ceiling + store``: the ceiling plus the store's part alone: what the in-process path's
  checkpoints wrote (each ``write_sorted`` of its buffer's flushes, recorded), written again
  into a new store with the same calls and committed as often; no kernel, no reads, no digest.
  A worker that keeps today's state format (one record per key, a min/max multiset per key
  and column) pays at least this, so this row's ``vs ceiling`` bounds what it can reach at
  this checkpoint interval (the store's part per step shrinks as ``--steps`` grows);
- with ``--flight``, ``apply (Flight)``: a real worker process called through
  :class:`WorkerClient`, and the round trip of an empty apply and of a ``status`` action.

Each worker path is timed over ``--checkpoints`` rounds of ``--steps`` applies AND the
``commit`` a checkpoint makes after them (the buffer's flush into RocksDB, the RocksDB
checkpoint), with the ``open`` of the committed version between two rounds, as the runtime's
checkpoint does: state that a buffer holds is paid for, and so is what a reopen costs the
steps after it (with ``--checkpoints 2`` or more). ``vs ceiling`` is ceiling time / worker
time (1.0 = as fast as pyarrow alone); ``of it commit`` is the part of ``ms/step`` spent in
the commits (the buffer's flush, the RocksDB checkpoint). With ``--profile``, a cProfile of one
in-process apply of the largest batch for all five aggregates.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.worker import StateWorker, WorkerClient
from sparkstep.runtime.worker.buffer import DEFAULT_LIMIT_BYTES
from sparkstep.storage import RocksDBDatabase, RocksDBStore

S = 256
SCHEMA = pa.schema([("k", pa.int64()), ("x", pa.int64())])
RIGHT = pa.schema([("k", pa.int64()), ("y", pa.int64())])
RIGHT_TEXT = pa.schema([("k", pa.int64()), ("y", pa.string())])
AGGS = [
    Agg("count", None, "n"),
    Agg("sum", "x", "s"),
    Agg("min", "x", "lo"),
    Agg("max", "x", "hi"),
    Agg("avg", "x", "mean"),
]
_ARROW_FN = {"count": "sum", "sum": "sum", "min": "min", "max": "max", "avg": "mean"}


def make_batch(
    rng: np.random.Generator, rows: int, keys: int, value: str = "x", spread: int = 2000
) -> pa.Table:
    k = rng.integers(0, keys, rows)
    return pa.table(
        {
            "k": pa.array(k, pa.int64()),
            value: pa.array(rng.integers(-(spread // 2), spread - spread // 2, rows), pa.int64()),
            "__weight": pa.array(np.ones(rows, dtype=np.int64)),
            "__shard": pa.array(k % S, pa.int64()),
        }
    )


@dataclass(frozen=True)
class Case:
    """One benchmarked operator: its spec, its inputs per step, and its pyarrow ceiling."""

    name: str
    spec: OperatorSpec
    sides: int
    ceiling: Callable[[list[pa.Table]], object]
    updates: bool = False
    text: bool = False  # the right side's value as a string (its integer in decimal)
    keys: int | None = None  # the keys of its batches, when not --keys
    spread: int | None = None  # the distinct values of a column, when not --values
    left_only: bool = False  # the right side's batches empty

    @property
    def fed(self) -> int:
        """How many of its inputs get rows each step."""
        return 1 if self.left_only else self.sides


def aggregate_ceiling(aggs: list[Agg]) -> Callable[[list[pa.Table]], object]:
    specs = [("__weight", "sum") if a.column is None else (a.column, _ARROW_FN[a.fn]) for a in aggs]
    return lambda step: step[0].group_by(["k", "__shard"]).aggregate(specs)


CASES = [
    Case(
        "aggregate count,sum",
        OperatorSpec.aggregate("op", SCHEMA, ["k"], AGGS[:2]),
        1,
        aggregate_ceiling(AGGS[:2]),
    ),
    Case(
        "aggregate all five",
        OperatorSpec.aggregate("op", SCHEMA, ["k"], AGGS),
        1,
        aggregate_ceiling(AGGS),
    ),
    Case(
        "all five, updates",
        OperatorSpec.aggregate("op", SCHEMA, ["k"], AGGS),
        1,
        aggregate_ceiling(AGGS),
        updates=True,
    ),
    Case(
        "all five, hot keys",
        OperatorSpec.aggregate("op", SCHEMA, ["k"], AGGS),
        1,
        aggregate_ceiling(AGGS),
        keys=1000,
        spread=2**40,
    ),
    Case(
        "distinct",
        OperatorSpec.distinct("op", SCHEMA),
        1,
        lambda step: step[0].group_by(["k", "x", "__shard"]).aggregate([("__weight", "sum")]),
    ),
    Case(
        "join",
        OperatorSpec.join("op", SCHEMA, RIGHT, ["k"]),
        2,
        lambda step: step[0].select(["k", "x"]).join(step[1].select(["k", "y"]), "k"),
    ),
    Case(
        "join, strings",
        OperatorSpec.join("op", SCHEMA, RIGHT_TEXT, ["k"]),
        2,
        lambda step: step[0].select(["k", "x"]).join(step[1].select(["k", "y"]), "k"),
        text=True,
    ),
    Case(
        "join, hot keys",
        OperatorSpec.join("op", SCHEMA, RIGHT, ["k"]),
        2,
        lambda step: step[0].group_by(["k", "x", "__shard"]).aggregate([("__weight", "sum")]),
        keys=1000,
        left_only=True,
    ),
]


def steps_of(
    case: Case, rng: np.random.Generator, size: int, keys: int, n: int, spread: int
) -> list[list[pa.Table]]:
    """``n + 1`` steps (the first is the warm-up) of one batch per input. With
    ``case.updates``, each step after the first is ``size / 2`` new rows and the retraction of
    half of the rows the step before inserted (so a min or max is often retracted)."""
    values = ["x", "y"][: case.sides]
    keys = case.keys or keys
    spread = case.spread or spread
    if case.left_only:
        return [[make_batch(rng, size, keys), make_batch(rng, 0, keys, "y")] for _ in range(n + 1)]
    if not case.updates:
        steps = [[make_batch(rng, size, keys, v, spread) for v in values] for _ in range(n + 1)]
        if case.text:
            for step in steps:
                step[1] = step[1].set_column(1, "y", step[1].column("y").cast(pa.string()))
        return steps
    inserted = make_batch(rng, size, keys, spread=spread)
    steps = [[inserted]]
    for _ in range(n):
        retracted = inserted.slice(0, size // 2)
        retracted = retracted.set_column(
            retracted.schema.get_field_index("__weight"),
            "__weight",
            pa.array(np.full(retracted.num_rows, -1, dtype=np.int64)),
        )
        inserted = make_batch(rng, size - size // 2, keys, spread=spread)
        steps.append([pa.concat_tables([inserted, retracted])])
    return steps


def apply_all(
    worker: StateWorker | WorkerClient,
    apply: Callable[..., object],
    steps: list[list[pa.Table]],
    every: int,
) -> tuple[float, float]:
    """Open version 0 and apply the warm-up step, then time the others with a commit after
    every ``every`` of them and an open of the committed version between two commits; seconds
    in all, and of them in the commits. ``apply(inc, step, side, batch)`` calls the worker's or
    the client's."""
    inc = worker.open(0)
    for side, batch in enumerate(steps[0]):
        apply(inc, 0, side, batch)
    committing = 0.0
    t0 = time.perf_counter()
    for step, batches in enumerate(steps[1:], start=1):
        for side, batch in enumerate(batches):
            apply(inc, step, side, batch)
        if step % every == 0:
            t1 = time.perf_counter()
            worker.commit(step + 1)
            committing += time.perf_counter() - t1
            if step < len(steps) - 1:
                inc = worker.open(step // every)
    return time.perf_counter() - t0, committing


class RecordingStore(RocksDBStore):
    """A store whose databases record what is written with ``write_sorted`` (the worker's
    buffer flushes), per commit: ``writes[i]`` is what the ``i``-th database opened wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes: list[list[tuple[str, Sequence[bytes], Sequence[bytes | None]]]] = []

    def open(self, version: int) -> RocksDBDatabase:
        db = super().open(version)
        written: list[tuple[str, Sequence[bytes], Sequence[bytes | None]]] = []
        self.writes.append(written)
        write_sorted = db.write_sorted

        def recording(table: str, keys: Sequence[bytes], values: Sequence[bytes | None]) -> None:
            written.append((table, keys, values))
            write_sorted(table, keys, values)

        db.write_sorted = recording  # type: ignore[method-assign]
        return db


def store_floor(store: RecordingStore, path: Path) -> float:
    """Seconds to write what each of ``store``'s databases wrote into a new store and commit
    it, as many times: what keeping that state in RocksDB costs with no kernel, no reads and no
    digest. (The first database's writes include the untimed warm-up step's, a few percent of
    its keys: the other steps' rewrite most of them.)"""
    floor = RocksDBStore(path)
    t0 = time.perf_counter()
    for version, written in enumerate(store.writes):
        db = floor.open(version)
        for table, keys, values in written:
            db.write_sorted(table, keys, values)
        db.commit()
    secs = time.perf_counter() - t0
    floor.close()
    return secs


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


class Result(NamedTuple):
    """One row of the table: seconds over the timed steps, and of them in commits."""

    op: str
    path: str
    size: int
    secs: float
    commit_secs: float = 0.0


def run_case(case: Case, root: Path, args: argparse.Namespace, token_file: Path) -> list[Result]:
    results: list[Result] = []
    rng = np.random.default_rng(1)
    for size in args.sizes:
        timed = args.steps * args.checkpoints
        steps = steps_of(case, rng, size, args.keys, timed, args.values)
        case.ceiling(steps[0])
        best = float("inf")
        for step in steps[1:]:
            t0 = time.perf_counter()
            case.ceiling(step)
            best = min(best, time.perf_counter() - t0)
        ceiling = best * timed
        results.append(Result(case.name, "pyarrow ceiling", size, ceiling))
        for path, buffer_bytes in [
            ("apply (in process)", DEFAULT_LIMIT_BYTES),
            ("apply, write-through", 0),
        ]:
            name = f"in-{case.name}-{size}-{path}".replace(" ", "_")
            store = RecordingStore(root / name)
            worker = StateWorker(store, S, buffer_bytes=buffer_bytes)
            worker.configure([case.spec], S)
            secs, committing = apply_all(
                worker,
                lambda i, st, side, b, w=worker: w.apply(i, st, "op", "d", b, input_index=side),
                steps,
                args.steps,
            )
            results.append(Result(case.name, path, size, secs, committing))
            worker.close()
            if buffer_bytes == DEFAULT_LIMIT_BYTES:
                floor = store_floor(store, root / f"{name}-floor")
                results.append(Result(case.name, "ceiling + store", size, ceiling + floor, floor))
        if args.flight:
            proc, client = start_worker(
                root / f"fl-{case.name}-{size}".replace(" ", "_"), token_file
            )
            client.configure([case.spec], S)
            secs, committing = apply_all(
                client,
                lambda i, st, side, b, c=client: c.apply(i, st, "op", "d", b, input=side),
                steps,
                args.steps,
            )
            results.append(Result(case.name, "apply (Flight)", size, secs, committing))
            client.shutdown()
            proc.wait(30)
    return results


def round_trips(root: Path, token_file: Path) -> tuple[float, float]:
    """Milliseconds of an empty-batch apply and of a ``status`` action through Flight."""
    proc, client = start_worker(root / "round-trips", token_file)
    client.configure([CASES[0].spec], S)
    inc = client.open(0)
    empty = SCHEMA.append(pa.field("__weight", pa.int64())).append(pa.field("__shard", pa.int64()))
    rounds = 200
    t0 = time.perf_counter()
    for i in range(rounds):
        client.apply(inc, i, "op", "d", empty.empty_table())
    empty_ms = (time.perf_counter() - t0) / rounds * 1000
    t0 = time.perf_counter()
    for _ in range(rounds):
        client.status()
    status_ms = (time.perf_counter() - t0) / rounds * 1000
    client.shutdown()
    proc.wait(30)
    return empty_ms, status_ms


def profile(root: Path, args: argparse.Namespace) -> str:
    rng = np.random.default_rng(2)
    size = max(args.sizes)
    worker = StateWorker(RocksDBStore(root / "profile"), shards=S)
    worker.configure([CASES[1].spec], S)
    inc = worker.open(0)
    worker.apply(inc, 0, "op", "d", make_batch(rng, size, args.keys, spread=args.values))
    prof = cProfile.Profile()
    batch = make_batch(rng, size, args.keys, spread=args.values)
    prof.enable()
    worker.apply(inc, 1, "op", "d", batch)
    prof.disable()
    worker.close()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(12)
    return "\n".join(stream.getvalue().splitlines()[:30])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--values", type=int, default=2000, help="distinct values of a column")
    parser.add_argument("--steps", type=int, default=3, help="steps between two checkpoints")
    parser.add_argument("--checkpoints", type=int, default=1, help="checkpoints timed")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--flight", action="store_true", help="also through a worker process")
    parser.add_argument("--profile", action="store_true", help="cProfile one apply")
    parser.add_argument(
        "--cases", nargs="+", help="only the operators whose name contains one of these"
    )
    args = parser.parse_args()
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as root_s:
        root = Path(root_s)
        token_file = root / "token"
        token_file.write_text("bench-token\n")
        for case in CASES:
            if not args.cases or any(part in case.name for part in args.cases):
                results += run_case(case, root, args, token_file)
        trips = round_trips(root, token_file) if args.flight else None
        prof = profile(root, args) if args.profile else None

    print(
        f"state worker apply over {args.keys} keys and {args.values} values (int64), "
        f"{args.checkpoints} x ({args.steps} steps and a checkpoint)"
    )
    print(
        f"{'operator':<22}{'path':<22}{'batch':>8}{'rows/s':>12}{'ms/step':>10}"
        f"{'of it commit':>14}{'vs ceiling':>11}"
    )
    ceilings = {(r.op, r.size): r.secs for r in results if r.path == "pyarrow ceiling"}
    sides = {case.name: case.fed for case in CASES}
    steps = args.steps * args.checkpoints
    for r in results:
        rate = r.size * sides[r.op] * steps / r.secs
        ratio = ceilings[(r.op, r.size)] / r.secs
        print(
            f"{r.op:<22}{r.path:<22}{r.size:>8}{rate:>12,.0f}{r.secs / steps * 1000:>10.1f}"
            f"{r.commit_secs / steps * 1000:>14.1f}{ratio:>10.3f}x"
        )
    if trips is not None:
        print(f"empty-batch apply round trip: {trips[0]:.2f} ms; status action: {trips[1]:.2f} ms")
    if prof is not None:
        print(f"\nprofile of one in-process apply of {max(args.sizes)} rows, all five aggregates:")
        print(prof)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
