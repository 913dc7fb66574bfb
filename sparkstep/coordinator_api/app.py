"""The coordinator's REST API (v1): a FastAPI app over a :class:`Supervisor`.

| method and path            | answer (model)                                         |
| -------------------------- | ------------------------------------------------------ |
| ``GET /api/v1/status``     | :class:`StatusAnswer`                                  |
| ``POST /api/v1/pause``     | :class:`PauseAnswer` (idempotent)                      |
| ``POST /api/v1/resume``    | :class:`ResumeAnswer`                                  |
| ``POST /api/v1/checkpoint``| :class:`CheckpointAnswer`                              |
| ``POST /api/v1/rescale``   | :class:`RescaleAnswer` for ``{"workers": N}``          |
| ``POST /api/v1/stop``      | :class:`StopAnswer`: a final checkpoint, then all exit |
| ``GET /api/v1/checkpoints``| :class:`CheckpointsAnswer`                             |
| ``GET /metrics``           | Prometheus text (:mod:`~sparkstep.coordinator_api.metrics`) |
| ``GET /``                  | the dashboard page (:mod:`~sparkstep.coordinator_api.dashboard`) |

Status codes, checked in this order:

1. 422: the body is invalid (FastAPI validates it before the handler runs, so an invalid
   rescale body is 422 whatever else holds, even without a token);
2. 401: a token is configured (``SPARKSTEP_API_TOKEN``) and the request lacks
   ``Authorization: Bearer <token>`` (every path but ``/`` and ``/metrics``, unless
   ``auth_metrics_and_dashboard``; the OpenAPI document and ``/docs`` are public);
3. 409: a procedure (checkpoint, rescale, stop) is in progress, or the runtime refuses the
   request in its current state; 503: the runtime is not running or cannot be reached
   (recovering, failed, stopped); 422: a valid rescale body the pipeline cannot take (more
   workers than its S shards).

Every error answers ``{"detail": "<what went wrong and what to do>"}``.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparkstep.coordinator_api.dashboard import render_dashboard
from sparkstep.coordinator_api.errors import (
    ConflictError,
    InvalidRequestError,
    RuntimeUnavailableError,
)
from sparkstep.coordinator_api.metrics import CONTENT_TYPE, CoordinatorFacts, prometheus_text
from sparkstep.coordinator_api.models import (
    CheckpointAnswer,
    CheckpointsAnswer,
    ErrorAnswer,
    PauseAnswer,
    RescaleAnswer,
    RescaleRequest,
    ResumeAnswer,
    StatusAnswer,
    StopAnswer,
)
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.errors import SparkstepError

__all__ = ["coordinator_app", "facts_of"]

API = "/api/v1"

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorAnswer, "description": "missing or wrong bearer token"},
    409: {"model": ErrorAnswer, "description": "conflicts with a procedure in progress"},
    503: {"model": ErrorAnswer, "description": "the runtime cannot be reached"},
}


class Unauthorized(Exception):
    """Raised by the token check; answered 401."""


def facts_of(supervisor: Supervisor) -> CoordinatorFacts:
    """What the metrics and the dashboard render, gathered from the supervisor now."""
    status, runtime_status = supervisor.status_and_runtime()
    return CoordinatorFacts(
        state=str(status["state"]),
        runtime_status=runtime_status,
        checkpoints=supervisor.checkpoints(),
        rescales=supervisor.rescales(),
        restarts=supervisor.restarts,
        pipeline=str(status["pipeline"]),
        last_failure=status["last_failure"],
    )


def coordinator_app(
    supervisor: Supervisor, api_token: str | None, auth_metrics_and_dashboard: bool = False
) -> FastAPI:
    """The REST app; ``api_token`` None leaves the API open (bind it to 127.0.0.1 then)."""
    app = FastAPI(
        title="sparkstep coordinator",
        version="1",
        description="Pause, checkpoint, rescale and stop a sparkstep pipeline.",
    )

    def authorise(request: Request, always: bool = True) -> None:
        if api_token is None or not (always or auth_metrics_and_dashboard):
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {api_token}".encode()):
            raise Unauthorized

    def error(status: int, detail: str) -> JSONResponse:
        return JSONResponse(status_code=status, content={"detail": detail})

    @app.exception_handler(RequestValidationError)
    def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back and fails (500) on a body that is not
        # UTF-8; the reason is enough: where and what.
        details = [
            {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")),
             "type": str(e.get("type"))}
            for e in exc.errors()
        ]  # fmt: skip
        return JSONResponse(status_code=422, content={"detail": details})

    @app.exception_handler(StarletteHTTPException)
    def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 for a body it cannot even decode; to the API that is an invalid
        # body like any other (422). Other codes (404, 405) pass through.
        status = 422 if exc.status_code == 400 else exc.status_code
        return JSONResponse(status_code=status, content={"detail": exc.detail}, headers=exc.headers)

    @app.exception_handler(Unauthorized)
    def unauthorized(_request: Request, _exc: Unauthorized) -> JSONResponse:
        response = error(401, "missing or wrong bearer token: send Authorization: Bearer <token>")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(ConflictError)
    def conflict(_request: Request, exc: ConflictError) -> JSONResponse:
        return error(409, str(exc))

    @app.exception_handler(InvalidRequestError)
    def invalid(_request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error(422, str(exc))

    @app.exception_handler(RuntimeUnavailableError)
    def unavailable(_request: Request, exc: RuntimeUnavailableError) -> JSONResponse:
        return error(503, str(exc))

    @app.exception_handler(SparkstepError)
    def failed(_request: Request, exc: SparkstepError) -> JSONResponse:
        # Anything else sparkstep reports (the manifest unreadable, ...): the pipeline cannot
        # serve the request now; the message says why.
        return error(503, str(exc))

    @app.get(f"{API}/status", responses={401: _ERRORS[401]})
    def status(request: Request) -> StatusAnswer:
        authorise(request)
        return StatusAnswer.model_validate(supervisor.status())

    @app.post(f"{API}/pause", responses=_ERRORS)
    def pause(request: Request) -> PauseAnswer:
        authorise(request)
        return PauseAnswer.model_validate(supervisor.pause())

    @app.post(f"{API}/resume", responses=_ERRORS)
    def resume(request: Request) -> ResumeAnswer:
        authorise(request)
        return ResumeAnswer.model_validate(supervisor.resume())

    @app.post(f"{API}/checkpoint", responses=_ERRORS)
    def checkpoint(request: Request) -> CheckpointAnswer:
        authorise(request)
        return CheckpointAnswer.model_validate(supervisor.checkpoint())

    @app.post(f"{API}/rescale", responses=_ERRORS)
    def rescale(body: RescaleRequest, request: Request) -> RescaleAnswer:
        authorise(request)
        return RescaleAnswer.model_validate(supervisor.rescale(body.workers))

    @app.post(f"{API}/stop", responses=_ERRORS)
    def stop(request: Request) -> StopAnswer:
        authorise(request)
        return StopAnswer.model_validate(supervisor.stop())

    @app.get(f"{API}/checkpoints", responses={401: _ERRORS[401]})
    def checkpoints(request: Request) -> CheckpointsAnswer:
        authorise(request)
        return CheckpointsAnswer.model_validate({"checkpoints": supervisor.checkpoints()})

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(request: Request) -> PlainTextResponse:
        authorise(request, always=False)
        return PlainTextResponse(prometheus_text(facts_of(supervisor)), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse)
    def dashboard(request: Request) -> HTMLResponse:
        authorise(request, always=False)
        return HTMLResponse(render_dashboard(facts_of(supervisor)))

    return app
