"""The step log: one JSON record per step in the topic ``<name>.steps``, the durable division.

The topic has one partition and is created if missing with ``retention.ms=-1``,
``retention.bytes=-1`` and ``cleanup.policy=delete``: it must keep every step until a checkpoint
covers it (an idle pipeline's last steps may be old), and it is small, one record per step.
:meth:`StepLog.ensure` refuses an existing step log that can delete records
(:class:`~sparkstep.io.errors.UndurableStepLogError`, with the ``kafka-configs.sh`` command that
fixes it), with one exception it fixes itself: on a step log sparkstep created (its settings on
the topic are ``retention.ms=-1`` and ``cleanup.policy=delete``), a ``retention.bytes`` or
``retention.ms`` inherited from a finite broker default is set to -1 on the topic. A setting made
on the topic itself was someone's choice and is never overwritten.

Each record is the value of one Kafka record written LAST in its step's transaction by
:class:`~sparkstep.io.output.OutputWriter`; its JSON has exactly these fields::

    {"deployment": str, "step": int, "epoch": int,
     "time": {"max_input_ts": int | null, "wall": int},
     "division": [{"topic", "partition", "start", "end", "count", "hash"}],
     "output": {"count": int, "digest": str,
                "ranges": [{"topic", "partition", "start", "end"}]},
     "state_digests": {"<worker>": str},
     "dlq_count": int}

``output.digest`` names its format (:func:`~sparkstep.io.encoding.output_digest_format`: ``v2:``
and 16 hex digits, or 16 hex digits for format 1); a record with a digest of neither form is
refused.

A **correction** record (``--on-replay-mismatch=reemit``, seed 004's "write as output the
difference between the new output and the previously produced output") has the same fields plus
``"correction": n`` (the n-th correction of that step, n >= 1). It is written when a replayed
step's output or state no longer matches its record, in ONE transaction with the correction's
output records (the difference between the step's new output and what was logged for it so
far). In a correction, ``output.count`` and ``output.digest`` describe the step's whole output
as now computed (what a later replay must reproduce), and ``output.ranges`` where the
correction's difference records landed; ``state_digests`` are the new ones; every other field is
the step's own. A correction of step ``s`` always follows the record of the then last step
``L >= s`` and precedes step ``L + 1``'s (corrections happen only while recovery replays, before
any new step). The **effective** record of a step is its last correction, or its own record
without one; readers return effective records, with
:attr:`StepRecord.prior_ranges` the output ranges of the records it supersedes (so the step's
output, as a consumer integrates it, is the records of ``prior_ranges + output.ranges``).

Invariants checked when reading (read_committed, so only committed steps are seen):

- steps are dense and increasing in offset order: step ``s + 1`` follows step ``s``; a later
  step raises :class:`~sparkstep.io.errors.StepLogGapError` naming both steps; a correction
  names a step already logged and is numbered one past the step's previous correction
  (:class:`~sparkstep.io.errors.StepLogError` otherwise);
- a record read as step ``s`` says step ``s``, else
  :class:`~sparkstep.io.errors.WrongStepError(expected=s, found=...)` (e.g. a step logged
  twice: the record after step ``s`` says ``s`` again);
- every record belongs to the reader's deployment, else
  :class:`~sparkstep.io.errors.DeploymentMismatchError` naming both deployments;
- a record that is not exactly this JSON raises :class:`~sparkstep.io.errors.StepLogError`.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sparkstep.ids import Step
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import Division, PartitionRange, StepTime
from sparkstep.io.encoding import output_digest_format
from sparkstep.io.errors import (
    DeploymentMismatchError,
    StepLogError,
    StepLogGapError,
    UndurableStepLogError,
    WrongStepError,
)
from sparkstep.io.ranges import read_range
from sparkstep.io.topics import KEEP_EVERY_RECORD, TopicAdmin

__all__ = [
    "OutputRange",
    "OutputSummary",
    "RangeSummary",
    "STEP_LOG_TOPIC_CONFIG",
    "StepLog",
    "StepRecord",
    "steps_topic",
]

log = logging.getLogger(__name__)

#: The configuration the step log topic is created with.
STEP_LOG_TOPIC_CONFIG = {**KEEP_EVERY_RECORD, "cleanup.policy": "delete"}
#: The settings on a step log topic that mark it as created by sparkstep; ``retention.bytes`` is
#: not among them, so a step log created without it (inheriting the broker's) is recognised.
_CREATED_BY_SPARKSTEP = {"retention.ms": "-1", "cleanup.policy": "delete"}

_FIELDS = (
    "deployment",
    "step",
    "epoch",
    "time",
    "division",
    "output",
    "state_digests",
    "dlq_count",
)
_WINDOW = 64


def steps_topic(name: str) -> str:
    """The step log topic of pipeline ``name``."""
    return f"{name}.steps"


@dataclass(frozen=True, order=True)
class RangeSummary:
    """One input range of a step as logged: its offsets, record count and hash."""

    topic: str
    partition: int
    start: int
    end: int
    count: int
    hash: str

    @property
    def range(self) -> PartitionRange:
        return PartitionRange(self.topic, self.partition, self.start, self.end)


@dataclass(frozen=True, order=True)
class OutputRange:
    """The offsets ``[start, end)`` one step's output occupies in one output partition."""

    topic: str
    partition: int
    start: int
    end: int


@dataclass(frozen=True)
class OutputSummary:
    """A step's output: record count, order-independent digest, and where it landed."""

    count: int
    digest: str
    ranges: tuple[OutputRange, ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """One step log record (see the module docstring for the JSON and the invariants).

    ``correction`` is 0 for a step's own record, n for its n-th correction. ``prior_ranges`` is
    not part of the JSON: readers fill it, for an effective record, with the output ranges of
    the records it supersedes.
    """

    deployment: str
    step: Step
    epoch: int
    time: StepTime
    division: tuple[RangeSummary, ...]
    output: OutputSummary
    state_digests: Mapping[str, str] = field(default_factory=dict)
    dlq_count: int = 0
    correction: int = 0
    prior_ranges: tuple[OutputRange, ...] = field(default=(), compare=False)

    @property
    def all_output_ranges(self) -> tuple[OutputRange, ...]:
        """Where every output record of this step landed: its own, then its corrections'."""
        return self.prior_ranges + self.output.ranges

    def to_division(self) -> Division:
        """The logged division, to replay this step with exactly its input."""
        return Division(
            step=self.step, ranges=tuple(r.range for r in self.division), time=self.time
        )

    def to_json(self) -> bytes:
        """The record's value: compact JSON with the fields in the documented order."""
        doc = {
            "deployment": self.deployment,
            "step": int(self.step),
            "epoch": self.epoch,
            "time": {"max_input_ts": self.time.max_input_ts, "wall": self.time.wall},
            "division": [
                {
                    "topic": r.topic,
                    "partition": r.partition,
                    "start": r.start,
                    "end": r.end,
                    "count": r.count,
                    "hash": r.hash,
                }
                for r in self.division
            ],
            "output": {
                "count": self.output.count,
                "digest": self.output.digest,
                "ranges": [
                    {"topic": r.topic, "partition": r.partition, "start": r.start, "end": r.end}
                    for r in self.output.ranges
                ],
            },
            "state_digests": dict(sorted(self.state_digests.items())),
            "dlq_count": self.dlq_count,
        }
        if self.correction:
            doc["correction"] = self.correction
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str) -> StepRecord:
        """Parse a record; :class:`StepLogError` unless it is exactly the documented JSON."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or set(doc) - {"correction"} != set(_FIELDS):
                found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
                raise ValueError(f"fields {found}, expected {sorted(_FIELDS)}")
            correction = _int(doc.get("correction", 0))
            if "correction" in doc and correction < 1:
                raise ValueError(f"correction {correction} is not a positive integer")
            time_doc = _obj(doc["time"], ("max_input_ts", "wall"))
            output = _obj(doc["output"], ("count", "digest", "ranges"))
            digests = doc["state_digests"]
            if not isinstance(digests, dict):
                raise ValueError("state_digests is not an object")
            return cls(
                deployment=_str(doc["deployment"]),
                step=Step(_int(doc["step"])),
                epoch=_int(doc["epoch"]),
                time=StepTime(
                    max_input_ts=None
                    if time_doc["max_input_ts"] is None
                    else _int(time_doc["max_input_ts"]),
                    wall=_int(time_doc["wall"]),
                ),
                division=tuple(
                    RangeSummary(
                        _str(r["topic"]),
                        _int(r["partition"]),
                        _int(r["start"]),
                        _int(r["end"]),
                        _int(r["count"]),
                        _str(r["hash"]),
                    )
                    for r in (
                        _obj(item, ("topic", "partition", "start", "end", "count", "hash"))
                        for item in _list(doc["division"])
                    )
                ),
                output=OutputSummary(
                    count=_int(output["count"]),
                    digest=_digest(output["digest"]),
                    ranges=tuple(
                        OutputRange(
                            _str(r["topic"]), _int(r["partition"]), _int(r["start"]), _int(r["end"])
                        )
                        for r in (
                            _obj(item, ("topic", "partition", "start", "end"))
                            for item in _list(output["ranges"])
                        )
                    ),
                ),
                state_digests={str(k): _str(v) for k, v in digests.items()},
                dlq_count=_int(doc["dlq_count"]),
                correction=correction,
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise StepLogError(f"a step log record is not valid: {exc}: {data!r:.200}") from exc


def _digest(value: Any) -> str:
    """An output digest, of a format :func:`~sparkstep.io.encoding.output_digest_format`
    knows."""
    digest = _str(value)
    output_digest_format(digest)
    return digest


def _obj(value: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(fields):
        raise ValueError(f"expected an object with fields {list(fields)}, got {value!r:.100}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {value!r:.100}")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r:.100}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r:.100}")
    return value


class StepLog:
    """Reads (and creates) the step log of one deployment; writing is the output writer's job.

    ``deployment`` is the reader's deployment: every record read must carry it.
    """

    def __init__(
        self,
        config: KafkaConfig,
        name: str,
        deployment: str,
        admin: TopicAdmin | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.topic = steps_topic(name)
        self.deployment = deployment
        self.admin = admin if admin is not None else TopicAdmin(config)

    def ensure(self) -> None:
        """Create the topic if missing; refuse one with more than one partition, compacted, or
        deleting records (fixed instead where the module docstring says); warn when it has
        fewer replicas than the cluster could give it (up to 3)."""
        created = self.admin.ensure_topic(self.topic, 1, STEP_LOG_TOPIC_CONFIG)
        partitions = self.admin.partitions(self.topic)
        if partitions != [0]:
            raise StepLogError(
                f"step log topic {self.topic} has {len(partitions)} partitions; it needs exactly "
                "one (steps are ordered): delete it or use another --name"
            )
        self.admin.refuse_compacted([self.topic], "step log")
        self._keep_every_record(created)
        replicas, brokers = self.admin.replication(self.topic)
        if replicas < min(3, brokers):
            log.warning(
                "step log topic %s has %d replica(s) on a cluster of %d brokers: losing a broker "
                "can lose the step log and with it recovery; add replicas "
                "(kafka-reassign-partitions.sh)",
                self.topic,
                replicas,
                brokers,
            )

    def _keep_every_record(self, created: bool) -> None:
        """Make sure retention deletes no step record (see the module docstring)."""
        config = self.admin.topic_config(self.topic)
        deleting = {
            name: config[name] for name in KEEP_EVERY_RECORD if int(config.get(name, "-1")) >= 0
        }
        if not deleting:
            return
        overrides = self.admin.topic_overrides(self.topic)
        ours = created or all(overrides.get(k) == v for k, v in _CREATED_BY_SPARKSTEP.items())
        if ours and not set(deleting) & set(overrides):
            self.admin.alter_topic_config(self.topic, {name: "-1" for name in deleting})
            log.warning(
                "step log topic %s inherited %s from the broker's defaults: set to -1 on the "
                "topic, so that it keeps every step",
                self.topic,
                ", ".join(f"{k}={v}" for k, v in sorted(deleting.items())),
            )
            return
        found = ", ".join(f"{k}={v}" for k, v in sorted(deleting.items()))
        fix = ",".join(f"{k}=-1" for k in sorted(deleting))
        raise UndurableStepLogError(
            f"step log topic {self.topic} has {found}, so Kafka can delete step records that "
            f"recovery needs (an idle pipeline's last steps grow old); keep them forever: "
            f"kafka-configs.sh --bootstrap-server {self.config.bootstrap_servers} --alter "
            f"--entity-type topics --entity-name {self.topic} --add-config {fix}"
        )

    # -- reading --------------------------------------------------------------------------

    def _bounds(self) -> tuple[int, int]:
        key = (self.topic, 0)
        earliest = self.admin.offsets([key], "earliest")[key]
        stable = self.admin.offsets([key], "stable")[key]
        return earliest, stable

    def _read(self, start: int, end: int) -> list[tuple[int, StepRecord]]:
        """The committed records in offsets ``[start, end)``, parsed and deployment-checked."""
        if start >= end:
            return []
        read = read_range(self.config, PartitionRange(self.topic, 0, start, end))
        columns = read.records.to_pydict()
        out = []
        for offset, value in zip(columns["offset"], columns["value"], strict=True):
            record = StepRecord.from_json(value if value is not None else b"null")
            if record.deployment != self.deployment:
                raise DeploymentMismatchError(self.topic, self.deployment, record.deployment)
            out.append((int(offset), record))
        return out

    def _check_next(self, expected: int, record: StepRecord) -> None:
        """Raise unless ``record`` is step ``expected`` (the one after the previous record)."""
        if record.step > expected:
            raise StepLogGapError(self.topic, expected - 1, record.step)
        if record.step < expected:
            raise WrongStepError(
                expected=expected,
                found=record.step,
                detail=f"step {record.step} is logged twice or out of order in {self.topic}",
            )

    def _regular(self, records: list[tuple[int, StepRecord]]) -> list[tuple[int, StepRecord]]:
        """The steps' own records among ``records`` (corrections left out), checked dense."""
        regular = [(offset, r) for offset, r in records if not r.correction]
        for (_, before), (_, after) in itertools.pairwise(regular):
            self._check_next(before.step + 1, after)
        return regular

    def _correct(self, effective: dict[int, StepRecord], correction: StepRecord) -> None:
        """Make ``correction`` the effective record of its step in ``effective`` (if there)."""
        prior = effective.get(correction.step)
        if prior is None:
            return  # a correction of a step before the ones asked for
        if correction.correction != prior.correction + 1:
            raise StepLogError(
                f"step log {self.topic}: correction {correction.correction} of step "
                f"{correction.step} follows correction {prior.correction} of it"
            )
        effective[correction.step] = replace(correction, prior_ranges=prior.all_output_ranges)

    def last(self) -> StepRecord | None:
        """The last committed step's effective record, or None when no step was ever logged."""
        earliest, stable = self._bounds()
        window = _WINDOW
        while True:
            start = max(earliest, stable - window)
            records = self._read(start, stable)
            regular = self._regular(records)
            if regular:
                at, last = regular[-1]
                effective: dict[int, StepRecord] = {last.step: last}
                for offset, record in records:
                    if offset > at:  # only corrections follow the last step's record
                        self._correct(effective, record)
                return effective[last.step]
            if start <= earliest:
                return None
            window *= 4

    def _first_at(self, offset: int, stable: int) -> tuple[int, StepRecord] | None:
        """The first committed step record (not a correction) at or after ``offset``, or None
        before ``stable``."""
        window = _WINDOW
        while offset < stable:
            records = self._read(offset, min(stable, offset + window))
            regular = [(at, r) for at, r in records if not r.correction]
            if regular:
                return regular[0]
            offset += window
            window *= 4
        return None

    def _locate(self, step: int) -> tuple[int, int]:
        """(offset of ``step``'s record, stable offset); :class:`StepLogError` if not logged."""
        earliest, stable = self._bounds()
        lo, hi = earliest, stable
        # Step records are in increasing step order, so a binary search over offsets finds one.
        while lo < hi:
            mid = (lo + hi) // 2
            found = self._first_at(mid, hi)
            if found is None:
                hi = mid
                continue
            offset, record = found
            if record.step == step:
                return offset, stable
            if record.step < step:
                lo = offset + 1
            else:
                hi = mid
        last = self.last()
        raise StepLogError(
            f"step {step} is not in step log {self.topic} (its last step is "
            f"{'none' if last is None else last.step}): the step log was truncated or the state "
            "belongs to another pipeline"
        )

    def record(self, step: int) -> StepRecord:
        """The effective record of ``step`` (see the module docstring)."""
        return next(self.records(step, step))

    def records(self, first: int, last: int | None = None) -> Iterator[StepRecord]:
        """The effective records of steps ``first..last`` (inclusive; to the end when ``last``
        is None), in step order.

        Each step record is checked to be the step after the one before (a gap raises
        :class:`StepLogGapError`, a record for another step :class:`WrongStepError`), and each
        correction to follow its step's previous record. A correction of step ``s`` follows the
        record of whatever step was last when it was made, so the read goes on to the end of the
        log (cheap: replays read from a checkpoint, and the log holds one small record per step).
        """
        if last is not None and last < first:
            return
        offset, stable = self._locate(first)
        effective: dict[int, StepRecord] = {}
        expected = first
        window = 4 * _WINDOW
        while offset < stable:
            end = min(stable, offset + window)
            for _, record in self._read(offset, end):
                if record.correction:
                    if record.step >= expected:
                        raise StepLogError(
                            f"step log {self.topic}: a correction of step {record.step} comes "
                            "before the step itself"
                        )
                    self._correct(effective, record)
                    continue
                self._check_next(expected, record)
                effective[record.step] = record
                expected += 1
            offset = end
        if last is not None and expected <= last:
            raise StepLogError(
                f"step log {self.topic} ends at step {expected - 1}, step {last} was expected"
            )
        for step, record in effective.items():
            if last is None or step <= last:
                yield record
