"""Running the coordinator in the foreground: supervisor, REST server, signals.

:func:`serve`, in this order:

1. what restarting cannot fix, each a :class:`~sparkstep.errors.ConfigError` before anything
   starts: a Java 17+ on PATH (the runtime's Spark driver needs it); the state dir's lock
   (:mod:`~sparkstep.coordinator_api.statelock`, held until every child is gone: a second
   coordinator on the same state dir is refused); :meth:`Supervisor.check` (a bad pipeline or
   a ``--workers`` the state dir cannot take);
2. the REST server (uvicorn, in a thread) on ``api_host:api_port``; a port in use is a
   :class:`~sparkstep.errors.ConfigError`;
3. supervision starts (workers, runtime, checkpoint timer); ``on_ready(url)`` is called;
4. until the pipeline is stopped (``POST /api/v1/stop``), SIGINT/SIGTERM arrives, which
   stops it gracefully (a final checkpoint; a second signal ends the children at once), or the
   pipeline has ``failed`` (a configuration error, a failure that recurs, or the restart
   strategy gave up): then the reason is logged once and the coordinator exits, so that
   whatever runs ``sparkstep run`` (a shell, systemd, a container runtime) sees the run end
   rather than a process that looks alive; ``on_tick(supervisor)`` is called about once a
   second meanwhile;
5. the server stops after answering what it is answering; every child is gone.

Returns the exit status: 0 when stopped, 1 when the pipeline had failed.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType

import uvicorn

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.statelock import DirectoryLock
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.errors import ConfigError
from sparkstep.io.broker import java_executable
from sparkstep.net import is_loopback

__all__ = ["serve"]

_TICK_S = 1.0

log = logging.getLogger(__name__)


def serve(
    settings: CoordinatorSettings,
    child_env: Mapping[str, str],
    *,
    on_ready: Callable[[str], None] | None = None,
    on_tick: Callable[[Supervisor], None] | None = None,
) -> int:
    """Run the coordinator until the pipeline stops; see the module docstring."""
    # Step 1. What restarting cannot fix, and the state dir to ourselves.
    java_executable()
    with DirectoryLock(
        settings.state_dir,
        f"the state dir {settings.state_dir}",
        "another coordinator runs on it; stop it first (sparkstep stop) or use another --state-dir",
    ):
        return _serve_locked(Supervisor(settings, child_env), on_ready, on_tick)


def _serve_locked(
    supervisor: Supervisor,
    on_ready: Callable[[str], None] | None,
    on_tick: Callable[[Supervisor], None] | None,
) -> int:
    settings = supervisor.settings
    supervisor.check()
    # Step 2. The REST server.
    api_token = None if settings.api_token is None else settings.api_token.get_secret_value()
    if api_token is None and not is_loopback(settings.api_host):
        log.warning(
            "the REST API on %s has no token (--insecure-no-auth): anyone who reaches it can "
            "pause, rescale and stop the pipeline",
            settings.api_host,
        )
    app = coordinator_app(supervisor, api_token, settings.auth_metrics_and_dashboard)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=settings.api_host, port=settings.api_port, log_level="warning", lifespan="off"
        )
    )
    thread = threading.Thread(target=server.run, name="rest", daemon=True)
    thread.start()
    stop_asked = threading.Event()
    while not server.started:
        if not thread.is_alive():
            raise ConfigError(
                f"cannot serve the REST API on {settings.api_host}:{settings.api_port} (in use?):"
                " choose another --api-port"
            )
        stop_asked.wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{settings.api_host}:{port}"
    # Step 3. Supervision.
    signals = 0

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        stop_asked.set()
        if signals > 1:
            supervisor.close()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        supervisor.start()
        if on_ready is not None:
            on_ready(url)
        # Step 4. Until stopped.
        while not supervisor.wait(_TICK_S):
            if stop_asked.is_set():
                stopper = threading.Thread(target=supervisor.shutdown, name="shutdown")
                stopper.start()
                while stopper.is_alive():
                    stopper.join(_TICK_S)
                    if on_tick is not None:
                        on_tick(supervisor)
                break
            if on_tick is not None:
                on_tick(supervisor)
            failure = supervisor.failure()
            if failure is not None:
                log.error("the pipeline failed: %s", failure)
                break
    finally:
        # Step 5. Answer what is being answered, then go.
        server.should_exit = True
        thread.join(30)
        supervisor.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if supervisor.status()["state"] == "stopped" else 1
