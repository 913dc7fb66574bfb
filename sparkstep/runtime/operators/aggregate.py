"""``aggregate``: count, sum, min, max and avg per key, with exact retractions.

Two state layouts, chosen by the spec (so one operator always uses the same one); one record per
key with a non-empty state, ``key = shard prefix + enc([key values...])`` (see operators.base).

**Columnar** (every aggregate is ``count``, ``sum``/``avg`` of an integer column, or ``min``/``max``
of an integer column other than uint64 or of a date, time, timestamp or duration column): a
fixed-width little-endian record of 8-byte fields: ``n`` int64, then per aggregate nothing for
``count(*)`` and ``min``/``max``, ``c`` int64 for ``count(col)``, and ``lo`` uint64, ``hi``
int64, ``c`` int64 for an integer ``sum``/``avg`` (the sum as an exact 128-bit two's complement
integer); then per column that a ``min`` or ``max`` reads (the *value columns*, numbered ``j``
in sorted order, shared by every min and max of that column) ``mn``, ``mx`` int64, ``lv``
uint64 and ``fl`` int64 (bit 0 *has*, bit 1 *negative*). The column's multiset per key
(value -> multiplicity, the sum of the weights of its rows) is kept in *chunks* beside the
record, at most one per level ``l`` (0..63)::

    key   = record key + bytes([j, l])
    value = (value int64 LE, multiplicity int64 LE) per distinct value with a multiplicity != 0,
            sorted by value; a chunk is never empty

A value's multiplicity is the sum over the key's chunks. Invariants of a stored record (the
kernel relies on them to read only the chunks it merges, and checks what it reads):

- ``lv`` has bit ``l`` set exactly when chunk ``l`` exists.
- *has* is set if some value has a positive multiplicity; ``mn`` is the least such value,
  ``mx`` the greatest (both 0 when none is).
- *negative* is set if some value may have a negative multiplicity (a retraction of what was
  never inserted). When it is clear, no chunk holds a negative multiplicity: a chunk is then a
  merge of inserts and of chunks like it, or of all of the key's chunks with none negative.

Why. Format 5 kept the multiset in one value, and a batch read, merged, digested and wrote
back the whole multiset of each key it touched: a key's cost per step grew with its distinct
values (a max of a timestamp per user rewrote every timestamp the user ever had: quadratic over
time, 4x slower than this layout after 30 steps of ``bench/workers.py``'s hot keys). Now:

- A key whose batch rows (with a value of the column) only insert, and not *negative*, needs
  no chunk for its new extremes: they are its record's and those of what it merges, all
  positive. Chunk 0 takes in the batch's values while it holds at most :data:`INLINE_VALUES`
  with them (read, merged, rewritten: a small multiset costs what format 5's did); past that,
  the values go in as a binary counter: with ``z`` the number of trailing ones of ``lv``,
  chunks ``0..z-1`` are read, merged with the batch into chunk ``z`` (absent: a clear bit) and
  deleted, ``lv`` becomes ``lv + 1``. So a value is rewritten O(log) times, not at each touch.
- A key with a retraction in its rows, or *negative*, reads all its chunks and merges them
  with the batch into one, at level 0 if it holds at most :data:`INLINE_VALUES` values, else
  at the highest level it had; its extremes and *negative* come from the result.
- A merge whose result is empty writes no chunk.

Reads: each key's record and chunk 0 of each value column in one ``StateReader.get_array``
(so a chunk 0 written is always a key read), the higher chunks a merge needs in a second one
(none, for most batches). A chunk written higher up by a carry is a key the kernel did not read
and knows absent (``StateChanges.read_at`` = ``ABSENT``), so it costs the worker no lookup for
the digest. Records and chunks are read and written (``StateChanges``) as Arrow arrays, merged
with one numpy sort and segmented sum per value column: the kernel runs no Python per key or
value. ``avg`` divides in float64 when ``|sum| <= 2**53`` (exact operands, one correctly rounded
division) and exactly in Python otherwise.

**General** (any float ``sum``/``avg``, or ``min``/``max`` of a float, bool, string or uint64
column)::

    value = enc([count(*), [state of each agg, in spec order], {column: multiset}])

Per aggregate state (``c`` = non-null count, i.e. the sum of the weights of non-null values):

- ``count(*)``: ``null`` (``n`` is the answer); ``count(col)``: ``c``.
- ``sum``/``avg`` of an integer column: ``[s, c]`` with ``s`` an exact Python int (unbounded).
- ``sum``/``avg`` of a float column: ``[num, den, nan, pinf, ninf, c]``: the finite values'
  sum as an exact rational ``num/den`` (every float is a dyadic rational, so adding and
  retracting is exact and the result does not depend on the order of the input), and the
  multiplicities of NaN, +inf and -inf. The answer is NaN if any NaN (or both infinities) is
  present, else the infinity present, else ``float(num/den)`` (correctly rounded). Chosen over a
  stored multiset with ``math.fsum``: O(1) state per key, same exactness.
- ``min``/``max``: ``null``; they read the column's multiset, shared by every min and max of
  that column: ``[value1, multiplicity1, value2, multiplicity2, ...]`` sorted by value,
  multiplicities != 0, so retracting the current minimum finds the next one. Floats sort with
  NaN greatest (Spark's order). A column whose multiset is empty has no entry.

A key's output row exists while ``n > 0``; a key whose count reaches 0 emits only its -1 row and
its state is deleted (when every aggregate state is empty too, which holds whenever every
retraction matches an earlier insert). ``avg = sum / c`` as float64; ``sum`` of an integer column
is int64 and a result outside int64 is a :class:`KernelError`.

Where time goes (``bench/workers.py``): the per-key and per-(key, value) work is vectorised
with ``Table.group_by`` (weights summed, integer sums as ``decimal128`` so they cannot overflow
within a batch). The general layout then runs Python once per distinct key (state decode,
update, encode, output row) and once per distinct (key, value) for float sums, min and max. The
columnar layout has no Python per key or value: state keys are built for the batch with Arrow
(``base.state_keys``), records and chunks with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkstep.runtime.errors import KernelError
from sparkstep.runtime.operators.base import (
    ABSENT,
    SHARD,
    WEIGHT,
    ApplyContext,
    Kernel,
    KernelResult,
    StateChanges,
    StateReader,
    arrays_from_plain,
    binary_layout,
    decode_value,
    encode_value,
    fixed_rows,
    fixed_values,
    plain_type,
    rows_order,
    state_keys,
    to_plain,
)
from sparkstep.runtime.operators.spec import Agg, OperatorSpec

__all__ = [
    "AggregateKernel",
]

_DEC = pa.decimal128(38, 0)
# Kinds of aggregate state (see the module docstring).
_COUNT_ALL, _COUNT, _INT_SUM, _FLOAT_SUM, _MIN_MAX = range(5)
INLINE_VALUES = 64
"""The most values a chunk 0 takes in by merging (see the module docstring)."""
# One element of a column's multiset in the columnar layout: value, multiplicity.
_PAIR = np.dtype([("v", "<i8"), ("m", "<i8")])
# The bits of a value column's ``fl`` field (see the module docstring).
_HAS, _NEGATIVE = 1, 2


def _columnar_extreme(arrow_type: pa.DataType | None) -> bool:
    """Whether a min/max of a column of ``arrow_type`` fits the columnar layout: its values are
    integers that fit int64 (integers but uint64, and dates, times, timestamps and durations,
    which are integers underneath, see ``base.plain_type``)."""
    if arrow_type is None:
        return False
    plain = plain_type(arrow_type)
    return bool(pa.types.is_integer(plain)) and plain != pa.uint64()


@dataclass(frozen=True)
class _Extremes:
    """Per key of a batch, of one value column: whether some value has a positive
    multiplicity (``has``), and the least and greatest such value (0 where none)."""

    has: np.ndarray
    mn: np.ndarray
    mx: np.ndarray

    @classmethod
    def of(cls, owner: np.ndarray, value: np.ndarray, count: np.ndarray, n: int) -> _Extremes:
        """From multiset elements sorted by ``owner`` (key index < ``n``), then ``value``."""
        positive = count > 0
        owner, value = owner[positive], value[positive]
        has = np.zeros(n, dtype=bool)
        mn = np.zeros(n, dtype=np.int64)
        mx = np.zeros(n, dtype=np.int64)
        if len(owner):
            first = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]]))
            last = np.concatenate([first[1:], [len(owner)]]) - 1
            has[owner[first]] = True
            mn[owner[first]] = value[first]
            mx[owner[first]] = value[last]
        return cls(has, mn, mx)

    @classmethod
    def stored(cls, records: np.ndarray, j: int) -> _Extremes:
        """Value column ``j``'s extremes as ``records`` hold them."""
        return cls((records[f"fl{j}"] & _HAS) != 0, records[f"mn{j}"], records[f"mx{j}"])


def _consolidated(
    owner: np.ndarray, value: np.ndarray, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(owner, value, count) elements sorted by owner, then value, each pair once with its
    counts summed, those summing to 0 left out."""
    order = rows_order([owner, value])
    owner, value, count = owner[order], value[order], count[order]
    if len(owner):
        first = np.flatnonzero(
            np.concatenate([[True], (owner[1:] != owner[:-1]) | (value[1:] != value[:-1])])
        )
        owner, value, count = owner[first], value[first], np.add.reduceat(count, first)
    kept = count != 0
    return owner[kept], value[kept], count[kept]


def _highest_bit(masks: np.ndarray) -> np.ndarray:
    """Each uint64 of ``masks`` reduced to its highest set bit (0 stays 0)."""
    top = masks.copy()
    for shift in (1, 2, 4, 8, 16, 32):
        top |= top >> np.uint64(shift)
    return top ^ (top >> np.uint64(1))  # type: ignore[no-any-return]


def _taken(array: pa.Array, indices: np.ndarray) -> pa.Array:
    """``array.take(indices)`` for ascending, distinct ``indices``: ``array`` itself when they
    are all of it (as many as its length, so 0, 1, ..., n - 1)."""
    if len(indices) == len(array):
        return array
    return array.take(pa.array(indices, pa.int64()))


def _chunk_keys(key_array: pa.Array, owner: np.ndarray, j: int, level: np.ndarray) -> pa.Array:
    """The keys of chunks ``level`` of value column ``j`` of the keys ``owner`` indexes."""
    suffix = np.empty((len(owner), 2), dtype=np.uint8)
    suffix[:, 0] = j
    suffix[:, 1] = level
    owned = key_array.take(pa.array(owner, pa.int64()))
    return pc.binary_join_element_wise(owned, fixed_rows(suffix).cast(owned.type), b"")


@dataclass(frozen=True)
class _Chunks:
    """Which chunks of one value column a batch merges (see the module docstring), per key of
    the batch: the levels it reads (``read``, a bit mask) and the level its merge goes to
    (``target``, one bit; 0 for a key the batch has no value for; a full merge of at most
    :data:`INLINE_VALUES` values goes to level 0 instead), whether the key reads all its
    chunks (``full``); and the chunks of level 1 and up it reads (chunk 0 is read with the
    records), in read order: their key's index (``owner``) and ``level``."""

    read: np.ndarray
    target: np.ndarray
    full: np.ndarray
    owner: np.ndarray
    level: np.ndarray

    @classmethod
    def plan(
        cls,
        records: np.ndarray,
        j: int,
        zero_sizes: np.ndarray,
        row_owner: np.ndarray,
        retraction: np.ndarray,
    ) -> _Chunks:
        """For ``records`` (the keys' stored records), the values of each key's chunk 0 of
        column ``j`` (``zero_sizes``, 0 without one) and the batch's rows with a value of the
        column (``row_owner``: their keys, ``retraction``: which have a negative weight). A key
        with a retraction reads all its chunks even if its rows cancel out: the batch's rows
        are merged once, with the chunks."""
        n = len(records)
        levels = records[f"lv{j}"]
        values = np.bincount(row_owner, minlength=n)  # at least its distinct values
        touched = values > 0
        retracts = np.bincount(row_owner[retraction], minlength=n) > 0
        full = touched & (retracts | ((records[f"fl{j}"] & _NEGATIVE) != 0))
        fast = touched & ~full
        one, none = np.uint64(1), np.uint64(0)
        absorb = fast & ((levels & one) != 0) & (zero_sizes + values <= INLINE_VALUES)
        carry = fast & ~absorb
        read = np.where(
            absorb, one, np.where(carry, levels & ~(levels + one), np.where(full, levels, none))
        )
        top = np.where(levels == 0, one, _highest_bit(levels))
        target = np.where(
            absorb, one, np.where(carry, (levels + one) & ~levels, np.where(full, top, none))
        )
        owners: list[np.ndarray] = [np.zeros(0, np.int64)]
        levels_read: list[np.ndarray] = [np.zeros(0, np.int64)]
        for level in range(1, int(read.max()).bit_length() if n else 0):
            at = np.flatnonzero((read >> np.uint64(level)) & one)
            owners.append(at)
            levels_read.append(np.full(len(at), level, dtype=np.int64))
        return cls(read, target, full, np.concatenate(owners), np.concatenate(levels_read))


class _Read(NamedTuple):
    """Chunks a kernel read: their elements laid one after another (:func:`_pairs`), each
    one's number of elements (0: absent), their keys, and the position of the first among the
    apply's reads (``StateChanges.read_at``)."""

    pairs: np.ndarray
    sizes: np.ndarray
    keys: pa.Array
    start: int


def _pairs(values: pa.Array, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Chunks (``values``, null or empty: none) as their ``_PAIR`` elements, laid one after
    another, and each chunk's number of elements. Raises :class:`KernelError` if a chunk is not
    a whole number of pairs (``what`` says whose, for the message)."""
    if values.null_count:  # Arrow need not give a null slot zero bytes
        values = pc.fill_null(values, pa.scalar(b"", values.type))
    offsets, data = binary_layout(values)
    sizes = np.diff(offsets)
    if np.any(sizes % _PAIR.itemsize):
        raise KernelError(
            f"{what} is not a whole number of (value, multiplicity) pairs: the store holds "
            "another state format"
        )
    return np.frombuffer(data, _PAIR), sizes // _PAIR.itemsize


def _float_key(item: tuple[Any, int]) -> tuple[bool, Any]:
    return (item[0] != item[0], item[0])


def _same(old: list[Any], new: list[Any], floats: bool) -> bool:
    """Row equality where NaN equals NaN (a NaN aggregate that stays NaN is unchanged).

    ``floats``: whether any aggregate is a float (only then can a row hold NaN).
    """
    if old == new:
        return True
    return floats and encode_value(old) == encode_value(new)


class AggregateKernel(Kernel):
    """The ``aggregate`` kernel for one :class:`OperatorSpec` of kind ``aggregate``."""

    def __init__(self, spec: OperatorSpec, shard_width: int) -> None:
        self.name = spec.name
        self.spec = spec
        self.shard_width = shard_width
        schema = spec.inputs[0]
        self.key = list(spec.key)
        self.key_types = [schema.field(c).type for c in self.key]
        self.aggs: list[Agg] = list(spec.aggs)
        self.col_types: list[pa.DataType | None] = [
            None if a.column is None else schema.field(a.column).type for a in self.aggs
        ]
        fields = [pa.field(c, t) for c, t in zip(self.key, self.key_types, strict=True)]
        for agg, ctype in zip(self.aggs, self.col_types, strict=True):
            fields.append(pa.field(agg.output, self._output_type(agg, ctype)))
        fields.append(pa.field(WEIGHT, pa.int64()))
        self.output_schema = pa.schema(fields)
        self._int_flags = [t is not None and pa.types.is_integer(t) for t in self.col_types]
        self._columns = [a.column or "" for a in self.aggs]
        self._kinds = [self._kind(i) for i in range(len(self.aggs))]
        self._columnar = all(
            k in (_COUNT_ALL, _COUNT, _INT_SUM) or (k == _MIN_MAX and _columnar_extreme(t))
            for k, t in zip(self._kinds, self.col_types, strict=True)
        )
        self._float_outputs = any(
            pa.types.is_floating(f.type) for f in self.output_schema if f.name != WEIGHT
        )
        # min rather than max, sum rather than avg (how _row reads a state).
        self._plain = [a.fn in ("min", "sum") for a in self.aggs]
        self._empty_aggs = [self._empty_agg_state(i) for i in range(len(self.aggs))]
        self._set_columns = sorted(
            {
                (a.column, bool(t is not None and pa.types.is_floating(t)))
                for a, t in zip(self.aggs, self.col_types, strict=True)
                if a.fn in ("min", "max") and a.column is not None
            }
        )
        # The columnar record: see the module docstring.
        fields_np: list[tuple[str, str]] = [("n", "<i8")]
        for i, kind in enumerate(self._kinds):
            if kind == _COUNT:
                fields_np.append((f"c{i}", "<i8"))
            elif kind == _INT_SUM:
                fields_np += [(f"lo{i}", "<u8"), (f"hi{i}", "<i8"), (f"c{i}", "<i8")]
        for j in range(len(self._set_columns)):
            fields_np += [(f"mn{j}", "<i8"), (f"mx{j}", "<i8"), (f"lv{j}", "<u8")]
            fields_np.append((f"fl{j}", "<i8"))
        self._record = np.dtype(fields_np)
        self._value_column = {column: j for j, (column, _) in enumerate(self._set_columns)}
        # The batch's per-key sums agg i reads, by name: the weights of its column's non-null
        # values (count, sum, avg), and for an integer sum/avg their products. Computed once
        # per column, however many aggregates read them (sum and avg of x share both).
        self._count_sum: dict[int, str] = {}
        self._product_sum: dict[int, str] = {}
        for i, kind in enumerate(self._kinds):
            first = self._columns.index(self._columns[i])
            if kind in (_COUNT, _INT_SUM, _FLOAT_SUM):
                self._count_sum[i] = f"c{first}"
            if kind == _INT_SUM:
                self._product_sum[i] = f"s{first}"
        # Whether agg i is updated per distinct (key, value) rather than per key.
        self._per_value = [
            a.fn in ("min", "max") or (a.fn in ("sum", "avg") and not self._int_flags[i])
            for i, a in enumerate(self.aggs)
        ]

    @staticmethod
    def _output_type(agg: Agg, ctype: pa.DataType | None) -> pa.DataType:
        if agg.fn == "count":
            return pa.int64()
        assert ctype is not None
        if agg.fn == "avg":
            return pa.float64()
        if agg.fn == "sum":
            return pa.int64() if pa.types.is_integer(ctype) else pa.float64()
        return ctype

    def _is_int(self, i: int) -> bool:
        return self._int_flags[i]

    def _kind(self, i: int) -> int:
        agg = self.aggs[i]
        if agg.fn == "count":
            return _COUNT_ALL if agg.column is None else _COUNT
        if agg.fn in ("min", "max"):
            return _MIN_MAX
        return _INT_SUM if self._int_flags[i] else _FLOAT_SUM

    def _empty_agg_state(self, i: int) -> Any:
        fn = self.aggs[i].fn
        if fn == "count":
            return None if self.aggs[i].column is None else 0
        if fn in ("min", "max"):
            return None
        if self._is_int(i):
            return [0, 0]
        return [0, 1, 0, 0, 0, 0]

    # -- the kernel ---------------------------------------------------------------------------

    def apply(self, rows: pa.Table, state: StateReader, ctx: ApplyContext) -> KernelResult:
        agg_cols = [a.column for a in self.aggs if a.column is not None]
        rows = self.check_input(rows, [*self.key, *agg_cols])
        if rows.num_rows == 0:
            return KernelResult(self.empty_delta())
        weight = rows.column(WEIGHT)
        group_cols = [*self.key, SHARD]

        # Step 1. Per key (vectorised): sum of weights, non-null counts, exact integer sums.
        derived: dict[str, Any] = {c: rows.column(c) for c in group_cols}
        derived["w"] = weight
        specs: list[tuple[str, str]] = [("w", "sum")]
        for i, agg in enumerate(self.aggs):
            count_sum, product_sum = self._count_sum.get(i), self._product_sum.get(i)
            if agg.column is None or count_sum is None:
                continue
            col = rows.column(agg.column)
            if count_sum not in derived:
                derived[count_sum] = pc.if_else(pc.is_valid(col), weight, 0)
                specs.append((count_sum, "sum"))
            if product_sum is not None and product_sum not in derived:
                try:
                    product = pc.multiply_checked(pc.cast(col, pa.int64()), weight)
                except (pa.ArrowInvalid, OverflowError) as exc:
                    raise KernelError(
                        f"aggregate {self.name!r}: {agg.column} * weight overflows int64"
                    ) from exc
                derived[product_sum] = pc.cast(product, _DEC)
                specs.append((product_sum, "sum"))
        per_key = pa.table(derived).group_by(group_cols, use_threads=False).aggregate(specs)

        key_array = state_keys(
            per_key.column(SHARD), [per_key.column(c) for c in self.key], self.shard_width
        )
        if self._columnar:
            return self._apply_columnar(rows, per_key, key_array, state)
        keys: list[bytes] = key_array.to_pylist()
        key_values = [to_plain(per_key.column(c)) for c in self.key]
        shards = per_key.column(SHARD).to_pylist()
        index = {ident: j for j, ident in enumerate(zip(shards, *key_values, strict=True))}
        sums = {name: per_key.column(f"{name}_sum").to_pylist() for name, _ in specs}

        # Step 2. Per (key, value) (vectorised): net weights for float sums, min and max, once
        # per column: key index -> [(value, net weight)].
        per_column: dict[str, list[list[tuple[Any, int]]]] = {}
        for i, agg in enumerate(self.aggs):
            if not self._per_value[i] or agg.column in per_column:
                continue
            assert agg.column is not None
            source = {c: rows.column(c) for c in group_cols}
            table = pa.table({**source, "v": rows.column(agg.column), "w": weight})
            table = table.filter(pc.is_valid(table.column("v")))
            grouped = table.group_by([*group_cols, "v"], use_threads=False).aggregate(
                [("w", "sum")]
            )
            grouped = grouped.filter(pc.not_equal(grouped.column("w_sum"), 0))
            entries: list[list[tuple[Any, int]]] = [[] for _ in keys]
            gkeys = [to_plain(grouped.column(c)) for c in group_cols[:-1]]
            for ident, value, w in zip(
                zip(grouped.column(SHARD).to_pylist(), *gkeys, strict=True),
                to_plain(grouped.column("v")),
                grouped.column("w_sum").to_pylist(),
                strict=True,
            ):
                entries[index[ident]].append((value, w))
            per_column[agg.column] = entries

        # Step 3. Per key (Python): read, update, compare, emit.
        previous = state.get_many(keys)
        take: list[int] = []
        out_rows: list[list[Any]] = []
        out_w: list[int] = []
        changes: dict[bytes, bytes | None] = {}
        for j, k in enumerate(keys):
            old_raw = previous[j]
            old = decode_value(old_raw) if old_raw is not None else None
            new = self._update(old, j, sums, per_column)
            if self._is_empty(new):
                if old_raw is not None:
                    changes[k] = None
            else:
                encoded = encode_value(new)
                if encoded != old_raw:
                    changes[k] = encoded
            old_row = self._row(old)
            new_row = self._row(new)
            if old_row is not None:
                if new_row is not None and _same(old_row, new_row, self._float_outputs):
                    continue
                take.append(j)
                out_rows.append(old_row)
                out_w.append(-1)
            if new_row is not None:
                take.append(j)
                out_rows.append(new_row)
                out_w.append(1)
        # Step 4. The delta: key columns by a vectorised take, aggregates from the rows.
        key_columns = per_key.select(self.key).take(pa.array(take, type=pa.int64()))
        return KernelResult(self._delta(key_columns, out_rows, out_w), StateChanges.of(changes))

    def _apply_columnar(
        self, rows: pa.Table, per_key: pa.Table, key_array: pa.Array, state: StateReader
    ) -> KernelResult:
        """Steps 2 to 4 for the columnar layout (see the module docstring), with numpy."""
        # Step 2. Old records (absent keys read as zeros) and each value column's chunk 0 (one
        # read), the chunks of level 1 and up the merges need (a second read, often empty), the
        # new records and chunks.
        n, m = len(key_array), len(self._set_columns)
        zero_keys = [
            pc.binary_join_element_wise(key_array, pa.scalar(bytes([j, 0]), key_array.type), b"")
            for j in range(m)
        ]
        stored = state.get_array(pa.concat_arrays([key_array, *zero_keys]))
        old, existed = fixed_values(stored.slice(0, n), self._record)
        new = old.copy()
        parts: list[StateChanges] = []
        extremes: list[tuple[_Extremes, _Extremes]] = []
        if m:
            row_keys = state_keys(
                rows.column(SHARD), [rows.column(c) for c in self.key], self.shard_width
            )
            owners = pc.index_in(row_keys, value_set=key_array).to_numpy(zero_copy_only=False)
            batches = [self._batch_rows(rows, c, owners) for c, _ in self._set_columns]
            zeros = [_pairs(stored.slice(n * (j + 1), n), self._chunk_name(j)) for j in range(m)]
            plans = [
                _Chunks.plan(old, j, zeros[j][1], owner, weight < 0)
                for j, (owner, _, weight) in enumerate(batches)
            ]
            upper_keys = [
                _chunk_keys(key_array, plan.owner, j, plan.level) for j, plan in enumerate(plans)
            ]
            upper = pa.concat_arrays(upper_keys)
            upper = state.get_array(upper) if len(upper) else pa.array([], pa.large_binary())
            upper_from = n * (m + 1)
            for j, plan in enumerate(plans):
                count = len(plan.owner)
                before, after, written = self._merge_chunks(
                    j,
                    old,
                    new,
                    batches[j],
                    plan,
                    _Read(*zeros[j], zero_keys[j], n * (j + 1)),
                    _Read(
                        *_pairs(upper.slice(upper_from - n * (m + 1), count), self._chunk_name(j)),
                        upper_keys[j],
                        upper_from,
                    ),
                    key_array,
                )
                extremes.append((before, after))
                parts.append(written)
                upper_from += count
        new["n"] += per_key.column("w_sum").to_numpy()
        for i, kind in enumerate(self._kinds):
            if kind in (_COUNT, _INT_SUM):
                new[f"c{i}"] += per_key.column(f"{self._count_sum[i]}_sum").to_numpy()
            if kind == _INT_SUM:
                ds = per_key.column(f"{self._product_sum[i]}_sum").combine_chunks()
                ds = pc.if_else(pc.is_valid(ds), ds, pa.scalar(Decimal(0), _DEC))
                halves = np.frombuffer(
                    ds.buffers()[1],
                    dtype=np.dtype([("lo", "<u8"), ("hi", "<i8")]),
                    count=len(ds),
                    offset=ds.offset * 16,
                )
                lo = old[f"lo{i}"] + halves["lo"]
                carry = (lo < old[f"lo{i}"]).astype(np.int64)
                new[f"lo{i}"] = lo
                new[f"hi{i}"] = old[f"hi{i}"] + halves["hi"] + carry
        # Step 3. Old and new output rows, and which keys emit what.
        old_exists = existed & (old["n"] > 0)
        new_exists = new["n"] > 0
        differs = np.zeros(n, dtype=bool)
        outputs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for i in range(len(self.aggs)):
            ov, onull = self._column_output(old, i, old_exists, [e[0] for e in extremes])
            nv, nnull = self._column_output(new, i, new_exists, [e[1] for e in extremes])
            differs |= (onull != nnull) | (~onull & ~nnull & (ov != nv))
            outputs.append((ov, onull, nv, nnull))
        emit_old = np.flatnonzero(old_exists & (~new_exists | differs))
        emit_new = np.flatnonzero(new_exists & (~old_exists | differs))
        order = np.argsort(np.concatenate([emit_old * 2, emit_new * 2 + 1]), kind="stable")
        take = np.concatenate([emit_old, emit_new])[order]
        arrays: list[Any] = list(per_key.select(self.key).take(pa.array(take)).columns)
        for i, (ov, onull, nv, nnull) in enumerate(outputs):
            values = np.concatenate([ov[emit_old], nv[emit_new]])[order]
            mask = np.concatenate([onull[emit_old], nnull[emit_new]])[order]
            fld = self.output_schema.field(len(self.key) + i)
            array = pa.array(values, type=plain_type(fld.type), mask=mask)
            arrays.append(array if array.type == fld.type else array.cast(fld.type))
        weights = np.concatenate(
            [np.full(len(emit_old), -1, np.int64), np.ones(len(emit_new), np.int64)]
        )[order]
        arrays.append(pa.array(weights, type=pa.int64()))
        delta = pa.Table.from_arrays(arrays, schema=self.output_schema)
        # Step 4. State changes: delete records that went back to all zeros.
        words = self._record.itemsize // 8  # every field is 8 bytes
        new_words = new.view(np.int64).reshape(n, words)
        empty = ~new_words.any(axis=1)
        changed = (new_words != old.view(np.int64).reshape(n, words)).any(axis=1)
        puts = np.flatnonzero(~empty & changed)
        records = new[puts].view(np.uint8).reshape(-1, self._record.itemsize)
        deletes = np.flatnonzero(empty & existed)
        parts.append(StateChanges(key_array.take(pa.array(puts)), fixed_rows(records), puts))
        parts.append(
            StateChanges(
                key_array.take(pa.array(deletes)),
                pa.nulls(len(deletes), pa.large_binary()),
                deletes,
            )
        )
        return KernelResult(delta, StateChanges.concat(parts))

    def _chunk_name(self, j: int) -> str:
        """How a message names a chunk of value column ``j``."""
        return f"aggregate {self.name!r}: a chunk of {self._set_columns[j][0]!r}"

    @staticmethod
    def _batch_rows(
        rows: pa.Table, column: str, owners: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch's rows with a non-null value of ``column``: (key index, value, weight)
        in row order (``owners``: each row's key)."""
        values = rows.column(column)
        valid = pc.is_valid(values).to_numpy(zero_copy_only=False)
        # Nulls filled first: to_numpy would turn an int64 array with nulls into float64.
        filled = pc.fill_null(pc.cast(pc.cast(values, plain_type(values.type)), pa.int64()), 0)
        return (
            owners[valid].astype(np.int64),
            filled.to_numpy(zero_copy_only=False)[valid],
            rows.column(WEIGHT).to_numpy()[valid],
        )

    def _merge_chunks(
        self,
        j: int,
        old: np.ndarray,
        new: np.ndarray,
        batch: tuple[np.ndarray, np.ndarray, np.ndarray],
        plan: _Chunks,
        zero: _Read,
        upper: _Read,
        key_array: pa.Array,
    ) -> tuple[_Extremes, _Extremes, StateChanges]:
        """Merge value column ``j``'s ``batch`` (:meth:`_batch_rows`) into the keys' chunks
        as ``plan`` says, and set the column's fields of the ``new`` records (copies of the
        ``old`` ones). ``zero``: every key's chunk 0 (aligned with ``key_array``), ``upper``:
        the chunks of level 1 and up ``plan`` reads. Returns the extremes before and after,
        and the chunks written and deleted."""
        n = len(key_array)
        one = np.uint64(1)
        levels = old[f"lv{j}"]
        if np.any(((levels & one) != 0) != (zero.sizes > 0)) or not np.all(upper.sizes):
            raise KernelError(
                f"{self._chunk_name(j)} is missing or where its record lists none: the store "
                "holds another state format, or is damaged"
            )
        # The chunks read: chunk 0 of the keys that read it, then the upper ones.
        zero_read = np.flatnonzero(plan.read & one)
        zero_owner = np.repeat(np.arange(n, dtype=np.int64), zero.sizes)
        used = ((plan.read & one) != 0)[zero_owner]
        b_owner, b_value, b_count = batch
        owner, value, count = _consolidated(
            np.concatenate([zero_owner[used], np.repeat(plan.owner, upper.sizes), b_owner]),
            np.concatenate([zero.pairs["v"][used], upper.pairs["v"], b_value]),
            np.concatenate([zero.pairs["m"][used], upper.pairs["m"], b_count]),
        )
        # The extremes: a full merge has them all; a key that only inserts has them from its
        # record's and the merge's (all of whose values are positive: not negative).
        before = _Extremes.stored(old, j)
        merged = _Extremes.of(owner, value, count, n)
        full = plan.full
        fast = (plan.target != 0) & ~full
        known_mn = np.where(before.has, before.mn, merged.mn)
        known_mx = np.where(before.has, before.mx, merged.mx)
        after = _Extremes(
            np.where(full, merged.has, before.has | fast),
            np.where(full, merged.mn, np.where(fast, np.minimum(known_mn, merged.mn), before.mn)),
            np.where(full, merged.mx, np.where(fast, np.maximum(known_mx, merged.mx), before.mx)),
        )
        new[f"mn{j}"], new[f"mx{j}"] = after.mn, after.mx
        negative = np.bincount(owner[count < 0], minlength=n) > 0
        was_negative = (old[f"fl{j}"] & _NEGATIVE) != 0
        new[f"fl{j}"] = after.has * _HAS + np.where(full, negative, was_negative) * _NEGATIVE
        # The chunks: each key's merge goes to its target level, unless empty; the chunks it
        # read go, but for the target's.
        sizes = np.bincount(owner, minlength=n)
        written = sizes > 0
        target = np.where(full & (sizes <= INLINE_VALUES), one, plan.target)
        new[f"lv{j}"] = (levels & ~plan.read) | np.where(written, target, np.uint64(0))
        # A target's old value: read (chunk 0 always is), or absent by lv (a carry upwards).
        replaced = (one << plan.level.astype(np.uint64)) == target[plan.owner]
        position = np.full(n, ABSENT, dtype=np.int64)
        position[plan.owner[replaced]] = upper.start + np.flatnonzero(replaced)
        position = np.where(target == one, zero.start + np.arange(n, dtype=np.int64), position)
        zero_gone = zero_read[~((target[zero_read] == one) & written[zero_read])]
        upper_gone = np.flatnonzero(~(replaced & written[plan.owner]))
        # The merged chunks, chunk 0's first (their keys are at hand), then those a carry
        # writes higher up (few).
        keys = np.flatnonzero(written)
        at_zero = target[keys] == one
        low, up = keys[at_zero], keys[~at_zero]
        element = np.empty(len(owner), _PAIR)
        element["v"], element["m"] = value, count
        lengths = sizes[np.concatenate([low, up])]
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if len(up):  # the merge has them in key order
            starts = np.cumsum(sizes) - sizes
            firsts = starts[np.concatenate([low, up])] - offsets[:-1]
            element = element[np.repeat(firsts, lengths) + np.arange(len(owner))]
        values = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(),
            len(keys),
            [None, pa.py_buffer(offsets * _PAIR.itemsize), pa.py_buffer(element)],
        )
        up_level = np.log2(target[up].astype(np.float64)).astype(np.int64)
        return (
            before,
            after,
            StateChanges.concat(
                [
                    StateChanges(
                        pa.concat_arrays(
                            [
                                _taken(zero.keys, low),
                                _chunk_keys(key_array, up, j, up_level),
                            ]
                        ),
                        values,
                        position[np.concatenate([low, up])],
                    ),
                    StateChanges(
                        pa.concat_arrays(
                            [
                                _taken(zero.keys, zero_gone),
                                _taken(upper.keys, upper_gone),
                            ]
                        ),
                        pa.nulls(len(zero_gone) + len(upper_gone), pa.large_binary()),
                        np.concatenate([zero.start + zero_gone, upper.start + upper_gone]),
                    ),
                ]
            ),
        )

    def _column_output(
        self, records: np.ndarray, i: int, exists: np.ndarray, extremes: list[_Extremes]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Agg ``i``'s output values and null mask for every record (columnar path), with
        ``extremes`` per value column."""
        kind = self._kinds[i]
        if kind == _COUNT_ALL:
            return records["n"], ~exists
        if kind == _MIN_MAX:
            column = extremes[self._value_column[self._columns[i]]]
            return column.mn if self._plain[i] else column.mx, ~exists | ~column.has
        c = records[f"c{i}"]
        if kind == _COUNT:
            return c, ~exists
        lo, hi = records[f"lo{i}"], records[f"hi{i}"]
        null = ~exists | (c <= 0)
        as_int = lo.view(np.int64)
        fits = (hi == np.where(as_int < 0, -1, 0)) | null
        if self.aggs[i].fn == "sum":
            if not fits.all():
                raise KernelError(f"aggregate {self.name!r}: a sum does not fit int64")
            return as_int, null
        # avg: an int64 below 2**53 in magnitude is exact as a double, so one IEEE division is
        # correctly rounded; anything larger is divided exactly in Python (rare).
        safe = fits & (np.abs(as_int) <= 2**53)
        with np.errstate(divide="ignore", invalid="ignore"):
            avg = as_int.astype(np.float64) / np.where(c == 0, 1, c)
        for j in np.flatnonzero(~safe & ~null):
            total = (int(hi[j]) << 64) + int(lo[j])
            avg[j] = total / int(c[j])
        return avg, null

    def _update(
        self,
        old: list[Any] | None,
        j: int,
        sums: dict[str, list[Any]],
        per_column: dict[str, list[list[tuple[Any, int]]]],
    ) -> list[Any]:
        if old is None:
            n, old_aggs, old_sets = 0, self._empty_aggs, {}
        else:
            n, old_aggs, old_sets = old
        n += sums["w"][j]
        new_aggs: list[Any] = []
        for i, kind in enumerate(self._kinds):
            st = old_aggs[i]
            if kind in (_COUNT_ALL, _MIN_MAX):
                new_aggs.append(None)
            elif kind == _COUNT:
                new_aggs.append(st + sums[self._count_sum[i]][j])
            elif kind == _INT_SUM:
                ds: Decimal | None = sums[self._product_sum[i]][j]
                new_aggs.append(
                    [
                        st[0] + (int(ds) if ds is not None else 0),
                        st[1] + sums[self._count_sum[i]][j],
                    ]
                )
            else:
                total = Fraction(st[0], st[1])
                nan, pinf, ninf = st[2], st[3], st[4]
                for value, w in per_column[self._columns[i]][j]:
                    if value != value:
                        nan += w
                    elif value == math.inf:
                        pinf += w
                    elif value == -math.inf:
                        ninf += w
                    else:
                        total += Fraction(value) * w
                c = st[5] + sums[self._count_sum[i]][j]
                new_aggs.append([total.numerator, total.denominator, nan, pinf, ninf, c])
        new_sets: dict[str, list[Any]] = {}
        for column, is_float in self._set_columns:
            flat = old_sets.get(column, [])
            entries = per_column[column][j]
            if entries:
                multiset: dict[Any, int] = {}
                for v, m in zip(flat[::2], flat[1::2], strict=True):
                    multiset[math.nan if v != v else v] = m
                for v, w in entries:
                    v = math.nan if v != v else v
                    multiset[v] = multiset.get(v, 0) + w
                items = [(v, m) for v, m in multiset.items() if m != 0]
                if is_float:
                    items.sort(key=_float_key)
                else:
                    items.sort()
                flat = [x for item in items for x in item]
            if flat:
                new_sets[column] = flat
        return [n, new_aggs, new_sets]

    def _is_empty(self, st: list[Any]) -> bool:
        return st[0] == 0 and st[1] == self._empty_aggs and not st[2]

    def _row(self, st: list[Any] | None) -> list[Any] | None:
        """The output values (aggregates only) of a key's state, or None without a row."""
        if st is None or st[0] <= 0:
            return None
        n, aggs, sets = st
        row: list[Any] = []
        for kind, column, plain, a in zip(
            self._kinds, self._columns, self._plain, aggs, strict=True
        ):
            if kind == _COUNT_ALL:
                row.append(n)
            elif kind == _COUNT:
                row.append(a)
            elif kind == _MIN_MAX:
                # plain: min (scan up from the smallest value), else max (scan down).
                flat = sets.get(column)
                value = None
                if flat:
                    positions = range(0, len(flat), 2) if plain else range(len(flat) - 2, -1, -2)
                    for p in positions:
                        if flat[p + 1] > 0:
                            value = flat[p]
                            break
                row.append(value)
            elif kind == _INT_SUM:
                s, c = a
                # plain: sum, else avg.
                row.append(None if c <= 0 else s if plain else s / c)
            else:
                num, den, nan, pinf, ninf, c = a
                if c <= 0:
                    row.append(None)
                elif nan > 0 or (pinf > 0 and ninf > 0):
                    row.append(math.nan)
                elif pinf > 0:
                    row.append(math.inf)
                elif ninf > 0:
                    row.append(-math.inf)
                else:
                    exact = Fraction(num, den)
                    row.append(float(exact if plain else exact / c))
        return row

    def _delta(
        self, key_columns: pa.Table, out_rows: list[list[Any]], out_w: list[int]
    ) -> pa.Table:
        arrays: list[Any] = list(key_columns.columns)
        columns = list(zip(*out_rows, strict=True)) if out_rows else [() for _ in self.aggs]
        try:
            for i, values in enumerate(columns):
                fld = self.output_schema.field(len(self.key) + i)
                arrays.append(arrays_from_plain(list(values), fld.type))
        except (OverflowError, pa.ArrowInvalid) as exc:
            raise KernelError(f"aggregate {self.name!r}: a result does not fit its type") from exc
        arrays.append(pa.array(out_w, type=pa.int64()))
        return pa.Table.from_arrays(arrays, schema=self.output_schema)
