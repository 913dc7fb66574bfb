"""Plan checks: user code between sparkstep operators must be linear over Z-sets.

Each step runs the user's DataFrame code over that step's input only. Row-wise code (select,
filter, withColumn, explode, union) gives the same integrated output however the input is
divided into steps; anything that looks at several rows at once (an aggregation, a join, a
distinct, a window, a limit) silently computes a per-step answer that looks right in a test with
one step and is wrong in production. So the analyzed plan is inspected and such nodes are
refused with a message naming the sparkstep operator to use instead. Non-deterministic
expressions are refused too: a replayed step must produce the output it produced the first time.

The check walks the analyzed logical plan from the top and stops at *boundaries*: the plans
sparkstep itself produced (input sources, operator outputs), which are wrapped in a
``SubqueryAlias`` named ``__sparkstep_<...>`` (see :func:`boundary_alias`). Each sparkstep
operator checks its own input the same way when it is built, so every piece of user code is
checked exactly once.

Raises :class:`NonLinearPlanError` with the node, the reason and what to use instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sparkstep.runtime.errors import NonLinearPlanError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["BOUNDARY_PREFIX", "WEIGHT", "boundary_alias", "check_linear", "scala_seq"]

WEIGHT = "__weight"
BOUNDARY_PREFIX = "__sparkstep_"

# Logical plan node -> (what is wrong, what to use instead).
_REFUSED_NODES: dict[str, tuple[str, str]] = {
    "Aggregate": (
        "an aggregation sees only one step's rows",
        "sparkstep.aggregate(df, name=..., key=[...], aggs={...})",
    ),
    "Join": (
        "a join sees only one step's rows on each side",
        "sparkstep.join(left, right, name=..., on=[...])",
    ),
    "Distinct": ("distinct sees only one step's rows", "sparkstep.distinct(df, name=...)"),
    "Deduplicate": (
        "distinct or dropDuplicates sees only one step's rows",
        "sparkstep.distinct(df, name=...)",
    ),
    "Window": (
        "a window function sees only one step's rows",
        "sparkstep.stateful_map(df, name=..., key=[...], fn=..., state_schema=...)",
    ),
    "GlobalLimit": ("limit is not linear: which rows it keeps depends on the step", "a filter"),
    "LocalLimit": ("limit is not linear: which rows it keeps depends on the step", "a filter"),
    "Offset": ("offset is not linear: which rows it skips depends on the step", "a filter"),
    "Tail": ("tail is not linear: which rows it keeps depends on the step", "a filter"),
    "Sample": (
        "sampling keeps different rows on a replayed step",
        "a deterministic filter, e.g. on pmod(xxhash64(key), 100)",
    ),
    "Intersect": ("intersect sees only one step's rows", "sparkstep.join(...)"),
    "Except": ("except sees only one step's rows", "sparkstep.join(...) with weights"),
    "FlatMapGroupsInPandas": (
        "applyInPandas sees only one step's rows of a group",
        "sparkstep.stateful_map(df, name=..., key=[...], fn=..., state_schema=...)",
    ),
    "FlatMapGroupsInArrow": (
        "applyInArrow sees only one step's rows of a group",
        "sparkstep.stateful_map(df, name=..., key=[...], fn=..., state_schema=...)",
    ),
    "FlatMapCoGroupsInPandas": (
        "cogroup sees only one step's rows of each group",
        "sparkstep.join(left, right, name=..., on=[...])",
    ),
    "FlatMapCoGroupsInArrow": (
        "cogroup sees only one step's rows of each group",
        "sparkstep.join(left, right, name=..., on=[...])",
    ),
}

# Deterministic by Spark's definition but different on a replay; the step's logged time is the
# replayable clock.
_WALL_CLOCK = {"CurrentTimestamp", "CurrentDate", "LocalTimestamp", "Now", "CurrentTime"}


def boundary_alias(label: str) -> str:
    """The alias that marks a sparkstep-produced plan, e.g. ``__sparkstep_source_orders``."""
    return f"{BOUNDARY_PREFIX}{label}"


def scala_seq(seq: Any) -> Iterator[Any]:
    """The items of a Scala ``Seq`` held through py4j, in order."""
    for i in range(seq.size()):
        yield seq.apply(i)


def _is_boundary(node: Any) -> bool:
    if node.nodeName() != "SubqueryAlias":
        return False
    name: str = node.alias()
    return name.startswith(BOUNDARY_PREFIX)


def _expressions(expr: Any) -> Iterator[Any]:
    yield expr
    for child in scala_seq(expr.children()):
        yield from _expressions(child)


def _check_node(node: Any, where: str) -> None:
    name: str = node.nodeName()
    refused = _REFUSED_NODES.get(name)
    if refused is not None:
        reason, instead = refused
        raise NonLinearPlanError(f"{where}: {name} is not allowed here ({reason}): use {instead}")
    for top in scala_seq(node.expressions()):
        for expr in _expressions(top):
            expr_name: str = expr.nodeName()
            if expr_name in _WALL_CLOCK or not expr.deterministic():
                pretty: str = expr.sql() if expr.resolved() else expr_name
                raise NonLinearPlanError(
                    f"{where}: the expression {pretty} is not deterministic, so a replayed step "
                    "would give other output: derive it from the row (e.g. xxhash64 of its "
                    "columns) or from the step's logged time"
                )


def check_linear(df: DataFrame, where: str) -> None:
    """Refuse ``df`` unless the user code above its sparkstep boundaries is linear.

    ``where`` names the place for the message (e.g. ``"the input of aggregate 'sums'"``). Also
    refuses a DataFrame that dropped the ``__weight`` column.
    """
    if WEIGHT not in df.columns:
        raise NonLinearPlanError(
            f"{where}: the column {WEIGHT} was dropped; user code between sparkstep operators "
            f"must keep it (select it along with your columns)"
        )
    stack = [df._jdf.queryExecution().analyzed()]
    while stack:
        node = stack.pop()
        if _is_boundary(node):
            continue
        _check_node(node, where)
        stack.extend(scala_seq(node.children()))
