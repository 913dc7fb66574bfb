"""The coordinator's procedures over the runtime's control endpoint: pause, resume, checkpoint,
rescale and stop.

Procedures (checkpoint, rescale, stop) run one at a time: a checkpoint or rescale requested
while another request's procedure runs is a :class:`ConflictError` (409); one that meets the
timer's checkpoint waits for it (the user did not start it). Pause, resume and stop wait
(bounded) for a running procedure, because a checkpoint resumes the loop it paused: a pause
answered in the middle of it would be undone.

Runtime control failures are translated into the coordinator's errors here, in
:func:`translate_control_error`, and nowhere else.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Literal

from sparkstep.coordinator_api.children import wait_ready
from sparkstep.coordinator_api.errors import (
    ConflictError,
    InvalidRequestError,
    RuntimeUnavailableError,
)
from sparkstep.coordinator_api.history import History
from sparkstep.coordinator_api.hosts import WORKERS_DIR, WorkerProcess
from sparkstep.coordinator_api.launcher import Launched, Launcher
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.state import SupervisorState, now_iso
from sparkstep.errors import SparkstepError
from sparkstep.failpoints import failpoint
from sparkstep.runtime.control import ControlClient, ControlError
from sparkstep.runtime.manifest import read_manifest

__all__ = ["Procedures", "translate_control_error"]

log = logging.getLogger("sparkstep.coordinator")

_STATUS_TIMEOUT_S = 5.0
_PROCEDURE_WAIT_S = 120.0
_TIMER = "timer checkpoint"
_ANSWER_GRACE_S = 30.0
"""How long after the rescale's deadline the coordinator still waits for the runtime's answer
(an answer in flight); past it the runtime is killed before the rescale is undone."""


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
    if exc.status == 503:  # given up before changing anything; the runtime runs on
        return RuntimeUnavailableError(f"{action}: {exc}")
    return RuntimeUnavailableError(f"{action} failed in the runtime, which will recover: {exc}")


class Procedures:
    """Runs the procedures on the runtime the ``launcher`` launched; see the module docstring."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        state: SupervisorState,
        launcher: Launcher,
        history: History,
    ) -> None:
        self.settings = settings
        self.state = state
        self.launcher = launcher
        self.history = history
        self.state_dir = settings.state_dir
        self._procedure = threading.Lock()
        self._procedure_name: str | None = None

    # -- the procedure lock ------------------------------------------------------------------

    def exclusive(self, name: str) -> None:
        """Take the procedure lock for ``name``, or :class:`ConflictError` (409) if a request's
        procedure holds it. The timer's checkpoint is waited for (bounded) instead: the user
        did not start it and it ends in a moment."""
        if not self._procedure.acquire(blocking=False):
            holder = self._procedure_name
            if holder != _TIMER or not self._procedure.acquire(timeout=_PROCEDURE_WAIT_S):
                raise ConflictError(f"{name}: a {holder or 'procedure'} is in progress")
        self._procedure_name = name

    def release(self) -> None:
        self._procedure_name = None
        self._procedure.release()

    def _after_procedure(self, name: str) -> None:
        """Wait (bounded) for a running checkpoint to end: a pause answered while a checkpoint
        holds the loop paused would be undone when that checkpoint resumes the loop."""
        if self.state.phase == "rescaling":
            raise ConflictError(f"{name}: a rescale is in progress")
        if not self._procedure.acquire(timeout=_PROCEDURE_WAIT_S):
            raise ConflictError(f"{name}: a {self._procedure_name} is in progress")
        self._procedure_name = name

    # -- the runtime -------------------------------------------------------------------------

    def _client(self, action: str) -> ControlClient:
        with self.state.lock:
            phase = self.state.phase
        launched = self.launcher.launched()
        if phase == "failed":
            raise RuntimeUnavailableError(
                f"{action}: the pipeline failed and is not restarted: {self.state.failure_reason()}"
            )
        if phase == "stopped":
            raise RuntimeUnavailableError(f"{action}: the pipeline is stopped")
        if launched is None or phase == "recovering":
            raise RuntimeUnavailableError(f"{action}: the pipeline is recovering, try again soon")
        return launched.client

    def _call(self, action: str, method: str) -> dict[str, Any]:
        client = self._client(action)
        try:
            answer: dict[str, Any] = getattr(client, method)()
        except ControlError as exc:
            raise translate_control_error(exc, action) from exc
        return answer

    def runtime_status(self) -> dict[str, Any] | None:
        """The runtime's ``GET /status`` document, or None when it cannot be reached."""
        with self.state.lock:
            phase = self.state.phase
        launched = self.launcher.launched()
        if launched is None or phase in ("recovering", "stopped", "failed"):
            return None
        try:
            with ControlClient(
                launched.runtime.address, self.launcher.token, _STATUS_TIMEOUT_S
            ) as client:
                status = client.status()
        except ControlError:
            return None
        with self.state.lock:
            self.state.last_step = int(status.get("step", self.state.last_step or 0))
        return status

    def _checkpointed(
        self, answer: dict[str, Any], duration_ms: int | Literal["answer"] | None = "answer"
    ) -> None:
        """A checkpoint (or a rescale's commit) is durable: record it, reread the manifest."""
        self.history.record_checkpoint(answer, duration_ms)
        self.state.reread_manifest()
        self.state.saw_step(int(answer["step"]))

    # -- pause, resume, checkpoint -----------------------------------------------------------

    def pause(self) -> dict[str, Any]:
        """Pause the step loop at the next step boundary (idempotent)."""
        self._after_procedure("pause")
        try:
            answer = self._call("pause", "pause")
        finally:
            self.release()
        with self.state.lock:
            self.state.last_step = int(answer["step"])
        return {"state": "paused", "step": int(answer["step"])}

    def resume(self) -> dict[str, Any]:
        """Resume a paused step loop."""
        self._after_procedure("resume")
        try:
            self._call("resume", "resume")
        finally:
            self.release()
        return {"state": "running"}

    def checkpoint(self, *, only_if_running: bool = False) -> dict[str, Any] | None:
        """Run the runtime's checkpoint procedure; ``{"version", "step", "duration_ms"}``.

        ``only_if_running`` (the timer): skip (None) unless the loop runs and has taken a step
        since the manifest's checkpoint, checked while holding the procedure lock, so that a
        pause that just ended is never followed by a timer checkpoint the user did not ask for.
        """
        self.exclusive(_TIMER if only_if_running else "checkpoint")
        try:
            if only_if_running:
                status = self.runtime_status()
                with self.state.lock:
                    manifest = self.state.manifest
                manifest_step = None if manifest is None else manifest.step
                if (
                    status is None
                    or status.get("state") != "running"
                    or status.get("step") == manifest_step
                ):
                    return None
            answer = self._call("checkpoint", "checkpoint")
        finally:
            self.release()
        self._checkpointed(answer)
        return {
            "version": int(answer["version"]),
            "step": int(answer["step"]),
            "duration_ms": int(answer["duration_ms"]),
        }

    # -- rescale -----------------------------------------------------------------------------

    def rescale(self, workers: int, mode: Literal["hot", "cold"] = "hot") -> dict[str, Any]:
        """Change the number of state workers to ``workers``, hot (the default) or cold.

        Cold, in this order (the runtime's part is :mod:`sparkstep.runtime.rescale`):

        1. pause the step loop (the state is ``rescaling`` until the end);
        2. checkpoint (manifest at ``v``; the loop stays paused);
        3. start the added workers on new stores ``workers/w<i>-e<epoch+1>`` created at ``v``
           (on state hosts: each on the host with the most free slots);
        4. the runtime's rescale: moves the shards and writes the manifest at ``v + 1`` (the
           commit point);
        5. stop the retired workers' processes and delete their stores;
        6. resume (unless the loop was paused before).

        Hot: step 3 at the last checkpoint ``v`` while the loop runs, then step 4 in hot mode
        (the runtime copies while its loop runs and pauses it only for the catch-up and the
        switch), then step 5 with the loop already running again. ``pause_ms`` is the
        coordinator's time from 1 to 6 (cold) or the runtime's pause (hot).

        A failure before 4 changes nothing (the added workers are stopped and their stores
        deleted), as does a hot rescale the runtime gives up before its pause (503); a runtime
        that fails in 4 exits and is recovered at whichever manifest is durable. More added
        workers than the state hosts have free slots is a :class:`ConflictError` (409) before
        step 1. Failpoints: ``rescale.after_checkpoint`` (cold), ``rescale.after_start``,
        ``rescale.after_runtime``, ``rescale.before_resume`` (cold).

        Deadline: the whole procedure has ``rescale_timeout_s`` from step 1. Step 4 sends what
        remains of it to the runtime, which never commits after it
        (:mod:`sparkstep.runtime.rescale`), and waits that long plus ``_ANSWER_GRACE_S`` for
        the answer. The undo (:meth:`_undo_rescale`) never deletes a store the durable manifest
        lists, and reads that manifest only once the runtime can no longer write it.
        """
        self.exclusive("rescale")
        try:
            return self._rescale(workers, mode == "hot")
        finally:
            with self.state.lock:
                if self.state.phase == "rescaling":
                    self.state.phase = "up"
            self.release()

    def _rescale(self, workers: int, hot: bool) -> dict[str, Any]:
        client = self._client("rescale")
        with self.state.lock:
            manifest = self.state.manifest
        launched = self.launcher.launched()
        if manifest is None or launched is None:
            raise RuntimeUnavailableError("rescale: the pipeline is recovering, try again soon")
        shards = manifest.layout.shards
        if workers > shards:
            raise InvalidRequestError(
                f"rescale: {workers} workers for S={shards} shards: at most {shards}"
            )
        old = manifest.workers
        mode = "hot" if hot else "cold"
        if workers == old:
            return {
                "mode": mode,
                "layout_epoch": int(manifest.epoch),
                "workers": old,
                "shards_moved": 0,
                "bytes_moved": 0,
                "bytes_precopied": 0,
                "bytes_paused": 0,
                "rounds": 0,
                "pause_ms": 0,
            }
        self.launcher.workers.check_slots(workers - old)
        try:
            status = client.status()
        except ControlError as exc:
            raise translate_control_error(exc, "rescale") from exc
        was_paused = status.get("state") == "paused"
        # Step 1. Pause (cold).
        started = time.monotonic()
        deadline = started + self.settings.rescale_timeout_s
        self.state.set_phase("rescaling")
        added: list[WorkerProcess] = []
        sent = False  # whether the runtime got the rescale request (step 4)
        try:
            if hot:
                # The last checkpoint: no other procedure can make one until this one ends.
                if not status.get("checkpoint"):
                    raise RuntimeUnavailableError("rescale: the runtime has not recovered yet")
                version = int(status["checkpoint"]["version"])
            else:
                client.pause()
                # Step 2. Checkpoint: the stores hold v, the loop stays paused.
                checkpoint = client.checkpoint()
                self._checkpointed(checkpoint)
                failpoint("rescale.after_checkpoint")
                version = int(checkpoint["version"])
            # Step 3. The added workers, on new stores created at v.
            epoch = int(manifest.epoch) + 1
            for i in range(old, workers):
                store = f"{WORKERS_DIR}/w{i}-e{epoch}"
                child = self.launcher.workers.start(i, store, create_version=version)
                added.append(child)
                self.launcher.add_pending(child)
            wait_ready(added, self.settings.start_timeout_s)
            failpoint("rescale.after_start")
            # Step 4. The runtime moves the shards and writes the manifest (the commit point).
            kept = list(launched.workers[: min(old, workers)])
            addresses = [w.address for w in kept] + [w.address for w in added]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeUnavailableError(
                    f"rescale: its deadline (rescale_timeout_s="
                    f"{self.settings.rescale_timeout_s:g}s) passed before the runtime's part"
                )
            sent = True
            answer = client.rescale(workers, addresses, remaining, _ANSWER_GRACE_S, mode=mode)
        except BaseException as exc:
            answered = not sent or (isinstance(exc, ControlError) and exc.status is not None)
            reason = f"rescale: no answer from the runtime by the rescale's deadline ({exc})"
            if not answered:
                # It may still be moving shards, and may still write the manifest: end it.
                self.launcher.kill_runtime(reason)
            self._undo_rescale(client, added, resume=answered and not was_paused and not hot)
            if not answered:
                raise RuntimeUnavailableError(
                    f"{reason}: the runtime was stopped; the pipeline recovers at the layout "
                    "of its manifest"
                ) from exc
            if isinstance(exc, ControlError):
                raise translate_control_error(exc, "rescale") from exc
            raise
        failpoint("rescale.after_runtime")
        # Step 5. The new worker set is supervised from now on; the retired ones go.
        retired = list(launched.workers[workers:])
        self.launcher.adopt(Launched((*kept, *added), launched.runtime, client), retired)
        self._checkpointed(answer, duration_ms=None)
        with self.state.lock:
            new_manifest = self.state.manifest
        listed = set() if new_manifest is None else set(new_manifest.stores)
        for child in retired:
            child.release(10.0)
            child.kill()
        self.launcher.workers.remove_stores(manifest.stores[workers:], listed)
        if not hot:
            failpoint("rescale.before_resume")
            # Step 6. Resume.
            if not was_paused:
                try:
                    client.resume()
                except ControlError as exc:
                    raise translate_control_error(exc, "rescale (resume)") from exc
        pause_ms = int(answer["pause_ms"]) if hot else round((time.monotonic() - started) * 1000)
        result = {
            "mode": mode,
            "layout_epoch": int(answer["layout_epoch"]),
            "workers": int(answer["workers"]),
            "shards_moved": int(answer["shards_moved"]),
            "bytes_moved": int(answer["bytes_moved"]),
            "bytes_precopied": int(answer["bytes_precopied"]),
            "bytes_paused": int(answer["bytes_paused"]),
            "rounds": int(answer["rounds"]),
            "pause_ms": pause_ms,
        }
        self.history.record_rescale({"at": now_iso(), "from_workers": old, **result})
        log.info(
            "rescaled from %d to %d workers: %s; pause parts (ms) %s",
            old,
            workers,
            result,
            answer.get("pause_parts_ms"),
        )
        return result

    def _undo_rescale(
        self, client: ControlClient, added: list[WorkerProcess], resume: bool
    ) -> None:
        """A rescale failed: stop the added workers, delete the stores of theirs that the
        durable manifest does not list, and resume the loop if ``resume``.

        The caller makes sure the runtime can no longer write the manifest (it answered the
        rescale request, never got it, or is dead). The manifest is read as recovery reads it
        (paths relative to the state dir); if it cannot be read, nothing is deleted: a store
        left behind is removed by the next launch, a store deleted wrongly is state lost.
        """
        self.launcher.drop_pending(added)
        for child in added:
            child.kill()
        self._remove_unlisted([c.store for c in added if c.store is not None])
        if resume:
            try:
                client.resume()
            except ControlError as exc:
                log.warning("rescale undone, but the loop could not be resumed: %s", exc)

    def _remove_unlisted(self, stores: list[str]) -> None:
        """Delete each of ``stores`` that the durable manifest does not list and that is a
        store sparkstep created (:func:`~sparkstep.storage.is_store`)."""
        try:  # a runtime that failed after its manifest write committed the new stores
            durable = read_manifest(self.state_dir)
        except SparkstepError as exc:
            log.warning("rescale undone; the added stores are kept: %s", exc)
            return
        if durable is None:
            return  # no checkpoint at all: nothing can be told apart, delete nothing
        self.launcher.workers.remove_stores(stores, set(durable.stores))

    # -- stop --------------------------------------------------------------------------------

    def stop(self) -> dict[str, Any]:
        """The runtime's stop: a final checkpoint, then the runtime exits; sets
        ``stop_requested`` (cleared again if the runtime refuses)."""
        self._after_procedure("stop")
        try:
            client = self._client("stop")
            self.state.stop_requested.set()
            try:
                answer = client.stop()
            except ControlError as exc:
                self.state.stop_requested.clear()
                raise translate_control_error(exc, "stop") from exc
        finally:
            self.release()
        self._checkpointed(answer, duration_ms=None)
        self.state.set_phase("stopping")
        return {"state": "stopped", "step": int(answer["step"]), "version": int(answer["version"])}
