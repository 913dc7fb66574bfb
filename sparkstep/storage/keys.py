"""State keys: a fixed-width shard prefix, so that a set of shards is a set of key ranges.

Every key of every user table starts with its shard as a **4-byte unsigned big-endian** integer
(:data:`SHARD_PREFIX_BYTES`). Big-endian makes byte order equal numeric order, so all keys of
shard ``s`` form the contiguous range ``[prefix(s), prefix(s + 1))`` and the keys of shards
``a..b`` the range ``[prefix(a), prefix(b + 1))``. Four bytes, not two: ``S`` is fixed when a
pipeline is created and 2 bytes would cap it at 65,536 to save 2 bytes per key, a bad trade for a
limit that can never be lifted without rewriting every store.

Shard export, import and drop (:meth:`sparkstep.storage.base.Database.export_shards` and
friends) rely on this rule; a key written without a prefix (shorter than 4 bytes) belongs to no
shard and is never exported or dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from sparkstep.ids import ShardId
from sparkstep.storage.errors import InvalidShardError

__all__ = [
    "MAX_SHARDS",
    "SHARD_PREFIX_BYTES",
    "shard_key",
    "shard_of",
    "shard_prefix",
    "shard_ranges",
]

SHARD_PREFIX_BYTES = 4
"""Width of the shard prefix of every state key, in bytes (unsigned, big-endian)."""

MAX_SHARDS = (1 << (8 * SHARD_PREFIX_BYTES)) - 1
"""Shards are numbered ``0 <= shard < MAX_SHARDS``; the largest prefix is kept free so that
every shard's range has an end bound (``prefix(shard + 1)``)."""


def _check(shard: int) -> None:
    if not 0 <= shard < MAX_SHARDS:
        raise InvalidShardError(f"shard {shard} is outside 0..{MAX_SHARDS - 1}")


def shard_prefix(shard: int) -> bytes:
    """The 4-byte prefix every key of ``shard`` starts with."""
    _check(shard)
    return shard.to_bytes(SHARD_PREFIX_BYTES, "big")


def shard_key(shard: int, key: bytes) -> bytes:
    """The state key of ``key`` in ``shard``: ``shard_prefix(shard) + key``."""
    _check(shard)
    return shard.to_bytes(SHARD_PREFIX_BYTES, "big") + key


def shard_of(key: bytes) -> ShardId:
    """The shard a state key belongs to (its first 4 bytes); the inverse of :func:`shard_key`."""
    if len(key) < SHARD_PREFIX_BYTES:
        raise InvalidShardError(f"key {key!r} is shorter than the {SHARD_PREFIX_BYTES}-byte prefix")
    return ShardId(int.from_bytes(key[:SHARD_PREFIX_BYTES], "big"))


def shard_ranges(shards: Iterable[int]) -> list[tuple[bytes, bytes]]:
    """The key ranges ``[begin, end)`` holding exactly the keys of ``shards``, ascending.

    Consecutive shards are merged into one range: shards ``a..b`` give
    ``(prefix(a), prefix(b + 1))``.
    """
    ordered = sorted(set(shards))
    for shard in ordered:
        _check(shard)
    ranges: list[tuple[bytes, bytes]] = []
    i = 0
    while i < len(ordered):
        first = last = ordered[i]
        while i + 1 < len(ordered) and ordered[i + 1] == last + 1:
            i += 1
            last = ordered[i]
        ranges.append((shard_prefix(first), (last + 1).to_bytes(SHARD_PREFIX_BYTES, "big")))
        i += 1
    return ranges
