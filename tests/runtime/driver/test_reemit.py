"""--on-replay-mismatch: a pipeline whose replay differs fails recovery, or is corrected."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from sparkstep import Pipeline, aggregate
from sparkstep.examples import keyed_sum
from sparkstep.io.errors import ReplayMismatchError
from tests.io.fixtures import high_watermark, read_committed_many
from tests.runtime.driver.fixtures import (
    HarnessFactory,
    integrate,
    keyed_sum_oracle,
    produce_keyed,
)


def _doubled(events: DataFrame) -> DataFrame:
    """keyed_sum's operator over doubled values: same fingerprint, other state and output."""
    doubled = events.withColumn("value", F.col("value") * 2)
    return aggregate(
        doubled, name="sums", key=["key"], aggs={"sum": "sum(value)", "count": "count(*)"}
    )


DOUBLED = Pipeline(
    name="keyed_sum",
    inputs=keyed_sum.pipeline.inputs,
    transform=_doubled,
    output_key=["key"],
)


def test_a_changed_pipeline_fails_replay_or_is_reemitted_exactly(
    harness_factory: HarnessFactory, bootstrap_servers: str, topic_factory
) -> None:
    topic = topic_factory("numbers", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 200, keys=15, seed=11)
    harness = harness_factory(keyed_sum.pipeline, {"events": topic})
    harness.build()
    harness.start()
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()  # no checkpoint after step 0: recovery replays every logged step
    assert harness.runtime is not None
    logged_next = harness.runtime.next_step
    assert logged_next > 2

    # The code changed: by default the first replayed step is a clear failure.
    harness.pipeline = DOUBLED
    with pytest.raises(ReplayMismatchError, match="step 0") as info:
        harness.build()
    assert info.value.correctable
    assert harness.runtime.writer is not None
    harness.runtime.writer.close()

    # reemit: every replayed step is corrected, then a checkpoint is taken at the next step.
    runtime = harness.build(on_replay_mismatch="reemit")
    assert runtime.corrected_steps == list(range(logged_next))
    assert runtime.manifest is not None
    assert (runtime.manifest.version, runtime.manifest.step) == (1, logged_next)
    harness.start()
    sent += produce_keyed(bootstrap_servers, topic, 80, keys=15, seed=12)
    harness.wait_consumed({(topic, p): high_watermark(bootstrap_servers, topic, p) for p in (0, 1)})
    harness.stop()
    # Recovering again replays nothing and corrects nothing.
    assert harness.build(on_replay_mismatch="reemit").corrected_steps == []

    seen = read_committed_many(bootstrap_servers, [harness.output_topic, f"{harness.name}.steps"])
    doubled = {k: (2 * s, c) for k, (s, c) in keyed_sum_oracle(sent).items()}
    expected = {(("count", c), ("key", k), ("sum", s)): 1 for k, (s, c) in doubled.items()}
    assert integrate(seen[harness.output_topic]) == expected
    logged = [json.loads(r.value or b"{}") for r in seen[f"{harness.name}.steps"]]
    steps = [r["step"] for r in logged if "correction" not in r]
    assert steps == list(range(len(steps)))
    corrections = [r for r in logged if "correction" in r]
    assert [(r["step"], r["correction"]) for r in corrections] == [
        (s, 1) for s in range(logged_next)
    ]
