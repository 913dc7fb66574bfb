"""State workers: one process per two-version store, serving apply and control over Arrow Flight.

- :mod:`.service`: :class:`StateWorker`, the apply rules, markers and tables (no wire).
- :mod:`.server`: the Flight server (bearer-token middleware, actions, the apply exchange).
- :mod:`.client`: :class:`WorkerClient`, the one client (runtime and Spark tasks).
- :mod:`.digest`: the incremental state digest.
- :mod:`.buffer`: the applies' writes held in memory between flushes into the open database.
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

What a caller holding the token can make a worker do:

- ``configure`` carries the operator specs as data (name, kind, key, Arrow IPC schemas,
  aggregates, timeout: :func:`~sparkstep.runtime.operators.spec_to_wire`), never a pickled
  object. The one piece of code is ``stateful_map``'s user function, a cloudpickle inside its
  spec, unpickled by the kernel: a worker runs the user's code exactly as a Spark executor does
  (executors unpickle the same function from the driver's tasks), so it trusts no one Spark
  does not. The token it checks is the deployment's internal secret, held by the coordinator,
  the runtime and the stateful-stage tasks, never by REST users. (A worker cannot build the
  specs from the pipeline module itself: building a pipeline needs a SparkSession.)
- ``export`` writes only into ``<store>/exports/<name>/`` (``name`` one plain path component)
  and reports a sha256 per file. ``import`` is told the sender's address, the export's name
  and its files: the receiver fetches them from the sender over Flight (``DoGet``, same
  token; the sender sends only regular files of its own exports) into its own
  ``<store>/imports/<name>/``, verifies each checksum, retries a broken or corrupt transfer as
  a whole a bounded number of times (then
  :class:`~sparkstep.runtime.errors.ShardTransferError`), and ingests. No path on a shared disk
  crosses workers. Any other name is refused with
  :class:`~sparkstep.runtime.errors.PathRefusedError`. Both directories are emptied at every
  ``open``.
"""

from __future__ import annotations

from sparkstep.runtime.worker.client import WorkerClient
from sparkstep.runtime.worker.service import ApplyResult, StateWorker

__all__ = [
    "ApplyResult",
    "StateWorker",
    "WorkerClient",
]
