"""A client of the coordinator's REST API (``sparkstep status|pause|...`` and the quickstart).

Failures are :class:`ApiError`: the coordinator answered an error (its ``detail`` and status),
or it cannot be reached at all (``status`` None; the message says so and what to check).
"""

from __future__ import annotations

from typing import Any

import httpx

from sparkstep.coordinator_api.errors import CoordinatorError

__all__ = ["ApiError", "CoordinatorClient"]


class ApiError(CoordinatorError):
    """Raised when the coordinator refuses a call (``status``) or cannot be reached (None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CoordinatorClient:
    """Calls the coordinator at ``url`` (``http://127.0.0.1:8080``) with an optional token."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.request(method, f"/api/v1/{path}", json=body)
        except httpx.HTTPError as exc:
            raise ApiError(
                f"cannot reach the coordinator at {self.url} ({exc.__class__.__name__}: {exc}): "
                "is `sparkstep run` running there? (--api URL)"
            ) from exc
        if response.status_code != 200:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(f"{path}: {detail} (HTTP {response.status_code})", response.status_code)
        return response.json()

    def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("GET", "status")
        return answer

    def pause(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("POST", "pause")
        return answer

    def resume(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("POST", "resume")
        return answer

    def checkpoint(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("POST", "checkpoint")
        return answer

    def rescale(self, workers: int, mode: str = "hot") -> dict[str, Any]:
        body = {"workers": workers, "mode": mode}
        answer: dict[str, Any] = self._call("POST", "rescale", body)
        return answer

    def stop(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("POST", "stop")
        return answer

    def checkpoints(self) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("GET", "checkpoints")
        return answer
