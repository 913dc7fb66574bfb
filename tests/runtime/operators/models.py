"""Plain-Python models of the operators, for comparing with the kernels' integrated output.

Each model integrates the input Z-set (row -> net weight) and computes the operator's answer
from scratch, the obvious way: no incremental logic shared with the kernels.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import pyarrow as pa


def integrate(tables: Iterable[pa.Table]) -> Counter[tuple[Any, ...]]:
    """Sum of weights per row (all columns but ``__weight``), zero weights dropped."""
    total: Counter[tuple[Any, ...]] = Counter()
    for table in tables:
        names = [n for n in table.schema.names if n != "__weight"]
        for row in table.to_pylist():
            total[tuple(_norm(row[n]) for n in names)] += row["__weight"]
    return Counter({k: v for k, v in total.items() if v != 0})


def _norm(value: Any) -> Any:
    # NaN != NaN: make rows holding NaN compare equal.
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def aggregate_model(
    rows: Counter[tuple[Any, ...]], aggs: list[tuple[str, int | None]]
) -> dict[Any, tuple[Any, ...]]:
    """rows: (key, col values...) -> weight; aggs: (fn, column index or None). key -> outputs."""
    keys = {r[0] for r in rows}
    out: dict[Any, tuple[Any, ...]] = {}
    for key in keys:
        mine = [(r, w) for r, w in rows.items() if r[0] == key]
        n = sum(w for _, w in mine)
        if n <= 0:
            continue
        values: list[Any] = []
        for fn, col in aggs:
            if col is None:
                values.append(n)
                continue
            present = [(r[col], w) for r, w in mine if r[col] is not None]
            c = sum(w for _, w in present)
            if fn == "count":
                values.append(c)
            elif fn in ("min", "max"):
                multiset: Counter[Any] = Counter()
                for v, w in present:
                    multiset[v] += w
                pos = sorted(v for v, m in multiset.items() if m > 0)
                values.append(None if not pos else pos[0] if fn == "min" else pos[-1])
            elif c <= 0:
                values.append(None)
            else:
                exact = sum((Fraction(v) * w for v, w in present), Fraction(0))
                if isinstance(present[0][0], int):
                    values.append(int(exact) if fn == "sum" else float(exact / c))
                else:
                    values.append(float(exact) if fn == "sum" else float(exact / c))
        out[key] = tuple(values)
    return out


def distinct_model(rows: Counter[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
    return Counter({r: 1 for r, w in rows.items() if w > 0})


def join_model(
    left: Counter[tuple[Any, ...]], right: Counter[tuple[Any, ...]]
) -> Counter[tuple[Any, ...]]:
    """Rows are (key, value); the join row is (key, left value, right value)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for (lk, lv), lw in left.items():
        for (rk, rv), rw in right.items():
            if lk == rk:
                out[(lk, lv, rv)] += lw * rw
    return Counter({k: v for k, v in out.items() if v != 0})
