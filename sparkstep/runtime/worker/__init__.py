"""State workers: one process per two-version store, serving apply and control over Arrow Flight.

- :mod:`.service`: :class:`StateWorker`, the apply rules, markers and tables (no wire).
- :mod:`.server`: the Flight server (bearer-token middleware, actions, the apply exchange).
- :mod:`.client`: :class:`WorkerClient`, the one client (runtime and Spark tasks).
- :mod:`.digest`: the incremental state digest.
- ``python -m sparkstep.runtime.worker``: the process (:mod:`.__main__`).

Apply on the wire (for a Spark task of the stateful stage, after the shuffle by ``__worker``)::

    DoExchange(FlightDescriptor.for_command(JSON {"incarnation", "step", "operator", "input",
                                                   "division_digest", "step_time_ms",
                                                   "layout_epoch"}))
      client -> server: the rows (Arrow schema + record batches, with __weight and __shard)
      server -> client: the delta (schema + batches: the operator's output columns, __weight),
                        then a metadata message {"state_digest": "<16 hex>", "replayed": bool}

Control calls are Flight actions with JSON bodies (``versions``, ``open``, ``configure``,
``commit``, ``export``, ``import``, ``drop``, ``set_layout``, ``close``, ``inspect``, ``status``,
``shutdown``); every call carries ``authorization: Bearer <token>``. Details in :mod:`.server`.
The apply header also carries the step's ``layout_epoch``; the worker refuses an apply of another
epoch or with rows of shards its layout does not give it (:mod:`.service`).
"""

from __future__ import annotations

from sparkstep.runtime.worker.client import WorkerClient
from sparkstep.runtime.worker.service import ApplyResult, StateWorker

__all__ = [
    "ApplyResult",
    "StateWorker",
    "WorkerClient",
]
