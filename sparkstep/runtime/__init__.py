"""The runtime: pipeline API, sharding and layout, operator kernels, state workers, step loop,
manifest, and the checkpoint, recovery and rescale procedures.

Imports :mod:`sparkstep.storage` and :mod:`sparkstep.io`, never the coordinator.
"""
