"""sessions: sessionization of clicks per user with an inactivity timeout on logged time.

Input value JSON ``{"user": str, "page": str}``. A user's session stays open while clicks keep
arriving; when no click arrived for ``TIMEOUT_S`` seconds of logged step time, the session is
closed and one row is emitted: ``{"user", "clicks", "opened_ms", "closed_ms"}`` (``+1``; a closed
session is never retracted). Timers fire on the logged step time, so a replay closes the same
sessions at the same steps.

Integrating the output once every session has closed: per user, the clicks of its sessions add
up to the user's clicks in the input.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame

from sparkstep import Pipeline, stateful_map
from sparkstep.runtime.operators.stateful_map import MapContext

__all__ = ["TIMEOUT_S", "pipeline", "sessionize", "transform"]

TIMEOUT_S = 3.0


def sessionize(
    key: tuple[Any, ...], rows: pa.Table, state: dict[str, Any] | None, ctx: MapContext
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One user's new clicks (or a timeout) -> (closed sessions, the open session)."""
    if ctx.timed_out:
        if state is None:
            return [], None
        closed = {"clicks": state["clicks"], "opened_ms": state["opened_ms"]}
        return [{**closed, "closed_ms": ctx.step_time_ms}], None
    clicks = sum(rows.column("__weight").to_pylist())
    if state is None:
        return [], {"clicks": clicks, "opened_ms": ctx.step_time_ms}
    return [], {"clicks": state["clicks"] + clicks, "opened_ms": state["opened_ms"]}


def transform(clicks: DataFrame) -> DataFrame:
    return stateful_map(
        clicks,
        name="sessions",
        key=["user"],
        fn=sessionize,
        state_schema="clicks long, opened_ms long",
        output_schema="clicks long, opened_ms long, closed_ms long",
        timeout=TIMEOUT_S,
    )


pipeline = Pipeline(
    name="sessions",
    inputs={"clicks": "user string, page string"},
    transform=transform,
    output_key=["user"],
)
