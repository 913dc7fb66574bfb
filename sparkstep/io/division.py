"""Divisions of input into steps, and the planner that takes the next one.

A :class:`Division` of step ``s`` is, for every input topic-partition, the half-open offset range
``[start, end)`` that step ``s`` consumes, plus the step's :class:`StepTime`. Invariants:

- consecutive divisions are contiguous: a partition's ``start`` in step ``s + 1`` is its ``end``
  in step ``s``; a partition that appears later starts at its earliest offset;
- ``end`` never passes the partition's last stable offset (LSO) at planning time, so a range never
  covers records of a transaction that may still abort; offsets in ``[start, end)`` that hold
  transaction markers or aborted records simply yield no records;
- ``end - start`` is at most the partition's share of ``max_records_per_step`` (offsets, not
  records: aborted records and markers count against the share, so a step never exceeds it);
- the keys and values a step reads add up to at most ``max_bytes_per_step``, split evenly over
  its non-empty ranges, except that a range always reads its first record (a record larger than
  its share is read alone, so no step is ever stuck);
- ranges are sorted by (topic, partition) and every input partition has one (possibly empty);
- a partition never ends below the end the last division gave it: a topic deleted and recreated
  (or truncated) raises :class:`~sparkstep.io.errors.InputRewoundError`, since the logged offsets
  would name other records (the high watermark and the LSO only grow while a topic lives; an
  unclean leader election, which loses committed records, is the one other way down).

Bytes, unlike offsets, are known only once the records are read. So a planned division carries
its ``byte_budget`` and is **tentative**: the reader (:func:`sparkstep.io.ranges.map_read`)
stops each range before the record that would take it past its share and reports where it
stopped, and :meth:`Division.cut` makes the **final** division of those ends (``byte_budget``
None). The records a tentative division's read takes are a function of its ranges and budget
(a range's records and their sizes never change), so a step's work can run on the tentative
division and its read at once; only the final division is logged, and a logged division is
always read exactly, whatever the budget is now.

The planner only proposes; the division becomes durable with the step's step log record (see
:mod:`sparkstep.io.output`), and a replayed step uses its logged division, never a new one.

Shares: the budget is spread evenly over the partitions that have input, and what a partition
cannot use (it has less input than its share) goes to the others, in (topic, partition) order for
the last indivisible records, so the result is a pure function of the offsets.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import Consumer, KafkaException, TopicPartition

from sparkstep.errors import ConfigError
from sparkstep.ids import Step
from sparkstep.io.config import KafkaConfig
from sparkstep.io.errors import InputLostError, InputRewoundError
from sparkstep.io.topics import TopicAdmin, TopicPartitionKey

__all__ = [
    "DEFAULT_MAX_BYTES_PER_STEP",
    "DEFAULT_MAX_RECORDS_PER_STEP",
    "Division",
    "DivisionOptions",
    "DivisionPlanner",
    "PartitionRange",
    "StartFrom",
    "StepTime",
    "allocate_shares",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_RECORDS_PER_STEP = 100_000
#: 256 MiB of keys and values per step: well inside one executor's memory, and far below the
#: 2 GiB an Arrow binary column can hold (the reader's batches are bounded on their own anyway).
DEFAULT_MAX_BYTES_PER_STEP = 256 << 20

StartFrom = Literal["earliest", "latest"]


@dataclass(frozen=True, order=True)
class PartitionRange:
    """The offsets ``[start, end)`` of one topic-partition; ``0 <= start <= end``."""

    topic: str
    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid offset range {self.topic}[{self.partition}] {self.span}")

    @property
    def key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)

    @property
    def span(self) -> str:
        return f"[{self.start}, {self.end})"

    @property
    def is_empty(self) -> bool:
        return self.start == self.end


@dataclass(frozen=True)
class StepTime:
    """The logged time of a step, in milliseconds since the epoch.

    ``wall`` is the driver's clock when the division was taken; ``max_input_ts`` the largest
    input record timestamp of the step (None until the ranges are read, or when the step has no
    input). Operators see only logged time, so timers fire identically on replay.
    """

    max_input_ts: int | None
    wall: int


@dataclass(frozen=True)
class Division:
    """The input of one step (see the module docstring for the invariants).

    ``byte_budget`` is set on a tentative division from the planner: the most key and value
    bytes its read may take before :meth:`cut` ends it where the reader stopped. None marks a
    final division (cut, or logged), whose ranges are read exactly.
    """

    step: Step
    ranges: tuple[PartitionRange, ...]
    time: StepTime
    byte_budget: int | None = None

    def __post_init__(self) -> None:
        keys = [r.key for r in self.ranges]
        if keys != sorted(set(keys)):
            raise ValueError(f"division of step {self.step}: ranges not sorted or repeated")

    @property
    def is_empty(self) -> bool:
        """True when the step consumes no offsets (a timer tick)."""
        return all(r.is_empty for r in self.ranges)

    @property
    def offset_count(self) -> int:
        """The number of offsets covered (an upper bound of the records)."""
        return sum(r.end - r.start for r in self.ranges)

    def ends(self) -> dict[TopicPartitionKey, int]:
        """Per partition, the first offset after this step: the next step's start."""
        return {r.key: r.end for r in self.ranges}

    def range_byte_budget(self) -> int | None:
        """Each non-empty range's share of :attr:`byte_budget` (None for a final division)."""
        if self.byte_budget is None:
            return None
        return max(1, self.byte_budget // max(1, sum(not r.is_empty for r in self.ranges)))

    def cut(self, ends: Mapping[TopicPartitionKey, int]) -> Division:
        """The final division: each range ends where ``ends`` says its read stopped.

        Raises ValueError for an end outside its range, or one that leaves a non-empty range
        empty (a read always takes its range's first record).
        """
        ranges = []
        for r in self.ranges:
            end = ends.get(r.key, r.end)
            if not r.start <= end <= r.end or (end == r.start < r.end):
                raise ValueError(
                    f"step {self.step}: a read of {r.topic}[{r.partition}] {r.span} cannot stop "
                    f"at {end}"
                )
            ranges.append(dataclasses.replace(r, end=end))
        return dataclasses.replace(self, ranges=tuple(ranges), byte_budget=None)

    def with_max_input_ts(self, max_input_ts: int | None) -> Division:
        """This division with the step time's ``max_input_ts`` filled in after reading."""
        return dataclasses.replace(
            self, time=StepTime(max_input_ts=max_input_ts, wall=self.time.wall)
        )


@dataclass(frozen=True)
class DivisionOptions:
    """What the planner divides: the input topics, the step budget and where step 0 starts."""

    topics: tuple[str, ...]
    max_records_per_step: int = DEFAULT_MAX_RECORDS_PER_STEP
    start_from: StartFrom = "earliest"
    max_bytes_per_step: int = DEFAULT_MAX_BYTES_PER_STEP

    def __post_init__(self) -> None:
        if not self.topics:
            raise ConfigError("at least one input topic is needed")
        if self.max_records_per_step < 1:
            raise ConfigError(
                f"--max-records-per-step must be at least 1, got {self.max_records_per_step}"
            )
        if self.max_bytes_per_step < 1:
            raise ConfigError(
                f"--max-bytes-per-step must be at least 1, got {self.max_bytes_per_step}"
            )
        if self.start_from not in ("earliest", "latest"):
            raise ConfigError(f"--start-from must be earliest or latest, not {self.start_from!r}")


def allocate_shares(
    available: Mapping[TopicPartitionKey, int], budget: int
) -> dict[TopicPartitionKey, int]:
    """Split ``budget`` over partitions with ``available`` offsets each (water-filling).

    Returns per partition ``0 <= share <= available``; the shares add up to
    ``min(budget, sum(available))``. Deterministic: a function of its arguments only.
    """
    shares = {key: 0 for key in available}
    active = sorted(key for key, avail in available.items() if avail > 0)
    remaining = budget
    while remaining > 0 and active:
        each = remaining // len(active)
        if each == 0:
            for key in active[:remaining]:
                shares[key] += 1
            break
        for key in active:
            grant = min(each, available[key] - shares[key])
            shares[key] += grant
            remaining -= grant
        active = [key for key in active if shares[key] < available[key]]
    return shares


class DivisionPlanner:
    """Takes the next division of the input topics (see the module docstring).

    Usage by the step loop::

        planner = DivisionPlanner(config, DivisionOptions(topics=("in",)))
        planner.check_inputs()                     # once: topics exist, none compacted
        division = planner.plan(previous)          # previous: the last step's Division or None
        if division.is_empty:
            planner.wait_for_input(previous_or_division, cancel)   # cancellable
        planner.close()                            # releases the wait's consumer

    One thread at a time calls :meth:`wait_for_input` (the step loop).
    """

    def __init__(
        self, config: KafkaConfig, options: DivisionOptions, admin: TopicAdmin | None = None
    ) -> None:
        self.config = config
        self.options = options
        self.admin = admin if admin is not None else TopicAdmin(config)
        self._last_stable: dict[TopicPartitionKey, int] = {}
        self._listener: Consumer | None = None  # made by the first wait that has ends

    def close(self) -> None:
        """Release the consumer :meth:`wait_for_input` listens with (a later wait makes a new
        one)."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()

    def check_inputs(self) -> None:
        """Raise unless every input topic exists and none is compacted; warn for retention by
        size (:meth:`~sparkstep.io.topics.TopicAdmin.size_retention_warnings`)."""
        self.admin.wait_until_reachable()
        for topic in self.options.topics:
            self.admin.partitions(topic)
        self.admin.refuse_compacted(self.options.topics, "input")
        self.admin.size_retention_warnings(self.options.topics)

    def input_partitions(self) -> list[TopicPartitionKey]:
        """Every partition of every input topic, sorted."""
        return sorted(
            (topic, partition)
            for topic in self.options.topics
            for partition in self.admin.partitions(topic)
        )

    def stable_offsets(self) -> dict[TopicPartitionKey, int]:
        """The last stable offset of every input partition."""
        return self.admin.offsets(self.input_partitions(), "stable")

    def high_watermarks(self) -> dict[TopicPartitionKey, int]:
        """The high watermark of every input partition (read-only, for metrics): above the LSO
        while a transaction there is open."""
        return self.admin.offsets(self.input_partitions(), "latest")

    def last_stable_offsets(self) -> dict[TopicPartitionKey, int]:
        """The LSOs the last :meth:`plan` divided by (empty before the first plan)."""
        return dict(self._last_stable)

    def plan(self, previous: Division | None, now_ms: int | None = None) -> Division:
        """The division of the step after ``previous`` (step 0 when ``previous`` is None).

        Raises :class:`InputLostError` when retention deleted offsets that the step would have
        to read (the previous end is below the log start), :class:`InputRewoundError` when a
        partition now ends below the previous end or is gone (the topic was recreated).
        """
        step = Step(0 if previous is None else previous.step + 1)
        wall = int(time.time() * 1000) if now_ms is None else now_ms
        # Step 1. The partitions now, with their log start and last stable offsets.
        keys = self.input_partitions()
        earliest = self.admin.offsets(keys, "earliest")
        stable = self.admin.offsets(keys, "stable")
        self._last_stable = stable
        # Step 2. Starts: the previous ends; step 0 and new partitions as documented.
        known = previous.ends() if previous is not None else {}
        self._refuse_rewound(known, earliest, stable)
        starts: dict[TopicPartitionKey, int] = {}
        for key in keys:
            if key in known:
                starts[key] = known[key]
            elif previous is None and self.options.start_from == "latest":
                starts[key] = stable[key]
            else:
                starts[key] = earliest[key]
            if starts[key] < earliest[key]:
                raise InputLostError(
                    f"input {key[0]}[{key[1]}] offsets {starts[key]}..{earliest[key]} were "
                    f"deleted by retention before step {step} read them; raise the topic's "
                    "retention.ms (sparkstep needs input until its step is checkpointed)"
                )
        # Step 3. Ends: the start plus the partition's share, never past the LSO.
        available = {key: max(0, stable[key] - starts[key]) for key in keys}
        shares = allocate_shares(available, self.options.max_records_per_step)
        ranges = tuple(
            PartitionRange(key[0], key[1], starts[key], starts[key] + shares[key]) for key in keys
        )
        return Division(
            step=step,
            ranges=ranges,
            time=StepTime(max_input_ts=None, wall=wall),
            byte_budget=self.options.max_bytes_per_step,
        )

    def check_ends(self, ends: Mapping[TopicPartitionKey, int]) -> None:
        """Raise :class:`InputRewoundError` unless every partition of ``ends`` (a logged step's
        ends) still exists and reaches at least its end; recovery asks before replaying."""
        keys = self.input_partitions()
        self._refuse_rewound(
            ends, self.admin.offsets(keys, "earliest"), self.admin.offsets(keys, "stable")
        )

    def _refuse_rewound(
        self,
        ends: Mapping[TopicPartitionKey, int],
        earliest: Mapping[TopicPartitionKey, int],
        stable: Mapping[TopicPartitionKey, int],
    ) -> None:
        for (topic, partition), end in sorted(ends.items()):
            if topic not in self.options.topics:
                continue  # no longer an input of the pipeline: not read any more
            where = f"input {topic}[{partition}]"
            advice = (
                "restore the topic as it was, or start over on the new topic with a new --name "
                "and --state-dir"
            )
            if (topic, partition) not in stable:
                raise InputRewoundError(
                    f"{where} no longer exists but logged steps read it up to offset {end}: "
                    f"topic {topic} was deleted and recreated with fewer partitions; {advice}"
                )
            if stable[(topic, partition)] < end:
                raise InputRewoundError(
                    f"{where} now holds offsets {earliest[(topic, partition)]}.."
                    f"{stable[(topic, partition)]}, below offset {end} that logged steps already "
                    f"read: topic {topic} was deleted and recreated (or truncated), so its offsets "
                    f"name other records now; {advice}"
                )

    def has_input_after(self, ends: Mapping[TopicPartitionKey, int]) -> bool:
        """Whether any partition has stable input at or after ``ends`` (new partitions: any).

        Raises :class:`InputRewoundError` as :meth:`plan` does, so a wait never stalls on a
        recreated topic.
        """
        keys = self.input_partitions()
        stable = self.admin.offsets(keys, "stable")
        missing = [key for key in keys if key not in ends]
        earliest = self.admin.offsets(missing, "earliest")
        if any(stable.get(key, -1) < end for key, end in ends.items()):
            self.check_ends(ends)  # raises (for an input topic), naming the partition
        for key in keys:
            start = ends.get(key, earliest.get(key, 0))
            if stable[key] > start:
                return True
        return False

    def wait_for_input(
        self,
        ends: Mapping[TopicPartitionKey, int] | Division | None,
        cancel: threading.Event,
        timeout_s: float | None = None,
        poll_interval_s: float = 0.1,
    ) -> bool:
        """Wait until there is input after ``ends``; False if ``cancel`` is set or time is up.

        ``ends`` is the last division (or its :meth:`Division.ends`); None means "before step
        0", where any stable input counts. Setting ``cancel`` (from another thread: pause, stop)
        returns within one poll interval.

        What counts is :meth:`has_input_after` (the offsets :meth:`plan` divides by), checked
        at least every ``poll_interval_s``. Between checks the wait listens: a read_committed
        consumer assigned at ``ends`` takes the first record committed there, and its arrival
        ends the pause at once, so new input on a known partition is seen within a round trip
        of its commit instead of up to a poll interval later (the one-record latency). The
        consumer is unassigned when the wait returns, so it fetches nothing while steps run.
        """
        if isinstance(ends, Division):
            ends = ends.ends()
        elif ends is None:
            ends = {}
        if ends == {} and self.options.start_from == "latest":
            # Nothing to wait for from "the start": step 0 begins at the LSO anyway.
            ends = self.stable_offsets()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        listening = self._listen(ends)
        try:
            while not cancel.is_set():
                if self.has_input_after(ends):
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                pause = poll_interval_s
                if deadline is not None:
                    pause = max(0.0, min(pause, deadline - time.monotonic()))
                if listening:
                    self._arrival(pause, cancel)
                else:
                    cancel.wait(pause)
            return False
        finally:
            if listening:
                self._unlisten()

    def _listen(self, ends: Mapping[TopicPartitionKey, int]) -> bool:
        """Assign the listening consumer at ``ends``; False (the wait only polls) when there
        is nothing to listen at or the consumer cannot be made or assigned."""
        if not ends:
            return False
        try:
            if self._listener is None:
                # A throwaway group id that is never joined (assign only, nothing committed);
                # no end-of-partition events, so only a record ends a pause.
                self._listener = Consumer(
                    self.config.consumer(
                        f"sparkstep.planner.{uuid.uuid4().hex}", **{"enable.partition.eof": False}
                    )
                )
            self._listener.assign([TopicPartition(t, p, end) for (t, p), end in ends.items()])
        except KafkaException as exc:
            log.debug("waiting for input by polling only: %s", exc)
            self.close()
            return False
        return True

    def _arrival(self, seconds: float, cancel: threading.Event) -> None:
        """Pause up to ``seconds``, less if a record arrives at the listening consumer. An
        error (an offset below the log start, a broker away) is no arrival: the rest of the
        pause is waited out, and the next offsets check says what happened."""
        assert self._listener is not None
        started = time.monotonic()
        try:
            found = self._listener.consume(num_messages=1, timeout=seconds)
        except KafkaException:
            found = []
        if not any(message.error() is None for message in found):
            cancel.wait(max(0.0, seconds - (time.monotonic() - started)))

    def _unlisten(self) -> None:
        assert self._listener is not None
        try:
            self._listener.unassign()
        except KafkaException:
            self.close()
