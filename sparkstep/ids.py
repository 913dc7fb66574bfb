"""Named ids shared by every layer (the design's terms), so signatures say what an int means.

- :data:`Step`: one execution of the pipeline over a fixed slice of input; dense from 0, never
  reused.
- :data:`Version`: a committed state of a two-version store (seed 004: a new store has 0).
- :data:`WorkerId`: a state worker, ``0 <= w < W``.
- :data:`ShardId`: a key group, ``0 <= shard < S``; ``S`` is fixed when a pipeline is created.
- :data:`LayoutEpoch`: the number of a layout ``(epoch, W, shard -> worker)``; +1 per rescale.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["LayoutEpoch", "ShardId", "Step", "Version", "WorkerId"]

Step = NewType("Step", int)
Version = NewType("Version", int)
WorkerId = NewType("WorkerId", int)
ShardId = NewType("ShardId", int)
LayoutEpoch = NewType("LayoutEpoch", int)
