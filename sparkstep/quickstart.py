"""``sparkstep up``: the quickstart, everything on this machine in one command.

In this order:

1. a local Kafka broker (:class:`~sparkstep.io.broker.LocalBroker`) with its data in
   ``<dir>/kafka`` on the given or a free port;
2. the input topic ``events`` (2 partitions);
3. a demo producer thread: ``{"key": "k<n>", "value": <int>}`` records at ``rate`` per second;
4. the coordinator (:func:`~sparkstep.coordinator_api.serve.serve`) running
   ``sparkstep.examples.keyed_sum`` with its state in ``<dir>/state``; the dashboard's address
   is printed, and a progress line (state, step, records/s, last checkpoint) is kept up to date
   (rewritten in place on a terminal, a line every few seconds otherwise);
5. Ctrl-C (or SIGTERM): the producer stops, the pipeline stops with a final checkpoint, the
   broker stops. Running it again on the same ``dir`` recovers and carries on.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from sparkstep.coordinator_api.serve import serve
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from sparkstep.io.broker import LocalBroker, find_free_port
from sparkstep.io.config import KafkaConfig
from sparkstep.io.producer import InputProducer
from sparkstep.io.topics import TopicAdmin

__all__ = ["QuickstartOptions", "quickstart"]

PIPELINE = "sparkstep.examples.keyed_sum:pipeline"
INPUT_TOPIC = "events"


@dataclass(frozen=True)
class QuickstartOptions:
    """``sparkstep up``'s settings: where, which ports, how fast the demo producer sends."""

    directory: Path
    kafka_libs: Path
    kafka_port: int | None = None
    api_port: int = 8080
    workers: int = 2
    rate: float = 200.0
    checkpoint_interval_s: float = 10.0
    keys: int = 50


class DemoProducer:
    """Sends keyed_sum input (``{"key": "k<n>", "value": 1..99}``, keys uniform over ``keys``)
    to ``topic`` at about ``rate`` records per second until stopped (the quickstart's, and
    ``sparkstep produce --demo``)."""

    def __init__(
        self, kafka: KafkaConfig, rate: float, keys: int, topic: str = INPUT_TOPIC
    ) -> None:
        self.producer = InputProducer(kafka, topic)
        self.rate = rate
        self.keys = keys
        self.sent = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="demo-producer", daemon=True)

    def _run(self) -> None:
        rng = random.Random()
        started = time.monotonic()
        while not self.stopped.wait(0.05):
            due = int((time.monotonic() - started) * self.rate) - self.sent
            for _ in range(max(due, 0)):
                key = f"k{rng.randrange(self.keys)}"
                doc = {"key": key, "value": rng.randrange(1, 100)}
                self.producer.send(json.dumps(doc).encode(), key.encode())
                self.sent += 1
        self.producer.flush()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(60)


class _Progress:
    """The live progress line: state, step, records/s, last checkpoint."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last: tuple[float, int] | None = None
        self.printed_at = 0.0
        self.rate = 0.0

    def __call__(self, supervisor: Supervisor) -> None:
        status, runtime = supervisor.status_and_runtime()
        now = time.monotonic()
        consumed = _consumed(runtime)
        if consumed is not None:
            if self.last is not None and now > self.last[0]:
                self.rate = (consumed - self.last[1]) / (now - self.last[0])
            self.last = (now, consumed)
        checkpoint = status["checkpoint"]
        step = "-" if status["step"] is None else str(status["step"])
        last = (
            "none"
            if checkpoint is None
            else f"v{checkpoint['version']} at step {checkpoint['step']}"
        )
        line = (
            f"state {status['state']:<10} step {step:>6}  {self.rate:8.0f} records/s  "
            f"last checkpoint {last}"
        )
        if self.tty:
            self.out.write("\r" + line + "\x1b[K")
            self.out.flush()
        elif now - self.printed_at >= 2.0:
            self.out.write(line + "\n")
            self.out.flush()
            self.printed_at = now


def _consumed(runtime: Mapping[str, object] | None) -> int | None:
    if runtime is None:
        return None
    ends = runtime.get("input_ends")
    if not isinstance(ends, Mapping):
        return None
    return sum(int(str(v)) for v in ends.values())


def quickstart(options: QuickstartOptions, child_env: Mapping[str, str]) -> int:
    """Run the quickstart until Ctrl-C; see the module docstring. Returns the exit status."""
    out = sys.stdout
    directory = options.directory.resolve()
    # Step 1. The broker.
    port = options.kafka_port or find_free_port()
    broker = LocalBroker(directory / "kafka", port, options.kafka_libs)
    out.write(f"starting a Kafka broker on {broker.bootstrap_servers} (data {broker.data_dir})\n")
    out.flush()
    broker.start()
    try:
        kafka = KafkaConfig(broker.bootstrap_servers)
        # Step 2. The input topic.
        TopicAdmin(kafka).ensure_topic(INPUT_TOPIC, 2)
        # Step 3. The demo producer.
        producer = DemoProducer(kafka, options.rate, options.keys)
        producer.start()
        try:
            # Step 4. The coordinator, with the example pipeline.
            settings = CoordinatorSettings.model_validate(
                {
                    "pipeline": PIPELINE,
                    "bootstrap_servers": broker.bootstrap_servers,
                    "state_dir": directory / "state",
                    "workers": options.workers,
                    "api_port": options.api_port,
                    "checkpoint_interval_s": options.checkpoint_interval_s,
                    "input_topics": (INPUT_TOPIC,),
                    "max_records_per_step": 2_000,
                }
            )

            def ready(url: str) -> None:
                out.write(
                    f"dashboard: {url}/   (REST: {url}/api/v1/status; Ctrl-C stops everything)\n"
                    f"starting {options.workers} state workers and the runtime (Spark); logs in "
                    f"{directory / 'coordinator.log'} and {directory / 'state' / 'logs'}\n"
                )
                out.flush()

            code = serve(settings, child_env, on_ready=ready, on_tick=_Progress(out))
        finally:
            # Step 5. Stop in order: input, pipeline (above), broker (below).
            producer.stop()
    finally:
        broker.stop()
    out.write(f"\nstopped: produced {producer.sent} records; state kept in {directory}\n")
    out.flush()
    return code
