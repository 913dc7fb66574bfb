"""The runtime control's GET /status carries the metrics of a real run (broker, Spark, worker).

The input holds an open transaction with committed records behind it, so the run shows an LSO
stall until the transaction commits; then every record is consumed and the lag drains to 0.
"""

from __future__ import annotations

import json
from typing import Any

from sparkstep.examples import keyed_sum
from sparkstep.runtime.control import ControlClient, control_app
from tests.io.fixtures import TxnInput
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    produce_keyed,
    produce_raw,
    wait_until,
)
from tests.serving import serving


def test_status_metrics_after_a_run_with_an_lso_stall(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("metrics", partitions=1)
    produce_keyed(bootstrap_servers, topic, 40, keys=5, seed=7)  # offsets 0..39
    produce_raw(bootstrap_servers, topic, [b"not json"])  # 40: a dead letter
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([json.dumps({"key": "k1", "value": 1}).encode()] * 5, keep_open=True)  # 41..45
    produce_keyed(bootstrap_servers, topic, 10, keys=5, seed=8)  # 46..55: behind the open one
    harness = harness_factory(
        keyed_sum.pipeline, {"events": topic}, workers=1, max_records_per_step=20
    )
    runtime = harness.build()
    harness.start()
    assert harness.state is not None
    app = control_app(runtime, harness.state, harness.token, on_stop=lambda: None)
    part = f"{topic}/0"
    with serving(app) as address, ControlClient(address, harness.token, timeout=300) as client:

        def metrics() -> dict[str, Any]:
            assert not harness.errors, harness.errors
            doc: dict[str, Any] = client.status()["metrics"]
            return doc

        # The stable input is consumed up to the open transaction, where the runtime waits.
        wait_until(lambda: metrics()["partitions"].get(part, {}).get("end") == 41, 240, "end at 41")
        held = metrics()["partitions"][part]
        assert held["stalled"] is True and held["lso_stalls"] >= 1
        assert (held["stable"], held["high"], held["lag"]) == (41, 56, 0)

        txn.finish(commit=True)
        wait_until(lambda: metrics()["partitions"][part]["end"] >= 56, 240, "all input consumed")
        wait_until(
            lambda: metrics()["partitions"][part]["stalled"] is False, 60, "the stall to clear"
        )
        snap = metrics()
        drained = snap["partitions"][part]
        assert drained["lag"] == 0 and drained["end"] == drained["stable"] == drained["high"]
        assert drained["lso_stalls"] == held["lso_stalls"]  # no stall after the commit
        assert snap["records_in"] == 56
        assert snap["dead_letters"] == 1
        assert snap["records_out"] > 0
        assert snap["steps"] == snap["last_step"] + 1 == runtime.next_step
        assert snap["replayed_steps"] == 0
        latency = snap["step_latency_seconds"]
        assert latency["count"] == snap["steps"] == latency["buckets"]["+Inf"]
        assert latency["sum"] > 0

        answer = client.checkpoint()
        checkpoints = metrics()["checkpoints"]
        assert checkpoints["count"] == 1
        assert checkpoints["recent"][-1]["version"] == answer["version"]
        assert checkpoints["recent"][-1]["step"] == answer["step"]
    harness.stop()
