"""The ``sparkstep`` command.

Every failure sparkstep knows about (a :class:`~sparkstep.errors.SparkstepError`) is printed as
one line, ``sparkstep: <what is wrong and what to do>``, with exit status 2; a traceback means a
bug in sparkstep.

Commands: ``kafka`` (a local broker), ``spark-master`` and ``spark-worker`` (Spark's standalone
cluster daemons, :mod:`sparkstep.cluster.spark`), ``spark-archive`` (the Spark driver's class
data archive, :mod:`sparkstep.runtime.jvm`), ``state-host`` (state workers on a host for
the coordinators, :mod:`sparkstep.coordinator_api.statehost`), ``produce`` (input), ``run`` (the
coordinator, in the foreground), ``status|pause|resume|checkpoint|checkpoints|rescale N|stop``
(REST clients of a running coordinator, ``--api URL``), ``reset`` (delete a stopped pipeline's
state dir and step log, with ``--yes``), ``up`` (the quickstart).

Environment (read here, at the entry point, and passed down as arguments):

- ``SPARKSTEP_CACHE``: where the Kafka broker jars and the Spark driver's class archive are
  kept (default ``~/.cache/sparkstep``; the runtime process reads it too).
- ``SPARKSTEP_API_TOKEN``: the REST API's bearer token (``run`` requires it from clients; the
  client commands send it).
- ``SPARKSTEP_*``: every setting of ``run`` (see
  :class:`~sparkstep.coordinator_api.settings.CoordinatorSettings`), below the flags and above
  the ``--config`` TOML file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.failpoints import ENV_VAR as FAILPOINT_ENV_VAR
from sparkstep.io.broker import LocalBroker, default_cache_dir, install_kafka

if TYPE_CHECKING:
    from sparkstep.coordinator_api.settings import CoordinatorSettings
    from sparkstep.io.config import KafkaConfig

__all__ = ["main"]

DEFAULT_KAFKA_PORT = 9092
DEFAULT_API = "http://127.0.0.1:8080"
TOKEN_ENV = "SPARKSTEP_API_TOKEN"


def _kafka(args: argparse.Namespace) -> int:
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.action == "install":
        libs = install_kafka(cache)
        print(f"Kafka broker jars installed in {libs}")
        return 0
    data_dir = Path(args.data_dir) if args.data_dir else Path(".sparkstep") / f"kafka-{args.port}"
    if args.action == "run":  # the foreground form: this process becomes the broker
        from sparkstep.net import advertised_host

        advertise = advertised_host(args.bind, args.advertise)
        LocalBroker(
            data_dir, args.port, install_kafka(cache), bind=args.bind, advertise=advertise
        ).run()
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
    if args.demo:
        return _demo_producer(config, args)
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


def _demo_producer(config: KafkaConfig, args: argparse.Namespace) -> int:
    """``produce --demo``: make the topic if it is missing, then keyed_sum input until SIGTERM
    or Ctrl-C (a compose service's demo producer)."""
    import signal

    from sparkstep.io.topics import TopicAdmin
    from sparkstep.quickstart import DemoProducer

    TopicAdmin(config).ensure_topic(args.topic, args.partitions)
    producer = DemoProducer(config, args.rate, args.keys, args.topic)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    producer.start()
    print(f"sending keyed_sum input to {args.topic} at {args.rate:g} records/s", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    producer.stop()
    print(f"sent {producer.sent} records", flush=True)
    return 0


def _spark_daemon(args: argparse.Namespace) -> int:
    from sparkstep.cluster.spark import master_argv, spark_env, worker_argv

    env = spark_env(os.environ)  # first: a missing Java is one line, not a launcher error
    if args.command == "spark-master":
        argv = master_argv(args.host, args.port, args.webui_port)
    else:
        work_dir = Path(args.work_dir).resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
        argv = worker_argv(
            args.master, args.host, args.cores, args.memory, work_dir, args.webui_port
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)  # the process becomes Spark's JVM: its signals, its status


def _spark_archive(args: argparse.Namespace) -> int:
    from sparkstep.runtime.jvm import make_archive

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    print(f"Spark driver class archive ready: {make_archive(cache)}")
    return 0


def _state_host(args: argparse.Namespace) -> int:
    from sparkstep.coordinator_api.statehost import serve_state_host

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.slots < 1:
        raise ConfigError(f"--slots {args.slots}: a state host offers at least 1 worker slot")
    return serve_state_host(
        Path(args.data_dir),
        args.bind,
        args.port,
        args.advertise,
        args.slots,
        Path(args.token_file),
    )


def _child_env() -> dict[str, str]:
    """The environment of the coordinator's children: ours, without armed failpoints (those
    are meant for the process they were given to)."""
    env = dict(os.environ)
    env.pop(FAILPOINT_ENV_VAR, None)
    return env


def _settings(args: argparse.Namespace, not_settings: tuple[str, ...] = ()) -> CoordinatorSettings:
    """The coordinator's settings from the flags given, the environment and ``--config``."""
    from sparkstep.coordinator_api.settings import CoordinatorSettings

    skip = ("command", "handler", "config", *not_settings)
    flags = {key: value for key, value in vars(args).items() if key not in skip}
    return CoordinatorSettings.load(flags, Path(args.config) if args.config else None)


def _run(args: argparse.Namespace) -> int:
    from sparkstep.coordinator_api.serve import serve

    settings = _settings(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control call

    def ready(url: str) -> None:
        print(f"sparkstep coordinator for {settings.pipeline}: REST API and dashboard at {url}/")
        sys.stdout.flush()

    return serve(settings, _child_env(), on_ready=ready)


def _reset(args: argparse.Namespace) -> int:
    from sparkstep.coordinator_api.reset import plan_reset, reset_pipeline
    from sparkstep.io.config import KafkaConfig

    settings = _settings(args, not_settings=("yes",))
    plan = plan_reset(settings)
    if not getattr(args, "yes", False):
        raise ConfigError(f"{plan.describe()}; nothing was deleted: pass --yes to do it")
    kafka = KafkaConfig.from_args(settings.bootstrap_servers, settings.kafka_config)
    print(reset_pipeline(plan, kafka).describe())
    return 0


def _describe_status(doc: dict[str, Any]) -> str:
    checkpoint = doc.get("checkpoint")
    processes = doc.get("processes") or {}
    workers = processes.get("workers") or {}
    lines = [
        f"pipeline    {doc.get('pipeline')}  (deployment {doc.get('deployment') or '-'})",
        f"state       {doc.get('state')}",
        f"step        {doc.get('step') if doc.get('step') is not None else '-'}",
        "checkpoint  "
        + (
            "none yet"
            if not checkpoint
            else f"version {checkpoint['version']} at step {checkpoint['step']} "
            f"({checkpoint['at']})"
        ),
        f"workers     {doc.get('workers')}  (layout epoch {doc.get('layout_epoch')})",
        f"processes   coordinator {processes.get('coordinator')}, runtime "
        f"{processes.get('runtime') or '-'}, workers "
        + (", ".join(f"{i}: {pid}" for i, pid in sorted(workers.items())) or "-"),
    ]
    failure = doc.get("last_failure")
    if failure:
        lines.append(f"last failure {failure['at']}: {failure['reason']}")
    return "\n".join(lines)


def _describe(command: str, doc: dict[str, Any]) -> str:
    if command == "status":
        return _describe_status(doc)
    if command == "pause":
        return f"paused at step {doc['step']}"
    if command == "resume":
        return "running"
    if command == "checkpoint":
        return (
            f"checkpoint version {doc['version']} at step {doc['step']} in {doc['duration_ms']} ms"
        )
    if command == "rescale":
        return (
            f"rescaled ({doc['mode']}) to {doc['workers']} workers (layout epoch "
            f"{doc['layout_epoch']}): {doc['shards_moved']} shards, {doc['bytes_moved']} bytes "
            f"moved ({doc['bytes_precopied']} while running, {doc['rounds']} rounds); paused "
            f"{doc['pause_ms']} ms"
        )
    if command == "stop":
        return f"stopped at step {doc['step']}, checkpoint version {doc['version']}"
    rows = [
        f"version {c['version']:>5}  step {c['step']:>8}  at {c['at']}  "
        + (f"{c['duration_ms']} ms" if c.get("duration_ms") is not None else "")
        for c in doc.get("checkpoints", [])
    ]
    return "\n".join(rows) or "no checkpoints yet"


def _client_command(args: argparse.Namespace) -> int:
    from sparkstep.coordinator_api.client import CoordinatorClient

    with CoordinatorClient(args.api, os.environ.get(TOKEN_ENV) or None) as client:
        if args.command == "rescale":
            doc = client.rescale(args.workers, args.mode)
        else:
            doc = getattr(client, args.command)()
    print(json.dumps(doc, indent=1) if args.json else _describe(args.command, doc))
    return 0


def _up(args: argparse.Namespace) -> int:
    from sparkstep.quickstart import QuickstartOptions, quickstart

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    # The terminal shows the progress line; the coordinator's log goes to a file.
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=str(Path(args.dir) / "coordinator.log"),
        level=logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    options = QuickstartOptions(
        directory=Path(args.dir),
        kafka_libs=install_kafka(cache),
        kafka_port=args.kafka_port,
        api_port=args.api_port,
        workers=args.workers,
        rate=args.rate,
    )
    return quickstart(options, _child_env())


def _add_run(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser(
        "run",
        help="the coordinator: start, supervise and checkpoint a pipeline (foreground)",
        argument_default=argparse.SUPPRESS,
        description="Flags override SPARKSTEP_* environment variables, which override the "
        "--config TOML file. Running the same command after any crash recovers.",
    )
    run.add_argument("--config", default=None, metavar="FILE", help="a TOML file of settings")
    run.add_argument("--pipeline", metavar="MODULE:ATTR")
    run.add_argument("--bootstrap-servers", metavar="HOST:PORT")
    run.add_argument("--state-dir", metavar="DIR")
    run.add_argument("--workers", type=int, metavar="N")
    run.add_argument("--api-port", type=int, metavar="PORT")
    run.add_argument(
        "--api-host",
        metavar="HOST",
        help="default 127.0.0.1; another address needs SPARKSTEP_API_TOKEN or --insecure-no-auth",
    )
    run.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve the REST API without a token on a non-loopback --api-host",
    )
    run.add_argument("--name", help="namespaces the step log, dead letters, group, txn id")
    run.add_argument(
        "--checkpoint-interval", type=float, dest="checkpoint_interval_s", metavar="SECONDS"
    )
    run.add_argument("--max-records-per-step", type=int, metavar="N")
    run.add_argument(
        "--max-bytes-per-step",
        type=int,
        metavar="BYTES",
        help="input keys and values per step (default 256 MiB; a larger record is read alone)",
    )
    run.add_argument(
        "--rescale-catchup-keys",
        type=int,
        metavar="N",
        help="a hot rescale copies rounds of changes while running until at most N changed "
        "keys are left for its pause (default 20000)",
    )
    run.add_argument("--start-from", choices=["earliest", "latest"])
    run.add_argument(
        "--on-replay-mismatch",
        choices=["fail", "reemit"],
        help="a replayed step that differs from its log: fail (default), or write the difference",
    )
    run.add_argument("--input-topic", action="append", dest="input_topics", metavar="[NAME=]TOPIC")
    run.add_argument("--output-topic", metavar="TOPIC")
    run.add_argument(
        "--kafka-config",
        action="append",
        metavar="KEY=VALUE",
        help="a Kafka client setting; a flag is visible in ps, so put secrets in "
        "SPARKSTEP_KAFKA_CONFIG or the --config file (the runtime gets them in a 0600 file)",
    )
    run.add_argument("--spark-master", metavar="URL")
    run.add_argument(
        "--bind",
        metavar="HOST",
        help="where the state workers and the runtime listen (default 127.0.0.1; a cluster "
        "binds 0.0.0.0)",
    )
    run.add_argument(
        "--advertise",
        metavar="HOST",
        help="the host name the other hosts dial them by (default: the bind address, or this "
        "host's name for 0.0.0.0)",
    )
    run.add_argument("--spark-driver-port", type=int, metavar="PORT")
    run.add_argument("--spark-block-manager-port", type=int, metavar="PORT")
    run.add_argument(
        "--py-files",
        action="append",
        dest="py_files",
        metavar="FILE",
        help="a .py module or .zip of packages shipped to the Spark executors (the pipeline's "
        "own code, when it is not installed on the executor hosts)",
    )
    run.add_argument(
        "--state-hosts",
        metavar="HOST:PORT,...",
        help="run the state workers on these `sparkstep state-host`s (default: as children of "
        "the coordinator)",
    )
    run.add_argument(
        "--state-host-token-file",
        metavar="FILE",
        help="the state hosts' token (the file they were given as --token-file)",
    )
    run.add_argument("--restart-strategy", choices=["fixed-delay", "failure-rate", "none"])
    run.add_argument("--restart-delay", type=float, dest="restart_delay_s", metavar="SECONDS")
    run.add_argument("--restart-attempts", type=int, metavar="N", help="fixed-delay")
    run.add_argument("--max-failures-per-interval", type=int, metavar="N", help="failure-rate")
    run.add_argument(
        "--failure-rate-interval", type=float, dest="failure_rate_interval_s", metavar="SECONDS"
    )
    run.add_argument("--retained-checkpoints", type=int, metavar="N")
    run.set_defaults(handler=_run)


def _add_reset(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    reset = commands.add_parser(
        "reset",
        help="delete a stopped pipeline's state dir and step log topic, to start it afresh",
        argument_default=argparse.SUPPRESS,
        description="Takes the settings of `sparkstep run` (flags, SPARKSTEP_*, --config) to "
        "find the state dir and the step log topic <name>.steps. Refused while a coordinator "
        "or a worker uses the state dir. The input, output and dead-letter topics are kept.",
    )
    reset.add_argument("--config", default=None, metavar="FILE", help="a TOML file of settings")
    reset.add_argument("--pipeline", metavar="MODULE:ATTR")
    reset.add_argument("--bootstrap-servers", metavar="HOST:PORT")
    reset.add_argument("--state-dir", metavar="DIR")
    reset.add_argument("--name", help="the pipeline's --name, if it was run with one")
    reset.add_argument("--kafka-config", action="append", metavar="KEY=VALUE")
    reset.add_argument("--yes", action="store_true", help="do it (without: say what it would do)")
    reset.set_defaults(handler=_reset)


def _add_clients(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    helps = {
        "status": "the pipeline's state, step, checkpoint and processes",
        "pause": "pause at the next step boundary",
        "resume": "resume a paused pipeline",
        "checkpoint": "take a checkpoint now",
        "checkpoints": "the retained checkpoints",
        "rescale": "change the number of state workers",
        "stop": "a final checkpoint, then every process exits",
    }
    for name, text in helps.items():
        client = commands.add_parser(name, help=f"{text} (REST client)")
        if name == "rescale":
            client.add_argument("workers", type=int, metavar="N")
            client.add_argument(
                "--mode",
                choices=("hot", "cold"),
                default="hot",
                help="hot (default): copy the moving state while the pipeline runs and pause "
                "only to switch; cold: pause for the whole move",
            )
        client.add_argument("--api", default=DEFAULT_API, metavar="URL", help=DEFAULT_API)
        client.add_argument("--json", action="store_true", help="print the JSON answer")
        client.set_defaults(handler=_client_command)


def _add_spark_daemons(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    master = commands.add_parser(
        "spark-master",
        help="Spark's standalone master from the installed pyspark (foreground)",
    )
    master.add_argument("--host", default="127.0.0.1", help="the address it binds and advertises")
    master.add_argument("--port", type=int, default=7077)
    master.add_argument("--webui-port", type=int, default=8081)
    master.set_defaults(handler=_spark_daemon)
    worker = commands.add_parser(
        "spark-worker",
        help="a Spark standalone worker from the installed pyspark (foreground)",
    )
    worker.add_argument("master", metavar="spark://HOST:PORT")
    worker.add_argument("--host", default="127.0.0.1", help="the address it binds and advertises")
    worker.add_argument("--cores", type=int, default=1, help="cores offered to executors")
    worker.add_argument("--memory", default="1g", help="memory offered to executors")
    worker.add_argument("--work-dir", default=".sparkstep/spark-worker", metavar="DIR")
    worker.add_argument("--webui-port", type=int, default=8082)
    worker.set_defaults(handler=_spark_daemon)
    archive = commands.add_parser(
        "spark-archive",
        help="make the Spark driver's class data archive, which shortens every runtime start",
        description="Trains a Spark driver JVM and keeps the classes it loaded as a class data "
        "archive (AppCDS) in the cache dir; every later runtime start maps it (about 3 s less "
        "on 2 cores). Once per pyspark install and Java; nothing to do when it is there.",
    )
    archive.add_argument("--cache-dir", help="where the archive is kept ($SPARKSTEP_CACHE)")
    archive.set_defaults(handler=_spark_archive)


def _add_state_host(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    host = commands.add_parser(
        "state-host",
        help="run state workers on this host for coordinators (foreground)",
        description="Starts, stops and watches state-worker processes on this host for the "
        "coordinators that name it in --state-hosts; their stores live in --data-dir.",
    )
    host.add_argument("--data-dir", required=True, metavar="DIR", help="the workers' stores")
    host.add_argument("--token-file", required=True, metavar="FILE", help="its bearer token")
    host.add_argument("--slots", type=int, default=4, help="how many workers it runs at most")
    host.add_argument(
        "--bind", default="127.0.0.1", metavar="HOST", help="where it and its workers listen"
    )
    host.add_argument("--port", type=int, default=7100, help="its REST port (0: a free one)")
    host.add_argument(
        "--advertise",
        metavar="HOST",
        help="the host name coordinators, the runtime and Spark executors dial (default: the "
        "bind address, or this host's name for 0.0.0.0)",
    )
    host.set_defaults(handler=_state_host)


def _add_up(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = commands.add_parser(
        "up", help="the quickstart: broker, example pipeline, demo producer, live progress"
    )
    up.add_argument("--dir", default=".sparkstep/up", help="broker data and pipeline state")
    up.add_argument("--kafka-port", type=int, help="default: a free port")
    up.add_argument("--api-port", type=int, default=8080, help="0 picks a free port")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--rate", type=float, default=200.0, help="demo records per second")
    up.add_argument("--cache-dir", help="where the Kafka jars are installed ($SPARKSTEP_CACHE)")
    up.set_defaults(handler=_up)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkstep",
        description="Exactly-once, checkpointed, rescalable stateful PySpark pipelines on Kafka.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kafka = commands.add_parser("kafka", help="a local single-node Kafka broker (KRaft)")
    kafka.add_argument(
        "action",
        choices=["install", "start", "run", "stop", "status"],
        help="start: in the background, on 127.0.0.1; run: in the foreground (a container)",
    )
    kafka.add_argument("--port", type=int, default=DEFAULT_KAFKA_PORT, help="client port")
    kafka.add_argument("--data-dir", help="the broker's directory (default .sparkstep/kafka-PORT)")
    kafka.add_argument("--cache-dir", help="where the jars are installed ($SPARKSTEP_CACHE)")
    kafka.add_argument("--bind", default="127.0.0.1", help="run: the address clients connect to")
    kafka.add_argument(
        "--advertise", help="run: the host clients are told to use (default: the bind address)"
    )
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
    produce.add_argument(
        "--demo",
        action="store_true",
        help="instead of lines, send keyed_sum input at --rate until stopped (makes the topic "
        "with --partitions if it is missing)",
    )
    produce.add_argument("--rate", type=float, default=50.0, help="--demo: records per second")
    produce.add_argument("--keys", type=int, default=50, help="--demo: distinct keys")
    produce.add_argument("--partitions", type=int, default=2, help="--demo: a new topic's")
    produce.set_defaults(handler=_produce)
    _add_spark_daemons(commands)
    _add_state_host(commands)
    _add_run(commands)
    _add_reset(commands)
    _add_clients(commands)
    _add_up(commands)
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
