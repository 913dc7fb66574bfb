"""An in-process runtime in front of real worker processes, and the keyed_sum oracle."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from sparkstep.failpoints import ENV_VAR
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import DEFAULT_MAX_BYTES_PER_STEP
from sparkstep.runtime.control import ControlClient
from sparkstep.runtime.driver import Runtime, RuntimeOptions
from sparkstep.runtime.pipeline import Pipeline
from sparkstep.runtime.runstate import RunState
from sparkstep.runtime.step import NARROW_STEP_OFFSETS
from tests.children import ready_line
from tests.io.fixtures import Seen, read_committed_many
from tests.runtime.worker.fixtures import WorkerFactory, WorkerProcess


def produce_keyed(bootstrap: str, topic: str, n: int, keys: int, seed: int) -> list[dict[str, Any]]:
    """``n`` keyed_sum records over ``keys`` keys, acks=all; returns what was sent."""
    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    sent: list[dict[str, Any]] = []
    for _ in range(n):
        key = f"k{rng.randrange(keys)}"
        doc: dict[str, Any] = {"key": key, "value": rng.randrange(-50, 100)}
        producer.produce(topic, key=key.encode(), value=json.dumps(doc).encode())
        sent.append(doc)
    assert producer.flush(30) == 0
    return sent


def produce_raw(
    bootstrap: str, topic: str, values: list[bytes | None], keys: list[bytes | None] | None = None
) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for value, key in zip(values, keys or [None] * len(values), strict=True):
        producer.produce(topic, value=value, key=key)
    assert producer.flush(30) == 0


def keyed_sum_oracle(sent: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for doc in sent:
        sums[doc["key"]] += doc["value"]
        counts[doc["key"]] += 1
    return {k: (sums[k], counts[k]) for k in counts}


def integrate(records: list[Seen]) -> dict[tuple[tuple[str, Any], ...], int]:
    """Adds up the weights per output row (its JSON without weight); drops rows at 0."""
    totals: Counter[tuple[tuple[str, Any], ...]] = Counter()
    for rec in records:
        assert rec.value is not None
        doc = json.loads(rec.value)
        weight = doc.pop("weight")
        totals[tuple(sorted(doc.items()))] += weight
    return {row: w for row, w in totals.items() if w != 0}


def step_header(rec: Seen) -> int:
    return int(dict(rec.headers)["sparkstep.step"])


def assert_keyed_sum_exactly_once(
    bootstrap: str, output_topic: str, steps_topic: str, sent: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The read_committed output of a keyed_sum run integrates to the oracle of ``sent``, the
    step log holds every step once and in order, and every output record belongs to a logged
    step; returns the step log records (parsed JSON)."""
    seen = read_committed_many(bootstrap, [output_topic, steps_topic])
    expected = {
        (("count", c), ("key", k), ("sum", s)): 1 for k, (s, c) in keyed_sum_oracle(sent).items()
    }
    assert integrate(seen[output_topic]) == expected
    logged = [json.loads(r.value) for r in seen[steps_topic] if r.value]
    steps = [record["step"] for record in logged]
    assert steps == list(range(len(steps)))
    assert {step_header(r) for r in seen[output_topic]} <= set(steps)
    return logged


@dataclass
class Harness:
    """W worker processes and a Runtime in this process, all on one state dir."""

    spark: SparkSession
    pipeline: Pipeline
    bootstrap: str
    state_dir: Path
    token: str
    topics: dict[str, str]
    output_topic: str
    name: str
    workers: list[WorkerProcess]
    max_records_per_step: int = 50
    max_bytes_per_step: int = DEFAULT_MAX_BYTES_PER_STEP
    narrow_step_offsets: int = NARROW_STEP_OFFSETS
    runtime: Runtime | None = None
    state: RunState | None = None
    thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def build(self, on_replay_mismatch: str = "fail") -> Runtime:
        options = RuntimeOptions(
            on_replay_mismatch=on_replay_mismatch,  # type: ignore[arg-type]
            name=self.name,
            state_dir=self.state_dir,
            token=self.token,
            topics=self.topics,
            output_topic=self.output_topic,
            stores=tuple(f"workers/w{i}" for i in range(len(self.workers))),
            max_records_per_step=self.max_records_per_step,
            max_bytes_per_step=self.max_bytes_per_step,
            narrow_step_offsets=self.narrow_step_offsets,
        )
        self.runtime = Runtime(
            self.spark,
            self.pipeline,
            options,
            KafkaConfig(self.bootstrap, timeout_s=30),
            [w.client(self.token) for w in self.workers],
        )
        self.runtime.recover()
        return self.runtime

    def start(self) -> None:
        assert self.runtime is not None
        self.state = RunState()

        def run() -> None:
            assert self.runtime is not None and self.state is not None
            try:
                self.runtime.run(self.state)
            except BaseException as exc:
                self.errors.append(exc)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_consumed(self, ends: dict[tuple[str, int], int], timeout: float = 240) -> None:
        """Until the last logged step's division reaches ``ends`` in every partition."""
        assert self.runtime is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert not self.errors, self.errors
            previous = self.runtime.last_logged
            if previous is not None and all(
                previous.ends().get(k, 0) >= v for k, v in ends.items()
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"input not consumed within {timeout}s: {self.runtime.last_logged}")

    def stop(self) -> None:
        assert self.state is not None and self.thread is not None
        self.state.stop(self.state.pause(timeout=120), timeout=120)
        self.thread.join(60)
        assert not self.errors, self.errors

    def output(self) -> list[Seen]:
        return read_committed_many(self.bootstrap, [self.output_topic])[self.output_topic]


HarnessFactory = Callable[..., Harness]


@pytest.fixture
def harness_factory(
    spark: SparkSession,
    bootstrap_servers: str,
    tmp_path: Path,
    token_file: Path,
    worker_factory: WorkerFactory,
    unique_name: str,
    topic_factory,
) -> Iterator[HarnessFactory]:
    def make(pipeline: Pipeline, topics: dict[str, str], workers: int = 2, **kw) -> Harness:
        state_dir = tmp_path / "state"
        (state_dir / "workers").mkdir(parents=True, exist_ok=True)
        procs = [
            worker_factory(store=state_dir / "workers" / f"w{i}", shards=pipeline.shards)
            for i in range(workers)
        ]
        return Harness(
            spark=spark,
            pipeline=pipeline,
            bootstrap=bootstrap_servers,
            state_dir=state_dir,
            token=token_file.read_text().strip(),
            topics=topics,
            output_topic=topic_factory("out", partitions=2),
            name=unique_name,
            workers=procs,
            **kw,
        )

    yield make


class RuntimeProcess:
    """``python -m sparkstep.runtime`` as a child, like the coordinator starts it."""

    def __init__(self, args: list[str], log: Path, failpoint: str | None = None) -> None:
        self.args = args
        self.log = log
        self.failpoint = failpoint
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.address: str | None = None  # HOST:PORT from the ready line
        self._control: ControlClient | None = None

    def start(self, timeout: float = 180.0) -> RuntimeProcess:
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        if self.failpoint:
            env[ENV_VAR] = self.failpoint
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sparkstep.runtime", *self.args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        try:
            ready = ready_line(self.proc, timeout)
        except TimeoutError:
            raise AssertionError(f"runtime not ready in {timeout}s: {self.tail()}") from None
        if ready is None:  # exited before ready (e.g. a failpoint during recovery)
            self.proc.wait(30)
            self.port = None
            return self
        self.port = int(ready["port"])
        self.address = str(ready["address"])
        return self

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def control(self, token: str) -> ControlClient:
        """One client per process, closed when the process is waited for or killed."""
        assert self.address is not None
        if self._control is None:
            self._control = ControlClient(self.address, token, timeout=300)
        return self._control

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._close_pipes()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.wait(30)

    def _close_pipes(self) -> None:
        assert self.proc is not None
        if self._control is not None:
            self._control.close()
            self._control = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


RuntimeFactory = Callable[..., RuntimeProcess]


@pytest.fixture
def runtime_factory() -> Iterator[RuntimeFactory]:
    """``make(args, log, failpoint=None)``: an unstarted :class:`RuntimeProcess`, killed (and its
    pipes closed) when the test ends, whether it passed or not, so no child or pipe outlives it."""
    made: list[RuntimeProcess] = []

    def make(args: list[str], log: Path, failpoint: str | None = None) -> RuntimeProcess:
        made.append(RuntimeProcess(args, log, failpoint))
        return made[-1]

    yield make
    for runtime in made:
        runtime.kill()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
