"""``state_keys`` builds exactly the bytes of the per-row key encoding, fast path or not."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sparkstep.runtime.operators.base import encode_value, shard_prefix, state_keys, to_plain

COLUMNS = {
    "int32 range": pa.array([0, -1, 2**31 - 1, -(2**31), 7], pa.int64()),
    "beyond int32": pa.array([0, 2**31, -(2**40), 5, 6], pa.int64()),
    "uint8": pa.array([0, 1, 255, 3, 4], pa.uint8()),
    "strings": pa.array(["", "a", "é€𝄞", "x" * 300, "k"], pa.string()),
    "large strings": pa.array(["", "b", "ü", "y" * 70, "k"], pa.large_string()),
    "with a null": pa.array([1, None, 3, 4, 5], pa.int64()),
    "timestamps": pa.array([0, 1, 2, 3, 4], pa.timestamp("us")),
    "bools": pa.array([True, False, True, True, False]),
}


@pytest.mark.parametrize(
    "names",
    [[name] for name in COLUMNS] + [["int32 range", "strings"], ["strings", "beyond int32"]],
)
def test_state_keys_equal_the_per_row_encoding(names: list[str]) -> None:
    shards = pa.array([0, 1, 255, 70000, 3], pa.int64())
    columns = [COLUMNS[n] for n in names]
    plain = [to_plain(c) for c in columns]
    expected = [
        shard_prefix(s, 4) + encode_value(list(values))
        for s, *values in zip(shards.to_pylist(), *plain, strict=True)
    ]
    assert state_keys(shards, columns, 4).to_pylist() == expected
    chunked = [pa.chunked_array([c.slice(0, 2), c.slice(2)]) for c in columns]
    assert state_keys(pa.chunked_array([shards]), chunked, 4).to_pylist() == expected
