"""Pipelines the runtime tests run in child processes (``--pipeline MODULE:ATTR``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame

from sparkstep import Pipeline, aggregate, stateful_map
from sparkstep.examples import keyed_sum
from sparkstep.runtime.operators.stateful_map import MapContext

__all__ = ["POISON_KEY", "more_aggregates", "poisoned"]

POISON_KEY = "poison"


def _running_count(
    key: tuple[Any, ...], rows: pa.Table, state: dict[str, Any] | None, ctx: MapContext
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The count per key, except that the poison key makes it raise, on every run."""
    if key[0] == POISON_KEY:
        raise ValueError(f"the key {POISON_KEY!r} is not allowed")
    count = (0 if state is None else state["n"]) + sum(rows.column("__weight").to_pylist())
    return [{"n": count}], {"n": count}


def _poisoned(events: DataFrame) -> DataFrame:
    return stateful_map(
        events,
        name="counts",
        key=["key"],
        fn=_running_count,
        state_schema="n long",
        output_schema="n long",
    )


poisoned = Pipeline(
    name="poisoned",
    inputs=keyed_sum.pipeline.inputs,
    transform=_poisoned,
    output_key=["key"],
)


def _more_aggregates(events: DataFrame) -> DataFrame:
    """keyed_sum's operator under the same name, with one more aggregate."""
    return aggregate(
        events,
        name="sums",
        key=["key"],
        aggs={"sum": "sum(value)", "count": "count(*)", "top": "max(value)"},
    )


more_aggregates = Pipeline(
    name="keyed_sum",
    inputs=keyed_sum.pipeline.inputs,
    transform=_more_aggregates,
    output_key=["key"],
)
