"""The runtime's control endpoint (internal API) and the client the coordinator uses.

The runtime process serves, on 127.0.0.1 with the deployment's bearer token, a small JSON API
through which the coordinator schedules the runtime's procedures. It is internal: users talk to
the coordinator's REST API, which forwards to this one. Every call needs
``Authorization: Bearer <token>`` (401 otherwise).

| method and path     | answer                                                              |
| ------------------- | ------------------------------------------------------------------- |
| ``GET /status``     | ``{"state", "step", "deployment", "checkpoint": {"version", "step"},|
|                     | "workers", "layout_epoch", "failure", "input_ends"}``; input_ends:  |
|                     | ``{"topic/partition": end}`` of the last logged step                |
|                     | ``"metrics"``: the runtime's metrics, shape below                   |
| ``POST /pause``     | ``{"state": "paused", "step"}``: every step below ``step`` is done  |
| ``POST /resume``    | ``{"state": "running"}``                                            |
| ``POST /checkpoint``| ``{"version", "step", "duration_ms"}`` (pause, commit, manifest,     |
|                     | reopen, resume; 409 while another procedure runs)                   |
| ``POST /stop``      | ``{"state": "stopped", "step", "version"}``: a final checkpoint,     |
|                     | then the loop stops and the process exits 0; if the checkpoint      |
|                     | fails, 500 with the reason, the loop is ``failed`` and the process  |
|                     | exits as failed                                                     |
| ``POST /rescale``   | body ``{"workers": N, "addresses": [N "host:port", worker order],   |
|                     | "deadline_s": D, "mode": "cold"|"hot"}`` (D optional: the caller's  |
|                     | deadline, seconds from now; past it the rescale never writes its    |
|                     | manifest, see :mod:`sparkstep.runtime.rescale`; mode default cold); |
|                     | answer :class:`~sparkstep.runtime.rescale.RescaleResult` as JSON.   |
|                     | Cold: 409 unless paused, and the loop stays paused. Hot: the loop   |
|                     | may run, the rescale pauses and resumes it itself; a failure before |
|                     | its pause is 503 and the loop runs on. 409 while another procedure  |
|                     | runs; 422 for N outside 1..S, a wrong count of addresses, a kept    |
|                     | worker with another address, or an added worker not ready           |

``GET /status`` also has ``"layout": {"epoch", "workers", "shards_per_worker": [n0, ...]}``.

``state`` is one of ``running``, ``pausing``, ``paused``, ``stopping``, ``stopped`` (the step
loop's :class:`~sparkstep.runtime.runstate.LoopPhase`), ``checkpointing`` (a checkpoint of a
running loop holds it paused briefly and resumes it) or ``failed``.

``metrics`` is :meth:`sparkstep.runtime.metrics.RuntimeMetrics.snapshot` (counters since the
runtime process started, new steps only; times in seconds, ``*_at`` in unix seconds; lag is the
last stable offset seen minus the end of the last logged step; an LSO stall is a planned
division while the partition's high watermark was above its LSO)::

    {"started_at", "steps", "last_step", "last_step_at", "replayed_steps", "records_in",
     "records_out", "dead_letters", "step_rate", "records_in_rate",
     "step_latency_seconds": {"buckets": {"0.01": n, ..., "+Inf": n} (cumulative), "sum", "count"},
     "checkpoints": {"count", "sum_seconds", "recent": [{"version", "step", "seconds", "at"}]},
     "partitions": {"topic/partition": {"topic", "partition", "end", "stable", "high", "lag",
                                        "lso_stalls", "stalled"}}}
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.runtime.driver import Runtime
from sparkstep.runtime.errors import (
    RescaleAbortedError,
    RescaleRequestError,
    StateMachineError,
)
from sparkstep.runtime.layout import check_worker_count
from sparkstep.runtime.runstate import LoopPhase, RunState
from sparkstep.runtime.worker.client import WorkerClient

__all__ = ["ControlClient", "ControlError", "control_app"]


class RescaleBody(BaseModel):
    """The body of ``POST /rescale``: the new W and every worker's address, in worker order."""

    workers: int = Field(ge=1)
    addresses: list[str]
    deadline_s: float | None = Field(default=None, gt=0)
    mode: Literal["hot", "cold"] = "cold"


class ControlError(SparkstepError):
    """Raised by :class:`ControlClient` when the runtime refuses a call or cannot be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def control_app(
    runtime: Runtime, state: RunState, token: str, on_stop: Callable[[], None]
) -> FastAPI:
    """The FastAPI app of the control endpoint over a running ``runtime`` and its ``state``."""
    app = FastAPI(title="sparkstep runtime control (internal)", docs_url=None, redoc_url=None)
    procedure = threading.Lock()

    @app.exception_handler(SparkstepError)
    def failed(_request: Request, exc: SparkstepError) -> JSONResponse:
        # A procedure failed (a worker, Kafka): the loop is failed and the process will exit.
        return JSONResponse(status_code=500, content={"detail": str(exc)})

    def authorised(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header, f"Bearer {token}"):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    def exclusive() -> threading.Lock:
        if not procedure.acquire(blocking=False):
            raise HTTPException(status_code=409, detail="another procedure is running")
        return procedure

    def status_doc() -> dict[str, Any]:
        snapshot = state.snapshot()
        manifest = runtime.manifest
        return {
            "state": "failed"
            if state.failure is not None
            else "checkpointing"
            if snapshot.brief
            else snapshot.phase.value,
            "step": runtime.next_step,
            "deployment": None if manifest is None else manifest.deployment,
            "checkpoint": None
            if manifest is None
            else {"version": manifest.version, "step": manifest.step},
            "workers": None if manifest is None else manifest.workers,
            "layout_epoch": None if manifest is None else manifest.epoch,
            "failure": None if state.failure is None else str(state.failure),
            "input_ends": runtime.input_ends(),
            "metrics": runtime.metrics.snapshot(),
            "layout": None
            if manifest is None
            else {
                "epoch": manifest.epoch,
                "workers": manifest.workers,
                "shards_per_worker": manifest.layout.shard_counts(),
            },
        }

    @app.get("/status", dependencies=[Depends(authorised)])
    def status() -> dict[str, Any]:
        return status_doc()

    @app.post("/pause", dependencies=[Depends(authorised)])
    def pause() -> dict[str, Any]:
        try:
            step = state.pause(runtime.options.pause_timeout_s)
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        return {"state": LoopPhase.PAUSED.value, "step": step}

    @app.post("/resume", dependencies=[Depends(authorised)])
    def resume() -> dict[str, Any]:
        lock = exclusive()
        try:
            state.resume()
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        return {"state": LoopPhase.RUN.value}

    @app.post("/checkpoint", dependencies=[Depends(authorised)])
    def checkpoint() -> dict[str, Any]:
        lock = exclusive()
        started = time.monotonic()
        try:
            manifest = runtime.checkpoint(state)
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        return {
            "version": manifest.version,
            "step": manifest.step,
            "duration_ms": round((time.monotonic() - started) * 1000),
        }

    @app.post("/stop", dependencies=[Depends(authorised)])
    def stop() -> dict[str, Any]:
        lock = exclusive()
        try:
            step = state.pause(runtime.options.pause_timeout_s)
            # The loop's state goes with the checkpoint: a failure fails the loop (the process
            # exits as failed, with the reason) rather than leaving it paused for good.
            manifest = runtime.checkpoint(state)
            state.stop(step, runtime.options.pause_timeout_s)
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        on_stop()
        return {
            "state": LoopPhase.STOPPED.value,
            "step": manifest.step,
            "version": manifest.version,
        }

    @app.post("/rescale", dependencies=[Depends(authorised)])
    def rescale(body: RescaleBody) -> dict[str, Any]:
        received = time.monotonic()
        try:
            check_worker_count(body.workers, runtime.pipeline.shards)
        except ConfigError as exc:
            raise HTTPException(422, str(exc)) from exc
        if len(body.addresses) != body.workers:
            raise HTTPException(
                422,
                f"{body.workers} workers need {body.workers} addresses, not {len(body.addresses)}",
            )
        lock = exclusive()
        try:
            hot = body.mode == "hot"
            if not hot and state.snapshot().phase is not LoopPhase.PAUSED:
                raise HTTPException(409, "a cold rescale needs the loop paused: pause first")
            clients = [WorkerClient(address, token) for address in body.addresses]
            deadline = None if body.deadline_s is None else received + body.deadline_s
            result = runtime.rescale(state, clients, deadline, hot=hot)
        except RescaleRequestError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        except RescaleAbortedError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from exc
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        return result.to_json()

    return app


class ControlClient:
    """Calls a runtime's control endpoint at ``address`` (``host:port``). Holds a connection
    pool: :meth:`close` it, or use the client as a context manager."""

    def __init__(self, address: str, token: str, timeout: float = 600.0) -> None:
        self.address = address
        self._http = httpx.Client(
            base_url=f"http://{address}",
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> dict[str, Any]:
        try:
            if timeout is None:
                response = self._http.request(method, path, json=body)
            else:
                response = self._http.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ControlError(f"the runtime at {self.address} cannot be reached: {exc}") from exc
        if response.status_code != 200:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ControlError(
                f"runtime {method} {path}: {response.status_code} {detail}", response.status_code
            )
        answer: dict[str, Any] = response.json()
        return answer

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")

    def pause(self) -> dict[str, Any]:
        return self._call("POST", "/pause")

    def resume(self) -> dict[str, Any]:
        return self._call("POST", "/resume")

    def checkpoint(self) -> dict[str, Any]:
        return self._call("POST", "/checkpoint")

    def stop(self) -> dict[str, Any]:
        return self._call("POST", "/stop")

    def rescale(
        self,
        workers: int,
        addresses: list[str],
        deadline_s: float | None = None,
        grace_s: float = 30.0,
        *,
        mode: str = "cold",
    ) -> dict[str, Any]:
        """``POST /rescale``: cold (the loop must be paused) or hot; see
        :mod:`sparkstep.runtime.rescale`.

        With ``deadline_s`` the runtime never commits the rescale after ``deadline_s`` from
        now, and this call waits for its answer ``deadline_s + grace_s`` at most
        (:class:`ControlError` with ``status`` None past that: the rescale may still be
        running, and may still commit, until the runtime process is gone).
        """
        body: dict[str, Any] = {"workers": workers, "addresses": addresses, "mode": mode}
        if deadline_s is None:
            return self._call("POST", "/rescale", body)
        body["deadline_s"] = deadline_s
        return self._call("POST", "/rescale", body, timeout=deadline_s + grace_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
