"""Divisions: LSO (not the high watermark), contiguity, shares, new partitions, compaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewPartitions, NewTopic
from hypothesis import given
from hypothesis import strategies as st

from sparkstep.errors import ConfigError
from sparkstep.ids import Step
from sparkstep.io.config import KafkaConfig
from sparkstep.io.division import (
    Division,
    DivisionOptions,
    DivisionPlanner,
    PartitionRange,
    allocate_shares,
)
from sparkstep.io.errors import CompactedTopicError, InputRewoundError, MissingTopicError
from sparkstep.io.topics import TopicAdmin, TopicPartitionKey

from .fixtures import TxnInput, high_watermark


@given(
    st.dictionaries(
        st.tuples(st.sampled_from("abc"), st.integers(0, 5)), st.integers(0, 50), max_size=8
    ),
    st.integers(1, 200),
)
def test_shares_fill_the_budget_without_exceeding_what_is_there(available, budget) -> None:
    shares = allocate_shares(available, budget)
    assert set(shares) == set(available)
    assert all(0 <= shares[k] <= available[k] for k in available)
    assert sum(shares.values()) == min(budget, sum(available.values()))
    assert allocate_shares(dict(reversed(list(available.items()))), budget) == shares
    # Even: no partition gets two more than another that still had input left.
    hungry = [k for k in available if shares[k] < available[k]]
    for k in hungry:
        assert all(shares[j] <= shares[k] + 1 for j in available)


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        DivisionOptions(topics=())
    with pytest.raises(ConfigError):
        DivisionOptions(topics=("t",), max_records_per_step=0)
    with pytest.raises(ValueError):
        PartitionRange("t", 0, 5, 4)


def _until_stable(planner: DivisionPlanner, expected: dict[tuple[str, int], int]) -> None:
    """Wait until the LSOs are ``expected``: commit_transaction returns before the markers are
    written, and the LSO passes a transaction only once they are (a new partition also reaches
    the metadata a moment after create_partitions returns)."""
    deadline = time.monotonic() + 30
    while True:
        stable = planner.stable_offsets()
        if all(stable.get(key) == offset for key, offset in expected.items()):
            return
        assert time.monotonic() < deadline, f"LSOs {stable}, expected {expected}"
        time.sleep(0.1)


def test_divisions_are_contiguous_and_stop_at_the_lso(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in", partitions=2)
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"a%d" % i for i in range(10)], partition=0)  # 0..9 + marker: LSO 11
    txn.batch([b"b%d" % i for i in range(3)], partition=1)  # LSO 4
    planner = DivisionPlanner(
        kafka_config, DivisionOptions(topics=(topic,), max_records_per_step=8)
    )
    planner.check_inputs()
    _until_stable(planner, {(topic, 0): 11, (topic, 1): 4})
    d0 = planner.plan(None)
    assert d0.step == 0
    assert d0.ranges == (PartitionRange(topic, 0, 0, 4), PartitionRange(topic, 1, 0, 4))
    d1 = planner.plan(d0)
    assert d1.step == 1
    assert d1.ranges == (PartitionRange(topic, 0, 4, 11), PartitionRange(topic, 1, 4, 4))
    # A producer holds a transaction open: the division never reaches into it.
    other = TxnInput(bootstrap_servers, topic)
    other.batch([b"open%d" % i for i in range(5)], partition=0, keep_open=True)
    txn.batch([b"late%d" % i for i in range(5)], partition=0)  # committed, after the open one
    assert high_watermark(bootstrap_servers, topic, 0) == 22
    d2 = planner.plan(d1)
    assert d2.ranges[0] == PartitionRange(topic, 0, 11, 11)
    assert d2.is_empty
    cancel = threading.Event()
    assert not planner.wait_for_input(d2, cancel, timeout_s=0.5)
    other.finish(commit=False)
    assert planner.wait_for_input(d2, cancel, timeout_s=30)
    _until_stable(planner, {(topic, 0): 23})
    d3 = planner.plan(d2)
    assert d3.ranges[0].start == 11
    assert d3.ranges[0].end == 19  # the budget of 8 offsets
    d4 = planner.plan(d3)
    assert d4.ranges[0].end == 23  # past the aborted transaction and both markers: the LSO


def test_step_zero_from_latest_and_partitions_added_later(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in", partitions=1)
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"old%d" % i for i in range(4)])
    planner = DivisionPlanner(kafka_config, DivisionOptions(topics=(topic,), start_from="latest"))
    _until_stable(planner, {(topic, 0): 5})
    d0 = planner.plan(None)
    assert d0.ranges == (PartitionRange(topic, 0, 5, 5),)
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_partitions([NewPartitions(topic, 2)])[topic].result(timeout=30)
    TxnInput(bootstrap_servers, topic).batch([b"new%d" % i for i in range(2)], partition=1)
    _until_stable(planner, {(topic, 1): 3})
    d1 = planner.plan(d0)
    assert d1.ranges == (PartitionRange(topic, 0, 5, 5), PartitionRange(topic, 1, 0, 3))


def test_wait_for_input_is_cancellable(topic_factory, kafka_config: KafkaConfig) -> None:
    topic = topic_factory("in")
    planner = DivisionPlanner(kafka_config, DivisionOptions(topics=(topic,)))
    d0 = planner.plan(None)
    cancel = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(planner.wait_for_input(d0, cancel)))
    waiter.start()
    cancel.set()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert result == [False]


def test_wait_for_input_wakes_when_input_arrives(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    """Between its offset checks the wait listens at the division's ends: a record committed
    there ends it long before the next check would (the checks are 10 minutes apart here)."""
    checked = threading.Event()

    class Observed(DivisionPlanner):
        """The real planner; only tells when an offsets check has found nothing."""

        def has_input_after(self, ends: Mapping[TopicPartitionKey, int]) -> bool:
            found = super().has_input_after(ends)
            if not found:
                checked.set()
            return found

    topic = topic_factory("in")
    planner = Observed(kafka_config, DivisionOptions(topics=(topic,)))
    d0 = planner.plan(None)
    cancel = threading.Event()
    result: list[bool] = []

    def wait() -> None:
        result.append(planner.wait_for_input(d0, cancel, poll_interval_s=600))

    waiter = threading.Thread(target=wait)
    waiter.start()
    # The first check found nothing, so only the listening can end the wait before the next.
    assert checked.wait(timeout=60)
    assert waiter.is_alive()
    TxnInput(bootstrap_servers, topic).batch([b"arrives"])
    waiter.join(timeout=60)
    cancel.set()
    assert not waiter.is_alive(), "the wait slept to its next offsets check"
    assert result == [True]
    # The listening consumer is released, and a later wait makes a new one.
    planner.close()
    assert planner.wait_for_input(d0, threading.Event(), timeout_s=30)
    planner.close()


def test_compacted_and_missing_inputs_are_refused(topic_factory, kafka_config: KafkaConfig) -> None:
    compacted = topic_factory("in", config={"cleanup.policy": "compact"})
    with pytest.raises(CompactedTopicError, match=compacted):
        DivisionPlanner(kafka_config, DivisionOptions(topics=(compacted,))).check_inputs()
    with pytest.raises(MissingTopicError, match="no-such-topic"):
        DivisionPlanner(kafka_config, DivisionOptions(topics=("no-such-topic",))).check_inputs()


def test_division_invariants() -> None:
    with pytest.raises(ValueError):
        Division(
            step=Step(0),
            ranges=(PartitionRange("t", 1, 0, 1), PartitionRange("t", 0, 0, 1)),
            time=None,  # type: ignore[arg-type]
        )


def _recreate(bootstrap: str, topic: str, partitions: int) -> None:
    """Delete ``topic`` and create it again with ``partitions``; wait until its metadata says
    so (deletion and creation both complete asynchronously)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(timeout=30)
    deadline = time.monotonic() + 60
    while True:
        try:
            admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)
            break
        except Exception:  # the old topic is still being deleted
            assert time.monotonic() < deadline, f"topic {topic} was not recreated"
            time.sleep(0.2)
    topics = TopicAdmin(KafkaConfig(bootstrap, timeout_s=30))
    while True:
        try:
            if topics.partitions(topic) == list(range(partitions)):
                return
        except MissingTopicError:
            pass
        assert time.monotonic() < deadline, f"topic {topic} did not come back"
        time.sleep(0.2)


def test_a_recreated_input_topic_stops_with_what_happened(
    bootstrap_servers: str, topic_factory, kafka_config: KafkaConfig
) -> None:
    topic = topic_factory("in", partitions=2)
    txn = TxnInput(bootstrap_servers, topic)
    txn.batch([b"a%d" % i for i in range(6)], partition=0)  # LSO 7
    txn.batch([b"b%d" % i for i in range(2)], partition=1)  # LSO 3
    planner = DivisionPlanner(kafka_config, DivisionOptions(topics=(topic,)))
    _until_stable(planner, {(topic, 0): 7, (topic, 1): 3})
    d0 = planner.plan(None)
    assert d0.ends() == {(topic, 0): 7, (topic, 1): 3}
    planner.check_ends(d0.ends())
    # The same name again, with less input than the logged steps read.
    _recreate(bootstrap_servers, topic, 2)
    TxnInput(bootstrap_servers, topic).batch([b"c0", b"c1"], partition=0)
    _until_stable(planner, {(topic, 0): 3})
    expected = rf"input {topic}\[0\] now holds offsets 0..3, below offset 7 .*recreated"
    with pytest.raises(InputRewoundError, match=expected) as info:
        planner.plan(d0)
    assert isinstance(info.value, ConfigError)  # the runtime exits as misconfigured
    with pytest.raises(InputRewoundError, match=expected):
        planner.wait_for_input(d0, threading.Event())
    with pytest.raises(InputRewoundError, match=expected):
        planner.check_ends(d0.ends())
    # Fewer partitions than the logged steps read.
    _recreate(bootstrap_servers, topic, 1)
    with pytest.raises(InputRewoundError, match=rf"{topic}\[1\] no longer exists"):
        planner.check_ends({(topic, 1): 3})
