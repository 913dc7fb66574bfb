"""Supervision without Spark: restart strategies, giving up (``failed`` with the reason), a
stop of a failed pipeline, and ``sparkstep run`` refusing a bad configuration in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.restart import FailureRate, FixedDelay, NoRestart
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from tests.coordinator_api.fixtures import asgi_call, sparkstep_cli, wait_until


def test_fixed_delay_allows_its_attempts_then_gives_up() -> None:
    strategy = FixedDelay(attempts=2, delay_s=0.5)
    assert [strategy.on_failure(t) for t in (0, 100, 1000)] == [0.5, 0.5, None]


def test_failure_rate_counts_only_failures_within_the_interval() -> None:
    strategy = FailureRate(max_failures=2, interval_s=60, delay_s=1)
    assert strategy.on_failure(0) == 1 and strategy.on_failure(30) == 1
    assert strategy.on_failure(59) is None  # three within 60 s
    strategy = FailureRate(max_failures=2, interval_s=60, delay_s=1)
    assert [strategy.on_failure(t) for t in (0, 30, 61, 95, 200)] == [1, 1, 1, 1, 1]
    assert NoRestart().on_failure(0) is None


def _supervisor(tmp_path: Path, **extra) -> Supervisor:
    state_dir = tmp_path / "state"
    (state_dir / "workers").mkdir(parents=True)
    # A file where worker 0's store directory belongs: the worker exits before it is ready.
    (state_dir / "workers" / "w0").write_text("not a store")
    settings = CoordinatorSettings.model_validate(
        {
            "pipeline": "sparkstep.examples.keyed_sum:pipeline",
            "bootstrap_servers": "127.0.0.1:9",
            "state_dir": state_dir,
            "workers": 2,
            "restart_delay_s": 0.1,
            "lock_timeout_s": 1,
            **extra,
        }
    )
    supervisor = Supervisor(settings, {})
    supervisor.check()
    return supervisor


@pytest.mark.parametrize(
    ("strategy", "restarts"),
    [({"restart_strategy": "none"}, 0),
     ({"restart_strategy": "fixed-delay", "restart_attempts": 2}, 2),
     ({"restart_strategy": "failure-rate", "max_failures_per_interval": 1}, 1)],
)  # fmt: skip
def test_a_child_that_keeps_failing_ends_failed_with_its_reason(
    tmp_path: Path, strategy: dict[str, Any], restarts: int
) -> None:
    supervisor = _supervisor(tmp_path, **strategy)
    app = coordinator_app(supervisor, None)
    supervisor.start()
    try:
        wait_until(
            lambda: asgi_call(app, "GET", "/api/v1/status").json()["state"] == "failed",
            120,
            "failed",
        )
        doc = asgi_call(app, "GET", "/api/v1/status").json()
        assert doc["last_failure"]["reason"].startswith("worker 0 exited with status")
        assert supervisor.restarts == restarts
        assert doc["processes"] == {"coordinator": doc["processes"]["coordinator"],
                                    "runtime": None, "workers": {}}  # fmt: skip
        refused = asgi_call(app, "POST", "/api/v1/checkpoint")
        assert refused.status_code == 503 and "failed" in refused.json()["detail"]
        stopped = asgi_call(app, "POST", "/api/v1/stop")
        assert stopped.status_code == 200
        assert stopped.json() == {"state": "stopped", "step": None, "version": None}
        assert supervisor.wait(10)
        assert asgi_call(app, "GET", "/api/v1/status").json()["state"] == "stopped"
    finally:
        supervisor.close()
    worker_log = (tmp_path / "state" / "logs" / "worker-w0.log").read_text()
    assert worker_log.count("starting worker 0") == restarts + 1


def test_token_file_is_private(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, restart_strategy="none")
    supervisor.start()
    try:
        wait_until(supervisor.token_file.exists, 30, "the token file")
        assert supervisor.token_file.stat().st_mode & 0o777 == 0o600
        secret = supervisor.token_file.read_text().strip()
        assert len(secret) >= 32
        # A new secret for every supervisor, whatever the settings (the REST token is not it).
        assert _supervisor(tmp_path / "other", restart_strategy="none")._secret != secret
    finally:
        supervisor.close()


def test_run_refuses_a_bad_pipeline_in_one_line(tmp_path: Path) -> None:
    code, out, err = sparkstep_cli(
        "run", "--pipeline", "no_such_module:pipeline", "--bootstrap-servers", "127.0.0.1:9",
        "--state-dir", str(tmp_path / "state"), "--api-port", "0",
    )  # fmt: skip
    assert code == 2, (out, err)
    assert err.startswith("sparkstep: ") and "no_such_module" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = sparkstep_cli("run", "--state-dir", str(tmp_path / "s"))
    assert code == 2 and "pipeline is missing: pass --pipeline" in err
