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
| ``POST /pause``     | ``{"state": "paused", "step"}``: every step below ``step`` is done  |
| ``POST /resume``    | ``{"state": "running"}``                                            |
| ``POST /checkpoint``| ``{"version", "step", "duration_ms"}`` (pause, commit, manifest,     |
|                     | reopen, resume; 409 while another procedure runs)                   |
| ``POST /stop``      | ``{"state": "stopped", "step", "version"}``: a final checkpoint,     |
|                     | then the loop stops and the process exits                           |

``state`` is one of ``running``, ``pausing``, ``paused``, ``stopping``, ``stopped`` (the step
loop's :class:`~sparkstep.runtime.runstate.Phase`) or ``failed``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from sparkstep.errors import SparkstepError
from sparkstep.runtime.driver import Runtime
from sparkstep.runtime.errors import StateMachineError, StepRuntimeError
from sparkstep.runtime.runstate import Phase, RunState

__all__ = ["ControlClient", "ControlError", "control_app"]


class ControlError(StepRuntimeError):
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
            "state": "failed" if state.failure is not None else snapshot.phase.value,
            "step": runtime.next_step,
            "deployment": None if manifest is None else manifest.deployment,
            "checkpoint": None
            if manifest is None
            else {"version": manifest.version, "step": manifest.step},
            "workers": None if manifest is None else manifest.workers,
            "layout_epoch": None if manifest is None else manifest.epoch,
            "failure": None if state.failure is None else str(state.failure),
            "input_ends": runtime.input_ends(),
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
        return {"state": Phase.PAUSED.value, "step": step}

    @app.post("/resume", dependencies=[Depends(authorised)])
    def resume() -> dict[str, Any]:
        lock = exclusive()
        try:
            state.resume()
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        return {"state": Phase.RUN.value}

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
            manifest = runtime.checkpoint(None)
            state.stop(step, runtime.options.pause_timeout_s)
        except StateMachineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from exc
        finally:
            lock.release()
        on_stop()
        return {"state": Phase.STOPPED.value, "step": manifest.step, "version": manifest.version}

    return app


class ControlClient:
    """Calls a runtime's control endpoint at ``address`` (``host:port``)."""

    def __init__(self, address: str, token: str, timeout: float = 600.0) -> None:
        self.address = address
        self._http = httpx.Client(
            base_url=f"http://{address}",
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def _call(self, method: str, path: str) -> dict[str, Any]:
        try:
            response = self._http.request(method, path)
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

    def close(self) -> None:
        self._http.close()
