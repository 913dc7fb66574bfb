"""The runtime: pipeline API, sharding and layout, operator kernels, state workers, step loop,
manifest, and the checkpoint, recovery and rescale procedures.

Imports :mod:`sparkstep.storage` and :mod:`sparkstep.io`, never the coordinator.

- :mod:`sparkstep.runtime.pipeline`: :class:`Pipeline`, what a user defines; ``MODULE:ATTR``.
- :mod:`sparkstep.runtime.dataflow`: the operators users call (``aggregate``, ``distinct``,
  ``join``, ``stateful_map``) and the stateful stage that calls the workers from Spark tasks.
- :mod:`sparkstep.runtime.plan_check`: refuses non-linear user code between operators.
- :mod:`sparkstep.runtime.decode`: JSON input -> the input DataFrame and dead letters.
- :mod:`sparkstep.runtime.layout`: shards, layouts and the least-movement planner.
- :mod:`sparkstep.runtime.step`: one step on Spark; :mod:`sparkstep.runtime.driver`: the step
  loop, recovery and checkpoint (:class:`Runtime`); :mod:`sparkstep.runtime.runstate`: its
  state machine; :mod:`sparkstep.runtime.manifest`: the commit point of checkpoints and
  rescales; :mod:`sparkstep.runtime.rescale`: the runtime's part of a rescale;
  :mod:`sparkstep.runtime.metrics`: the loop's counters and histograms (in its status).
- :mod:`sparkstep.runtime.control`: the runtime's internal control endpoint and its client;
  ``python -m sparkstep.runtime``: the runtime process (:mod:`sparkstep.runtime.process`).
- :mod:`sparkstep.runtime.operators`: the stateful operator kernels over Arrow Z-sets
  (aggregate, distinct, join, stateful_map), their specs and the fingerprint.
- :mod:`sparkstep.runtime.worker`: the state worker process (Arrow Flight) and
  :class:`~sparkstep.runtime.worker.WorkerClient`, its one client.
"""
