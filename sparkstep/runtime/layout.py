"""Layouts: which state worker owns which shard, and the planner that changes W.

A layout is ``(epoch, W, shard -> worker)`` over a fixed number of shards ``S`` (key groups,
Flink's name; the seed's "fixed sharding"). A row's shard is ``pmod(xxhash64(key columns), S)``,
computed by Spark (:func:`shard_column`), so it never changes; a rescale only changes which
worker owns a shard, and the state of a shard moves as a whole.

Invariants of every :class:`Layout`:

- ``owners[shard]`` is in ``0..W`` for every shard in ``0..S``; workers are numbered densely, so a
  layout at W has exactly the workers ``0..W`` (a scale-in retires the highest ids).
- Balanced: every worker owns ``S // W`` or ``S // W + 1`` shards (within one of ``S/W``).
  This needs ``1 <= W <= S``.

:func:`plan_rescale` moves the fewest shards possible from *whatever the current assignment is*
(not from a fresh layout at the old W; after several rescales the assignment is no longer
contiguous). Why it is optimal: a worker that survives keeps at most ``min(current, target)`` of
its shards, a new worker keeps none and a retired worker keeps none, so ``S - sum(min(c, t))`` is
a lower bound on the shards that must move for given targets ``t``; the targets are fixed up to
which workers get the ``S % W`` extra shards, and giving the extras to the surviving workers that
own the most shards maximises the sum (an exchange argument: swapping an extra from a larger
owner to a smaller one never raises ``min(c, t)`` summed). The planner then moves exactly that
many shards: each surviving worker keeps ``min(c, t)`` of its own shards and the freed shards
fill the workers below their target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkstep.errors import ConfigError
from sparkstep.ids import LayoutEpoch, ShardId, WorkerId

if TYPE_CHECKING:
    from pyspark.sql import Column

__all__ = [
    "DEFAULT_SHARDS",
    "Layout",
    "Move",
    "check_worker_count",
    "initial_layout",
    "plan_rescale",
    "shard_column",
]

DEFAULT_SHARDS = 256


@dataclass(frozen=True)
class Move:
    """One shard changing owner in a rescale."""

    shard: ShardId
    source: WorkerId
    target: WorkerId


@dataclass(frozen=True)
class Layout:
    """``(epoch, W, shard -> worker)``; see the module docstring for the invariants."""

    epoch: LayoutEpoch
    workers: int
    owners: tuple[WorkerId, ...]

    def __post_init__(self) -> None:
        shards = len(self.owners)
        check_worker_count(self.workers, shards)
        counts = self.shard_counts()
        if any(not 0 <= w < self.workers for w in self.owners):
            raise ConfigError(f"layout epoch {self.epoch} names a worker outside 0..{self.workers}")
        low = shards // self.workers
        if min(counts) < low or max(counts) > low + (shards % self.workers > 0):
            raise ConfigError(
                f"layout epoch {self.epoch} is unbalanced: shards per worker {counts}, "
                f"expected {low} or {low + 1}"
            )

    @property
    def shards(self) -> int:
        """S, the number of shards."""
        return len(self.owners)

    def shard_counts(self) -> list[int]:
        """Shards owned by each worker, indexed by worker."""
        counts = [0] * self.workers
        for owner in self.owners:
            counts[owner] += 1
        return counts

    def shards_of(self, worker: WorkerId) -> list[ShardId]:
        """The shards ``worker`` owns, ascending."""
        return [ShardId(s) for s, owner in enumerate(self.owners) if owner == worker]

    def moves_to(self, other: Layout) -> list[Move]:
        """The shards whose owner differs in ``other``, ascending by shard."""
        if other.shards != self.shards:
            raise ConfigError(f"layouts over {self.shards} and {other.shards} shards")
        return [
            Move(ShardId(s), a, b)
            for s, (a, b) in enumerate(zip(self.owners, other.owners, strict=True))
            if a != b
        ]

    def to_json(self) -> str:
        """A stable JSON form, stored in the manifest and in every store."""
        return json.dumps(
            {"epoch": self.epoch, "workers": self.workers, "owners": list(self.owners)},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        data = json.loads(text)
        return cls(
            epoch=LayoutEpoch(int(data["epoch"])),
            workers=int(data["workers"]),
            owners=tuple(WorkerId(int(w)) for w in data["owners"]),
        )


def check_worker_count(workers: int, shards: int) -> None:
    """Raise :class:`ConfigError` unless ``1 <= workers <= shards`` (every worker owns a shard)."""
    if not 1 <= workers <= shards:
        raise ConfigError(f"workers must be between 1 and S={shards}, not {workers}")


def initial_layout(shards: int, workers: int) -> Layout:
    """Epoch 0: worker ``w`` owns the contiguous shards ``[w*S//W, (w+1)*S//W)``."""
    check_worker_count(workers, shards)
    owners = tuple(WorkerId(s * workers // shards) for s in range(shards))
    return Layout(epoch=LayoutEpoch(0), workers=workers, owners=owners)


def _targets(counts: Sequence[int], shards: int, workers: int) -> list[int]:
    """Shards each new-layout worker should own: the extras go to the largest current owners."""
    low, extra = divmod(shards, workers)
    current = [counts[w] if w < len(counts) else 0 for w in range(workers)]
    # Largest current owners first; ties broken by worker id so the plan is deterministic.
    by_size = sorted(range(workers), key=lambda w: (-current[w], w))
    targets = [low] * workers
    for w in by_size[:extra]:
        targets[w] += 1
    return targets


def plan_rescale(current: Layout, workers: int) -> Layout:
    """The layout at ``workers`` that moves the fewest shards from ``current`` (epoch + 1).

    Each surviving worker keeps the lowest-numbered of its shards it is allowed to keep, so
    runs of shards stay contiguous where they were; freed shards go, in ascending order, to the
    lowest-numbered workers still below their target.
    """
    shards = current.shards
    check_worker_count(workers, shards)
    targets = _targets(current.shard_counts(), shards, workers)
    owners = list(current.owners)
    kept = [0] * workers
    freed: list[int] = []
    for shard, owner in enumerate(current.owners):
        if owner < workers and kept[owner] < targets[owner]:
            kept[owner] += 1
        else:
            freed.append(shard)
    receivers = (w for w in range(workers) for _ in range(targets[w] - kept[w]))
    for shard, receiver in zip(freed, receivers, strict=True):
        owners[shard] = WorkerId(receiver)
    # zip(strict=True): the freed shards are exactly the places below target, by construction.
    return Layout(epoch=LayoutEpoch(current.epoch + 1), workers=workers, owners=tuple(owners))


def shard_column(key_columns: Sequence[str], shards: int) -> Column:
    """``pmod(xxhash64(key columns), S)`` as a Spark column (JVM side, stable, no Python)."""
    from pyspark.sql import functions as F

    if not key_columns:
        raise ConfigError("a shard needs at least one key column")
    return F.pmod(F.xxhash64(*[F.col(c) for c in key_columns]), F.lit(shards)).cast("int")
