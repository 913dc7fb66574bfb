"""keyed_sum: the running sum and count of ``value`` per ``key``.

Input value JSON ``{"key": str, "value": int}``; output rows ``{"key", "sum", "count"}`` as Z-set
deltas (``"weight": -1`` retracts a key's previous row, ``+1`` inserts its new one). Integrating
the output (adding up the weights per row) leaves exactly one row per key with the true sum and
count of all input for that key::

    sparkstep run --pipeline sparkstep.examples.keyed_sum:pipeline --input-topic numbers ...
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from sparkstep import Pipeline, aggregate

__all__ = ["pipeline", "transform"]


def transform(events: DataFrame) -> DataFrame:
    return aggregate(
        events, name="sums", key=["key"], aggs={"sum": "sum(value)", "count": "count(*)"}
    )


pipeline = Pipeline(
    name="keyed_sum",
    inputs={"events": "key string, value long"},
    transform=transform,
    output_key=["key"],
)
