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
| ``GET /api/v1/history``    | :class:`HistoryAnswer` (``?since=`` unix seconds: newer only) |
| ``GET /metrics``           | Prometheus text (:mod:`~sparkstep.coordinator_api.metrics`) |
| ``GET /``                  | the dashboard page (:mod:`~sparkstep.coordinator_api.dashboard`) |
| ``GET /static/...``        | the page's script, style and chart library (not in OpenAPI) |

Status codes, checked in this order:

1. 401: a token is configured (``SPARKSTEP_API_TOKEN``) and the request lacks
   ``Authorization: Bearer <token>``: checked by a middleware before anything else, so an
   unauthenticated caller learns nothing from validation (every path under ``/api/v1/``, and
   ``/``, ``/static/`` and ``/metrics`` with ``auth_metrics_and_dashboard``; the OpenAPI
   document and ``/docs`` are public);
2. 422: the body is invalid (FastAPI validates it before the handler runs);
3. 409: a procedure (checkpoint, rescale, stop) is in progress, or the runtime refuses the
   request in its current state; 503: the runtime is not running or cannot be reached
   (recovering, failed, stopped); 422: a valid rescale body the pipeline cannot take (more
   workers than its S shards).

Every error answers :class:`ErrorAnswer`, ``{"detail": "<what went wrong and what to do>"}``,
one line (an invalid body's problems are joined: ``body.workers: Input should be ...``); the
OpenAPI document declares it for every error status an operation can answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.params import Depends
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparkstep.coordinator_api.dashboard import STATIC_DIR, render_dashboard
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
    HistoryAnswer,
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

_UNAUTHORIZED = "missing or wrong bearer token: send Authorization: Bearer <token>"

_ERROR_401 = {"model": ErrorAnswer, "description": "missing or wrong bearer token"}
_ERROR_503 = {"model": ErrorAnswer, "description": "the runtime or the state cannot be reached"}
#: The error answers of the procedures (POST).
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _ERROR_401,
    409: {"model": ErrorAnswer, "description": "conflicts with a procedure in progress"},
    422: {"model": ErrorAnswer, "description": "an invalid body, or one the pipeline cannot take"},
    503: _ERROR_503,
}
#: The error answers of the reads (GET).
_READ_ERRORS: dict[int | str, dict[str, Any]] = {401: _ERROR_401, 503: _ERROR_503}
#: The error answers of a read with query parameters.
_QUERY_ERRORS: dict[int | str, dict[str, Any]] = {
    **_READ_ERRORS,
    422: {"model": ErrorAnswer, "description": "an invalid query parameter"},
}
#: The error answers of the pages (``/``, ``/metrics``): JSON, though the pages are not (with a
#: ``model`` FastAPI would declare it under the page's media type).
_PAGE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {
        "description": answer["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorAnswer"}}},
    }
    for code, answer in _READ_ERRORS.items()
}

#: Declares the bearer scheme in the OpenAPI document only: with ``auto_error=False`` it never
#: answers anything itself; the middleware in :func:`coordinator_app` checks the token.
_BEARER = HTTPBearer(auto_error=False, description="SPARKSTEP_API_TOKEN")

#: Paths that never need the token: the API's own description.
_PUBLIC = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def _one_line(exc: RequestValidationError) -> str:
    """The problems of an invalid request, one line: ``body.workers: Input should be ...``."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error.get('loc', ()))}: {error.get('msg')}"
        for error in exc.errors()
    )


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

    guarded: list[Depends] = [] if api_token is None else [Security(_BEARER)]
    guarded_pages = guarded if auth_metrics_and_dashboard else []

    def needs_token(path: str) -> bool:
        if api_token is None or path in _PUBLIC:
            return False
        return path.startswith(f"{API}/") or auth_metrics_and_dashboard

    @app.middleware("http")
    async def authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        # Before routing and body parsing: an unauthenticated caller gets 401 whatever it sent.
        if needs_token(request.url.path):
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {api_token}".encode()):
                return error(401, _UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    def error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)

    @app.exception_handler(RequestValidationError)
    def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back and fails (500) on a body that is not
        # UTF-8; the reason is enough: where and what.
        return error(422, _one_line(exc))

    @app.exception_handler(StarletteHTTPException)
    def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI answers 400 for a body it cannot even decode; to the API that is an invalid
        # body like any other (422). Other codes (404, 405) pass through.
        status = 422 if exc.status_code == 400 else exc.status_code
        return error(status, str(exc.detail), exc.headers)

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

    @app.get(f"{API}/status", responses=_READ_ERRORS, dependencies=guarded)
    def status() -> StatusAnswer:
        return StatusAnswer.model_validate(supervisor.status())

    @app.post(f"{API}/pause", responses=_ERRORS, dependencies=guarded)
    def pause() -> PauseAnswer:
        return PauseAnswer.model_validate(supervisor.pause())

    @app.post(f"{API}/resume", responses=_ERRORS, dependencies=guarded)
    def resume() -> ResumeAnswer:
        return ResumeAnswer.model_validate(supervisor.resume())

    @app.post(f"{API}/checkpoint", responses=_ERRORS, dependencies=guarded)
    def checkpoint() -> CheckpointAnswer:
        return CheckpointAnswer.model_validate(supervisor.checkpoint())

    @app.post(f"{API}/rescale", responses=_ERRORS, dependencies=guarded)
    def rescale(body: RescaleRequest) -> RescaleAnswer:
        return RescaleAnswer.model_validate(supervisor.rescale(body.workers, body.mode))

    @app.post(f"{API}/stop", responses=_ERRORS, dependencies=guarded)
    def stop() -> StopAnswer:
        return StopAnswer.model_validate(supervisor.stop())

    @app.get(f"{API}/checkpoints", responses=_READ_ERRORS, dependencies=guarded)
    def checkpoints() -> CheckpointsAnswer:
        return CheckpointsAnswer.model_validate({"checkpoints": supervisor.checkpoints()})

    @app.get(f"{API}/history", responses=_QUERY_ERRORS, dependencies=guarded)
    def history(
        since: Annotated[
            float | None,
            Query(
                allow_inf_nan=False,
                description="unix seconds: only the samples and events after this time",
            ),
        ] = None,
    ) -> HistoryAnswer:
        """The recent samples (rates, step latency, input lag per topic, every few seconds)
        and events (checkpoints, restarts, rescales) of this coordinator, kept in memory."""
        return HistoryAnswer.model_validate(supervisor.timeline.answer(since))

    @app.get("/metrics", response_class=PlainTextResponse, responses=_PAGE_ERRORS,
             dependencies=guarded_pages)  # fmt: skip
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(facts_of(supervisor)), media_type=CONTENT_TYPE)

    @app.get("/", response_class=HTMLResponse, responses=_PAGE_ERRORS, dependencies=guarded_pages)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(render_dashboard(facts_of(supervisor)))

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
