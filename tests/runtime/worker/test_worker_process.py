"""State worker processes: apply rules over the wire, crash safety, shard moves.

Real ``python -m sparkstep.runtime.worker`` children on real stores. The "runtime" here is the
test: it keeps a manifest version, opens it, re-runs steps from the store's ``get_step()`` and
commits after every step, exactly as recovery would.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle

from sparkstep.failpoints import FAILPOINT_EXIT_CODE
from sparkstep.runtime.errors import (
    DivisionMismatchError,
    FencedError,
    OperatorSpecError,
    PathRefusedError,
    ShardTransferError,
    StaleStepError,
    UnknownOperatorError,
    WorkerAuthError,
    WorkerClosedError,
    WorkerError,
    WrongOperatorsError,
)
from sparkstep.runtime.layout import initial_layout
from sparkstep.runtime.operators import Agg, OperatorSpec, fingerprint, spec_to_wire
from sparkstep.runtime.operators.base import decode_value, encode_value
from sparkstep.runtime.worker import StateWorker, WorkerClient
from sparkstep.runtime.worker.digest import MASK
from sparkstep.runtime.worker.server import FETCH_ATTEMPTS, STORE_CHANGING_ACTIONS
from sparkstep.runtime.worker.service import EXPORTS_DIR, IMPORTS_DIR
from sparkstep.storage import RocksDBStore
from sparkstep.storage.errors import StoreFencedError, WrongDeploymentError
from tests.runtime.operators.models import aggregate_model, integrate
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess

S = 8
SCHEMA = pa.schema([("k", pa.string()), ("x", pa.int64())])
AGGS = [Agg("count", None, "n"), Agg("sum", "x", "s"), Agg("min", "x", "lo")]
SPEC = OperatorSpec.aggregate("agg", SCHEMA, ["k"], AGGS)


def shard_of(key: str) -> int:
    return sum(key.encode()) % S


def batch(rows: list[tuple[str, int, int]]) -> pa.Table:
    return pa.table(
        {
            "k": [r[0] for r in rows],
            "x": [r[1] for r in rows],
            "__weight": [r[2] for r in rows],
            "__shard": [shard_of(r[0]) for r in rows],
        },
        schema=pa.schema([*SCHEMA, ("__weight", pa.int64()), ("__shard", pa.int64())]),
    )


def make_batches(seed: int, steps: int = 4, size: int = 40) -> list[pa.Table]:
    rng = random.Random(seed)
    live: list[tuple[str, int]] = []
    out = []
    for _ in range(steps):
        rows: list[tuple[str, int, int]] = []
        for _ in range(size):
            if live and rng.random() < 0.3:
                k, x = live.pop(rng.randrange(len(live)))
                rows.append((k, x, -1))
            else:
                k, x = f"k{rng.randrange(30)}", rng.randrange(-50, 50)
                live.append((k, x))
                rows.append((k, x, 1))
        out.append(batch(rows))
    return out


BATCHES = make_batches(7)
Record = dict[int, tuple[pa.Table, str]]


def drive(
    client: WorkerClient, manifest: dict[str, int], batches: list[pa.Table], record: Record
) -> None:
    """Open the manifest version, run the remaining steps, commit after each (a checkpoint)."""
    inc = client.open(manifest["version"])
    start = client.status()["step"]
    for s in range(start, len(batches)):
        result = client.apply(inc, s, "agg", f"division-{s}", batches[s])
        record[s] = (result.delta, result.state_digest)
        client.commit(s + 1)
        manifest["version"] += 1
        inc = client.open(manifest["version"])


def dump_store(path: Path, table: str = "state.agg") -> dict[bytes, bytes]:
    with RocksDBStore(path) as store:
        db = store.open(store.versions()[-1])
        try:
            return dict(db.items(table))
        finally:
            db.close()


@pytest.fixture(scope="module")
def reference(module_dir: Path) -> tuple[Record, dict[bytes, bytes]]:
    """The run without crashes, in process: per step (delta, digest), and the final state."""
    store = RocksDBStore(module_dir / "reference")
    worker = StateWorker(store, shards=S)
    worker.configure([SPEC], S)
    record: Record = {}
    inc = worker.open(0)
    for s, rows in enumerate(BATCHES):
        result = worker.apply(inc, s, "agg", f"division-{s}", rows)
        record[s] = (result.delta, result.state_digest)
        worker.commit(s + 1)
        inc = worker.open(s + 1)
    final = worker.dump("agg")
    worker.close()
    return record, final


@pytest.fixture(scope="module")
def shared(worker_factory: WorkerFactory) -> WorkerClient:
    """One worker process for the tests that do not kill it."""
    client = worker_factory(shards=S).client()
    client.configure([SPEC], S)
    return client


def test_same_apply_twice_returns_the_recorded_delta(shared: WorkerClient) -> None:
    inc = shared.open(shared.versions()[0])
    rows = batch([("a", 1, 1), ("b", 2, 1), ("a", 5, 1)])
    first = shared.apply(inc, 0, "agg", "d0", rows)
    second = shared.apply(inc, 0, "agg", "d0", rows)
    assert not first.replayed and second.replayed
    assert first.delta.equals(second.delta) and first.state_digest == second.state_digest
    assert sorted(first.delta.to_pylist(), key=str) == sorted(
        [
            {"k": "a", "n": 2, "s": 6, "lo": 1, "__weight": 1},
            {"k": "b", "n": 1, "s": 2, "lo": 2, "__weight": 1},
        ],
        key=str,
    )
    # Applied once: the next step sees count 2 for "a", not 4.
    nxt = shared.apply(inc, 1, "agg", "d1", batch([("a", 0, 1)]))
    assert nxt.delta.to_pylist() == [
        {"k": "a", "n": 2, "s": 6, "lo": 1, "__weight": -1},
        {"k": "a", "n": 3, "s": 6, "lo": 0, "__weight": 1},
    ]


def test_concurrent_identical_applies_apply_once(shared: WorkerClient) -> None:
    inc = shared.open(shared.versions()[0])
    rows = batch([(f"k{i % 7}", i, 1) for i in range(200)])
    barrier = threading.Barrier(4)
    results: list[Any] = []
    errors: list[BaseException] = []

    def task() -> None:
        client = WorkerClient(shared.address, shared.token)
        barrier.wait()
        try:
            results.append(client.apply(inc, 0, "agg", "same-division", rows))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=task) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 4
    assert sum(not r.replayed for r in results) == 1
    assert all(r.delta.equals(results[0].delta) for r in results)
    assert len({r.state_digest for r in results}) == 1
    after = shared.apply(inc, 1, "agg", "d1", batch([("k0", 0, 1)]))
    assert after.delta.to_pylist()[0]["n"] == sum(1 for i in range(200) if i % 7 == 0)


def test_different_division_digest_is_refused(shared: WorkerClient) -> None:
    inc = shared.open(shared.versions()[0])
    shared.apply(inc, 0, "agg", "division-a", batch([("a", 1, 1)]))
    with pytest.raises(DivisionMismatchError, match="division-a"):
        shared.apply(inc, 0, "agg", "division-b", batch([("a", 1, 1)]))
    shared.apply(inc, 1, "agg", "division-c", batch([("a", 1, 1)]))
    with pytest.raises(StaleStepError):
        shared.apply(inc, 0, "agg", "division-a", batch([("a", 1, 1)]))
    with pytest.raises(UnknownOperatorError):
        shared.apply(inc, 2, "nope", "x", batch([]))


def test_old_incarnation_is_fenced_after_a_new_open(shared: WorkerClient) -> None:
    old = shared.open(shared.versions()[0])
    shared.apply(old, 0, "agg", "d", batch([("a", 1, 1)]))
    new = shared.open(shared.versions()[0])
    assert new != old
    with pytest.raises(FencedError, match="incarnation"):
        shared.apply(old, 1, "agg", "d", batch([("a", 1, 1)]))
    # The new incarnation starts from the committed state: the old apply is gone.
    fresh = shared.apply(new, 0, "agg", "d", batch([("a", 1, 1)]))
    assert not fresh.replayed and fresh.delta.to_pylist()[0]["n"] == 1


def test_a_replaced_runtime_is_refused_on_every_store_changing_call(
    worker_factory: WorkerFactory, module_dir: Path
) -> None:
    """Fencing (issue 14 item 4): once generation 2 has called the worker, every call of
    generation 1 (or of none) that would change the store is refused, also by a new process on
    the same store (the fence is in the store); reads still answer."""
    store = module_dir / "fenced"
    proc = worker_factory(store=store, shards=S)
    old, new, anonymous = proc.client(), proc.client(), proc.client()
    old.generation, new.generation = 1, 2
    old.configure([SPEC], S)
    stale = old.open(0)
    old.apply(stale, 0, "agg", "d0", batch([("a", 1, 1)]))
    inc = new.open(0)  # the new runtime takes the store over
    sender = worker_factory(shards=S).client()  # an export to import from
    sender.configure([SPEC], S)
    sender.open(0)
    files = sender.export_shards([1], "x")["files"]

    def refused(client: WorkerClient) -> None:
        calls: dict[str, Any] = {
            "configure": lambda: client.configure([SPEC], S),
            "open": lambda: client.open(0),
            "commit": lambda: client.commit(1),
            "track": lambda: client.track([1]),
            "export": lambda: client.export_shards([1], "e"),
            "export_changes": lambda: client.export_changes([1], "e"),
            "import": lambda: client.import_files(sender.address, "x", files),
            "ingest": lambda: client.ingest("x", files),
            "drop": lambda: client.drop_shards([1]),
            "set_layout": lambda: client.set_layout(initial_layout(S, 1), 0),
            "close": client.close_db,
        }
        assert set(calls) == STORE_CHANGING_ACTIONS
        for name, call in calls.items():
            with pytest.raises(StoreFencedError, match="fenced at token 2"):
                call()
            assert new.status()["incarnation"] == inc, name  # the new owner's store, untouched

    refused(old)
    refused(anonymous)
    with pytest.raises(FencedError):  # its incarnation died with the newer open
        old.apply(stale, 0, "agg", "d0", batch([("a", 1, 1)]))
    assert old.versions() == range(0, 1) and old.status()["incarnation"] == inc
    new.apply(inc, 0, "agg", "d0", batch([("a", 1, 1)]))
    new.commit(1)
    # The worker process dies and comes back on its store: the fence is still there.
    proc.kill()
    again = worker_factory(store=store, shards=S)
    came_back = again.client()
    came_back.generation = 1
    with pytest.raises(StoreFencedError):
        came_back.commit(2)
    newest = again.client()
    newest.generation = 3
    newest.configure([SPEC], S)
    assert newest.versions() == range(0, 2) and newest.open(1)


def test_token_and_closed_state(worker_factory: WorkerFactory) -> None:
    proc = worker_factory(shards=S)
    with pytest.raises(WorkerAuthError):
        proc.client(token="wrong").versions()
    client = proc.client()
    client.configure([SPEC], S)
    with pytest.raises(WorkerClosedError):
        client.apply("nobody", 0, "agg", "d", batch([]))
    inc = client.open(0)
    client.commit(1)
    with pytest.raises(WorkerClosedError):
        client.apply(inc, 1, "agg", "d", batch([]))
    # Children die with their parent: EOF on stdin ends the process cleanly.
    proc.close_stdin()
    assert proc.wait(30) == 0


def test_configure_binds_the_store_to_its_operators_and_deployment(
    worker_factory: WorkerFactory, module_dir: Path
) -> None:
    fp = fingerprint([SPEC], S)
    assert fp == fingerprint([SPEC], S) != fingerprint([SPEC], S + 1)
    store = module_dir / f"bound-{uuid.uuid4().hex[:6]}"
    proc = worker_factory(store=store, shards=S)
    client = proc.client()
    assert client.status()["fingerprint"] is None and client.status()["deployment"] is None
    assert client.configure([SPEC], S, "dep-1") == fp
    assert (client.status()["fingerprint"], client.status()["deployment"]) == (fp, "dep-1")
    other = OperatorSpec.aggregate("agg", SCHEMA, ["k"], [Agg("count", None, "n")])
    with pytest.raises(WrongOperatorsError, match=fp):
        client.configure([other], S, "dep-1")
    with pytest.raises(WrongDeploymentError, match="dep-1"):
        client.configure([SPEC], S, "dep-2")
    # The binding is durable: a restarted worker on the store refuses the same.
    proc.kill()
    again = worker_factory(store=store, shards=S).client()
    with pytest.raises(WrongOperatorsError, match=fp):
        again.configure([other], S)
    assert again.configure([SPEC], S, "dep-1") == fp


def test_configure_takes_data_and_never_unpickles_the_body(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    client = worker_factory(shards=S).client()
    marker = tmp_path / "pwned"
    # What configure accepted before: a base64 cloudpickle of the spec list. Unpickling this
    # one would create the marker file.
    payload = cloudpickle.dumps(_Creates(str(marker)))  # type: ignore[no-untyped-call]
    flight_client = flight.FlightClient(f"grpc+tcp://{client.address}")
    options = flight.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {client.token}".encode())]
    )
    body = {"specs": base64.b64encode(payload).decode(), "shards": S}
    with pytest.raises(flight.FlightServerError, match="OperatorSpecError"):
        list(
            flight_client.do_action(flight.Action("configure", json.dumps(body).encode()), options)
        )
    flight_client.close()
    assert not marker.exists()
    # A spec is data; a malformed one is refused with the reason.
    wire = spec_to_wire(SPEC)
    assert json.loads(json.dumps(wire)) == wire
    with pytest.raises(OperatorSpecError, match="kind"):
        client._action("configure", {"specs": [{**wire, "kind": "exec"}], "shards": S})


class _Creates:
    """Unpickles into a file at ``path`` (what a hostile configure body could do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_shards_move_over_the_network_between_unrelated_dirs(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    # The stores share no directory: the receiver is never told where the sender's store is.
    a_store, b_store = tmp_path / "host-a" / "data" / "a", tmp_path / "host-b" / "b"
    a_store.parent.mkdir(parents=True)
    b_store.parent.mkdir(parents=True)
    a = worker_factory(store=a_store, shards=S).client()
    b = worker_factory(store=b_store, shards=S).client()
    for client in (a, b):
        client.configure([SPEC], S)
    inc = a.open(0)
    a.apply(inc, 0, "agg", "d0", batch([(f"key{i}", i, 1) for i in range(20)]))
    b.open(0)
    # Export: only a name inside the worker's own store directory.
    for name in ("../../escape", str(tmp_path / "elsewhere"), "a/b", ".."):
        with pytest.raises(PathRefusedError):
            a.export_shards([1, 2], name)
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escape").exists()
    exported = a.export_shards(list(range(S)), "ok")
    files = exported["files"]["state.agg"]
    assert all((a_store / EXPORTS_DIR / "ok" / f["file"]).is_file() for f in files)
    assert sum(f["bytes"] for f in files) == exported["bytes"]
    # The sender sends only plain files of its own exports: no other name, no link.
    (a_store / EXPORTS_DIR / "ok" / "link.sst").symlink_to(
        a_store / EXPORTS_DIR / "ok" / files[0]["file"]
    )
    for file in ("../../VERSION", "link.sst", "missing.sst"):
        # Refused by the receiver before it writes anything, or by the sender.
        forged = {"state.agg": [{"file": file, "sha256": files[0]["sha256"], "bytes": 1}]}
        with pytest.raises(PathRefusedError):
            b.import_files(a.address, "ok", forged)
    b.import_files(a.address, "ok", exported["files"])
    assert b.inspect()["tables"]["state.agg"] == a.inspect()["tables"]["state.agg"]
    # The fetched files are gone once ingested; the exports are gone at the next open.
    assert not any((b_store / IMPORTS_DIR).rglob("*.sst"))
    a.commit(1)
    a.open(1)
    assert not (a_store / EXPORTS_DIR).exists()


def _sender_and_receiver(
    worker_factory: WorkerFactory, tmp_path: Path, failpoint: str | None = None
) -> tuple[WorkerProcess, WorkerClient, WorkerClient]:
    """Two workers on unrelated dirs, both open: the sender (its process, armed with
    ``failpoint``, and its client) holds 20 keys of state, the receiver none."""
    a_store, b_store = tmp_path / "x" / "a", tmp_path / "y" / "b"
    a_store.parent.mkdir()
    b_store.parent.mkdir()
    sender = worker_factory(store=a_store, shards=S, failpoint=failpoint)
    a, b = sender.client(), worker_factory(store=b_store, shards=S).client()
    for client in (a, b):
        client.configure([SPEC], S)
    inc = a.open(0)
    a.apply(inc, 0, "agg", "d0", batch([(f"key{i}", i, 1) for i in range(20)]))
    b.open(0)
    return sender, a, b


def test_a_corrupt_transfer_is_retried_then_refused(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    sender, a, b = _sender_and_receiver(worker_factory, tmp_path)
    exported = a.export_shards(list(range(S)), "bad")
    # The fault: the sender's file changes after the export reported its checksum.
    sent = sender.store / EXPORTS_DIR / "bad" / exported["files"]["state.agg"][0]["file"]
    data = bytearray(sent.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sent.write_bytes(bytes(data))
    with pytest.raises(
        ShardTransferError,
        match=rf"sha256.*{FETCH_ATTEMPTS} attempts|{FETCH_ATTEMPTS} attempts.*sha256",
    ):
        b.import_files(a.address, "bad", exported["files"])
    assert not b.inspect()["tables"].get("state.agg")
    # An intact export of the same shards then moves.
    good = a.export_shards(list(range(S)), "good")
    b.import_files(a.address, "good", good["files"])
    assert b.inspect()["tables"]["state.agg"] == a.inspect()["tables"]["state.agg"]


def test_a_stream_that_breaks_once_is_fetched_again_and_moves(
    worker_factory: WorkerFactory, tmp_path: Path
) -> None:
    """The sender's stream fails after its first chunk, once (a failed read or a broken
    connection): the receiver restarts the transfer and the shards arrive whole."""
    sender, a, b = _sender_and_receiver(worker_factory, tmp_path, "worker.get.after_chunk:raise")
    exported = a.export_shards(list(range(S)), "flaky")
    b.import_files(a.address, "flaky", exported["files"])
    assert b.inspect()["tables"]["state.agg"] == a.inspect()["tables"]["state.agg"]
    assert "failpoint worker.get.after_chunk raises (hit 1)" in sender.log.read_text()


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_aggregate_through_the_worker_matches_model(
    shared: WorkerClient, data: st.DataObject
) -> None:
    name = f"agg{data.draw(st.integers(0, 2**31))}"
    spec = OperatorSpec.aggregate(name, SCHEMA, ["k"], AGGS)
    shared.configure([SPEC, spec], S)
    inc = shared.open(shared.versions()[0])
    base = shared.status()["step"]
    live: Counter[tuple[Any, ...]] = Counter()
    deltas = []
    for s in range(data.draw(st.integers(1, 6))):
        inserts = data.draw(
            st.lists(st.tuples(st.sampled_from("abcd"), st.integers(-9, 9)), max_size=8)
        )
        pool = sorted(live.elements())
        retract = (
            data.draw(st.lists(st.sampled_from(pool), max_size=4, unique=True)) if pool else []
        )
        rows = [(k, x, 1) for k, x in inserts] + [(k, x, -1) for k, x in retract]
        for k, x, w in rows:
            live[(k, x)] += w
        live = +live
        deltas.append(shared.apply(inc, base + s, name, f"d{s}", batch(rows)).delta)
        integrated = integrate(deltas)
        assert all(w == 1 for w in integrated.values())
        model = aggregate_model(live, [("count", None), ("sum", 1), ("min", 1)])
        assert {r[0]: r[1:] for r in integrated} == model


# -- crashes ----------------------------------------------------------------------------------

FAILPOINTS = [
    "worker.apply.before_write@2",
    "worker.apply.after_write@2",
    "worker.commit.before_commit@2",
    "worker.commit.after_commit@2",
    "store.commit.after_checkpoint@3",
    "store.commit.after_version_file@1",
    "store.open.after_copy@3",
]


def _recover_and_finish(
    worker_factory: WorkerFactory, store: Path, manifest: dict[str, int], record: Record
) -> None:
    proc = worker_factory(store=store, shards=S)
    client = proc.client()
    client.configure([SPEC], S)
    assert manifest["version"] in client.versions()
    drive(client, manifest, BATCHES, record)
    client.shutdown()
    assert proc.wait(30) == 0


def _check(reference: tuple[Record, dict[bytes, bytes]], record: Record, store: Path) -> None:
    ref_record, ref_state = reference
    assert sorted(record) == sorted(ref_record)
    for s, (delta, digest) in ref_record.items():
        assert record[s][0].equals(delta), s
        assert record[s][1] == digest, s
    assert dump_store(store) == ref_state


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_crash_at_failpoint_then_rerun_is_as_if_once(
    worker_factory: WorkerFactory, module_dir: Path, reference: Any, failpoint: str
) -> None:
    store = module_dir / f"crash-{failpoint.replace('@', '-')}"
    manifest = {"version": 0}
    record: Record = {}
    proc = worker_factory(store=store, shards=S, failpoint=failpoint)
    client = proc.client()
    client.configure([SPEC], S)
    with pytest.raises(WorkerError):
        drive(client, manifest, BATCHES, record)
    assert proc.wait(30) == FAILPOINT_EXIT_CODE
    _recover_and_finish(worker_factory, store, manifest, record)
    _check(reference, record, store)


def test_random_sigkill_trials(
    worker_factory: WorkerFactory, module_dir: Path, reference: Any, long_run: bool
) -> None:
    rng = random.Random()
    for trial in range(20 if long_run else 2):
        store = module_dir / f"sigkill-{trial}-{rng.randrange(10**6)}"
        manifest = {"version": 0}
        record: Record = {}
        proc = worker_factory(store=store, shards=S)
        client = proc.client()
        client.configure([SPEC], S)
        killer = threading.Timer(rng.uniform(0.0, 0.4), proc.kill)
        killer.start()
        with contextlib.suppress(WorkerError):  # the kill may come after the last step
            drive(client, manifest, BATCHES, record)
        killer.join()
        proc.kill()
        _recover_and_finish(worker_factory, store, manifest, record)
        _check(reference, record, store)


def test_sigkill_loses_nothing_committed(worker_factory: WorkerFactory, module_dir: Path) -> None:
    store = module_dir / "committed"
    proc = worker_factory(store=store, shards=S)
    client = proc.client()
    client.configure([SPEC], S)
    inc = client.open(0)
    first = client.apply(inc, 0, "agg", "d0", batch([("a", 3, 1), ("b", 4, 1)]))
    client.commit(1)
    inc = client.open(1)
    client.apply(inc, 1, "agg", "d1", batch([("a", 100, 1)]))  # not committed
    before = client.versions()
    proc.kill()
    proc = worker_factory(store=store, shards=S)
    client = proc.client()
    client.configure([SPEC], S)
    assert client.versions() == before == range(0, 2)  # open(1) keeps 0 until a commit
    inc = client.open(1)
    assert client.status()["step"] == 1
    empty = client.apply(inc, 1, "agg", "d1", batch([]))
    assert empty.state_digest == first.state_digest and empty.delta.num_rows == 0
    retract = client.apply(inc, 2, "agg", "d2", batch([("a", 3, -1)]))
    assert retract.delta.to_pylist() == [{"k": "a", "n": 1, "s": 3, "lo": 3, "__weight": -1}]


def test_export_import_drop_moves_exactly_the_shards(
    worker_factory: WorkerFactory, module_dir: Path
) -> None:
    a_store, b_store = module_dir / "move-a", module_dir / "move-b"
    rows = batch([(f"key{i}", i, 1) for i in range(100)])
    a = worker_factory(store=a_store, shards=S).client()
    a.configure([SPEC], S)
    inc_a = a.open(0)
    before = a.apply(inc_a, 0, "agg", "d0", rows)
    a.commit(1)
    inc_a = a.open(1)
    b = worker_factory(store=b_store, shards=S).client()
    b.configure([SPEC], S)
    inc_b = b.open(0)
    moving = [5, 6, 7]
    exported = a.export_shards(moving, "move-files")
    assert exported["keys"] > 0 and "state.agg" in exported["files"]
    b.import_files(a.address, "move-files", exported["files"])
    a.drop_shards(moving)
    # Digests are per shard and move with the data: the totals still add up.
    da = a.apply(inc_a, 1, "agg", "d1", batch([])).state_digest
    db_ = b.apply(inc_b, 1, "agg", "d1", batch([])).state_digest
    assert (int(da, 16) + int(db_, 16)) & MASK == int(before.state_digest, 16)
    a.commit(2)
    b.commit(2)
    a.shutdown()
    b.shutdown()
    for proc_store, shards in ((a_store, set(range(5))), (b_store, set(moving))):
        dumped = _wait_dump(proc_store)
        held = {int.from_bytes(k[:4], "big") for k in dumped}
        assert held <= shards
        # A record key, or a min's multiset (its record key + a column byte): the key.
        keys = {encode_value(decode_value(k[4:])) for k in dumped if len(k) > 4}
        expected = {encode_value([f"key{i}"]) for i in range(100) if shard_of(f"key{i}") in shards}
        assert keys == expected


def _wait_dump(store: Path) -> dict[bytes, bytes]:
    """Dump a store once its worker has released the lock (bounded wait in the store)."""
    with RocksDBStore(store, lock_timeout=30) as st_:
        db = st_.open(st_.versions()[-1])
        try:
            return dict(db.items("state.agg"))
        finally:
            db.close()


_PARENT = """
import json, subprocess, sys
proc = subprocess.Popen(
    [sys.executable, "-m", "sparkstep.runtime.worker", "--store", sys.argv[1], "--port", "0",
     "--token-file", sys.argv[2], "--ignore-stdin"],
    stdout=subprocess.PIPE,
)
ready = json.loads(proc.stdout.readline())
print(json.dumps({"worker": ready["pid"]}), flush=True)
proc.wait()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_worker_dies_with_its_parent(module_dir: Path, token_file: Path) -> None:
    """PR_SET_PDEATHSIG: SIGKILL the parent (stdin watching off) and the worker goes too."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(module_dir / "orphan"), str(token_file)],
        stdout=subprocess.PIPE,
    )
    assert parent.stdout is not None
    worker_pid = json.loads(parent.stdout.readline())["worker"]
    assert not _gone(worker_pid)
    parent.kill()
    parent.wait(30)
    parent.stdout.close()
    deadline = time.monotonic() + 30
    try:
        while not _gone(worker_pid):
            assert time.monotonic() < deadline, "the worker outlived its parent"
            time.sleep(0.05)
    finally:
        if not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_join_and_stateful_map_through_the_worker(shared: WorkerClient) -> None:
    """Both join inputs travel over the wire; a closure travels by value (cloudpickle)."""
    left = pa.schema([("k", pa.string()), ("lv", pa.int64())])
    right = pa.schema([("k", pa.string()), ("rv", pa.int64())])
    join = OperatorSpec.join("j", left, right, ["k"])
    bonus = 1000

    def fn(key, rows, state, ctx):
        total = (state or {"total": 0})["total"]
        if ctx.timed_out:
            return [{"total": -total}], None
        total += sum(rows.column("x").to_pylist()) + bonus
        return [{"total": total}], {"total": total}

    schema = pa.schema([("k", pa.string()), ("x", pa.int64())])
    smap = OperatorSpec.stateful_map(
        "m",
        schema,
        ["k"],
        fn,
        pa.schema([("total", pa.int64())]),
        pa.schema([("total", pa.int64())]),
        timeout_ms=50,
    )
    shared.configure([SPEC, join, smap], S)
    inc = shared.open(shared.versions()[0])
    step = shared.status()["step"]

    def side(rows: list[tuple[str, int]], col: str) -> pa.Table:
        return pa.table(
            {
                "k": [r[0] for r in rows],
                col: [r[1] for r in rows],
                "__weight": [1] * len(rows),
                "__shard": [shard_of(r[0]) for r in rows],
            }
        )

    assert shared.apply(inc, step, "j", "d", side([("a", 1)], "lv"), input=0).delta.num_rows == 0
    joined = shared.apply(inc, step, "j", "d", side([("a", 7), ("b", 8)], "rv"), input=1)
    assert joined.delta.to_pylist() == [{"k": "a", "lv": 1, "rv": 7, "__weight": 1}]

    first = shared.apply(inc, step, "m", "d", side([("a", 1), ("a", 2)], "x"), step_time_ms=100)
    assert first.delta.to_pylist() == [{"k": "a", "total": 1003, "__weight": 1}]
    quiet = shared.apply(inc, step + 1, "m", "d", side([], "x"), step_time_ms=149)
    assert quiet.delta.num_rows == 0
    fired = shared.apply(inc, step + 2, "m", "d", side([], "x"), step_time_ms=150)
    assert fired.delta.to_pylist() == [{"k": "a", "total": -1003, "__weight": 1}]
