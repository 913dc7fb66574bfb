"""A step's input is bounded in bytes as well as in records, and stays exactly once."""

from __future__ import annotations

from sparkstep.examples import keyed_sum
from tests.io.fixtures import high_watermark, read_committed
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
)


def test_each_step_reads_at_most_its_byte_budget(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 120, keys=6, seed=5)
    records = read_committed(bootstrap_servers, topic)
    size = {(r.partition, r.offset): len(r.key or b"") + len(r.value) for r in records}
    assert max(size.values()) <= 150  # every record fits in a range's share of the budget
    # The record budget alone would take everything in one step; the byte budget cuts it.
    budget = 300
    harness = harness_factory(
        keyed_sum.pipeline,
        {"events": topic},
        max_records_per_step=10_000,
        max_bytes_per_step=budget,
    )
    harness.build()
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()
    logged = assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )
    read = [
        sum(
            size.get((r["partition"], offset), 0)
            for r in record["division"]
            for offset in range(r["start"], r["end"])
        )
        for record in logged
    ]
    assert all(n <= budget for n in read)
    assert sum(read) == sum(size.values())
    assert len([n for n in read if n]) >= sum(size.values()) // budget
