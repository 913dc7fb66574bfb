"""A fast 64-bit hash of byte strings, for many at once: the state and output digests' base.

For a byte string ``b`` of length ``L`` cut into little-endian 64-bit words ``w_0 .. w_{m-1}``
(the last one zero-padded; ``m >= 1``)::

    H(b) = fmix64(sum_j fmix64(w_j xor (j + 1) * K1)  xor  L * K2)          (mod 2**64)
    pair_hash(a, b) = fmix64(H(a) * K3 + H(b))

with ``fmix64`` MurmurHash3's 64-bit finaliser and a null (``None``) hashing as ``H = 0``.
:func:`hash_bytes` and :func:`pair_hashes` compute them for a whole batch with numpy, no Python
per value. A checksum against nondeterminism and misreading, not a cryptographic hash.

Users, each of whom names the version of what they store: the state digest
(:mod:`sparkstep.runtime.worker.digest`, an entry's hash is ``pair_hash(key, value)``) and the
output digest (:func:`sparkstep.io.encoding.output_digest`, a record's hash is
``pair_hash(key, value)``). This module imports nothing of sparkstep, so both layers use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "BLOCK_WORDS",
    "MASK",
    "U64",
    "binary_layout",
    "combine_hashes",
    "fmix64",
    "hash_bytes",
    "large_binary",
    "padded",
    "pair_hashes",
    "word_rows",
]

MASK = (1 << 64) - 1
U64 = npt.NDArray[np.uint64]
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_K3 = np.uint64(0x165667B19E3779F9)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def fmix64(x: U64) -> U64:
    """MurmurHash3's finaliser, element-wise (uint64 arithmetic wraps mod 2**64)."""
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


def large_binary(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """``values`` as a large_binary array (a list converted, another binary type cast)."""
    array = values if isinstance(values, pa.Array) else pa.array(values, type=pa.binary())
    if array.type != pa.large_binary():
        array = array.cast(pa.large_binary())
    return array


def padded(raw: memoryview | bytes) -> npt.NDArray[np.uint8]:
    """The values' bytes copied and padded with 8 zeros, so that a word read at any entry
    start stays inside the buffer."""
    data = np.zeros(len(raw) + 8, dtype=np.uint8)
    data[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return data


#: The words one block of :func:`hash_bytes` hashes (values are never split: a block holds at
#: least one value). A block's temporaries, a few arrays of this many uint64, stay in a core's
#: cache; hashing a batch of millions of words in one pass sent each numpy operation of
#: ``fmix64`` to memory and was 2.2-2.4x slower (3.2M words: 26 ms against 11 ms).
BLOCK_WORDS = 1 << 15


def hash_bytes(values: Sequence[bytes | None] | pa.Array) -> U64:
    """``H(b)`` of each byte string (see the module docstring); ``None`` hashes to 0.

    O(words) numpy work, a block of about :data:`BLOCK_WORDS` words at a time. When every value
    has the same length (fixed-width records, the keys of an integer key column) a block is one
    ``(n, words)`` matrix of little-endian words; when every length is a multiple of 8
    (multisets of 16-byte pairs) the data is read as the words it is; otherwise each word is
    read with one unaligned 8-byte load from a sliding-window view of the data, and only each
    value's last word is masked to its length.
    """
    array = large_binary(values)
    n = len(array)
    hashed = np.zeros(n, dtype=np.uint64)
    if n == 0:
        return hashed
    offsets, raw = binary_layout(array)
    lengths = np.diff(offsets)
    words = np.maximum((lengths + 7) // 8, 1)
    equal = not array.null_count and bool((lengths == lengths[0]).all())
    whole = not (lengths % 8).any()
    for a, b in _blocks(words):
        start, end = int(offsets[a]), int(offsets[b])
        if equal:
            hashed[a:b] = _hash_equal_lengths(raw[start:end], b - a, int(lengths[0]))
        elif whole:
            hashed[a:b] = _hash_whole_words(
                raw[start:end], offsets[a : b + 1] - start, lengths[a:b]
            )
        else:
            hashed[a:b] = _hash_any_lengths(
                padded(raw[start:end]), offsets[a:b] - start, lengths[a:b]
            )
    if array.null_count:
        hashed[~np.asarray(array.is_valid())] = 0
    return hashed


def _blocks(words: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """Consecutive ranges ``[a, b)`` of the values (at least one), whose ``words`` add up to
    about :data:`BLOCK_WORDS` each (a value longer than that is a block of its own)."""
    n = len(words)
    ends = np.cumsum(words)
    cuts = np.searchsorted(ends, np.arange(BLOCK_WORDS, int(ends[-1]), BLOCK_WORDS), side="right")
    bounds = np.unique(np.concatenate([[0], cuts, [n]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def word_rows(raw: memoryview | bytes, n: int, length: int) -> npt.NDArray[np.uint8]:
    """The ``n`` values of ``length`` bytes each laid one after another in ``raw``, as an
    ``(n, 8 * words)`` byte matrix: each value a row, zero-padded to whole 8-byte words (at
    least one), to be viewed as words of either byte order."""
    words = max((length + 7) // 8, 1)
    matrix = np.zeros((n, words * 8), dtype=np.uint8)
    matrix[:, :length] = np.frombuffer(raw, dtype=np.uint8, count=n * length).reshape(n, length)
    return matrix


def _hash_equal_lengths(raw: memoryview | bytes, n: int, length: int) -> U64:
    """``H`` of ``n`` values of ``length`` bytes each, laid one after another in ``raw``."""
    matrix = word_rows(raw, n, length).view("<u8")
    salt = np.arange(1, matrix.shape[1] + 1, dtype=np.uint64) * _K1
    sums = fmix64(matrix ^ salt).sum(axis=1, dtype=np.uint64)
    return fmix64(sums ^ np.uint64((length * int(_K2)) & MASK))


_EMPTY_SUM = fmix64(np.array([_K1], dtype=np.uint64))[0]
"""The word sum of an empty value: one word of zeros at position 1."""


def _hash_whole_words(
    raw: memoryview | bytes, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> U64:
    """``H`` of values whose lengths are all multiples of 8 (a min/max multiset of 16-byte
    pairs; empty and null values too): the data is its words as they lie, so nothing is
    gathered, padded or masked; an empty value adds its one word of zeros as a constant."""
    full = np.flatnonzero(lengths)
    sums = np.full(len(lengths), _EMPTY_SUM, dtype=np.uint64)
    if len(full):
        words = np.frombuffer(raw, dtype="<u8")
        first = offsets[:-1][full] // 8
        position = np.arange(1, len(words) + 1, dtype=np.int64)
        position -= np.repeat(first, lengths[full] // 8)
        mixed = fmix64(words ^ (position.astype(np.uint64) * _K1))
        sums[full] = np.add.reduceat(mixed, first)
    return fmix64(sums ^ (lengths.astype(np.uint64) * _K2))


def _hash_any_lengths(
    data: npt.NDArray[np.uint8], start: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> U64:
    """``H`` of the values at ``start`` with ``lengths`` in ``data`` (padded with 8 zeros)."""
    words = np.maximum((lengths + 7) // 8, 1)
    word_start = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(words, out=word_start[1:])
    total_words = int(word_start[-1])
    position = np.arange(total_words, dtype=np.int64) - np.repeat(word_start[:-1], words)
    windows = np.ndarray(shape=(len(data) - 7,), dtype="<u8", buffer=data, strides=(1,))
    word = windows[np.repeat(start, words) + position * 8]
    # The bytes of a value's last word past its end read as zero (a value of length 0 is one
    # word of zeros).
    tail = (lengths - (words - 1) * 8).astype(np.uint64)
    last = word_start[1:] - 1
    word[last] &= np.where(
        tail >= 8, np.uint64(MASK), (np.uint64(1) << (tail * np.uint64(8))) - np.uint64(1)
    )
    mixed = fmix64(word ^ ((position + 1).astype(np.uint64) * _K1))
    sums = np.add.reduceat(mixed, word_start[:-1]).astype(np.uint64)
    return fmix64(sums ^ (lengths.astype(np.uint64) * _K2))


def combine_hashes(firsts: U64, seconds: U64) -> U64:
    """``pair_hash`` from the two halves' ``H``: ``fmix64(firsts * K3 + seconds)``."""
    return fmix64(firsts * _K3 + seconds)


def pair_hashes(
    firsts: Sequence[bytes | None] | pa.Array, seconds: Sequence[bytes | None] | pa.Array
) -> U64:
    """``pair_hash(a, b)`` of each pair of ``firsts`` and ``seconds`` (aligned)."""
    return combine_hashes(hash_bytes(firsts), hash_bytes(seconds))


def binary_layout(values: pa.Array) -> tuple[np.ndarray, memoryview | bytes]:
    """The ``len + 1`` int64 offsets of a binary or large_binary array (rebased to start at 0)
    and the bytes of its values, concatenated (zero-copy where Arrow allows)."""
    n = len(values)
    offset_type = np.int64 if pa.types.is_large_binary(values.type) else np.int32
    if n == 0:
        return np.zeros(1, dtype=np.int64), b""
    offsets = np.frombuffer(
        values.buffers()[1],
        dtype=offset_type,
        count=n + 1,
        offset=values.offset * np.dtype(offset_type).itemsize,
    ).astype(np.int64)
    start, end = int(offsets[0]), int(offsets[-1])
    raw = values.buffers()[2]
    data = memoryview(raw)[start:end] if raw is not None else b""
    return offsets - start, data
