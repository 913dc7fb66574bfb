"""Kernels against plain-Python models: random Z-set batches, many small steps, real stores.

Each example runs a :class:`StateWorker` in process over a real RocksDB store in a temporary
directory (hypothesis examples cannot share pytest's function-scoped ``tmp_path``), with commits
and reopens between some steps, and checks after every step:

- the delta's shape (per key at most one -1 row then one +1 row; nothing for unchanged keys);
- the integrated output equals the model computed from the integrated input;
- the state (decoded from the store) holds exactly the live keys;
- the state digest the apply returns is the sum of the stored entries' hashes.
"""

from __future__ import annotations

import math
import struct
import tempfile
from collections import Counter
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkstep.runtime.errors import KernelError, OperatorSpecError
from sparkstep.runtime.operators import Agg, OperatorSpec
from sparkstep.runtime.operators import aggregate as aggregate_module
from sparkstep.runtime.operators import join as join_module
from sparkstep.runtime.operators.base import (
    KernelResult,
    StateChanges,
    decode_value,
    encode_value,
    plain_type,
    rows_order,
    state_keys,
)
from sparkstep.runtime.operators.distinct import DistinctKernel
from sparkstep.runtime.operators.join import JoinKernel
from sparkstep.runtime.worker import StateWorker
from sparkstep.runtime.worker.buffer import WriteBuffer
from sparkstep.runtime.worker.digest import MASK, entry_hash, format_digest
from sparkstep.runtime.worker.service import _Reader
from sparkstep.storage import RocksDBStore
from sparkstep.storage.keys import SHARD_PREFIX_BYTES
from tests.runtime.operators.models import aggregate_model, distinct_model, integrate, join_model

S = 8
KEYS = ["a", "b", "c", "d", "e"]
FLOATS = [0.1, 0.2, 0.3, 1e16, -1e16, 3.5, -0.7, 1e-3, 2.0**-30]
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def shard_of(key: Any) -> int:
    return sum(str(key).encode()) % S


class Runner:
    """Feeds batches to one operator of an in-process worker, committing now and then."""

    def __init__(self, root: Path, specs: list[OperatorSpec]) -> None:
        self.store = RocksDBStore(root / "store")
        self.worker = StateWorker(self.store, shards=S)
        self.worker.configure(specs, S)
        self.version = 0
        self.inc = self.worker.open(0)
        self.step = 0

    def apply(self, operator: str, rows: pa.Table, input_index: int = 0, time_ms: int = 0):
        result = self.worker.apply(
            self.inc,
            self.step,
            operator,
            f"div-{self.step}",
            rows,
            input_index=input_index,
            step_time_ms=time_ms,
        )
        # A re-run of the same task returns the recorded answer.
        again = self.worker.apply(
            self.inc,
            self.step,
            operator,
            f"div-{self.step}",
            rows,
            input_index=input_index,
            step_time_ms=time_ms,
        )
        assert again.replayed
        assert again.delta.equals(result.delta) or (  # NaN != NaN
            again.delta.schema == result.delta.schema
            and repr(again.delta.to_pylist()) == repr(result.delta.to_pylist())
        )
        assert again.state_digest == result.state_digest
        # The digest the apply kept up incrementally is that of the state it left.
        entries = self.worker.dump(operator).items()
        total = sum(entry_hash(k, v) for k, v in entries if len(k) > SHARD_PREFIX_BYTES)
        assert result.state_digest == format_digest(total & MASK)
        return result

    def next_step(self, commit: bool) -> None:
        self.step += 1
        if commit:
            self.worker.commit(self.step)
            self.version += 1
            self.inc = self.worker.open(self.version)

    def close(self) -> None:
        self.worker.close()


def _table(rows: list[dict[str, Any]], schema: pa.Schema, key: str) -> pa.Table:
    fields = [*schema, pa.field("__weight", pa.int64()), pa.field("__shard", pa.int64())]
    data = {f.name: [r.get(f.name) for r in rows] for f in schema}
    data["__weight"] = [r["__weight"] for r in rows]
    data["__shard"] = [shard_of(r[key]) for r in rows]
    return pa.table(data, schema=pa.schema(fields))


def _draw_batch(
    data: st.DataObject, live: Counter[tuple[Any, ...]], make_row: st.SearchStrategy[Any]
) -> list[tuple[tuple[Any, ...], int]]:
    inserts = data.draw(st.lists(make_row, max_size=6))
    pool = sorted(live.elements(), key=repr)
    retract = data.draw(st.lists(st.sampled_from(pool), max_size=4)) if pool else []
    out: list[tuple[tuple[Any, ...], int]] = [(r, 1) for r in inserts]
    budget = Counter(live)
    for r in retract:
        if budget[r] > 0:
            budget[r] -= 1
            out.append((r, -1))
    return data.draw(st.permutations(out))


# -- aggregate --------------------------------------------------------------------------------

AGG_SCHEMA = pa.schema([("k", pa.string()), ("x", pa.int64()), ("f", pa.float64())])
AGGS = [
    Agg("count", None, "n"),
    Agg("count", "x", "cx"),
    Agg("sum", "x", "sx"),
    Agg("sum", "f", "sf"),
    Agg("min", "x", "mnx"),
    Agg("max", "x", "mxx"),
    Agg("min", "f", "mnf"),
    Agg("max", "f", "mxf"),
    Agg("avg", "x", "ax"),
    Agg("avg", "f", "af"),
]
MODEL_AGGS: list[tuple[str, int | None]] = [
    ("count", None),
    ("count", 1),
    ("sum", 1),
    ("sum", 2),
    ("min", 1),
    ("max", 1),
    ("min", 2),
    ("max", 2),
    ("avg", 1),
    ("avg", 2),
]
agg_rows = st.tuples(
    st.sampled_from(KEYS),
    st.one_of(st.none(), st.integers(-(2**40), 2**40)),
    st.one_of(st.none(), st.sampled_from(FLOATS)),
)


def check_key_shape(delta: pa.Table, key: str) -> dict[Any, list[int]]:
    """Per key, the weights in order; asserts [-1], [+1] or [-1, +1]."""
    per_key: dict[Any, list[int]] = {}
    for row in delta.to_pylist():
        per_key.setdefault(row[key], []).append(row["__weight"])
    for k, weights in per_key.items():
        assert weights in ([-1], [1], [-1, 1]), (k, weights)
    return per_key


def check_aggregate_step(
    delta: pa.Table,
    deltas: list[pa.Table],
    before: dict[Any, tuple[Any, ...]],
    after: dict[Any, tuple[Any, ...]],
) -> None:
    """One step of an aggregate against the model: a key's rows in ``delta`` exactly when its
    output changed (``before`` -> ``after``), and the integrated ``deltas`` equal ``after``."""
    shape = check_key_shape(delta, "k")
    for k in set(before) | set(after):
        changed = before.get(k) != after.get(k)
        assert (k in shape) == changed, (k, before.get(k), after.get(k))
    integrated = integrate(deltas)
    assert all(w == 1 for w in integrated.values()), integrated
    assert {r[0]: r[1:] for r in integrated} == after


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_aggregate_matches_model(data: st.DataObject, steps: int) -> None:
    spec = OperatorSpec.aggregate("agg", AGG_SCHEMA, ["k"], AGGS)
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        live: Counter[tuple[Any, ...]] = Counter()
        deltas: list[pa.Table] = []
        before: dict[Any, tuple[Any, ...]] = {}
        try:
            for _ in range(steps):
                batch = _draw_batch(data, live, agg_rows)
                rows = [{"k": r[0], "x": r[1], "f": r[2], "__weight": w} for r, w in batch]
                for r, w in batch:
                    live[r] += w
                live = +live
                result = run.apply("agg", _table(rows, AGG_SCHEMA, "k"))
                deltas.append(result.delta)
                after = aggregate_model(live, MODEL_AGGS)
                check_aggregate_step(result.delta, deltas, before, after)
                state = run.worker.dump("agg")
                keys = {
                    decode_value(k[4:])[0]: decode_value(v) for k, v in state.items() if len(k) > 4
                }
                assert set(keys) == {r[0] for r in live}
                for k, st_value in keys.items():
                    assert st_value[0] == sum(w for r, w in live.items() if r[0] == k)
                before = after
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


COLUMNAR_AGGS = [
    Agg("count", None, "n"),
    Agg("count", "x", "cx"),
    Agg("sum", "x", "sx"),
    Agg("avg", "x", "ax"),
]
columnar_rows = st.tuples(
    st.sampled_from(KEYS),
    st.one_of(st.none(), st.integers(-(2**61), 2**61), st.integers(-3, 3)),
    st.none(),
)


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_aggregate_columnar_path_matches_model(data: st.DataObject, steps: int) -> None:
    """Only count and integer sum/avg: the numpy path with 128-bit sums and fixed records."""
    spec = OperatorSpec.aggregate("agg", AGG_SCHEMA, ["k"], COLUMNAR_AGGS)
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        assert run.worker._kernels["agg"]._columnar  # type: ignore[attr-defined]
        live: Counter[tuple[Any, ...]] = Counter()
        deltas: list[pa.Table] = []
        before: dict[Any, tuple[Any, ...]] = {}
        try:
            for _ in range(steps):
                batch = _draw_batch(data, live, columnar_rows)
                rows = [{"k": r[0], "x": r[1], "f": r[2], "__weight": w} for r, w in batch]
                for r, w in batch:
                    live[r] += w
                live = +live
                after = aggregate_model(
                    live, [("count", None), ("count", 1), ("sum", 1), ("avg", 1)]
                )
                if any(v[2] is not None and not -(2**63) <= v[2] < 2**63 for v in after.values()):
                    with pytest.raises(KernelError, match="does not fit int64"):
                        run.apply("agg", _table(rows, AGG_SCHEMA, "k"))
                    return
                result = run.apply("agg", _table(rows, AGG_SCHEMA, "k"))
                deltas.append(result.delta)
                check_aggregate_step(result.delta, deltas, before, after)
                state = run.worker.dump("agg")
                counts = {
                    decode_value(k[4:])[0]: int.from_bytes(v[:8], "little", signed=True)
                    for k, v in state.items()
                    if len(k) > 4
                }
                assert counts == {
                    k: sum(w for r, w in live.items() if r[0] == k) for k in {r[0] for r in live}
                }
                before = after
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


@pytest.mark.parametrize("layout", ["columnar", "general"])
def test_aggregate_integer_sums_are_exact_at_int64_edges(layout: str) -> None:
    """Integer sums are exact beyond int64 within a batch and in the state: batches of int64's
    extremes, whose running sums leave int64's range whatever their order, give exact totals;
    a key brought to int64's maximum exactly reads it, and one more is refused; in both
    layouts."""
    aggs = [Agg("count", None, "n"), Agg("sum", "x", "sx")]
    if layout == "general":
        aggs.append(Agg("sum", "f", "sf"))  # a float sum takes the general layout
    spec = OperatorSpec.aggregate("agg", AGG_SCHEMA, ["k"], aggs)
    rng = np.random.default_rng(7)
    edges = [2**63 - 1, -(2**63) + 1, 2**62, 2**32 - 1, -(2**32), 2**31]
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        assert run.worker._kernels["agg"]._columnar == (layout == "columnar")  # type: ignore[attr-defined]
        totals: Counter[str] = Counter()

        def apply(rows: list[tuple[str, int, int]]) -> None:
            table = [{"k": k, "x": x, "f": 0.5, "__weight": w} for k, x, w in rows]
            delta = run.apply("agg", _table(table, AGG_SCHEMA, "k")).delta.to_pylist()
            for k, x, w in rows:
                totals[k] += x * w
            assert {r["k"]: r["sx"] for r in delta if r["__weight"] == 1} == {
                k: totals[k] for k in {k for k, _, _ in rows}
            }
            run.next_step(commit=True)

        try:
            for _ in range(6):
                rows = []
                for _ in range(int(rng.integers(1, 8))):
                    k, x = str(rng.choice(["a", "b"])), int(rng.choice(edges))
                    rows += [(k, x, 1), (k, x, 1), (k, -x, 1), (k, -x, 1)]
                    rows.append((k, int(rng.integers(-5, 6)), 1))
                apply([rows[i] for i in rng.permutation(len(rows))])
            apply([("a", 2**63 - 1 - totals["a"] - 2**62, 1), ("a", 2**62, 1)])
            assert totals["a"] == 2**63 - 1
            with pytest.raises(KernelError, match="does not fit"):
                run.apply(
                    "agg", _table([{"k": "a", "x": 1, "f": 0.5, "__weight": 1}], AGG_SCHEMA, "k")
                )
        finally:
            run.close()


EXTREME_SCHEMA = pa.schema([("k", pa.string()), ("x", pa.int64()), ("y", pa.int32())])
EXTREME_AGGS = [
    Agg("count", None, "n"),
    Agg("sum", "x", "sx"),
    Agg("min", "x", "mnx"),
    Agg("max", "x", "mxx"),
    Agg("avg", "x", "ax"),
    Agg("max", "y", "mxy"),
    Agg("min", "y", "mny"),
]


def model_aggs(schema: pa.Schema, aggs: list[Agg]) -> list[tuple[str, int | None]]:
    """``aggs`` as ``aggregate_model`` takes them: (fn, the column's index in a row tuple)."""
    return [(a.fn, None if a.column is None else schema.names.index(a.column)) for a in aggs]


EXTREME_MODEL = model_aggs(EXTREME_SCHEMA, EXTREME_AGGS)
extreme_rows = st.tuples(
    st.sampled_from(KEYS),
    st.one_of(st.none(), st.integers(-3, 3), st.integers(-(2**60), 2**60)),
    st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1), st.integers(0, 2)),
)


def test_rows_sort_as_lexsort_sorts_them_at_any_span() -> None:
    """The one-key sort of rows when their columns' spans fit 62 bits, lexsort when not: the
    same order either way, up to int64's extremes, for one to four columns."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(0, 50))
        columns = [rng.integers(0, int(rng.choice([1, 5, 1000, 2**20])), n)]
        for _ in range(int(rng.integers(0, 4))):
            span = int(rng.choice([1, 2, 10, 2**20, 2**40, 2**62]))
            column = rng.integers(-span, span, n, dtype=np.int64)
            if trial % 7 == 0 and n:
                column[0], column[-1] = np.iinfo(np.int64).min, np.iinfo(np.int64).max
            columns.append(column)
        order = rows_order(columns)
        expected = np.lexsort(tuple(reversed(columns)))
        assert np.array_equal(order, expected), trial


def count_written(monkeypatch: pytest.MonkeyPatch, table: str) -> dict[str, int]:
    """``{"bytes": n}``, ``n`` counting the bytes of the values written into ``table`` through
    any worker's buffer from now on (deletions count 0)."""
    written = {"bytes": 0}
    write = WriteBuffer.write

    def counted(self: WriteBuffer, changes: Any, *, flush: bool = True) -> None:
        for change in changes:
            if change.table == table:
                values = change.values
                values = values if isinstance(values, list) else values.to_pylist()
                written["bytes"] += sum(len(v) for v in values if v)
        write(self, changes, flush=flush)

    monkeypatch.setattr(WriteBuffer, "write", counted)
    return written


def stored_multisets(run: Runner) -> dict[tuple[Any, int, int], int]:
    """(key, value column, value) -> multiplicity, from the columnar layout's chunks (summed
    over a key's levels), after checking each record's invariants against its chunks: ``lv``
    lists exactly the chunks there are, *has* (bit 0 of ``fl``), ``mn`` and ``mx`` say whether
    a value is positive and which are the least and the greatest, no chunk holds a negative
    multiplicity unless *negative* (bit 1); and each chunk holds sorted distinct values, none
    of multiplicity 0."""
    record = run.worker._kernels["agg"]._record  # type: ignore[attr-defined]
    records: dict[Any, np.ndarray] = {}
    levels: dict[tuple[Any, int], set[int]] = {}
    negative: set[tuple[Any, int]] = set()
    out: Counter[tuple[Any, int, int]] = Counter()
    for k, v in run.worker.dump("agg").items():
        if len(k) <= 4:
            continue
        key = decode_value(k[4:])[0]
        if len(k) == 4 + len(encode_value([key])):
            records[key] = np.frombuffer(v, record)[0]
            continue
        assert len(k) == 6 + len(encode_value([key])) and v, (k, v)
        pairs = np.frombuffer(v, dtype=[("v", "<i8"), ("m", "<i8")])
        assert list(pairs["v"]) == sorted(set(pairs["v"])) and all(pairs["m"] != 0)
        levels.setdefault((key, k[-2]), set()).add(k[-1])
        if pairs["m"].min() < 0:
            negative.add((key, k[-2]))
        for value, m in pairs.tolist():
            out[(key, k[-2], value)] += m
    multisets = {k: m for k, m in out.items() if m != 0}
    columns = sum(1 for name in record.names if name.startswith("lv"))
    for key, rec in records.items():
        for j in range(columns):
            lv = int(rec[f"lv{j}"])
            assert {b for b in range(64) if lv >> b & 1} == levels.pop((key, j), set())
            mine = sorted(
                (value, m) for (k, c, value), m in multisets.items() if (k, c) == (key, j)
            )
            positive = [value for value, m in mine if m > 0]
            expected = (1, positive[0], positive[-1]) if positive else (0, 0, 0)
            flags = int(rec[f"fl{j}"])
            assert (flags & 1, int(rec[f"mn{j}"]), int(rec[f"mx{j}"])) == expected
            if not flags & 2:  # not negative: no chunk holds a negative multiplicity
                assert (key, j) not in negative, (key, j, mine)
    assert not levels, f"chunks without a record: {levels}"
    return multisets


def live_multisets(live: Counter[tuple[Any, ...]]) -> dict[tuple[Any, int, int], int]:
    """The same from the integrated input (value columns in sorted order: x is 0, y is 1)."""
    out: Counter[tuple[Any, int, int]] = Counter()
    for row, w in live.items():
        for j, value in enumerate(row[1:]):
            if value is not None:
                out[(row[0], j, value)] += w
    return {k: m for k, m in out.items() if m != 0}


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_aggregate_columnar_extremes_match_model(data: st.DataObject, steps: int) -> None:
    """min/max of integer columns in the columnar layout: small value domains so that extremes
    are retracted and kept, an int32 column, two value columns in one multiset each."""
    spec = OperatorSpec.aggregate("agg", EXTREME_SCHEMA, ["k"], EXTREME_AGGS)
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        assert run.worker._kernels["agg"]._columnar  # type: ignore[attr-defined]
        live: Counter[tuple[Any, ...]] = Counter()
        deltas: list[pa.Table] = []
        before: dict[Any, tuple[Any, ...]] = {}
        try:
            for _ in range(steps):
                batch = _draw_batch(data, live, extreme_rows)
                rows = [{"k": r[0], "x": r[1], "y": r[2], "__weight": w} for r, w in batch]
                for r, w in batch:
                    live[r] += w
                live = +live
                result = run.apply("agg", _table(rows, EXTREME_SCHEMA, "k"))
                deltas.append(result.delta)
                after = aggregate_model(live, EXTREME_MODEL)
                check_aggregate_step(result.delta, deltas, before, after)
                assert result.delta.schema.field("mny").type == pa.int32()
                assert stored_multisets(run) == live_multisets(live)
                before = after
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


TEMPORAL_SCHEMA = pa.schema(
    [("k", pa.string()), ("t", pa.timestamp("ms", tz="UTC")), ("d", pa.date32())]
)
TEMPORAL_AGGS = [
    Agg("count", None, "n"),
    Agg("min", "t", "first"),
    Agg("max", "t", "last"),
    Agg("max", "d", "day"),
]
temporal_rows = st.tuples(
    st.sampled_from(KEYS),
    st.one_of(st.none(), st.integers(-3, 3), st.integers(-(2**50), 2**50)),
    st.one_of(st.none(), st.integers(-3, 3), st.integers(-(2**20), 2**20)),
)


def as_plain(delta: pa.Table) -> pa.Table:
    """``delta`` with its temporal columns as their integers (the model's values)."""
    return pa.table({f.name: delta.column(f.name).cast(plain_type(f.type)) for f in delta.schema})


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_aggregate_columnar_extremes_of_temporal_columns_match_model(
    data: st.DataObject, steps: int
) -> None:
    """min/max of a timestamp and a date column run columnar, answer in their own types."""
    spec = OperatorSpec.aggregate("agg", TEMPORAL_SCHEMA, ["k"], TEMPORAL_AGGS)
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        assert run.worker._kernels["agg"]._columnar  # type: ignore[attr-defined]
        live: Counter[tuple[Any, ...]] = Counter()
        deltas: list[pa.Table] = []
        try:
            for _ in range(steps):
                batch = _draw_batch(data, live, temporal_rows)
                rows = [{"k": r[0], "t": r[1], "d": r[2], "__weight": w} for r, w in batch]
                for r, w in batch:
                    live[r] += w
                live = +live
                result = run.apply("agg", _table(rows, TEMPORAL_SCHEMA, "k"))
                assert result.delta.schema.field("first").type == pa.timestamp("ms", tz="UTC")
                assert result.delta.schema.field("day").type == pa.date32()
                deltas.append(as_plain(result.delta))
                after = aggregate_model(live, model_aggs(TEMPORAL_SCHEMA, TEMPORAL_AGGS))
                assert {r[0]: r[1:] for r in integrate(deltas)} == after
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


def test_aggregate_columnar_extremes_with_negative_multiplicities(tmp_path: Path) -> None:
    """A Z-set may retract a value before inserting it: only positive multiplicities count."""
    spec = OperatorSpec.aggregate("agg", EXTREME_SCHEMA, ["k"], EXTREME_AGGS[:4])
    run = Runner(tmp_path, [spec])
    live: Counter[tuple[Any, ...]] = Counter()
    deltas: list[pa.Table] = []
    steps = [
        [(5, -1), (7, 1)],  # n = 0: no row; 5 is at -1, 7 at 1
        [(3, 1), (4, 1)],  # min 3, max 7 (5 does not count)
        [(5, 2)],  # 5 now at 1
        [(3, -1), (7, -1)],  # both extremes retracted: 4 and 5 are left
        [(4, -1), (9, -1)],  # n = 0: no row; 9 at -1
        [(9, 1), (1, 1)],  # 9 back to 0 (deleted): min 1, max 5
        [(5, -1)],  # the max retracted again: min 1, max 1
    ]
    try:
        for batch in steps:
            rows = [{"k": "a", "x": x, "y": None, "__weight": w} for x, w in batch]
            for x, w in batch:
                live[("a", x, None)] += w
            deltas.append(run.apply("agg", _table(rows, EXTREME_SCHEMA, "k")).delta)
            expected = aggregate_model(live, EXTREME_MODEL[:4])
            assert {r[0]: r[1:] for r in integrate(deltas)} == expected
            assert stored_multisets(run) == live_multisets(live)
            run.next_step(commit=True)
        assert expected == {"a": (1, 1, 1, 1)}
    finally:
        run.close()


def test_a_key_whose_extremes_only_grow_is_not_rewritten_whole_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One key gains a new value per step (a max of a timestamp per user): chunk 0 takes in
    values up to ``INLINE_VALUES``, then carries into the levels above as a binary counter, so
    the bytes written over N steps grow like N (INLINE_VALUES + log N), where one multiset per
    key (state format 5) rewrote all of the key's values every step (N**2 / 2 pairs), and the
    key has a few chunks. A retraction of the maximum then reads every chunk and merges them
    into one, at the highest level the key had; a retraction that leaves few values merges
    them back into chunk 0."""
    written = count_written(monkeypatch, "state.agg")
    spec = OperatorSpec.aggregate("agg", EXTREME_SCHEMA, ["k"], EXTREME_AGGS[:4])
    run = Runner(tmp_path, [spec])
    steps = 1500

    def chunks() -> dict[int, int]:
        """Level -> values of key "a"'s chunks of column x."""
        out = {}
        for k, v in run.worker.dump("agg").items():
            if len(k) == 6 + len(encode_value(["a"])) and k[-2] == 0:
                out[k[-1]] = len(v) // 16
        return out

    try:
        for step in range(steps):
            rows = [{"k": "a", "x": step, "y": None, "__weight": 1}]
            delta = run.apply("agg", _table(rows, EXTREME_SCHEMA, "k")).delta
            assert delta.to_pylist()[-1] == {
                "k": "a",
                "n": step + 1,
                "sx": step * (step + 1) // 2,
                "mnx": 0,
                "mxx": step,
                "__weight": 1,
            }
            run.next_step(commit=step % 250 == 0)
        levels = chunks()
        assert sum(levels.values()) == steps
        assert len(levels) <= math.log2(steps / aggregate_module.INLINE_VALUES) + 2
        assert max(levels.values()) > aggregate_module.INLINE_VALUES
        pair_bytes = 16
        assert written["bytes"] < 0.1 * pair_bytes * steps * steps / 2
        rows = [{"k": "a", "x": steps - 1, "y": None, "__weight": -1}]
        delta = run.apply("agg", _table(rows, EXTREME_SCHEMA, "k")).delta
        top = steps - 1
        assert [(r["mxx"], r["__weight"]) for r in delta.to_pylist()] == [(top, -1), (top - 1, 1)]
        assert chunks() == {max(levels): steps - 1}
        run.next_step(commit=False)
        # A merge small enough goes back to chunk 0, which takes in values again.
        rows = [{"k": "a", "x": x, "y": None, "__weight": -1} for x in range(10, steps - 1)]
        run.apply("agg", _table(rows, EXTREME_SCHEMA, "k"))
        assert chunks() == {0: 10}
        run.next_step(commit=False)
        rows = [{"k": "a", "x": steps + 1, "y": None, "__weight": 1}]
        delta = run.apply("agg", _table(rows, EXTREME_SCHEMA, "k")).delta
        assert [(r["mxx"], r["__weight"]) for r in delta.to_pylist()] == [(9, -1), (steps + 1, 1)]
        assert chunks() == {0: 11}
        stored_multisets(run)  # the record's invariants
    finally:
        run.close()


def test_aggregate_float_sum_is_order_independent(tmp_path: Path) -> None:
    spec = OperatorSpec.aggregate("agg", AGG_SCHEMA, ["k"], [Agg("sum", "f", "s")])
    values = [1e16, 1.0, -1e16, 1.0, 0.1, 0.2]
    answers = []
    for i, order in enumerate([values, values[::-1], sorted(values)]):
        run = Runner(tmp_path / str(i), [spec])
        rows = [{"k": "a", "f": v, "__weight": 1} for v in order]
        delta = run.apply("agg", _table(rows, AGG_SCHEMA, "k")).delta
        answers.append(delta.column("s").to_pylist())
        run.close()
    assert answers[0] == answers[1] == answers[2] == [math.fsum(values)]


# -- distinct ---------------------------------------------------------------------------------

DISTINCT_SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int32())])
distinct_rows = st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), st.integers(0, 3)))


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_distinct_matches_model(data: st.DataObject, steps: int) -> None:
    spec = OperatorSpec.distinct("dist", DISTINCT_SCHEMA)
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        live: Counter[tuple[Any, ...]] = Counter()
        deltas: list[pa.Table] = []
        try:
            for _ in range(steps):
                batch = _draw_batch(data, live, distinct_rows)
                rows = [{"k": r[0], "v": r[1], "__weight": w} for r, w in batch]
                for r, w in batch:
                    live[r] += w
                live = +live
                result = run.apply("dist", _table(rows, DISTINCT_SCHEMA, "k"))
                deltas.append(result.delta)
                assert integrate(deltas) == distinct_model(live)
                state = run.worker.dump("dist")
                stored = {
                    tuple(decode_value(k[4:])): int.from_bytes(v, "little", signed=True)
                    for k, v in state.items()
                    if len(k) > 4
                }
                assert stored == dict(live)
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


def _no_lookup(*args: object) -> pa.Array:
    raise AssertionError("the worker looked the changed keys up by hash")


@pytest.mark.parametrize(
    "spec",
    [
        OperatorSpec.aggregate("op", AGG_SCHEMA, ["k"], COLUMNAR_AGGS),
        OperatorSpec.aggregate("op", EXTREME_SCHEMA, ["k"], EXTREME_AGGS),
        OperatorSpec.distinct("op", DISTINCT_SCHEMA),
    ],
    ids=["aggregate", "aggregate with extremes", "distinct"],
)
def test_columnar_kernels_say_where_they_read_each_changed_key(
    spec: OperatorSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The columnar kernels give their changes' read positions, and rightly: the worker takes
    every changed key's old value and hash by position (its lookup by hash fails here), and
    every state digest is still the stored state's (the Runner checks it)."""
    monkeypatch.setattr(_Reader, "olds", _no_lookup)
    rng = np.random.default_rng(3)
    live: list[dict[str, Any]] = []
    run = Runner(tmp_path, [spec])
    for step in range(6):
        inserts = [
            {
                f.name: str(rng.choice(KEYS)) if f.name == "k" else int(rng.integers(-3, 3))
                for f in spec.inputs[0]
            }
            for _ in range(12)
        ]
        retracted = [live.pop(int(rng.integers(len(live)))) for _ in range(min(5, len(live)))]
        live += inserts
        rows = [{**r, "__weight": 1} for r in inserts] + [{**r, "__weight": -1} for r in retracted]
        run.apply("op", _table(rows, spec.inputs[0], "k"))
        run.next_step(commit=step % 2 == 1)
    run.close()


@pytest.mark.parametrize(
    "fault",
    [lambda at: at[::-1], lambda at: at + 10**6, lambda at: np.where(at % 2, -1, at)],
    ids=["positions reversed", "positions past the reads", "read keys said unread"],
)
def test_wrong_read_positions_cost_a_lookup_never_a_wrong_digest(
    fault: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault injected into the distinct kernel's read positions: the worker finds the keys
    are not there, looks them up by hash, and every digest is still the stored state's. Keys
    said unread (-1) that hold values are read again, never taken as absent."""
    apply = DistinctKernel.apply

    def faulty(self: DistinctKernel, rows: pa.Table, state: Any, ctx: Any) -> KernelResult:
        result = apply(self, rows, state, ctx)
        changes = result.changes
        assert changes.read_at is not None
        moved = StateChanges(changes.keys, changes.values, fault(changes.read_at))
        return KernelResult(result.delta, moved)

    monkeypatch.setattr(DistinctKernel, "apply", faulty)
    spec = OperatorSpec.distinct("op", DISTINCT_SCHEMA)
    run = Runner(tmp_path, [spec])
    for step in range(3):
        # Multiplicities that differ by key and grow by step: old values present and unequal.
        rows = [{"k": k, "v": 0, "__weight": 1} for i, k in enumerate(KEYS) for _ in range(i + 1)]
        rows += [{"k": k, "v": step + 1, "__weight": 1} for k in KEYS]
        run.apply("op", _table(rows, DISTINCT_SCHEMA, "k"))
        run.next_step(commit=step == 1)
    run.close()


def test_distinct_counts_negative_multiplicities(tmp_path: Path) -> None:
    """A row retracted before it is inserted is out of the set until its multiplicity is > 0."""
    run = Runner(tmp_path, [OperatorSpec.distinct("dist", DISTINCT_SCHEMA)])
    answers = []
    try:
        for weight in (-1, 2, -2, 1, 1):
            rows = [{"k": "a", "v": 1, "__weight": weight}]
            delta = run.apply("dist", _table(rows, DISTINCT_SCHEMA, "k")).delta
            answers.append(delta.column("__weight").to_pylist())
            run.next_step(commit=True)
    finally:
        run.close()
    # multiplicities -1, 1, -1, 0, 1: in, out, in again
    assert answers == [[], [1], [-1], [], [1]]


# -- join -------------------------------------------------------------------------------------

LEFT = pa.schema([("k", pa.string()), ("lv", pa.int64())])
RIGHT = pa.schema([("k", pa.string()), ("rv", pa.string())])
# Model rows are (key, (column values...)); _NAN where the table holds a NaN (NaN != NaN in a
# Counter).
_NAN = "NaN"
left_rows = st.tuples(st.sampled_from(KEYS[:3]), st.tuples(st.one_of(st.none(), st.integers(0, 2))))
right_rows = st.tuples(st.sampled_from(KEYS[:3]), st.tuples(st.sampled_from(["x", "y", None])))
# Every kind of column a row holds, their extremes, nulls, NaN, signed zeros, empty strings.
WIDE_LEFT = pa.schema(
    [
        ("k", pa.string()),
        ("a", pa.int32()),
        ("u", pa.uint64()),
        ("f", pa.float64()),
        ("b", pa.bool_()),
        ("d", pa.date32()),
    ]
)
WIDE_RIGHT = pa.schema(
    [
        ("k", pa.string()),
        ("h", pa.float32()),
        ("s", pa.string()),
        ("t", pa.timestamp("us")),
        ("z", pa.null()),
        ("i", pa.int8()),
        ("ls", pa.large_string()),
    ]
)
wide_left_rows = st.tuples(
    st.sampled_from(KEYS[:3]),
    st.tuples(
        st.sampled_from([None, 0, -(2**31), 2**31 - 1]),
        st.sampled_from([None, 0, 2**64 - 1, 2**63]),
        st.sampled_from([None, 0.0, -0.0, 1.5, _NAN, -math.inf]),
        st.sampled_from([None, True, False]),
        st.sampled_from([None, date(1970, 1, 1), date(2026, 11, 27)]),
    ),
)
wide_right_rows = st.tuples(
    st.sampled_from(KEYS[:3]),
    st.tuples(
        st.sampled_from([None, 0.25, -0.0, _NAN]),
        st.sampled_from([None, "", "é", "xy"]),
        st.sampled_from([None, datetime(2026, 11, 27, 23, 59, 59, 999999), datetime(1, 1, 1)]),
        st.just(None),
        st.sampled_from([None, -128, 127]),
        st.sampled_from([None, "", "a\x00b"]),
    ),
)


def _join_table(rows: list[tuple[tuple[Any, ...], int]], schema: pa.Schema) -> pa.Table:
    names = [f.name for f in schema][1:]
    dicts = []
    for (key, values), weight in rows:
        row = {n: math.nan if v == _NAN else v for n, v in zip(names, values, strict=True)}
        dicts.append({"k": key, **row, "__weight": weight})
    return _table(dicts, schema, "k")


def _join_runs(
    dump: dict[bytes, bytes], side: bytes, key: str, width: int
) -> tuple[list[int], list[np.ndarray | None], set[bytes]]:
    """A join key's index (older runs' row counts, from the tail of its rows key's value), its
    runs oldest first (the newest last, None when absent) as (rows, words) matrices, and the
    keys of these entries (operators/join.py)."""
    base = state_keys(pa.array([shard_of(key)]), [pa.array([key])], SHARD_PREFIX_BYTES)[0]
    rows_key = base.as_py()[:SHARD_PREFIX_BYTES] + side + base.as_py()[SHARD_PREFIX_BYTES:]
    newest = dump.get(rows_key)
    counts: list[int] = []
    if newest is not None and len(newest) % 8 == 1:
        tail = 8 * newest[-1] + 1
        counts = np.frombuffer(newest[-tail:-1], "<i8").tolist()
        newest = newest[:-tail] or None
    keys = [*(rows_key + bytes([0xFF, p]) for p in range(len(counts)))]
    runs: list[np.ndarray | None] = [np.frombuffer(dump[k], "<i8").reshape(-1, width) for k in keys]
    runs.append(None if newest is None else np.frombuffer(newest, "<i8").reshape(-1, width))
    return counts, runs, {*keys, rows_key}


@pytest.mark.parametrize("inline_rows", [join_module.INLINE_ROWS, 1], ids=["default", "runs"])
@pytest.mark.parametrize(
    ("schemas", "strategies"),
    [
        ((LEFT, RIGHT), (left_rows, right_rows)),
        ((WIDE_LEFT, WIDE_RIGHT), (wide_left_rows, wide_right_rows)),
    ],
    ids=["one column", "every type"],
)
@SETTINGS
@given(data=st.data(), steps=st.integers(1, 8))
def test_join_matches_model(
    schemas: tuple[pa.Schema, pa.Schema],
    strategies: tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]],
    inline_rows: int,
    data: st.DataObject,
    steps: int,
) -> None:
    """With ``inline_rows`` 1, a key keeps older runs as soon as a batch does not merge its
    newest one (operators/join.py): the layout is checked run by run, and every run's rows
    summed must be the key's live rows."""
    spec = OperatorSpec.join("j", *schemas, ["k"])
    names = [*schemas[0].names, *schemas[1].names[1:], "__weight"]
    # A stored row's words: a column each, the null mask, the multiplicity.
    widths = [len(s) + 1 for s in schemas]
    with tempfile.TemporaryDirectory() as root, pytest.MonkeyPatch.context() as patch:
        patch.setattr(join_module, "INLINE_ROWS", inline_rows)
        run = Runner(Path(root), [spec])
        lives: tuple[Counter[tuple[Any, ...]], Counter[tuple[Any, ...]]] = (Counter(), Counter())
        deltas: list[pa.Table] = []
        try:
            for _ in range(steps):
                sides = [0, 1][:: -1 if data.draw(st.booleans()) else 1]
                for index in sides:
                    batch = _draw_batch(data, lives[index], strategies[index])
                    for r, w in batch:
                        lives[index][r] += w
                    rows = _join_table(batch, schemas[index])
                    result = run.apply("j", rows, input_index=index)
                    assert result.delta.schema.names == names
                    assert 0 not in result.delta.column("__weight").to_pylist()
                    deltas.append(result.delta)
                left, right = +lives[0], +lives[1]
                expected = Counter(
                    {(k, *lv, *rv): w for (k, lv, rv), w in join_model(left, right).items()}
                )
                assert integrate(deltas) == expected
                dump = run.worker.dump("j")
                known: set[bytes] = set()
                for side, (side_byte, width) in enumerate(zip((b"L", b"R"), widths, strict=True)):
                    for key in KEYS[:3]:
                        counts, runs, keys = _join_runs(dump, side_byte, key, width)
                        known |= keys
                        assert [len(s) for s in runs[:-1] if s is not None] == counts
                        total = 0
                        for stored in runs:
                            if stored is not None:
                                assert len(stored) and np.all(stored[:, -1] != 0)
                                total += int(stored[:, -1].sum())
                        live = sum(w for (k, _), w in lives[side].items() if k == key)
                        assert total == live
                # Everything else: shard digests and runs' string columns.
                for entry in dump.keys() - known:
                    assert len(entry) == SHARD_PREFIX_BYTES or entry[:-1] in known
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


# -- stateful_map -----------------------------------------------------------------------------

MAP_SCHEMA = pa.schema(
    [
        ("k", pa.string()),
        ("x", pa.int64()),
        ("__topic", pa.string()),
        ("__partition", pa.int32()),
        ("__offset", pa.int64()),
    ]
)
MAP_STATE = pa.schema([("count", pa.int64()), ("total", pa.int64()), ("seq", pa.string())])
MAP_OUT = pa.schema([("count", pa.int64()), ("total", pa.int64()), ("seq", pa.string())])
TIMEOUT = 100


def session_fn(key: tuple[Any, ...], rows: pa.Table, state: dict[str, Any] | None, ctx: Any):
    """Counts and sums a key's rows; remembers their order; closes the session on timeout."""
    st_ = state or {"count": 0, "total": 0, "seq": ""}
    if ctx.timed_out:
        return [{"count": st_["count"], "total": st_["total"], "seq": "closed:" + st_["seq"]}], None
    for row in rows.to_pylist():
        st_ = {
            "count": st_["count"] + row["__weight"],
            "total": st_["total"] + row["x"] * row["__weight"],
            "seq": st_["seq"] + f"{row['x']},",
        }
    return [dict(st_)], st_


def session_model(
    state: dict[str, dict[str, Any]],
    deadlines: dict[str, int],
    batch: list[dict[str, Any]],
    time_ms: int,
) -> list[tuple[Any, ...]]:
    """The model: one step of session_fn semantics; returns the output rows (weight +1)."""
    out: list[tuple[Any, ...]] = []
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(batch, key=lambda r: (r["__topic"], r["__partition"], r["__offset"])):
        by_key.setdefault(row["k"], []).append(row)
    for k, rows in by_key.items():
        st_ = state.get(k, {"count": 0, "total": 0, "seq": ""})
        for row in rows:
            st_ = {
                "count": st_["count"] + row["__weight"],
                "total": st_["total"] + row["x"] * row["__weight"],
                "seq": st_["seq"] + f"{row['x']},",
            }
        state[k] = st_
        deadlines[k] = time_ms + TIMEOUT
        out.append((k, st_["count"], st_["total"], st_["seq"]))
    for k in sorted(deadlines):
        if k not in by_key and deadlines[k] <= time_ms:
            st_ = state.pop(k)
            del deadlines[k]
            out.append((k, st_["count"], st_["total"], "closed:" + st_["seq"]))
    return out


@SETTINGS
@given(data=st.data(), steps=st.integers(1, 10))
def test_stateful_map_matches_model(data: st.DataObject, steps: int) -> None:
    spec = OperatorSpec.stateful_map(
        "sessions", MAP_SCHEMA, ["k"], session_fn, MAP_STATE, MAP_OUT, timeout_ms=TIMEOUT
    )
    with tempfile.TemporaryDirectory() as root:
        run = Runner(Path(root), [spec])
        state: dict[str, dict[str, Any]] = {}
        deadlines: dict[str, int] = {}
        time_ms = 1_000
        offset = 0
        try:
            for _ in range(steps):
                time_ms += data.draw(st.integers(0, 150))
                xs = data.draw(
                    st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 9)), max_size=6)
                )
                batch = []
                for k, x in xs:
                    offset += 1
                    batch.append(
                        {
                            "k": k,
                            "x": x,
                            "__topic": "t",
                            "__partition": offset % 2,
                            "__offset": offset,
                            "__weight": 1,
                        }
                    )
                shuffled = data.draw(st.permutations(batch))
                expected = session_model(state, deadlines, batch, time_ms)
                result = run.apply(
                    "sessions", _table(list(shuffled), MAP_SCHEMA, "k"), time_ms=time_ms
                )
                got = [(r["k"], r["count"], r["total"], r["seq"]) for r in result.delta.to_pylist()]
                assert all(w == 1 for w in result.delta.column("__weight").to_pylist())
                assert sorted(got) == sorted(expected)
                stored = run.worker.dump("sessions")
                live_keys = {
                    decode_value(k[4:])[0] for k in stored if len(k) > 4 and k[4:5] != b"\x00"
                }
                timers = {
                    decode_value(k[13:])[0] for k in stored if len(k) > 4 and k[4:5] == b"\x00"
                }
                assert live_keys == set(state) and timers == set(deadlines)
                run.next_step(commit=data.draw(st.booleans()))
        finally:
            run.close()


# -- the columns a kernel reads ---------------------------------------------------------------

_EXTRA = [("__timestamp", pa.int64()), ("__topic", pa.string()), ("__partition", pa.int32())]


def _with_extra(schema: pa.Schema) -> pa.Schema:
    """``schema`` with an unused user column and the input metadata a decoded row carries."""
    extra = [pa.field(n, t) for n, t in [("unused", pa.string()), *_EXTRA] if n not in schema.names]
    if "__offset" not in schema.names:
        extra.append(pa.field("__offset", pa.int64()))
    return pa.schema([*schema, *extra])


@pytest.mark.parametrize(
    "spec",
    [
        OperatorSpec.aggregate("op", _with_extra(AGG_SCHEMA), ["k"], AGGS),
        OperatorSpec.distinct("op", _with_extra(DISTINCT_SCHEMA)),
        OperatorSpec.join("op", _with_extra(LEFT), RIGHT, ["k"]),
        OperatorSpec.stateful_map(
            "op", _with_extra(MAP_SCHEMA), ["k"], session_fn, MAP_STATE, MAP_OUT, TIMEOUT
        ),
    ],
    ids=lambda spec: spec.kind,
)
def test_a_kernel_needs_only_its_read_columns(spec: OperatorSpec, tmp_path: Path) -> None:
    # The stage sends a worker only spec.read_columns() (and __weight, __shard): the kernel
    # must give the same delta, step after step, as with every column of its input.
    full, cut = Runner(tmp_path / "full", [spec]), Runner(tmp_path / "cut", [spec])
    try:
        for step in range(3):
            for index, schema in enumerate(spec.inputs):
                rows = []
                for i in range(12):
                    row: dict[str, Any] = {"__weight": 1 if i % 5 else -1, "unused": f"u{i}"}
                    for f in schema:
                        if f.name not in row:
                            row[f.name] = _sample(f.type, 7 * step + i)
                    row["k"] = KEYS[i % 3]
                    rows.append(row)
                table = _table(rows, schema, "k")
                wanted = [*spec.read_columns(index), "__weight", "__shard"]
                assert "unused" not in wanted or spec.kind != "aggregate"
                assert "__timestamp" not in wanted
                time_ms = 1_000 * (step + 1)
                a = full.apply("op", table, input_index=index, time_ms=time_ms)
                b = cut.apply("op", table.select(wanted), input_index=index, time_ms=time_ms)
                assert a.delta.equals(b.delta) and a.state_digest == b.state_digest
            full.next_step(commit=True)
            cut.next_step(commit=True)
    finally:
        full.close()
        cut.close()


@pytest.mark.parametrize(
    "spec",
    [
        OperatorSpec.aggregate("op", AGG_SCHEMA, ["k"], AGGS),
        OperatorSpec.aggregate("op", EXTREME_SCHEMA, ["k"], EXTREME_AGGS),
        OperatorSpec.distinct("op", DISTINCT_SCHEMA),
        OperatorSpec.join("op", LEFT, RIGHT, ["k"]),
    ],
    ids=["aggregate", "aggregate columnar", "distinct", "join"],
)
@pytest.mark.parametrize("inline_rows", [join_module.INLINE_ROWS, 1], ids=["default", "runs"])
def test_a_kernels_state_does_not_depend_on_the_order_of_its_rows(
    spec: OperatorSpec, inline_rows: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried Spark task may deliver a batch's rows in another order: the state (and so the
    digest a replay verifies) and the delta must be the same; for a join also when its keys
    keep older runs (``inline_rows`` 1)."""
    monkeypatch.setattr(join_module, "INLINE_ROWS", inline_rows)
    forward, backward = Runner(tmp_path / "f", [spec]), Runner(tmp_path / "b", [spec])
    try:
        for step in range(4):
            for index, schema in enumerate(spec.inputs):
                rows = []
                for i in range(16):
                    row: dict[str, Any] = {"__weight": -1 if step and i % 4 == 0 else 1}
                    for f in schema:
                        row[f.name] = _sample(f.type, 5 * step + i * 3)
                    row["k"] = KEYS[i % 3]
                    rows.append(row)
                a = forward.apply("op", _table(rows, schema, "k"), input_index=index)
                b = backward.apply("op", _table(rows[::-1], schema, "k"), input_index=index)
                assert a.state_digest == b.state_digest
                assert sorted(map(repr, a.delta.to_pylist())) == sorted(
                    map(repr, b.delta.to_pylist())
                )
            forward.next_step(commit=step % 2 == 0)
            backward.next_step(commit=step % 2 == 0)
        dump = forward.worker.dump("op")
        assert dump == backward.worker.dump("op")
        if spec.kind == "join" and inline_rows == 1:  # some key has an index of older runs
            assert any(len(value) % 8 == 1 for value in dump.values())
    finally:
        forward.close()
        backward.close()


def test_a_join_multiset_of_signed_zeros_and_nans_does_not_depend_on_row_order(
    tmp_path: Path,
) -> None:
    """0.0 and -0.0 are two rows that sort as equal; NaNs may differ in their payload."""
    schema = pa.schema([("k", pa.string()), ("f", pa.float64())])
    spec = OperatorSpec.join("op", schema, RIGHT, ["k"])
    other_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    values = [0.0, -0.0, math.nan, other_nan, 1.5, None, -0.0]
    rows = [{"k": "a", "f": v, "__weight": 1} for v in values]
    dumps = []
    for name, order in (("f", rows), ("b", rows[::-1])):
        run = Runner(tmp_path / name, [spec])
        run.apply("op", _table(order, schema, "k"))
        run.next_step(commit=True)
        dumps.append(run.worker.dump("op"))
        run.close()
    assert dumps[0] == dumps[1]
    # Rows of three words (24 bytes): 0.0, -0.0 (twice), one NaN (twice), 1.5, null.
    (value,) = [v for k, v in dumps[0].items() if len(k) > SHARD_PREFIX_BYTES]
    stored = np.frombuffer(value, "<i8").reshape(-1, 3)
    assert len(stored) == 5 and sorted(stored[:, 2].tolist()) == [1, 1, 1, 2, 2]


@pytest.mark.parametrize("right", [RIGHT, WIDE_RIGHT], ids=["one column", "every type"])
def test_a_null_key_joins_nothing(right: pa.Schema, tmp_path: Path) -> None:
    spec = OperatorSpec.join("op", LEFT, right, ["k"])
    run = Runner(tmp_path, [spec])
    try:
        for index, schema in enumerate(spec.inputs):
            rows = [{"k": k, "__weight": 1} for k in (None, "a")]
            result = run.apply("op", _table(rows, schema, "k"), input_index=index)
        assert [r["k"] for r in result.delta.to_pylist()] == ["a"]
    finally:
        run.close()


TEXT_LEFT = pa.schema([("k", pa.string()), ("s", pa.string())])


@pytest.mark.parametrize(
    ("schema", "row", "extra", "message"),
    [
        (LEFT, {"lv": 1}, b"xy", "not made of 24-byte rows"),
        (LEFT, {"lv": 1}, b"\x05", "index is empty or longer than its value"),
        (LEFT, {"lv": 1}, b"\x00", "index is empty"),
        (TEXT_LEFT, {"s": "text"}, b"xy", "string bytes do not match its rows"),
    ],
    ids=["rows", "index of five runs", "index of none", "strings"],
)
def test_a_join_refuses_stored_state_of_another_layout(
    schema: pa.Schema,
    row: dict[str, Any],
    extra: bytes,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A value whose length is not a whole number of rows, an index of more runs than the value
    holds or of none, or string bytes that do not add up to the lengths in the rows, are state
    of another layout or format: the kernel says so instead of reading them. The fault:
    ``extra`` bytes after every rows value (one byte is an index's run count), or after every
    string entry (its key ends with the column's byte, 0)."""
    spec = OperatorSpec.join("op", schema, RIGHT, ["k"])
    run = Runner(tmp_path, [spec])
    rows = [{"k": "a", **row, "__weight": 1}]
    run.apply("op", _table(rows, schema, "k"))
    run.next_step(commit=True)
    get_array = _Reader.get_array
    strings = "s" in row

    def longer(self: _Reader, keys: pa.Array) -> pa.Array:
        values = get_array(self, keys).to_pylist()
        return pa.array(
            [
                v and v + extra if k.endswith(b"\x00") == strings else v
                for k, v in zip(keys.to_pylist(), values, strict=True)
            ],
            pa.large_binary(),
        )

    monkeypatch.setattr(_Reader, "get_array", longer)
    with pytest.raises(KernelError, match=message):
        run.apply("op", _table(rows, schema, "k"))
    run.close()


def test_a_hot_join_key_is_not_rewritten_whole_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key that gains a row per step on one side: each step writes its new run and, now and
    then, merges older runs, so the bytes written over N steps grow like N log N, where one
    value per key (state format 4) rewrote all of the key's rows every step (N**2 / 2 rows).
    The other side still joins every row, and the state stays a few runs."""
    written = count_written(monkeypatch, "state.op")
    spec = OperatorSpec.join("op", LEFT, RIGHT, ["k"])
    run = Runner(tmp_path, [spec])
    steps = 1500
    try:
        run.apply("op", _table([{"k": "a", "rv": "x", "__weight": 1}], RIGHT, "k"), 1)
        for step in range(steps):
            rows = [{"k": "a", "lv": step, "__weight": 1}]
            delta = run.apply("op", _table(rows, LEFT, "k")).delta
            assert delta.to_pylist() == [{"k": "a", "lv": step, "rv": "x", "__weight": 1}]
            run.next_step(commit=step % 250 == 0)
        right = _table([{"k": "a", "rv": "y", "__weight": 1}], RIGHT, "k")
        delta = run.apply("op", right, 1).delta
        assert sorted(r["lv"] for r in delta.to_pylist()) == list(range(steps))
        _, runs, _ = _join_runs(run.worker.dump("op"), b"L", "a", 3)
        assert len(runs) <= math.log2(steps / join_module.INLINE_ROWS) + 2
        row_bytes = 3 * 8
        assert written["bytes"] < 0.05 * row_bytes * steps * steps / 2
    finally:
        run.close()


def test_a_join_side_of_many_columns_or_none(tmp_path: Path) -> None:
    """A null mask over two words (70 columns, nulls at 0, 63, 64 and 69), against a side
    with no column but its key: each stored row comes back with its nulls where they were."""
    wide = pa.schema([("k", pa.string()), *((f"c{i}", pa.int64()) for i in range(70))])
    bare = pa.schema([("k", pa.string())])
    run = Runner(tmp_path, [OperatorSpec.join("op", wide, bare, ["k"])])
    try:
        rows = []
        for j, nulls in enumerate([(0,), (63,), (64, 69), ()]):
            values = {f"c{i}": None if i in nulls else 10 * i + j for i in range(70)}
            rows.append({"k": "a", **values, "__weight": 1})
        run.apply("op", _table(rows, wide, "k"))
        run.next_step(commit=True)
        bare_rows = [{"k": "a", "__weight": 2}, {"k": "b", "__weight": 1}]
        delta = run.apply("op", _table(bare_rows, bare, "k"), input_index=1).delta
        expected = [{**r, "__weight": 2} for r in rows]
        assert sorted(map(repr, delta.to_pylist())) == sorted(map(repr, expected))
    finally:
        run.close()


def test_a_join_side_of_255_string_columns_is_refused() -> None:
    """Byte 255 after a key marks its older runs (operators/join.py): a side's string columns
    are numbered 0 to 254."""
    fits = pa.schema([("k", pa.string()), *((f"s{i}", pa.string()) for i in range(254))])
    JoinKernel(OperatorSpec.join("op", fits, RIGHT.remove(1), ["k"]), SHARD_PREFIX_BYTES)
    wide = fits.append(pa.field("s254", pa.string()))
    with pytest.raises(OperatorSpecError, match="255 string columns; at most 254"):
        JoinKernel(OperatorSpec.join("op", wide, RIGHT.remove(1), ["k"]), SHARD_PREFIX_BYTES)


def test_an_interval_column_is_refused_when_the_spec_is_built() -> None:
    schema = pa.schema([("k", pa.string()), ("i", pa.month_day_nano_interval())])
    with pytest.raises(OperatorSpecError, match="cannot keep in state"):
        OperatorSpec.join("op", schema, RIGHT, ["k"])


def _sample(arrow_type: pa.DataType, i: int) -> Any:
    if pa.types.is_string(arrow_type):
        return f"s{i % 4}"
    if pa.types.is_floating(arrow_type):
        return FLOATS[i % len(FLOATS)]
    return i % 6


@pytest.mark.parametrize("with_order_columns", [False, True])
def test_stateful_map_sees_rows_in_one_order_however_they_arrive(
    with_order_columns: bool, tmp_path: Path
) -> None:
    # Spark's exchange delivers a worker's rows in no fixed order. Rows without the input
    # order (after another operator), or several rows of one input record (same offset), must
    # still reach the function in one order, or a replay would compute another state.
    schema = (
        MAP_SCHEMA if with_order_columns else pa.schema([("k", pa.string()), ("x", pa.int64())])
    )
    spec = OperatorSpec.stateful_map("m", schema, ["k"], session_fn, MAP_STATE, MAP_OUT)
    rows = [
        {"k": KEYS[i % 2], "x": (5 * i) % 7, "__topic": "t", "__partition": 0, "__offset": i // 3}
        for i in range(12)
    ]
    for row in rows:
        row["__weight"] = 1
    table = _table(rows, schema, "k")
    shuffled = table.take(pa.array([7, 2, 11, 0, 5, 9, 1, 4, 10, 3, 8, 6]))
    first, second = Runner(tmp_path / "a", [spec]), Runner(tmp_path / "b", [spec])
    try:
        a = first.apply("m", table, time_ms=1_000)
        b = second.apply("m", shuffled, time_ms=1_000)
        assert a.delta.equals(b.delta) and a.state_digest == b.state_digest
    finally:
        first.close()
        second.close()
