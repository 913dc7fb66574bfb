"""Stateful operator kernels over Arrow Z-sets, and their specs.

- :mod:`.base`: the kernel contract (:class:`~.base.Kernel`), key and row encoding.
- :mod:`.spec`: :class:`~.spec.OperatorSpec`, :class:`~.spec.Agg`, :func:`~.spec.fingerprint`.
- one module per kernel: :mod:`.aggregate`, :mod:`.distinct`, :mod:`.join`,
  :mod:`.stateful_map`, each documenting its state layout.

:func:`make_kernel` builds the kernel of a spec.
"""

from __future__ import annotations

from sparkstep.runtime.operators.aggregate import AggregateKernel
from sparkstep.runtime.operators.base import (
    ApplyContext,
    Kernel,
    KernelResult,
    StateChanges,
    StateReader,
)
from sparkstep.runtime.operators.distinct import DistinctKernel
from sparkstep.runtime.operators.join import JoinKernel
from sparkstep.runtime.operators.spec import (
    Agg,
    OperatorSpec,
    fingerprint,
    spec_from_wire,
    spec_to_wire,
)
from sparkstep.runtime.operators.stateful_map import MapContext, StatefulMapKernel

__all__ = [
    "Agg",
    "AggregateKernel",
    "ApplyContext",
    "DistinctKernel",
    "JoinKernel",
    "Kernel",
    "KernelResult",
    "MapContext",
    "OperatorSpec",
    "StateChanges",
    "StateReader",
    "StatefulMapKernel",
    "fingerprint",
    "make_kernel",
    "spec_from_wire",
    "spec_to_wire",
]


def make_kernel(spec: OperatorSpec, shard_width: int, shards: int) -> Kernel:
    """The kernel for ``spec``; ``shard_width`` is the key prefix width, ``shards`` is ``S``."""
    if spec.kind == "aggregate":
        return AggregateKernel(spec, shard_width)
    if spec.kind == "distinct":
        return DistinctKernel(spec, shard_width)
    if spec.kind == "join":
        return JoinKernel(spec, shard_width)
    return StatefulMapKernel(spec, shard_width, shards)
