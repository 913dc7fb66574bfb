"""Kafka client settings, and the one place where confluent-kafka errors become ours.

:class:`KafkaConfig` is what every part of :mod:`sparkstep.io` takes: the bootstrap servers, the
user's extra client settings (``--kafka-config key=value``: SASL, TLS, ...) and the bound on
blocking calls. It is a frozen dataclass of strings and numbers, so it pickles into Spark
executors unchanged, and it builds the settings dict of each kind of client:

- :meth:`KafkaConfig.consumer`: read_committed, auto commit and offset store off, offsets out of
  range are an error (never a silent jump), for the given ``group.id``;
- :meth:`KafkaConfig.producer`: ``acks=all`` with idempotence (users' producers);
- :meth:`KafkaConfig.transactional_producer`: the same with a ``transactional.id``;
- :meth:`KafkaConfig.admin`.

The user's settings may hold secrets (``sasl.password``), so they never travel on a command
line (``/proc/<pid>/cmdline`` is world-readable): the coordinator hands them to the runtime in a
*settings file*, :func:`write_kafka_settings_file` / :func:`read_kafka_settings_file`: a JSON
object ``{"key": "value", ...}``, created with mode 0600 (owner only, from the first byte).

Invariant: the settings sparkstep's guarantees rest on (isolation level, acks, idempotence, auto
commit, transactional id) cannot be overridden by ``--kafka-config``; trying is a
:class:`~sparkstep.errors.ConfigError`, not a silent loss of exactly once.

:func:`translate_kafka_error` maps a ``KafkaException``/``KafkaError`` to the layer's errors; every
module calls it and re-raises ``from exc``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from sparkstep.errors import ConfigError
from sparkstep.io.errors import (
    KafkaUnavailableError,
    MissingTopicError,
    StreamIOError,
    WriterFencedError,
)

__all__ = [
    "ClientSettings",
    "KAFKA_LOGGER",
    "KafkaConfig",
    "PROTECTED_SETTINGS",
    "kafka_error_of",
    "parse_kafka_settings",
    "read_kafka_settings_file",
    "translate_kafka_error",
    "write_kafka_settings_file",
]

#: The settings dict of one confluent-kafka client (values include a ``logging.Logger``).
ClientSettings = dict[str, Any]

#: librdkafka's own log lines go to this logger instead of raw stderr.
KAFKA_LOGGER = "sparkstep.io.kafka"

#: Settings sparkstep sets itself; ``--kafka-config`` may not change them.
PROTECTED_SETTINGS = frozenset(
    {
        "acks",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "enable.idempotence",
        "group.id",
        "isolation.level",
        "request.required.acks",
        "transactional.id",
    }
)

_UNAVAILABLE = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TIMED_OUT,
        KafkaError._MSG_TIMED_OUT,
        KafkaError._RESOLVE,
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.REQUEST_TIMED_OUT,
    }
)
_MISSING_TOPIC = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
_FENCED = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


def parse_kafka_settings(pairs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``["sasl.mechanism=PLAIN", ...]`` -> sorted ``(key, value)`` pairs; refuses bad input."""
    settings: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--kafka-config expects KEY=VALUE, got {pair!r}")
        if key in PROTECTED_SETTINGS:
            raise ConfigError(
                f"--kafka-config may not set {key}: sparkstep sets it itself for exactly-once"
            )
        if key == "bootstrap.servers":
            raise ConfigError("set bootstrap.servers with --bootstrap-servers")
        settings[key] = value
    return tuple(sorted(settings.items()))


def write_kafka_settings_file(path: Path, pairs: Iterable[str]) -> None:
    """Write the settings ``pairs`` (``--kafka-config`` syntax; refused as by
    :func:`parse_kafka_settings`) to ``path``, readable by the owner only (0600) from the first
    byte: created with that mode, and an existing file's mode is reset before it is written."""
    text = json.dumps(dict(parse_kafka_settings(pairs)), indent=1, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_kafka_settings_file(path: Path) -> tuple[str, ...]:
    """The settings in a file of :func:`write_kafka_settings_file`, as ``KEY=VALUE`` pairs."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the Kafka settings file {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ConfigError(f"the Kafka settings file {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
        raise ConfigError(f"the Kafka settings file {path} is not a JSON object of strings")
    return tuple(f"{key}={value}" for key, value in doc.items())


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach the Kafka cluster; picklable, hashable, the same in driver and executors.

    ``timeout_s`` bounds every blocking call that waits for the cluster (metadata, admin
    requests, transaction calls, a range read that makes no progress): past it the caller gets
    :class:`~sparkstep.io.errors.KafkaUnavailableError` instead of a hang.
    """

    bootstrap_servers: str
    settings: tuple[tuple[str, str], ...] = field(default=())
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.bootstrap_servers.strip():
            raise ConfigError("--bootstrap-servers is empty")
        if self.timeout_s <= 0:
            raise ConfigError(f"the Kafka timeout must be positive, got {self.timeout_s}")
        for key, _ in self.settings:
            if key in PROTECTED_SETTINGS or key == "bootstrap.servers":
                raise ConfigError(f"the extra Kafka settings may not set {key}")

    @classmethod
    def from_args(
        cls, bootstrap_servers: str, kafka_config: Iterable[str] = (), timeout_s: float = 30.0
    ) -> KafkaConfig:
        """Build from ``--bootstrap-servers`` and the ``--kafka-config K=V`` list."""
        return cls(bootstrap_servers, parse_kafka_settings(kafka_config), timeout_s)

    def _base(self) -> ClientSettings:
        base: ClientSettings = {
            "bootstrap.servers": self.bootstrap_servers,
            "logger": logging.getLogger(KAFKA_LOGGER),
        }
        base.update(dict(self.settings))
        return base

    def admin(self) -> ClientSettings:
        """Settings of an ``AdminClient``."""
        return self._base()

    def consumer(self, group_id: str, **overrides: Any) -> ClientSettings:
        """Settings of a read_committed consumer that never commits or stores offsets itself."""
        conf = self._base()
        conf.update(
            {
                "group.id": group_id,
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "error",
                "enable.partition.eof": True,
            }
        )
        conf.update(overrides)
        return conf

    def producer(self, **overrides: Any) -> ClientSettings:
        """Settings of an idempotent producer with ``acks=all``."""
        conf = self._base()
        conf.update(
            {
                "acks": "all",
                "enable.idempotence": True,
                # The Java client's partitioner, so keys land where Java producers put them.
                "partitioner": "murmur2_random",
            }
        )
        conf.update(overrides)
        return conf

    def transactional_producer(
        self, transactional_id: str, transaction_timeout_ms: int = 60_000
    ) -> ClientSettings:
        """Settings of the output writer's transactional producer."""
        return self.producer(
            **{
                "transactional.id": transactional_id,
                "transaction.timeout.ms": transaction_timeout_ms,
                "message.timeout.ms": min(transaction_timeout_ms, 300_000),
                "linger.ms": 1,
                # A restarted writer's init_transactions() waits for the broker to abort the dead
                # writer's transaction (CONCURRENT_TRANSACTIONS, retried): retry soon.
                "retry.backoff.ms": 20,
                "retry.backoff.max.ms": 250,
            }
        )


def kafka_error_of(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` carried by a confluent-kafka exception, if any."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    if isinstance(exc, KafkaError):
        return exc
    return None


def translate_kafka_error(
    exc: BaseException, action: str, config: KafkaConfig | None = None
) -> StreamIOError:
    """The layer's error for a confluent-kafka failure while doing ``action``.

    The caller raises the result ``from exc``. ``action`` says what was being done ("listing the
    offsets of topic t"); the message adds the cluster and what to do.
    """
    error = kafka_error_of(exc)
    where = f" (bootstrap servers {config.bootstrap_servers})" if config is not None else ""
    if error is None:
        text = str(exc) or type(exc).__name__
        return StreamIOError(f"{action} failed{where}: {text}")
    code = error.code()
    text = error.str()
    if code in _UNAVAILABLE:
        return KafkaUnavailableError(
            f"{action} failed: the Kafka cluster did not answer{where}: {text}; check that the "
            "broker runs and --bootstrap-servers/--kafka-config are right"
        )
    if code in _MISSING_TOPIC:
        return MissingTopicError(f"{action} failed: the topic does not exist{where}: {text}")
    if code in _FENCED:
        return WriterFencedError(
            f"{action} failed: another writer of this pipeline took over (fenced){where}: "
            f"{text}; this process must exit without touching state"
        )
    return StreamIOError(f"{action} failed{where}: {text}")
