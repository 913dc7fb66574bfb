"""The hot rescale procedure at the worker level: real worker processes and stores, no Spark,
with steps applied in another thread while the moving shards are copied.

The steps carry retractions, so keys are deleted as well as changed while the copy runs; the
catch-up must ship both. The outcome is checked against the rows sent: every key held once, by
the owner of its shard, and the integrated deltas equal the oracle.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pytest
import rocksdict

from sparkstep.ids import Step
from sparkstep.runtime import rescale as rescale_module
from sparkstep.runtime.errors import RescaleAbortedError
from sparkstep.runtime.layout import plan_rescale
from sparkstep.runtime.manifest import read_manifest
from sparkstep.runtime.rescale import RescaleResult, new_store_path, run_hot_procedure
from sparkstep.runtime.worker.digest import MASK, entry_hash, read_digest_value
from sparkstep.runtime.worker.service import IMPORTS_DIR
from sparkstep.storage.keys import SHARD_PREFIX_BYTES
from sparkstep.storage.layout import TABLE_PREFIX, VERSIONS_DIR
from sparkstep.storage.options import RocksDBOptions
from tests.runtime.operators.models import integrate
from tests.runtime.rescale.test_procedure import SCHEMA, SPEC, Fleet, S, shard_of
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess

KEYS = 3000


def weighted_rows(rows: list[tuple[str, int, int]]) -> pa.Table:
    return pa.table(
        {
            "k": [k for k, _, _ in rows],
            "x": [x for _, x, _ in rows],
            "__weight": [w for _, _, w in rows],
            "__shard": [shard_of(k) for k, _, _ in rows],
        },
        schema=pa.schema([*SCHEMA, ("__weight", pa.int64()), ("__shard", pa.int64())]),
    )


class ChurningFleet(Fleet):
    """A fleet whose steps add and retract rows, so keys appear, change and vanish."""

    def __init__(self, state_dir: Path, factory: WorkerFactory, workers: int) -> None:
        super().__init__(state_dir, factory, workers)
        self.live: list[tuple[str, int]] = []  # rows sent and not retracted
        self.rng = random.Random(11)

    def churn(self) -> None:
        rows: list[tuple[str, int, int]] = []
        for _ in range(400):
            if self.live and self.rng.random() < 0.3:
                k, x = self.live.pop(self.rng.randrange(len(self.live)))
                rows.append((k, x, -1))
            else:
                k, x = f"k{self.rng.randrange(KEYS)}", self.rng.randrange(100)
                self.live.append((k, x))
                rows.append((k, x, 1))
        by_worker: dict[int, list[tuple[str, int, int]]] = {
            w: [] for w in range(self.layout.workers)
        }
        for row in rows:
            by_worker[self.layout.owners[shard_of(row[0])]].append(row)
        for w, mine in by_worker.items():
            result = self.clients[w].apply(
                self.incarnations[w],
                self.step,
                "sums",
                f"d{self.step}",
                weighted_rows(mine),
                layout_epoch=self.layout.epoch,
            )
            self.deltas.append(result.delta)
        self.step += 1

    def oracle(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        counts: Counter[str] = Counter(k for k, _ in self.live)
        for k, x in self.live:
            n, s = out.get(k, (0, 0))
            out[k] = (n + 1, s + x)
        assert all(out[k][0] == counts[k] for k in out)
        return out


class StepThread:
    """Runs the fleet's steps until paused, as the runtime's loop does during a hot rescale."""

    def __init__(self, fleet: ChurningFleet) -> None:
        self.fleet = fleet
        self.pausing = threading.Event()
        self.paused = threading.Event()
        self.failure: BaseException | None = None
        self.steps_while_copying = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.pausing.is_set():
                self.fleet.churn()
                self.steps_while_copying += 1
        except BaseException as exc:  # reported by the test
            self.failure = exc
        self.paused.set()

    def then_a_step(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call``, then a wait until the steps ran one more step (unless they are pausing):
        the state changes after every copy round, whatever the machine's speed."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen = self.steps_while_copying
            answer = call(*args, **kwargs)
            while not self.pausing.is_set() and self.steps_while_copying == seen:
                assert self.failure is None, self.failure
                time.sleep(0.005)
            return answer

        return wrapped

    def pause(self) -> Step:
        """The loop's pause: stop at the top of the next step; returns its number."""
        self.pausing.set()
        assert self.paused.wait(60)
        return Step(self.fleet.step)


def hot_rescale(
    fleet: ChurningFleet, n: int, catchup_keys: int
) -> tuple[RescaleResult, StepThread]:
    """The coordinator's part around the runtime's, with steps running until the pause."""
    added = fleet.start_added(n)
    workers = [*fleet.clients[:n], *(p.client() for p in added)]
    steps = StepThread(fleet)
    for client in fleet.clients:  # a step after every round, however fast the copy
        client.export_shards = steps.then_a_step(client.export_shards)  # type: ignore[method-assign]
        client.export_changes = steps.then_a_step(client.export_changes)  # type: ignore[method-assign]
    manifest, incarnations, result = run_hot_procedure(
        fleet.manifest, fleet.lease, fleet.clients, workers, steps.pause, None, catchup_keys
    )
    assert steps.failure is None, steps.failure
    assert steps.paused.is_set()  # the procedure returns with the steps paused
    fleet.switch(n, added, workers, manifest, incarnations)
    return result, steps


def check_digests(fleet: Fleet) -> None:
    """In every store's committed version, each shard's digest record is the sum of its
    entries' hashes (a catch-up that missed a digest key would leave the copy's)."""
    for store in fleet.manifest.stores:
        path = fleet.state_dir / store / VERSIONS_DIR / str(fleet.manifest.version)
        options = RocksDBOptions().to_options()
        families = rocksdict.Rdict.list_cf(str(path), options)
        db = rocksdict.Rdict(
            str(path),
            options,
            column_families={f: RocksDBOptions().to_options() for f in families if f != "default"},
            access_type=rocksdict.AccessType.read_only(),
        )
        try:
            table = db.get_column_family(TABLE_PREFIX + "state.sums")
            stored: dict[bytes, int] = {}
            summed: Counter[bytes] = Counter()
            entries = cast(list[tuple[bytes, bytes]], list(table.items()))
            for key, value in entries:
                if len(key) == SHARD_PREFIX_BYTES:
                    stored[key] = read_digest_value(value)
                else:
                    summed[key[:SHARD_PREFIX_BYTES]] += entry_hash(key, value)
            assert stored.keys() >= summed.keys()
            for prefix, digest in stored.items():
                assert digest == summed[prefix] & MASK, (store, prefix)
        finally:
            db.close()


def check_exact(fleet: ChurningFleet) -> None:
    """Every key held once by its shard's owner; the integrated output equals the oracle."""
    oracle = fleet.oracle()
    per_shard = fleet.keys_per_shard()
    assert sum(per_shard.values()) == len(oracle)
    for s, count in per_shard.items():
        assert count == sum(1 for k in oracle if shard_of(k) == s)
    integrated = integrate(fleet.deltas)
    assert all(w == 1 for w in integrated.values())
    assert {r[0]: r[1:] for r in integrated} == oracle


@pytest.mark.parametrize("catchup_keys", [0, 10**9], ids=["every-round", "one-round"])
def test_hot_rescale_copies_while_steps_run_and_ships_only_the_changes(
    worker_factory: WorkerFactory, tmp_path: Path, catchup_keys: int
) -> None:
    # 0: every change is "too many", so all MAX_ROUNDS rounds run; 10**9: the copy only.
    fleet = ChurningFleet(tmp_path / "state", worker_factory, workers=2)
    for _ in range(6):
        fleet.churn()
    fleet.checkpoint()
    for _ in range(2):  # steps after the checkpoint: the rescale's commit covers them
        fleet.churn()
    for n in (3, 2):
        before = fleet.manifest
        expected_layout = plan_rescale(before.layout, n)
        result, steps = hot_rescale(fleet, n, catchup_keys)

        assert result.mode == "hot"
        assert (result.layout_epoch, result.workers) == (before.epoch + 1, n)
        assert (result.version, result.step) == (before.version + 1, fleet.step)
        assert fleet.layout == expected_layout
        assert result.rounds == (rescale_module.MAX_ROUNDS if catchup_keys == 0 else 1)
        assert result.bytes_moved == result.bytes_precopied + result.bytes_paused
        assert result.bytes_precopied > 0
        assert set(result.pause_parts_ms) >= {"catch_up", "ingest", "commit", "reopen"}
        # Nothing staged is left behind: every fetched export was ingested.
        for store in fleet.manifest.stores:
            imports = fleet.state_dir / store / IMPORTS_DIR
            assert not imports.exists() or not any(imports.iterdir())
        check_exact(fleet)
        check_digests(fleet)
        fleet.churn()
        check_exact(fleet)
        # The steps between the checkpoint and the pause are in the rescale's commit.
        assert fleet.manifest.step == result.step
        # Steps ran while copying: at least one after every round.
        assert steps.steps_while_copying >= result.rounds
        assert result.keys_paused > 0  # and their changes were shipped in the pause


def test_a_hot_rescale_that_fails_before_its_pause_changes_nothing(
    worker_factory: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = ChurningFleet(tmp_path / "state", worker_factory, workers=2)
    for _ in range(4):
        fleet.churn()
    fleet.checkpoint()
    fleet.churn()
    before = fleet.manifest
    added: WorkerProcess = worker_factory(
        store=fleet.state_dir / new_store_path(2, before.epoch + 1),
        shards=S,
        args=("--create-version", str(before.version)),
    )
    target = added.client()
    target.configure([SPEC], S)
    fetch = target.import_files

    def die_then_fetch(*args: Any, **kwargs: Any) -> None:
        added.kill()  # the fault: the target dies as the copy starts to arrive
        fetch(*args, **kwargs)

    monkeypatch.setattr(target, "import_files", die_then_fetch)
    paused: list[bool] = []

    def begin() -> Step:
        paused.append(True)
        return Step(fleet.step)

    with pytest.raises(RescaleAbortedError, match="before its pause"):
        run_hot_procedure(before, fleet.lease, fleet.clients, [*fleet.clients, target], begin)
    assert paused == []  # never paused
    assert read_manifest(fleet.state_dir) == before
    assert all(c.status()["tracked_keys"] is None for c in fleet.clients)  # tracking ended
    fleet.churn()  # the old layout runs on, and checkpoints as before
    fleet.checkpoint()
    check_exact(fleet)
