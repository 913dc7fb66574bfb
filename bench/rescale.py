"""Benchmark: the pause and the bytes moved by a rescale, against stop-and-restore and the minimum;
with ``--hot``, the hot rescale against the cold one under steady input, for several state sizes.

    .venv/bin/python -m bench.rescale [--keys 1000000] [--shards 256] [--batch 100000]
    .venv/bin/python -m bench.rescale --hot [--sizes 100000,1000000,10000000] [--plot FILE]

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

``--hot`` (issue 15's curve): for each state size, two fleets are filled with the same keys; a
thread applies steady input to each (``--updates`` random keys of the state per step, a step every
``1 / --rate`` s) while both go through 2 -> 3 -> 2 -> 4 -> 8 (reported: 2->3, 3->2, 4->8):

- ``cold`` (``{"mode": "cold"}``): the coordinator's cold flow (pause the steps, checkpoint,
  start the added workers, :func:`~sparkstep.runtime.rescale.run_procedure`, stop the retired
  workers, resume);
- ``hot`` (the default): start the added workers while the steps run,
  :func:`~sparkstep.runtime.rescale.run_hot_procedure` (it pauses and resumes the steps
  itself), stop the retired workers after the resume.

The pause is measured black box, from the input thread: the time it stood held at the top of a
step (where it arrives when a step is due) during the rescale: no step ran then that should
have. Bytes: those sent during
the pause, in all, and the minimum (the fraction any balanced change moves times the whole
state, measured by exporting it once). Where the hot pause goes is the procedure's own split
(``pause_parts_ms``: catch-up, ingest, drop and layout, commit, manifest, reopen). ``--plot``
draws the pause against the state size for both modes (matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from sparkstep.ids import LayoutEpoch, Step, Version, WorkerId
from sparkstep.runtime.driver import ensure_layouts
from sparkstep.runtime.layout import Layout, initial_layout
from sparkstep.runtime.manifest import Manifest, ManifestLease
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.rescale import new_store_path, run_hot_procedure, run_procedure
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
        for start in range(0, keys, batch):
            self.apply_step(np.arange(start, min(start + batch, keys), dtype=np.int64))

    def apply_step(self, k: np.ndarray) -> None:
        """One step: the keys ``k`` (int64) routed to their owners, one apply per worker."""
        layout = self.manifest.layout
        owners = np.array(layout.owners)
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

    def start_added(self, n: int) -> list[Worker]:
        """The workers a change to ``n`` adds (all at once), on new stores at the manifest's
        version, as the coordinator starts them."""
        epoch = self.manifest.epoch + 1
        return start_workers(
            [self.state_dir / new_store_path(i, epoch) for i in range(self.manifest.workers, n)],
            self.token_file,
            self.shards,
            self.manifest.version,
        )

    def whole_bytes(self) -> int:
        """The whole state's size as the rescale measures bytes (one export per worker)."""
        return sum(
            int(
                client.export_shards(self.manifest.layout.shards_of(WorkerId(w)), f"whole-{w}")[
                    "bytes"
                ]
            )
            for w, client in enumerate(self.clients)
        )

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
        new = [*self.workers[:n], *self.start_added(n)]
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


# -- hot against cold under steady input ---------------------------------------------------------


@dataclass(eq=False)  # a thread must stay hashable
class Input(threading.Thread):
    """Steady input: a step of ``updates`` random keys of the state every ``1 / rate`` s, until
    stopped; pausable at the top of a step, as the runtime's loop is."""

    fleet: Fleet
    keys: int
    updates: int
    rate: float
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (stopped, went on)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        super().__init__(daemon=True)
        self._go = threading.Event()
        self._go.set()
        self._at_top = threading.Event()
        self._left = threading.Event()
        self._halt = threading.Event()
        self._rng = np.random.default_rng(7)

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if not self._go.is_set():
                    stopped = time.perf_counter()
                    self._at_top.set()
                    self._go.wait()
                    self.pauses.append((stopped, time.perf_counter()))
                    self._at_top.clear()
                    self._left.set()
                    continue
                began = time.perf_counter()
                self.fleet.apply_step(self._rng.integers(0, self.keys, self.updates))
                self._halt.wait(max(0.0, 1 / self.rate - (time.perf_counter() - began)))
        except BaseException as exc:  # reported by stop()
            self.failure = exc
            self._at_top.set()

    def pause(self) -> Step:
        """Stop at the top of the next step; returns the next step's number."""
        self._left.clear()
        self._go.clear()
        self._at_top.wait()
        if self.failure is not None:
            raise RuntimeError(f"the input thread failed: {self.failure}")
        return Step(self.fleet.step)

    def resume(self) -> None:
        """Let the steps go on; returns once the thread has left the top (and noted the pause)."""
        self._go.set()
        self._left.wait(60)

    def stop(self) -> None:
        self._halt.set()
        self._go.set()
        self.join(60)
        if self.failure is not None:
            raise RuntimeError(f"the input thread failed: {self.failure}")

    def paused_since(self, since: float) -> float:
        """Seconds the thread stood at the top of a step, held, since ``since``: it reaches the
        top when a step is due, so this is the time no step ran that should have."""
        return sum(went - stopped for stopped, went in self.pauses if stopped >= since)


@dataclass(frozen=True)
class Measured:
    """One rescale under input: the black-box pause, the bytes, where the pause went."""

    pause_ms: int
    bytes_paused: int
    bytes_total: int
    parts: dict[str, int]
    rounds: int


@dataclass(frozen=True)
class Row:
    keys: int
    w: int
    n: int
    cold: Measured
    hot: Measured
    whole: int

    @property
    def minimum(self) -> float:
        return min_fraction(self.w, self.n) * self.whole


def cold_under_input(fleet: Fleet, steps: Input, n: int) -> Measured:
    """The coordinator's cold flow with the input thread as the loop."""
    started = time.perf_counter()
    parts: dict[str, int] = {}
    lap = [started]

    def mark(part: str) -> None:
        now = time.perf_counter()
        parts[part] = round((now - lap[0]) * 1000)
        lap[0] = now

    steps.pause()
    mark("settle")
    fleet.checkpoint()
    mark("checkpoint")
    new = [*fleet.workers[:n], *fleet.start_added(n)]
    mark("start")
    manifest, incarnations, result = run_procedure(
        fleet.manifest, fleet.lease, fleet.clients, [w.client for w in new]
    )
    mark("procedure")
    retired = fleet.workers[n:]
    fleet.workers, fleet.manifest, fleet.incarnations = new, manifest, incarnations
    for worker in retired:
        worker.stop()
        shutil.rmtree(worker.store)
    mark("retire")
    steps.resume()
    return Measured(
        pause_ms=round(steps.paused_since(started) * 1000),
        bytes_paused=result.bytes_moved,
        bytes_total=result.bytes_moved,
        parts={**parts, **{f"procedure.{k}": v for k, v in result.pause_parts_ms.items()}},
        rounds=0,
    )


def hot_under_input(fleet: Fleet, steps: Input, n: int) -> Measured:
    """The coordinator's hot flow: the added workers start and the copy runs while the input
    thread goes on; the procedure pauses it, and it resumes once the fleet has switched."""
    started = time.perf_counter()
    new = [*fleet.workers[:n], *fleet.start_added(n)]
    manifest, incarnations, result = run_hot_procedure(
        fleet.manifest, fleet.lease, fleet.clients, [w.client for w in new], steps.pause
    )
    retired = fleet.workers[n:]
    fleet.workers, fleet.manifest, fleet.incarnations = new, manifest, incarnations
    steps.resume()
    for worker in retired:
        worker.stop()
        shutil.rmtree(worker.store)
    return Measured(
        pause_ms=round(steps.paused_since(started) * 1000),
        bytes_paused=result.bytes_paused,
        bytes_total=result.bytes_moved,
        parts=dict(result.pause_parts_ms),
        rounds=result.rounds,
    )


def _held_keys(fleet: Fleet) -> int:
    total = 0
    for w, client in enumerate(fleet.clients):
        doc = client.inspect()
        owned = set(fleet.manifest.layout.shards_of(WorkerId(w)))
        held = doc["tables"].get("state.agg", {})
        assert {int(s) for s in held} <= owned
        total += sum(held.values())
    return total


CHANGES = ((2, 3, True), (3, 2, True), (2, 4, False), (4, 8, True))
"""The changes both benchmarks run, in order, and whether each is reported (2->4 prepares 4->8)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rescale")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--batch", type=int, default=100_000)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument("--hot", action="store_true", help="hot against cold, under input")
    parser.add_argument(
        "--sizes",
        default="100000,1000000,10000000",
        help="--hot: the state sizes in keys, comma-separated (add 100000000 if the disk allows)",
    )
    parser.add_argument("--updates", type=int, default=5_000, help="--hot: keys per step")
    parser.add_argument("--rate", type=float, default=5.0, help="--hot: steps per second")
    parser.add_argument("--plot", type=Path, default=None, help="--hot: write the curve (PNG)")
    args = parser.parse_args(argv)
    if args.hot:
        return hot_main(args)
    return cold_main(args)


def hot_main(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.sizes.split(",")]
    print(
        f"steady input: {args.updates:,} keys a step, {args.rate:g} steps/s; S={args.shards}",
        flush=True,
    )
    rows: list[Row] = []
    for keys in sizes:
        with tempfile.TemporaryDirectory(dir=args.root) as tmp:
            root = Path(tmp)
            token_file = root / "token"
            token_file.write_text(uuid.uuid4().hex)
            fleets = {
                mode: Fleet(root / mode, token_file, args.shards, workers=2)
                for mode in ("cold", "hot")
            }
            started = time.perf_counter()
            for fleet in fleets.values():
                fleet.fill(keys, args.batch)
                fleet.checkpoint()
            whole = fleets["cold"].whole_bytes()
            print(
                f"state: {keys:,} keys ({whole / 1e6:.0f} MB exported), two fleets filled in "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
            inputs = {
                mode: Input(fleet, keys, args.updates, args.rate) for mode, fleet in fleets.items()
            }
            for one in inputs.values():
                one.start()
                one.pause()
            for w, n, reported in CHANGES:
                measured: dict[str, Measured] = {}
                for mode, run in (("cold", cold_under_input), ("hot", hot_under_input)):
                    inputs[mode].resume()
                    time.sleep(1.0)  # steady input before the rescale
                    measured[mode] = run(fleets[mode], inputs[mode], n)
                    inputs[mode].pause()
                    assert _held_keys(fleets[mode]) == keys
                if reported:
                    rows.append(Row(keys, w, n, measured["cold"], measured["hot"], whole))
                    _print_hot_row(rows[-1])
            for mode, fleet in fleets.items():
                inputs[mode].stop()
                for worker in fleet.workers:
                    worker.stop()
    print()
    print(
        f"{'keys':>11} {'change':<7}{'cold ms':>9}{'hot ms':>8}{'hot/cold':>9}{'paused MB':>10}"
        f"{'total MB':>9}{'min MB':>8}{'total/min':>10}{'rounds':>7}  hot pause parts (ms)"
    )
    for row in rows:
        _print_hot_row(row, table=True)
    if args.plot is not None:
        _plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


def _print_hot_row(row: Row, table: bool = False) -> None:
    cold, hot = row.cold, row.hot
    if not table:
        print(
            f"  {row.keys:,} keys {row.w}->{row.n}: cold {cold.pause_ms} ms {cold.parts}; "
            f"hot {hot.pause_ms} ms, {hot.rounds} rounds",
            flush=True,
        )
        return
    parts = " ".join(f"{k}={v}" for k, v in hot.parts.items())
    print(
        f"{row.keys:>11,} {f'{row.w}->{row.n}':<7}{cold.pause_ms:>9}{hot.pause_ms:>8}"
        f"{hot.pause_ms / max(cold.pause_ms, 1):>9.2f}{hot.bytes_paused / 1e6:>10.2f}"
        f"{hot.bytes_total / 1e6:>9.1f}{row.minimum / 1e6:>8.1f}"
        f"{hot.bytes_total / row.minimum:>10.2f}{hot.rounds:>7}  {parts}"
    )


def _plot(rows: list[Row], path: Path) -> None:
    """The pause against the state size, hot and cold, one line per change."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
    for w, n in sorted({(r.w, r.n) for r in rows}):
        mine = [r for r in rows if (r.w, r.n) == (w, n)]
        sizes = [r.keys for r in mine]
        axes.plot(sizes, [r.cold.pause_ms for r in mine], "--", marker="o", label=f"cold {w}->{n}")
        axes.plot(sizes, [r.hot.pause_ms for r in mine], "-", marker="s", label=f"hot {w}->{n}")
    axes.set_xscale("log")
    axes.set_xlabel("state (keys)")
    axes.set_ylabel("pause (ms, no step ran)")
    axes.set_title("sparkstep rescale pause against state size, under steady input")
    axes.axhline(300, color="grey", linewidth=0.8, linestyle=":")
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8, ncol=3)
    figure.tight_layout()
    figure.savefig(path)


def cold_main(args: argparse.Namespace) -> int:
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
        for w, n, reported in CHANGES:
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
