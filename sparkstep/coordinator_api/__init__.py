"""The coordinator: FastAPI app, REST models, checkpoint timer, supervision.

Talks to the runtime only through its control clients; reads storage only to report.

- :mod:`~sparkstep.coordinator_api.settings`: the frozen settings model (flags, ``SPARKSTEP_*``,
  TOML); :mod:`~sparkstep.coordinator_api.restart`: Flink's restart strategies.
- :mod:`~sparkstep.coordinator_api.supervisor`: starts and supervises the workers and the
  runtime, and schedules checkpoints and rescales; :mod:`~sparkstep.coordinator_api.children`:
  the child processes.
- :mod:`~sparkstep.coordinator_api.app` and :mod:`~sparkstep.coordinator_api.models`: the REST
  API (v1); :mod:`~sparkstep.coordinator_api.metrics` and
  :mod:`~sparkstep.coordinator_api.dashboard`: ``/metrics`` and ``/``.
- :mod:`~sparkstep.coordinator_api.serve`: ``sparkstep run``;
  :mod:`~sparkstep.coordinator_api.client`: the REST client of the other commands. (``sparkstep
  up``, which also runs a broker and a producer, is :mod:`sparkstep.quickstart`, beside the
  command line: the coordinator does not use :mod:`sparkstep.io`.)
"""
