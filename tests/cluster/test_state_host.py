"""``sparkstep state-host`` as real processes on 127.0.0.1, driven through the coordinator's
client side (:mod:`sparkstep.coordinator_api.hosts`): workers start where their stores are, a
worker's or a host's death is reported at once, slots are a hard limit, only stores are ever
deleted, and every refusal says why."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sparkstep.coordinator_api.children import wait_ready
from sparkstep.coordinator_api.errors import ConflictError
from sparkstep.coordinator_api.hosts import (
    HostedWorkers,
    RemoteWorker,
    StateHostClient,
    StateHostError,
    parse_state_hosts,
)
from sparkstep.coordinator_api.reset import ResetPlan, reset_pipeline
from sparkstep.errors import ConfigError
from sparkstep.io.config import KafkaConfig
from sparkstep.runtime.worker.client import WorkerClient
from tests.cluster.fixtures import HOST_TOKEN, StateHostProcess
from tests.coordinator_api.fixtures import pid_alive, sparkstep_cli, wait_until

SECRET = "the-coordinators-internal-secret-0123"
HostFactory = Callable[..., StateHostProcess]


_OPEN: list[HostedWorkers | StateHostClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def _hosted(*hosts: StateHostProcess, pipeline: str = "p1") -> HostedWorkers:
    placement = HostedWorkers(tuple(h.address for h in hosts), HOST_TOKEN, SECRET, 30.0)
    placement.bind_pipeline(pipeline)
    _OPEN.append(placement)
    return placement


def _client(host: StateHostProcess) -> StateHostClient:
    client = StateHostClient(host.address, HOST_TOKEN)
    _OPEN.append(client)
    return client


def _started(placement: HostedWorkers, stores: list[str]) -> list[RemoteWorker]:
    workers = [placement.start(i, store) for i, store in enumerate(stores)]
    wait_ready(workers, 120)
    return workers


def test_workers_start_on_their_host_and_their_deaths_are_reported_at_once(
    state_host_factory: HostFactory,
) -> None:
    host = state_host_factory("a", slots=2)
    placement = _hosted(host)
    placement.prepare(("workers/w0", "workers/w1"), fresh=True)
    w0, w1 = _started(placement, ["workers/w0", "workers/w1"])
    # A real worker, dialled by the address it advertised, with the coordinator's secret.
    client = WorkerClient(w0.address, SECRET)
    try:
        store = Path(str(client.status()["store"]))
    finally:
        client.close()
    assert store == host.data_dir / "pipelines" / "p1" / "workers" / "w0"
    assert w0.alive() and w1.alive()

    os.kill(w1.pid, signal.SIGKILL)
    wait_until(lambda: not w1.alive(), 10, "the worker's death reported")
    assert w1.describe_exit() == "was killed by SIGKILL"
    assert w0.alive()

    host.kill()  # its workers die with it
    wait_until(lambda: not w0.alive(), 15, "the host's loss reported")
    assert "was lost with its state host" in w0.describe_exit()
    wait_until(lambda: not pid_alive(w0.pid), 10, "the worker dying with its host")


def test_slots_are_a_hard_limit_and_a_new_worker_replaces_the_old_on_its_store(
    state_host_factory: HostFactory,
) -> None:
    host = state_host_factory("a", slots=2)
    placement = _hosted(host)
    placement.prepare((), fresh=True)
    first, _ = _started(placement, ["workers/w0", "workers/w1"])
    with pytest.raises(ConflictError, match=r"1 more workers need 1 free worker slots.*0 of 2"):
        placement.check_slots(1)
    with pytest.raises(ConflictError, match="no free worker slot on the state hosts"):
        placement.start(2, "workers/w2")
    client = _client(host)
    with pytest.raises(StateHostError, match="all 2 worker slots of this state host are taken"):
        client.start("p1", "workers/w2", SECRET, None, 30.0)
    # The same store again: the old worker is stopped first, so the slot count holds.
    again = _started(placement, ["workers/w0"])[0]
    wait_until(lambda: not first.alive(), 10, "the replaced worker's exit")
    assert again.alive() and again.pid != first.pid


def test_prepare_deletes_only_unlisted_stores_and_stops_stale_workers(
    state_host_factory: HostFactory,
) -> None:
    host = state_host_factory("a", slots=3)
    placement = _hosted(host)
    placement.prepare((), fresh=True)
    stale = _started(placement, ["workers/w0", "workers/w1", "workers/w2"])
    workers_dir = host.data_dir / "pipelines" / "p1" / "workers"
    (workers_dir / "notes").mkdir()  # not a store: never deleted
    # A coordinator after a crash: the manifest lists w0 and w1.
    again = _hosted(host)
    again.prepare(("workers/w0", "workers/w1"), fresh=False)
    assert sorted(p.name for p in workers_dir.iterdir()) == ["notes", "w0", "w1"]
    wait_until(lambda: not any(pid_alive(w.pid) for w in stale), 10, "the stale workers stopped")
    # The stores stay on their host; a store the manifest lists on no host is refused.
    with pytest.raises(ConfigError, match="lists the stores workers/w7, which no state host"):
        again.prepare(("workers/w0", "workers/w7"), fresh=False)


def test_a_store_is_placed_once_on_the_freest_host_and_found_there_again(
    state_host_factory: HostFactory,
) -> None:
    a, b = state_host_factory("a", slots=2), state_host_factory("b", slots=2)
    placement = _hosted(a, b)
    stores = ("workers/w0", "workers/w1", "workers/w2")
    placement.prepare(stores, fresh=True)
    workers = _started(placement, list(stores))
    assert [w.host for w in workers] == [a.address, b.address, a.address]  # spread evenly
    for worker in workers:
        worker.kill()
    # Listed the other way round, each store is found where it is.
    again = _hosted(b, a)
    again.prepare(stores, fresh=False)
    found = _started(again, list(stores))
    assert [w.host for w in found] == [a.address, b.address, a.address]
    # A store on two hosts is refused: one of them is stale.
    for worker in found:
        worker.kill()
    shutil.copytree(_store(a, "w0"), _store(b, "w0"))
    with pytest.raises(ConfigError, match="workers/w0 of pipeline p1 is on two state hosts"):
        _hosted(a, b).prepare(stores, fresh=False)


def _store(host: StateHostProcess, name: str) -> Path:
    return host.data_dir / "pipelines" / "p1" / "workers" / name


def test_refusals_say_why(state_host_factory: HostFactory, tmp_path: Path) -> None:
    host = state_host_factory("a")
    wrong = httpx.get(f"http://{host.address}/v1/host", headers={"authorization": "Bearer x"})
    assert wrong.status_code == 401
    client = _client(host)
    with pytest.raises(StateHostError, match=r"422 .*must be workers/<name>") as bad:
        client.start("p1", "../../etc", SECRET, None, 30.0)
    assert bad.value.status == 422
    with pytest.raises(StateHostError, match=r"422 .*pipeline name"):
        client.stores(".hidden")
    # A second state host on the same data dir: one line, exit 2.
    code, _, err = sparkstep_cli(
        "state-host", "--data-dir", str(host.data_dir), "--token-file", str(host.token_file),
        "--port", "0",
    )  # fmt: skip
    assert code == 2 and err.startswith("sparkstep: the state host data dir") and "in use" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = sparkstep_cli(
        "state-host", "--data-dir", str(tmp_path / "d"), "--token-file", str(tmp_path / "none")
    )
    assert code == 2 and err.startswith("sparkstep: cannot read the token file")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_state_hosts("a:1,b")


def test_a_coordinator_waits_for_a_host_that_does_not_answer() -> None:
    placement = HostedWorkers(("127.0.0.1:9",), HOST_TOKEN, SECRET, 30.0)
    _OPEN.append(placement)
    started = time.monotonic()
    with pytest.raises(StateHostError, match=r"127\.0\.0\.1:9 does not answer"):
        placement.check()
    assert time.monotonic() - started < 60


def test_reset_deletes_the_pipelines_stores_on_every_host_or_nothing(
    state_host_factory: HostFactory, bootstrap_servers: str, tmp_path: Path
) -> None:
    a, b = state_host_factory("a"), state_host_factory("b")
    placement = _hosted(a, b, pipeline="p2")
    placement.prepare(("workers/w0", "workers/w1"), fresh=True)
    for worker in _started(placement, ["workers/w0", "workers/w1"]):
        worker.kill()
    kafka = KafkaConfig.from_args(bootstrap_servers, ())
    down = ResetPlan("p2", tmp_path / "state", "p2.steps", bootstrap_servers, ("127.0.0.1:9",), "t")
    with pytest.raises(StateHostError, match="does not answer"):
        reset_pipeline(down, kafka)
    plan = ResetPlan(
        "p2", tmp_path / "state", "p2.steps", bootstrap_servers, (a.address, b.address), HOST_TOKEN
    )
    assert "its stores on the state hosts" in plan.describe()
    reset_pipeline(plan, kafka)
    assert _client(a).stores("p2") == [] and _client(b).stores("p2") == []
    assert not (a.data_dir / "pipelines" / "p2" / "token").exists()
