"""The coordinator: FastAPI app, REST models, checkpoint timer, supervision.

Talks to the runtime only through its control clients; reads storage only to report.

- :mod:`~sparkstep.coordinator_api.settings`: the frozen settings model (flags, ``SPARKSTEP_*``,
  TOML); :mod:`~sparkstep.coordinator_api.restart`: Flink's restart strategies.
- :mod:`~sparkstep.coordinator_api.supervisor`: the supervisor, which ties the parts below,
  restarts what dies and reports the status; :mod:`~sparkstep.coordinator_api.launcher`:
  spawning, watching and ending the workers and the runtime;
  :mod:`~sparkstep.coordinator_api.children`: one child process;
  :mod:`~sparkstep.coordinator_api.procedures`: pause, resume, checkpoint, rescale, stop;
  :mod:`~sparkstep.coordinator_api.preflight`: the Kafka checks before every launch;
  :mod:`~sparkstep.coordinator_api.timer`: the checkpoint timer;
  :mod:`~sparkstep.coordinator_api.history`: the checkpoint and rescale history;
  :mod:`~sparkstep.coordinator_api.state`: what these parts share.
- :mod:`~sparkstep.coordinator_api.app` and :mod:`~sparkstep.coordinator_api.models`: the REST
  API (v1); :mod:`~sparkstep.coordinator_api.metrics` and
  :mod:`~sparkstep.coordinator_api.dashboard`: ``/metrics`` and ``/``.
- :mod:`~sparkstep.coordinator_api.serve`: ``sparkstep run``;
  :mod:`~sparkstep.coordinator_api.client`: the REST client of the other commands. (``sparkstep
  up``, which also runs a broker and a producer, is :mod:`sparkstep.quickstart`, beside the
  command line.) The coordinator uses :mod:`sparkstep.io` only for the runtime's Kafka settings
  file and the checks before a launch (:mod:`~sparkstep.coordinator_api.preflight`).
"""
