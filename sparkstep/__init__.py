"""sparkstep: a checkpointed, rescalable, exactly-once step runtime for stateful PySpark pipelines.

The layers, each a subpackage (imports go one way, top to bottom):

- ``sparkstep.coordinator_api``: the FastAPI coordinator (REST, timer, supervision);
- ``sparkstep.runtime``: the step loop, state workers, operators, manifest and procedures;
- ``sparkstep.storage``: the per-worker two-version RocksDB store;
- ``sparkstep.io``: Kafka input ranges, the step log, the exactly-once output writer, the broker.

``sparkstep.errors`` and ``sparkstep.failpoints`` are shared by every layer.
"""

__version__ = "0.1.0"
