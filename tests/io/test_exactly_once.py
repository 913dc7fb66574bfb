"""Exactly once under crashes: a writer process SIGKILLed at failpoints and at random instants.

Every trial runs a real writer subprocess (``tests.io.writer_child``) against the real broker,
kills it, restarts it until it finishes, and then checks with an independent read_committed
consumer that every step appears exactly once, contiguous, with its records and dead letters.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from sparkstep.failpoints import ENV_VAR, FAILPOINT_EXIT_CODE
from sparkstep.io.broker import LocalBroker, find_free_port
from sparkstep.io.deadletter import dlq_topic
from sparkstep.io.encoding import HEADER_STEP
from sparkstep.io.steplog import StepRecord, steps_topic

from .fixtures import read_committed_many, step_rows

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5

FAILPOINTS = [
    "output.after_record@2",
    "output.after_record@7",
    "output.after_records",
    "output.after_records@3",
    "output.after_step_record",
    "output.after_step_record@2",
    "output.before_commit",
    "output.before_commit@4",
    "output.after_commit",
    "output.after_commit@3",
]


class Child:
    """One writer process; its stdout lines are collected by a thread."""

    def __init__(
        self,
        bootstrap: str,
        name: str,
        output: str,
        steps: int,
        failpoint: str = "",
        pace: float = 0.0,
    ):
        env = dict(os.environ)
        env.pop(ENV_VAR, None)
        if failpoint:
            env[ENV_VAR] = failpoint
        args = [bootstrap, name, output, str(steps), "2", str(pace)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.io.writer_child", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.err: list[str] = []
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line.strip())
                self.changed.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if not line.startswith("%"):  # librdkafka's connection chatter
                self.err.append(line.rstrip())

    def wait_for_line(
        self, prefix: str | tuple[str, ...], timeout: float = 60.0, may_exit: bool = False
    ) -> None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not any(line.startswith(prefix) for line in self.lines):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no {prefix!r} line: {self.lines}"
                if self.proc.poll() is not None:
                    assert may_exit, (self.lines, self.err)
                    return
                self.changed.wait(min(remaining, 0.5))

    def wait(self, timeout: float = 120.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        for reader in self.readers:
            reader.join(timeout=10)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        assert code is not None, f"writer did not finish: {self.lines} {self.err[-20:]}"
        return code

    def stderr(self) -> str:
        return "\n".join(self.err[-30:])


def check_exactly_once(bootstrap: str, name: str, output: str, steps: int) -> None:
    """Every step once, contiguous, whole: its records, its dead letter, its step log record."""
    seen = read_committed_many(bootstrap, [output, steps_topic(name), dlq_topic(name)])
    by_step: dict[int, Counter[tuple[bytes | None, bytes | None]]] = {}
    for record in seen[output]:
        step = int(dict(record.headers)[HEADER_STEP])
        by_step.setdefault(step, Counter())[(record.key, record.value)] += 1
    assert sorted(by_step) == list(range(steps))
    for step, records in by_step.items():
        expected = Counter(
            (
                key.encode(),
                json.dumps(
                    {"key": key, "sum": total, "weight": weight}, separators=(",", ":")
                ).encode(),
            )
            for key, total, weight in step_rows(step)
        )
        assert records == expected, f"step {step}"
    log = [StepRecord.from_json(r.value) for r in seen[steps_topic(name)]]
    assert [r.step for r in log] == list(range(steps))
    letters = seen[dlq_topic(name)]
    assert [int(dict(r.headers)[HEADER_STEP]) for r in letters] == list(range(steps))
    assert [r.value for r in letters] == [b"not json %d" % s for s in range(steps)]


def run_trial(bootstrap: str, topic_factory, crash, steps: int = STEPS) -> None:
    """``crash(name, output)`` runs a writer that dies; then a survivor must finish the job."""
    name = f"p{uuid.uuid4().hex[:12]}"
    output = topic_factory("out", partitions=2)
    crash(name, output)
    survivor = Child(bootstrap, name, output, steps)
    code = survivor.wait()
    assert code == 0, (survivor.lines, survivor.stderr())
    check_exactly_once(bootstrap, name, output, steps)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_killed_at_a_failpoint_then_restarted(
    bootstrap_servers: str, topic_factory, failpoint: str
) -> None:
    def crash(name: str, output: str) -> None:
        armed = Child(bootstrap_servers, name, output, STEPS, failpoint)
        code = armed.wait()
        assert code == FAILPOINT_EXIT_CODE, (failpoint, armed.lines, armed.stderr())

    run_trial(bootstrap_servers, topic_factory, crash)


def test_killed_at_random_instants_then_restarted(
    bootstrap_servers: str, topic_factory, long_run: bool
) -> None:
    rng = random.Random()
    for _ in range(100 if long_run else 10):

        def crash(name: str, output: str) -> None:
            child = Child(bootstrap_servers, name, output, STEPS)
            child.wait_for_line(f"step {rng.randrange(STEPS - 1)}")
            time.sleep(rng.uniform(0.0, 0.03))  # the random instant of the kill
            child.proc.send_signal(signal.SIGKILL)
            assert child.wait() in (-signal.SIGKILL, 0)

        run_trial(bootstrap_servers, topic_factory, crash)


def test_broker_restart_while_writing_loses_and_duplicates_nothing(
    tmp_path: Path, kafka_libs: Path
) -> None:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    broker = LocalBroker(tmp_path / "kafka", find_free_port(), kafka_libs, heap="512m")
    broker.start()
    try:
        bootstrap = broker.bootstrap_servers

        def topic_factory(prefix: str, partitions: int = 1) -> str:
            topic = f"{prefix}-{uuid.uuid4().hex[:12]}"
            admin = AdminClient({"bootstrap.servers": bootstrap})
            admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)
            return topic

        steps = 200
        name = f"p{uuid.uuid4().hex[:12]}"
        output = topic_factory("out", partitions=2)
        child = Child(bootstrap, name, output, steps, pace=0.05)
        child.wait_for_line("step 5")
        broker.stop()
        # The broker stays down until the writer has noticed (its Kafka timeout is 10 s), so
        # the outage certainly hits a step in flight, however fast the broker restarts.
        child.wait_for_line(("reopening", "aborted", "fenced"), timeout=120, may_exit=True)
        broker.start()
        # Like the coordinator, restart a writer that exited on a fatal producer error (the
        # transaction coordinator may answer a post-restart abort with a fatal state error).
        lines: list[str] = []
        for _ in range(5):
            code = child.wait(timeout=240)
            lines += child.lines
            if code != 3:
                break
            child = Child(bootstrap, name, output, steps)
        assert code == 0, ([line for line in lines if not line.startswith("step")], child.stderr())
        # The outage hit the writer while it was writing (it reopened, reran or restarted).
        assert any(line.startswith(("reopening", "aborted", "fenced")) for line in lines)
        check_exactly_once(bootstrap, name, output, steps)
    finally:
        broker.stop()
