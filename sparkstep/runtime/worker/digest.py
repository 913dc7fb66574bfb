"""The state digest: a cheap, incremental, order-independent hash of an operator's state.

For every shard ``s`` and operator table ``t`` the worker keeps, under the reserved key
``shard_prefix(s)`` (the bare prefix, which no kernel uses) of ``t``, the 8-byte big-endian value

    D(t, s) = sum over the entries (k, v) of shard s in t of entry_hash(k, v)   (mod 2**64)

A sum is commutative, so ``D`` is updated per put/delete with ``+ hash(new) - hash(old)`` in the
same write as the change (:mod:`.buffer`), and it never needs a scan of the state. It lives
inside the shard's key range, so it moves with the shard on export/import/drop. The digest an
``apply`` reports is the operator's total over all shards the worker holds, ``sum_s D(t, s)
mod 2**64``, as 16 hex digits: the worker computes it from the ``S`` shard records once per
open (and after an import or a drop) and then keeps it up to date in memory. The total of a set
of shards does not depend on which worker holds them, so a rescale keeps ``sum over workers``
unchanged.

``entry_hash`` (:data:`DIGEST_FORMAT` 2) is computed for a whole batch of entries at once with
numpy (:func:`entry_hashes`), no Python per entry: for a byte string ``b`` of length ``L`` cut
into little-endian 64-bit words ``w_0 .. w_{m-1}`` (the last one zero-padded; ``m >= 1``)::

    H(b) = fmix64(sum_j fmix64(w_j xor (j + 1) * K1)  xor  L * K2)          (mod 2**64)
    entry_hash(k, v) = fmix64(H(k) * K3 + H(v))

with ``fmix64`` MurmurHash3's 64-bit finaliser. It is a checksum against nondeterminism and
misreading, not a cryptographic hash. Format 1 (BLAKE2b per entry) is refused by the worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from sparkstep.runtime.operators.base import binary_layout

__all__ = [
    "DIGEST_FORMAT",
    "MASK",
    "digest_value",
    "entry_hash",
    "entry_hash_deltas",
    "entry_hashes",
    "format_digest",
    "hash_bytes",
    "read_digest_value",
    "shard_sums",
]

MASK = (1 << 64) - 1
DIGEST_FORMAT = 2
"""The version of :func:`entry_hash` (part of the worker's state format)."""

U64 = npt.NDArray[np.uint64]
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_K3 = np.uint64(0x165667B19E3779F9)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def _fmix64(x: U64) -> U64:
    """MurmurHash3's finaliser, element-wise (uint64 arithmetic wraps mod 2**64)."""
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


def _binary(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    array = values if isinstance(values, pa.Array) else pa.array(values, type=pa.binary())
    if array.type != pa.large_binary():
        array = array.cast(pa.large_binary())
    return array


def _padded(raw: memoryview | bytes) -> npt.NDArray[np.uint8]:
    """The values' bytes copied and padded with 8 zeros, so that a word read at any entry
    start stays inside the buffer."""
    data = np.zeros(len(raw) + 8, dtype=np.uint8)
    data[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return data


def hash_bytes(values: Sequence[bytes | None] | pa.Array) -> U64:
    """``H(b)`` of each byte string (see the module docstring); ``None`` hashes to 0.

    O(words) numpy work. When every value has the same length (fixed-width records, the keys of
    an integer key column) the values are one ``(n, words)`` matrix of little-endian words;
    when every length is a multiple of 8 (multisets of 16-byte pairs) the data is read as the
    words it is; otherwise each word is read with one unaligned 8-byte load from a
    sliding-window view of the data, and only each value's last word is masked to its length.
    """
    array = _binary(values)
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    offsets, raw = binary_layout(array)
    lengths = np.diff(offsets)
    if not array.null_count and (lengths == lengths[0]).all():
        hashed = _hash_equal_lengths(raw, n, int(lengths[0]))
    elif not (lengths % 8).any():
        hashed = _hash_whole_words(raw, offsets, lengths)
    else:
        hashed = _hash_any_lengths(_padded(raw), offsets[:-1], lengths)
    if array.null_count:
        hashed[~np.asarray(array.is_valid())] = 0
    return hashed


def _hash_equal_lengths(raw: memoryview | bytes, n: int, length: int) -> U64:
    """``H`` of ``n`` values of ``length`` bytes each, laid one after another in ``raw``."""
    words = max((length + 7) // 8, 1)
    matrix = np.zeros((n, words * 8), dtype=np.uint8)
    matrix[:, :length] = np.frombuffer(raw, dtype=np.uint8, count=n * length).reshape(n, length)
    salt = np.arange(1, words + 1, dtype=np.uint64) * _K1
    sums = _fmix64(matrix.view("<u8") ^ salt).sum(axis=1, dtype=np.uint64)
    return _fmix64(sums ^ np.uint64((length * int(_K2)) & MASK))


_EMPTY_SUM = _fmix64(np.array([_K1], dtype=np.uint64))[0]
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
        mixed = _fmix64(words ^ (position.astype(np.uint64) * _K1))
        sums[full] = np.add.reduceat(mixed, first)
    return _fmix64(sums ^ (lengths.astype(np.uint64) * _K2))


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
    mixed = _fmix64(word ^ ((position + 1).astype(np.uint64) * _K1))
    sums = np.add.reduceat(mixed, word_start[:-1]).astype(np.uint64)
    return _fmix64(sums ^ (lengths.astype(np.uint64) * _K2))


def entry_hashes(keys: Sequence[bytes], values: Sequence[bytes | None]) -> U64:
    """``entry_hash(k, v)`` per pair, vectorised; an absent value (``None``) hashes to 0."""
    value_array = _binary(values)
    out = _fmix64(hash_bytes(keys) * _K3 + hash_bytes(value_array))
    if value_array.null_count:
        out[~np.asarray(value_array.is_valid())] = 0
    return out


def entry_hash_deltas(
    keys: Sequence[bytes] | pa.Array,
    old: Sequence[bytes | None] | pa.Array,
    new: Sequence[bytes | None] | pa.Array,
    key_hashes: U64 | None = None,
) -> U64:
    """``entry_hash(k, new) - entry_hash(k, old)`` per key mod 2**64 (``None``: no entry);
    ``key_hashes``: ``hash_bytes(keys)``, when the caller has it."""
    if not len(keys):
        return np.zeros(0, dtype=np.uint64)
    hk = (hash_bytes(keys) if key_hashes is None else key_hashes) * _K3
    olds, news = _binary(old), _binary(new)
    before = _fmix64(hk + hash_bytes(olds))
    after = _fmix64(hk + hash_bytes(news))
    if olds.null_count:
        before[~np.asarray(olds.is_valid())] = 0
    if news.null_count:
        after[~np.asarray(news.is_valid())] = 0
    return after - before


def entry_hash(key: bytes, value: bytes) -> int:
    """The 64-bit hash of one state entry (:func:`entry_hashes` of one pair)."""
    return int(entry_hashes([key], [value])[0])


def shard_sums(
    keys: Sequence[bytes] | pa.Array, deltas: U64, width: int, shards: int
) -> dict[bytes, int]:
    """``shard prefix -> sum of the deltas of its keys mod 2**64``: the ``width``-byte prefixes
    of ``keys`` (each at least ``width`` long), ``deltas`` aligned with ``keys``. Every prefix,
    read as a big-endian integer, is a shard below ``shards`` (else ValueError); the shards
    no key falls in are left out.

    No sort: a shard's sum is the sum of its deltas' low and high 32-bit halves, each added up
    by ``np.bincount`` in float64, which is exact for fewer than 2**21 terms of under 2**32
    (a chunk of :data:`_EXACT_TERMS` keys at a time). Sorting the keys by shard to add them
    with ``np.add.reduceat`` took four times as long (5 ms for 100k changes).
    """
    n = len(keys)
    if n == 0:
        return {}
    offsets, raw = binary_layout(_binary(keys))
    prefix = _padded(raw)[offsets[:-1, None] + np.arange(width)]
    shard = np.zeros(n, dtype=np.int64)
    for column in range(width):
        shard = (shard << 8) | prefix[:, column]
    if int(shard.max()) >= shards:
        raise ValueError(f"a key's prefix {int(shard.max())} is not a shard below {shards}")
    low = np.zeros(shards, dtype=np.uint64)
    high = np.zeros(shards, dtype=np.uint64)
    for start in range(0, n, _EXACT_TERMS):
        part, moved = shard[start : start + _EXACT_TERMS], deltas[start : start + _EXACT_TERMS]
        low += np.bincount(part, (moved & _LOW).astype(np.float64), shards).astype(np.uint64)
        high += np.bincount(part, (moved >> _S32).astype(np.float64), shards).astype(np.uint64)
    totals = (high << _S32) + low
    return {
        s.to_bytes(width, "big"): int(totals[s])
        for s in np.flatnonzero(np.bincount(shard, minlength=shards)).tolist()
    }


#: The most 32-bit terms :func:`shard_sums` adds in one float64 ``bincount`` (exact below 2**21).
_EXACT_TERMS = 1 << 20
_LOW = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def digest_value(digest: int) -> bytes:
    """The stored form of a shard digest (8 bytes, big-endian)."""
    return (digest & MASK).to_bytes(8, "big")


def read_digest_value(raw: bytes | None) -> int:
    """The inverse of :func:`digest_value`; an absent record is 0 (an empty shard)."""
    return 0 if raw is None else int.from_bytes(raw, "big")


def format_digest(digest: int) -> str:
    """The digest as reported by ``apply`` and written to the step log: 16 hex digits."""
    return f"{digest & MASK:016x}"
