"""Benchmark: the pause and the bytes moved by a rescale, against stop-and-restore and the minimum.

    .venv/bin/python -m bench.rescale [--keys 1000000] [--shards 256] [--batch 100000]

Measured at the worker level: real worker processes (``python -m sparkstep.runtime.worker``) on
real stores, filled through their ``apply`` (the ``aggregate`` kernel, count and sum per int64
key: the real key encoding and shard prefixes), and the runtime's own procedure
(:func:`sparkstep.runtime.rescale.run_procedure`). No Spark: a rescale runs no step, and the
runtime's part beyond the procedure is one control call. The state is filled once at W=2 and
then changed 2 -> 3 -> 2 -> 4 -> 8; the table reports 2->3, 3->2 and 4->8 (2->4 prepares 4->8).

For each change, on the same state, in the same run:

- ``ours`` (the coordinator's pause, pause to resume): checkpoint; start the added workers
  (``--create-version v``, all at once); the procedure (plan, export the moving shards,
  import, drop, layout, commit ``v+1``, manifest, reopen); stop the retired workers.
- ``stop-and-restore`` (Flink's way: stop, savepoint, restore at the new parallelism):
  checkpoint; start N new worker processes on new stores (all at once); rebuild every new
  store from all of the state (export every shard from its owner, import at its owner in a
  fresh layout at N); write the layout, commit, open; stop the old workers. Its bytes are the
  whole state.
- ``minimum``: the fraction of the state that any balanced layout change must move:
  ``(N - W) / N`` when scaling out (each added worker needs its ``1/N``) and ``(W - N) / W``
  when scaling in (the retired workers' state).

Ratios: pause (ours / stop-and-restore) and moved bytes (ours / (minimum x whole state)).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from sparkstep.ids import LayoutEpoch, Step, Version, WorkerId
from sparkstep.runtime.driver import ensure_layouts
from sparkstep.runtime.layout import Layout, initial_layout
from sparkstep.runtime.manifest import Manifest, ManifestLease
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.rescale import new_store_path, run_procedure
from sparkstep.runtime.worker import WorkerClient

SCHEMA = pa.schema([("k", pa.int64()), ("x", pa.int64())])
SPEC = OperatorSpec.aggregate("agg", SCHEMA, ["k"], [Agg("count", None, "n"), Agg("sum", "x", "s")])
_TIMEOUT = 3600.0


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    client: WorkerClient
    store: Path

    def stop(self) -> None:
        self.client.shutdown()
        self.proc.wait(60)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def start_workers(
    stores: list[Path], token_file: Path, shards: int, version: int | None
) -> list[Worker]:
    """Start one worker per store, all at once (as a coordinator would), and configure them."""
    extra = [] if version is None else ["--create-version", str(version)]
    env = {k: v for k, v in os.environ.items() if k != "SPARKSTEP_FAILPOINT"}
    procs = [
        subprocess.Popen(
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
                str(shards),
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        for store in stores
    ]
    workers = []
    token = token_file.read_text().strip()
    for proc, store in zip(procs, stores, strict=True):
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        client = WorkerClient(f"127.0.0.1:{port}", token, timeout=_TIMEOUT)
        client.configure([SPEC], shards)
        workers.append(Worker(proc, client, store))
    return workers


def min_fraction(w: int, n: int) -> float:
    return (n - w) / n if n > w else (w - n) / w


class Fleet:
    """W workers on one state dir and their manifest, driven like the runtime drives them."""

    def __init__(self, state_dir: Path, token_file: Path, shards: int, workers: int) -> None:
        self.state_dir, self.token_file, self.shards = state_dir, token_file, shards
        (state_dir / "workers").mkdir(parents=True)
        self.workers = start_workers(
            [state_dir / f"workers/w{i}" for i in range(workers)], token_file, shards, None
        )
        self.manifest = Manifest(
            deployment=str(uuid.uuid4()),
            name="bench",
            layout=initial_layout(shards, workers),
            stores=tuple(f"workers/w{i}" for i in range(workers)),
            version=Version(0),
            step=Step(0),
        )
        self.lease = ManifestLease.claim(state_dir)
        self.lease.write(self.manifest, expected=None)
        self.incarnations = [w.client.open(0) for w in self.workers]
        ensure_layouts(self.manifest, self.clients)
        self.step = 0

    @property
    def clients(self) -> list[WorkerClient]:
        return [w.client for w in self.workers]

    def fill(self, keys: int, batch: int) -> None:
        """One apply per worker per batch of distinct keys: the state holds ``keys`` keys."""
        layout = self.manifest.layout
        owners = np.array(layout.owners)
        for start in range(0, keys, batch):
            k = np.arange(start, min(start + batch, keys), dtype=np.int64)
            shard = (k * 2654435761) % (1 << 32) % self.shards
            for w, client in enumerate(self.clients):
                mine = owners[shard] == w
                rows = pa.table(
                    {
                        "k": pa.array(k[mine]),
                        "x": pa.array(k[mine] % 1000),
                        "__weight": pa.array(np.ones(int(mine.sum()), dtype=np.int64)),
                        "__shard": pa.array(shard[mine]),
                    }
                )
                client.apply(
                    self.incarnations[w], self.step, "agg", f"d{self.step}", rows,
                    layout_epoch=layout.epoch,
                )  # fmt: skip
            self.step += 1

    def checkpoint(self) -> None:
        for client in self.clients:
            client.commit(self.step)
        m = self.manifest
        self.manifest = Manifest(
            m.deployment, m.name, m.layout, m.stores, Version(m.version + 1), Step(self.step)
        )
        self.lease.write(self.manifest, expected=m.version)
        self.incarnations = [c.open(self.manifest.version) for c in self.clients]

    def rescale(self, n: int) -> tuple[float, int, int]:
        """Ours; returns (pause seconds, bytes moved, the procedure's own ms)."""
        started = time.perf_counter()
        self.checkpoint()
        epoch = self.manifest.epoch + 1
        added = start_workers(
            [self.state_dir / new_store_path(i, epoch) for i in range(self.manifest.workers, n)],
            self.token_file,
            self.shards,
            self.manifest.version,
        )
        new = [*self.workers[:n], *added]
        manifest, self.incarnations, result = run_procedure(
            self.manifest, self.lease, self.clients, [w.client for w in new]
        )
        for worker in self.workers[n:]:
            worker.stop()
            shutil.rmtree(worker.store)
        pause = time.perf_counter() - started
        self.workers, self.manifest = new, manifest
        return pause, result.bytes_moved, result.duration_ms

    def stop_and_restore(self, n: int) -> tuple[float, int]:
        """The baseline on the same state; leaves this fleet as it was (reopened)."""
        started = time.perf_counter()
        self.checkpoint()
        version, step = self.manifest.version, self.manifest.step
        layout = Layout(
            LayoutEpoch(self.manifest.epoch + 1), n, initial_layout(self.shards, n).owners
        )
        # Stores next to the fleet's: a worker imports only its sibling stores' exports.
        stores = [self.state_dir / "workers" / f"restore-w{i}" for i in range(n)]
        fresh = start_workers(stores, self.token_file, self.shards, version)
        for worker in fresh:
            worker.client.open(version)
        moved = 0
        for source, client in enumerate(self.clients):
            for target, worker in enumerate(fresh):
                shards = [
                    s
                    for s in range(self.shards)
                    if self.manifest.layout.owners[s] == source and layout.owners[s] == target
                ]
                if not shards:
                    continue
                name = f"w{source}-w{target}"
                out = client.export_shards(shards, name, timeout=_TIMEOUT)
                worker.client.import_files(client.address, name, out["files"], timeout=_TIMEOUT)
                moved += int(out["bytes"])
        for target, worker in enumerate(fresh):
            worker.client.set_layout(layout, target)
            worker.client.commit(step)
            worker.client.open(version + 1)
        for client in self.clients:
            client.close_db()
        pause = time.perf_counter() - started
        for worker in fresh:
            worker.stop()
        for store in stores:
            shutil.rmtree(store)
        self.incarnations = [c.open(version) for c in self.clients]
        return pause, moved


def _held_keys(fleet: Fleet) -> int:
    total = 0
    for w, client in enumerate(fleet.clients):
        doc = client.inspect()
        owned = set(fleet.manifest.layout.shards_of(WorkerId(w)))
        held = doc["tables"].get("state.agg", {})
        assert {int(s) for s in held} <= owned
        total += sum(held.values())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rescale")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        token_file = root / "token"
        token_file.write_text(uuid.uuid4().hex)
        fleet = Fleet(root / "state", token_file, args.shards, workers=2)
        started = time.perf_counter()
        fleet.fill(args.keys, args.batch)
        fill_s = time.perf_counter() - started
        print(f"state: {args.keys:,} keys, S={args.shards}, filled in {fill_s:.1f} s", flush=True)
        rows = []
        for w, n, reported in ((2, 3, True), (3, 2, True), (2, 4, False), (4, 8, True)):
            base_pause, whole = fleet.stop_and_restore(n)
            pause, moved, procedure_ms = fleet.rescale(n)
            assert _held_keys(fleet) == args.keys
            if reported:
                rows.append((w, n, pause, procedure_ms, moved, base_pause, whole))
        for worker in fleet.workers:
            worker.stop()

    print()
    print(
        f"{'change':<8}{'ours pause ms':>14}{'(procedure)':>12}{'restore ms':>12}"
        f"{'pause ratio':>12}{'ours MB':>9}{'all MB':>8}{'moved':>8}{'minimum':>9}{'bytes/min':>10}"
    )
    for w, n, pause, procedure_ms, moved, base_pause, whole in rows:
        minimum = min_fraction(w, n)
        print(
            f"{f'{w}->{n}':<8}{pause * 1000:>14.0f}{procedure_ms:>12}{base_pause * 1000:>12.0f}"
            f"{pause / base_pause:>12.2f}{moved / 1e6:>9.1f}{whole / 1e6:>8.1f}"
            f"{moved / whole:>8.3f}{minimum:>9.3f}{moved / (minimum * whole):>10.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
