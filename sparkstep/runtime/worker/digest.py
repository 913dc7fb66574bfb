"""The state digest: a cheap, incremental, order-independent hash of an operator's state.

For every shard ``s`` and operator table ``t`` the worker keeps, under the reserved key
``shard_prefix(s)`` (the bare prefix, which no kernel uses) of ``t``, the 8-byte big-endian value

    D(t, s) = sum over the entries (k, v) of shard s in t of entry_hash(k, v)   (mod 2**64)

with ``entry_hash`` the first 8 bytes of BLAKE2b over ``len(k) || k || v``. A sum is
commutative, so ``D`` is updated per put/delete with ``+ hash(new) - hash(old)`` in the same
``db.write`` as the change, and it never needs a scan of the state. It lives inside the shard's
key range, so it moves with the shard on export/import/drop. The digest an ``apply`` reports is
the operator's total over all shards the worker holds, ``sum_s D(t, s) mod 2**64``, as 16 hex
digits: the worker computes it from the ``S`` shard records once per open (and after an import
or a drop) and then keeps it up to date in memory.
"""

from __future__ import annotations

import hashlib

__all__ = [
    "MASK",
    "digest_value",
    "entry_hash",
    "format_digest",
    "read_digest_value",
]

MASK = (1 << 64) - 1


def entry_hash(key: bytes, value: bytes) -> int:
    """The 64-bit hash of one state entry."""
    data = b"".join((len(key).to_bytes(4, "big"), key, value))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def digest_value(digest: int) -> bytes:
    """The stored form of a shard digest (8 bytes, big-endian)."""
    return (digest & MASK).to_bytes(8, "big")


def read_digest_value(raw: bytes | None) -> int:
    """The inverse of :func:`digest_value`; an absent record is 0 (an empty shard)."""
    return 0 if raw is None else int.from_bytes(raw, "big")


def format_digest(digest: int) -> str:
    """The digest as reported by ``apply`` and written to the step log: 16 hex digits."""
    return f"{digest & MASK:016x}"
