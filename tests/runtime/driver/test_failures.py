"""How the runtime ends when it cannot go on: a failed stop, a changed pipeline, a step that
fails the same way on every replay. Real broker, Spark and worker processes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparkstep.examples import keyed_sum
from sparkstep.ids import Version
from sparkstep.runtime.control import ControlClient, ControlError, control_app
from sparkstep.runtime.errors import PipelineChangedError
from sparkstep.runtime.failure import FAILURE_FILE
from sparkstep.runtime.manifest import read_manifest, write_manifest
from sparkstep.runtime.process import EXIT_CONFIG, EXIT_FAILED, EXIT_PERMANENT
from sparkstep.runtime.worker.service import MARKER_TABLE, STATE_FORMAT_KEY
from sparkstep.storage import RocksDBStore
from tests.io.fixtures import high_watermark
from tests.runtime.driver import pipelines
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    RuntimeFactory,
    produce_keyed,
    produce_raw,
)
from tests.runtime.worker.fixtures import WorkerFactory
from tests.serving import serving


def test_a_stop_whose_final_checkpoint_fails_ends_failed_with_the_reason(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    produce_keyed(bootstrap_servers, topic, 60, keys=5, seed=41)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    runtime = harness.build()
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    assert harness.state is not None and harness.thread is not None
    stopped: list[bool] = []
    app = control_app(runtime, harness.state, harness.token, on_stop=lambda: stopped.append(True))
    harness.workers[1].kill()  # the final checkpoint cannot commit worker 1's store
    with serving(app) as address, ControlClient(address, harness.token, timeout=120) as client:
        with pytest.raises(ControlError, match="worker") as info:
            client.stop()
        assert info.value.status == 500
        harness.thread.join(60)
        assert not harness.thread.is_alive()  # the loop left instead of staying paused
        status = client.status()
    assert status["state"] == "failed"
    assert status["failure"] and "worker" in status["failure"]
    assert harness.errors and harness.errors[0] is harness.state.failure
    assert stopped == []


def test_changed_aggregates_under_the_same_name_are_refused_at_recovery(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    produce_keyed(bootstrap_servers, topic, 60, keys=5, seed=42)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    harness.build()
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()  # a graceful stop: no replay would notice the change

    harness.pipeline = pipelines.more_aggregates
    with pytest.raises(PipelineChangedError) as info:
        harness.build()
    message = str(info.value)
    assert "operator 'sums': aggs changed from" in message
    assert '["max", "value", "top"]' in message
    assert "run the code the state was made by" in message
    assert "a new --state-dir and --name" in message
    # Refused before anything changed: the old code still recovers, and so do the stores,
    # which the first recovery bound to the deployment and the operators.
    harness.pipeline = keyed_sum.pipeline
    runtime = harness.build()
    manifest = read_manifest(harness.state_dir)
    assert manifest is not None and manifest.operators == runtime.operators
    for worker in harness.workers:
        status = worker.client(harness.token).status()
        assert status["deployment"] == manifest.deployment
        assert status["fingerprint"] == manifest.operators.fingerprint


def test_a_step_that_fails_the_same_way_again_ends_permanently_failed(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
) -> None:
    topic = topic_factory("numbers", partitions=1)
    produce_keyed(bootstrap_servers, topic, 10, keys=5, seed=43)
    produce_raw(
        bootstrap_servers, topic, [json.dumps({"key": pipelines.POISON_KEY, "value": 1}).encode()]
    )
    state_dir = tmp_path / "state"
    stores = [state_dir / "workers" / f"w{i}" for i in range(2)]
    stores[0].parent.mkdir(parents=True)
    workers = [worker_factory(store=store, shards=256) for store in stores]
    args = [
        "--pipeline", "tests.runtime.driver.pipelines:poisoned",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(state_dir),
        "--name", unique_name,
        "--input-topic", topic,
        "--max-records-per-step", "100",
        "--token-file", str(token_file),
        *[arg for w in workers for arg in ("--worker", f"127.0.0.1:{w.port}")],
    ]  # fmt: skip
    log = tmp_path / "runtime.log"

    first = runtime_factory(args, log).start(timeout=600)
    assert first.wait(600) == EXIT_FAILED, first.tail()
    recorded = json.loads((state_dir / FAILURE_FILE).read_text())
    step = recorded["step"]
    assert step == 0  # one step holds the good records and the poison one
    assert "KernelError" in recorded["cause"]
    assert "ValueError: the key 'poison' is not allowed" in recorded["cause"]

    second = runtime_factory(args, log).start(timeout=600)
    assert second.wait(600) == EXIT_PERMANENT, second.tail()
    reason = log.read_text(errors="replace").splitlines()
    last = [line for line in reason if line.startswith(f"sparkstep: step {step} failed again")]
    assert last and "ValueError: the key 'poison' is not allowed" in last[-1], second.tail()


def test_a_state_dir_of_another_state_format_ends_the_run_as_a_configuration_error(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
) -> None:
    topic = topic_factory("numbers", partitions=1)
    produce_keyed(bootstrap_servers, topic, 10, keys=5, seed=44)
    state_dir = tmp_path / "state"
    stores = [state_dir / "workers" / f"w{i}" for i in range(2)]
    stores[0].parent.mkdir(parents=True)
    workers = [worker_factory(store=store, shards=256) for store in stores]
    args = [
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(state_dir),
        "--name", unique_name,
        "--input-topic", topic,
        "--token-file", str(token_file),
    ]  # fmt: skip
    log = tmp_path / "runtime.log"
    addresses = [arg for w in workers for arg in ("--worker", f"127.0.0.1:{w.port}")]
    first = runtime_factory([*args, *addresses], log).start(timeout=600)
    assert first.control(token_file.read_text().strip()).stop()["state"] == "stopped"
    assert first.wait(120) == 0, first.tail()
    for w in workers:
        w.kill()

    # What a future sparkstep would leave: the same stores with another state format recorded,
    # committed as the next version, and the manifest naming that version.
    manifest = read_manifest(state_dir)
    assert manifest is not None
    for path in stores:
        store = RocksDBStore(path)
        db = store.open(manifest.version)
        db.put(MARKER_TABLE, STATE_FORMAT_KEY, json.dumps({"state_format": 99}).encode())
        db.commit()
        assert manifest.version + 1 in store.versions()
        store.close()
    write_manifest(state_dir, dataclasses.replace(manifest, version=Version(manifest.version + 1)))

    workers = [worker_factory(store=store, shards=256) for store in stores]
    addresses = [arg for w in workers for arg in ("--worker", f"127.0.0.1:{w.port}")]
    second = runtime_factory([*args, *addresses], log).start(timeout=600)
    assert second.port is None, "it must refuse the stores during recovery, before it is ready"
    assert second.wait(60) == EXIT_CONFIG, second.tail()
    lines = log.read_text(errors="replace").splitlines()
    assert any(
        line.startswith("sparkstep: ") and "holds worker state format 99" in line for line in lines
    ), second.tail()
