"""The layout planner: balanced, and moving the fewest shards from history-dependent layouts."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession

from sparkstep.errors import ConfigError
from sparkstep.ids import WorkerId
from sparkstep.runtime.layout import Layout, initial_layout, plan_rescale, shard_column


def _minimum_moves(current: Layout, workers: int) -> int:
    """Brute force, independent of the planner: over every choice of which workers get the
    S % N extra shards, the most shards that can stay put; S minus that must move."""
    shards = current.shards
    low, extra = divmod(shards, workers)
    counts = current.shard_counts()
    kept_best = 0
    for lucky in combinations(range(workers), extra):
        kept = sum(
            min(counts[w] if w < current.workers else 0, low + (w in lucky)) for w in range(workers)
        )
        kept_best = max(kept_best, kept)
    return shards - kept_best


def test_initial_layout_is_contiguous_and_balanced() -> None:
    layout = initial_layout(10, 3)
    assert layout.owners == (0, 0, 0, 0, 1, 1, 1, 2, 2, 2)
    assert layout.shard_counts() == [4, 3, 3]
    assert Layout.from_json(layout.to_json()) == layout


@settings(max_examples=60, deadline=None)
@given(
    shards=st.sampled_from([16, 24, 37, 64]),
    history=st.lists(st.integers(1, 16), min_size=1, max_size=8),
)
def test_rescales_from_any_history_are_balanced_and_minimal(
    shards: int, history: list[int]
) -> None:
    layout = initial_layout(shards, min(history[0], shards))
    for workers in history[1:]:
        workers = min(workers, shards)
        new = plan_rescale(layout, workers)
        assert new.epoch == layout.epoch + 1
        assert new.workers == workers
        counts = new.shard_counts()
        assert max(counts) - min(counts) <= 1
        assert len(layout.moves_to(new)) == _minimum_moves(layout, workers)
        layout = new


def test_scale_out_by_one_moves_only_the_new_workers_share() -> None:
    layout = initial_layout(256, 4)
    new = plan_rescale(layout, 5)
    moves = layout.moves_to(new)
    assert {m.target for m in moves} == {4}
    assert len(moves) == len(new.shards_of(WorkerId(4))) == 51


def test_same_worker_count_moves_nothing() -> None:
    layout = plan_rescale(plan_rescale(initial_layout(64, 3), 5), 2)
    assert plan_rescale(layout, 2).owners == layout.owners


@pytest.mark.parametrize("workers", [0, 65])
def test_worker_count_outside_one_to_s_is_refused(workers: int) -> None:
    with pytest.raises(ConfigError, match="between 1 and S=64"):
        plan_rescale(initial_layout(64, 2), workers)


def test_unbalanced_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="unbalanced"):
        Layout.from_json('{"epoch": 3, "workers": 2, "owners": [0, 0, 0, 1]}')


def test_shard_column_is_spark_xxhash64_pmod(spark: SparkSession) -> None:
    df = spark.createDataFrame([("a", 1), ("b", 2), ("a", 3)], "key string, n long")
    rows = df.select("key", shard_column(["key"], 256).alias("shard")).collect()
    by_key = {r["key"]: r["shard"] for r in rows}
    assert all(0 <= s < 256 for s in by_key.values())
    assert len({r["shard"] for r in rows if r["key"] == "a"}) == 1
    # Stable across sessions and machines: Spark's xxhash64 with seed 42.
    expected = spark.sql("select pmod(xxhash64('a'), 256) as s").collect()[0]["s"]
    assert by_key["a"] == expected
