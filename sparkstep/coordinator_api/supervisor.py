"""Supervision: the coordinator starts, watches and restarts the state workers and the runtime.

This is seed 004's coordinator loop made into processes. The runtime recovers by itself when it
starts (at the manifest's version), so "recover" here means: stop whatever is left, start
everything again in the right order (:mod:`~sparkstep.coordinator_api.launcher`), and let the
runtime's recovery procedure run.

The parts, one module each:

- :mod:`~sparkstep.coordinator_api.launcher`: spawning the children, watching them, ending them;
- :mod:`~sparkstep.coordinator_api.procedures`: pause, resume, checkpoint, rescale, stop;
- :mod:`~sparkstep.coordinator_api.timer`: the checkpoint timer;
- :mod:`~sparkstep.coordinator_api.history`: the checkpoint and rescale history;
- :mod:`~sparkstep.coordinator_api.timeline`: the recent history over time (samples taken by
  this module's sampler thread every ``interval_s``, and events), ``GET /api/v1/history``;
- :mod:`~sparkstep.coordinator_api.state`: what they share (phase, last failure, manifest);
- this module: the :class:`Supervisor` that ties them, the supervision loop and the status.

Supervision states (``state`` of ``GET /api/v1/status``)::

      start ──> recovering ──ready──> running <──resume/pause──> paused
                   ^   |                 |  \\
     restart after |   | gives up        |   `── rescale ──> rescaling ──> running/paused
     the delay     |   v                 |
                   +── (a child died) <──+── stop ──> stopped
                       failed

Before every launch the Kafka cluster must answer and the input topics must exist
(:mod:`~sparkstep.coordinator_api.preflight`), and every state host must answer
(:mod:`~sparkstep.coordinator_api.hosts`), checked by the coordinator itself:

- a cluster or state host that does not answer: the state is ``recovering``, ``last_failure``
  says "the Kafka broker at X is unreachable (...); retrying in Ns (at T)" (or which state host
  does not answer), and the check is repeated with
  exponential backoff (1 s doubling to 60 s); nothing is spawned meanwhile, and these waits are
  not failures of the restart strategy; a stop ends the wait at once;
- a missing input topic is a configuration error: ``failed`` at once with the reason, no
  restart (at start, :meth:`Supervisor.check` refuses it before anything runs).

When a child dies: the state is ``recovering`` with the reason in ``last_failure``, the other
children are killed, and the restart strategy (:mod:`sparkstep.coordinator_api.restart`)
decides whether to launch again after its delay or to give up (``failed``). A runtime that
exits with status 2 refused its configuration: restarting cannot help, the state is ``failed``
at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Literal

from sparkstep.coordinator_api.children import write_token_file
from sparkstep.coordinator_api.errors import KafkaUnreachableError, LaunchError
from sparkstep.coordinator_api.history import History
from sparkstep.coordinator_api.hosts import (
    HostedWorkers,
    StateHostError,
    StateHostUnreachableError,
)
from sparkstep.coordinator_api.launcher import Launched, Launcher
from sparkstep.coordinator_api.preflight import Backoff, check_kafka
from sparkstep.coordinator_api.procedures import Procedures
from sparkstep.coordinator_api.restart import restart_strategy
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.state import Phase, SupervisorState, iso
from sparkstep.coordinator_api.statehost import check_name
from sparkstep.coordinator_api.timeline import Timeline
from sparkstep.coordinator_api.timer import CheckpointTimer
from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.io.config import write_kafka_settings_file
from sparkstep.runtime.manifest import read_manifest
from sparkstep.runtime.pipeline import load_pipeline, resolve_topics
from sparkstep.runtime.process import NO_RESTART

__all__ = ["Supervisor"]

log = logging.getLogger("sparkstep.coordinator")


class Supervisor:
    """Starts and supervises the pipeline's processes and runs its procedures; see the module
    docstring. ``child_env`` is the environment the children get (the entry point decides it).

    The internal secret: the runtime's control endpoint and the workers accept only a bearer
    token that this supervisor generates (``secrets.token_urlsafe(32)``, new for every
    supervisor) and writes to ``<state_dir>/coordinator/token`` (mode 0600, the
    ``--token-file`` of its children); its own control clients send it. It is never the REST
    API's token (``api_token``), so a REST user cannot call the workers or the runtime directly.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        child_env: Mapping[str, str],
        python: str = sys.executable,
    ) -> None:
        self.settings = settings
        self._secret = secrets.token_urlsafe(32)
        self.state_dir = settings.state_dir
        self.home = self.state_dir / "coordinator"
        self.token_file = self.home / "token"
        self.kafka_settings_file = self.home / "kafka-settings.json"
        self.restarts = 0
        self.state = SupervisorState(self.state_dir)
        self.timeline = Timeline()
        self.history = History(
            self.home / "checkpoints.jsonl", settings.retained_checkpoints, self.timeline
        )
        self.launcher = Launcher(
            settings,
            self.state,
            self._secret,
            self.token_file,
            self.kafka_settings_file,
            child_env,
            python,
        )
        self.procedures = Procedures(settings, self.state, self.launcher, self.history)
        self._strategy = restart_strategy(settings)
        self._done = threading.Event()
        self._pipeline_name = settings.name or settings.pipeline
        # --workers other than the manifest's: a rescale after the first recovery.
        self._startup_rescale: int | None = None
        self._input_topics: tuple[str, ...] = ()
        self._waiting_for_kafka = False

    # -- start -------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse what restarting cannot fix, before anything starts (:class:`ConfigError`).

        The pipeline must load and accept the input topics, and the input topics must exist if
        the Kafka cluster answers (one that does not is waited for once supervision starts); a
        ``--workers`` other than the manifest's W needs a rescale after recovery.
        """
        pipeline = load_pipeline(self.settings.pipeline)
        topics = resolve_topics(pipeline, self.settings.input_topics)
        self._input_topics = tuple(topics.values())
        self._pipeline_name = self.settings.name or pipeline.name
        if isinstance(self.launcher.workers, HostedWorkers):
            try:
                name = check_name(self._pipeline_name, "the pipeline name (--name)")
            except ValueError as exc:
                raise ConfigError(f"{exc}: state hosts keep its stores under it") from exc
            self.launcher.workers.bind_pipeline(name)
        try:
            self._check_kafka()
        except KafkaUnreachableError as exc:
            log.warning("%s: waiting for it once supervision starts", exc)
        manifest = read_manifest(self.state_dir)
        with self.state.lock:
            self.state.manifest = manifest
        if manifest is not None and manifest.workers != self.settings.workers:
            log.warning(
                "the checkpoint has %d workers and --workers is %d: recovering with %d, then "
                "rescaling to %d",
                manifest.workers,
                self.settings.workers,
                manifest.workers,
                self.settings.workers,
            )
            self._startup_rescale = self.settings.workers
        self.history.load(manifest)

    def start(self) -> None:
        """Write the token file (the internal secret) and start supervising (and the checkpoint
        timer and the timeline's sampler) in threads."""
        write_token_file(self.token_file, self._secret)
        write_kafka_settings_file(self.kafka_settings_file, self.settings.kafka_config)
        threading.Thread(target=self._supervise, name="supervisor", daemon=True).start()
        threading.Thread(target=self._sample, name="timeline", daemon=True).start()
        if self.settings.checkpoint_interval_s > 0:
            CheckpointTimer(
                self.settings.checkpoint_interval_s,
                self.state.stop_requested,
                lambda: self.state.phase == "up",
                lambda: self.procedures.checkpoint(only_if_running=True),
            ).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the pipeline is stopped (True) or ``timeout`` passed (False)."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def failure(self) -> str | None:
        """The reason, once the pipeline has ``failed`` (nothing will restart it); else None."""
        with self.state.lock:
            return self.state.failure_reason() if self.state.phase == "failed" else None

    # -- supervision -------------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._supervise_loop()
        except BaseException as exc:  # a bug in supervision must not leave orphans
            log.exception("supervision failed")
            self.state.set_failure(f"supervision failed: {exc!r}")
            self.state.set_phase("failed")
            self.launcher.kill_all()
            self._done.set()

    def _sample(self) -> None:
        """A timeline sample every ``interval_s`` until the pipeline is stopped."""
        while not self._done.wait(self.timeline.interval_s):
            status, runtime_status = self.status_and_runtime()
            self.timeline.sample(str(status["state"]), status["step"], runtime_status)

    def _supervise_loop(self) -> None:
        stop_requested = self.state.stop_requested
        while not stop_requested.is_set():
            reason: str | None
            fatal = False
            try:
                if not self._wait_for_services():
                    break
                launched = self._launch()
            except LaunchError as exc:
                reason = str(exc)
                fatal = self.launcher.runtime_refused()
            except ConfigError as exc:
                reason, fatal = str(exc), True
            except StateHostError as exc:  # a host went away or refused: launch again
                reason = str(exc)
            except SparkstepError as exc:  # the manifest unreadable, a store dir not removable
                reason, fatal = str(exc), True
            else:
                if self._startup_rescale is not None:
                    target, self._startup_rescale = self._startup_rescale, None
                    threading.Thread(
                        target=self._rescale_at_start, args=(target,), name="rescale", daemon=True
                    ).start()
                reason = self.launcher.watch(launched)
                fatal = reason is not None and launched.runtime.proc.returncode in NO_RESTART
            if reason is None or stop_requested.is_set():  # stopped on request
                break
            self.launcher.kill_all()
            self.state.set_failure(reason)
            delay = None if fatal else self._strategy.on_failure(time.monotonic())
            if delay is None:
                log.error("giving up (%s): %s", self._strategy.describe(), reason)
                self.state.set_phase("failed")
                return  # _done stays unset: the coordinator keeps reporting "failed"
            log.warning("recovering in %.1fs: %s", delay, reason)
            self.state.set_phase("recovering")
            if stop_requested.wait(delay):
                break
            self.restarts += 1
            self.timeline.event("restart", reason=reason)
        self.launcher.kill_all(graceful=True)
        self.state.set_phase("stopped")
        self._done.set()

    def _check_kafka(self) -> None:
        s = self.settings
        check_kafka(s.bootstrap_servers, s.kafka_config, self._input_topics)

    def _wait_for_services(self) -> bool:
        """Until the cluster answers, the input topics exist and every state host answers
        (True) or a stop is requested (False), with backoff, spawning nothing;
        :class:`ConfigError` for a missing topic."""
        backoff = Backoff()
        stop_requested = self.state.stop_requested
        while not stop_requested.is_set():
            try:
                self._check_kafka()
                self.launcher.workers.check()
            except (KafkaUnreachableError, StateHostUnreachableError) as exc:
                delay = backoff.next_delay()
                reason = f"{exc}; retrying in {delay:g}s (at {iso(time.time() + delay)})"
                log.warning("%s", reason)
                with self.state.lock:
                    self.state.phase = "recovering"
                    self._waiting_for_kafka = True
                self.state.set_failure(reason)
                stop_requested.wait(delay)
                continue
            with self.state.lock:
                self._waiting_for_kafka = False
            return True
        return False

    def _launch(self) -> Launched:
        launched = self.launcher.launch()
        self.history.seed(self.state.manifest)
        return launched

    def _rescale_at_start(self, workers: int) -> None:
        try:
            result = self.rescale(workers)
        except SparkstepError as exc:
            log.error("the rescale to %d workers after recovery failed: %s", workers, exc)
            return
        log.info("rescaled to --workers %d after recovery: %s", workers, result)

    # -- procedures (:mod:`~sparkstep.coordinator_api.procedures`) ----------------------------

    def pause(self) -> dict[str, Any]:
        """Pause the step loop at the next step boundary (idempotent)."""
        return self.procedures.pause()

    def resume(self) -> dict[str, Any]:
        """Resume a paused step loop."""
        return self.procedures.resume()

    def checkpoint(self) -> dict[str, Any] | None:
        """A checkpoint now: ``{"version", "step", "duration_ms"}``."""
        return self.procedures.checkpoint()

    def rescale(self, workers: int, mode: Literal["hot", "cold"] = "hot") -> dict[str, Any]:
        """Change the number of state workers to ``workers`` at a checkpoint boundary, hot
        (copying while the pipeline runs) or cold (paused for the whole move)."""
        return self.procedures.rescale(workers, mode)

    def stop(self) -> dict[str, Any]:
        """Graceful stop: a final checkpoint, then every process exits.

        A failed pipeline, or one waiting for the Kafka cluster (no runtime either way), stops
        at once and answers the manifest's checkpoint.
        """
        with self.state.lock:
            idle = self.state.phase == "failed" or self._waiting_for_kafka
        if idle:
            self.state.stop_requested.set()
            self.launcher.kill_all()
            self.state.set_phase("stopped")
            self._done.set()
            manifest = read_manifest(self.state_dir)
            return {
                "state": "stopped",
                "step": None if manifest is None else int(manifest.step),
                "version": None if manifest is None else int(manifest.version),
            }
        return self.procedures.stop()

    def shutdown(self, timeout: float = 600.0) -> None:
        """Ctrl-C / SIGTERM: a graceful stop when the runtime runs, else end the children."""
        if not self._done.is_set():
            try:
                self.stop()
            except SparkstepError as exc:
                log.warning("no final checkpoint (%s): stopping the processes", exc)
                self.state.stop_requested.set()
        if not self._done.wait(timeout):
            self.state.stop_requested.set()
            self.launcher.kill_all()

    def close(self) -> None:
        """End every child at once (the coordinator is exiting)."""
        self.state.stop_requested.set()
        self.launcher.kill_all()

    # -- reading -----------------------------------------------------------------------------

    def checkpoints(self) -> list[dict[str, Any]]:
        """The retained checkpoints, oldest first; the last one is the manifest's."""
        return self.history.checkpoints()

    def rescales(self) -> list[dict[str, Any]]:
        return self.history.rescales()

    def status(self) -> dict[str, Any]:
        """``GET /api/v1/status``: the coordinator's view, with the runtime's where it runs."""
        return self.status_and_runtime()[0]

    def status_and_runtime(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """:meth:`status` and the runtime's status document it was made from (None when the
        runtime cannot be reached)."""
        doc = self.procedures.runtime_status()
        launched = self.launcher.launched()
        with self.state.lock:
            phase = self.state.phase
            manifest = self.state.manifest
            failure = self.state.last_failure
            last_failure = None if failure is None else dict(failure)
            step = self.state.last_step
        latest = self.history.latest()
        state = self._state(phase, doc)
        if doc is not None:
            step = int(doc["step"])
        if step is None and manifest is not None:
            step = int(manifest.step)
        workers = () if launched is None else launched.workers
        pids = {str(i): w.pid for i, w in enumerate(workers)}
        hosts = {str(i): w.host for i, w in enumerate(workers) if w.host is not None}
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
                "hosts": hosts,
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
        return "running"  # also "checkpointing": a running pipeline's checkpoint
