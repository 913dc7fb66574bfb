"""The exactly-once output writer: seed 004's ``write(step, output)`` over Kafka transactions.

One :class:`OutputWriter` per deployment, in the runtime (the Spark driver). Each new step is ONE
Kafka transaction with ``transactional.id = "sparkstep.<name>"`` holding, in this order:

1. the step's output records (topic ``OutputOptions.output_topic``, format in
   :mod:`sparkstep.io.encoding`);
2. its dead-letter records (``<name>.dlq``, see :mod:`sparkstep.io.deadletter`);
3. its step log record (``<name>.steps``, see :mod:`sparkstep.io.steplog`), which carries the
   output offset ranges taken from the delivery reports of 1, before the commit.

The output records go to the partitions the default partitioner gives their keys, named by the
writer (:mod:`sparkstep.io.partitioner`), and only the first and the last record of each
partition ask for a delivery report: the producer is idempotent, so a partition's records land
in the order they were produced, and those two offsets bound the step's range there. A record
between them that is not delivered fails the transaction (its commit raises the record's
error, classified like any other).

So the division, the output and the dead letters of a step become visible to read_committed
consumers together or not at all. A correction (:meth:`OutputWriter.correct`, what it writes in
:mod:`sparkstep.io.corrections`) is one such transaction too.

Before a transaction begins, every record is checked against the size limit the writer read when
it opened (:mod:`sparkstep.io.limits`): an output record over it is written as a dead letter
instead (truncated, with the reason), a dead letter over it truncated, so a step whose input or
output holds a record too large for Kafka still completes, the same way on every run. The step
log record's ``output.count`` and ``output.digest`` describe the step's whole output, replaced
records included (what a replay must reproduce, whatever the limit); ``output.ranges`` hold the
records written; ``dlq_count`` counts the input's dead letters (a function of the input).

``write(step, output, ...)`` semantics (seed 004), with ``next`` = the step log's last step + 1:

- ``step < next``: the step was logged, this is a replay: count, digest, dead-letter count and
  input hashes are compared with the log (a difference raises
  :class:`~sparkstep.io.errors.ReplayMismatchError` naming the step) and the output is discarded;
- ``step == next``: written as above; ``next`` becomes ``step + 1``;
- ``step > next``: :class:`~sparkstep.io.errors.StepOrderError`.

Writer states::

        open()              write() begins           commit ok
  NEW --------> READY --------------> IN_TRANSACTION ----------> READY
                  ^                      |   |
                  |  abort ok            |   | fenced / fatal / outcome unknown
                  +----------------------+   v
                  (StepAbortedError)       FAILED --close()--> CLOSED

Errors and what the caller does:

- :class:`~sparkstep.io.errors.StepAbortedError` (``txn_requires_abort``, a delivery failure):
  the transaction was aborted; rerun the SAME step with the same division;
- :class:`~sparkstep.io.errors.RecurringWriteError` (the broker refused a record for its size
  although it passed the check, or the step log record is too large): the transaction was
  aborted, and rerunning the step meets the same refusal: fail the pipeline with the message;
- :class:`~sparkstep.io.errors.WriterFencedError` (a newer writer took over, or a fatal producer
  error): exit at once without touching the stores;
- :class:`~sparkstep.io.errors.KafkaUnavailableError` (the commit did not complete within
  ``KafkaConfig.timeout_s``, the outcome is unknown): this writer is FAILED; the caller exits and
  its recovery opens a new writer, whose ``init_transactions()`` completes or aborts the pending
  transaction and whose step log says whether the step was committed.
Retriable commit errors are retried within ``KafkaConfig.timeout_s``.

Failpoints (crash tests): ``output.after_record`` (each output record produced),
``output.after_records`` (output and dead letters delivered), ``output.after_step_record``,
``output.before_commit``, ``output.after_commit``.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from sparkstep.failpoints import armed, failpoint
from sparkstep.ids import Step
from sparkstep.io.config import (
    KafkaConfig,
    kafka_error_of,
    translate_kafka_error,
)
from sparkstep.io.corrections import HEADER_CORRECTION, plan_correction
from sparkstep.io.deadletter import DeadLetter, DlqRecord, dlq_topic
from sparkstep.io.division import StepTime
from sparkstep.io.encoding import (
    EncodedRecords,
    encode_output,
    output_digest,
    output_digest_format,
    step_header,
)
from sparkstep.io.errors import (
    DeploymentConflictError,
    DeploymentMismatchError,
    KafkaUnavailableError,
    RecurringWriteError,
    ReplayMismatchError,
    StepAbortedError,
    StepOrderError,
    WriterFencedError,
    WriterStateError,
)
from sparkstep.io.limits import RecordLimit, fit_step
from sparkstep.io.partitioner import record_partitions
from sparkstep.io.steplog import (
    OutputRange,
    OutputSummary,
    RangeSummary,
    StepLog,
    StepRecord,
    steps_topic,
)
from sparkstep.io.topics import TopicAdmin

__all__ = [
    "DLQ_TOPIC_CONFIG",
    "OutputOptions",
    "OutputWriter",
    "StepFacts",
    "WriteOutcome",
    "WriteResult",
    "WriterStatus",
    "transactional_id",
]

log = logging.getLogger(__name__)

#: The configuration the dead-letter topic is created with.
DLQ_TOPIC_CONFIG = {"cleanup.policy": "delete"}
#: Errors of a record the broker refuses for its size: the same bytes are refused again.
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
#: librdkafka's "no partition given" (``RD_KAFKA_PARTITION_UA``): its partitioner chooses.
_ANY_PARTITION = -1


def transactional_id(name: str) -> str:
    """The transactional id of pipeline ``name``'s writer: one per deployment name."""
    return f"sparkstep.{name}"


# -- the writer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputOptions:
    """Where and how a deployment writes its output.

    ``output_partitions`` is used only when the output topic is missing and
    ``create_output_topic`` allows creating it; otherwise a missing topic is an error.
    """

    name: str
    deployment: str
    output_topic: str
    key_columns: tuple[str, ...] | None = None
    weight_column: str = "weight"
    create_output_topic: bool = True
    output_partitions: int = 1
    transaction_timeout_ms: int = 60_000


@dataclass(frozen=True)
class StepFacts:
    """What the runtime knows about a step besides its output: logged with it, checked on replay.

    ``division`` holds every input range with its record count and hash (see
    :mod:`sparkstep.io.ranges`); ``time`` the step time; ``state_digests`` the workers' state
    digests by worker number (as strings).
    """

    epoch: int
    time: StepTime
    division: tuple[RangeSummary, ...]
    state_digests: Mapping[str, str] = field(default_factory=dict)


class WriterStatus(enum.Enum):
    """The writer's state (diagram in the module docstring)."""

    NEW = "new"
    READY = "ready"
    IN_TRANSACTION = "in_transaction"
    FAILED = "failed"
    CLOSED = "closed"


class WriteOutcome(enum.Enum):
    """What :meth:`OutputWriter.write` (or :meth:`OutputWriter.correct`) did with a step."""

    WRITTEN = "written"
    REPLAYED = "replayed"
    CORRECTED = "corrected"


@dataclass(frozen=True)
class WriteResult:
    """The outcome of one write and the step log record that now holds the step."""

    step: Step
    outcome: WriteOutcome
    record: StepRecord


class _Deliveries:
    """Delivery reports of one transaction: per partition the offsets, and the first error."""

    def __init__(self) -> None:
        self.pending = 0
        self.error: KafkaError | None = None
        # (topic, partition) -> [lowest offset, highest offset + 1]
        self.offsets: dict[tuple[str, int], list[int]] = {}

    def callback(self, err: KafkaError | None, msg: Message) -> None:
        self.pending -= 1
        if err is not None:
            if self.error is None:
                self.error = err
            return
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if topic is None or partition is None or offset is None:
            return
        key = (topic, partition)
        span = self.offsets.get(key)
        if span is None:
            self.offsets[key] = [offset, offset + 1]
        elif offset < span[0]:
            span[0] = offset
        elif offset >= span[1]:
            span[1] = offset + 1

    def ranges(self, topic: str) -> tuple[OutputRange, ...]:
        return tuple(
            sorted(
                OutputRange(t, p, low, high)
                for (t, p), (low, high) in self.offsets.items()
                if t == topic
            )
        )


class OutputWriter:
    """Exactly-once output of one deployment (see the module docstring).

    Usage::

        writer = OutputWriter(config, OutputOptions(name, deployment, "out", ("key",)))
        next_step = writer.open()          # fences any older writer; reads the step log
        writer.write(step, table, dead_letters, StepFacts(...))
        writer.close()
    """

    def __init__(
        self, config: KafkaConfig, options: OutputOptions, admin: TopicAdmin | None = None
    ) -> None:
        self.config = config
        self.options = options
        self.admin = admin if admin is not None else TopicAdmin(config)
        self.step_log = StepLog(config, options.name, options.deployment, self.admin)
        self.dlq_topic = dlq_topic(options.name)
        self.steps_topic = steps_topic(options.name)
        self._status = WriterStatus.NEW
        self._producer: Producer | None = None
        self._next: Step = Step(0)
        self._last: StepRecord | None = None
        self._logged: dict[int, StepRecord] = {}
        self._limit: RecordLimit | None = None

    @property
    def status(self) -> WriterStatus:
        return self._status

    @property
    def next_step(self) -> Step:
        """The step the writer will append next: the step log's last step + 1."""
        self._require(WriterStatus.READY, WriterStatus.IN_TRANSACTION)
        return self._next

    @property
    def limit(self) -> RecordLimit:
        """The size limit of the records this writer writes, read when it opened."""
        self._require(WriterStatus.READY, WriterStatus.IN_TRANSACTION)
        assert self._limit is not None
        return self._limit

    @property
    def last_record(self) -> StepRecord | None:
        """The step log's last record (None before the first step)."""
        self._require(WriterStatus.READY, WriterStatus.IN_TRANSACTION)
        return self._last

    def _require(self, *allowed: WriterStatus) -> None:
        if self._status not in allowed:
            raise WriterStateError(
                f"the output writer is {self._status.value}; this call needs "
                f"{' or '.join(s.value for s in allowed)}"
            )

    def open(self) -> Step:
        """Take over as the deployment's writer; return the next step to write.

        Step 1. Check the topics: the output topic exists (or is created) and is not
        compacted; the dead-letter and step log topics are created if missing.
        Step 2. The step log's last committed record must be this deployment's, else
        :class:`~sparkstep.io.errors.DeploymentConflictError` (a configuration error) and
        nothing else happens: checked BEFORE step 3, because ``init_transactions()`` would fence
        the live writer of the other deployment, whatever this writer does next.
        Step 3. The record size limit (:mod:`sparkstep.io.limits`), then
        ``init_transactions()``: fences every older writer of this name and completes
        (PrepareCommit) or aborts its open transaction.
        Step 4. Read the step log's last step again (step 3 may have completed a transaction);
        the next step is the one after it.

        An empty step log cannot say whose the name is: a writer of another deployment that
        has not committed a step yet is fenced.
        """
        self._require(WriterStatus.NEW)
        # Step 1.
        self.admin.wait_until_reachable()
        if self.options.create_output_topic:
            self.admin.ensure_topic(self.options.output_topic, self.options.output_partitions)
        self.admin.partitions(self.options.output_topic)
        self.admin.refuse_compacted([self.options.output_topic], "output")
        self.admin.ensure_topic(self.dlq_topic, 1, DLQ_TOPIC_CONFIG)
        self.admin.refuse_compacted([self.dlq_topic], "dead-letter")
        self.step_log.ensure()
        # Step 2.
        try:
            self.step_log.last()
        except DeploymentMismatchError as exc:
            self._status = WriterStatus.FAILED
            raise DeploymentConflictError(
                self.options.name, self.steps_topic, exc.expected, exc.found
            ) from exc
        # Step 3.
        settings = self.config.transactional_producer(
            transactional_id(self.options.name), self.options.transaction_timeout_ms
        )
        self._limit = RecordLimit.read(
            self.admin, settings, (self.options.output_topic, self.dlq_topic, self.steps_topic)
        )
        batch_size = int(settings.get("batch.size", self._limit.batch_size))
        settings["batch.size"] = min(batch_size, self._limit.batch_size)
        producer = Producer(settings)
        try:
            producer.init_transactions(self.config.timeout_s)
        except KafkaException as exc:
            self._status = WriterStatus.FAILED
            raise translate_kafka_error(
                exc, f"taking over as the writer of {self.options.name}", self.config
            ) from exc
        self._producer = producer
        # Step 4.
        self._last = self.step_log.last()
        self._next = Step(0 if self._last is None else self._last.step + 1)
        self._status = WriterStatus.READY
        log.info("output writer of %s open; next step %d", self.options.name, self._next)
        return self._next

    def close(self) -> None:
        """Release the producer. An open transaction is left to the next writer to abort."""
        if self._producer is not None:
            try:
                self._producer.poll(0)
            except KafkaException as exc:
                log.info("closing the output writer of %s: %s", self.options.name, exc)
        self._producer = None
        self._status = WriterStatus.CLOSED

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- write ----------------------------------------------------------------------------

    def write(
        self,
        step: int,
        output: pa.Table,
        dead_letters: Sequence[DeadLetter],
        facts: StepFacts,
    ) -> WriteResult:
        """Write (or recognise as a replay) the output of ``step``; see the module docstring."""
        self._require(WriterStatus.READY)
        if step < 0:
            raise StepOrderError(f"cannot write step {step}: steps start at 0")
        records = encode_output(output, self.options.key_columns, self.options.weight_column)
        if step < self._next:
            # A replay is checked by the digest of the format its step was logged with.
            logged = self._logged_record(step)
            digest = output_digest(records, output_digest_format(logged.output.digest))
            self._check_replay(logged, len(records), digest, len(dead_letters), facts)
            return WriteResult(Step(step), WriteOutcome.REPLAYED, logged)
        if step > self._next:
            raise StepOrderError(
                f"cannot write step {step}: the next step of {self.options.name} is "
                f"{self._next} (steps are written in order, without gaps)"
            )
        record = self._transact(Step(step), records, output_digest(records), dead_letters, facts)
        self._next = Step(step + 1)
        self._last = record
        return WriteResult(Step(step), WriteOutcome.WRITTEN, record)

    def correct(self, step: int, output: pa.Table, facts: StepFacts) -> WriteResult:
        """Make a logged step's output ``output``: write the difference and a correction record.

        For ``--on-replay-mismatch=reemit``, after :meth:`write` raised a correctable
        :class:`~sparkstep.io.errors.ReplayMismatchError` for ``step``; what is written, in ONE
        transaction, is in :mod:`sparkstep.io.corrections`. Errors as :meth:`write` (an aborted
        transaction: call ``correct`` again).
        """
        self._require(WriterStatus.READY)
        if step >= self._next:
            raise StepOrderError(f"cannot correct step {step}: it was never logged")
        logged = self._logged_record(step)
        records = encode_output(output, self.options.key_columns, self.options.weight_column)
        summary = OutputSummary(count=len(records), digest=output_digest(records))
        number = [(HEADER_CORRECTION, str(logged.correction + 1).encode("ascii"))]
        fitted = fit_step(self.limit, step, self.options.output_topic, records, (), number)
        correction = plan_correction(
            self.config, logged, fitted.records, summary, facts.state_digests
        )
        written = self._transact_records(
            Step(step),
            correction.records,
            fitted.dead_letters,
            lambda ranges: replace(
                correction.record,
                output=replace(correction.record.output, ranges=ranges),
            ),
            extra_headers=correction.headers,
        )
        effective = replace(written, prior_ranges=logged.all_output_ranges)
        self._logged[step] = effective
        if self._last is not None and self._last.step == step:
            self._last = effective
        log.warning(
            "step %d corrected (correction %d): %d difference records",
            step,
            effective.correction,
            len(correction.records),
        )
        return WriteResult(Step(step), WriteOutcome.CORRECTED, effective)

    def _logged_record(self, step: int) -> StepRecord:
        if step in self._logged:
            return self._logged[step]
        if self._last is not None and self._last.step == step:
            return self._last
        # Replays run forward from a checkpoint: fetch the rest of the log once.
        self._logged = {r.step: r for r in self.step_log.records(step, self._next - 1)}
        return self._logged[step]

    def _check_replay(
        self,
        logged: StepRecord,
        count: int,
        digest: str,
        dlq_count: int,
        facts: StepFacts,
    ) -> None:
        step = logged.step
        replayed = {(r.topic, r.partition): r for r in facts.division}
        for entry in logged.division:
            now = replayed.get((entry.topic, entry.partition))
            if now is None or (now.start, now.end, now.count, now.hash) != (
                entry.start,
                entry.end,
                entry.count,
                entry.hash,
            ):
                raise ReplayMismatchError(
                    step,
                    f"input {entry.topic}[{entry.partition}]",
                    f"{entry.start}..{entry.end} count {entry.count} hash {entry.hash}",
                    None
                    if now is None
                    else f"{now.start}..{now.end} count {now.count} hash {now.hash}",
                    correctable=False,
                )
        for worker, logged_digest in sorted(logged.state_digests.items()):
            now_digest = facts.state_digests.get(worker)
            if now_digest is not None and now_digest != logged_digest:
                raise ReplayMismatchError(
                    step,
                    f"state digest of worker {worker}",
                    logged_digest,
                    now_digest,
                    correctable=True,
                )
        if logged.dlq_count != dlq_count:
            raise ReplayMismatchError(
                step, "dead-letter count", logged.dlq_count, dlq_count, correctable=False
            )
        if logged.output.count != count:
            raise ReplayMismatchError(
                step, "output record count", logged.output.count, count, correctable=True
            )
        if logged.output.digest != digest:
            raise ReplayMismatchError(
                step, "output digest", logged.output.digest, digest, correctable=True
            )

    def _produce(
        self,
        deliveries: _Deliveries,
        topic: str,
        records: Iterable[tuple[bytes | None, bytes | None, Any, int, bool]],
        after_each: Callable[[], None] | None = None,
    ) -> None:
        """Produce ``records`` (key, value, headers as a list of (name, bytes), partition or
        :data:`_ANY_PARTITION`, whether it reports its delivery) to ``topic`` in order, the
        delivery reports asked for going to ``deliveries``; a full local queue is waited out."""
        producer = self._producer
        assert producer is not None
        produce, callback = producer.produce, deliveries.callback
        for key, value, headers, partition, report in records:
            while True:
                try:
                    # Positional: (topic, value, key, partition, callback, on_delivery,
                    # timestamp, headers); the time of producing is the default. A quarter
                    # less time per record than keywords (a dict per call), measured with the
                    # step header and a delivery report each.
                    produce(
                        topic,
                        value,
                        key,
                        partition,
                        callback if report else None,
                        None,
                        0,
                        headers,
                    )
                    break
                except BufferError:
                    producer.poll(0.05)  # the local queue is full: serve delivery reports
            if report:
                deliveries.pending += 1
            if after_each is not None:
                after_each()

    def _produce_output(
        self,
        step: Step,
        deliveries: _Deliveries,
        records: EncodedRecords,
        headers: Sequence[tuple[str, bytes]],
        after_each: Callable[[], None] | None = None,
    ) -> None:
        """:meth:`_produce` ``records`` to the output topic, each to its key's partition, with
        a delivery report for the first and the last record of each partition only (the
        module docstring). An output topic without partitions (deleted since the writer
        opened) aborts the step."""
        producer = self._producer
        assert producer is not None
        topic = self.options.output_topic
        if not len(records):
            return
        # The producer's own metadata, so that it knows every partition it is given.
        found = producer.list_topics(topic, self.config.timeout_s).topics.get(topic)
        count = 0 if found is None or found.error is not None else len(found.partitions)
        if count == 0:
            self._abort(step, f"the output topic {topic} has no partitions: was it deleted?")
        partitions = record_partitions(records.keys, count)
        reported = np.zeros(len(partitions), dtype=bool)
        order = np.argsort(partitions, kind="stable")
        bounds = np.flatnonzero(np.diff(partitions[order], prepend=-1, append=count))
        reported[order[bounds[:-1]]] = True  # the first record of each partition
        reported[order[bounds[1:] - 1]] = True  # and the last
        self._produce(
            deliveries,
            topic,
            zip(
                records.keys,
                records.values,
                itertools.repeat(list(headers)),
                partitions.tolist(),
                reported.tolist(),
                strict=False,  # the headers repeat without end; the rest are one per record
            ),
            after_each,
        )

    def _flush(self, deliveries: _Deliveries, step: Step) -> None:
        producer = self._producer
        assert producer is not None
        deadline = time.monotonic() + self.config.timeout_s
        # poll(), not flush(): confluent-kafka's flush() raises fatal errors as a bare KafkaError
        # object, which no except clause can catch; poll() raises a proper KafkaException.
        while deliveries.pending > 0 and time.monotonic() < deadline:
            try:
                producer.poll(0.05)
            except KafkaException as exc:
                self._fail(step, exc, "delivering the step's records")
        if deliveries.error is not None:
            self._abort(
                step,
                f"a record was not delivered: {deliveries.error.str()}",
                recurring=deliveries.error.code() in _TOO_LARGE,
            )
        if deliveries.pending > 0:
            self._abort(
                step, f"{deliveries.pending} records not delivered in {self.config.timeout_s}s"
            )

    def _transact(
        self,
        step: Step,
        records: EncodedRecords,
        digest: str,
        dead_letters: Sequence[DeadLetter],
        facts: StepFacts,
    ) -> StepRecord:
        """One new step's transaction (module docstring); returns its step log record."""
        fitted = fit_step(self.limit, step, self.options.output_topic, records, dead_letters)
        if fitted.replaced:
            log.warning(
                "step %d: %d records over the %d-byte limit (%s) written truncated as dead letters",
                step,
                fitted.replaced,
                self.limit.max_bytes,
                self.limit.source,
            )
        logged = StepRecord(
            deployment=self.options.deployment,
            step=step,
            epoch=facts.epoch,
            time=facts.time,
            division=tuple(sorted(facts.division)),
            output=OutputSummary(count=len(records), digest=digest),
            state_digests=dict(facts.state_digests),
            dlq_count=len(dead_letters),
        )
        return self._transact_records(
            step,
            fitted.records,
            fitted.dead_letters,
            lambda ranges: replace(logged, output=replace(logged.output, ranges=ranges)),
        )

    def _transact_records(
        self,
        step: Step,
        records: EncodedRecords,
        dead_letters: Sequence[DlqRecord],
        make_record: Callable[[tuple[OutputRange, ...]], StepRecord],
        extra_headers: Sequence[tuple[str, bytes]] = (),
    ) -> StepRecord:
        """ONE transaction: ``records``, ``dead_letters``, then the step log record that
        ``make_record`` builds from the output ranges of ``records``; returns that record.

        Every record must fit :attr:`limit`; one that does not raises
        :class:`~sparkstep.io.errors.RecurringWriteError` before the transaction begins.
        """
        producer = self._producer
        assert producer is not None
        header = [step_header(step)]
        output_headers = header + list(extra_headers)
        over = np.flatnonzero(records.payload > self.limit.payload_room(output_headers))
        if len(over):
            key, value = records.keys[over[0]], records.values[over[0]]
            size = self.limit.record_bytes(key, value, output_headers)
            raise RecurringWriteError(
                f"step {step} cannot be written: an output record that retracts an earlier "
                f"one is {self.limit.too_large(size)}; raise that limit"
            )
        self._status = WriterStatus.IN_TRANSACTION
        self._call(step, "beginning the transaction", producer.begin_transaction)
        # Step 1. The output records, then the dead letters.
        deliveries = _Deliveries()
        per_record_failpoint = "output.after_record" in armed()
        try:
            self._produce_output(
                step,
                deliveries,
                records,
                output_headers,
                (lambda: failpoint("output.after_record")) if per_record_failpoint else None,
            )
            self._produce(
                deliveries,
                self.dlq_topic,
                (
                    (letter.key, letter.value, letter.headers(step), _ANY_PARTITION, True)
                    for letter in dead_letters
                ),
            )
        except KafkaException as exc:
            self._fail(step, exc, "producing the output")
        # Step 2. Wait for their delivery reports: the output ranges of the step log record.
        self._flush(deliveries, step)
        failpoint("output.after_records")
        logged = make_record(deliveries.ranges(self.options.output_topic))
        # Step 3. The step log record, last in the transaction.
        value = logged.to_json()
        if not self.limit.fits(None, value, header):
            size = self.limit.record_bytes(None, value, header)
            self._abort(
                step,
                f"its step log record is {self.limit.too_large(size)}; raise that limit",
                recurring=True,
            )
        log_delivery = _Deliveries()
        try:
            self._produce(
                log_delivery, self.steps_topic, [(None, value, header, _ANY_PARTITION, True)]
            )
        except KafkaException as exc:
            self._fail(step, exc, "producing the step log record")
        self._flush(log_delivery, step)
        failpoint("output.after_step_record")
        # Step 4. Commit; retriable errors are retried within the timeout.
        failpoint("output.before_commit")
        self._commit(step)
        failpoint("output.after_commit")
        self._status = WriterStatus.READY
        return logged

    def _call(self, step: Step, action: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except KafkaException as exc:
            self._fail(step, exc, action)

    def _commit(self, step: Step) -> None:
        producer = self._producer
        assert producer is not None
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                producer.commit_transaction(max(1.0, remaining))
                return
            except KafkaException as exc:
                error = kafka_error_of(exc)
                if (
                    error is not None
                    and error.retriable()
                    and not error.fatal()
                    and not error.txn_requires_abort()
                ):
                    if time.monotonic() < deadline:
                        log.warning("commit of step %d failed, retrying: %s", step, error.str())
                        continue
                    self._status = WriterStatus.FAILED
                    raise KafkaUnavailableError(
                        f"the commit of step {step} did not complete within "
                        f"{self.config.timeout_s:.0f}s ({error.str()}): its outcome is unknown; "
                        "reopen the writer, whose step log tells whether the step was committed"
                    ) from exc
                self._fail(step, exc, f"committing step {step}")

    def _fail(self, step: Step, exc: KafkaException, action: str) -> None:
        """Classify a transaction error: fenced/fatal, abortable, or unknown outcome. Raises."""
        error = kafka_error_of(exc)
        # librdkafka's own classification decides: an epoch error after a broker failover can
        # be abortable (KIP-360), and only a fatal error means this producer is done.
        if error is None or error.fatal():
            self._status = WriterStatus.FAILED
            translated = translate_kafka_error(exc, action, self.config)
            if isinstance(translated, WriterFencedError):
                raise translated from exc
            raise WriterFencedError(
                f"{action} for step {step} failed fatally: {translated}; this writer cannot "
                "continue: exit without touching state and restart"
            ) from exc
        if error.txn_requires_abort() or not error.retriable():
            self._abort(
                step, f"{action} failed: {error.str()}", exc, recurring=error.code() in _TOO_LARGE
            )
        self._status = WriterStatus.FAILED
        raise KafkaUnavailableError(
            f"{action} for step {step} failed: {error.str()}: reopen the writer"
        ) from exc

    def _abort(
        self,
        step: Step,
        why: str,
        cause: BaseException | None = None,
        *,
        recurring: bool = False,
    ) -> None:
        """Abort the open transaction and raise :class:`StepAbortedError`, or
        :class:`RecurringWriteError` when ``recurring`` (a rerun meets the same cause), or worse
        when the abort fails."""
        producer = self._producer
        assert producer is not None
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                producer.abort_transaction(max(1.0, deadline - time.monotonic()))
                break
            except KafkaException as exc:
                error = kafka_error_of(exc)
                if error is not None and error.retriable() and time.monotonic() < deadline:
                    continue
                if error is not None and error.fatal():
                    self._status = WriterStatus.FAILED
                    raise WriterFencedError(
                        f"aborting step {step} failed fatally ({error.str()}) after: {why}; "
                        "exit without touching state"
                    ) from exc
                self._status = WriterStatus.FAILED
                raise KafkaUnavailableError(
                    f"aborting step {step} failed ({exc}) after: {why}; reopen the writer"
                ) from exc
        self._status = WriterStatus.READY
        if recurring:
            raise RecurringWriteError(
                f"step {step} was aborted ({why}) and would be again on every rerun: "
                "the pipeline cannot go on until the cause is removed"
            ) from cause
        raise StepAbortedError(
            f"step {step} was aborted ({why}); nothing of it is visible: rerun step {step}"
        ) from cause
