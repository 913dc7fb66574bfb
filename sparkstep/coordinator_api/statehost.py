"""``sparkstep state-host``: the coordinator's agent on a host that keeps state workers.

One process per host (Flink's TaskManager offering slots to its JobManager is the model). It
owns a data directory and a number of worker **slots**, and on the coordinator's requests it
starts, stops and watches state-worker processes (``python -m sparkstep.runtime.worker``) whose
stores live in that directory. It never decides anything: placement, when to start and what to
delete are the coordinator's (:mod:`~sparkstep.coordinator_api.hosts`).

Data directory::

    <data_dir>/sparkstep.lock                    flock()ed by the one state host using it
    <data_dir>/pipelines/<pipeline>/token        the pipeline's internal secret (0600), the
                                                 workers' --token-file
    <data_dir>/pipelines/<pipeline>/workers/<s>  the stores, one per worker (storage/)
    <data_dir>/logs/<pipeline>/                  the workers' stdout and stderr

``<pipeline>`` is the coordinator's pipeline name (``--name``), so several pipelines can share
a host; a store's name is what its manifest lists (``workers/<s>``). A worker dies with its
state host (parent-death signal and a stdin pipe, as with the coordinator's own children).

REST API (HTTP/JSON on ``--bind:--port``; every call needs ``Authorization: Bearer <token>``,
the first line of ``--token-file``, which the coordinators hold too; 401 otherwise):

| method and path                          | answer                                              |
| ---------------------------------------- | --------------------------------------------------- |
| ``GET /v1/host``                         | ``{"address", "slots", "free", "workers": [W]}``    |
| ``GET /v1/pipelines/{p}/stores``         | ``{"stores": ["workers/<s>", ...]}``: the stores    |
|                                          | sparkstep created here (``is_store``)               |
| ``POST /v1/pipelines/{p}/prepare``       | body ``{"keep": ["workers/<s>", ...]}``: stop every |
|                                          | worker of ``p``, delete its stores not in ``keep``; |
|                                          | ``{"removed": [...], "left_alone": [...]}``         |
| ``POST /v1/pipelines/{p}/workers``       | body ``{"store", "secret", "create_version",        |
|                                          | "lock_timeout_s"}``: start a worker on the store    |
|                                          | (a worker still on it is stopped first); answers    |
|                                          | ``W`` at once, ready or not; 409 when every slot is |
|                                          | taken                                               |
| ``GET /v1/workers/{id}``                 | ``W``                                               |
| ``DELETE /v1/workers/{id}?grace_s=G``    | stop it (stdin EOF, then SIGKILL after ``G`` s);    |
|                                          | ``W``                                               |
| ``DELETE /v1/pipelines/{p}/stores/{s}``  | delete ``workers/<s>`` unless a worker runs on it   |
|                                          | (409); ``{"deleted": bool}``                        |
| ``DELETE /v1/pipelines/{p}``             | stop the pipeline's workers, delete its stores and  |
|                                          | token (``sparkstep reset``)                         |
| ``GET /v1/events``                       | a stream of JSON lines: ``{"kind": "hello",         |
|                                          | "workers": [W]}`` first, then ``{"kind": "exit",    |
|                                          | "worker": W}`` at every worker's exit and           |
|                                          | ``{"kind": "beat"}`` every second                   |

``W`` is ``{"id", "pipeline", "store", "pid", "address", "exit"}``: ``address`` is None until the
worker is ready, ``exit`` None while it runs, else how it ended (``"exited with status 1:
<its last message>"``, ``"was killed by SIGKILL"``). A worker's record stays until it is
deleted, so an exit is never missed by a coordinator that connects late.

Invariants: at most ``slots`` workers run at once; at most one worker runs on a store (the
store's own lock would make a second one wait); a name in a path is one path segment
(``[A-Za-z0-9._-]``, not starting with a dot), else 422. Only what
:func:`~sparkstep.storage.is_store` recognises is ever deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from sparkstep.coordinator_api.children import Child, read_token, spawn, write_token_file
from sparkstep.coordinator_api.errors import LaunchError
from sparkstep.coordinator_api.statelock import DirectoryLock
from sparkstep.errors import ConfigError
from sparkstep.runtime.manifest import STORES_DIR
from sparkstep.storage import is_store

__all__ = ["StateHost", "WORKERS_DIR", "check_name", "state_host_app"]

log = logging.getLogger("sparkstep.state_host")

WORKERS_DIR = STORES_DIR  # the manifest names a store workers/<s>
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_BEAT_S = 1.0
_POLL_S = 0.1


def check_name(name: str, what: str) -> str:
    """``name`` if it is one safe path segment, else :class:`ValueError` saying why."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{what} {name!r} must be 1-200 of A-Z a-z 0-9 . _ - and not start with a dot"
        )
    return name


def store_name(store: str) -> str:
    """The directory name of ``workers/<s>`` (the manifest's form); :class:`ValueError` else."""
    head, _, name = store.partition("/")
    if head != WORKERS_DIR:
        raise ValueError(f"store {store!r} must be {WORKERS_DIR}/<name>")
    return check_name(name, "store name")


@dataclass
class HostedWorker:
    """A worker process this host started for ``pipeline`` on ``store`` (``workers/<s>``)."""

    id: str
    pipeline: str
    store: str
    child: Child
    exit: str | None = None

    def describe(self) -> dict[str, Any]:
        if self.exit is None:
            with contextlib.suppress(LaunchError):  # the watcher records the exit
                self.child.poll_ready()
        ready = self.child.ready
        return {
            "id": self.id,
            "pipeline": self.pipeline,
            "store": self.store,
            "pid": self.child.pid,
            "address": None if ready is None else str(ready["address"]),
            "exit": self.exit,
        }


class StateHost:
    """The workers of one host; see the module docstring. Thread-safe.

    ``bind``/``advertise`` are passed to every worker (:mod:`sparkstep.net`); ``python`` runs
    them; ``env`` is their environment.
    """

    def __init__(
        self,
        data_dir: Path,
        slots: int,
        bind: str,
        advertise: str | None,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.slots = slots
        self.bind = bind
        self.advertise = advertise
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self._lock = threading.Lock()
        self._workers: dict[str, HostedWorker] = {}
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[dict[str, Any]]]]
        self._subscribers = []
        # Workers are started from this one long-lived thread: their parent-death signal fires
        # when the thread that started them ends.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="watch", daemon=True).start()

    # -- paths -------------------------------------------------------------------------------

    def _pipeline_dir(self, pipeline: str) -> Path:
        return self.data_dir / "pipelines" / check_name(pipeline, "pipeline name")

    def store_path(self, pipeline: str, store: str) -> Path:
        return self._pipeline_dir(pipeline) / WORKERS_DIR / store_name(store)

    # -- queries -----------------------------------------------------------------------------

    def running(self) -> list[HostedWorker]:
        with self._lock:
            return [w for w in self._workers.values() if w.exit is None]

    def describe(self) -> dict[str, Any]:
        with self._lock:
            workers = list(self._workers.values())
        running = sum(1 for w in workers if w.exit is None)
        return {
            "slots": self.slots,
            "free": max(0, self.slots - running),
            "workers": [w.describe() for w in workers],
        }

    def worker(self, worker_id: str) -> HostedWorker:
        """The worker ``worker_id``; :class:`KeyError` if this host has no record of it."""
        with self._lock:
            return self._workers[worker_id]

    def stores(self, pipeline: str) -> list[str]:
        """The stores of ``pipeline`` here that sparkstep created, as ``workers/<s>``."""
        root = self._pipeline_dir(pipeline) / WORKERS_DIR
        if not root.is_dir():
            return []
        return sorted(f"{WORKERS_DIR}/{p.name}" for p in root.iterdir() if is_store(p))

    # -- changes -----------------------------------------------------------------------------

    def start(
        self,
        pipeline: str,
        store: str,
        secret: str,
        create_version: int | None,
        lock_timeout_s: float,
    ) -> HostedWorker:
        """Start a worker of ``pipeline`` on ``store``, stopping one still on it first.

        Raises :class:`SlotsExhaustedError` when every slot is taken (after that stop).
        """
        path = self.store_path(pipeline, store)
        for old in self.running():
            if old.pipeline == pipeline and old.store == store:
                log.warning("stopping worker %s: a new one starts on %s", old.id, store)
                self.stop(old.id, 0.0)
        with self._lock:
            running = sum(1 for w in self._workers.values() if w.exit is None)
            if running >= self.slots:
                raise SlotsExhaustedError(
                    f"all {self.slots} worker slots of this state host are taken"
                )
            home = self._pipeline_dir(pipeline)
            token_file = home / "token"
            write_token_file(token_file, secret)
            worker_id = uuid.uuid4().hex[:12]
            argv = [
                self.python, "-m", "sparkstep.runtime.worker",
                "--store", str(path),
                "--port", "0",
                "--token-file", str(token_file),
                "--lock-timeout", str(lock_timeout_s),
                "--bind", self.bind,
            ]  # fmt: skip
            if self.advertise:
                argv += ["--advertise", self.advertise]
            if create_version is not None:
                argv += ["--create-version", str(create_version)]
            path.parent.mkdir(parents=True, exist_ok=True)
            logs = self.data_dir / "logs" / pipeline
            child = self._spawner.submit(
                spawn, f"worker on {store}", f"worker-{path.name}", argv, logs, self.env
            ).result()
            worker = HostedWorker(worker_id, pipeline, store, child)
            self._workers[worker_id] = worker
        log.info("started worker %s (pid %d) of %s on %s", worker_id, child.pid, pipeline, store)
        return worker

    def stop(self, worker_id: str, grace_s: float) -> HostedWorker:
        """Stop the worker (stdin EOF; SIGKILL after ``grace_s``), reaped when this returns."""
        worker = self.worker(worker_id)
        if grace_s > 0:
            worker.child.release(grace_s)
        worker.child.kill()
        self._record_exit(worker)
        return worker

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def prepare(self, pipeline: str, keep: list[str]) -> dict[str, list[str]]:
        """Stop every worker of ``pipeline`` and delete its stores not in ``keep``."""
        wanted = {store_name(s) for s in keep}
        for worker in self.running():
            if worker.pipeline == pipeline:
                self.stop(worker.id, 0.0)
        removed, left_alone = [], []
        root = self._pipeline_dir(pipeline) / WORKERS_DIR
        for path in sorted(root.iterdir()) if root.is_dir() else []:
            if path.name in wanted:
                continue
            if is_store(path):
                log.warning("removing %s: a store the manifest does not list", path)
                shutil.rmtree(path)
                removed.append(f"{WORKERS_DIR}/{path.name}")
            else:
                left_alone.append(f"{WORKERS_DIR}/{path.name}")
        with self._lock:  # the stopped workers' records are of no use to anyone now
            for worker_id in [w.id for w in self._workers.values() if w.pipeline == pipeline]:
                del self._workers[worker_id]
        return {"removed": removed, "left_alone": left_alone}

    def delete_store(self, pipeline: str, store: str) -> bool:
        """Delete the store if sparkstep made it; :class:`StoreInUseError` if a worker runs
        on it. True if something was deleted."""
        path = self.store_path(pipeline, store)
        if any(w.pipeline == pipeline and w.store == store for w in self.running()):
            raise StoreInUseError(f"a worker runs on {store}: stop it first")
        if not is_store(path):
            return False
        shutil.rmtree(path)
        return True

    def delete_pipeline(self, pipeline: str) -> dict[str, list[str]]:
        """Stop the pipeline's workers, delete its stores and its token."""
        removed = self.prepare(pipeline, [])
        (self._pipeline_dir(pipeline) / "token").unlink(missing_ok=True)
        return removed

    def close(self) -> None:
        """Stop every worker (the host is exiting)."""
        self._closed.set()
        for worker in self.running():
            self.stop(worker.id, 5.0)

    # -- events ------------------------------------------------------------------------------

    def subscribe(self) -> tuple[asyncio.Queue[dict[str, Any]], list[dict[str, Any]]]:
        """A queue of exit events from now on, and every worker's record as of now."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        with self._lock:
            self._subscribers.append((asyncio.get_running_loop(), queue))
            workers = list(self._workers.values())
        return queue, [w.describe() for w in workers]

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        with self._lock:
            self._subscribers = [(lp, q) for lp, q in self._subscribers if q is not queue]

    def _record_exit(self, worker: HostedWorker) -> None:
        with self._lock:
            if worker.exit is not None or worker.child.alive():
                return
            worker.exit = worker.child.describe_exit()
            subscribers = list(self._subscribers)
        log.info("worker %s (pid %d) %s", worker.id, worker.child.pid, worker.exit)
        event = {"kind": "exit", "worker": worker.describe()}
        for loop, queue in subscribers:
            loop.call_soon_threadsafe(queue.put_nowait, event)

    def _watch(self) -> None:
        while not self._closed.wait(_POLL_S):
            for worker in self.running():
                if not worker.child.alive():
                    self._record_exit(worker)


class StateHostError(Exception):
    """A request this state host refuses."""


class SlotsExhaustedError(StateHostError):
    """Every slot is taken (409)."""


class StoreInUseError(StateHostError):
    """A worker runs on the store (409)."""


class StartBody(BaseModel):
    store: str
    secret: str = Field(min_length=16)
    create_version: int | None = Field(default=None, ge=0)
    lock_timeout_s: float = Field(default=30.0, gt=0)


class PrepareBody(BaseModel):
    keep: list[str]


def state_host_app(host: StateHost, token: str, address: Callable[[], str]) -> FastAPI:
    """The FastAPI app of the state host's REST API (see the module docstring)."""
    app = FastAPI(title="sparkstep state host (internal)", docs_url=None, redoc_url=None)

    def authorised(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header, f"Bearer {token}"):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    def checked(action: Any, *args: Any) -> Any:
        try:
            return action(*args)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        except StateHostError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc

    def found(worker_id: str) -> HostedWorker:
        try:
            return host.worker(worker_id)
        except KeyError:
            raise HTTPException(404, f"no worker {worker_id} on this state host") from None

    auth = [Depends(authorised)]

    @app.get("/v1/host", dependencies=auth)
    def describe() -> dict[str, Any]:
        return {"address": address(), **host.describe()}

    @app.get("/v1/pipelines/{pipeline}/stores", dependencies=auth)
    def stores(pipeline: str) -> dict[str, Any]:
        return {"stores": checked(host.stores, pipeline)}

    @app.post("/v1/pipelines/{pipeline}/prepare", dependencies=auth)
    def prepare(pipeline: str, body: PrepareBody) -> dict[str, Any]:
        answer: dict[str, Any] = checked(host.prepare, pipeline, body.keep)
        return answer

    @app.post("/v1/pipelines/{pipeline}/workers", dependencies=auth)
    def start(pipeline: str, body: StartBody) -> dict[str, Any]:
        worker: HostedWorker = checked(
            host.start, pipeline, body.store, body.secret, body.create_version, body.lock_timeout_s
        )
        return worker.describe()

    @app.get("/v1/workers/{worker_id}", dependencies=auth)
    def get_worker(worker_id: str) -> dict[str, Any]:
        return found(worker_id).describe()

    @app.delete("/v1/workers/{worker_id}", dependencies=auth)
    def stop_worker(worker_id: str, grace_s: float = 0.0) -> dict[str, Any]:
        found(worker_id)
        described = host.stop(worker_id, min(max(grace_s, 0.0), 60.0)).describe()
        host.forget(worker_id)
        return described

    @app.delete("/v1/pipelines/{pipeline}/stores/{name}", dependencies=auth)
    def delete_store(pipeline: str, name: str) -> dict[str, Any]:
        return {"deleted": checked(host.delete_store, pipeline, f"{WORKERS_DIR}/{name}")}

    @app.delete("/v1/pipelines/{pipeline}", dependencies=auth)
    def delete_pipeline(pipeline: str) -> dict[str, Any]:
        answer: dict[str, Any] = checked(host.delete_pipeline, pipeline)
        return answer

    @app.get("/v1/events", dependencies=auth)
    async def events() -> StreamingResponse:
        queue, workers = host.subscribe()

        async def lines() -> AsyncIterator[bytes]:
            try:
                yield _line({"kind": "hello", "workers": workers})
                while True:
                    try:
                        event = await asyncio.wait_for(queue.get(), _BEAT_S)
                    except TimeoutError:
                        event = {"kind": "beat", "at": time.time()}
                    yield _line(event)
            finally:
                host.unsubscribe(queue)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _line(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc) + "\n").encode()


def lock_data_dir(data_dir: Path) -> DirectoryLock:
    """Take the data dir for this state host (one line, :class:`ConfigError`, if another has
    it or it cannot be made)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot make the state host's --data-dir {data_dir}: {exc.strerror}; give a "
            "directory this user can write"
        ) from exc
    return DirectoryLock(
        data_dir, f"the state host data dir {data_dir}", "give each state host its own --data-dir"
    )


def serve_state_host(
    data_dir: Path,
    bind: str,
    port: int,
    advertise: str | None,
    slots: int,
    token_file: Path,
) -> int:
    """``sparkstep state-host``: serve until SIGTERM/SIGINT, then stop every worker; 0.

    Prints ``{"port", "pid", "address"}`` on stdout once it serves. Raises
    :class:`~sparkstep.errors.ConfigError` (one line) for an unreadable token file or a data
    dir that cannot be made or is in use.
    """
    import uvicorn

    from sparkstep.net import advertised_host, host_port

    token = read_token(token_file)
    lock = lock_data_dir(data_dir.resolve())
    host = StateHost(data_dir.resolve(), slots, bind, advertise)
    advertised = advertised_host(bind, advertise)
    address = ""
    app = state_host_app(host, token, lambda: address)
    server = uvicorn.Server(uvicorn.Config(app, host=bind, port=port, log_level="warning"))

    def announce() -> None:
        nonlocal address
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1]
        address = host_port(advertised, bound)
        print(json.dumps({"port": bound, "pid": os.getpid(), "address": address}), flush=True)
        log.info("state host %s: %d slots, data dir %s", address, slots, data_dir)

    threading.Thread(target=announce, name="announce", daemon=True).start()
    try:
        server.run()
    finally:
        host.close()
        lock.release()
    return 0
