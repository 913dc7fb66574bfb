"""Benchmark: sparkstep vs Spark Structured Streaming on the same keyed_sum input, in one run.

    .venv/bin/python -m bench.peers [--records 2000000] [--keys 100000] [--quick]
                                    [--max-records-per-step 200000] [--workers 2]
                                    [--systems sparkstep,ss-tuned,ss-default]

One private Kafka broker (temporary directory) for the whole run. Each system then runs in a
process of its own, so in a Spark JVM of its own, one after the other in the order of
``--systems``. A JVM compiles its hot code while it runs (HotSpot's C2 compiler alone kept
0.3-0.4 of the 2 cores busy through a whole sparkstep run), so a system run in a JVM that
another system had warmed would inherit the other's warm-up: with one shared JVM, Spark SS tuned
ran about a third faster after sparkstep than before it (BENCHMARKS.md), and the order decided
the comparison. In its process, each system:

1. produces its input: one 2-partition topic per system holding ``--records`` keyed_sum
   records (``{"key": "k<i>", "value": v}``, keys uniform over ``--keys``; the producer's seed
   is fixed, so every system gets the same records), before anything consumes it;
2. starts its SparkSession (``local[2,3]``, UI off, Arrow on, driver 4g, as ``bench.runtime``,
   with Spark's Kafka connector on its class path);
3. runs the plain Spark batch job over the backlog (``bench.runtime.baseline``) twice, which
   also warms the JVM the same way for every system; the best over all systems is the ``vs
   batch`` reference;
4. runs the system:

   - sparkstep (``bench.runtime.run_sparkstep``): keyed_sum through the runtime with
     ``--workers`` state workers, ``--max-records-per-step`` records a step, a checkpoint every
     ``--checkpoint-every`` seconds; then one-record steps;
   - Spark Structured Streaming, tuned or with defaults: the same aggregation as a streaming
     query, the Kafka source (``startingOffsets`` earliest, ``maxOffsetsPerTrigger`` =
     ``--max-records-per-step``) -> ``from_json`` -> ``groupBy(key).agg(sum(value), count(*))``
     -> the Kafka sink (key = ``key``, value = JSON ``{"key", "sum", "count"}``) in update mode,
     the RocksDB state store provider, the default trigger (each micro-batch as soon as the
     previous one ends), a checkpoint location on local disk. Tuned: 4 shuffle partitions (the
     state's partitions); defaults: 200. The query starts from a fresh checkpoint, works
     through the backlog, then takes one-record batches; then it is stopped.

The system's process prints its own details and hands its figures back as JSON; this process
prints the table.

Measured per system: records/s = records in the backlog / wall time from the start (the
runtime's recovery on a fresh state dir, the query's ``start()``) until the last backlog
step/batch ends, warm-up included; step or micro-batch latency p50/p99 (``_run_step`` time; the
progress' ``batchDuration``) over the backlog; the one-record latency, produce (acks=all) -> a
record readable on the output topic (read_committed for sparkstep, whose output is
transactional; read_uncommitted for Structured Streaming, whose sink is not), median of
``--single-trials`` with the system idle; and the output read back and checked against the true
sums (sparkstep: the Z-set integrated; Structured Streaming: the last row of each key).

Spark's Kafka connector, ``org.apache.spark:spark-sql-kafka-0-10_2.13`` (4.2.0: the newest on
Maven Central; it runs on pyspark 4.3) and its dependencies, is fetched once by Maven into the
sparkstep cache dir (``$SPARKSTEP_CACHE`` or ``~/.cache/sparkstep``), as the broker is; the jars
pyspark already ships are left to pyspark's own versions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.runtime import (
    INPUT_PARTITIONS,
    OUTPUT_PARTITIONS,
    ROOT_ENV,
    Input,
    SparkstepOptions,
    baseline,
    check_output,
    drain,
    make_input,
    output_consumer,
    percentile,
    readable_after,
    run_sparkstep,
    spark_session,
)

SYSTEMS = ("sparkstep", "ss-tuned", "ss-default")
SPARK_KAFKA_VERSION = "4.2.0"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

_POM = f"""<?xml version="1.0" encoding="UTF-8"?>
<!-- Spark's Kafka source and sink for bench.peers (fetched by sparkstep.io.broker's
     install_maven_jars; nothing is built). -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.sparkstep</groupId>
  <artifactId>sparkstep-bench-spark-kafka</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.spark</groupId>
      <artifactId>spark-sql-kafka-0-10_2.13</artifactId>
      <version>{SPARK_KAFKA_VERSION}</version>
    </dependency>
  </dependencies>
  <build><plugins><plugin>
    <groupId>org.apache.maven.plugins</groupId>
    <artifactId>maven-dependency-plugin</artifactId>
    <version>3.8.1</version>
  </plugin></plugins></build>
</project>
"""

_JAR = re.compile(r"^(.+?)-\d+\.[^-]*(?:-.*)?\.jar$")  # a version starts "<digits>."


def _artifact(jar: str) -> str:
    """``kafka-clients-3.9.2.jar`` -> ``kafka-clients``."""
    match = _JAR.match(jar)
    return match.group(1) if match else jar


def spark_kafka_jars() -> list[str]:
    """The jars Spark's Kafka connector needs beyond pyspark's own, installed once."""
    import pyspark

    from sparkstep.io.broker import default_cache_dir, install_maven_jars

    libs = install_maven_jars(
        default_cache_dir(), "spark-sql-kafka", _POM.encode(), "Spark's Kafka connector"
    )
    shipped = {_artifact(j.name) for j in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    return sorted(str(j) for j in libs.glob("*.jar") if _artifact(j.name) not in shipped)


@dataclass
class StreamingRun:
    """What :func:`run_streaming` measured."""

    shuffle_partitions: int
    records: int
    run_s: float
    batches_ms: list[float]
    single_readable: list[float]
    output_check: str

    @property
    def rate(self) -> float:
        return self.records / self.run_s


def _progress(query: Any) -> list[dict[str, Any]]:
    """The query's recent progress reports as dicts."""
    reports = []
    for report in query.recentProgress:
        reports.append(json.loads(report.json) if hasattr(report, "json") else dict(report))
    return reports


def _end_offsets(report: dict[str, Any], topic: str) -> dict[int, int]:
    end = report["sources"][0]["endOffset"]
    if isinstance(end, str):
        end = json.loads(end)
    return {int(p): int(o) for p, o in end.get(topic, {}).items()}


def run_streaming(
    spark: Any,
    inp: Input,
    tmp: Path,
    shuffle_partitions: int,
    batch_records: int,
    single_trials: int,
    timeout: float,
) -> StreamingRun:
    """keyed_sum as a Structured Streaming query over ``inp``'s topic; see the module docstring."""
    from confluent_kafka import Producer
    from pyspark.sql import functions as F

    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.topics import TopicAdmin

    output_topic = f"ss{shuffle_partitions}-{uuid.uuid4().hex[:8]}-out"
    TopicAdmin(KafkaConfig(inp.bootstrap, timeout_s=60)).ensure_topic(
        output_topic, OUTPUT_PARTITIONS
    )
    records = sum(inp.ends.values())
    target = dict(inp.ends)
    previous = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    try:
        source = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", inp.bootstrap)
            .option("subscribe", inp.topic)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", str(batch_records))
            .load()
        )
        doc = F.from_json(F.col("value").cast("string"), "key string, value long").alias("j")
        sums = (
            source.select(doc)
            .select("j.key", "j.value")
            .groupBy("key")
            .agg(F.sum("value").alias("sum"), F.count("*").alias("count"))
        )
        out = sums.select("key", F.to_json(F.struct("key", "sum", "count")).alias("value"))
        started = time.perf_counter()
        query = (
            out.writeStream.format("kafka")
            .option("kafka.bootstrap.servers", inp.bootstrap)
            .option("topic", output_topic)
            .option("checkpointLocation", str(tmp / f"ss-checkpoint-{shuffle_partitions}"))
            .outputMode("update")
            .start()
        )
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", previous)
    try:
        # The backlog: done when a batch's end offsets reach the topic's ends.
        while True:
            if not query.isActive:
                raise AssertionError(f"the streaming query stopped: {query.exception()}")
            assert time.perf_counter() - started < timeout, f"input not consumed in {timeout} s"
            report = query.lastProgress
            if report is not None:
                ends = _end_offsets(json.loads(report.json), inp.topic)
                if all(ends.get(p, 0) >= end for p, end in target.items()):
                    break
            time.sleep(0.05)
        run_s = time.perf_counter() - started
        batches_ms = [float(r["batchDuration"]) for r in _progress(query) if r["numInputRows"]]
        print(
            f"Structured Streaming ({shuffle_partitions} shuffle partitions) consumed the input "
            f"in {run_s:.1f} s ({len(batches_ms)} batches)",
            flush=True,
        )
        # One-record batches, with the query idle.
        producer = Producer({"bootstrap.servers": inp.bootstrap, "acks": "all"})
        consumer = output_consumer(inp.bootstrap, output_topic, committed=False)
        single: list[float] = []
        try:
            for i in range(single_trials):
                drain(consumer, 0.5)
                s0 = time.perf_counter()
                inp.send_one(producer, 0, 1, i % INPUT_PARTITIONS)
                single.append(readable_after(consumer, s0, 60))
        finally:
            consumer.close()
        # Let the last trial's batch finish, so the output is complete when read back.
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            report = query.lastProgress
            ends = _end_offsets(json.loads(report.json), inp.topic)
            if all(ends.get(p, 0) >= end for p, end in inp.ends.items()):
                break
            time.sleep(0.05)
    finally:
        query.stop()
    check = check_output(spark, inp.bootstrap, output_topic, inp.truth, "last")
    return StreamingRun(shuffle_partitions, records, run_s, batches_ms, single, check)


def _row(
    label: str,
    rate: float,
    tuned: float | None,
    batch: float,
    latencies_ms: list[float],
    single: list[float],
    check: str,
) -> list[str]:
    def ms(value: float) -> str:
        return f"{value:,.0f} ms" if value == value else "-"  # NaN: no figure

    return [
        label,
        f"{rate:,.0f}",
        f"{rate / tuned:.2f}" if tuned else "-",
        f"{rate / batch:.3f}",
        ms(percentile(latencies_ms, 50)),
        ms(percentile(latencies_ms, 99)),
        ms(statistics.median(single) * 1000) if single else "-",
        check,
    ]


def run(args: argparse.Namespace, tmp: Path) -> None:
    """The whole run: the broker, each system in a process of its own, then the table."""
    from sparkstep.io.broker import LocalBroker, default_cache_dir, find_free_port, install_kafka

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown --systems {unknown}: choose among {', '.join(SYSTEMS)}")
    spark_kafka_jars()  # fetched once, before anything is timed
    broker = LocalBroker(tmp / "kafka", find_free_port(), install_kafka(default_cache_dir()))
    try:
        broker.start()
        results: dict[str, dict[str, Any]] = {}
        for system in systems:
            result = tmp / f"{system}.json"
            command = [
                *(sys.executable, "-m", "bench.peers", *sys.argv[1:]),
                *("--system", system, "--bootstrap", broker.bootstrap_servers),
                *("--result", str(result)),
            ]
            # The system's process counts the broker under this one (bench.runtime.cpu_by_role).
            env = {**os.environ, ROOT_ENV: str(os.getpid())}
            subprocess.run(command, check=True, env=env)
            results[system] = json.loads(result.read_text())
        _print_table(args, systems, results)
    finally:
        broker.stop()


def run_system(args: argparse.Namespace, tmp: Path) -> None:
    """One system's process (``--system``): its input, its SparkSession, the batch job twice,
    the system; its figures go to ``--result`` as JSON."""
    system = args.system
    inp = make_input(args.bootstrap, f"peers-{system}", args.records, args.keys)
    spark = spark_session(
        f"sparkstep-bench-peers-{system}",
        {
            "spark.jars": ",".join(spark_kafka_jars()),
            "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        },
    )
    try:
        expect = inp.truth.totals()
        batch_s = [baseline(spark, inp.bootstrap, inp.topic, inp.ends, expect) for _ in range(2)]
        print(f"Spark batch job: {' / '.join(f'{b:.1f}' for b in batch_s)} s", flush=True)
        figures: dict[str, Any] = {"batch_s": batch_s}
        if system == "sparkstep":
            ours = run_sparkstep(spark, inp, tmp / "sparkstep", SparkstepOptions.of(args))
            print("sparkstep in detail:")
            for label, value in ours.rows():
                print(f"  {label:<50}{value:>16}")
            print(
                "  steps (records:ms = Spark stage (worker applies) / digests / encode / write): "
                + ours.step_lines()
            )
            figures.update(rate=ours.rate, latencies_ms=ours.step_latencies_ms(),
                           single=ours.single_readable, check=ours.output_check)  # fmt: skip
        else:
            partitions = 4 if system == "ss-tuned" else 200
            ss = run_streaming(spark, inp, tmp, partitions, args.max_records_per_step,
                               args.single_trials, args.timeout)  # fmt: skip
            print(f"{system} batches (ms): {', '.join(f'{b:.0f}' for b in ss.batches_ms)}")
            figures.update(rate=ss.rate, latencies_ms=ss.batches_ms, single=ss.single_readable,
                           check=ss.output_check)  # fmt: skip
        sys.stdout.flush()
        Path(args.result).write_text(json.dumps(figures))
    finally:
        spark.stop()


def _print_table(
    args: argparse.Namespace, systems: list[str], results: dict[str, dict[str, Any]]
) -> None:
    batch_s = min(s for figures in results.values() for s in figures["batch_s"])
    batch_rate = args.records / batch_s
    tuned = results["ss-tuned"]["rate"] if "ss-tuned" in results else None
    header = ["system", "records/s", "vs SS tuned", "vs batch", "step/batch p50",
              "step/batch p99", "one record", "output"]  # fmt: skip
    versus_tuned = f"{batch_rate / tuned:.2f}" if tuned else "-"
    runs = sum(len(figures["batch_s"]) for figures in results.values())
    rows = [[f"plain Spark batch job (best of {runs})", f"{batch_rate:,.0f}", versus_tuned,
             "1.000", "", "", "", "ok"]]  # fmt: skip
    names = {"sparkstep": f"sparkstep ({args.workers} workers)",
             "ss-tuned": "Spark SS, tuned (4 shuffle partitions, RocksDB)",
             "ss-default": "Spark SS, defaults (200 shuffle partitions, RocksDB)"}  # fmt: skip
    for system in systems:
        figures = results[system]
        rows.append(
            _row(names[system], figures["rate"], tuned, batch_rate, figures["latencies_ms"],
                 figures["single"], figures["check"])
        )  # fmt: skip
    print()
    print(
        f"keyed_sum: {args.records:,} records, {args.keys:,} keys, {INPUT_PARTITIONS} input "
        f"partitions, {args.max_records_per_step:,} records a step/batch "
        f"(maxOffsetsPerTrigger), {args.single_trials} one-record trials, each system in a "
        "Spark JVM of its own"
    )
    print("| " + " | ".join(header) + " |")
    print("| --- | " + " | ".join("---:" for _ in header[1:-1]) + " | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument(
        "--quick", action="store_true", help="200k records over 10k keys, 50k a step"
    )
    parser.add_argument(
        "--max-records-per-step",
        type=int,
        default=None,
        help="sparkstep's step size and Structured Streaming's maxOffsetsPerTrigger (200000)",
    )
    parser.add_argument("--workers", type=int, default=2, help="sparkstep's state workers")
    parser.add_argument("--checkpoint-every", type=float, default=10.0)
    parser.add_argument("--single-trials", type=int, default=5)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which, in this order")
    parser.add_argument("--timeout", type=float, default=1800.0)
    # A system's own process (started by ``run``): which system, the broker, where its figures go.
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.records, args.keys = 200_000, 10_000
    if args.max_records_per_step is None:
        args.max_records_per_step = 50_000 if args.quick else 200_000
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="sparkstep-bench-peers-") as tmp:
        (run_system if args.system else run)(args, Path(tmp))


if __name__ == "__main__":
    main()
