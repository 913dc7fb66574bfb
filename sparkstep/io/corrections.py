"""What a correction of a logged step writes (``--on-replay-mismatch=reemit``).

Seed 004: "write as output the difference between the new output and the previously produced
output". :func:`plan_correction` computes it; :meth:`~sparkstep.io.output.OutputWriter.correct`
writes it in one transaction, as it writes every step:

Step 1. The step's output so far is read back (read_committed) from every output range of its
effective step log record (its own and its earlier corrections'), keeping the records whose
``sparkstep.step`` header is the step, and integrated per row (key, and value without the
weight).
Step 2. The difference ``new output - so far``, consolidated per row, in a deterministic order:
retractions first, then insertions. Each is written with the headers ``sparkstep.step`` and
:data:`HEADER_CORRECTION` = n. New output records too large to write are left out of the new
output and written as dead letters in the same transaction (:mod:`sparkstep.io.limits`).
Step 3. The correction record (format in :mod:`sparkstep.io.steplog`): count and digest of the
new output, the ranges of step 2's records, the new state digests; every other field the step's
own; ``correction`` = n, one past the step's previous correction.

Afterwards a consumer that integrates the output topic sees exactly the new output for the step,
and a later replay of the step is compared with it and the new digests. Dead letters are not
corrected: they are a function of the input, whose hashes matched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import PartitionRange
from sparkstep.io.encoding import HEADER_STEP, EncodedRecords, encode_json
from sparkstep.io.ranges import range_messages
from sparkstep.io.steplog import OutputSummary, StepRecord

__all__ = ["Correction", "HEADER_CORRECTION", "plan_correction"]

#: On the records of a correction: its number n >= 1 (ASCII decimal).
HEADER_CORRECTION = "sparkstep.correction"

#: Per row (key, value without the weight): the integrated weight.
_Totals = dict[tuple[bytes | None, bytes], int]


@dataclass(frozen=True)
class Correction:
    """What one correction writes: the difference records, and its step log record (whose
    output ranges the writer fills in from the delivery reports)."""

    records: EncodedRecords
    record: StepRecord

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        """The extra headers of the difference records."""
        return [(HEADER_CORRECTION, str(self.record.correction).encode("ascii"))]


def _integrate(totals: _Totals, key: bytes | None, value: bytes, sign: int) -> None:
    """Add one encoded output record's weight (times ``sign``) to ``totals`` under its row:
    its key and its value without the weight (re-encoded, so equal rows give equal bytes)."""
    doc = json.loads(value)
    weight = doc.pop("weight")
    row = encode_json(doc)
    totals[(key, row)] = totals.get((key, row), 0) + sign * int(weight)


def _output_so_far(config: KafkaConfig, logged: StepRecord) -> _Totals:
    """Step 1: the committed output of ``logged``'s step, integrated per row."""
    totals: _Totals = {}
    step = str(logged.step).encode("ascii")
    for rng in logged.all_output_ranges:
        span = PartitionRange(rng.topic, rng.partition, rng.start, rng.end)
        for msg in range_messages(config, span):
            if dict(msg.headers() or ()).get(HEADER_STEP) == step:
                _integrate(totals, msg.key(), msg.value() or b"null", 1)
    return totals


def plan_correction(
    config: KafkaConfig,
    logged: StepRecord,
    records: EncodedRecords,
    summary: OutputSummary,
    state_digests: Mapping[str, str],
) -> Correction:
    """The correction that makes the written output of ``logged``'s step ``records``; ``logged``
    is the step's effective record, ``summary`` the count and digest of the step's whole new
    output (``records`` and the records replaced by dead letters, see
    :mod:`sparkstep.io.limits`); module docstring, steps 1 to 3."""
    difference = _output_so_far(config, logged)
    for key, value in zip(records.keys, records.values, strict=True):
        _integrate(difference, key, value, -1)
    diff = EncodedRecords.of(  # now - so far = -(so far - now)
        (key, encode_json({**json.loads(row), "weight": -weight}))
        for (key, row), weight in sorted(difference.items(), key=lambda kv: -kv[1])
        if weight != 0
    )
    correction = StepRecord(
        deployment=logged.deployment,
        step=logged.step,
        epoch=logged.epoch,
        time=logged.time,
        division=logged.division,
        output=summary,
        state_digests=dict(state_digests),
        dlq_count=logged.dlq_count,
        correction=logged.correction + 1,
    )
    return Correction(diff, correction)
