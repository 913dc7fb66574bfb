"""``sparkstep reset`` through the real command: a real pipeline's state dir and step log topic
are deleted only when nothing uses them and ``--yes`` is given; everything else is kept."""

from __future__ import annotations

import os
from pathlib import Path

from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from sparkstep.storage.rocksdb import RocksDBStore
from tests.coordinator_api.fixtures import CoordinatorProcess, sparkstep_cli, wait_until
from tests.runtime.driver.fixtures import produce_keyed

PIPELINE = "sparkstep.examples.keyed_sum:pipeline"


def _topics(bootstrap_servers: str) -> set[str]:
    return set(AdminClient({"bootstrap.servers": bootstrap_servers}).list_topics(timeout=30).topics)


def test_reset_of_a_real_pipeline_only_when_stopped_and_confirmed(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str
) -> None:
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    produce_keyed(bootstrap_servers, topic, 100, keys=10, seed=7)
    state = tmp_path / "state"
    steps = f"{unique_name}.steps"
    which = ["--pipeline", PIPELINE, "--bootstrap-servers", bootstrap_servers,
             "--state-dir", str(state), "--name", unique_name]  # fmt: skip
    run = [*which, "--workers", "2", "--api-port", "0", "--input-topic", topic,
           "--output-topic", out, "--max-records-per-step", "25", "--checkpoint-interval", "0",
           "--restart-strategy", "none"]  # fmt: skip
    coordinator = CoordinatorProcess(run, tmp_path / "coordinator.log").start()
    try:
        coordinator.wait_state("running")
        api = ["--api", str(coordinator.url)]
        code, _out, err = sparkstep_cli("checkpoint", *api)
        assert code == 0, err
        assert (state / "manifest.json").exists() and steps in _topics(bootstrap_servers)
        assert coordinator.proc is not None
        pid = coordinator.proc.pid

        # While it runs, a second coordinator and a reset are refused; nothing is deleted.
        code, _out, err = sparkstep_cli("run", *run)
        assert (code, err) == (2, (
            f"sparkstep: the state dir {state} is in use by pid {pid}: another coordinator runs "
            "on it; stop it first (sparkstep stop) or use another --state-dir\n"
        ))  # fmt: skip
        code, _out, err = sparkstep_cli("reset", *which, "--yes")
        assert (code, err) == (2, (
            f"sparkstep: the state dir {state} is in use by pid {pid}: a coordinator runs on "
            "it; stop it first (sparkstep stop), then reset\n"
        ))  # fmt: skip
        assert (state / "manifest.json").exists() and steps in _topics(bootstrap_servers)

        code, _out, err = sparkstep_cli("stop", *api)
        assert code == 0, err
        assert coordinator.wait(120) == 0
    finally:
        coordinator.kill()

    # Without --yes: one line saying what would go, and nothing goes.
    code, text, err = sparkstep_cli("reset", *which)
    assert (code, text, err) == (2, "", (
        f"sparkstep: reset deletes the state dir {state} and the step log topic {steps} on "
        f"{bootstrap_servers}; the input and output topics and the dead-letter topic "
        f"{unique_name}.dlq are kept; nothing was deleted: pass --yes to do it\n"
    ))  # fmt: skip
    assert (state / "manifest.json").exists() and steps in _topics(bootstrap_servers)

    code, text, err = sparkstep_cli("reset", *which, "--yes")
    assert (code, err) == (0, ""), err
    assert text == f"reset {unique_name}: deleted the step log topic {steps}; deleted the state dir {state}\n"  # fmt: skip  # noqa: E501
    assert not state.exists()
    left = _topics(bootstrap_servers)
    assert steps not in left and {topic, out} <= left

    code, text, err = sparkstep_cli("reset", *which, "--yes")  # nothing left to do: fine
    assert (code, text) == (0, f"reset {unique_name}: no step log topic {steps}; no state dir {state}\n"), err  # fmt: skip  # noqa: E501


def test_reset_refuses_a_store_in_use_and_keeps_files_sparkstep_did_not_make(
    tmp_path: Path, bootstrap_servers: str, unique_name: str
) -> None:
    state = tmp_path / "state"
    steps = f"{unique_name}.steps"
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(steps, num_partitions=1)])[steps].result(timeout=30)
    wait_until(lambda: steps in _topics(bootstrap_servers), 30, f"topic {steps}")
    (state / "notes").mkdir(parents=True)
    (state / "notes" / "mine.txt").write_text("not sparkstep's")
    (state / "workers" / "backup").mkdir(parents=True)  # under workers/, but not a store
    (state / "workers" / "backup" / "data").write_text("not sparkstep's either")
    (state / "failure.json").write_text("{}")  # the runtime's failure record: sparkstep's
    which = ["--pipeline", PIPELINE, "--bootstrap-servers", bootstrap_servers,
             "--state-dir", str(state), "--name", unique_name, "--yes"]  # fmt: skip

    store = RocksDBStore.create(state / "workers" / "w0", version=0)  # a worker's, in use
    try:
        code, _out, err = sparkstep_cli("reset", *which)
        assert (code, err) == (2, (
            f"sparkstep: the store {state / 'workers' / 'w0'} is in use by pid {os.getpid()}: "
            "a worker still owns it; stop its coordinator first, then reset\n"
        ))  # fmt: skip
        assert steps in _topics(bootstrap_servers)
    finally:
        store.close()
    assert (state / "workers" / "w0").is_dir()

    code, text, err = sparkstep_cli("reset", *which)
    assert (code, err) == (0, ""), err
    assert text == (
        f"reset {unique_name}: deleted the step log topic {steps}; deleted sparkstep's files in "
        f"{state} and kept what it did not create: notes, workers/backup\n"
    )
    assert sorted(p.name for p in state.iterdir()) == ["notes", "workers"]
    assert [p.name for p in (state / "workers").iterdir()] == ["backup"]
    assert (state / "notes" / "mine.txt").read_text() == "not sparkstep's"
    assert (state / "workers" / "backup" / "data").read_text() == "not sparkstep's either"
    assert steps not in _topics(bootstrap_servers)
