"""Launching and watching the pipeline's processes: the state workers and the runtime.

:meth:`Launcher.launch`, in this order (also after every failure):

1. Read the manifest (:func:`~sparkstep.runtime.manifest.read_manifest`). Its stores, in worker
   order, are the workers to start; a fresh state dir gets ``workers/w0 .. w<W-1>``.
2. Prepare the places the workers run (:mod:`~sparkstep.coordinator_api.hosts`): find each
   store (on state hosts: the host holding it, or place a new one), stop stale workers, and
   delete the stores the manifest does not list: leftovers of a rescale that crashed before
   its manifest was written. Only what sparkstep created as a store
   (:func:`~sparkstep.storage.is_store`: its marker file) is deleted; anything else is left
   alone and logged once.
3. Start every worker (each takes its store lock, waiting boundedly for a dying predecessor)
   and wait for their ready lines.
4. Start the runtime with the workers' addresses in worker order; it recovers (fences the dead
   writer, opens the stores at the manifest's version, replays the logged steps) and then says
   it is ready.

The launcher knows every child it started until it is killed: the launched set (runtime and
workers), the workers of a launch or rescale not yet adopted (``pending``), the runtime being
launched, and the workers a rescale retired (whose exit is expected). :meth:`Launcher.kill_all`
ends them all, whatever the instant.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sparkstep.coordinator_api.children import Child, read_token, spawn, wait_ready
from sparkstep.coordinator_api.errors import LaunchError
from sparkstep.coordinator_api.hosts import (
    WORKERS_DIR,
    HostedWorkers,
    LocalWorkers,
    WorkerPlacement,
    WorkerProcess,
)
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.state import SupervisorState
from sparkstep.runtime.control import ControlClient
from sparkstep.runtime.manifest import read_manifest
from sparkstep.runtime.process import NO_RESTART

__all__ = ["Launched", "Launcher"]

log = logging.getLogger("sparkstep.coordinator")

_POLL_S = 0.2


@dataclass(frozen=True)
class Launched:
    """The processes of one launch."""

    workers: tuple[WorkerProcess, ...]
    runtime: Child
    client: ControlClient


class Launcher:
    """Starts, watches and ends the children; see the module docstring.

    ``token_file`` is the file the children read their bearer token from and ``token`` its
    content (the launcher's control clients send it); ``kafka_settings_file`` the runtime's
    Kafka client settings; ``child_env`` the children's environment. The workers run where
    ``settings.state_hosts`` says (:mod:`~sparkstep.coordinator_api.hosts`).
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        state: SupervisorState,
        token: str,
        token_file: Path,
        kafka_settings_file: Path,
        child_env: Mapping[str, str],
        python: str,
    ) -> None:
        self.settings = settings
        self.state = state
        self.token = token
        self.token_file = token_file
        self.kafka_settings_file = kafka_settings_file
        self.child_env = dict(child_env)
        self.python = python
        self.state_dir = settings.state_dir
        self.log_dir = self.state_dir / "logs"
        # Children are started from this one long-lived thread: their parent-death signal
        # fires when the thread that started them ends, and request threads come and go.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self.workers: WorkerPlacement
        if settings.state_hosts:
            assert settings.state_host_token_file is not None  # the settings check it
            self.workers = HostedWorkers(
                settings.state_hosts,
                read_token(settings.state_host_token_file),
                token,
                settings.lock_timeout_s,
            )
        else:
            self.workers = LocalWorkers(
                self.state_dir,
                self._spawner,
                python,
                token_file,
                settings.lock_timeout_s,
                self._network_argv(),
                self.child_env,
            )
        self._launched: Launched | None = None
        # The workers of a launch or rescale in progress (killed with the rest when it fails).
        self._pending: list[WorkerProcess] = []
        self._launching: Child | None = None
        # Workers a rescale retired: their exit is expected, not a failure.
        self._retiring: list[WorkerProcess] = []
        # Why the coordinator killed the launched runtime (the failure :meth:`watch` reports).
        self._kill_reason: str | None = None

    # -- the children ------------------------------------------------------------------------

    def launched(self) -> Launched | None:
        """The running launch, or None while launching, recovering or stopped."""
        with self.state.lock:
            return self._launched

    def add_pending(self, child: WorkerProcess) -> None:
        with self.state.lock:
            self._pending.append(child)

    def drop_pending(self, children: Iterable[WorkerProcess]) -> None:
        gone = list(children)
        with self.state.lock:
            self._pending = [c for c in self._pending if c not in gone]

    def kill_runtime(self, reason: str) -> None:
        """SIGKILL the launched runtime and reap it: when this returns it can write nothing
        more. :meth:`watch` then reports ``reason`` as the failure."""
        with self.state.lock:
            launched = self._launched
            if launched is not None and launched.runtime.alive():
                self._kill_reason = reason
        if launched is not None:
            launched.runtime.kill()

    def adopt(self, launched: Launched, retiring: list[WorkerProcess]) -> None:
        """A rescale committed: supervise ``launched`` from now on; ``retiring`` may exit."""
        with self.state.lock:
            self._retiring = retiring
            self._launched = launched
            self._pending = []

    # -- launch ------------------------------------------------------------------------------

    def launch(self) -> Launched:
        """Steps 1-4 of the module docstring; returns the ready processes (phase ``up``)."""
        with self.state.lock:
            self.state.phase = "recovering"
            self._launching = None
            self._kill_reason = None
        # Step 1. The manifest decides the workers.
        manifest = read_manifest(self.state_dir)
        stores = (
            manifest.stores
            if manifest is not None
            else tuple(f"{WORKERS_DIR}/w{i}" for i in range(self.settings.workers))
        )
        # Step 2. Find or place the stores; delete the leftovers of a rescale that crashed
        # before its manifest.
        self.workers.prepare(stores, fresh=manifest is None)
        # Step 3. The workers.
        workers: list[WorkerProcess] = []
        try:
            for i, store in enumerate(stores):
                workers.append(self.workers.start(i, store))
            with self.state.lock:
                self._launched = None
                self._pending = list(workers)
            wait_ready(workers, self.settings.start_timeout_s)
            # Step 4. The runtime; it recovers, then says it is ready.
            runtime = self._spawn_runtime([w.address for w in workers])
            with self.state.lock:
                self._launching = runtime
            self._wait_runtime(runtime, workers)
        except BaseException:
            for child in workers:
                child.kill()
            if self._launching is not None:
                self._launching.kill()
            raise
        client = ControlClient(runtime.address, self.token, timeout=self.settings.start_timeout_s)
        launched = Launched(tuple(workers), runtime, client)
        manifest = read_manifest(self.state_dir)
        with self.state.lock:
            self._launched = launched
            self._pending = []
            self.state.phase = "up"
            self.state.manifest = manifest
            assert runtime.ready is not None
            self.state.last_step = int(runtime.ready.get("step", 0))
        log.info(
            "running: runtime pid %d, workers %s",
            runtime.pid,
            ", ".join(self.workers.describe(w) for w in workers),
        )
        return launched

    def runtime_refused(self) -> bool:
        """True if the runtime being launched exited with a status restarting cannot help."""
        launching = self._launching
        return (
            launching is not None
            and launching.proc.poll() is not None
            and launching.proc.returncode in NO_RESTART
        )

    def _wait_runtime(self, runtime: Child, workers: list[WorkerProcess]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not runtime.poll_ready():
            for worker in workers:
                if not worker.alive():
                    raise LaunchError(f"{worker.role} {worker.describe_exit()} during recovery")
            if self.state.stop_requested.is_set():
                raise LaunchError("stopped while the runtime was recovering")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the runtime was not ready within {self.settings.start_timeout_s:.0f}s"
                )
            time.sleep(0.1)

    # -- spawning ----------------------------------------------------------------------------

    def _runtime_argv(self, addresses: list[str]) -> list[str]:
        s = self.settings
        argv = [
            self.python, "-m", "sparkstep.runtime",
            "--pipeline", s.pipeline,
            "--bootstrap-servers", s.bootstrap_servers,
            "--state-dir", str(self.state_dir),
            "--token-file", str(self.token_file),
            "--kafka-settings-file", str(self.kafka_settings_file),
            "--max-records-per-step", str(s.max_records_per_step),
            "--max-bytes-per-step", str(s.max_bytes_per_step),
            "--rescale-catchup-keys", str(s.rescale_catchup_keys),
            "--start-from", s.start_from,
            "--on-replay-mismatch", s.on_replay_mismatch,
        ]  # fmt: skip
        for address in addresses:
            argv += ["--worker", address]
        if s.name:
            argv += ["--name", s.name]
        for topic in s.input_topics:
            argv += ["--input-topic", topic]
        if s.output_topic:
            argv += ["--output-topic", s.output_topic]
        if s.spark_master:
            argv += ["--spark-master", s.spark_master]
        argv += self._network_argv()
        if s.spark_driver_port is not None:
            argv += ["--spark-driver-port", str(s.spark_driver_port)]
        if s.spark_block_manager_port is not None:
            argv += ["--spark-block-manager-port", str(s.spark_block_manager_port)]
        for path in s.py_files:
            argv += ["--py-files", path]
        return argv

    def _network_argv(self) -> list[str]:
        """Every child binds and advertises as the coordinator was told (sparkstep.net)."""
        argv = ["--bind", self.settings.bind]
        if self.settings.advertise:
            argv += ["--advertise", self.settings.advertise]
        return argv

    def _spawn_runtime(self, addresses: list[str]) -> Child:
        return self._spawn("the runtime", "runtime", self._runtime_argv(addresses))

    def _spawn(self, role: str, slug: str, argv: list[str]) -> Child:
        return self._spawner.submit(spawn, role, slug, argv, self.log_dir, self.child_env).result()

    # -- watching and ending -----------------------------------------------------------------

    def watch(self, launched: Launched) -> str | None:
        """Until a child dies (its description) or the runtime stopped on request (None)."""
        while True:
            with self.state.lock:
                current = self._launched
            if current is None:  # replaced by a rescale's new workers meanwhile
                current = launched
            # Workers first: a dead worker makes the runtime fail its step and exit, so when
            # both are found dead the worker's death is the cause worth reporting.
            for i, worker in enumerate(current.workers):
                if not worker.alive() and worker not in self._retiring:
                    return f"worker {i} (pid {worker.pid}) {worker.describe_exit()}"
            runtime = current.runtime
            if not runtime.alive():
                if self.state.stop_requested.is_set() and runtime.proc.returncode == 0:
                    return None
                if self._kill_reason is not None:
                    return self._kill_reason
                return f"the runtime (pid {runtime.pid}) {runtime.describe_exit()}"
            time.sleep(_POLL_S)

    def kill_all(self, graceful: bool = False) -> None:
        """End every child this launcher knows of; ``graceful``: EOF first, so the workers
        close their stores themselves (after a stop)."""
        with self.state.lock:
            launched, self._launched = self._launched, None
            pending, self._pending = self._pending, []
            launching, self._launching = self._launching, None
        children: list[WorkerProcess | Child] = list(pending)
        if launched is not None:
            launched.client.close()
            children = [launched.runtime, *launched.workers, *children]
        if launching is not None:
            children.append(launching)
        if graceful:
            for child in children:
                child.release(10.0)
        for child in children:
            child.kill()
