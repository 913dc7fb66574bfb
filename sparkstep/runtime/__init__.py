"""The runtime: pipeline API, sharding and layout, operator kernels, state workers, step loop,
manifest, and the checkpoint, recovery and rescale procedures.

Imports :mod:`sparkstep.storage` and :mod:`sparkstep.io`, never the coordinator.

- :mod:`sparkstep.runtime.operators`: the stateful operator kernels over Arrow Z-sets
  (aggregate, distinct, join, stateful_map), their specs and the fingerprint.
- :mod:`sparkstep.runtime.worker`: the state worker process (Arrow Flight) and
  :class:`~sparkstep.runtime.worker.WorkerClient`, its one client.
"""
