"""Before every launch: the Kafka cluster answers, and the pipeline's input topics exist.

Both are checked by the coordinator itself, with one short metadata request each, so that a
broker that is down or a topic that is missing never costs a launch of W + 1 processes:

- a cluster that does not answer within ``timeout_s`` is :class:`KafkaUnreachableError`: the
  supervisor waits for it with exponential backoff (:class:`Backoff`), spawning nothing;
- a missing input topic is a :class:`~sparkstep.errors.ConfigError` (restarting cannot create
  it): reported once, and the run ends with the reason.

The Kafka errors of :mod:`sparkstep.io` are translated into these here, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sparkstep.coordinator_api.errors import KafkaUnreachableError
from sparkstep.errors import ConfigError
from sparkstep.io.config import KafkaConfig
from sparkstep.io.errors import KafkaUnavailableError, MissingTopicError
from sparkstep.io.topics import TopicAdmin

__all__ = ["Backoff", "check_kafka"]

PREFLIGHT_TIMEOUT_S = 5.0
"""How long one check waits for the cluster to answer before it counts as unreachable."""


def check_kafka(
    bootstrap_servers: str,
    kafka_config: Iterable[str],
    input_topics: Iterable[str],
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
) -> None:
    """Return if the cluster answers and every topic of ``input_topics`` exists.

    Raises :class:`KafkaUnreachableError` if the cluster does not answer within ``timeout_s``,
    :class:`ConfigError` if an input topic is missing or ``kafka_config`` is invalid.
    """
    config = KafkaConfig.from_args(bootstrap_servers, kafka_config, timeout_s)
    admin = TopicAdmin(config)
    try:
        admin.wait_until_reachable()
        for topic in input_topics:
            admin.partitions(topic)
    except MissingTopicError as exc:
        raise ConfigError(f"input {exc}; then run again") from exc
    except KafkaUnavailableError as exc:
        raise KafkaUnreachableError(
            f"the Kafka broker at {bootstrap_servers} is unreachable (no answer within "
            f"{timeout_s:g}s)"
        ) from exc


@dataclass
class Backoff:
    """Exponential backoff: ``first_s``, then twice the previous delay, at most ``max_s``;
    :meth:`reset` after a success starts again at ``first_s``."""

    first_s: float = 1.0
    max_s: float = 60.0
    _next_s: float = 0.0

    def next_delay(self) -> float:
        delay = self._next_s or self.first_s
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next_s = 0.0
