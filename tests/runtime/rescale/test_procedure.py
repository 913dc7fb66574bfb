"""The rescale procedure at the worker level: real worker processes and stores, no Spark.

The "runtime" here is :class:`Fleet`: it routes keyed rows to the owners of their shards with the
layout's epoch, checkpoints like the runtime (commit everywhere, manifest, reopen) and rescales
with :func:`sparkstep.runtime.rescale.run_procedure`, starting added workers and retiring others
as the coordinator does.
"""

from __future__ import annotations

import random
import shutil
import uuid
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from sparkstep.ids import LayoutEpoch, Step, Version, WorkerId
from sparkstep.runtime.driver import ensure_layouts
from sparkstep.runtime.errors import (
    RecoveryError,
    RescaleRequestError,
    ShardNotOwnedError,
    WorkerClosedError,
    WrongLayoutError,
)
from sparkstep.runtime.layout import Layout, initial_layout, plan_rescale
from sparkstep.runtime.manifest import Manifest, ManifestLease, read_manifest
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.rescale import RescaleResult, new_store_path, run_procedure
from sparkstep.runtime.worker.client import WorkerClient
from sparkstep.runtime.worker.service import EXPORTS_DIR
from tests.runtime.operators.models import integrate
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess

S = 32
SCHEMA = pa.schema([("k", pa.string()), ("x", pa.int64())])
AGGS = [Agg("count", None, "n"), Agg("sum", "x", "s")]
SPEC = OperatorSpec.aggregate("sums", SCHEMA, ["k"], AGGS)


def shard_of(key: str) -> int:
    return zlib.crc32(key.encode()) % S


def rows_table(rows: list[tuple[str, int]]) -> pa.Table:
    return pa.table(
        {
            "k": [k for k, _ in rows],
            "x": [x for _, x in rows],
            "__weight": [1] * len(rows),
            "__shard": [shard_of(k) for k, _ in rows],
        },
        schema=pa.schema([*SCHEMA, ("__weight", pa.int64()), ("__shard", pa.int64())]),
    )


class Fleet:
    """W worker processes on one state dir, driven like the runtime drives them."""

    def __init__(self, state_dir: Path, factory: WorkerFactory, workers: int) -> None:
        self.state_dir = state_dir
        self.factory = factory
        (state_dir / "workers").mkdir(parents=True)
        self.procs: list[WorkerProcess] = [
            factory(store=state_dir / f"workers/w{i}", shards=S) for i in range(workers)
        ]
        self.clients = [p.client() for p in self.procs]
        self.manifest = Manifest(
            deployment=str(uuid.uuid4()),
            name="fleet",
            layout=initial_layout(S, workers),
            stores=tuple(f"workers/w{i}" for i in range(workers)),
            version=Version(0),
            step=Step(0),
        )
        self.lease = ManifestLease.claim(state_dir)
        self.lease.write(self.manifest, expected=None)
        for client in self.clients:
            client.configure([SPEC], S)
        self.incarnations = [c.open(0) for c in self.clients]
        ensure_layouts(self.manifest, self.clients)
        self.step = 0
        self.deltas: list[pa.Table] = []
        self.sent: Counter[str] = Counter()
        self.sums: Counter[str] = Counter()

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    def run_step(self, rows: list[tuple[str, int]]) -> None:
        by_worker: dict[int, list[tuple[str, int]]] = {w: [] for w in range(self.layout.workers)}
        for k, x in rows:
            by_worker[self.layout.owners[shard_of(k)]].append((k, x))
            self.sent[k] += 1
            self.sums[k] += x
        for w, mine in by_worker.items():
            result = self.clients[w].apply(
                self.incarnations[w],
                self.step,
                "sums",
                f"d{self.step}",
                rows_table(mine),
                layout_epoch=self.layout.epoch,
            )
            self.deltas.append(result.delta)
        self.step += 1

    def checkpoint(self) -> None:
        for client in self.clients:
            client.commit(self.step)
        self.manifest = Manifest(
            deployment=self.manifest.deployment,
            name=self.manifest.name,
            layout=self.layout,
            stores=self.manifest.stores,
            version=Version(self.manifest.version + 1),
            step=Step(self.step),
        )
        self.lease.write(self.manifest, expected=Version(self.manifest.version - 1))
        self.incarnations = [c.open(self.manifest.version) for c in self.clients]

    def start_added(self, n: int) -> list[WorkerProcess]:
        """The workers a change to ``n`` adds, on new stores at the manifest's version."""
        epoch = self.layout.epoch + 1
        added = [
            self.factory(
                store=self.state_dir / new_store_path(i, epoch),
                shards=S,
                args=("--create-version", str(self.manifest.version)),
            )
            for i in range(self.layout.workers, n)
        ]
        for proc in added:
            proc.client().configure([SPEC], S)
        return added

    def switch(
        self,
        n: int,
        added: list[WorkerProcess],
        workers: list[WorkerClient],
        manifest: Manifest,
        incarnations: list[str],
    ) -> None:
        """After a rescale to ``n``: stop and delete the retired workers, adopt the new set."""
        assert read_manifest(self.state_dir) == manifest
        for proc, store in zip(self.procs[n:], self.manifest.stores[n:], strict=True):
            proc.client().shutdown()
            assert proc.wait(30) == 0
            shutil.rmtree(self.state_dir / store)
        self.procs = [*self.procs[:n], *added]
        self.clients, self.incarnations, self.manifest = workers, incarnations, manifest

    def rescale(self, n: int) -> RescaleResult:
        """The coordinator's part around the runtime's: start added workers, run, retire."""
        added = self.start_added(n)
        workers = [*self.clients[:n], *(p.client() for p in added)]
        manifest, incarnations, result = run_procedure(
            self.manifest, self.lease, self.clients, workers
        )
        self.switch(n, added, workers, manifest, incarnations)
        return result

    def keys_per_shard(self) -> dict[int, int]:
        """Keys of every shard over all workers; checks each worker holds only its shards."""
        total: Counter[int] = Counter()
        for w, client in enumerate(self.clients):
            doc = client.inspect()
            assert doc["layout_epoch"] == self.layout.epoch
            owned = set(self.layout.shards_of(WorkerId(w)))
            assert doc["owned"] == sorted(owned)
            held = {int(s): n for s, n in doc["tables"].get("state.sums", {}).items()}
            assert set(held) <= owned, f"worker {w} holds shards {set(held) - owned}"
            total.update(held)
        return dict(total)

    def shard_exports(self) -> dict[int, dict[str, Any]]:
        """Every shard exported alone (keys, bytes of its file), from its owner."""
        out = {}
        for shard, owner in enumerate(self.layout.owners):
            out[shard] = self.clients[owner].export_shards([shard], f"probe-s{shard}")
        return out

    def worker_exports(self) -> list[int]:
        """Bytes of every worker's whole state exported as one file per table."""
        sizes = []
        for w, client in enumerate(self.clients):
            shards = self.layout.shards_of(WorkerId(w))
            sizes.append(int(client.export_shards(shards, f"probe-w{w}")["bytes"]))
        return sizes

    def exports_left(self) -> list[Path]:
        """The export directories of the manifest's stores (emptied when a store reopens)."""
        return [
            path
            for store in self.manifest.stores
            if (path := self.state_dir / store / EXPORTS_DIR).exists() and any(path.iterdir())
        ]


def test_rescale_2_3_1_4_moves_only_the_planned_shards(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    fleet = Fleet(tmp_path / "state", worker_factory, workers=2)
    rng = random.Random(3)
    keys = 4000
    for n in (3, 1, 4):
        for _ in range(2):
            fleet.run_step([(f"k{rng.randrange(keys)}", rng.randrange(100)) for _ in range(3000)])
        fleet.checkpoint()
        before = fleet.manifest
        exports = fleet.shard_exports()
        wholes = fleet.worker_exports()
        expected_layout = plan_rescale(before.layout, n)
        moved = {m.shard for m in before.layout.moves_to(expected_layout)}

        result = fleet.rescale(n)

        assert (result.layout_epoch, result.workers) == (before.epoch + 1, n)
        assert (result.version, result.step) == (before.version + 1, before.step)
        assert fleet.layout == expected_layout
        assert result.shards_moved == len(moved)
        # Exactly the moved shards' keys crossed (digest entries included).
        assert result.keys_moved == sum(exports[s]["keys"] for s in moved)
        # Their bytes are the moved shards' share of the state, up to the fixed cost of an SST
        # file: from the single-shard files and one file per worker, solve
        # sum(single) = S * file + per_key * K and sum(whole) = W * file + per_key * K,
        # then predict the procedure's files (one per (source, target) pair).
        singles = sum(e["bytes"] for e in exports.values())
        file_cost = (singles - sum(wholes)) / (S - len(wholes))
        per_key = (sum(wholes) - len(wholes) * file_cost) / sum(e["keys"] for e in exports.values())
        pairs = len({(m.source, m.target) for m in before.layout.moves_to(expected_layout)})
        predicted = pairs * file_cost + per_key * result.keys_moved
        assert abs(result.bytes_moved - predicted) <= 0.05 * predicted, (result, predicted)
        assert fleet.exports_left() == []
        # Every key is held once, by the owner of its shard.
        per_shard = fleet.keys_per_shard()
        assert sum(per_shard.values()) == len(fleet.sent)
        for s, count in per_shard.items():
            assert count == sum(1 for k in fleet.sent if shard_of(k) == s)
    fleet.run_step([(f"k{rng.randrange(keys)}", rng.randrange(100)) for _ in range(3000)])
    integrated = integrate(fleet.deltas)
    assert all(w == 1 for w in integrated.values())
    assert {r[0]: r[1:] for r in integrated} == {
        k: (fleet.sent[k], fleet.sums[k]) for k in fleet.sent
    }


def test_same_w_is_a_new_epoch_that_moves_nothing(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    fleet = Fleet(tmp_path / "state", worker_factory, workers=2)
    fleet.run_step([(f"k{i}", i) for i in range(200)])
    fleet.checkpoint()
    result = fleet.rescale(2)
    assert (result.layout_epoch, result.shards_moved, result.bytes_moved) == (1, 0, 0)
    assert fleet.keys_per_shard() and result.retired == ()
    # Recovery against a manifest of another layout epoch (a mix) is refused.
    mixed = Manifest(
        deployment=fleet.manifest.deployment,
        name=fleet.manifest.name,
        layout=Layout(LayoutEpoch(0), 2, fleet.layout.owners),
        stores=fleet.manifest.stores,
        version=fleet.manifest.version,
        step=fleet.manifest.step,
    )
    with pytest.raises(RecoveryError, match="layout epoch 1, but the manifest"):
        ensure_layouts(mixed, fleet.clients)
    ensure_layouts(fleet.manifest, fleet.clients)


def test_bad_requests_change_nothing(worker_factory: WorkerFactory, tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "state", worker_factory, workers=2)
    fleet.run_step([(f"k{i}", i) for i in range(50)])
    fleet.checkpoint()
    manifest = fleet.manifest
    # An added worker whose store is not at the checkpoint's version.
    stale = worker_factory(store=fleet.state_dir / "workers/w2-e1", shards=S)
    with pytest.raises(RescaleRequestError, match="--create-version 1"):
        run_procedure(manifest, fleet.lease, fleet.clients, [*fleet.clients, stale.client()])
    # An added worker outside the state dir.
    outside = worker_factory(store=tmp_path / "elsewhere", shards=S, args=("--create-version", "1"))
    with pytest.raises(RescaleRequestError, match="outside a workers/ directory"):
        run_procedure(manifest, fleet.lease, fleet.clients, [*fleet.clients, outside.client()])
    # A kept worker at another address.
    swapped = [fleet.clients[1], fleet.clients[0]]
    with pytest.raises(RescaleRequestError, match="must keep its address"):
        run_procedure(manifest, fleet.lease, fleet.clients, swapped)
    assert read_manifest(fleet.state_dir) == manifest
    fleet.run_step([(f"k{i}", i) for i in range(50)])  # the old layout still runs


def test_worker_checks_the_layout_epoch_and_shard_of_every_apply(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    proc = worker_factory(store=tmp_path / "w", shards=S)
    client = proc.client()
    client.configure([SPEC], S)
    inc = client.open(0)
    rows = rows_table([("a", 1), ("b", 2)])
    # A store without a layout refuses an apply that names one.
    with pytest.raises(WrongLayoutError, match="holds no layout"):
        client.apply(inc, 0, "sums", "d", rows, layout_epoch=0)
    layout = Layout(LayoutEpoch(3), 2, plan_rescale(initial_layout(S, 2), 2).owners)
    client.set_layout(layout, 1)
    assert client.status()["layout_epoch"] == 3
    mine = [(k, 1) for k in ("a", "b", "c", "d", "e", "f") if layout.owners[shard_of(k)] == 1]
    theirs = [(k, 1) for k in ("a", "b", "c", "d", "e", "f") if layout.owners[shard_of(k)] == 0]
    assert mine and theirs
    with pytest.raises(WrongLayoutError, match=r"epoch 2.*epoch 3"):
        client.apply(inc, 0, "sums", "d", rows_table(mine), layout_epoch=2)
    with pytest.raises(WrongLayoutError):
        client.apply(inc, 0, "sums", "d", rows_table(mine))
    with pytest.raises(ShardNotOwnedError, match="does not own"):
        client.apply(inc, 0, "sums", "d", rows_table(mine + theirs), layout_epoch=3)
    client.apply(inc, 0, "sums", "d", rows_table(mine), layout_epoch=3)
    # The layout is part of the version: committed, reopened, still there.
    client.commit(1)
    client.open(1)
    status = client.status()
    assert (status["layout_epoch"], status["layout_worker"]) == (3, 1)
    # close_db: the worker stays, applies are refused.
    client.close_db()
    with pytest.raises(WorkerClosedError):
        client.apply(inc, 1, "sums", "d", rows_table(mine), layout_epoch=3)
    assert client.status()["open_version"] is None


def test_create_version_replaces_a_leftover_directory(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "w2-e1"
    first = worker_factory(store=path, shards=S, args=("--create-version", "4"))
    client = first.client()
    client.configure([SPEC], S)
    inc = client.open(4)
    client.apply(inc, 0, "sums", "d", rows_table([("a", 1)]))
    client.commit(1)
    assert client.versions() == range(4, 6)
    first.kill()  # a rescale that crashed before its manifest left this store behind
    again = worker_factory(store=path, shards=S, args=("--create-version", "7")).client()
    assert again.versions() == range(7, 8)
    again.configure([SPEC], S)
    again.open(7)
    assert again.inspect()["tables"] == {}
