"""Fencing across runtimes (issue 14 item 4): a runtime that was replaced while it was slow or
partitioned can change neither the stores nor the manifest, and the output stays exactly once.
Real broker, Spark and worker processes; the two runtimes share this process."""

from __future__ import annotations

import pytest

from sparkstep.examples import keyed_sum
from sparkstep.runtime.errors import ManifestConflictError
from sparkstep.runtime.manifest import ManifestLease, read_manifest
from sparkstep.storage import StoreFencedError
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
)


def test_a_replaced_runtime_changes_neither_the_stores_nor_the_manifest(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 120, keys=15, seed=71)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    old = harness.build()
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()  # the old runtime's loop ends; the runtime (its lease, its clients) lives on
    before = read_manifest(harness.state_dir)
    assert before is not None

    # A successor claims the state dir while the old runtime checkpoints: the old one's commits
    # reach the stores (the successor has not called them yet), its manifest does not.
    ManifestLease.claim(harness.state_dir)
    with pytest.raises(ManifestConflictError, match="has replaced this one"):
        old.checkpoint(None)
    assert read_manifest(harness.state_dir) == before

    # The successor recovers from the manifest (the old one's commit is an uncommitted v+1,
    # discarded), and from then on the old runtime cannot touch a store.
    new = harness.build()
    assert new.manifest == before
    for client in old.workers:
        with pytest.raises(StoreFencedError, match="was replaced by a newer owner"):
            client.commit(old.next_step)
        with pytest.raises(StoreFencedError):
            client.open(before.version)
    with pytest.raises(ManifestConflictError):
        old.lease.write(before, expected=before.version)

    harness.start()
    sent += produce_keyed(bootstrap_servers, topic, 60, keys=15, seed=72)
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    new.checkpoint(harness.state)
    harness.stop()
    assert_keyed_sum_exactly_once(
        bootstrap_servers, harness.output_topic, f"{harness.name}.steps", sent
    )
