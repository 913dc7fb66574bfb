"""A local single-node Apache Kafka broker (KRaft) for development, tests and the quickstart.

The broker is the real Apache Kafka server, fetched from Maven Central by Maven using the pom
shipped beside this module (``broker_pom.xml``) into a cache directory, and started as
``java -cp '<libs>/*' kafka.Kafka server.properties``. Nothing is faked or embedded.

A broker lives in a data directory that holds everything about it::

    <data_dir>/server.properties   written at every start (ports may change between starts)
    <data_dir>/log4j2.properties   logging to broker.log
    <data_dir>/broker.pid          the pid of the running broker, removed by stop()
    <data_dir>/broker.log          the broker's own log; broker.out its stdout/stderr
    <data_dir>/controller.port     the KRaft controller port, reused across restarts
    <data_dir>/kraft/              the log dirs, formatted on first use (meta.properties)

Invariants:

- ``start()`` returns only once the broker answers a metadata request on ``127.0.0.1:port``;
  if it dies or does not answer within the timeout it is killed and :class:`BrokerError` says
  why, with the tail of its log.
- ``stop()`` signals exactly the recorded pid (checked to be a Kafka broker, so a reused pid is
  never hit), waits for it to exit and for the port to be free.
- Several brokers run side by side when they have different ports and data directories.
- Clients connect on ``bind:port`` (default ``127.0.0.1``; a container binds ``0.0.0.0``) and are
  told to come back by ``advertise:port`` (default: the bind address); the KRaft controller
  always listens on loopback only.
- :meth:`LocalBroker.run` is the foreground form, for a container: it formats the data dir if
  needed and then *becomes* the broker's JVM (``exec``), so signals reach Kafka directly.
- The configuration makes transactions and consumer groups work on one node: the replication
  factors and min ISR of the internal topics are 1.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import NoReturn

from confluent_kafka.admin import AdminClient

from sparkstep.errors import MissingToolError
from sparkstep.io.errors import BrokerError

__all__ = [
    "BrokerStatus",
    "LocalBroker",
    "default_cache_dir",
    "find_free_port",
    "install_kafka",
    "install_maven_jars",
    "installed_kafka_libs",
    "java_executable",
]

_MAIN_CLASS = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"
_MIN_JAVA = 17


def default_cache_dir() -> Path:
    """The cache of installed tools (the broker's jars, the Spark driver's class archive):
    ``$SPARKSTEP_CACHE`` or ``~/.cache/sparkstep``. Read only by entry points (the CLI, the
    runtime process), which pass it down."""
    env = os.environ.get("SPARKSTEP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sparkstep"


def _pom_bytes() -> bytes:
    return resources.files("sparkstep.io").joinpath("broker_pom.xml").read_bytes()


def _install_dir(cache_dir: Path, name: str, pom: bytes) -> Path:
    # Keyed by the pom's content, so a changed pom installs afresh beside the old one.
    digest = hashlib.sha256(pom).hexdigest()[:12]
    return cache_dir / f"{name}-{digest}"


def installed_kafka_libs(cache_dir: Path) -> Path | None:
    """The directory of broker jars installed under ``cache_dir``, or None if not installed."""
    return _installed(_install_dir(cache_dir, "kafka", _pom_bytes()))


def _installed(home: Path) -> Path | None:
    libs = home / "libs"
    return libs if (home / "COMPLETE").exists() and libs.is_dir() else None


def java_executable() -> str:
    """The path of a Java 17+ ``java``; raises :class:`MissingToolError` if there is none."""
    java = shutil.which("java")
    if java is None:
        raise MissingToolError(
            "Java 17+ is required to run the Kafka broker and Spark, and `java` is not on PATH: "
            "install a JDK 17 or newer (e.g. `apt-get install openjdk-17-jdk-headless`)"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        raise MissingToolError(f"could not tell the version of {java}: install Java 17 or newer")
    major = int(match.group(1))
    if major == 1 and match.group(2):  # "1.8.0" style
        major = int(match.group(2))
    if major < _MIN_JAVA:
        raise MissingToolError(
            f"Java {_MIN_JAVA}+ is required, {java} is Java {major}: install a newer JDK "
            "and put it first on PATH"
        )
    return java


def _maven_executable(what: str) -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            f"Maven is required to install {what} from Maven Central, and `mvn` is not "
            "on PATH: install it (e.g. `apt-get install maven`)"
        )
    return mvn


def install_kafka(cache_dir: Path) -> Path:
    """Install the broker jars under ``cache_dir`` (once) and return their directory.

    ``org.apache.kafka:kafka_2.13`` and its runtime dependencies, as
    :func:`install_maven_jars` installs them.
    """
    return install_maven_jars(cache_dir, "kafka", _pom_bytes(), "the Kafka broker")


def install_maven_jars(cache_dir: Path, name: str, pom: bytes, what: str) -> Path:
    """Install the runtime dependencies ``pom`` names under ``cache_dir`` (once); return their
    directory, ``<cache_dir>/<name>-<pom digest>/libs``.

    Maven (``dependency:copy-dependencies``) fetches them from Maven Central into a temporary
    directory which is renamed into place only when complete, so an interrupted install never
    leaves a half-filled ``libs`` that looks installed. ``what`` names the jars in errors.
    """
    cache_dir = cache_dir.resolve()  # Maven resolves a relative path against the pom's dir
    home = _install_dir(cache_dir, name, pom)
    libs = _installed(home)
    if libs is not None:
        return libs
    java_executable()
    mvn = _maven_executable(what)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-install-", dir=cache_dir))
    try:
        pom_file = staging / "pom.xml"
        pom_file.write_bytes(pom)
        cmd = [
            mvn, "-q", "-B", "-f", str(pom_file), "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={staging / 'libs'}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise BrokerError(
                f"Maven could not fetch {what} from Maven Central "
                f"(exit {done.returncode}): {' | '.join(tail)}"
            )
        (staging / "COMPLETE").write_text("ok\n")
        if home.exists():
            shutil.rmtree(home)
        staging.rename(home)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return home / "libs"


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _is_broker_pid(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _MAIN_CLASS.encode() in cmdline.split(b"\0")


@dataclass(frozen=True)
class BrokerStatus:
    """What ``sparkstep kafka status`` reports."""

    running: bool
    pid: int | None
    port: int
    answers: bool

    def describe(self) -> str:
        if not self.running:
            return f"no broker running for port {self.port}"
        health = "answers metadata requests" if self.answers else "does NOT answer"
        return f"broker pid {self.pid} on 127.0.0.1:{self.port} {health}"


class LocalBroker:
    """One single-node KRaft broker on ``127.0.0.1:port`` with its state in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        libs: Path,
        *,
        heap: str = "768m",
        bind: str = "127.0.0.1",
        advertise: str | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port
        self.libs = libs
        self.heap = heap
        self.bind = bind
        self.advertise = advertise or bind
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def _pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def _log_dir(self) -> Path:
        return self.data_dir / "kraft"

    def pid(self) -> int | None:
        """The pid of this data dir's running broker, or None."""
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _is_broker_pid(pid) else None

    def status(self, timeout: float = 5.0) -> BrokerStatus:
        pid = self.pid()
        answers = pid is not None and self._answers(timeout)
        return BrokerStatus(running=pid is not None, pid=pid, port=self.port, answers=answers)

    def start(self, timeout: float = 90.0) -> int:
        """Start the broker (formatting the data dir on first use); return its pid.

        A broker already running from this data dir on this port is left as it is. Raises
        :class:`BrokerError` if the port is taken by something else or the broker does not come
        up within ``timeout`` seconds.
        """
        running = self.pid()
        if running is not None:
            if self._answers(5.0):
                return running
            raise BrokerError(
                f"a broker (pid {running}) already runs from {self.data_dir} but does not answer "
                f"on port {self.port}: stop it with `sparkstep kafka stop --data-dir "
                f"{self.data_dir} --port {self.port}`"
            )
        argv = self._prepare()
        out = (self.data_dir / "broker.out").open("ab")
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        finally:
            out.close()
        self._pid_file.write_text(f"{self._proc.pid}\n")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"the Kafka broker exited with code {self._proc.returncode} while starting: "
                    f"{self._log_tail()}"
                )
            if self._answers(2.0):
                return self._proc.pid
            time.sleep(0.2)
        self._kill(self._proc.pid)
        raise BrokerError(
            f"the Kafka broker did not answer on port {self.port} within {timeout:.0f}s: "
            f"{self._log_tail()}"
        )

    def run(self) -> NoReturn:
        """Format the data dir on first use, then replace this process with the broker's JVM
        (never returns). Raises :class:`BrokerError` if the port is taken."""
        argv = self._prepare()
        self._pid_file.write_text(f"{os.getpid()}\n")  # the JVM keeps this pid
        os.execv(argv[0], argv)

    def _prepare(self) -> list[str]:
        """Check the port, write the configuration, format the data dir on first use; the
        broker's command. Raises :class:`BrokerError` if the port is taken."""
        if not _port_is_free(self.port):
            raise BrokerError(
                f"port {self.port} on 127.0.0.1 is already in use: choose another with --port"
            )
        java = java_executable()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        properties = self._write_config()
        if not (self._log_dir / "meta.properties").exists():
            self._format(java, properties)
        return [java, *self._jvm_options(), "-cp", f"{self.libs}/*", _MAIN_CLASS, str(properties)]

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop this data dir's broker; return False if none was running.

        SIGTERM first (a clean shutdown), SIGKILL if it has not exited after ``timeout``.
        Returns once the process is gone and the port is free.
        """
        pid = self.pid()
        if pid is None:
            self._pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            self._kill(pid)
        self._pid_file.unlink(missing_ok=True)
        deadline = time.monotonic() + timeout
        while not _port_is_free(self.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        return True

    def _kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self._wait_exit(pid, 10.0)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not _is_broker_pid(pid):
                return True
            time.sleep(0.1)
        return False

    def _answers(self, timeout: float) -> bool:
        # log_level 0 silences librdkafka's connection-refused chatter while the broker starts.
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        try:
            metadata = admin.list_topics(timeout=timeout)
        except Exception:  # any failure to answer means "not (yet) up"
            return False
        return bool(metadata.brokers)

    def _jvm_options(self) -> list[str]:
        return [
            f"-Xmx{self.heap}",
            "-Xms128m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
        ]

    def _format(self, java: str, properties: Path) -> None:
        cluster_id = _kraft_cluster_id()
        cmd = [java, "-cp", f"{self.libs}/*", _STORAGE_TOOL, "format", "-t", cluster_id,
               "-c", str(properties)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BrokerError(
                f"formatting the broker's storage in {self._log_dir} failed: "
                f"{(done.stdout + done.stderr).strip()[-500:]}"
            )

    def _controller_port(self) -> int:
        """The controller's port: the one used before if still free (a restarted KRaft node
        finds its quorum at once), else a new free one, remembered in the data dir."""
        saved = self.data_dir / "controller.port"
        try:
            port = int(saved.read_text())
        except (OSError, ValueError):
            port = 0
        if not port or not _port_is_free(port):
            port = find_free_port()
            saved.write_text(f"{port}\n")
        return port

    def _write_config(self) -> Path:
        controller_port = self._controller_port()
        settings = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
            "listeners": f"PLAINTEXT://{self.bind}:{self.port},CONTROLLER://127.0.0.1:"
            f"{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.advertise}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self._log_dir),
            # One node: every internal topic has one replica and needs one in sync.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "group.initial.rebalance.delay.ms": "0",
            # Topics are created on purpose, with the configuration they need, never by a typo.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        log4j = self.data_dir / "log4j2.properties"
        log4j.write_text(
            "status = warn\n"
            "appender.file.type = File\n"
            "appender.file.name = file\n"
            f"appender.file.fileName = {self.data_dir / 'broker.log'}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = info\n"
            "rootLogger.appenderRef.file.ref = file\n"
        )
        return path

    def _log_tail(self, lines: int = 8) -> str:
        chunks = []
        for name in ("broker.out", "broker.log"):
            try:
                text = (self.data_dir / name).read_text(errors="replace")
            except OSError:
                continue
            interesting = [ln for ln in text.splitlines() if "ERROR" in ln or "Exception" in ln]
            chunks.extend((interesting or text.splitlines())[-lines:])
        return " | ".join(chunks[-lines:]) or f"no log in {self.data_dir}"


def _kraft_cluster_id() -> str:
    """A random KRaft cluster id: 16 random bytes, URL-safe base64 without padding.

    Never starting with ``-``: the storage tool would read such an id as an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
