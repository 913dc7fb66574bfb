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

``entry_hash(k, v)`` (:data:`DIGEST_FORMAT` 2) is ``pair_hash(k, v)`` of
:mod:`sparkstep.hashing`, computed for a whole batch of entries at once with numpy
(:func:`entry_hashes`), no Python per entry. Format 1 (BLAKE2b per entry) is refused by the
worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from sparkstep.hashing import (
    MASK,
    U64,
    binary_layout,
    combine_hashes,
    hash_bytes,
    large_binary,
    padded,
    pair_hashes,
)

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

DIGEST_FORMAT = 2
"""The version of :func:`entry_hash` (part of the worker's state format)."""


def entry_hashes(keys: Sequence[bytes], values: Sequence[bytes | None]) -> U64:
    """``entry_hash(k, v)`` per pair, vectorised; an absent value (``None``) hashes to 0."""
    value_array = large_binary(values)
    out = pair_hashes(keys, value_array)
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
    hk = hash_bytes(keys) if key_hashes is None else key_hashes
    olds, news = large_binary(old), large_binary(new)
    before = combine_hashes(hk, hash_bytes(olds))
    after = combine_hashes(hk, hash_bytes(news))
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
    offsets, raw = binary_layout(large_binary(keys))
    prefix = padded(raw)[offsets[:-1, None] + np.arange(width)]
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
