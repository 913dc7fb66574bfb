"""The runtime process on the network: its control endpoint and Spark driver listen where they
are told and advertise a host, workers are dialled by their advertised addresses, and a pipeline
module that only exists as a file reaches the Spark executors through ``--py-files``. Real
broker, Spark and worker processes."""

from __future__ import annotations

import textwrap
from pathlib import Path

from sparkstep.runtime.process import EXIT_CONFIG
from tests.io.fixtures import high_watermark
from tests.runtime.driver.fixtures import (
    RuntimeFactory,
    assert_keyed_sum_exactly_once,
    produce_keyed,
    wait_until,
)
from tests.runtime.worker.fixtures import WorkerFactory

# The pipeline's own code: the stateless filter runs in the executors' Python workers, which
# unpickle ``even`` by reference to this module, so they must be able to import it.
PIPELINE_MODULE = textwrap.dedent(
    '''
    """A keyed sum of the even values only, as a file outside every import path."""
    from pyspark.sql import DataFrame
    from pyspark.sql.functions import col, pandas_udf
    from pyspark.sql.types import BooleanType

    from sparkstep import Pipeline, aggregate


    def even(values):
        return values % 2 == 0


    def transform(events: DataFrame) -> DataFrame:
        # The lambda travels by value; the module-level function it calls travels by reference.
        is_even = pandas_udf(lambda values: even(values), BooleanType())
        kept = events.where(is_even(col("value")))
        return aggregate(
            kept, name="sums", key=["key"], aggs={"sum": "sum(value)", "count": "count(*)"}
        )


    pipeline = Pipeline(
        name="even_sum",
        inputs={"events": "key string, value long"},
        transform=transform,
        output_key=["key"],
    )
    '''
)


def test_a_pipeline_shipped_with_py_files_runs_with_advertised_addresses(
    tmp_path: Path,
    bootstrap_servers: str,
    topic_factory,
    worker_factory: WorkerFactory,
    runtime_factory: RuntimeFactory,
    token_file: Path,
    unique_name: str,
) -> None:
    module_dir = tmp_path / "user_code"
    module_dir.mkdir()
    module = module_dir / f"even_sum_{unique_name}.py"
    module.write_text(PIPELINE_MODULE)
    topic = topic_factory("numbers", partitions=2)
    out = topic_factory("out", partitions=2)
    sent = produce_keyed(bootstrap_servers, topic, 80, keys=7, seed=51)
    state_dir = tmp_path / "state"
    stores = [state_dir / "workers" / f"w{i}" for i in range(2)]
    stores[0].parent.mkdir(parents=True)
    workers = [
        worker_factory(store=s, shards=256, args=("--bind", "0.0.0.0", "--advertise", "localhost"))
        for s in stores
    ]
    assert all(w.address == f"localhost:{w.port}" for w in workers)
    args = [
        "--pipeline", f"{module.stem}:pipeline",
        "--bootstrap-servers", bootstrap_servers,
        "--state-dir", str(state_dir),
        "--name", unique_name,
        "--input-topic", topic,
        "--output-topic", out,
        "--token-file", str(token_file),
        "--bind", "0.0.0.0",
        "--advertise", "localhost",
        *[arg for w in workers for arg in ("--worker", str(w.address))],
    ]  # fmt: skip
    log = tmp_path / "runtime.log"

    # Without --py-files the module is nowhere on the path: a configuration error, said once.
    missing = runtime_factory(args, log).start(timeout=600)
    assert missing.port is None
    assert missing.wait(60) == EXIT_CONFIG, missing.tail()

    runtime = runtime_factory([*args, "--py-files", str(module)], log).start(timeout=600)
    assert runtime.address == f"localhost:{runtime.port}", runtime.tail()
    token = token_file.read_text().strip()
    ends = {f"{topic}/{p}": high_watermark(bootstrap_servers, topic, p) for p in (0, 1)}

    def consumed() -> bool:
        got = runtime.control(token).status()["input_ends"]
        return all(got.get(k, 0) >= v for k, v in ends.items())

    wait_until(consumed, 300, "all input consumed")
    assert runtime.control(token).stop()["state"] == "stopped"
    assert runtime.wait(60) == 0, runtime.tail()
    even = [record for record in sent if record["value"] % 2 == 0]
    assert_keyed_sum_exactly_once(bootstrap_servers, out, f"{unique_name}.steps", even)
