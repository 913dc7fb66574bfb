"""Where the state workers run: as the coordinator's own children, or on state hosts.

The launcher and the rescale procedure start, watch and end workers through one interface,
:class:`WorkerPlacement`, with two implementations:

- :class:`LocalWorkers` (the default, no ``--state-hosts``): every worker is a child of the
  coordinator, its store ``<state_dir>/workers/<s>``.
- :class:`HostedWorkers` (``--state-hosts HOST:PORT,...``): every worker runs on a
  ``sparkstep state-host`` (:mod:`~sparkstep.coordinator_api.statehost`), its store
  ``<data_dir>/pipelines/<pipeline>/workers/<s>`` on that host.

Either way a store is named as the manifest lists it, ``workers/<s>``, and a worker is a
:class:`WorkerProcess`: ``alive()``, ``describe_exit()``, ``kill()``, ``release(timeout)``,
``poll_ready()``, its ``address`` once ready.

Placement on state hosts (:meth:`HostedWorkers.prepare`, at every launch):

1. Ask every host which of the pipeline's stores it holds. A store is where it is: state stays
   on the disk it was written to, so a worker always starts on the host holding its store. A
   store on two hosts, or a store the manifest lists on none, is a configuration error that
   restarting cannot fix (the message says which host to look at).
2. Every host stops the pipeline's workers still running there (a crashed coordinator's) and
   deletes its stores that the manifest does not list (:func:`~sparkstep.storage.is_store`).
3. Stores found nowhere (a fresh state dir, or a rescale's added stores) go to the host with
   the most free slots, first in ``--state-hosts`` order on a tie: spread evenly.

Deaths are reported at once: per host a thread holds the host's event stream
(``GET /v1/events``), which says every worker exit and beats every second. A stream that
breaks or stays silent for :data:`_SILENCE_S` means the host is lost, and so is every worker
on it (they die with their host). A host that does not answer before a launch is waited for
with backoff, like the Kafka cluster (:class:`StateHostUnreachableError`). A rescale that needs
more workers than the hosts have free slots is refused with 409 before it pauses anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import httpx

from sparkstep.coordinator_api.children import Child, spawn
from sparkstep.coordinator_api.errors import ConflictError, CoordinatorError, LaunchError
from sparkstep.errors import ConfigError
from sparkstep.runtime.manifest import STORES_DIR
from sparkstep.storage import is_store

__all__ = [
    "HostedWorkers",
    "LocalWorkers",
    "RemoteWorker",
    "StateHostClient",
    "StateHostError",
    "StateHostUnreachableError",
    "WORKERS_DIR",
    "WorkerPlacement",
    "WorkerProcess",
    "parse_state_hosts",
]

log = logging.getLogger("sparkstep.coordinator")

WORKERS_DIR = STORES_DIR  # the manifest names a store workers/<s>
_SILENCE_S = 5.0
"""A host whose event stream says nothing (not even a beat) this long is lost."""
_CONNECT_S = 10.0


class WorkerProcess(Protocol):
    """A state worker process, wherever it runs."""

    role: str
    store: str | None
    host: str | None  # the state host it runs on; None for the coordinator's own child

    @property
    def pid(self) -> int: ...

    @property
    def address(self) -> str: ...

    def poll_ready(self) -> bool: ...

    def alive(self) -> bool: ...

    def describe_exit(self) -> str: ...

    def kill(self) -> None: ...

    def release(self, timeout: float) -> bool: ...


class WorkerPlacement(Protocol):
    """Starts workers where their stores are; see the module docstring."""

    def check(self) -> None:
        """Raise :class:`StateHostUnreachableError` if a place for workers does not answer."""

    def prepare(self, stores: tuple[str, ...], fresh: bool) -> None:
        """Before a launch: find or place ``stores`` (``fresh``: no manifest lists them), stop
        stale workers, delete unlisted stores."""

    def start(self, index: int, store: str, create_version: int | None = None) -> WorkerProcess:
        """Start worker ``index`` on ``store`` (created at ``create_version`` if given)."""

    def check_slots(self, more: int) -> None:
        """:class:`ConflictError` unless ``more`` workers more can start."""

    def remove_stores(self, stores: Iterable[str], listed: set[str]) -> None:
        """Delete each of ``stores`` not in ``listed`` that sparkstep created as a store."""

    def describe(self, worker: WorkerProcess) -> str:
        """Where ``worker`` runs, for logs."""


# -- the coordinator's own children ----------------------------------------------------------


class LocalWorkers:
    """Workers as children of the coordinator, stores under ``<state_dir>/workers/``."""

    def __init__(
        self,
        state_dir: Path,
        spawner: ThreadPoolExecutor,
        python: str,
        token_file: Path,
        lock_timeout_s: float,
        network_argv: list[str],
        env: Mapping[str, str],
    ) -> None:
        self.state_dir = state_dir
        self._spawner = spawner
        self.python = python
        self.token_file = token_file
        self.lock_timeout_s = lock_timeout_s
        self.network_argv = network_argv
        self.env = dict(env)
        # What prepare found under workers/ and did not create (logged once each).
        self._left_alone: set[Path] = set()

    def check(self) -> None:
        return None

    def prepare(self, stores: tuple[str, ...], fresh: bool) -> None:
        root = self.state_dir / WORKERS_DIR
        if not root.is_dir():
            return
        keep = {(self.state_dir / s).resolve() for s in stores}
        for path in sorted(root.iterdir()):
            if path.resolve() in keep:
                continue
            if is_store(path):
                log.warning("removing %s: a store the manifest does not list", path)
                shutil.rmtree(path)
            elif path not in self._left_alone:
                self._left_alone.add(path)
                log.warning("leaving %s alone: sparkstep did not create it as a store", path)

    def start(self, index: int, store: str, create_version: int | None = None) -> Child:
        path = self.state_dir / store
        argv = [
            self.python, "-m", "sparkstep.runtime.worker",
            "--store", str(path),
            "--port", "0",
            "--token-file", str(self.token_file),
            "--lock-timeout", str(self.lock_timeout_s),
            *self.network_argv,
        ]  # fmt: skip
        if create_version is not None:
            argv += ["--create-version", str(create_version)]
        log_dir = self.state_dir / "logs"
        child = self._spawner.submit(
            spawn, f"worker {index}", f"worker-{path.name}", argv, log_dir, self.env
        ).result()
        child.store = store
        return child

    def check_slots(self, more: int) -> None:
        return None

    def remove_stores(self, stores: Iterable[str], listed: set[str]) -> None:
        for store in stores:
            path = self.state_dir / store
            if store not in listed and is_store(path):
                shutil.rmtree(path, ignore_errors=True)

    def describe(self, worker: WorkerProcess) -> str:
        return str(worker.pid)


# -- state hosts ---------------------------------------------------------------------------


class StateHostError(CoordinatorError):
    """A state host refused a call (``status``: its HTTP status) or cannot be reached (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StateHostUnreachableError(StateHostError):
    """A state host does not answer (waited for with backoff before a launch)."""


def parse_state_hosts(text: str | Iterable[str]) -> tuple[str, ...]:
    """``HOST:PORT,HOST:PORT`` (or a list of them) as a tuple; :class:`ValueError` if one has
    no port or one is given twice."""
    items = text.split(",") if isinstance(text, str) else list(text)
    hosts = tuple(item.strip() for item in items if item.strip())
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"state host {host!r} must be HOST:PORT")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"a state host is given twice: {', '.join(hosts)}")
    return hosts


class StateHostClient:
    """Calls one state host's REST API (:mod:`~sparkstep.coordinator_api.statehost`)."""

    def __init__(self, address: str, token: str, timeout: float = 60.0) -> None:
        self.address = address
        self.token = token
        self._http = httpx.Client(
            base_url=f"http://{address}",
            headers={"authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout, connect=_CONNECT_S),
        )

    def _call(self, method: str, path: str, body: Any = None, **params: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, json=body, params=params or None)
        except httpx.HTTPError as exc:
            raise StateHostUnreachableError(
                f"the state host {self.address} does not answer ({exc}): start it, or fix "
                "--state-hosts"
            ) from exc
        if response.status_code != 200:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise StateHostError(
                f"state host {self.address}: {method} {path}: {response.status_code} {detail}",
                response.status_code,
            )
        answer: dict[str, Any] = response.json()
        return answer

    def describe(self) -> dict[str, Any]:
        return self._call("GET", "/v1/host")

    def stores(self, pipeline: str) -> list[str]:
        return [str(s) for s in self._call("GET", f"/v1/pipelines/{pipeline}/stores")["stores"]]

    def prepare(self, pipeline: str, keep: list[str]) -> dict[str, Any]:
        return self._call("POST", f"/v1/pipelines/{pipeline}/prepare", {"keep": keep})

    def start(
        self,
        pipeline: str,
        store: str,
        secret: str,
        create_version: int | None,
        lock_timeout_s: float,
    ) -> dict[str, Any]:
        body = {
            "store": store,
            "secret": secret,
            "create_version": create_version,
            "lock_timeout_s": lock_timeout_s,
        }
        return self._call("POST", f"/v1/pipelines/{pipeline}/workers", body)

    def worker(self, worker_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/workers/{worker_id}")

    def stop(self, worker_id: str, grace_s: float = 0.0) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/workers/{worker_id}", grace_s=grace_s)

    def delete_store(self, pipeline: str, store: str) -> bool:
        name = store.removeprefix(f"{WORKERS_DIR}/")
        return bool(self._call("DELETE", f"/v1/pipelines/{pipeline}/stores/{name}")["deleted"])

    def delete_pipeline(self, pipeline: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/pipelines/{pipeline}")

    def close(self) -> None:
        self._http.close()


class HostWatch:
    """Holds one host's event stream in a thread; knows which of our workers on it ended.

    A worker is registered (:meth:`register`) once started. An exit event, a ``hello`` (on
    every reconnect) that no longer lists a registered worker, or the stream breaking, records
    the worker's end in :attr:`exits`; a host that is lost is lost for every worker on it,
    even if the stream comes back (the coordinator relaunches, as after any worker's death).
    """

    def __init__(self, client: StateHostClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._ours: set[str] = set()
        self.exits: dict[str, str] = {}
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.problem: str | None = None

    def ensure(self) -> None:
        """Start the thread if needed and wait until the stream is up, else
        :class:`StateHostUnreachableError`."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"watch {self.client.address}", daemon=True
            )
            self._thread.start()
        if not self._connected.wait(_CONNECT_S):
            raise StateHostUnreachableError(
                f"the state host {self.client.address} does not answer "
                f"({self.problem or 'no event stream'}): start it, or fix --state-hosts"
            )

    def register(self, worker_id: str) -> None:
        with self._lock:
            self._ours.add(worker_id)

    def exit_of(self, worker_id: str) -> str | None:
        with self._lock:
            return self.exits.get(worker_id)

    def close(self) -> None:
        self._closed.set()

    def _lose(self, why: str) -> None:
        self._connected.clear()
        self.problem = why
        with self._lock:
            for worker_id in self._ours:
                self.exits.setdefault(
                    worker_id, f"was lost with its state host {self.client.address} ({why})"
                )

    def _on(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        with self._lock:
            if kind == "hello":
                listed = {str(w["id"]): w for w in event.get("workers", [])}
                for worker_id in self._ours:
                    doc = listed.get(worker_id)
                    if doc is None:
                        self.exits.setdefault(
                            worker_id,
                            f"is gone: its state host {self.client.address} no longer knows it",
                        )
                    elif doc.get("exit"):
                        self.exits.setdefault(worker_id, str(doc["exit"]))
            elif kind == "exit":  # kept even before register(): a start's answer may be late
                worker = event["worker"]
                self.exits.setdefault(str(worker["id"]), str(worker["exit"]))
        if kind == "hello":
            self.problem = None
            self._connected.set()

    def _run(self) -> None:
        url = f"http://{self.client.address}/v1/events"
        headers = {"authorization": f"Bearer {self.client.token}"}
        timeout = httpx.Timeout(_SILENCE_S, connect=_SILENCE_S)
        while not self._closed.is_set():
            try:
                with httpx.stream("GET", url, headers=headers, timeout=timeout) as response:
                    if response.status_code != 200:
                        response.read()
                        raise StateHostError(f"{response.status_code} {response.text}")
                    for line in response.iter_lines():
                        if self._closed.is_set():
                            return
                        if line:
                            self._on(json.loads(line))
                raise StateHostError("the event stream ended")
            except (httpx.HTTPError, StateHostError, ValueError) as exc:
                why = f"its event stream broke: {exc or type(exc).__name__}"
                if self._connected.is_set():
                    log.warning("state host %s lost: %s", self.client.address, why)
                self._lose(why)
            self._closed.wait(1.0)


class RemoteWorker:
    """A worker a state host runs for us (the :class:`WorkerProcess` interface)."""

    def __init__(self, role: str, store: str, watch: HostWatch, doc: dict[str, Any]) -> None:
        self.role = role
        self.store: str | None = store
        self.watch = watch
        self.id = str(doc["id"])
        self._pid = int(doc["pid"])
        self.ready: dict[str, Any] | None = None
        self.host: str | None = watch.client.address

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def address(self) -> str:
        assert self.ready is not None, f"{self.role} is not ready"
        return str(self.ready["address"])

    def poll_ready(self) -> bool:
        if self.ready is not None:
            return True
        gone = self.watch.exit_of(self.id)
        doc = None if gone else self.watch.client.worker(self.id)
        if doc is not None and doc.get("exit"):
            gone = str(doc["exit"])
        if gone:
            raise LaunchError(f"{self.role} on {self.host} {gone} before it was ready")
        if doc is not None and doc.get("address"):
            self.ready = {"address": doc["address"], "pid": self._pid}
            return True
        return False

    def alive(self) -> bool:
        return self.watch.exit_of(self.id) is None

    def describe_exit(self) -> str:
        return self.watch.exit_of(self.id) or "is running"

    def kill(self) -> None:
        self.release(0.0)

    def release(self, timeout: float) -> bool:
        """Stop it (stdin EOF, SIGKILL after ``timeout``); a host that does not answer is
        left alone: its workers are lost with it, and the next launch stops them."""
        try:
            self.watch.client.stop(self.id, timeout)
        except StateHostError as exc:
            if exc.status != 404:
                log.warning("could not stop %s on %s: %s", self.role, self.host, exc)
            return False
        return True


class HostedWorkers:
    """Workers on state hosts; see the module docstring.

    ``secret`` is the internal secret the workers take (sent to each host, which gives it to
    its workers as their token file); ``host_token`` authenticates us to the hosts.
    """

    def __init__(
        self, hosts: tuple[str, ...], host_token: str, secret: str, lock_timeout_s: float
    ) -> None:
        self.clients = [StateHostClient(address, host_token) for address in hosts]
        self.watches = {c.address: HostWatch(c) for c in self.clients}
        self.secret = secret
        self.lock_timeout_s = lock_timeout_s
        self.pipeline = ""
        self._where: dict[str, StateHostClient] = {}  # store -> the host holding it
        self._lock = threading.Lock()

    def bind_pipeline(self, name: str) -> None:
        """The pipeline name the stores are kept under on every host."""
        self.pipeline = name

    def check(self) -> None:
        for watch in self.watches.values():
            watch.ensure()

    def prepare(self, stores: tuple[str, ...], fresh: bool) -> None:
        self.check()
        where: dict[str, StateHostClient] = {}
        for client in self.clients:
            for store in client.stores(self.pipeline):
                if store in where and store in stores:
                    raise ConfigError(
                        f"the store {store} of pipeline {self.pipeline} is on two state hosts, "
                        f"{where[store].address} and {client.address}: one is stale; delete it "
                        "from the host that did not run it last"
                    )
                where.setdefault(store, client)
        missing = [s for s in stores if s not in where]
        if missing and not fresh:
            raise ConfigError(
                f"the manifest lists the stores {', '.join(missing)}, which no state host of "
                f"--state-hosts {','.join(self.watches)} holds: a host is missing from "
                "--state-hosts, or lost its --data-dir (then the state is lost: `sparkstep "
                "reset` and start again)"
            )
        for client in self.clients:
            answer = client.prepare(self.pipeline, list(stores))
            for store in answer.get("removed", []):
                log.warning(
                    "removed %s on %s: a store the manifest does not list", store, client.address
                )
        with self._lock:
            self._where = {s: where[s] for s in stores if s in where}

    def _place(self) -> StateHostClient:
        """The host with the most free slots (the first on a tie), or :class:`ConflictError`."""
        best, best_free = None, 0
        for client in self.clients:
            free = int(client.describe()["free"])
            if free > best_free:
                best, best_free = client, free
        if best is None:
            raise ConflictError(f"no free worker slot on the state hosts: {self._slots()}")
        return best

    def _slots(self) -> str:
        parts = []
        for client in self.clients:
            try:
                doc = client.describe()
                parts.append(f"{client.address} {doc['free']} of {doc['slots']} free")
            except StateHostError:
                parts.append(f"{client.address} does not answer")
        return ", ".join(parts)

    def start(self, index: int, store: str, create_version: int | None = None) -> RemoteWorker:
        with self._lock:
            client = self._where.get(store)
            if client is None:
                client = self._place()
                self._where[store] = client
        watch = self.watches[client.address]
        watch.ensure()
        try:
            doc = client.start(
                self.pipeline, store, self.secret, create_version, self.lock_timeout_s
            )
        except StateHostError as exc:
            if exc.status == 409:
                raise LaunchError(f"worker {index} on {client.address}: {exc}") from exc
            raise
        watch.register(str(doc["id"]))
        return RemoteWorker(f"worker {index}", store, watch, doc)

    def check_slots(self, more: int) -> None:
        free = 0
        for client in self.clients:
            with contextlib.suppress(StateHostError):
                free += int(client.describe()["free"])
        if more > free:
            raise ConflictError(
                f"{more} more workers need {more} free worker slots, the state hosts have "
                f"{free} ({self._slots()}): start another state host, or give one more --slots"
            )

    def remove_stores(self, stores: Iterable[str], listed: set[str]) -> None:
        for store in stores:
            if store in listed:
                continue
            with self._lock:
                client = self._where.pop(store, None)
            if client is None:
                continue
            try:
                client.delete_store(self.pipeline, store)
            except StateHostError as exc:  # the next launch's prepare deletes it
                log.warning("could not delete %s on %s: %s", store, client.address, exc)

    def describe(self, worker: WorkerProcess) -> str:
        return f"{worker.pid}@{worker.host}"

    def close(self) -> None:
        for watch in self.watches.values():
            watch.close()
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.close()
