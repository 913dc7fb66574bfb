"""The step loop end to end: real broker, real Spark, real worker processes, an oracle."""

from __future__ import annotations

import json

from sparkstep.examples import keyed_sum
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
    produce_raw,
)


def test_keyed_sum_many_small_steps_checkpoint_and_in_process_recovery(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 300, keys=20, seed=1)
    produce_raw(bootstrap_servers, topic, [b"not json", None])
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    runtime = harness.build()
    harness.start()
    harness.wait_consumed({(topic, 0): 1, (topic, 1): 1})
    manifest = runtime.checkpoint(harness.state)
    assert (manifest.version, manifest.workers) == (1, 2)
    assert manifest.step > 0
    sent += produce_keyed(bootstrap_servers, topic, 100, keys=20, seed=2)
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    logged_before = runtime.next_step
    harness.stop()

    # A new runtime on the same stores and topics recovers from the checkpoint: it replays
    # (and discards) the steps logged after it, then goes on with new input.
    recovered = harness.build()
    assert recovered.manifest is not None and recovered.manifest.version == 1
    assert recovered.next_step == logged_before
    harness.start()
    sent += produce_keyed(bootstrap_servers, topic, 60, keys=20, seed=3)
    ends = {(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}
    harness.wait_consumed(ends)
    harness.stop()

    logged = assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )
    seen = read_committed_many(bootstrap_servers, [harness.output_topic])
    assert len(logged) > 10  # many small steps (at most 50 records each)
    assert sum(r["dlq_count"] for r in logged) == 2
    assert all(
        json.loads(r.value or b"{}")["weight"] in (1, -1) for r in seen[harness.output_topic]
    )
