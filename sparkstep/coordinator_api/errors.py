"""Errors of the coordinator; the REST API maps each to one status code.

Runtime control failures (:class:`~sparkstep.runtime.control.ControlError`) are translated into
these in one place, :func:`sparkstep.coordinator_api.procedures.translate_control_error`; Kafka
failures of the checks before a launch in :func:`sparkstep.coordinator_api.preflight.check_kafka`.
"""

from __future__ import annotations

from sparkstep.errors import SparkstepError

__all__ = [
    "ConflictError",
    "CoordinatorError",
    "InvalidRequestError",
    "KafkaUnreachableError",
    "LaunchError",
    "RuntimeUnavailableError",
]


class CoordinatorError(SparkstepError):
    """Raised for every failure of the coordinator; the base of this layer's errors."""


class ConflictError(CoordinatorError):
    """Raised when a request conflicts with a procedure in progress or with the state (409)."""


class InvalidRequestError(CoordinatorError):
    """Raised for a well-formed request the pipeline cannot take, e.g. more workers than S (422)."""


class RuntimeUnavailableError(CoordinatorError):
    """Raised when the runtime is not running or cannot be reached (503)."""


class KafkaUnreachableError(CoordinatorError):
    """Raised when the Kafka cluster does not answer the coordinator's check before a launch."""


class LaunchError(CoordinatorError):
    """Raised when a child process exits or stays silent before it says it is ready."""
