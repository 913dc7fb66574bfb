"""Benchmark: the runtime end to end (issue 6): keyed_sum over Kafka vs one plain Spark batch job.

    .venv/bin/python -m bench.runtime [--records 2000000] [--keys 100000] [--quick]
                                      [--max-records-per-step 200000] [--checkpoint-every 10]

Self-contained: a private Kafka broker in a temporary directory, a SparkSession (``local[2,3]``,
UI off, 4 shuffle partitions), two worker processes (``python -m sparkstep.runtime.worker``) on
a temporary state dir. In one run:

1. ``--records`` keyed_sum records (``{"key": "k<i>", "value": v}``, keys uniform over
   ``--keys``) are produced into a 2-partition input topic before the runtime starts, so the
   runtime works through a backlog at its own pace (its ceiling, not the producer's).
2. The :class:`~sparkstep.runtime.driver.Runtime` runs ``keyed_sum`` in a thread; the main
   thread calls ``runtime.checkpoint(state)`` every ``--checkpoint-every`` seconds until the
   whole input is logged. Every step is timed around ``Runtime._run_step`` (Spark read, decode,
   worker applies, state digests, the output transaction with its step log record); the
   sustained rate is records / wall time from the loop's start to the last step, checkpoints
   included.
3. One-record steps: with the loop idle, one record is produced (acks=all) and the time until
   its step is logged is measured (end to end, including the loop's 0.1 s input poll), together
   with that step's own ``_run_step`` time; a few times, the median is reported.
4. The baseline: the same aggregation as one plain Spark batch job over the same records: the
   whole offset range of each partition read on the executors (``map_read``, as a step reads,
   one task per partition), ``from_json`` of the value,
   ``groupBy(key).agg(sum(value), count(*))``, the result collected with ``toArrow()``. Run
   twice (the first run warms the Python workers); the best is Spark's own ceiling on this
   machine. Its result is checked against the sums the producer computed. The ratio is
   ours / baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

INPUT_PARTITIONS = 2
WORKERS = 2


@dataclass(frozen=True)
class StepTiming:
    step: int
    records: int
    seconds: float
    end: float  # time.perf_counter() when the step was logged


def make_timed_runtime_class() -> Any:
    """A Runtime that times every ``_run_step`` (imported late: pyspark loads slowly)."""
    from sparkstep.io.division import Division
    from sparkstep.runtime.driver import Runtime

    class TimedRuntime(Runtime):
        timings: list[StepTiming]
        phases: dict[str, float]

        def _run_step(self, division: Division) -> None:
            start = time.perf_counter()
            super()._run_step(division)
            elapsed = time.perf_counter() - start
            self.timings.append(
                StepTiming(division.step, division.offset_count, elapsed, start + elapsed)
            )

        def recover(self) -> Any:
            """Recover, then time the Spark stage and the output write of every step."""
            first = super().recover()
            assert self.writer is not None
            self.phases = {"spark": 0.0, "write": 0.0}
            self.runner.run = _timed(self.runner.run, self.phases, "spark")  # type: ignore[method-assign]
            self.writer.write = _timed(self.writer.write, self.phases, "write")  # type: ignore[method-assign]
            return first

    return TimedRuntime


def _timed(fn: Any, into: dict[str, float], phase: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[phase] += time.perf_counter() - start

    return call


def _stat(pid: int) -> tuple[int, float, float]:
    """(parent pid, own CPU seconds, CPU seconds of reaped children) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (
        int(fields[1]),
        (int(fields[11]) + int(fields[12])) / tick,
        (int(fields[13]) + int(fields[14])) / tick,
    )


def cpu_by_role() -> dict[str, float]:
    """CPU seconds of this process and its descendants, by role (from /proc).

    Roles: ``driver`` (this Python process), ``spark jvm``, ``spark python`` (pyspark's daemon
    and its forked workers, with their reaped children), ``state workers``, ``kafka broker``.
    """
    procs: dict[int, tuple[int, float, float, bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent, own, reaped = _stat(int(entry.name))
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        procs[int(entry.name)] = (parent, own, reaped, cmdline)
    me = os.getpid()
    totals = dict.fromkeys(
        ("driver", "spark jvm", "spark python", "state workers", "kafka broker"), 0.0
    )
    for pid, (_, own, reaped, cmdline) in procs.items():
        ancestor = pid
        while ancestor in procs and ancestor != me:
            ancestor = procs[ancestor][0]
        if ancestor != me:
            continue
        if pid == me:
            totals["driver"] += own
        elif b"sparkstep.runtime.worker" in cmdline:
            totals["state workers"] += own
        elif b"kafka.Kafka" in cmdline:
            totals["kafka broker"] += own
        elif b"java" in cmdline.split(b"\0")[0]:
            totals["spark jvm"] += own
        elif b"pyspark" in cmdline:
            totals["spark python"] += own + reaped
    return totals


def machine_busy_seconds() -> float:
    """CPU seconds (all cores) the machine spent not idle, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def produce(bootstrap: str, topic: str, records: int, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Produce the input; return (key ids, values) so the baseline's result can be checked."""
    from confluent_kafka import Producer

    rng = np.random.default_rng(6)
    key_ids = rng.integers(0, keys, records)
    values = rng.integers(-50, 100, records)
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
         "linger.ms": 20, "batch.size": 1_000_000, "queue.buffering.max.messages": 1_000_000}
    )  # fmt: skip
    for i, (k, v) in enumerate(zip(key_ids.tolist(), values.tolist(), strict=True)):
        key = b"k%d" % k
        doc = b'{"key": "k%d", "value": %d}' % (k, v)
        while True:
            try:
                producer.produce(topic, key=key, value=doc, partition=i % INPUT_PARTITIONS)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(120) == 0, "input not delivered"
    return key_ids, values


def start_worker(store: Path, token_file: Path, shards: int) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m sparkstep.runtime.worker`` on ``store``; returns (process, address)."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store.parent / f"{store.name}.log", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkstep.runtime.worker", "--store", str(store),
             "--port", "0", "--token-file", str(token_file), "--shards", str(shards),
             "--lock-timeout", "30"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        raise RuntimeError(f"worker exited before ready: {(store.parent / f'{store.name}.log')}")
    return proc, f"127.0.0.1:{json.loads(line)['port']}"


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """Close its stdin (the worker exits on EOF); SIGKILL if it has not exited in 10 s."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    if proc.stdout is not None and not proc.stdout.closed:
        proc.stdout.close()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def baseline(
    spark: Any, bootstrap: str, topic: str, ends: dict[int, int], expect: dict[str, Any]
) -> float:
    """One plain Spark batch job: read, from_json, groupBy(key).agg(sum, count), collect."""
    from pyspark.sql import functions as F

    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.ranges import RANGES_DDL, READ_DDL, map_read

    config = KafkaConfig(bootstrap, timeout_s=60)
    start = time.perf_counter()
    rows = [(topic, p, 0, end, None) for p, end in sorted(ends.items())]
    ranges = spark.createDataFrame(spark.sparkContext.parallelize(rows, len(rows)), RANGES_DDL)
    records = ranges.mapInArrow(map_read(config), READ_DDL).where("not __summary")
    parsed = records.select(
        F.from_json(F.col("value").cast("string"), "key string, value long").alias("j")
    ).select("j.key", "j.value")
    result = parsed.groupBy("key").agg(F.sum("value").alias("sum"), F.count("*").alias("count"))
    table = result.toArrow()
    elapsed = time.perf_counter() - start
    got = {
        "keys": table.num_rows,
        "records": int(sum(table.column("count").to_pylist())),
        "sum": int(sum(table.column("sum").to_pylist())),
    }
    assert got == expect, f"baseline result {got} != produced {expect}"
    return elapsed


def run(args: argparse.Namespace, tmp: Path) -> None:
    from confluent_kafka import Producer
    from pyspark.sql import SparkSession

    from sparkstep.cli import default_cache_dir
    from sparkstep.examples.keyed_sum import pipeline
    from sparkstep.io.broker import LocalBroker, find_free_port, install_kafka
    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.topics import TopicAdmin
    from sparkstep.runtime.driver import RuntimeOptions
    from sparkstep.runtime.runstate import RunState
    from sparkstep.runtime.worker import WorkerClient

    broker = LocalBroker(tmp / "kafka", find_free_port(), install_kafka(default_cache_dir()))
    workers: list[subprocess.Popen[bytes]] = []
    spark: Any = None
    try:
        # Step 1. Broker, topics, input.
        broker.start()
        bootstrap = broker.bootstrap_servers
        config = KafkaConfig(bootstrap, timeout_s=60)
        admin = TopicAdmin(config)
        name = f"bench{uuid.uuid4().hex[:8]}"
        topic, output_topic = f"{name}-in", f"{name}-out"
        admin.ensure_topic(topic, INPUT_PARTITIONS)
        admin.ensure_topic(output_topic, 2)
        t0 = time.perf_counter()
        key_ids, values = produce(bootstrap, topic, args.records, args.keys)
        produce_s = time.perf_counter() - t0
        stable = admin.offsets([(topic, p) for p in range(INPUT_PARTITIONS)], "stable")
        ends = {p: stable[(topic, p)] for p in range(INPUT_PARTITIONS)}
        expect = {
            "keys": int(np.unique(key_ids).size),
            "records": args.records,
            "sum": int(values.sum()),
        }
        print(f"produced {args.records:,} records in {produce_s:.1f} s", flush=True)

        # Step 2. Spark, workers, the runtime.
        os.environ["PYSPARK_PYTHON"] = sys.executable
        spark = (
            SparkSession.builder.master("local[2,3]")
            .appName("sparkstep-bench-runtime")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.default.parallelism", "2")
            .config("spark.speculation", "false")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.driver.memory", "4g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        state_dir = tmp / "state"
        token_file = tmp / "token"
        token = uuid.uuid4().hex
        token_file.write_text(token + "\n")
        addresses = []
        for i in range(WORKERS):
            store = state_dir / "workers" / f"w{i}"
            proc, address = start_worker(store, token_file, pipeline.shards)
            workers.append(proc)
            addresses.append(address)
        options = RuntimeOptions(
            name=name,
            state_dir=state_dir,
            token=token,
            topics={"events": topic},
            output_topic=output_topic,
            stores=tuple(f"workers/w{i}" for i in range(WORKERS)),
            max_records_per_step=args.max_records_per_step,
        )
        runtime = make_timed_runtime_class()(
            spark,
            pipeline,
            options,
            config,
            [WorkerClient(a, token, timeout=300.0) for a in addresses],
        )
        runtime.timings = []
        runtime.recover()
        state = RunState()
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                runtime.run(state)
            except BaseException as exc:
                errors.append(exc)

        def logged(target: dict[int, int]) -> bool:
            previous = runtime._previous
            return previous is not None and all(
                previous.ends().get((topic, p), 0) >= end for p, end in target.items()
            )

        # Step 3. The backlog, with a checkpoint every --checkpoint-every seconds.
        checkpoints: list[float] = []
        pauses: list[float] = []
        thread = threading.Thread(target=loop, daemon=True)
        roles0 = cpu_by_role()
        busy0 = machine_busy_seconds()
        load0 = os.getloadavg()[0]
        started = time.perf_counter()
        thread.start()
        last_checkpoint = started
        deadline = started + args.timeout
        while not logged(ends):
            assert not errors, errors
            assert time.perf_counter() < deadline, f"input not consumed in {args.timeout} s"
            if time.perf_counter() - last_checkpoint >= args.checkpoint_every:
                # Pause first (idempotent; checkpoint() pauses again at once), so the wait for
                # the step in flight is told apart from the checkpoint procedure itself. A loop
                # paused before checkpoint() stays paused after it: resume it here.
                c0 = time.perf_counter()
                state.pause(300)
                c1 = time.perf_counter()
                runtime.checkpoint(state)
                checkpoints.append(time.perf_counter() - c1)
                pauses.append(c1 - c0)
                state.resume()
                last_checkpoint = time.perf_counter()
            time.sleep(0.05)
        run_s = time.perf_counter() - started
        busy = machine_busy_seconds() - busy0
        roles = {role: cpu - roles0[role] for role, cpu in cpu_by_role().items()}
        phases = dict(runtime.phases)
        big_steps = list(runtime.timings)
        print(f"runtime consumed the input in {run_s:.1f} s ({len(big_steps)} steps)", flush=True)

        # Step 4. One-record steps, with the loop idle.
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
        single_e2e: list[float] = []
        single_step: list[float] = []
        for i in range(args.single_trials):
            time.sleep(0.5)  # let the loop settle into its input wait
            n_before = len(runtime.timings)
            p = i % INPUT_PARTITIONS
            s0 = time.perf_counter()
            producer.produce(topic, value=b'{"key": "k0", "value": 1}', partition=p)
            assert producer.flush(30) == 0
            ends[p] += 1
            while not logged(ends):
                assert not errors, errors
                assert time.perf_counter() - s0 < 60, "one-record step not logged in 60 s"
                time.sleep(0.001)
            single_e2e.append(time.perf_counter() - s0)
            new = [t for t in runtime.timings[n_before:] if t.records > 0]
            single_step.append(new[-1].seconds)
        expect["records"] += args.single_trials
        expect["sum"] += args.single_trials
        state.stop(state.pause(timeout=300), timeout=300)
        thread.join(60)
        assert not errors, errors

        # Step 5. The baseline, twice (the first warms the Python workers).
        base = [baseline(spark, bootstrap, topic, ends, expect) for _ in range(2)]
        base_s = min(base)
        total = args.records + args.single_trials
        base_rate = total / base_s

        # Step 6. The table.
        ours_rate = args.records / run_s
        # After the first step (the session's warm-up: Python workers, imports, codegen).
        first, last = big_steps[0], big_steps[-1]
        steady = (
            (args.records - first.records) / (last.end - first.end)
            if len(big_steps) > 1
            else float("nan")
        )
        lat = [t.seconds * 1000 for t in big_steps]
        step_rates = [t.records / t.seconds for t in big_steps if t.records]
        print()
        print(
            f"keyed_sum: {args.records:,} records, {args.keys:,} keys, {INPUT_PARTITIONS} input "
            f"partitions, {WORKERS} workers, max {args.max_records_per_step:,} records/step, "
            f"checkpoint every {args.checkpoint_every:g} s"
        )
        print(f"{'measure':<50}{'value':>16}")
        rows = [
            ("sparkstep sustained records/s (ckpts incl.)", f"{ours_rate:,.0f}"),
            ("  wall time to consume the input (s)", f"{run_s:.1f}"),
            ("  after the first step (warm-up), ckpts incl.", f"{steady:,.0f}"),
            ("  first step (ms)", f"{first.seconds * 1000:,.0f}"),
            ("  steps", f"{len(big_steps)}"),
            ("  records/s within steps (median)", f"{statistics.median(step_rates):,.0f}"),
            ("  step latency p50 (ms)", f"{percentile(lat, 50):,.0f}"),
            ("  step latency p99 (ms)", f"{percentile(lat, 99):,.0f}"),
            ("  step latency max (ms)", f"{max(lat):,.0f}"),
            ("  step time in Spark stage / output write (s)",
             f"{phases['spark']:.1f} / {phases['write']:.1f}"),
            ("  checkpoints", f"{len(checkpoints)}"),
            ("  checkpoint: wait for step in flight, median ms",
             f"{statistics.median(pauses) * 1000 if pauses else 0:,.0f}"),
            ("  checkpoint procedure median / max ms",
             f"{statistics.median(checkpoints) * 1000 if checkpoints else 0:,.0f} / "
             f"{max(checkpoints) * 1000 if checkpoints else 0:,.0f}"),
            ("  CPU s, whole machine (other users too)", f"{busy:.0f}"),
            ("  load average 1 min, before / after", f"{load0:.1f} / {os.getloadavg()[0]:.1f}"),
            *[(f"  CPU s, {role}", f"{cpu:.0f}") for role, cpu in roles.items()],
            ("one-record step, produce->logged median (ms)",
             f"{statistics.median(single_e2e) * 1000:,.0f}"),
            ("one-record step, _run_step median (ms)",
             f"{statistics.median(single_step) * 1000:,.0f}"),
            ("Spark batch job records/s (best of 2)", f"{base_rate:,.0f}"),
            ("  Spark batch job runs (s)", " / ".join(f"{b:.1f}" for b in base)),
            ("ratio sparkstep / Spark batch", f"{ours_rate / base_rate:.3f}x"),
        ]  # fmt: skip
        for label, value in rows:
            print(f"{label:<50}{value:>16}")
        print(f"(input produced in {produce_s:.1f} s, {args.records / produce_s:,.0f} records/s)")
        steps = ", ".join(f"{t.records}:{t.seconds * 1000:.0f}" for t in big_steps)
        print(f"steps (records:ms): {steps}")
        sys.stdout.flush()
    except BaseException:
        # A failed run: say what became of the workers before their logs are deleted.
        for i, proc in enumerate(workers):
            log_file = tmp / "state" / "workers" / f"w{i}.log"
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            print(f"worker {i}: exit code {proc.poll()}; log tail:\n{tail}", file=sys.stderr)
        raise
    finally:
        # Step 7. Clean up: workers, Spark, broker.
        for proc in workers:
            stop_worker(proc)
        if spark is not None:
            spark.stop()
        broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="200k records over 10k keys")
    parser.add_argument("--max-records-per-step", type=int, default=200_000)
    parser.add_argument("--checkpoint-every", type=float, default=10.0)
    parser.add_argument("--single-trials", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if args.quick:
        args.records, args.keys = 200_000, 10_000
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="sparkstep-bench-runtime-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
