"""The keys a worker's applies changed in some shards: what a hot rescale ships at its catch-up.

A hot rescale (``runtime/rescale.py``) copies the moving shards while the pipeline runs, then
pauses and ships only what changed since the copy began. The source worker learns what changed
from a :class:`ChangeTracker`, started (:meth:`StateWorker.track
<sparkstep.runtime.worker.service.StateWorker.track>`) before the copy reads anything.

Invariant (what makes base copy + deltas equal the state at the pause): every write of an
apply is recorded AFTER it is in the worker's state (its write buffer, :mod:`.buffer`), and
recording and :meth:`ChangeTracker.take` hold the same lock (the worker's ``db_lock``); the
take, like the live export's base copy, first flushes the buffer into the database under that
lock. So a key written after a take is recorded in the tracker's next set, and a key a take
returns had its write in the database before the take: reading its value after the take sees
that write or a later one, and a later one is in the next set. A key never written since
tracking began has, in any read of the database made after tracking began and the flush, the
value it has at the pause.

The tracker lives in memory, for one open database: a reopen, commit or close ends it. That is
enough: a crash of the worker or the runtime kills the rescale (every process is killed and the
pipeline recovers), and no checkpoint runs during a rescale.
"""

from __future__ import annotations

from collections.abc import Iterable

from sparkstep.storage.keys import SHARD_PREFIX_BYTES, shard_prefix

__all__ = ["ChangeTracker"]


class ChangeTracker:
    """The keys of ``shards`` written since it began (or since the last :meth:`take` of them),
    per table. Not thread-safe on its own: the worker calls it under its ``db_lock``."""

    def __init__(self, shards: Iterable[int]) -> None:
        self.shards = frozenset(int(s) for s in shards)
        self._prefixes = frozenset(shard_prefix(s) for s in self.shards)
        self._changed: dict[str, set[bytes]] = {}

    def record(self, table: str, keys: Iterable[bytes]) -> None:
        """Note the keys of tracked shards among ``keys`` (just written to ``table``)."""
        prefixes = self._prefixes
        mine = {k for k in keys if k[:SHARD_PREFIX_BYTES] in prefixes}
        if mine:
            self._changed.setdefault(table, set()).update(mine)

    def count(self, shards: Iterable[int] | None = None) -> int:
        """How many keys (of ``shards``, default all tracked) are recorded now."""
        if shards is None:
            return sum(len(keys) for keys in self._changed.values())
        prefixes = {shard_prefix(s) for s in shards}
        return sum(
            1 for keys in self._changed.values() for k in keys if k[:SHARD_PREFIX_BYTES] in prefixes
        )

    def take(self, shards: Iterable[int]) -> dict[str, set[bytes]]:
        """Remove and return the recorded keys of ``shards`` (table -> keys); they are recorded
        again when written again. ``shards`` must be tracked (``ValueError`` otherwise)."""
        wanted = frozenset(int(s) for s in shards)
        if not wanted <= self.shards:
            raise ValueError(f"shards {sorted(wanted - self.shards)[:10]} are not tracked")
        prefixes = {shard_prefix(s) for s in wanted}
        taken: dict[str, set[bytes]] = {}
        for table, keys in self._changed.items():
            mine = {k for k in keys if k[:SHARD_PREFIX_BYTES] in prefixes}
            if mine:
                keys -= mine
                taken[table] = mine
        self._changed = {t: keys for t, keys in self._changed.items() if keys}
        return taken
