"""The exactly-once output writer: format, step log record, replays, fencing, refusals."""

from __future__ import annotations

import hashlib
import json
import uuid

import pyarrow as pa
import pytest

from sparkstep.errors import ConfigError
from sparkstep.io import output as output_module
from sparkstep.io.config import KafkaConfig
from sparkstep.io.corrections import HEADER_CORRECTION
from sparkstep.io.deadletter import (
    HEADER_OUTPUT_TOPIC,
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_VALUE_SIZE,
    DeadLetter,
    dlq_topic,
)
from sparkstep.io.encoding import (
    HEADER_STEP,
    EncodedRecords,
    encode_output,
    output_digest,
    output_digest_format,
)
from sparkstep.io.errors import (
    CompactedTopicError,
    DeploymentConflictError,
    DeploymentMismatchError,
    RecurringWriteError,
    ReplayMismatchError,
    StepAbortedError,
    StepOrderError,
    WriterFencedError,
    WriterStateError,
)
from sparkstep.io.limits import RecordLimit, fit_step
from sparkstep.io.output import (
    OutputOptions,
    OutputWriter,
    StepFacts,
    WriteOutcome,
    WriterStatus,
)
from sparkstep.io.steplog import RangeSummary, StepLog, StepRecord, steps_topic
from sparkstep.io.topics import TopicAdmin

from .fixtures import read_committed, step_facts, step_letters, step_table


def make_writer(kafka_config: KafkaConfig, name: str, output: str, deployment: str = "dep-1"):
    return OutputWriter(
        kafka_config,
        OutputOptions(name=name, deployment=deployment, output_topic=output, key_columns=("key",)),
    )


def test_encoding_and_order_independent_digest() -> None:
    table = pa.table({"a": ["x", "y"], "b": [1.5, None], "weight": pa.array([1, -1], pa.int64())})
    records = encode_output(table, ("a",))
    assert [r.key for r in records] == [b"x", b"y"]
    assert [json.loads(r.value) for r in records] == [
        {"a": "x", "b": 1.5, "weight": 1},
        {"a": "y", "b": None, "weight": -1},
    ]
    assert encode_output(table, ("a", "b"))[0].key == b'["x",1.5]'
    assert encode_output(table, None)[0].key == b'{"a":"x","b":1.5}'
    shuffled = table.take([1, 0])
    assert output_digest(encode_output(shuffled, ("a",))) == output_digest(records)
    changed = pa.table({"a": ["x", "y"], "b": [1.5, 2.0], "weight": pa.array([1, -1], pa.int64())})
    assert output_digest(encode_output(changed, ("a",))) != output_digest(records)


def test_output_digests_are_their_definitions_in_both_formats() -> None:
    """Format 2 is the sum of pair_hash(key, value) (a missing key hashing as 0), written with
    ``v2:``; format 1 the sum of BLAKE2b-64 of the framed record; both mod 2**64. The test's
    sums overflow 64 bits, and a missing key differs from an empty one."""
    from sparkstep.hashing import MASK, pair_hashes

    records = EncodedRecords([b"k1", None, b"", b"k1"], [b'{"a":1}', b"{}", b"{}", b"x" * 21])
    pairs = list(zip(records.keys, records.values, strict=True))
    v2 = sum(int(pair_hashes([k], [v])[0]) for k, v in pairs) & MASK
    assert int(pair_hashes([None], [b"{}"])[0]) != int(pair_hashes([b""], [b"{}"])[0])
    assert output_digest(records) == output_digest(records, 2) == f"v2:{v2:016x}"
    v1 = 0
    for key, value in pairs:
        head = b"\xff" * 4 if key is None else len(key).to_bytes(4, "big") + key
        v1 += int.from_bytes(hashlib.blake2b(head + value, digest_size=8).digest(), "big")
    assert output_digest(records, 1) == f"{v1 & MASK:016x}"
    assert output_digest(EncodedRecords([], []), 2) == "v2:" + "0" * 16
    with pytest.raises(ValueError, match="no output digest format 3"):
        output_digest(records, 3)


@pytest.mark.parametrize(
    ("text", "found"),
    [("v2:" + "0f" * 8, 2), ("0f" * 8, 1), ("v2:" + "0F" * 8, None), ("v3:" + "0" * 16, None),
     ("0" * 15, None), ("v2:" + "0" * 17, None)],
)  # fmt: skip
def test_an_output_digest_names_its_format(text: str, found: int | None) -> None:
    if found is None:
        with pytest.raises(ValueError, match="no format this sparkstep knows"):
            output_digest_format(text)
    else:
        assert output_digest_format(text) == found


def test_steps_are_written_whole_with_their_step_log_record(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out", partitions=2)
    writer = make_writer(kafka_config, unique_name, output)
    assert writer.open() == 0
    for step in range(3):
        result = writer.write(step, step_table(step), step_letters(step), step_facts(step))
        assert result.outcome is WriteOutcome.WRITTEN
    assert writer.next_step == 3
    # Nothing visible before commit leaks; everything visible is whole.
    seen = read_committed(bootstrap_servers, output)
    assert len(seen) == 12
    for record in seen:
        step = int(dict(record.headers)[HEADER_STEP])
        value = json.loads(record.value)
        assert set(value) == {"key", "sum", "weight"}
        assert record.key == value["key"].encode()
        assert value["sum"] // 100 == step
    log_seen = read_committed(bootstrap_servers, steps_topic(unique_name))
    log_records = [StepRecord.from_json(r.value) for r in log_seen]
    assert [r.step for r in log_records] == [0, 1, 2]
    for logged in log_records:
        assert logged.deployment == "dep-1"
        assert logged.division == step_facts(logged.step).division
        assert logged.time == step_facts(logged.step).time
        assert logged.state_digests == {"0": f"state{logged.step}"}
        assert logged.dlq_count == 1
        assert logged.output.count == 4
        # The logged offset ranges hold exactly this step's output records.
        ranges = logged.output.ranges
        in_ranges = [
            s
            for s in seen
            if any(r.partition == s.partition and r.start <= s.offset < r.end for r in ranges)
        ]
        assert sorted(json.loads(s.value)["sum"] for s in in_ranges) == [
            logged.step * 100 + i for i in range(4)
        ]
    letters = read_committed(bootstrap_servers, dlq_topic(unique_name))
    assert [r.value for r in letters] == [b"not json %d" % s for s in range(3)]
    headers = dict(letters[1].headers)
    assert headers[HEADER_STEP] == b"1"
    assert headers[HEADER_REASON] == b"bad JSON"
    assert headers[HEADER_SOURCE_TOPIC] == b"input"
    assert headers[HEADER_SOURCE_PARTITION] == b"0"
    assert headers[HEADER_SOURCE_OFFSET] == b"19"
    # The step log reads back, checked.
    log = StepLog(kafka_config, unique_name, "dep-1")
    assert log.last() == log_records[-1]
    assert log.record(1) == log_records[1]
    assert list(log.records(0)) == log_records
    writer.close()


def test_replays_are_checked_and_discarded(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out")
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        for step in range(3):
            writer.write(step, step_table(step), step_letters(step), step_facts(step))
    with make_writer(kafka_config, unique_name, output) as writer:
        assert writer.open() == 3
        # The same output in another row order is the same output.
        for step in range(3):
            table = step_table(step, shuffle=True)
            result = writer.write(step, table, step_letters(step), step_facts(step))
            assert result.outcome is WriteOutcome.REPLAYED
        with pytest.raises(ReplayMismatchError, match="step 1") as info:
            writer.write(1, step_table(1, rows=5), step_letters(1), step_facts(1))
        assert info.value.step == 1
        changed = step_table(2).set_column(1, "sum", pa.array([1, 2, 3, 4], pa.int64()))
        with pytest.raises(ReplayMismatchError, match="output digest"):
            writer.write(2, changed, step_letters(2), step_facts(2))
        with pytest.raises(ReplayMismatchError, match="input"):
            facts = step_facts(0)
            other = StepFacts(facts.epoch, facts.time, (RangeSummary("input", 0, 0, 10, 10, "x"),))
            writer.write(0, step_table(0), step_letters(0), other)
        with pytest.raises(StepOrderError, match="next step"):
            writer.write(5, step_table(5), [], step_facts(5))
        assert writer.write(3, step_table(3), [], step_facts(3)).outcome is WriteOutcome.WRITTEN
    assert len(read_committed(bootstrap_servers, output)) == 16


def test_a_step_logged_with_a_format_1_digest_is_replayed_against_format_1(
    topic_factory, unique_name: str, kafka_config: KafkaConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step log of an earlier sparkstep (BLAKE2b output digests) keeps being checked: a
    replay computes its step's digest in the format the step was logged with."""
    output = topic_factory("out")
    real = output_digest
    with monkeypatch.context() as patch:  # the writer of an earlier sparkstep
        patch.setattr(output_module, "output_digest", lambda records, _=2: real(records, 1))
        with make_writer(kafka_config, unique_name, output) as writer:
            writer.open()
            writer.write(0, step_table(0), [], step_facts(0))
    with make_writer(kafka_config, unique_name, output) as writer:
        assert writer.open() == 1
        logged = writer.last_record
        assert logged is not None and output_digest_format(logged.output.digest) == 1
        shuffled = step_table(0, shuffle=True)
        assert writer.write(0, shuffled, [], step_facts(0)).outcome is WriteOutcome.REPLAYED
        changed = step_table(0).set_column(1, "sum", pa.array([1, 2, 3, 4], pa.int64()))
        with pytest.raises(ReplayMismatchError, match="output digest"):
            writer.write(0, changed, [], step_facts(0))
        written = writer.write(1, step_table(1), [], step_facts(1))
        assert output_digest_format(written.record.output.digest) == 2


def test_output_ranges_bound_each_partitions_records_of_the_step(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    """Only the first and the last record of each partition report their delivery; the ranges
    they give are exactly where the step's records are, partition by partition."""
    output = topic_factory("out", partitions=3)
    table = _payload_table([5] * 40)
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        first = writer.write(0, _payload_table([5] * 3), [], step_facts(0)).record
        record = writer.write(1, table, [], step_facts(1)).record
    seen = read_committed(bootstrap_servers, output)
    ours = [s for s in seen if s.offset >= _range_end(first, s.partition)]
    offsets: dict[int, list[int]] = {}
    for s in ours:
        offsets.setdefault(s.partition, []).append(s.offset)
    assert len(ours) == 40 and len(offsets) == 3
    assert {(r.partition, r.start, r.end) for r in record.output.ranges} == {
        (p, min(found), max(found) + 1) for p, found in offsets.items()
    }


def test_a_step_whose_output_topic_was_deleted_is_aborted_and_says_so(
    topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out")
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        writer.write(0, step_table(0), [], step_facts(0))
        assert TopicAdmin(kafka_config).delete_topic(output)
        with pytest.raises(StepAbortedError, match=rf"output topic {output} has no partitions"):
            writer.write(1, step_table(1), [], step_facts(1))
        assert writer.status is WriterStatus.READY


def _range_end(record: StepRecord, partition: int) -> int:
    return max((r.end for r in record.output.ranges if r.partition == partition), default=0)


def test_an_older_writer_is_fenced_and_says_so(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out")
    old = make_writer(kafka_config, unique_name, output)
    old.open()
    old.write(0, step_table(0), [], step_facts(0))
    new = make_writer(kafka_config, unique_name, output)
    assert new.open() == 1
    with pytest.raises(WriterFencedError, match=r"fenced|another writer"):
        old.write(1, step_table(1), [], step_facts(1))
    assert old.status is WriterStatus.FAILED
    with pytest.raises(WriterStateError):
        old.write(1, step_table(1), [], step_facts(1))
    new.write(1, step_table(1), [], step_facts(1))
    log_seen = read_committed(bootstrap_servers, steps_topic(unique_name))
    steps = [StepRecord.from_json(r.value).step for r in log_seen]
    assert steps == [0, 1]
    assert len(read_committed(bootstrap_servers, output)) == 8


def test_another_deployment_of_the_name_is_refused_before_it_fences_the_live_one(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out")
    with make_writer(kafka_config, unique_name, output, deployment="dep-A") as live:
        live.open()
        live.write(0, step_table(0), [], step_facts(0))
        intruder = make_writer(kafka_config, unique_name, output, deployment="dep-B")
        with pytest.raises(DeploymentConflictError, match=r"dep-A.*dep-B.*--name") as info:
            intruder.open()
        # A configuration error: the runtime exits with its status, the supervisor gives up.
        assert isinstance(info.value, ConfigError)
        assert intruder.status is WriterStatus.FAILED
        # The live writer was not fenced: it goes on writing steps.
        for step in (1, 2):
            assert live.write(step, step_table(step), [], step_facts(step)).outcome is (
                WriteOutcome.WRITTEN
            )
    log_seen = read_committed(bootstrap_servers, steps_topic(unique_name))
    assert [StepRecord.from_json(r.value).step for r in log_seen] == [0, 1, 2]
    # The step log itself refuses another deployment's reader too.
    with pytest.raises(DeploymentMismatchError, match=r"dep-B.*dep-A"):
        StepLog(kafka_config, unique_name, "dep-B").last()


def test_compacted_output_is_refused(topic_factory, kafka_config: KafkaConfig) -> None:
    output = topic_factory("out", config={"cleanup.policy": "compact"})
    with pytest.raises(CompactedTopicError, match=output):
        make_writer(kafka_config, f"p{uuid.uuid4().hex[:8]}", output).open()


def _integrated_by_step(seen) -> dict[int, dict[tuple[str, int], int]]:
    totals: dict[int, dict[tuple[str, int], int]] = {}
    for record in seen:
        value = json.loads(record.value)
        rows = totals.setdefault(int(dict(record.headers)[HEADER_STEP]), {})
        row = (value["key"], value["sum"])
        rows[row] = rows.get(row, 0) + value["weight"]
    return {step: {r: w for r, w in rows.items() if w} for step, rows in totals.items()}


def _as_rows(table: pa.Table) -> dict[tuple[str, int], int]:
    rows: dict[tuple[str, int], int] = {}
    for row in table.to_pylist():
        key = (row["key"], row["sum"])
        rows[key] = rows.get(key, 0) + row["weight"]
    return {r: w for r, w in rows.items() if w}


def test_corrections_write_the_difference_and_become_the_logged_step(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out", partitions=2)
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        for step in range(3):
            writer.write(step, step_table(step), step_letters(step), step_facts(step))
    first = step_table(1).set_column(1, "sum", pa.array([100, 101, 7, 8], pa.int64()))
    second = step_table(1, rows=2)
    last = step_table(2).set_column(1, "sum", pa.array([5, 201, 202, 203], pa.int64()))
    new_state = StepFacts(
        step_facts(1).epoch, step_facts(1).time, step_facts(1).division, {"0": "other"}
    )
    with make_writer(kafka_config, unique_name, output) as writer:
        assert writer.open() == 3
        with pytest.raises(ReplayMismatchError) as info:
            writer.write(1, first, step_letters(1), new_state)
        assert info.value.correctable
        result = writer.correct(1, first, new_state)
        assert result.outcome is WriteOutcome.CORRECTED
        assert result.record.correction == 1
        assert result.record.state_digests == {"0": "other"}
        # The corrected step is what a replay is now compared with.
        replay = writer.write(1, first, step_letters(1), new_state)
        assert replay.outcome is WriteOutcome.REPLAYED
        assert writer.correct(1, second, new_state).record.correction == 2
        assert writer.correct(2, last, step_facts(2)).record.correction == 1
        assert writer.last_record is not None and writer.last_record.correction == 1
        assert writer.write(3, step_table(3), [], step_facts(3)).outcome is WriteOutcome.WRITTEN
    seen = read_committed(bootstrap_servers, output)
    by_step = _integrated_by_step(seen)
    assert by_step[0] == _as_rows(step_table(0))
    assert by_step[1] == _as_rows(second)
    assert by_step[2] == _as_rows(last)
    assert by_step[3] == _as_rows(step_table(3))
    corrections = [r for r in seen if HEADER_CORRECTION in dict(r.headers)]
    assert corrections, "a correction writes records"
    # The log reads back with the effective records; each one's ranges hold its step's output.
    log = StepLog(kafka_config, unique_name, "dep-1")
    effective = list(log.records(0))
    assert [(r.step, r.correction) for r in effective] == [(0, 0), (1, 2), (2, 1), (3, 0)]
    assert log.record(1).correction == 2
    last_record = log.last()
    assert last_record is not None and last_record.step == 3
    for record in effective:
        ranges = record.all_output_ranges
        in_ranges = [
            s
            for s in seen
            if any(r.partition == s.partition and r.start <= s.offset < r.end for r in ranges)
        ]
        assert _integrated_by_step(in_ranges)[record.step] == by_step[record.step]
    with make_writer(kafka_config, unique_name, output) as writer:
        assert writer.open() == 4
        assert writer.write(1, second, step_letters(1), new_state).outcome is WriteOutcome.REPLAYED
        with pytest.raises(ReplayMismatchError) as info:
            other = StepFacts(
                step_facts(0).epoch,
                step_facts(0).time,
                (RangeSummary("input", 0, 0, 10, 10, "x"),),
            )
            writer.write(0, step_table(0), step_letters(0), other)
        assert not info.value.correctable


# -- records too large for Kafka ----------------------------------------------------------------

SMALL_LIMIT = 20_000


def _payload_table(payloads: list[int]) -> pa.Table:
    """One output row per entry: key ``r<i>`` and a payload of that many bytes."""
    return pa.table(
        {
            "key": [f"r{i}" for i in range(len(payloads))],
            "payload": ["x" * size for size in payloads],
            "weight": pa.array([1] * len(payloads), pa.int64()),
        }
    )


def test_an_output_record_over_the_topic_limit_becomes_a_truncated_dead_letter(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out", config={"max.message.bytes": str(SMALL_LIMIT)})
    table = _payload_table([10, 3 * SMALL_LIMIT, 20])
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        assert writer.limit.max_bytes == SMALL_LIMIT
        assert output in writer.limit.source
        result = writer.write(0, table, step_letters(0), step_facts(0))
        assert result.outcome is WriteOutcome.WRITTEN
        # Many records that fit one by one are batched within the limit too.
        many = _payload_table([1_000] * 100)
        assert writer.write(1, many, [], step_facts(1)).outcome is WriteOutcome.WRITTEN
    seen = read_committed(bootstrap_servers, output)
    assert [(r.key, len(r.value)) for r in seen if dict(r.headers)[HEADER_STEP] == b"0"] == [
        (b"r0", len(encode_output(table, ("key",))[0].value)),
        (b"r2", len(encode_output(table, ("key",))[2].value)),
    ]
    assert len(seen) == 102
    letters = read_committed(bootstrap_servers, dlq_topic(unique_name))
    assert len(letters) == 2  # the input's dead letter, then the replaced output record
    assert letters[0].value == b"not json 0"
    replaced = letters[1]
    headers = dict(replaced.headers)
    original = encode_output(table, ("key",))[1].value
    assert headers[HEADER_STEP] == b"0"
    assert headers[HEADER_OUTPUT_TOPIC] == output.encode()
    assert headers[HEADER_VALUE_SIZE] == str(len(original)).encode()
    reason = headers[HEADER_REASON].decode()
    assert f"{SMALL_LIMIT}-byte limit" in reason and output in reason
    assert replaced.key == b"r1"
    assert 0 < len(replaced.value) < SMALL_LIMIT
    assert original.startswith(replaced.value)
    # The step log describes the whole output; its ranges hold the records written.
    logged = StepLog(kafka_config, unique_name, "dep-1").record(0)
    assert logged.output.count == 3
    assert logged.output.digest == output_digest(encode_output(table, ("key",)))
    assert logged.dlq_count == 1
    assert sum(r.end - r.start for r in logged.output.ranges) == 2
    # A replay replaces the same record the same way: it matches the log.
    with make_writer(kafka_config, unique_name, output) as writer:
        assert writer.open() == 2
        replay = writer.write(0, table.take([2, 1, 0]), step_letters(0), step_facts(0))
        assert replay.outcome is WriteOutcome.REPLAYED


def test_a_dead_letter_over_the_topic_limit_is_written_truncated(
    bootstrap_servers: str, unique_name: str, kafka_config: KafkaConfig, admin: TopicAdmin
) -> None:
    admin.ensure_topic(dlq_topic(unique_name), 1, {"max.message.bytes": str(SMALL_LIMIT)})
    output = f"{unique_name}.out"
    huge = DeadLetter("input", 0, 7, b"k" * 5_000, b"v" * (2 * SMALL_LIMIT), "x" * 3_000)
    small = DeadLetter("input", 0, 8, b"k", b"not json", "bad JSON")
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        result = writer.write(0, step_table(0), [huge, small], step_facts(0))
        assert result.outcome is WriteOutcome.WRITTEN
        assert result.record.dlq_count == 2
    assert len(read_committed(bootstrap_servers, output)) == 4
    letters = read_committed(bootstrap_servers, dlq_topic(unique_name))
    assert [r.value for r in letters][1] == b"not json"
    truncated = letters[0]
    headers = dict(truncated.headers)
    assert headers[HEADER_SOURCE_TOPIC] == b"input"
    assert headers[HEADER_SOURCE_PARTITION] == b"0"
    assert headers[HEADER_SOURCE_OFFSET] == b"7"
    assert headers[HEADER_VALUE_SIZE] == str(2 * SMALL_LIMIT).encode()
    assert f"{SMALL_LIMIT}-byte limit" in headers[HEADER_REASON].decode()
    assert truncated.key is not None and b"k" * 100 in truncated.key
    assert 0 < len(truncated.value) < SMALL_LIMIT and set(truncated.value) == {ord("v")}
    assert HEADER_VALUE_SIZE not in dict(letters[1].headers)


def test_a_step_log_record_over_the_limit_fails_the_step_as_recurring(
    bootstrap_servers: str, topic_factory, unique_name: str, kafka_config: KafkaConfig
) -> None:
    output = topic_factory("out", config={"max.message.bytes": "1000"})
    facts = step_facts(0)
    wide = StepFacts(
        facts.epoch,
        facts.time,
        tuple(RangeSummary("input", p, 0, 10, 10, f"hash{p}") for p in range(20)),
    )
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        with pytest.raises(RecurringWriteError, match=r"step log record.*1000-byte limit"):
            writer.write(0, step_table(0), [], wide)
        assert writer.status is WriterStatus.READY
        assert writer.next_step == 0
    assert read_committed(bootstrap_servers, output) == []


@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_record_the_broker_refuses_for_its_size_fails_the_step_as_recurring(
    at: int,
    monkeypatch: pytest.MonkeyPatch,
    bootstrap_servers: str,
    topic_factory,
    unique_name: str,
    kafka_config: KafkaConfig,
) -> None:
    output = topic_factory("out", config={"max.message.bytes": str(SMALL_LIMIT)})
    # The fault: a limit read wrong, so the record passes the writer's check.
    monkeypatch.setattr(
        RecordLimit, "read", classmethod(lambda cls, *args: cls(10 * SMALL_LIMIT, "wrong"))
    )
    with make_writer(kafka_config, unique_name, output) as writer:
        writer.open()
        # The refused record first, between others of its partition (which report no
        # delivery: the commit's error names it), or last.
        payloads = [10] * 3
        payloads[at] = 2 * SMALL_LIMIT
        with pytest.raises(RecurringWriteError, match=r"step 0 .*every rerun"):
            writer.write(0, _payload_table(payloads), [], step_facts(0))
        assert writer.status is WriterStatus.READY
    assert read_committed(bootstrap_servers, output) == []


def test_fitting_a_step_is_deterministic_and_everything_it_returns_fits() -> None:
    limit = RecordLimit(5_000, "a test limit")
    records = encode_output(_payload_table([10, 9_000, 20]), ("key",))
    letters = [
        DeadLetter("in", 0, 1, b"k", b"v" * 9_000, "bad"),
        DeadLetter("in", 0, 2, None, None, "a tombstone"),
    ]
    fitted = fit_step(limit, 3, "out", records, letters)
    assert fitted == fit_step(limit, 3, "out", records, letters)
    assert fitted.replaced == 2
    assert [r.key for r in fitted.records] == [b"r0", b"r2"]
    assert [type(d).__name__ for d in fitted.dead_letters] == [
        "DeadLetter",
        "DeadLetter",
        "RejectedOutput",
    ]
    assert fitted.dead_letters[1] == letters[1]
    for letter in fitted.dead_letters:
        assert limit.fits(letter.key, letter.value, letter.headers(3))
    with pytest.raises(RecurringWriteError, match=r"does not fit even truncated"):
        fit_step(RecordLimit(150, "a tiny limit"), 3, "out", records, [])
