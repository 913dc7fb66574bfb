"""Benchmark: keyed_sum on a Spark standalone cluster with state hosts vs the embedded default.

    .venv/bin/python -m bench.cluster [--records 400000] [--keys 50000]
                                      [--max-records-per-step 25000] [--quick]

Self-contained, everything real processes on 127.0.0.1: a private Kafka broker; the input
(``--records`` keyed_sum records over ``--keys`` keys, 2 partitions) produced once, before
either run, so each run works through the same backlog at its own pace. Two runs of
``sparkstep run`` (the coordinator, as a user starts it), in this order, each on a fresh state
dir and ``--name``:

- ``local``: the embedded default: Spark ``local[2,3]``, the workers the coordinator's children;
- ``cluster``: ``sparkstep spark-master`` with two ``sparkstep spark-worker``s (1 core, 1 GiB
  each: two executors), two ``sparkstep state-host``s, and ``--spark-master spark://...
  --state-hosts A,B``; the runtime advertises ``localhost`` and listens on every interface.

Each run: ``--workers 2``, ``--max-records-per-step``, no checkpoint timer. Measured from the
coordinator's ``/metrics``, polled every 0.2 s: the sustained rate is the records / the time
from the state ``running`` to all input in logged steps; the step latency p50 is the
histogram's (``sparkstep_step_latency_seconds``, interpolated in its bucket as Prometheus'
``histogram_quantile`` does) and the mean is its sum / count. Then a rescale 2 -> 3 over REST:
``bytes_moved`` and ``pause_ms`` from its answer (on the cluster the added worker lands on one
host and shards come from both, so some cross hosts). Last, the run is stopped (final
checkpoint) and its output is checked against the input (every key's last row is its true sum).

Ratios are cluster / local, in the same run of this script. The machine has 2 cores: the
cluster's master, workers, executors and hosts share them with the driver, so the ratio says
what the extra processes and network hops cost, not what more machines would give.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.runtime import INPUT_PARTITIONS, Input, make_input

_URL = re.compile(r"at (http://127\.0\.0\.1:\d+)/")
_TOKEN = "bench-cluster-state-host-token-0123456789"


@dataclass
class Measured:
    """One run's figures."""

    name: str
    rate: float
    p50_s: float
    mean_s: float
    steps: int
    rescale_bytes: int
    rescale_shards: int
    pause_ms: int


class Processes:
    """Children in process groups of their own, all SIGKILLed at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sparkstep.cli", *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)


def wait_for(condition: Any, timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def standalone_cluster(procs: Processes) -> Iterator[tuple[str, list[str], Path]]:
    """A Spark master, two workers and two state hosts: (master URL, hosts, token file)."""
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs.start("master", "spark-master", "--port", str(port), "--webui-port", str(ui))

    def alive_workers() -> int:
        try:
            doc = httpx.get(f"http://127.0.0.1:{ui}/json/", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return -1
        return int(doc.get("aliveworkers", 0))

    wait_for(lambda: alive_workers() >= 0, 120, "the Spark master")
    for i in range(2):
        procs.start(
            f"worker{i}", "spark-worker", url, "--cores", "1", "--memory", "1g",
            "--work-dir", str(procs.root / f"spark-worker{i}"), "--webui-port", "0",
        )  # fmt: skip
    wait_for(lambda: alive_workers() == 2, 120, "two Spark workers")
    token = procs.root / "host.token"
    token.write_text(_TOKEN + "\n")
    hosts = []
    for i in range(2):
        port = free_port()
        procs.start(
            f"host{i}", "state-host", "--data-dir", str(procs.root / f"host{i}"),
            "--token-file", str(token), "--slots", "2", "--port", str(port),
        )  # fmt: skip
        hosts.append(f"127.0.0.1:{port}")
    for host in hosts:
        wait_for(lambda h=host: _answers(h), 60, f"the state host {host}")
    yield url, hosts, token


def _answers(host: str) -> bool:
    try:
        return (
            httpx.get(
                f"http://{host}/v1/host",
                headers={"authorization": f"Bearer {_TOKEN}"},
                timeout=5,
            ).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def samples(text: str, family: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(family + "{") or line.startswith(family + " "):
            name, _, value = line.rpartition(" ")
            found[name[len(family) :]] = float(value)
    return found


def histogram_p50(text: str, family: str) -> float:
    """The median of a Prometheus histogram, interpolated within its bucket."""
    buckets = sorted(
        (float("inf") if le == "+Inf" else float(le), n)
        for labels, n in samples(text, f"{family}_bucket").items()
        for le in re.findall(r'le="([^"]+)"', labels)
    )
    total = buckets[-1][1]
    rank, lower, below = total / 2, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = upper, count
    return lower


def measure(
    name: str,
    procs: Processes,
    inp: Input,
    bootstrap: str,
    extra: list[str],
    args: argparse.Namespace,
) -> Measured:
    """One ``sparkstep run`` over the whole backlog, a rescale 2 -> 3, a stop; its figures."""
    run_name = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    out_topic = f"{run_name}-out"
    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.topics import TopicAdmin

    TopicAdmin(KafkaConfig(bootstrap, timeout_s=60)).ensure_topic(out_topic, 2)
    coordinator = procs.start(
        f"coordinator-{name}", "run",
        "--pipeline", "sparkstep.examples.keyed_sum:pipeline",
        "--bootstrap-servers", bootstrap,
        "--state-dir", str(procs.root / f"state-{name}"),
        "--workers", "2", "--api-port", "0", "--name", run_name,
        "--input-topic", inp.topic, "--output-topic", out_topic,
        "--max-records-per-step", str(args.max_records_per_step),
        "--checkpoint-interval", "0",
        *extra,
    )  # fmt: skip
    assert coordinator.stdout is not None
    match = _URL.search(coordinator.stdout.readline().decode())
    assert match, f"no URL from the {name} coordinator (see {procs.root})"
    api = match.group(1)

    def status() -> dict[str, Any]:
        doc: dict[str, Any] = httpx.get(f"{api}/api/v1/status", timeout=30).json()
        assert doc["state"] != "failed", doc
        return doc

    wait_for(lambda: status()["state"] == "running", 600, f"the {name} run to be running")
    started = time.perf_counter()
    ends = {f'{{topic="{inp.topic}",partition="{p}"}}': e for p, e in inp.ends.items()}

    def done() -> bool:
        got = samples(httpx.get(f"{api}/metrics", timeout=30).text, "sparkstep_input_end_offset")
        return all(got.get(k, -1) >= e for k, e in ends.items())

    wait_for(done, args.timeout, f"the {name} run to log all input")
    seconds = time.perf_counter() - started
    time.sleep(2.0)  # the last step's latency is recorded once its transaction committed
    text = httpx.get(f"{api}/metrics", timeout=30).text
    family = "sparkstep_step_latency_seconds"
    count = samples(text, f"{family}_count")
    total = samples(text, f"{family}_sum")
    steps = int(sum(count.values()))
    mean = sum(total.values()) / max(steps, 1)
    rescale = httpx.post(f"{api}/api/v1/rescale", json={"workers": 3}, timeout=1800)
    assert rescale.status_code == 200, rescale.text
    moved = rescale.json()
    stopped = httpx.post(f"{api}/api/v1/stop", timeout=600)
    assert stopped.status_code == 200, stopped.text
    coordinator.wait(120)
    check_output(bootstrap, out_topic, inp)
    return Measured(
        name,
        inp.records / seconds,
        histogram_p50(text, family),
        mean,
        steps,
        int(moved["bytes_moved"]),
        int(moved["shards_moved"]),
        int(moved["pause_ms"]),
    )


def check_output(bootstrap: str, topic: str, inp: Input) -> None:
    """The output (read_committed), integrated: one row per key with weight 1, the true sum
    and count (:meth:`bench.runtime.Truth.check`)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
         "isolation.level": "read_committed", "enable.auto.commit": False}
    )  # fmt: skip
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), 30)[1] for p in range(2)}
    consumer.assign([TopicPartition(topic, p, 0) for p in range(2)])
    weights: dict[tuple[str, int, int], int] = {}

    def behind() -> bool:  # the position steps over transaction markers, offsets do not
        at = consumer.position([TopicPartition(topic, p) for p in range(2)])
        return any(tp.offset < ends[tp.partition] for tp in at if ends[tp.partition] > 0)

    deadline = time.monotonic() + 600
    while behind():
        assert time.monotonic() < deadline, "the output was not read back within 600 s"
        for msg in consumer.consume(10_000, 1.0):
            value = msg.value()
            if msg.error() or value is None:
                continue
            doc = json.loads(value)
            row = (doc["key"], int(doc["sum"]), int(doc["count"]))
            weights[row] = weights.get(row, 0) + int(doc["weight"])
    consumer.close()
    rows = [row for row, weight in weights.items() if weight != 0]
    assert all(weights[row] == 1 for row in rows), "a row integrates to a weight other than 1"
    verdict = inp.truth.check([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    assert verdict == "ok", verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=400_000)
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--max-records-per-step", type=int, default=25_000)
    parser.add_argument("--quick", action="store_true", help="100k records over 10k keys")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if args.quick:
        args.records, args.keys = 100_000, 10_000
    logging.basicConfig(level=logging.WARNING)
    from sparkstep.io.broker import LocalBroker, default_cache_dir, find_free_port, install_kafka

    with tempfile.TemporaryDirectory(prefix="sparkstep-bench-cluster-") as tmp:
        root = Path(tmp)
        broker = LocalBroker(root / "kafka", find_free_port(), install_kafka(default_cache_dir()))
        procs = Processes(root)
        try:
            broker.start()
            bootstrap = broker.bootstrap_servers
            inp = make_input(bootstrap, "bench-cluster", args.records, args.keys)
            local = measure("local", procs, inp, bootstrap, [], args)
            with standalone_cluster(procs) as (url, hosts, token):
                cluster = measure(
                    "cluster", procs, inp, bootstrap,
                    ["--spark-master", url, "--state-hosts", ",".join(hosts),
                     "--state-host-token-file", str(token),
                     "--bind", "0.0.0.0", "--advertise", "localhost"],
                    args,
                )  # fmt: skip
        finally:
            procs.close()
            broker.stop()
    print()
    print(
        f"keyed_sum: {args.records:,} records, {args.keys:,} keys, {INPUT_PARTITIONS} input "
        f"partitions, 2 workers, max {args.max_records_per_step:,} records/step"
    )
    print(f"{'measure':<34}{'local[2,3]':>14}{'cluster':>14}{'cluster/local':>16}")
    rows = [
        ("sustained records/s", local.rate, cluster.rate, "{:,.0f}"),
        ("step latency p50 (s)", local.p50_s, cluster.p50_s, "{:.3f}"),
        ("step latency mean (s)", local.mean_s, cluster.mean_s, "{:.3f}"),
        ("steps", local.steps, cluster.steps, "{:,.0f}"),
        ("rescale 2->3 bytes moved", local.rescale_bytes, cluster.rescale_bytes, "{:,.0f}"),
        ("rescale 2->3 shards moved", local.rescale_shards, cluster.rescale_shards, "{:,.0f}"),
        ("rescale 2->3 pause_ms", local.pause_ms, cluster.pause_ms, "{:,.0f}"),
    ]
    for label, ours, theirs, fmt in rows:
        ratio = f"{theirs / ours:.2f}x" if ours else "-"
        print(f"{label:<34}{fmt.format(ours):>14}{fmt.format(theirs):>14}{ratio:>16}")


if __name__ == "__main__":
    main()
