"""Supervision without Spark: restart strategies, giving up (``failed`` with the reason), a
stop of a failed pipeline, ``sparkstep run`` refusing a bad configuration in one line, and the
Kafka checks before a launch (a missing input topic fails once, an unreachable broker is waited
for without spawning anything)."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.restart import FailureRate, FixedDelay, NoRestart
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.storage import RocksDBStore
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


def _settings(tmp_path: Path, bootstrap_servers: str, topic: str, **extra) -> CoordinatorSettings:
    return CoordinatorSettings.model_validate(
        {
            "pipeline": "sparkstep.examples.keyed_sum:pipeline",
            "bootstrap_servers": bootstrap_servers,
            "input_topics": (topic,),
            "state_dir": tmp_path / "state",
            "workers": 2,
            "restart_delay_s": 0.1,
            "lock_timeout_s": 1,
            **extra,
        }
    )


def _supervisor(tmp_path: Path, bootstrap_servers: str, topic: str, **extra) -> Supervisor:
    state_dir = tmp_path / "state"
    (state_dir / "workers").mkdir(parents=True)
    # A file where worker 0's store directory belongs: the worker exits before it is ready.
    (state_dir / "workers" / "w0").write_text("not a store")
    supervisor = Supervisor(_settings(tmp_path, bootstrap_servers, topic, **extra), {})
    supervisor.check()
    return supervisor


@pytest.mark.parametrize(
    ("strategy", "restarts"),
    [({"restart_strategy": "none"}, 0),
     ({"restart_strategy": "fixed-delay", "restart_attempts": 2}, 2),
     ({"restart_strategy": "failure-rate", "max_failures_per_interval": 1}, 1)],
)  # fmt: skip
def test_a_child_that_keeps_failing_ends_failed_with_its_reason(
    tmp_path: Path, bootstrap_servers: str, topic_factory, strategy: dict[str, Any], restarts: int
) -> None:
    supervisor = _supervisor(tmp_path, bootstrap_servers, topic_factory("numbers"), **strategy)
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
                                    "runtime": None, "workers": {}, "hosts": {}}  # fmt: skip
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


def test_token_file_is_private(tmp_path: Path, bootstrap_servers: str, topic_factory) -> None:
    topic = topic_factory("numbers")
    supervisor = _supervisor(tmp_path, bootstrap_servers, topic, restart_strategy="none")
    supervisor.start()
    try:
        wait_until(supervisor.token_file.exists, 30, "the token file")
        assert supervisor.token_file.stat().st_mode & 0o777 == 0o600
        secret = supervisor.token_file.read_text().strip()
        assert len(secret) >= 32
        # A new secret for every supervisor, whatever the settings (the REST token is not it).
        other = _supervisor(tmp_path / "other", bootstrap_servers, topic, restart_strategy="none")
        assert other._secret != secret
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


def test_run_refuses_a_missing_input_topic_in_one_line(
    tmp_path: Path, bootstrap_servers: str
) -> None:
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    code, out, err = sparkstep_cli(
        "run", "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers, "--input-topic", missing,
        "--state-dir", str(tmp_path / "state"), "--api-port", "0",
    )  # fmt: skip
    assert code == 2, (out, err)
    assert err.startswith("sparkstep: input topic ") and missing in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "state" / "logs").exists()  # nothing was spawned


def test_an_input_topic_missing_at_a_launch_fails_once_without_restarts(
    tmp_path: Path, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers")
    supervisor = Supervisor(_settings(tmp_path, bootstrap_servers, topic), {})
    supervisor.check()  # the topic exists here
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.delete_topics([topic])[topic].result(timeout=60)
    wait_until(lambda: topic not in admin.list_topics(timeout=30).topics, 60, "the deletion")
    app = coordinator_app(supervisor, None)
    supervisor.start()
    try:
        wait_until(
            lambda: asgi_call(app, "GET", "/api/v1/status").json()["state"] == "failed",
            120,
            "failed",
        )
        doc = asgi_call(app, "GET", "/api/v1/status").json()
        reason = doc["last_failure"]["reason"]
        assert reason.startswith(f"input topic {topic} does not exist"), reason
        assert supervisor.restarts == 0
        assert doc["processes"]["runtime"] is None and doc["processes"]["workers"] == {}
        assert not (tmp_path / "state" / "logs").exists()  # nothing was spawned
    finally:
        supervisor.close()


def test_an_unreachable_broker_is_waited_for_without_spawning(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    supervisor = Supervisor(_settings(tmp_path, f"127.0.0.1:{port}", "numbers"), {})
    supervisor.check()  # a cluster that does not answer is waited for later, not refused
    app = coordinator_app(supervisor, None)
    reasons: list[str] = []

    def waiting() -> bool:
        doc = asgi_call(app, "GET", "/api/v1/status").json()
        assert doc["state"] == "recovering", doc
        assert doc["processes"]["runtime"] is None and doc["processes"]["workers"] == {}
        failure = doc["last_failure"]
        if failure is not None and failure["reason"] not in reasons:
            reasons.append(failure["reason"])
        return len(reasons) >= 3

    supervisor.start()
    try:
        wait_until(waiting, 120, "three checks of the broker")
        for reason in reasons:
            assert reason.startswith(f"the Kafka broker at 127.0.0.1:{port} is unreachable")
        # Exponential backoff: 1 s, then 2 s, then 4 s.
        assert [r.split("retrying in ")[1].split("s ")[0] for r in reasons] == ["1", "2", "4"]
        assert supervisor.restarts == 0
        assert not (tmp_path / "state" / "logs").exists()  # nothing was spawned
        stopped = asgi_call(app, "POST", "/api/v1/stop")
        assert stopped.status_code == 200, stopped.text
        assert stopped.json() == {"state": "stopped", "step": None, "version": None}
        assert supervisor.wait(30)
        assert asgi_call(app, "GET", "/api/v1/status").json()["state"] == "stopped"
    finally:
        supervisor.close()


def test_a_start_deletes_leftover_stores_and_nothing_a_user_put_there(
    tmp_path: Path, bootstrap_servers: str, topic_factory
) -> None:
    workers = tmp_path / "state" / "workers"
    workers.mkdir(parents=True)
    RocksDBStore.create(workers / "w5-e3", version=0).close()  # a store no manifest lists
    (workers / "notes.txt").write_text("mine")
    (workers / "backup").mkdir()
    (workers / "backup" / "data.bin").write_bytes(b"mine too")
    settings = _settings(tmp_path, bootstrap_servers, topic_factory("numbers"))
    supervisor = Supervisor(settings, {})
    supervisor.check()
    supervisor.start()
    try:
        wait_until(lambda: (workers / "w0").is_dir(), 120, "the launch's workers")
    finally:
        supervisor.close()
    assert not (workers / "w5-e3").exists()
    assert (workers / "notes.txt").read_text() == "mine"
    assert (workers / "backup" / "data.bin").read_bytes() == b"mine too"


def test_sparkstep_run_ends_when_the_pipeline_has_failed(
    tmp_path: Path, bootstrap_servers: str, topic_factory
) -> None:
    """A pipeline that will never run again ends ``sparkstep run`` with the reason, status 1:
    a coordinator that stays up while nothing runs looks healthy to whatever started it."""
    topic = topic_factory("in")
    code, out, err = sparkstep_cli(
        "run", "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers, "--input-topic", topic,
        "--state-dir", str(tmp_path / "state"), "--api-port", "0",
        "--spark-master", "no-such-master", "--restart-strategy", "none",
        timeout=300,
    )  # fmt: skip
    assert code == 1, (out, err)
    assert "the pipeline failed: the runtime exited" in err, err
