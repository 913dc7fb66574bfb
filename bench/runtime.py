"""Benchmark: the runtime end to end (issue 6): keyed_sum over Kafka vs one plain Spark batch job.

    .venv/bin/python -m bench.runtime [--records 2000000] [--keys 100000] [--quick]
                                      [--workers 2] [--max-records-per-step 200000]
                                      [--checkpoint-every 10]

Self-contained: a private Kafka broker in a temporary directory, a SparkSession (``local[2,3]``,
UI off, 4 shuffle partitions), ``--workers`` state worker processes (``python -m
bench.timed_worker``: ``sparkstep.runtime.worker`` logging the wall time of every ``apply``) on a
temporary state dir. In one run:

1. ``--records`` keyed_sum records (``{"key": "k<i>", "value": v}``, keys uniform over
   ``--keys``) are produced into a 2-partition input topic before the runtime starts, so the
   runtime works through a backlog at its own pace (its ceiling, not the producer's).
2. The :class:`~sparkstep.runtime.driver.Runtime` runs ``keyed_sum`` in a thread; the main
   thread calls ``runtime.checkpoint(state)`` every ``--checkpoint-every`` seconds until the
   whole input is logged. Every step is timed from the start of its ``Runtime._run_step`` (on
   Spark) to the end of its ``Runtime._write_step`` (committed; writes are pipelined with the
   next step's Spark stage) and broken down (:class:`StepTiming`) by wrappers around what the
   runtime calls, without changing it: the Spark stage (``StepRunner.run``), within it the
   workers' applies (from the workers' apply logs: the union of their intervals, so parallel
   applies count once, and their sum), the state digests (``WorkerClient.status``), the output
   encoding (``encode_output`` and ``output_digest`` of ``sparkstep.io.output``) and the rest of
   ``OutputWriter.write`` (the transaction). The sustained rate is records / wall time from the
   start of the runtime's recovery (on this fresh state dir: building the step's plan, fencing
   the output writer, opening the stores; Spark Structured Streaming's time in ``bench.peers``
   starts with its query's start) to the last step, checkpoints included. Spark's event log (one
   JSON file in the run's temporary directory) gives the time in which Spark ran no step's job
   (:func:`spark_idle`): what the loop costs beyond Spark, from its start to the first job,
   between two steps, and between two steps at a checkpoint.
3. One-record steps: with the loop idle, one record is produced (acks=all) and the time until
   its step is logged and until its output is readable (a read_committed consumer on the output
   topic) is measured, together with that step's own time (Spark to commit); a few times, the
   median is reported.
4. The baseline: the same aggregation as one plain Spark batch job over the same records: the
   whole offset range of each partition read on the executors (``map_read``, as a step reads,
   one task per partition), ``from_json`` of the value,
   ``groupBy(key).agg(sum(value), count(*))``, the result collected with ``toArrow()``. Run
   twice (the first run warms the Python workers); the best is Spark's own ceiling on this
   machine. Its result is checked against the sums the producer computed. The ratio is
   ours / baseline.
5. The output topic is read back (read_committed, on the executors) and integrated: every key
   must have exactly one row left, with the true sum and count.

``bench.peers`` runs the same harness (:func:`run_sparkstep`) beside Spark Structured Streaming.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bench.timed_worker import read_apply_log
from sparkstep.io.broker import default_cache_dir
from sparkstep.runtime.jvm import driver_java_options

INPUT_PARTITIONS = 2
OUTPUT_PARTITIONS = 2

#: The driver-side phases of a step, as :class:`StepTiming` keeps them (seconds).
PHASES = ("spark", "digests", "encode", "write")


@dataclass(frozen=True)
class StepTiming:
    step: int
    records: int
    seconds: float
    end: float  # time.perf_counter() when the step was logged
    phases: dict[str, float] = field(default_factory=dict)  # PHASES, each within ``seconds``


class Truth:
    """What was produced into the input topic: per key id, the sum and the count of its values."""

    def __init__(self, key_ids: np.ndarray, values: np.ndarray, keys: int) -> None:
        self.sums = np.bincount(key_ids, weights=values, minlength=keys).astype(np.int64)
        self.counts = np.bincount(key_ids, minlength=keys).astype(np.int64)

    def add(self, key_id: int, value: int) -> None:
        self.sums[key_id] += value
        self.counts[key_id] += 1

    def totals(self) -> dict[str, int]:
        """``{"keys", "records", "sum"}`` as :func:`baseline` checks them."""
        return {
            "keys": int(np.count_nonzero(self.counts)),
            "records": int(self.counts.sum()),
            "sum": int(self.sums.sum()),
        }

    def check(self, keys: list[str], sums: list[int], counts: list[int]) -> str:
        """``"ok"``, or what is wrong with a result of one row per key ``k<id>``."""
        got_sums = np.zeros_like(self.sums)
        got_counts = np.zeros_like(self.counts)
        seen = np.zeros(self.sums.size, dtype=bool)
        duplicates = 0
        for key, total, count in zip(keys, sums, counts, strict=True):
            i = int(key[1:])
            duplicates += bool(seen[i])
            seen[i] = True
            got_sums[i], got_counts[i] = total, count
        wrong = int(np.count_nonzero((got_sums != self.sums) | (got_counts != self.counts)))
        missing = int(np.count_nonzero((self.counts > 0) & ~seen))
        extra = int(np.count_nonzero((self.counts == 0) & seen))
        if wrong == 0 and duplicates == 0 and extra == 0:
            return "ok"
        return (
            f"WRONG: {wrong} keys differ ({missing} missing, {extra} extra), "
            f"{duplicates} duplicate rows"
        )


@dataclass
class Input:
    """The produced input: its topic, end offsets (records are added at the end) and truth."""

    bootstrap: str
    topic: str
    ends: dict[int, int]
    truth: Truth
    records: int
    produce_s: float

    def send_one(self, producer: Any, key_id: int, value: int, partition: int) -> None:
        """Produce one record (acks as ``producer`` says) and account for it."""
        doc = b'{"key": "k%d", "value": %d}' % (key_id, value)
        producer.produce(self.topic, key=b"k%d" % key_id, value=doc, partition=partition)
        assert producer.flush(30) == 0, "one record not delivered"
        self.ends[partition] += 1
        self.truth.add(key_id, value)


def make_input(bootstrap: str, name: str, records: int, keys: int) -> Input:
    """Create the 2-partition input topic ``<name>-in`` and produce the keyed_sum backlog."""
    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.topics import TopicAdmin

    admin = TopicAdmin(KafkaConfig(bootstrap, timeout_s=60))
    topic = f"{name}-in"
    admin.ensure_topic(topic, INPUT_PARTITIONS)
    t0 = time.perf_counter()
    key_ids, values = produce(bootstrap, topic, records, keys)
    produce_s = time.perf_counter() - t0
    stable = admin.offsets([(topic, p) for p in range(INPUT_PARTITIONS)], "stable")
    ends = {p: stable[(topic, p)] for p in range(INPUT_PARTITIONS)}
    print(f"produced {records:,} records in {produce_s:.1f} s", flush=True)
    return Input(bootstrap, topic, ends, Truth(key_ids, values, keys), records, produce_s)


def spark_session(
    app: str, conf: Mapping[str, str] | None = None, event_log: Path | None = None
) -> Any:
    """The benchmarks' SparkSession: ``local[2,3]``, UI off, 4 shuffle partitions, Arrow on,
    the driver JVM's options as the runtime's (the class archive, if one is ready, for every
    system alike); with ``event_log``, Spark's event log in that directory (one plain JSON
    file, which :func:`spark_idle` reads)."""
    from pyspark.sql import SparkSession

    if event_log is not None:
        event_log.mkdir(parents=True, exist_ok=True)
        conf = {
            **(conf or {}),
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": event_log.resolve().as_uri(),
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",
        }

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (
        SparkSession.builder.master("local[2,3]")
        .config("spark.driver.extraJavaOptions", driver_java_options(default_cache_dir()))
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.speculation", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "4g")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def make_timed_runtime_class() -> Any:
    """A Runtime that times every step and its phases (imported late: pyspark loads slowly).
    :meth:`instrument` must be called after ``recover``.

    Writes are pipelined (the driver's "Pipelined writes"): a step runs on Spark in the loop
    thread and is written in the writer thread while the next step runs. A step's time is from
    the start of its ``_run_step`` to the end of its ``_write_step``; each thread charges its
    phases to the step it works on, so the phases of one step can add up to less than its time
    (waiting for the previous write) or overlap with the next step's.
    """
    import threading

    from sparkstep.io.division import Division
    from sparkstep.runtime.driver import Runtime

    class TimedRuntime(Runtime):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.timings: list[StepTiming] = []
            self._phases: dict[int, dict[str, float]] = {}
            self._started: dict[int, float] = {}
            self._current = threading.local()

        def _run_step(self, division: Division) -> None:
            self._current.step = division.step
            self._phases[division.step] = dict.fromkeys(PHASES, 0.0)
            self._started[division.step] = time.perf_counter()
            try:
                super()._run_step(division)
            finally:
                self._current.step = None

        def _write_step(self, division: Division, *args: Any, **kwargs: Any) -> None:
            self._current.step = division.step
            try:
                super()._write_step(division, *args, **kwargs)
            finally:
                self._current.step = None
            end = time.perf_counter()
            start = self._started.pop(division.step, end)
            self.timings.append(
                StepTiming(
                    division.step,
                    division.offset_count,
                    end - start,
                    end,
                    self._phases.pop(division.step, {}),
                )
            )

        def instrument(self) -> None:
            """Time the Spark stage, the digests and the output write of every step."""
            assert self.writer is not None
            self.timings.clear()
            self.runner.run = _timed(self.runner.run, self._phase, "spark")  # type: ignore[method-assign]
            self.writer.write = _timed(self.writer.write, self._phase, "write")  # type: ignore[method-assign]
            for client in self.workers:
                client.status = _timed(client.status, self._phase, "digests")  # type: ignore[method-assign]

        def _phase(self) -> dict[str, float]:
            """The phases of the step this thread works on (a throwaway dict between steps)."""
            step = getattr(self._current, "step", None)
            return self._phases.get(step, {}) if step is not None else {}

    return TimedRuntime


def _timed(fn: Any, into: Callable[[], dict[str, float]], phase: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases = into()
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start

    return call


@contextmanager
def timed_encoding(into: Callable[[], dict[str, float]]) -> Iterator[None]:
    """Time ``encode_output`` and ``output_digest`` as ``sparkstep.io.output`` calls them, into
    the ``encode`` phase; where the writer no longer calls them there, ``encode`` stays 0."""
    module = importlib.import_module("sparkstep.io.output")
    saved = {
        n: getattr(module, n) for n in ("encode_output", "output_digest") if hasattr(module, n)
    }
    for name, fn in saved.items():
        setattr(module, name, _timed(fn, into, "encode"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


#: The environment variable naming the process whose descendants :func:`cpu_by_role` counts
#: (default: this process).
ROOT_ENV = "SPARKSTEP_BENCH_ROOT"


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
    Where the environment variable :data:`ROOT_ENV` names an ancestor (``bench.peers`` runs
    each system in a process of its own, under the process that started the broker), the
    processes under that ancestor count, so the broker does too.
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
    root = int(os.environ.get(ROOT_ENV, me))
    totals = dict.fromkeys(
        ("driver", "spark jvm", "spark python", "state workers", "kafka broker"), 0.0
    )
    for pid, (_, own, reaped, cmdline) in procs.items():
        ancestor = pid
        while ancestor in procs and ancestor != root:
            ancestor = procs[ancestor][0]
        if ancestor != root:
            continue
        if pid == me:
            totals["driver"] += own
        elif b"bench.timed_worker" in cmdline or b"sparkstep.runtime.worker" in cmdline:
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


def start_worker(
    store: Path, token_file: Path, shards: int, apply_log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """A state worker (``python -m bench.timed_worker``, logging its applies into
    ``apply_log``) on ``store``; returns (process, address)."""
    store.parent.mkdir(parents=True, exist_ok=True)
    with open(store.parent / f"{store.name}.log", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.timed_worker", "--apply-log", str(apply_log),
             "--store", str(store), "--port", "0", "--token-file", str(token_file),
             "--shards", str(shards), "--lock-timeout", "30"],
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


def check_output(
    spark: Any, bootstrap: str, topic: str, truth: Truth, mode: Literal["zset", "last"]
) -> str:
    """Read ``topic`` back (read_committed, on the executors) and check it against ``truth``.

    ``zset``: sparkstep's output, rows ``{"key", "sum", "count", "weight"}``; integrated (the
    weights added up per row), exactly one row per key must be left, with weight 1.
    ``last``: an update-mode sink's output, rows ``{"key", "sum", "count"}`` keyed by ``key``
    (so one key's updates are in one partition, in order); the last row of each key counts.
    Returns ``"ok"`` or what is wrong.
    """
    from pyspark.sql import functions as F

    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.ranges import RANGES_DDL, READ_DDL, map_read
    from sparkstep.io.topics import TopicAdmin

    config = KafkaConfig(bootstrap, timeout_s=60)
    admin = TopicAdmin(config)
    keys = [(topic, p) for p in range(OUTPUT_PARTITIONS)]
    first, stable = admin.offsets(keys, "earliest"), admin.offsets(keys, "stable")
    rows = [(topic, p, first[(topic, p)], stable[(topic, p)], None) for _, p in keys]
    ranges = spark.createDataFrame(spark.sparkContext.parallelize(rows, len(rows)), RANGES_DDL)
    records = ranges.mapInArrow(map_read(config), READ_DDL).where("not __summary")
    doc = F.from_json(
        F.col("value").cast("string"), "key string, sum long, count long, weight long"
    )
    parsed = records.select(doc.alias("j"), "offset").select("j.*", "offset")
    if mode == "zset":
        result = (
            parsed.groupBy("key", "sum", "count")
            .agg(F.sum("weight").alias("weight"))
            .where("weight != 0")
        )
        table = result.toArrow()
        weights = table.column("weight").to_pylist()
        if any(w != 1 for w in weights):
            return f"WRONG: {sum(w != 1 for w in weights)} rows integrate to a weight other than 1"
    else:
        last = F.max_by(F.struct("sum", "count"), "offset").alias("last")
        table = parsed.groupBy("key").agg(last).select("key", "last.sum", "last.count").toArrow()
    return truth.check(
        table.column("key").to_pylist(),
        table.column("sum").to_pylist(),
        table.column("count").to_pylist(),
    )


def output_consumer(bootstrap: str, topic: str, *, committed: bool) -> Any:
    """A consumer of ``topic``'s partitions from their current ends (read_committed if
    ``committed``), fetching without waiting for more bytes: the one-record latency probe."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
         "enable.auto.commit": False, "fetch.wait.max.ms": 5, "fetch.queue.backoff.ms": 5,
         "isolation.level": "read_committed" if committed else "read_uncommitted"}
    )  # fmt: skip
    ends = []
    for p in range(OUTPUT_PARTITIONS):
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
        ends.append(TopicPartition(topic, p, high))
    # A read_committed consumer assigned at the high watermark would skip nothing it could read.
    consumer.assign(ends)
    return consumer


def drain(consumer: Any, seconds: float) -> None:
    """Read whatever ``consumer`` has for ``seconds`` (the previous trial's remaining rows)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        consumer.poll(0.02)


def readable_after(consumer: Any, start: float, timeout: float) -> float:
    """Seconds from ``start`` (perf_counter) until ``consumer`` reads a record."""
    while time.perf_counter() - start < timeout:
        msg = consumer.poll(0.005)
        if msg is not None and msg.error() is None:
            return time.perf_counter() - start
    raise AssertionError(f"no output readable {timeout:.0f} s after the record was produced")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass(frozen=True)
class SparkIdle:
    """How long Spark ran no sparkstep job while the backlog was worked through (from its event
    log): before the first step's job (from the loop's start), and between two steps' jobs,
    those gaps during a checkpoint apart (seconds)."""

    before_first: float
    between: list[float]
    at_checkpoints: list[float]

    @property
    def total(self) -> float:
        return self.before_first + sum(self.between) + sum(self.at_checkpoints)


def spark_idle(
    spark: Any, since: float, until: float, checkpoints: list[tuple[float, float]]
) -> SparkIdle | None:
    """The Spark idle time of the sparkstep jobs that started in ``[since, until]`` (wall
    clock, ``time.time()``), from the session's event log; None without one. A gap counts as a
    checkpoint's if it overlaps one of ``checkpoints`` (wall-clock start and end)."""
    if spark.conf.get("spark.eventLog.enabled", "false") != "true":
        return None
    folder = Path(spark.conf.get("spark.eventLog.dir").removeprefix("file:"))
    app = spark.sparkContext.applicationId
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for path in folder.glob(f"{app}*"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerJobStart":
                described = event.get("Properties", {}).get("spark.job.description", "")
                if described.startswith("sparkstep step "):
                    starts[event["Job ID"]] = event["Submission Time"] / 1000
            elif kind == "SparkListenerJobEnd":
                ends[event["Job ID"]] = event["Completion Time"] / 1000
    jobs = sorted(
        (start, ends[job])
        for job, start in starts.items()
        if since <= start <= until and job in ends
    )
    if not jobs:
        return None
    between: list[float] = []
    at_checkpoints: list[float] = []
    for (_, end), (start, _) in itertools.pairwise(jobs):
        during = any(c0 < start and end < c1 for c0, c1 in checkpoints)
        (at_checkpoints if during else between).append(start - end)
    return SparkIdle(jobs[0][0] - since, between, at_checkpoints)


@dataclass(frozen=True)
class SparkstepOptions:
    """How :func:`run_sparkstep` runs sparkstep."""

    workers: int = 2
    max_records_per_step: int = 200_000
    checkpoint_every: float = 10.0
    single_trials: int = 5
    timeout: float = 1800.0

    @classmethod
    def of(cls, args: argparse.Namespace) -> SparkstepOptions:
        """The options a benchmark's command line gives (its arguments of the same names)."""
        return cls(
            workers=args.workers,
            max_records_per_step=args.max_records_per_step,
            checkpoint_every=args.checkpoint_every,
            single_trials=args.single_trials,
            timeout=args.timeout,
        )


@dataclass
class SparkstepRun:
    """What :func:`run_sparkstep` measured."""

    options: SparkstepOptions
    records: int
    run_s: float  # from the start of recovery to the last step logged
    recovery_s: float
    steps: list[StepTiming]
    apply: dict[int, tuple[float, float]]  # step -> (union of the workers' applies, their sum)
    checkpoints: list[float]
    busy: float
    load: tuple[float, float]
    roles: dict[str, float]
    single_logged: list[float]
    single_readable: list[float]
    single_step: list[float]
    output_check: str
    idle: SparkIdle | None = None

    @property
    def rate(self) -> float:
        return self.records / self.run_s

    def step_latencies_ms(self) -> list[float]:
        return [t.seconds * 1000 for t in self.steps]

    def rows(self) -> list[tuple[str, str]]:
        """The table rows of this run (label, value)."""
        steps, first, last = self.steps, self.steps[0], self.steps[-1]
        steady = (
            (self.records - first.records) / (last.end - first.end)
            if len(steps) > 1
            else float("nan")
        )
        lat = self.step_latencies_ms()
        step_rates = [t.records / t.seconds for t in steps if t.records]
        total = sum(t.seconds for t in steps)
        spark = sum(t.phases.get("spark", 0.0) for t in steps)
        digests = sum(t.phases.get("digests", 0.0) for t in steps)
        encode = sum(t.phases.get("encode", 0.0) for t in steps)
        write = sum(t.phases.get("write", 0.0) for t in steps)
        applied = [self.apply.get(t.step, (0.0, 0.0)) for t in steps]
        apply_union = sum(a[0] for a in applied)
        apply_sum = sum(a[1] for a in applied)

        def part(seconds: float) -> str:
            return f"{seconds:.1f} ({seconds / total:.0%})" if total else "-"

        ckpt = self.checkpoints
        return [
            ("sparkstep sustained records/s (ckpts incl.)", f"{self.rate:,.0f}"),
            ("  wall time to consume the input (s)", f"{self.run_s:.1f}"),
            ("  of which recovery, before the loop (ms)", f"{self.recovery_s * 1000:,.0f}"),
            ("  after the first step (warm-up), ckpts incl.", f"{steady:,.0f}"),
            ("  first step (ms)", f"{first.seconds * 1000:,.0f}"),
            ("  steps", f"{len(steps)}"),
            ("  records/s within steps (median)", f"{statistics.median(step_rates):,.0f}"),
            ("  step latency p50 (ms)", f"{percentile(lat, 50):,.0f}"),
            ("  step latency p99 (ms)", f"{percentile(lat, 99):,.0f}"),
            ("  step latency max (ms)", f"{max(lat):,.0f}"),
            ("step time, sum over steps (s)", f"{total:.1f}"),
            ("  Spark stage (StepRunner.run)", part(spark)),
            ("    of which worker applies (union)", part(apply_union)),
            ("    Spark without the applies", part(spark - apply_union)),
            ("  state digests (status calls)", part(digests)),
            ("  output encode (encode + digest)", part(encode)),
            ("  output transaction (write - encode)", part(write - encode)),
            ("  rest (the previous write, planning)", part(total - spark - digests - write)),
            ("worker applies: sum / union (W = parallel)",
             f"{apply_sum / apply_union:.2f}" if apply_union else "-"),
            ("  checkpoints", f"{len(ckpt)}"),
            ("  checkpoint, until its manifest, median / max ms",
             f"{statistics.median(ckpt) * 1000 if ckpt else 0:,.0f} / "
             f"{max(ckpt) * 1000 if ckpt else 0:,.0f}"),
            *self.idle_rows(),
            ("  CPU s, whole machine (other users too)", f"{self.busy:.0f}"),
            ("  load average 1 min, before / after", f"{self.load[0]:.1f} / {self.load[1]:.1f}"),
            *[(f"  CPU s, {role}", f"{cpu:.0f}") for role, cpu in self.roles.items()],
            ("one-record step, produce->readable median (ms)",
             f"{statistics.median(self.single_readable) * 1000:,.0f}"),
            ("one-record step, produce->logged median (ms)",
             f"{statistics.median(self.single_logged) * 1000:,.0f}"),
            ("one-record step, Spark to commit median (ms)",
             f"{statistics.median(self.single_step) * 1000:,.0f}"),
            ("output vs true sums", self.output_check),
        ]  # fmt: skip

    def idle_rows(self) -> list[tuple[str, str]]:
        """The rows of :attr:`idle` (none without an event log)."""
        idle = self.idle
        if idle is None:
            return []

        def ms(gaps: list[float]) -> str:
            if not gaps:
                return "-"
            return f"{statistics.median(gaps) * 1000:,.0f} / {max(gaps) * 1000:,.0f}"

        return [
            ("Spark idle, no step's job running (s)",
             f"{idle.total:.1f} ({idle.total / self.run_s:.0%})"),
            ("  from the loop's start to the first job (ms)", f"{idle.before_first * 1000:,.0f}"),
            ("  between steps, median / max ms", ms(idle.between)),
            ("  between steps at a checkpoint, median / max ms", ms(idle.at_checkpoints)),
        ]  # fmt: skip

    def step_lines(self) -> str:
        """Per step: records and ms in total = Spark (applies) / digests / encode / write."""
        parts = []
        for t in self.steps:
            ms = {k: v * 1000 for k, v in t.phases.items()}
            union = self.apply.get(t.step, (0.0, 0.0))[0] * 1000
            parts.append(
                f"{t.records}:{t.seconds * 1000:.0f}={ms.get('spark', 0):.0f}({union:.0f})"
                f"/{ms.get('digests', 0):.0f}/{ms.get('encode', 0):.0f}/{ms.get('write', 0):.0f}"
            )
        return ", ".join(parts)


def run_sparkstep(spark: Any, inp: Input, tmp: Path, options: SparkstepOptions) -> SparkstepRun:
    """Run keyed_sum on sparkstep over ``inp``'s backlog, then one-record steps; see the module
    docstring (steps 2, 3 and 5). Its workers and state live in ``tmp``."""
    from confluent_kafka import Producer

    from sparkstep.examples.keyed_sum import pipeline
    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.topics import TopicAdmin
    from sparkstep.runtime.driver import RuntimeOptions
    from sparkstep.runtime.runstate import RunState
    from sparkstep.runtime.worker import WorkerClient

    config = KafkaConfig(inp.bootstrap, timeout_s=60)
    name = f"sparkstep{uuid.uuid4().hex[:8]}"
    output_topic = f"{name}-out"
    TopicAdmin(config).ensure_topic(output_topic, OUTPUT_PARTITIONS)
    tmp.mkdir(parents=True, exist_ok=True)
    state_dir = tmp / "state"
    token_file = tmp / "token"
    token = uuid.uuid4().hex
    token_file.write_text(token + "\n")
    logs = [state_dir / "workers" / f"w{i}.applies" for i in range(options.workers)]
    workers: list[subprocess.Popen[bytes]] = []
    try:
        addresses = []
        for i, log_file in enumerate(logs):
            store = state_dir / "workers" / f"w{i}"
            proc, address = start_worker(store, token_file, pipeline.shards, log_file)
            workers.append(proc)
            addresses.append(address)
        runtime_options = RuntimeOptions(
            name=name,
            state_dir=state_dir,
            token=token,
            topics={"events": inp.topic},
            output_topic=output_topic,
            stores=tuple(f"workers/w{i}" for i in range(options.workers)),
            max_records_per_step=options.max_records_per_step,
        )
        runtime = make_timed_runtime_class()(
            spark,
            pipeline,
            runtime_options,
            config,
            [WorkerClient(a, token, timeout=300.0) for a in addresses],
        )
        # The run is timed from recovery on, as Spark Structured Streaming's from its query's
        # start: on a fresh state dir recovery builds the step's plan (describing the
        # pipeline), fences the output writer and opens the stores.
        roles0 = cpu_by_role()
        busy0 = machine_busy_seconds()
        load0 = os.getloadavg()[0]
        started = time.perf_counter()
        runtime.recover()
        recovery_s = time.perf_counter() - started
        runtime.instrument()
        state = RunState()
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                with timed_encoding(runtime._phase):
                    runtime.run(state)
            except BaseException as exc:
                errors.append(exc)

        def logged(target: dict[int, int]) -> bool:
            previous = runtime.last_logged
            return previous is not None and all(
                previous.ends().get((inp.topic, p), 0) >= end for p, end in target.items()
            )

        # The backlog, with a checkpoint every checkpoint_every seconds.
        checkpoints: list[float] = []
        thread = threading.Thread(target=loop, daemon=True)
        started_wall = time.time()  # the loop's start
        checkpoint_walls: list[tuple[float, float]] = []
        thread.start()
        last_checkpoint = time.perf_counter()
        deadline = last_checkpoint + options.timeout
        while not logged(inp.ends):
            assert not errors, errors
            assert time.perf_counter() < deadline, f"input not consumed in {options.timeout} s"
            if time.perf_counter() - last_checkpoint >= options.checkpoint_every:
                # As the coordinator does: checkpoint() pauses the loop itself, briefly, and
                # resumes it before the write in flight has committed; what the loop loses is
                # the Spark idle time at a checkpoint, below.
                c0, wall0 = time.perf_counter(), time.time()
                runtime.checkpoint(state)
                checkpoints.append(time.perf_counter() - c0)
                checkpoint_walls.append((wall0, time.time()))
                last_checkpoint = time.perf_counter()
            time.sleep(0.05)
        run_s = time.perf_counter() - started
        ended_wall = time.time()
        busy = machine_busy_seconds() - busy0
        roles = {role: cpu - roles0[role] for role, cpu in cpu_by_role().items()}
        big_steps = list(runtime.timings)
        records = sum(t.records for t in big_steps)
        print(f"sparkstep consumed the input in {run_s:.1f} s ({len(big_steps)} steps)", flush=True)

        # One-record steps, with the loop idle.
        producer = Producer({"bootstrap.servers": inp.bootstrap, "acks": "all"})
        consumer = output_consumer(inp.bootstrap, output_topic, committed=True)
        single_logged: list[float] = []
        single_readable: list[float] = []
        single_step: list[float] = []
        try:
            for i in range(options.single_trials):
                drain(consumer, 0.5)  # and let the loop settle into its input wait
                n_before = len(runtime.timings)
                s0 = time.perf_counter()
                inp.send_one(producer, 0, 1, i % INPUT_PARTITIONS)
                single_readable.append(readable_after(consumer, s0, 60))
                while not logged(inp.ends):
                    assert not errors, errors
                    assert time.perf_counter() - s0 < 60, "one-record step not logged in 60 s"
                    time.sleep(0.001)
                single_logged.append(time.perf_counter() - s0)
                # The step is logged once its transaction commits; its timing is taken just
                # after that, in the writer thread.
                while not (new := [t for t in runtime.timings[n_before:] if t.records > 0]):
                    assert time.perf_counter() - s0 < 60, "one-record step not timed in 60 s"
                    time.sleep(0.001)
                single_step.append(new[-1].seconds)
        finally:
            consumer.close()
        state.stop(state.pause(timeout=300), timeout=300)
        thread.join(60)
        assert not errors, errors
    except BaseException:
        # A failed run: say what became of the workers before their logs are deleted.
        for i, proc in enumerate(workers):
            log_file = state_dir / "workers" / f"w{i}.log"
            tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
            print(f"worker {i}: exit code {proc.poll()}; log tail:\n{tail}", file=sys.stderr)
        raise
    finally:
        for proc in workers:
            stop_worker(proc)
    calls: dict[int, list[tuple[float, float]]] = {}
    for log_file in logs:
        for step, start, end in read_apply_log(log_file):
            calls.setdefault(step, []).append((start, end))
    apply = {s: (union_seconds(c), sum(e - b for b, e in c)) for s, c in calls.items()}
    check = check_output(spark, inp.bootstrap, output_topic, inp.truth, "zset")
    return SparkstepRun(
        options=options,
        records=records,
        run_s=run_s,
        recovery_s=recovery_s,
        steps=big_steps,
        apply=apply,
        checkpoints=checkpoints,
        busy=busy,
        load=(load0, os.getloadavg()[0]),
        roles=roles,
        single_logged=single_logged,
        single_readable=single_readable,
        single_step=single_step,
        output_check=check,
        idle=spark_idle(spark, started_wall, ended_wall, checkpoint_walls),
    )


def run(args: argparse.Namespace, tmp: Path) -> None:
    from sparkstep.io.broker import LocalBroker, find_free_port, install_kafka

    broker = LocalBroker(tmp / "kafka", find_free_port(), install_kafka(default_cache_dir()))
    spark: Any = None
    try:
        broker.start()
        inp = make_input(broker.bootstrap_servers, "bench", args.records, args.keys)
        spark = spark_session("sparkstep-bench-runtime", event_log=tmp / "spark-events")
        ours = run_sparkstep(spark, inp, tmp, SparkstepOptions.of(args))
        # The baseline, twice (the first warms the Python workers), over the same offsets.
        expect = inp.truth.totals()
        base = [baseline(spark, inp.bootstrap, inp.topic, inp.ends, expect) for _ in range(2)]
        base_rate = expect["records"] / min(base)
        print()
        print(
            f"keyed_sum: {args.records:,} records, {args.keys:,} keys, {INPUT_PARTITIONS} input "
            f"partitions, {args.workers} workers, max {args.max_records_per_step:,} "
            f"records/step, checkpoint every {args.checkpoint_every:g} s"
        )
        print(f"{'measure':<50}{'value':>16}")
        rows = [
            *ours.rows(),
            ("Spark batch job records/s (best of 2)", f"{base_rate:,.0f}"),
            ("  Spark batch job runs (s)", " / ".join(f"{b:.1f}" for b in base)),
            ("ratio sparkstep / Spark batch", f"{ours.rate / base_rate:.3f}x"),
        ]
        for label, value in rows:
            print(f"{label:<50}{value:>16}")
        print(f"(input produced in {inp.produce_s:.1f} s, {args.records / inp.produce_s:,.0f}/s)")
        print(
            "steps (records:ms = Spark stage (worker applies) / digests / encode / write): "
            + ours.step_lines()
        )
        sys.stdout.flush()
    finally:
        if spark is not None:
            spark.stop()
        broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="200k records over 10k keys")
    parser.add_argument("--workers", type=int, default=2, help="state worker processes")
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
