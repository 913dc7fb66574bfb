"""Kafka: input ranges and divisions, the step log, the exactly-once output writer, the broker.

Imports nothing of sparkstep but the shared :mod:`sparkstep.errors`, :mod:`sparkstep.ids`,
:mod:`sparkstep.failpoints` and :mod:`sparkstep.hashing`. The local development broker
(:mod:`sparkstep.io.broker`) is not imported here: Spark executors import this package and need
none of it.

The runtime's use, one concern per module:

- :mod:`~sparkstep.io.config`: :class:`KafkaConfig` (picklable), error translation;
- :mod:`~sparkstep.io.topics`: :class:`TopicAdmin`: topics, offsets (LSO), retention warnings,
  consumer group offsets for lag tools;
- :mod:`~sparkstep.io.division`: :class:`DivisionPlanner` -> :class:`Division` of
  :class:`PartitionRange`; the cancellable wait for input;
- :mod:`~sparkstep.io.ranges`: :func:`map_read` for ``mapInArrow`` in the executors (records
  and summaries in one read, cut by the step's byte budget), :func:`read_range` in process;
- :mod:`~sparkstep.io.steplog`: :class:`StepLog`, :class:`StepRecord`;
- :mod:`~sparkstep.io.output`: :class:`OutputWriter` (one transaction per step);
- :mod:`~sparkstep.io.encoding`: the output record format, :func:`output_digest`;
- :mod:`~sparkstep.io.partitioner`: each output record's partition (Kafka's murmur2);
- :mod:`~sparkstep.io.corrections`: what a correction (``--on-replay-mismatch=reemit``) writes;
- :mod:`~sparkstep.io.deadletter`: :class:`DeadLetter`;
- :mod:`~sparkstep.io.producer`: :class:`InputProducer`, :func:`produce_json_lines`;
- :mod:`~sparkstep.io.errors`: the errors, rooted at :class:`StreamIOError`.
"""

from __future__ import annotations

from sparkstep.io.config import KafkaConfig, parse_kafka_settings
from sparkstep.io.deadletter import DeadLetter, dead_letters_from_arrow, dlq_topic
from sparkstep.io.division import (
    DEFAULT_MAX_BYTES_PER_STEP,
    DEFAULT_MAX_RECORDS_PER_STEP,
    Division,
    DivisionOptions,
    DivisionPlanner,
    PartitionRange,
    StepTime,
)
from sparkstep.io.encoding import encode_output, output_digest
from sparkstep.io.errors import (
    CompactedTopicError,
    DeploymentConflictError,
    DeploymentMismatchError,
    InputLostError,
    InputRewoundError,
    KafkaUnavailableError,
    MissingTopicError,
    ReplayMismatchError,
    StepAbortedError,
    StepLogError,
    StepLogGapError,
    StepOrderError,
    StreamIOError,
    UndurableStepLogError,
    WriterFencedError,
    WrongStepError,
)
from sparkstep.io.output import (
    OutputOptions,
    OutputWriter,
    StepFacts,
    WriteOutcome,
    WriteResult,
)
from sparkstep.io.producer import InputProducer, ProduceReport, produce_json_lines
from sparkstep.io.ranges import (
    RANGES_DDL,
    READ_DDL,
    RECORDS_DDL,
    RangeRead,
    ReadSummary,
    map_read,
    read_range,
    read_summaries,
)
from sparkstep.io.steplog import (
    OutputRange,
    OutputSummary,
    RangeSummary,
    StepLog,
    StepRecord,
    steps_topic,
)
from sparkstep.io.topics import TopicAdmin, consumer_group_id

__all__ = [
    "CompactedTopicError",
    "DEFAULT_MAX_BYTES_PER_STEP",
    "DEFAULT_MAX_RECORDS_PER_STEP",
    "DeadLetter",
    "DeploymentConflictError",
    "DeploymentMismatchError",
    "Division",
    "DivisionOptions",
    "DivisionPlanner",
    "InputLostError",
    "InputProducer",
    "InputRewoundError",
    "KafkaConfig",
    "KafkaUnavailableError",
    "MissingTopicError",
    "OutputOptions",
    "OutputRange",
    "OutputSummary",
    "OutputWriter",
    "PartitionRange",
    "ProduceReport",
    "RANGES_DDL",
    "READ_DDL",
    "RECORDS_DDL",
    "RangeRead",
    "RangeSummary",
    "ReadSummary",
    "ReplayMismatchError",
    "StepAbortedError",
    "StepFacts",
    "StepLog",
    "StepLogError",
    "StepLogGapError",
    "StepOrderError",
    "StepRecord",
    "StepTime",
    "StreamIOError",
    "TopicAdmin",
    "UndurableStepLogError",
    "WriteOutcome",
    "WriteResult",
    "WriterFencedError",
    "WrongStepError",
    "consumer_group_id",
    "dead_letters_from_arrow",
    "dlq_topic",
    "encode_output",
    "map_read",
    "output_digest",
    "parse_kafka_settings",
    "produce_json_lines",
    "read_range",
    "read_summaries",
    "steps_topic",
]
