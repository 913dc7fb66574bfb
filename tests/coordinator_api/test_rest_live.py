"""The REST contract over a real pipeline: a real supervisor in this process with its real
worker and runtime processes (real broker, real Spark), every endpoint's answer and the 409s,
in process through ``httpx.ASGITransport``; the children listen on every interface and are dialled
by the host name they advertise, as on a cluster; every answer is checked against the OpenAPI
document (a declared status code, the declared schema)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.failpoints import ENV_VAR
from tests.coordinator_api.fixtures import asgi_call, metric_samples, wait_until
from tests.runtime.driver.fixtures import produce_keyed

TOKEN = "live-token"
_DWELL_S = 4


@pytest.fixture
def live(
    tmp_path: Path, bootstrap_servers: str, topic_factory, unique_name: str
) -> Iterator[tuple[Supervisor, str]]:
    topic = topic_factory("numbers", partitions=2)
    settings = CoordinatorSettings.model_validate(
        {
            "pipeline": "sparkstep.examples.keyed_sum:pipeline",
            "bootstrap_servers": bootstrap_servers,
            "state_dir": tmp_path / "state",
            "workers": 2,
            "name": unique_name,
            "input_topics": (topic,),
            "output_topic": topic_factory("out", partitions=2),
            "max_records_per_step": 30,
            "checkpoint_interval_s": 0,
            "restart_strategy": "none",
            # Listening on every interface, dialled by a name: as on a cluster (sparkstep.net).
            "bind": "0.0.0.0",
            "advertise": "localhost",
        }
    )
    # The runtime's first checkpoint (the test's first) dwells between commits and manifest.
    supervisor = Supervisor(settings, {ENV_VAR: f"checkpoint.after_commits:sleep={_DWELL_S}"})
    supervisor.check()
    supervisor.start()
    try:
        yield supervisor, topic
    finally:
        supervisor.close()


def test_every_endpoint_over_a_real_pipeline(live, bootstrap_servers: str) -> None:
    supervisor, topic = live
    app = coordinator_app(supervisor, TOKEN)
    document = schemathesis.openapi.from_dict(app.openapi())

    def call(method: str, path: str, json=None):
        """The answer, checked against the OpenAPI document: a declared status and shape."""
        answer = asgi_call(app, method, f"/api/v1/{path}", token=TOKEN, json=json)
        operation = document[f"/api/v1/{path}"][method]
        assert str(answer.status_code) in operation.definition.raw["responses"], answer.text
        operation.validate_response(answer)
        return answer

    def status() -> dict[str, Any]:
        answer = call("GET", "status")
        assert answer.status_code == 200
        doc = answer.json()
        assert doc["state"] != "failed", doc
        return doc

    wait_until(lambda: status()["state"] == "running", 300, "running")
    produce_keyed(bootstrap_servers, topic, 120, keys=15, seed=3)
    wait_until(lambda: (status()["step"] or 0) >= 2, 300, "two steps")
    doc = status()
    assert doc["workers"] == 2 and doc["layout_epoch"] == 0

    # The history fills while the pipeline runs: input rate, latency, lag per topic.
    def history(since: float | None = None) -> dict[str, Any]:
        if since is None:
            answer = call("GET", "history")
        else:  # the query, checked against the same operation
            answer = asgi_call(app, "GET", f"/api/v1/history?since={since!r}", token=TOKEN)
            document["/api/v1/history"]["GET"].validate_response(answer)
        assert answer.status_code == 200, answer.text
        doc: dict[str, Any] = answer.json()
        return doc

    def busy(sample: dict[str, Any]) -> bool:
        return bool(sample["input_rate"]) and sample["latency_p50_ms"] is not None

    wait_until(lambda: any(busy(s) for s in history()["samples"]), 300, "a busy sample")
    sample = next(s for s in history()["samples"] if busy(s))
    assert sample["output_rate"] is not None and sample["steps"] > 0
    assert 0 < sample["latency_p50_ms"] <= sample["latency_max_ms"]
    assert set(sample["lag"]) == {topic}
    seen = history()["samples"][-1]["time"]
    wait_until(lambda: history(seen)["samples"], 60, "a newer sample")
    assert all(s["time"] > seen for s in history(seen)["samples"])
    assert set(doc["processes"]["workers"]) == {"0", "1"} and doc["processes"]["runtime"]

    # a checkpoint of the running pipeline: the runtime holds the loop briefly and says so;
    # the pipeline is running all along, never "paused" by nobody
    answers: list[Any] = []
    checkpointing = threading.Thread(target=lambda: answers.append(call("POST", "checkpoint")))
    checkpointing.start()
    try:
        wait_until(
            lambda: (supervisor.procedures.runtime_status() or {}).get("state") == "checkpointing",
            60,
            "the runtime checkpointing",
        )
        assert status()["state"] == "running"
    finally:
        checkpointing.join(120)
    assert answers[0].status_code == 200, answers[0].text
    assert status()["state"] == "running"

    # pause (idempotent), checkpoint twice
    paused = call("POST", "pause")
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    assert call("POST", "pause").json() == paused.json()
    assert status()["state"] == "paused"
    first, second = call("POST", "checkpoint").json(), call("POST", "checkpoint").json()
    assert second["version"] > first["version"]
    assert first["step"] == second["step"] == paused.json()["step"]
    listed = call("GET", "checkpoints").json()["checkpoints"]
    assert [c["version"] for c in listed][-2:] == [first["version"], second["version"]]
    assert status()["checkpoint"]["version"] == second["version"]
    events = [e for e in history()["events"] if e["kind"] == "checkpoint"][-2:]
    assert [(e["version"], e["duration_ms"]) for e in events] == [
        (first["version"], first["duration_ms"]),
        (second["version"], second["duration_ms"]),
    ]
    wait_until(lambda: history()["samples"][-1]["state"] == "paused", 60, "a paused sample")

    # 409 while another procedure runs (the procedure lock held as a checkpoint would hold it)
    supervisor.procedures.exclusive("checkpoint")
    try:
        for path, body in [("checkpoint", None), ("rescale", {"workers": 3})]:
            answer = call("POST", path, body)
            assert answer.status_code == 409, (path, answer.text)
            assert "checkpoint is in progress" in answer.json()["detail"]
    finally:
        supervisor.procedures.release()

    # a valid body the pipeline cannot take: more workers than shards
    too_many = call("POST", "rescale", {"workers": 257})
    assert too_many.status_code == 422 and "S=256" in too_many.json()["detail"]

    # a cold rescale while paused: stays paused; the layout changes
    called = time.monotonic()
    grown = call("POST", "rescale", {"workers": 3, "mode": "cold"})
    elapsed_ms = math.ceil((time.monotonic() - called) * 1000)
    assert grown.status_code == 200, grown.text
    answer = grown.json()
    assert (answer["workers"], answer["layout_epoch"]) == (3, 1)
    assert answer["shards_moved"] > 0 and answer["bytes_moved"] > 0
    assert answer["mode"] == "cold" and answer["bytes_paused"] == answer["bytes_moved"]
    assert (answer["bytes_precopied"], answer["rounds"]) == (0, 0)
    assert 0 < answer["pause_ms"] <= elapsed_ms  # the pause lies inside the call, in ms
    doc = status()
    assert (doc["state"], doc["workers"], doc["layout_epoch"]) == ("paused", 3, 1)
    assert set(doc["processes"]["workers"]) == {"0", "1", "2"}
    launched = supervisor.launcher.launched()
    assert launched is not None
    addresses = [launched.runtime.address, *(w.address for w in launched.workers)]
    assert all(a.startswith("localhost:") for a in addresses), addresses
    assert call("GET", "checkpoints").json()["checkpoints"][-1]["version"] > second["version"]
    rescales = [e for e in history()["events"] if e["kind"] == "rescale"]
    assert [{k: v for k, v in e.items() if k not in ("kind", "time")} for e in rescales] == [
        {"from_workers": 2, **answer}
    ]

    # resume; steps go on with 3 workers; a hot rescale (the default) down while running
    resumed = call("POST", "resume")
    assert resumed.status_code == 200 and resumed.json() == {"state": "running"}
    step = status()["step"]
    produce_keyed(bootstrap_servers, topic, 90, keys=15, seed=4)
    wait_until(lambda: status()["step"] > step, 300, "a step with 3 workers")
    shrunk = call("POST", "rescale", {"workers": 1})
    assert shrunk.status_code == 200, shrunk.text
    hot = shrunk.json()
    assert (hot["workers"], hot["layout_epoch"], hot["mode"]) == (1, 2, "hot")
    assert hot["rounds"] >= 1 and hot["bytes_precopied"] > 0
    assert hot["bytes_moved"] == hot["bytes_precopied"] + hot["bytes_paused"]
    doc = status()
    assert (doc["state"], doc["workers"]) == ("running", 1)
    assert list(doc["processes"]["workers"]) == ["0"]
    assert sorted(p.name for p in (supervisor.state_dir / "workers").iterdir()) == ["w0"]

    metrics = asgi_call(app, "GET", "/metrics").text
    assert metric_samples(metrics, "sparkstep_rescales_total") == {"": 2.0}

    # stop: a final checkpoint, then every process exits
    pids = status()["processes"]
    last = call("GET", "checkpoints").json()["checkpoints"][-1]["version"]
    stopped = call("POST", "stop")
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["state"] == "stopped"
    assert stopped.json()["version"] == last + 1
    assert supervisor.wait(120)
    assert status()["state"] == "stopped"
    children = [pids["runtime"], *pids["workers"].values()]
    wait_until(lambda: all(_gone(pid) for pid in children), 60, "the children to exit")
    assert call("POST", "pause").status_code == 503


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True
