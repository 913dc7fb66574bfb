"""sparkstep: a checkpointed, rescalable, exactly-once step runtime for stateful PySpark pipelines.

What a pipeline's author imports::

    from sparkstep import Pipeline, aggregate, distinct, join, stateful_map

The layers, each a subpackage (imports go one way, top to bottom):

- ``sparkstep.coordinator_api``: the FastAPI coordinator (REST, timer, supervision);
- ``sparkstep.runtime``: the step loop, state workers, operators, manifest and procedures;
- ``sparkstep.storage``: the per-worker two-version RocksDB store;
- ``sparkstep.io``: Kafka input ranges, the step log, the exactly-once output writer, the broker.

``sparkstep.errors``, ``sparkstep.ids`` and ``sparkstep.failpoints`` are shared by every layer.
The names above are loaded on first use, so importing ``sparkstep.io`` or ``sparkstep.storage``
(in a Spark executor, a state worker) does not import Spark's driver-side code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkstep.runtime.dataflow import aggregate, distinct, join, stateful_map
    from sparkstep.runtime.pipeline import Pipeline

__all__ = ["Pipeline", "aggregate", "distinct", "join", "stateful_map"]
__version__ = "0.1.0"

_LAZY = {
    "Pipeline": "sparkstep.runtime.pipeline",
    "aggregate": "sparkstep.runtime.dataflow",
    "distinct": "sparkstep.runtime.dataflow",
    "join": "sparkstep.runtime.dataflow",
    "stateful_map": "sparkstep.runtime.dataflow",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkstep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
