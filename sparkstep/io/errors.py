"""Errors of the Kafka layer (input ranges, step log, output writer, local broker).

Foreign errors (``confluent_kafka.KafkaException``, ``KafkaError``) are translated into these in
one place per module and re-raised with ``from exc``.
"""

from __future__ import annotations

from sparkstep.errors import SparkstepError

__all__ = ["BrokerError", "StreamIOError"]


class StreamIOError(SparkstepError):
    """Raised for a failure of Kafka input, output or the step log; the base of this layer."""


class BrokerError(StreamIOError):
    """Raised when the local development broker cannot be installed, started, reached or stopped."""
