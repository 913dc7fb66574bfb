"""The ``sparkstep`` command.

Every failure sparkstep knows about (a :class:`~sparkstep.errors.SparkstepError`) is printed as
one line, ``sparkstep: <what is wrong and what to do>``, with exit status 2; a traceback means a
bug in sparkstep.

Environment (read here, at the entry point, and passed down as arguments):

- ``SPARKSTEP_CACHE``: where the Kafka broker jars are installed (default
  ``~/.cache/sparkstep``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.io.broker import LocalBroker, install_kafka

__all__ = ["main"]

DEFAULT_KAFKA_PORT = 9092


def default_cache_dir() -> Path:
    """The cache of downloaded tools: ``$SPARKSTEP_CACHE`` or ``~/.cache/sparkstep``."""
    env = os.environ.get("SPARKSTEP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparkstep"


def _kafka(args: argparse.Namespace) -> int:
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.action == "install":
        libs = install_kafka(cache)
        print(f"Kafka broker jars installed in {libs}")
        return 0
    data_dir = Path(args.data_dir) if args.data_dir else Path(".sparkstep") / f"kafka-{args.port}"
    if args.action == "start":
        broker = LocalBroker(data_dir, args.port, install_kafka(cache))
        pid = broker.start()
        print(f"Kafka broker pid {pid} listening on {broker.bootstrap_servers} (data {data_dir})")
        return 0
    # status and stop need no jars: they only look at the pid file and the port.
    broker = LocalBroker(data_dir, args.port, cache)
    if args.action == "status":
        status = broker.status()
        print(status.describe())
        return 0 if status.running and status.answers else 1
    stopped = broker.stop()
    print(f"broker on port {args.port} stopped" if stopped else "no broker was running")
    return 0


def _produce(args: argparse.Namespace) -> int:
    # Imported here: the Kafka client is not needed by the other commands.
    from sparkstep.io.config import KafkaConfig
    from sparkstep.io.producer import produce_json_lines

    config = KafkaConfig.from_args(args.bootstrap_servers, args.kafka_config or ())
    if args.file is None or args.file == "-":
        report = produce_json_lines(config, args.topic, sys.stdin)
    else:
        try:
            lines = open(args.file, encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise ConfigError(f"cannot read {args.file}: {exc.strerror}") from exc
        with lines:
            report = produce_json_lines(config, args.topic, lines)
    print(report.describe())
    return 0 if report.failed == 0 else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkstep",
        description="Exactly-once, checkpointed, rescalable stateful PySpark pipelines on Kafka.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kafka = commands.add_parser("kafka", help="a local single-node Kafka broker (KRaft)")
    kafka.add_argument("action", choices=["install", "start", "stop", "status"])
    kafka.add_argument("--port", type=int, default=DEFAULT_KAFKA_PORT, help="client port")
    kafka.add_argument("--data-dir", help="the broker's directory (default .sparkstep/kafka-PORT)")
    kafka.add_argument("--cache-dir", help="where the jars are installed ($SPARKSTEP_CACHE)")
    kafka.set_defaults(handler=_kafka)

    produce = commands.add_parser(
        "produce", help="send JSON lines to a topic with acks=all and idempotence"
    )
    produce.add_argument("--bootstrap-servers", required=True, metavar="HOST:PORT")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--file", help="a file of JSON lines (default: standard input)")
    produce.add_argument(
        "--kafka-config",
        action="append",
        metavar="KEY=VALUE",
        help="a client setting (SASL, TLS, ...); repeat for several",
    )
    produce.set_defaults(handler=_produce)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except SparkstepError as exc:
        print(f"sparkstep: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
