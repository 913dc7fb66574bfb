"""Errors of the Kafka layer (input ranges, step log, output writer, local broker).

Foreign errors (``confluent_kafka.KafkaException``, ``KafkaError``) are translated into these in
one place, :func:`sparkstep.io.config.translate_kafka_error`, and re-raised with ``from exc``.

What the caller of the output writer does with each writer error:

- :class:`StepAbortedError`: the step's transaction was aborted; nothing of it is visible. Rerun
  the same step with the same division (workers return their recorded deltas).
- :class:`RecurringWriteError`: the step's transaction was aborted (nothing of it is visible)
  for a cause that a rerun of the same step meets again (a record the broker refuses whatever
  the writer does). Do not retry the step: fail with the message.
- :class:`WriterFencedError`: another writer of this deployment took over, or the producer hit a
  fatal error. Exit at once without touching the state stores.
- :class:`ReplayMismatchError`: a replayed step produced other output than the logged one: the
  pipeline is not deterministic (or its code changed).

:class:`DeploymentMismatchError` (and :class:`DeploymentConflictError`) are also
:class:`~sparkstep.errors.ConfigError`: another deployment owns the pipeline name; restarting
cannot help.
"""

from __future__ import annotations

from sparkstep.errors import ConfigError, SparkstepError

__all__ = [
    "BrokerError",
    "CompactedTopicError",
    "DeploymentConflictError",
    "DeploymentMismatchError",
    "InputLostError",
    "InputRewoundError",
    "KafkaUnavailableError",
    "MissingTopicError",
    "RangeReadError",
    "RecurringWriteError",
    "ReplayMismatchError",
    "StepAbortedError",
    "StepLogError",
    "StepLogGapError",
    "StepOrderError",
    "StreamIOError",
    "UndurableStepLogError",
    "WriterFencedError",
    "WriterStateError",
    "WrongStepError",
]


class StreamIOError(SparkstepError):
    """Raised for a failure of Kafka input, output or the step log; the base of this layer."""


class BrokerError(StreamIOError):
    """Raised when the local development broker cannot be installed, started, reached or stopped."""


class KafkaUnavailableError(StreamIOError):
    """Raised when the Kafka cluster does not answer within the bounded retry of an operation."""


class MissingTopicError(StreamIOError):
    """Raised when a topic sparkstep needs does not exist and was not to be created."""


class CompactedTopicError(StreamIOError, ConfigError):
    """Raised when an input or output topic has ``cleanup.policy=compact``, which loses data."""


class InputLostError(StreamIOError):
    """Raised when input a step needs was deleted from Kafka (retention) before it was read."""


class InputRewoundError(StreamIOError, ConfigError):
    """Raised when an input partition ends below its logged end (recreated or truncated topic)."""


class RangeReadError(StreamIOError):
    """Raised when an input offset range cannot be read completely."""


class StepLogError(StreamIOError):
    """Raised when the step log topic cannot be read or holds something it should not."""


class UndurableStepLogError(StepLogError, ConfigError):
    """Raised when the step log topic's retention lets Kafka delete step records."""


class WrongStepError(StepLogError):
    """Raised when a step log record read as step ``expected`` says it is step ``found``."""

    def __init__(self, expected: int, found: int, detail: str = "") -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            f"step log record read as step {expected} says it is step {found}"
            + (f": {detail}" if detail else "")
        )


class StepLogGapError(StepLogError):
    """Raised when the step log skips steps (step ``found`` follows step ``previous``)."""

    def __init__(self, topic: str, previous: int, found: int) -> None:
        self.previous = previous
        self.found = found
        super().__init__(
            f"step log {topic} says step {found} follows step {previous}: the step log topic was "
            "truncated or written by another pipeline"
        )


class DeploymentMismatchError(StepLogError, ConfigError):
    """Raised when the step log belongs to another deployment than the one reading it."""

    def __init__(self, topic: str, expected: str, found: str) -> None:
        self.expected = expected
        self.found = found
        super().__init__(
            f"state belongs to deployment {expected}, step log {topic} to {found}: "
            "use another --name or `sparkstep reset`"
        )


class DeploymentConflictError(StepLogError, ConfigError):
    """Raised when opening a writer would fence the writer of another deployment of the name."""

    def __init__(self, name: str, topic: str, expected: str, found: str) -> None:
        self.name = name
        self.topic = topic
        self.expected = expected
        self.found = found
        super().__init__(
            f"the pipeline name {name!r} belongs to deployment {found} (its step log {topic}), "
            f"not to this deployment {expected} (another --state-dir): starting would fence "
            f"{found}'s output; use another --name, or this name's own --state-dir",
        )


class StepOrderError(StreamIOError):
    """Raised when the writer is asked to write a step after the next one (a gap in output)."""


class WriterStateError(StreamIOError):
    """Raised when the output writer is called in a state that does not allow the call."""


class StepAbortedError(StreamIOError):
    """Raised when a step's transaction was aborted; the caller reruns the same step."""


class WriterFencedError(StreamIOError):
    """Raised when the writer was fenced by a newer one or failed fatally; the caller exits."""


class ReplayMismatchError(StreamIOError):
    """Raised when a replayed step's input, state or output differs from what was logged for it.

    ``correctable`` is True for a difference in state digests or output (the pipeline's code
    changed or is not deterministic: ``--on-replay-mismatch=reemit`` can write the difference),
    False for a difference in the input or the dead letters (the durable input log itself
    changed: nothing can reproduce the step).
    """

    def __init__(
        self, step: int, what: str, logged: object, replayed: object, *, correctable: bool
    ) -> None:
        self.step = step
        self.what = what
        self.logged = logged
        self.replayed = replayed
        self.correctable = correctable
        hint = "see --on-replay-mismatch" if correctable else "the input log was changed"
        super().__init__(
            f"replay of step {step} is not deterministic: its {what} was {logged!r} and is now "
            f"{replayed!r}; the pipeline or its input changed ({hint})"
        )


class RecurringWriteError(StreamIOError):
    """Raised when a step cannot be written for a cause that recurs on every rerun of the step."""
