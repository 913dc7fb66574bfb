"""``python -m sparkstep.runtime``: the runtime process (the Spark driver and its step loop).

    python -m sparkstep.runtime --pipeline MODULE:ATTR --bootstrap-servers HOST:PORT
        --state-dir DIR --worker HOST:PORT [--worker ...] --token-file F
        [--kafka-settings-file F] [--name NAME] [--input-topic [NAME=]TOPIC ...] [--output-topic T]
        [--max-records-per-step N] [--max-bytes-per-step BYTES] [--start-from earliest|latest]
        [--rescale-catchup-keys N]
        [--on-replay-mismatch fail|reemit]
        [--spark-master URL] [--spark-driver-port P] [--spark-block-manager-port P]
        [--py-files FILE ...] [--bind HOST] [--advertise HOST] [--control-port P]
        [--ignore-stdin]

The coordinator starts it after the state workers (whose addresses it passes, in worker order);
tests start it the same way. Procedure:

1. Die with the parent: the parent-death signal, and exit at EOF of stdin (a pipe from the
   parent) unless ``--ignore-stdin``.
2. Start Spark (``local[2,3]`` by default: with F >= 2 failed tasks are retried as on a
   cluster; speculation off). The driver listens on ``--bind`` and tells the executors to dial
   the advertised host (``spark.driver.bindAddress``, ``spark.driver.host``), on fixed ports if
   given (``--spark-driver-port``, ``--spark-block-manager-port``: what a container publishes).
   Every ``--py-files`` file (a ``.py`` module, or a ``.zip``/``.egg`` of packages) is on the
   driver's ``sys.path`` before the pipeline is loaded and is shipped to every executor
   (``SparkContext.addPyFile``): that is how a pipeline module that is not installed on the
   executor hosts reaches them. sparkstep itself must be installed there (one image for every
   service: the repository's ``Dockerfile``). The driver JVM logs on stderr, and maps the
   class data archive of ``$SPARKSTEP_CACHE`` (default ``~/.cache/sparkstep``) if one is ready
   (:mod:`sparkstep.runtime.jvm`: about 3 s less at every start).
3. Recover (:meth:`Runtime.recover`: fence the old writer, open the stores at the manifest's
   version, replay the logged steps).
4. Serve the control endpoint (:mod:`sparkstep.runtime.control`) on ``--bind`` (127.0.0.1 by
   default) and print one JSON line on stdout, ``{"port": P, "pid": PID, "step": S,
   "address": "HOST:PORT"}``: the runtime is ready. ``address`` is what the coordinator dials
   (:func:`sparkstep.net.advertised_host`).
5. Run the step loop until ``POST /stop`` (a final checkpoint) or a failure.

Exit status (one line on stderr says why, except after a stop):

- 0 (``EXIT_STOPPED``): stopped by ``POST /stop`` after its final checkpoint;
- 2 (:data:`EXIT_CONFIG`): a configuration error: the pipeline or its settings, a pipeline whose
  stateful operators are not those the state was made by, stores of another state format, or a
  replay that no longer matches its log under ``--on-replay-mismatch=fail``. Restarting cannot
  help; the coordinator does not;
- 3 (:data:`EXIT_FAILED`): any other failure, in recovery or in the loop; the coordinator
  recovers;
- 4 (:data:`EXIT_PERMANENT`): a step failed with the same cause as the last time it ran (it
  will fail on every replay: :mod:`sparkstep.runtime.failure`). The coordinator does not
  restart it.

:data:`NO_RESTART` holds the statuses a supervisor must not restart on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.io.broker import default_cache_dir
from sparkstep.io.config import KafkaConfig, read_kafka_settings_file
from sparkstep.io.division import DEFAULT_MAX_BYTES_PER_STEP, DEFAULT_MAX_RECORDS_PER_STEP
from sparkstep.io.errors import ReplayMismatchError
from sparkstep.net import DEFAULT_BIND, advertised_host, host_port
from sparkstep.runtime.control import control_app
from sparkstep.runtime.driver import Runtime, RuntimeOptions
from sparkstep.runtime.errors import (
    NonLinearPlanError,
    PipelineChangedError,
    PipelineDefinitionError,
    StateFormatError,
)
from sparkstep.runtime.failure import TRANSIENT, StepFailure, record_failure
from sparkstep.runtime.jvm import driver_java_options
from sparkstep.runtime.pipeline import load_pipeline, resolve_topics
from sparkstep.runtime.rescale import CATCHUP_KEYS
from sparkstep.runtime.runstate import RunState
from sparkstep.runtime.step import NARROW_STEP_OFFSETS
from sparkstep.runtime.worker.__main__ import set_parent_death_signal
from sparkstep.runtime.worker.client import WorkerClient

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DEFAULT_SPARK_MASTER",
    "DriverNetwork",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_PERMANENT",
    "EXIT_STOPPED",
    "NO_RESTART",
    "main",
    "spark_session",
]

DEFAULT_SPARK_MASTER = "local[2,3]"
EXIT_STOPPED = 0
EXIT_CONFIG = 2
EXIT_FAILED = 3
EXIT_PERMANENT = 4
NO_RESTART = frozenset({EXIT_CONFIG, EXIT_PERMANENT})
"""Exit statuses after which restarting the runtime cannot help."""

_CONFIG_ERRORS = (
    ConfigError,
    PipelineChangedError,
    PipelineDefinitionError,
    NonLinearPlanError,
    ReplayMismatchError,
    StateFormatError,  # the state dir is another sparkstep's: restarting cannot read it
)

log = logging.getLogger("sparkstep.runtime")


@dataclass(frozen=True)
class DriverNetwork:
    """Where the Spark driver listens (``bind``), the host its executors dial (``host``), and
    its fixed ports (None: Spark picks free ones)."""

    bind: str = DEFAULT_BIND
    host: str = DEFAULT_BIND
    port: int | None = None
    block_manager_port: int | None = None


def spark_session(
    master: str,
    app_name: str,
    network: DriverNetwork = DriverNetwork(),
    *,
    cache_dir: Path,
) -> SparkSession:
    """The driver's SparkSession: retries on, speculation off, Python workers on this Python;
    the driver JVM's options from :func:`~sparkstep.runtime.jvm.driver_java_options` (its log
    on stderr, the class archive of ``cache_dir`` if one is ready)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master)
    builder = builder.config("spark.driver.extraJavaOptions", driver_java_options(cache_dir))
    builder = builder.config("spark.driver.bindAddress", network.bind)
    builder = builder.config("spark.driver.host", network.host)
    if network.port is not None:
        builder = builder.config("spark.driver.port", str(network.port))
    if network.block_manager_port is not None:
        builder = builder.config("spark.blockManager.port", str(network.block_manager_port))
    session: SparkSession = (
        builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.speculation", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sparkstep.runtime")
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--worker", action="append", required=True, dest="workers")
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--name")
    parser.add_argument("--input-topic", action="append", default=[], dest="input_topics")
    parser.add_argument("--output-topic")
    parser.add_argument("--max-records-per-step", type=int, default=DEFAULT_MAX_RECORDS_PER_STEP)
    parser.add_argument("--max-bytes-per-step", type=int, default=DEFAULT_MAX_BYTES_PER_STEP)
    parser.add_argument("--on-replay-mismatch", choices=["fail", "reemit"], default="fail")
    parser.add_argument("--rescale-catchup-keys", type=int, default=CATCHUP_KEYS)
    parser.add_argument("--start-from", choices=["earliest", "latest"], default="earliest")
    # Steps of at most this many offsets run as one Spark stage (step.py, "Small steps are one
    # Spark stage"); 0: every step runs the wide plan. The crash tests run both ways.
    parser.add_argument("--narrow-step-offsets", type=int, default=NARROW_STEP_OFFSETS)
    # Kafka client settings (secrets) come in a 0600 file, never on the world-readable argv.
    parser.add_argument("--kafka-settings-file")
    parser.add_argument("--spark-master", default=DEFAULT_SPARK_MASTER)
    parser.add_argument("--spark-driver-port", type=int)
    parser.add_argument("--spark-block-manager-port", type=int)
    parser.add_argument("--py-files", action="append", default=[], dest="py_files")
    parser.add_argument("--bind", default=DEFAULT_BIND)
    parser.add_argument("--advertise")
    parser.add_argument("--control-port", type=int, default=0)
    parser.add_argument("--ignore-stdin", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Step 1. Die with the parent.
    set_parent_death_signal()
    runtime: Runtime | None = None
    try:
        token = Path(args.token_file).read_text().strip()
        py_files = [_driver_import_path(path) for path in args.py_files]
        pipeline = load_pipeline(args.pipeline)
        name = args.name or pipeline.name
        options = RuntimeOptions(
            name=name,
            state_dir=Path(args.state_dir),
            token=token,
            topics=resolve_topics(pipeline, args.input_topics),
            output_topic=args.output_topic or f"{name}.out",
            stores=tuple(f"workers/w{i}" for i in range(len(args.workers))),
            max_records_per_step=args.max_records_per_step,
            max_bytes_per_step=args.max_bytes_per_step,
            on_replay_mismatch=args.on_replay_mismatch,
            start_from=args.start_from,
            rescale_catchup_keys=args.rescale_catchup_keys,
            narrow_step_offsets=args.narrow_step_offsets,
        )
        pairs: tuple[str, ...] = ()
        if args.kafka_settings_file:
            pairs = read_kafka_settings_file(Path(args.kafka_settings_file))
        kafka = KafkaConfig.from_args(args.bootstrap_servers, pairs)
        # Step 2. Spark.
        advertised = advertised_host(args.bind, args.advertise)
        network = DriverNetwork(
            bind=args.bind,
            host=advertised,
            port=args.spark_driver_port,
            block_manager_port=args.spark_block_manager_port,
        )
        spark = spark_session(
            args.spark_master, f"sparkstep-{name}", network, cache_dir=default_cache_dir()
        )
        for path in py_files:
            spark.sparkContext.addPyFile(str(path))
        # Step 3. Recover.
        workers = [WorkerClient(address, token) for address in args.workers]
        runtime = Runtime(spark, pipeline, options, kafka, workers)
        step = runtime.recover()
    except _CONFIG_ERRORS as exc:
        print(f"sparkstep: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except SparkstepError as exc:  # Kafka or a worker unreachable, a replayed step failed, ...
        print(f"sparkstep: recovery failed: {exc}", file=sys.stderr)
        return _failed(runtime, exc)
    # Step 4. The control endpoint.
    state = RunState()
    stopped = threading.Event()
    app = control_app(runtime, state, token, on_stop=stopped.set)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.bind, port=args.control_port, log_level="warning")
    )
    serving = threading.Thread(target=server.run, name="control", daemon=True)
    serving.start()
    while not server.started:
        if not serving.is_alive():
            print("sparkstep: the control endpoint could not start", file=sys.stderr)
            return EXIT_FAILED
        stopped.wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    ready = {"port": port, "pid": os.getpid(), "step": step, "address": host_port(advertised, port)}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    if not args.ignore_stdin:

        def watch_stdin() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            log.warning("the parent closed our stdin: exiting")
            os._exit(EXIT_FAILED)

        threading.Thread(target=watch_stdin, name="stdin-eof", daemon=True).start()
    # Step 5. The loop, until stopped or failed.
    try:
        runtime.run(state)
    except BaseException as exc:
        log.error("the step loop failed: %s", exc, exc_info=not isinstance(exc, SparkstepError))
        status = _failed(runtime, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    stopped.wait(30)  # the /stop answer is sent after the loop stopped
    server.should_exit = True
    serving.join(10)
    sys.stdout.flush()
    os._exit(EXIT_STOPPED)


def _driver_import_path(path: str) -> Path:
    """Put a ``--py-files`` file on the driver's ``sys.path`` (its directory for a ``.py``
    module, the archive itself for a ``.zip``/``.egg``); returns its absolute path. Raises
    :class:`ConfigError` for a file that is missing or of another kind."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"--py-files {path}: no such file")
    if file.suffix == ".py":
        entry = str(file.parent)
    elif file.suffix in (".zip", ".egg"):
        entry = str(file)
    else:
        raise ConfigError(f"--py-files {path}: give a .py module or a .zip or .egg of packages")
    if entry not in sys.path:
        sys.path.insert(0, entry)
    return file


def _failed(runtime: Runtime | None, exc: BaseException) -> int:
    """The exit status of a failure: :data:`EXIT_PERMANENT` if it is a step's failure that
    recurred (recorded and compared by :mod:`sparkstep.runtime.failure`), else
    :data:`EXIT_FAILED`."""
    step = None if runtime is None else runtime.failing_step
    if runtime is None or step is None or isinstance(exc, TRANSIENT):
        return EXIT_FAILED
    failure = StepFailure.of(step, exc)
    try:
        recurred = record_failure(runtime.options.state_dir, failure)
    except OSError as err:
        log.warning("the failure of step %d could not be recorded: %s", step, err)
        return EXIT_FAILED
    if not recurred:
        return EXIT_FAILED
    print(
        f"sparkstep: step {step} failed again with the same cause, so it fails on every replay "
        f"and restarting cannot help: {failure.cause}. Fix the cause (the pipeline's code or "
        "its input), or start a new deployment with a new --state-dir and --name",
        file=sys.stderr,
    )
    return EXIT_PERMANENT
