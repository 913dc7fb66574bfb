"""Supervision: the coordinator starts, watches and restarts the state workers and the runtime.

This is seed 004's coordinator loop made into processes. The runtime recovers by itself when it
starts (at the manifest's version), so "recover" here means: stop whatever is left, start
everything again in the right order, and let the runtime's recovery procedure run.

Launch, in this order (also after every failure):

1. Read the manifest (:func:`~sparkstep.runtime.manifest.read_manifest`). Its stores, in worker
   order, are the workers to start; a fresh state dir gets ``workers/w0 .. w<W-1>``.
2. Delete store directories under ``<state_dir>/workers/`` that the manifest does not list:
   leftovers of a rescale that crashed before its manifest was written.
3. Start every worker (each takes its store lock, waiting boundedly for a dying predecessor)
   and wait for their ready lines.
4. Start the runtime with the workers' addresses in worker order; it recovers (fences the dead
   writer, opens the stores at the manifest's version, replays the logged steps) and then says
   it is ready.

Supervision states (``state`` of ``GET /api/v1/status``)::

      start ──> recovering ──ready──> running <──resume/pause──> paused
                   ^   |                 |  \\
     restart after |   | gives up        |   `── rescale ──> rescaling ──> running/paused
     the delay     |   v                 |
                   +── (a child died) <──+── stop ──> stopped
                       failed

When a child dies: the state is ``recovering`` with the reason in ``last_failure``, the other
children are killed, and the restart strategy (:mod:`sparkstep.coordinator_api.restart`)
decides whether to launch again after its delay or to give up (``failed``). A runtime that
exits with status 2 refused its configuration: restarting cannot help, the state is ``failed``
at once.

Procedures (checkpoint, rescale, stop) run one at a time: a checkpoint or rescale requested
while another request's procedure runs is a :class:`ConflictError` (409); one that meets the
timer's checkpoint waits for it (the user did not start it). Pause, resume and stop wait
(bounded) for a running procedure, because a checkpoint resumes the loop it paused: a pause
answered in the middle of it would be undone. The checkpoint timer skips its turn when a
procedure runs, when the loop is paused, and when no step was taken since the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from sparkstep.coordinator_api.children import Child, spawn, wait_ready
from sparkstep.coordinator_api.errors import (
    ConflictError,
    InvalidRequestError,
    LaunchError,
    RuntimeUnavailableError,
)
from sparkstep.coordinator_api.restart import restart_strategy
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.failpoints import failpoint
from sparkstep.io.config import write_kafka_settings_file
from sparkstep.runtime.control import ControlClient, ControlError
from sparkstep.runtime.manifest import Manifest, read_manifest
from sparkstep.runtime.pipeline import load_pipeline, resolve_topics

__all__ = ["Supervisor", "translate_control_error", "write_token_file"]

log = logging.getLogger("sparkstep.coordinator")

Phase = Literal["recovering", "up", "rescaling", "stopping", "stopped", "failed"]

EXIT_CONFIG = 2
WORKERS_DIR = "workers"
_POLL_S = 0.2
_STATUS_TIMEOUT_S = 5.0
_PROCEDURE_WAIT_S = 120.0
_TIMER = "timer checkpoint"


def translate_control_error(exc: ControlError, action: str) -> SparkstepError:
    """The coordinator's error for a failed runtime control call (the one place of translation).

    409 stays a conflict; unreachable, or a runtime whose procedure failed (it exits and is
    recovered), is "unavailable".
    """
    if exc.status == 409:
        return ConflictError(f"{action}: {exc}")
    if exc.status == 422:
        return InvalidRequestError(f"{action}: {exc}")
    if exc.status is None:
        return RuntimeUnavailableError(f"{action}: the runtime cannot be reached ({exc})")
    return RuntimeUnavailableError(f"{action} failed in the runtime, which will recover: {exc}")


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, readable by the owner only (0600) from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class Launched:
    """The processes of one launch."""

    workers: tuple[Child, ...]
    runtime: Child
    client: ControlClient


class Supervisor:
    """Starts and supervises the pipeline's processes and runs its procedures; see the module
    docstring. ``token`` is the bearer token of the children's control endpoints; ``child_env``
    the environment the children get (the entry point decides it)."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        token: str,
        child_env: Mapping[str, str],
        python: str = sys.executable,
    ) -> None:
        self.settings = settings
        self.token = token
        self.child_env = dict(child_env)
        self.python = python
        self.state_dir = settings.state_dir
        self.home = self.state_dir / "coordinator"
        self.log_dir = self.state_dir / "logs"
        self.token_file = self.home / "token"
        self.kafka_settings_file = self.home / "kafka-settings.json"
        self.history_file = self.home / "checkpoints.jsonl"
        self.restarts = 0
        self._strategy = restart_strategy(settings)
        self._lock = threading.RLock()
        self._procedure = threading.Lock()
        self._procedure_name: str | None = None
        self._phase: Phase = "recovering"
        self._launched: Launched | None = None
        self._manifest: Manifest | None = None
        self._last_step: int | None = None
        self._last_failure: dict[str, str] | None = None
        self._checkpoints: list[dict[str, Any]] = []
        self._rescales: list[dict[str, Any]] = []
        self._stop_requested = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pipeline_name = settings.name or settings.pipeline
        # Children are started from this one long-lived thread: their parent-death signal
        # fires when the thread that started them ends, and request threads come and go.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        # The children of a launch in progress (killed with the rest when it fails).
        self._pending_workers: list[Child] = []
        # --workers other than the manifest's: a rescale after the first recovery.
        self._startup_rescale: int | None = None
        self._launching: Child | None = None
        # Workers a rescale retired: their exit is expected, not a failure.
        self._retiring: list[Child] = []

    # -- start -------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse what restarting cannot fix, before anything starts (:class:`ConfigError`).

        The pipeline must load and accept the input topics; a ``--workers`` other than the
        manifest's W needs a rescale after recovery, which needs the runtime's rescale.
        """
        pipeline = load_pipeline(self.settings.pipeline)
        resolve_topics(pipeline, self.settings.input_topics)
        self._pipeline_name = self.settings.name or pipeline.name
        manifest = read_manifest(self.state_dir)
        self._manifest = manifest
        differs = manifest is not None and manifest.workers != self.settings.workers
        if manifest is not None and differs:
            log.warning(
                "the checkpoint has %d workers and --workers is %d: recovering with %d, then "
                "rescaling to %d",
                manifest.workers,
                self.settings.workers,
                manifest.workers,
                self.settings.workers,
            )
            self._startup_rescale = self.settings.workers
        self._load_history(manifest)

    def start(self) -> None:
        """Write the token file and start supervising (and the checkpoint timer) in threads."""
        write_token_file(self.token_file, self.token)
        write_kafka_settings_file(self.kafka_settings_file, self.settings.kafka_config)
        supervise = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._threads.append(supervise)
        supervise.start()
        if self.settings.checkpoint_interval_s > 0:
            timer = threading.Thread(target=self._timer, name="checkpoint-timer", daemon=True)
            self._threads.append(timer)
            timer.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the pipeline is stopped (True) or ``timeout`` passed (False)."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    # -- supervision -------------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._supervise_loop()
        except BaseException as exc:  # a bug in supervision must not leave orphans
            log.exception("supervision failed")
            self._set_failure(f"supervision failed: {exc!r}")
            with self._lock:
                self._phase = "failed"
            self._kill_all()
            self._done.set()

    def _supervise_loop(self) -> None:
        while not self._stop_requested.is_set():
            reason: str | None
            fatal = False
            try:
                launched = self._launch()
            except LaunchError as exc:
                reason = str(exc)
                fatal = self._runtime_refused()
            except ConfigError as exc:
                reason, fatal = str(exc), True
            except SparkstepError as exc:  # the manifest unreadable, a store dir not removable
                reason, fatal = str(exc), True
            else:
                if self._startup_rescale is not None:
                    target, self._startup_rescale = self._startup_rescale, None
                    threading.Thread(
                        target=self._rescale_at_start, args=(target,), name="rescale", daemon=True
                    ).start()
                reason = self._watch(launched)
                fatal = reason is not None and launched.runtime.proc.returncode == EXIT_CONFIG
            if reason is None or self._stop_requested.is_set():  # stopped on request
                break
            self._kill_all()
            self._set_failure(reason)
            delay = None if fatal else self._strategy.on_failure(time.monotonic())
            if delay is None:
                log.error("giving up (%s): %s", self._strategy.describe(), reason)
                with self._lock:
                    self._phase = "failed"
                return  # _done stays unset: the coordinator keeps reporting "failed"
            log.warning("recovering in %.1fs: %s", delay, reason)
            with self._lock:
                self._phase = "recovering"
            if self._stop_requested.wait(delay):
                break
            self.restarts += 1
        self._kill_all(graceful=True)
        with self._lock:
            self._phase = "stopped"
        self._done.set()

    def _rescale_at_start(self, workers: int) -> None:
        try:
            result = self.rescale(workers)
        except SparkstepError as exc:
            log.error("the rescale to %d workers after recovery failed: %s", workers, exc)
            return
        log.info("rescaled to --workers %d after recovery: %s", workers, result)

    def _runtime_refused(self) -> bool:
        launched = self._launching
        return (
            launched is not None
            and launched.proc.poll() is not None
            and launched.proc.returncode == EXIT_CONFIG
        )

    def _launch(self) -> Launched:
        """Steps 1-4 of the module docstring; returns the ready processes."""
        with self._lock:
            self._phase = "recovering"
            self._launching = None
        # Step 1. The manifest decides the workers.
        manifest = read_manifest(self.state_dir)
        stores = (
            manifest.stores
            if manifest is not None
            else tuple(f"{WORKERS_DIR}/w{i}" for i in range(self.settings.workers))
        )
        # Step 2. Leftover store dirs of a rescale that crashed before its manifest.
        self._remove_leftover_stores(stores)
        # Step 3. The workers.
        workers: list[Child] = []
        try:
            for i, store in enumerate(stores):
                workers.append(self._spawn_worker(i, self.state_dir / store))
            with self._lock:
                self._launched = None
                self._pending_workers = list(workers)
            wait_ready(workers, self.settings.start_timeout_s)
            # Step 4. The runtime; it recovers, then says it is ready.
            runtime = self._spawn_runtime([w.address for w in workers])
            with self._lock:
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
        with self._lock:
            self._launched = launched
            self._pending_workers = []
            self._phase = "up"
            self._manifest = read_manifest(self.state_dir)
            assert runtime.ready is not None
            self._last_step = int(runtime.ready.get("step", 0))
        self._seed_history(self._manifest)
        log.info(
            "running: runtime pid %d, workers %s",
            runtime.pid,
            ", ".join(str(w.pid) for w in workers),
        )
        return launched

    def _wait_runtime(self, runtime: Child, workers: list[Child]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not runtime.poll_ready():
            for worker in workers:
                if not worker.alive():
                    raise LaunchError(f"{worker.role} {worker.describe_exit()} during recovery")
            if self._stop_requested.is_set():
                raise LaunchError("stopped while the runtime was recovering")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the runtime was not ready within {self.settings.start_timeout_s:.0f}s"
                )
            time.sleep(0.1)

    def _remove_leftover_stores(self, stores: tuple[str, ...]) -> None:
        root = self.state_dir / WORKERS_DIR
        if not root.is_dir():
            return
        keep = {(self.state_dir / s).resolve() for s in stores}
        for path in sorted(root.iterdir()):
            if path.is_dir() and path.resolve() not in keep:
                log.warning("removing %s: a store the manifest does not list", path)
                shutil.rmtree(path)

    def _spawn_worker(self, index: int, store: Path, create_version: int | None = None) -> Child:
        argv = [
            self.python, "-m", "sparkstep.runtime.worker",
            "--store", str(store),
            "--port", "0",
            "--token-file", str(self.token_file),
            "--lock-timeout", str(self.settings.lock_timeout_s),
        ]  # fmt: skip
        if create_version is not None:
            argv += ["--create-version", str(create_version)]
        child = self._spawn(f"worker {index}", f"worker-{store.name}", argv)
        child.store = store
        return child

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
        return argv

    def _spawn_runtime(self, addresses: list[str]) -> Child:
        return self._spawn("the runtime", "runtime", self._runtime_argv(addresses))

    def _spawn(self, role: str, slug: str, argv: list[str]) -> Child:
        return self._spawner.submit(spawn, role, slug, argv, self.log_dir, self.child_env).result()

    def _watch(self, launched: Launched) -> str | None:
        """Until a child dies (its description) or the runtime stopped on request (None)."""
        while True:
            with self._lock:
                current = self._launched
            if current is None:  # replaced by a rescale's new workers meanwhile
                current = launched
            runtime = current.runtime
            if not runtime.alive():
                if self._stop_requested.is_set() and runtime.proc.returncode == 0:
                    return None
                return f"the runtime (pid {runtime.pid}) {runtime.describe_exit()}"
            for i, worker in enumerate(current.workers):
                if not worker.alive() and worker not in self._retiring:
                    return f"worker {i} (pid {worker.pid}) {worker.describe_exit()}"
            time.sleep(_POLL_S)

    def _kill_all(self, graceful: bool = False) -> None:
        with self._lock:
            launched, self._launched = self._launched, None
            pending, self._pending_workers = self._pending_workers, []
            launching, self._launching = self._launching, None
        children: list[Child] = list(pending)
        if launched is not None:
            launched.client.close()
            children = [launched.runtime, *launched.workers, *children]
        if launching is not None:
            children.append(launching)
        if graceful:  # after a stop: EOF first, so the workers close their stores themselves
            for child in children:
                child.release(10.0)
        for child in children:
            child.kill()

    def _set_failure(self, reason: str) -> None:
        with self._lock:
            self._last_failure = {"at": _now_iso(), "reason": reason}

    # -- the runtime -------------------------------------------------------------------------

    def _client(self, action: str) -> ControlClient:
        with self._lock:
            phase, launched = self._phase, self._launched
        if phase == "failed":
            raise RuntimeUnavailableError(
                f"{action}: the pipeline failed and is not restarted: {self._failure_reason()}"
            )
        if phase == "stopped":
            raise RuntimeUnavailableError(f"{action}: the pipeline is stopped")
        if launched is None or phase == "recovering":
            raise RuntimeUnavailableError(f"{action}: the pipeline is recovering, try again soon")
        return launched.client

    def _failure_reason(self) -> str:
        with self._lock:
            return "" if self._last_failure is None else self._last_failure["reason"]

    def _call(self, action: str, method: str) -> dict[str, Any]:
        client = self._client(action)
        try:
            answer: dict[str, Any] = getattr(client, method)()
        except ControlError as exc:
            raise translate_control_error(exc, action) from exc
        return answer

    def runtime_status(self) -> dict[str, Any] | None:
        """The runtime's ``GET /status`` document, or None when it cannot be reached."""
        with self._lock:
            launched = self._launched
            phase = self._phase
        if launched is None or phase in ("recovering", "stopped", "failed"):
            return None
        try:
            doc = ControlClient(launched.runtime.address, self.token, _STATUS_TIMEOUT_S)
            try:
                status = doc.status()
            finally:
                doc.close()
        except ControlError:
            return None
        with self._lock:
            self._last_step = int(status.get("step", self._last_step or 0))
        return status

    # -- procedures --------------------------------------------------------------------------

    def _exclusive(self, name: str) -> None:
        """Take the procedure lock for ``name``, or :class:`ConflictError` (409) if a request's
        procedure holds it. The timer's checkpoint is waited for (bounded) instead: the user
        did not start it and it ends in a moment."""
        if not self._procedure.acquire(blocking=False):
            holder = self._procedure_name
            if holder != _TIMER or not self._procedure.acquire(timeout=_PROCEDURE_WAIT_S):
                raise ConflictError(f"{name}: a {holder or 'procedure'} is in progress")
        self._procedure_name = name

    def _release(self) -> None:
        self._procedure_name = None
        self._procedure.release()

    def _after_procedure(self, name: str) -> None:
        """Wait (bounded) for a running checkpoint to end: a pause answered while a checkpoint
        holds the loop paused would be undone when that checkpoint resumes the loop."""
        if self._phase == "rescaling":
            raise ConflictError(f"{name}: a rescale is in progress")
        if not self._procedure.acquire(timeout=_PROCEDURE_WAIT_S):
            raise ConflictError(f"{name}: a {self._procedure_name} is in progress")
        self._procedure_name = name

    def pause(self) -> dict[str, Any]:
        """Pause the step loop at the next step boundary (idempotent)."""
        self._after_procedure("pause")
        try:
            answer = self._call("pause", "pause")
        finally:
            self._release()
        with self._lock:
            self._last_step = int(answer["step"])
        return {"state": "paused", "step": int(answer["step"])}

    def resume(self) -> dict[str, Any]:
        """Resume a paused step loop."""
        self._after_procedure("resume")
        try:
            self._call("resume", "resume")
        finally:
            self._release()
        return {"state": "running"}

    def checkpoint(self, *, only_if_running: bool = False) -> dict[str, Any] | None:
        """Run the runtime's checkpoint procedure; ``{"version", "step", "duration_ms"}``.

        ``only_if_running`` (the timer): skip (None) unless the loop runs and has taken a step
        since the manifest's checkpoint, checked while holding the procedure lock, so that a
        pause that just ended is never followed by a timer checkpoint the user did not ask for.
        """
        self._exclusive(_TIMER if only_if_running else "checkpoint")
        try:
            if only_if_running:
                status = self.runtime_status()
                with self._lock:
                    manifest_step = None if self._manifest is None else self._manifest.step
                if (
                    status is None
                    or status.get("state") != "running"
                    or status.get("step") == manifest_step
                ):
                    return None
            answer = self._call("checkpoint", "checkpoint")
        finally:
            self._release()
        self._record_checkpoint(answer)
        return {
            "version": int(answer["version"]),
            "step": int(answer["step"]),
            "duration_ms": int(answer["duration_ms"]),
        }

    def rescale(self, workers: int) -> dict[str, Any]:
        """Change the number of state workers to ``workers`` at a checkpoint boundary.

        In this order (the runtime's part is :mod:`sparkstep.runtime.rescale`):

        1. pause the step loop (the state is ``rescaling`` until the end);
        2. checkpoint (manifest at ``v``; the loop stays paused);
        3. start the added workers on new stores ``workers/w<i>-e<epoch+1>`` created at ``v``;
        4. the runtime's rescale: moves the shards and writes the manifest at ``v + 1`` (the
           commit point);
        5. stop the retired workers' processes and delete their stores;
        6. resume (unless the loop was paused before).

        ``pause_ms`` is the time from 1 to 6. A failure before 4 changes nothing (the added
        workers are stopped and their stores deleted); a runtime that fails in 4 exits and is
        recovered at whichever manifest is durable. Failpoints: ``rescale.after_checkpoint``,
        ``rescale.after_start``, ``rescale.after_runtime``, ``rescale.before_resume``.
        """
        self._exclusive("rescale")
        try:
            return self._rescale(workers)
        finally:
            with self._lock:
                if self._phase == "rescaling":
                    self._phase = "up"
            self._release()

    def _rescale(self, workers: int) -> dict[str, Any]:
        client = self._client("rescale")
        with self._lock:
            manifest, launched = self._manifest, self._launched
        if manifest is None or launched is None:
            raise RuntimeUnavailableError("rescale: the pipeline is recovering, try again soon")
        shards = manifest.layout.shards
        if workers > shards:
            raise InvalidRequestError(
                f"rescale: {workers} workers for S={shards} shards: at most {shards}"
            )
        old = manifest.workers
        if workers == old:
            return {
                "layout_epoch": int(manifest.epoch),
                "workers": old,
                "shards_moved": 0,
                "bytes_moved": 0,
                "pause_ms": 0,
            }
        try:
            was_paused = client.status().get("state") == "paused"
        except ControlError as exc:
            raise translate_control_error(exc, "rescale") from exc
        # Step 1. Pause.
        started = time.monotonic()
        with self._lock:
            self._phase = "rescaling"
        added: list[Child] = []
        try:
            client.pause()
            # Step 2. Checkpoint: the stores hold v, the loop stays paused.
            checkpoint = client.checkpoint()
            self._record_checkpoint(checkpoint)
            failpoint("rescale.after_checkpoint")
            version = int(checkpoint["version"])
            # Step 3. The added workers, on new stores created at v.
            epoch = int(manifest.epoch) + 1
            for i in range(old, workers):
                store = self.state_dir / WORKERS_DIR / f"w{i}-e{epoch}"
                child = self._spawn_worker(i, store, create_version=version)
                added.append(child)
                with self._lock:
                    self._pending_workers.append(child)
            wait_ready(added, self.settings.start_timeout_s)
            failpoint("rescale.after_start")
            # Step 4. The runtime moves the shards and writes the manifest (the commit point).
            kept = list(launched.workers[: min(old, workers)])
            addresses = [w.address for w in kept] + [w.address for w in added]
            answer = client.rescale(workers, addresses)
        except BaseException as exc:
            self._undo_rescale(client, added, was_paused)
            if isinstance(exc, ControlError):
                raise translate_control_error(exc, "rescale") from exc
            raise
        failpoint("rescale.after_runtime")
        # Step 5. The new worker set is supervised from now on; the retired ones go.
        retired = list(launched.workers[workers:])
        with self._lock:
            self._retiring = retired
            self._launched = Launched((*kept, *added), launched.runtime, client)
            self._pending_workers = []
            self._manifest = read_manifest(self.state_dir)
            new_manifest = self._manifest
        self._record_checkpoint(answer, duration_ms=None)
        listed = set() if new_manifest is None else set(new_manifest.stores)
        for i, child in enumerate(retired, start=workers):
            child.release(10.0)
            child.kill()
            gone = manifest.stores[i]
            if gone not in listed:
                shutil.rmtree(self.state_dir / gone, ignore_errors=True)
        failpoint("rescale.before_resume")
        # Step 6. Resume.
        if not was_paused:
            try:
                client.resume()
            except ControlError as exc:
                raise translate_control_error(exc, "rescale (resume)") from exc
        result = {
            "layout_epoch": int(answer["layout_epoch"]),
            "workers": int(answer["workers"]),
            "shards_moved": int(answer["shards_moved"]),
            "bytes_moved": int(answer["bytes_moved"]),
            "pause_ms": round((time.monotonic() - started) * 1000),
        }
        with self._lock:
            self._rescales.append({"at": _now_iso(), "from_workers": old, **result})
        log.info("rescaled from %d to %d workers: %s", old, workers, result)
        return result

    def _undo_rescale(self, client: ControlClient, added: list[Child], was_paused: bool) -> None:
        """A rescale failed before its commit point: stop the added workers, delete their
        stores, and resume if the runtime still runs."""
        with self._lock:
            self._pending_workers = [c for c in self._pending_workers if c not in added]
        try:  # a runtime that died after its manifest write committed the new stores
            durable = read_manifest(self.state_dir)
        except SparkstepError:
            durable = None
        listed = (
            set() if durable is None else {(self.state_dir / s).resolve() for s in durable.stores}
        )
        for child in added:
            child.kill()
            store = child.store
            if store is not None and store.resolve() not in listed and durable is not None:
                shutil.rmtree(store, ignore_errors=True)
        if not was_paused:
            try:
                client.resume()
            except ControlError as exc:
                log.warning("rescale undone, but the loop could not be resumed: %s", exc)

    def stop(self) -> dict[str, Any]:
        """Graceful stop: a final checkpoint, then every process exits.

        A failed pipeline (no runtime) stops at once and answers the manifest's checkpoint.
        """
        with self._lock:
            phase = self._phase
        if phase == "failed":
            self._stop_requested.set()
            self._kill_all()
            with self._lock:
                self._phase = "stopped"
            self._done.set()
            manifest = read_manifest(self.state_dir)
            return {
                "state": "stopped",
                "step": None if manifest is None else int(manifest.step),
                "version": None if manifest is None else int(manifest.version),
            }
        self._after_procedure("stop")
        try:
            client = self._client("stop")
            self._stop_requested.set()
            try:
                answer = client.stop()
            except ControlError as exc:
                self._stop_requested.clear()
                raise translate_control_error(exc, "stop") from exc
        finally:
            self._release()
        self._record_checkpoint(answer, duration_ms=None)
        with self._lock:
            self._phase = "stopping"
        return {"state": "stopped", "step": int(answer["step"]), "version": int(answer["version"])}

    def shutdown(self, timeout: float = 600.0) -> None:
        """Ctrl-C / SIGTERM: a graceful stop when the runtime runs, else end the children."""
        if not self._done.is_set():
            try:
                self.stop()
            except SparkstepError as exc:
                log.warning("no final checkpoint (%s): stopping the processes", exc)
                self._stop_requested.set()
        if not self._done.wait(timeout):
            self._stop_requested.set()
            self._kill_all()

    def close(self) -> None:
        """End every child at once (the coordinator is exiting)."""
        self._stop_requested.set()
        self._kill_all()

    # -- the checkpoint timer ----------------------------------------------------------------

    def _timer(self) -> None:
        interval = self.settings.checkpoint_interval_s
        while not self._stop_requested.wait(interval):
            with self._lock:
                up = self._phase == "up"
            if not up:
                continue
            try:
                self.checkpoint(only_if_running=True)
            except SparkstepError as exc:
                log.info("timer checkpoint skipped: %s", exc)

    # -- history -----------------------------------------------------------------------------

    def _record_checkpoint(
        self, answer: Mapping[str, Any], duration_ms: int | Literal["answer"] | None = "answer"
    ) -> None:
        entry = {
            "version": int(answer["version"]),
            "step": int(answer["step"]),
            "at": _now_iso(),
            "duration_ms": answer.get("duration_ms") if duration_ms == "answer" else duration_ms,
        }
        with self._lock:
            self._checkpoints.append(entry)
            del self._checkpoints[: -self.settings.retained_checkpoints]
            self._manifest = read_manifest(self.state_dir)
            self._last_step = max(self._last_step or 0, int(answer["step"]))
            try:
                self.home.mkdir(parents=True, exist_ok=True)
                with self.history_file.open("a") as fh:
                    fh.write(json.dumps(entry) + "\n")
            except OSError as exc:
                log.warning("checkpoint history not saved: %s", exc)

    def _load_history(self, manifest: Manifest | None) -> None:
        entries: list[dict[str, Any]] = []
        try:
            for line in self.history_file.read_text().splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # a line torn by a crash
                if isinstance(doc, dict) and {"version", "step", "at"} <= doc.keys():
                    entries.append(doc)
        except FileNotFoundError:
            pass
        with self._lock:
            self._checkpoints = entries[-self.settings.retained_checkpoints :]
        self._seed_history(manifest)

    def _seed_history(self, manifest: Manifest | None) -> None:
        """The manifest's checkpoint is in the history even if this coordinator did not take
        it (the runtime's first manifest, or a history lost with its file)."""
        if manifest is None:
            return
        with self._lock:
            if any(c["version"] == manifest.version for c in self._checkpoints):
                return
            self._checkpoints.append(
                {
                    "version": int(manifest.version),
                    "step": int(manifest.step),
                    "at": _iso(manifest.written_at),
                    "duration_ms": None,
                }
            )
            self._checkpoints.sort(key=lambda c: int(c["version"]))
            del self._checkpoints[: -self.settings.retained_checkpoints]

    # -- reading -----------------------------------------------------------------------------

    def checkpoints(self) -> list[dict[str, Any]]:
        """The retained checkpoints, oldest first; the last one is the manifest's."""
        with self._lock:
            return [dict(c) for c in self._checkpoints]

    def rescales(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._rescales]

    def status(self) -> dict[str, Any]:
        """``GET /api/v1/status``: the coordinator's view, with the runtime's where it runs."""
        return self.status_and_runtime()[0]

    def status_and_runtime(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """:meth:`status` and the runtime's status document it was made from (None when the
        runtime cannot be reached)."""
        doc = self.runtime_status()
        with self._lock:
            phase, launched = self._phase, self._launched
            manifest = self._manifest
            last_failure = None if self._last_failure is None else dict(self._last_failure)
            step = self._last_step
            latest = self._checkpoints[-1] if self._checkpoints else None
        state = self._state(phase, doc)
        if doc is not None:
            step = int(doc["step"])
        if step is None and manifest is not None:
            step = int(manifest.step)
        pids = {} if launched is None else {str(i): w.pid for i, w in enumerate(launched.workers)}
        answer = {
            "pipeline": self._pipeline_name,
            "deployment": None if manifest is None else manifest.deployment,
            "state": state,
            "step": step,
            "checkpoint": None
            if latest is None
            else {"version": latest["version"], "step": latest["step"], "at": latest["at"]},
            "workers": manifest.workers if manifest is not None else self.settings.workers,
            "layout_epoch": None if manifest is None else int(manifest.epoch),
            "processes": {
                "coordinator": os.getpid(),
                "runtime": None if launched is None else launched.runtime.pid,
                "workers": pids,
            },
            "last_failure": last_failure,
        }
        return answer, doc

    @staticmethod
    def _state(phase: Phase, doc: Mapping[str, Any] | None) -> str:
        if phase in ("recovering", "rescaling", "failed", "stopped"):
            return phase
        if phase == "stopping":
            return "stopped"
        if doc is None:
            return "recovering"  # the runtime just died; supervision notices within a poll
        runtime_state = str(doc.get("state"))
        if runtime_state in ("pausing", "paused", "stopping"):
            return "paused"
        if runtime_state == "stopped":
            return "stopped"
        if runtime_state == "failed":
            return "recovering"
        return "running"
