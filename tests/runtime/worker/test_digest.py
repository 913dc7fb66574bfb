"""The entry hash of digest format 2 against a plain-Python reading of its definition (the
``digest`` module docstring): the vectorised ``hash_bytes`` must never drift from it, or every
store's digests would change meaning without a format change."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from sparkstep import hashing
from sparkstep.runtime.worker import digest
from sparkstep.runtime.worker.digest import MASK, entry_hashes, hash_bytes, shard_sums

K1, K2, K3 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    return x ^ (x >> 33)


def reference_hash(b: bytes) -> int:
    """``H(b)`` word by word, as the module docstring defines it."""
    words = max((len(b) + 7) // 8, 1)
    padded = b + bytes(8 * words - len(b))
    total = 0
    for j in range(words):
        word = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        total = (total + fmix64(word ^ (((j + 1) * K1) & MASK))) & MASK
    return fmix64(total ^ ((len(b) * K2) & MASK))


def _random_bytes(rng: np.random.Generator, length: int) -> bytes:
    return rng.integers(0, 256, length, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 16, 40, 63])
def test_hash_bytes_of_equal_lengths_is_the_definition(length: int) -> None:
    rng = np.random.default_rng(length)
    values = [_random_bytes(rng, length) for _ in range(50)]
    assert hash_bytes(values).tolist() == [reference_hash(v) for v in values]


def test_hash_bytes_of_mixed_lengths_nulls_and_slices_is_the_definition() -> None:
    rng = np.random.default_rng(3)
    values: list[bytes | None] = [
        None if i % 11 == 0 else _random_bytes(rng, int(rng.integers(0, 70))) for i in range(300)
    ]
    expected = [0 if v is None else reference_hash(v) for v in values]
    assert hash_bytes(values).tolist() == expected
    for kind in (pa.binary(), pa.large_binary()):
        array = pa.array(values, kind)
        assert hash_bytes(array.slice(17, 200)).tolist() == expected[17:217]
    uniform = pa.array([_random_bytes(rng, 12) for _ in range(40)], pa.binary()).slice(5, 30)
    assert hash_bytes(uniform).tolist() == [reference_hash(v) for v in uniform.to_pylist()]


def test_hash_bytes_of_whole_words_is_the_definition() -> None:
    """Lengths all multiples of 8 (a multiset's pairs), empty values and nulls among them,
    sliced, and a null slot that holds bytes (Arrow allows it)."""
    rng = np.random.default_rng(5)
    values: list[bytes | None] = [
        None if i % 13 == 0 else _random_bytes(rng, 8 * int(rng.integers(0, 9))) for i in range(200)
    ]
    expected = [0 if v is None else reference_hash(v) for v in values]
    assert hash_bytes(values).tolist() == expected
    for kind in (pa.binary(), pa.large_binary()):
        array = pa.array(values, kind)
        assert hash_bytes(array.slice(3, 150)).tolist() == expected[3:153]
    data = _random_bytes(rng, 40)
    offsets = np.array([0, 16, 32, 40], dtype=np.int32)  # the middle slot null, with 16 bytes
    padded = pa.BinaryArray.from_buffers(
        pa.binary(),
        3,
        [
            pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes()),
            pa.py_buffer(offsets.tobytes()),
            pa.py_buffer(data),
        ],
    )
    assert hash_bytes(padded).tolist() == [reference_hash(data[:16]), 0, reference_hash(data[32:])]


@pytest.mark.parametrize("block_words", [1, 3, 8])
def test_hash_bytes_in_blocks_is_the_definition(
    monkeypatch: pytest.MonkeyPatch, block_words: int
) -> None:
    """Hashed a few words at a time (values longer than a block among them), each kind of
    batch hashes as in one pass: the blocks' bounds change nothing."""
    monkeypatch.setattr(hashing, "BLOCK_WORDS", block_words)
    rng = np.random.default_rng(block_words)
    batches: list[list[bytes | None]] = [
        [_random_bytes(rng, 20) for _ in range(40)],  # equal lengths
        [_random_bytes(rng, 0) for _ in range(10)],  # equal lengths, empty
        [  # whole words, empty values and nulls among them
            None if i % 7 == 0 else _random_bytes(rng, 8 * int(rng.integers(0, 6)))
            for i in range(60)
        ],
        [  # any lengths and nulls
            None if i % 5 == 0 else _random_bytes(rng, int(rng.integers(0, 50))) for i in range(60)
        ],
    ]
    for values in batches:
        expected = [0 if v is None else reference_hash(v) for v in values]
        assert hash_bytes(values).tolist() == expected
        assert hash_bytes(pa.array(values, pa.binary()).slice(3)).tolist() == expected[3:]


def test_entry_hash_is_the_definition() -> None:
    rng = np.random.default_rng(4)
    keys = [_random_bytes(rng, int(rng.integers(1, 30))) for _ in range(50)]
    values = [_random_bytes(rng, int(rng.integers(0, 30))) for _ in range(50)]
    expected = [
        fmix64((reference_hash(k) * K3 + reference_hash(v)) & MASK)
        for k, v in zip(keys, values, strict=True)
    ]
    assert entry_hashes(keys, values).tolist() == expected


def _reference_sums(keys: list[bytes], deltas: list[int], width: int) -> dict[bytes, int]:
    sums: dict[bytes, int] = {}
    for key, delta in zip(keys, deltas, strict=True):
        sums[key[:width]] = (sums.get(key[:width], 0) + delta) & MASK
    return sums


@pytest.mark.parametrize("chunk", [None, 7])
def test_shard_sums_are_the_sums_mod_2_64_of_each_shards_deltas(
    chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deltas near 2**64 in a shard with many keys: float64 counts stay exact, halves carry.
    With chunks of 7 keys the sums also cross chunks (what a batch of 2**20 keys does)."""
    if chunk is not None:
        monkeypatch.setattr(digest, "_EXACT_TERMS", chunk)
    rng = np.random.default_rng(5)
    shards = [0, 1, 255, 65_535, 65_535, 3] * 20
    keys = [s.to_bytes(4, "big") + _random_bytes(rng, int(rng.integers(0, 12))) for s in shards]
    deltas = [MASK - int(d) for d in rng.integers(0, 1 << 40, len(keys))]
    deltas[:7] = [MASK] * 7
    found = shard_sums(pa.array(keys, pa.binary()), np.array(deltas, np.uint64), 4, 65_536)
    assert found == _reference_sums(keys, deltas, 4)
    assert shard_sums([], np.zeros(0, np.uint64), 4, 1) == {}


def test_shard_sums_refuse_a_prefix_that_is_no_shard() -> None:
    with pytest.raises(ValueError, match="not a shard below 256"):
        shard_sums([(256).to_bytes(4, "big") + b"k"], np.ones(1, np.uint64), 4, 256)
