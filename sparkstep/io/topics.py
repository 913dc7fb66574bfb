"""Topic administration: existence, partitions, cleanup policy, offsets, retention, group offsets.

Everything here is a bounded request to the cluster through one ``AdminClient``: each call
waits at most :attr:`KafkaConfig.timeout_s <sparkstep.io.config.KafkaConfig.timeout_s>` and then
raises :class:`~sparkstep.io.errors.KafkaUnavailableError`; nothing retries forever. Listing
offsets retries, within that bound, the partitions whose leadership the broker is still settling
(a topic just created, a leader just moved: ``UNKNOWN_LEADER_EPOCH`` and its kin), since the same
request succeeds moments later.

Offsets (``TopicPartitionKey = (topic, partition)``):

- ``"earliest"``: the log start offset (the first offset retention has not deleted);
- ``"stable"``: the last stable offset (LSO), asked with ``IsolationLevel.READ_COMMITTED``: the
  first offset of the oldest open transaction, or the high watermark if none is open. Input
  divisions end at most here; the high watermark (the default answer of ``list_offsets``) may
  lie inside an open transaction whose records could still be aborted.
- ``"latest"``: the high watermark.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, TypeVar

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import (
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
)
from confluent_kafka.admin._listoffsets import OffsetSpec
from confluent_kafka.admin._metadata import ClusterMetadata, TopicMetadata
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewTopic

from sparkstep.io.config import KafkaConfig, kafka_error_of, translate_kafka_error
from sparkstep.io.errors import (
    CompactedTopicError,
    KafkaUnavailableError,
    MissingTopicError,
    StreamIOError,
)

__all__ = [
    "KEEP_EVERY_RECORD",
    "OffsetKind",
    "TopicAdmin",
    "TopicPartitionKey",
    "consumer_group_id",
]

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]
OffsetKind = Literal["earliest", "latest", "stable"]

_T = TypeVar("_T")

#: The settings under which a topic (with ``cleanup.policy=delete``) deletes no record, by age
#: or by size.
KEEP_EVERY_RECORD = {"retention.ms": "-1", "retention.bytes": "-1"}


#: Errors of a partition whose leadership the broker is still settling: a topic just created (a
#: KRaft broker answers for it before it has applied its own partition record) or a leader just
#: moved. The same request succeeds moments later.
_LEADERSHIP_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.OFFSET_NOT_AVAILABLE,
    }
)

#: The pause before a settling partition's offsets are asked again.
_SETTLING_BACKOFF_S = 0.1


def consumer_group_id(name: str) -> str:
    """The consumer group whose offsets pipeline ``name`` commits at checkpoints (lag tools)."""
    return f"sparkstep.{name}"


class TopicAdmin:
    """Bounded administrative requests against one cluster (see the module docstring)."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self._admin = AdminClient(config.admin())

    # -- plumbing -------------------------------------------------------------------------

    def _result(self, future: concurrent.futures.Future[_T], action: str) -> _T:
        try:
            return future.result(timeout=self.config.timeout_s + 5.0)
        except concurrent.futures.TimeoutError as exc:
            raise KafkaUnavailableError(
                f"{action} failed: no answer from {self.config.bootstrap_servers} within "
                f"{self.config.timeout_s:.0f}s; check that the broker runs"
            ) from exc
        except KafkaException as exc:
            raise translate_kafka_error(exc, action, self.config) from exc

    def wait_until_reachable(self) -> None:
        """Return once the cluster answers a metadata request; retries until ``timeout_s``."""
        deadline = time.monotonic() + self.config.timeout_s
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                metadata = self._admin.list_topics(timeout=min(remaining, 5.0))
                if metadata.brokers:
                    return
            except KafkaException as exc:
                last = exc
            time.sleep(0.2)
        raise KafkaUnavailableError(
            f"the Kafka cluster at {self.config.bootstrap_servers} did not answer within "
            f"{self.config.timeout_s:.0f}s ({last}); check that the broker runs and "
            "--bootstrap-servers/--kafka-config are right"
        )

    # -- topics ---------------------------------------------------------------------------

    def _metadata(self, topic: str) -> tuple[ClusterMetadata, TopicMetadata]:
        """``(cluster metadata, topic metadata)`` of ``topic``; :class:`MissingTopicError` if it
        has no partitions."""
        try:
            metadata = self._admin.list_topics(topic=topic, timeout=self.config.timeout_s)
        except KafkaException as exc:
            raise translate_kafka_error(
                exc, f"reading the metadata of topic {topic}", self.config
            ) from exc
        info = metadata.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            raise MissingTopicError(
                f"topic {topic} does not exist on {self.config.bootstrap_servers}: create it "
                "(e.g. kafka-topics.sh --create) or check the topic name"
            )
        return metadata, info

    def partitions(self, topic: str) -> list[int]:
        """The partition numbers of ``topic``, sorted; :class:`MissingTopicError` if none."""
        return sorted(self._metadata(topic)[1].partitions)

    def exists(self, topic: str) -> bool:
        """Whether ``topic`` exists."""
        try:
            self.partitions(topic)
        except MissingTopicError:
            return False
        return True

    def ensure_topic(
        self, topic: str, partitions: int = 1, config: Mapping[str, str] | None = None
    ) -> bool:
        """Create ``topic`` with ``partitions`` and ``config`` unless it exists; True if created.

        An existing topic is left as it is (its configuration is checked by the callers that
        care, e.g. :meth:`refuse_compacted`). Replication is the cluster's default.
        """
        if self.exists(topic):
            return False
        new = NewTopic(topic, num_partitions=partitions, config=dict(config or {}))
        futures = self._admin.create_topics([new], request_timeout=self.config.timeout_s)
        try:
            self._result(futures[topic], f"creating topic {topic}")
        except StreamIOError as exc:
            cause = kafka_error_of(exc.__cause__) if exc.__cause__ is not None else None
            if cause is not None and cause.code() == cause.TOPIC_ALREADY_EXISTS:
                return False  # created concurrently by someone else: fine
            raise
        log.info("created topic %s with %d partition(s) %s", topic, partitions, config or {})
        self._wait_until_known(topic)
        return True

    def delete_topic(self, topic: str) -> bool:
        """Delete ``topic`` and wait (bounded) until the cluster no longer lists it; True if it
        existed. A topic that does not exist (or is deleted concurrently) is not an error."""
        if not self.exists(topic):
            return False
        futures = self._admin.delete_topics([topic], request_timeout=self.config.timeout_s)
        try:
            self._result(futures[topic], f"deleting topic {topic}")
        except StreamIOError as exc:
            cause = kafka_error_of(exc.__cause__) if exc.__cause__ is not None else None
            if cause is None or cause.code() != cause.UNKNOWN_TOPIC_OR_PART:
                raise
        deadline = time.monotonic() + self.config.timeout_s
        while self.exists(topic):  # deletion completes asynchronously on the brokers
            if time.monotonic() >= deadline:
                raise KafkaUnavailableError(
                    f"topic {topic} is still listed {self.config.timeout_s:.0f}s after its "
                    "deletion; check the broker's delete.topic.enable and its log"
                )
            time.sleep(0.1)
        log.info("deleted topic %s", topic)
        return True

    def _wait_until_known(self, topic: str) -> None:
        """Wait (bounded) until a new topic answers metadata and configuration requests."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                self.partitions(topic)
                self.topic_config(topic)
                return
            except MissingTopicError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def topic_config(self, topic: str) -> dict[str, str]:
        """The effective configuration of ``topic`` (``cleanup.policy``, ``retention.ms``...)."""
        return {name: value for name, (value, _) in self._config_entries(topic).items()}

    def topic_overrides(self, topic: str) -> dict[str, str]:
        """The settings made on ``topic`` itself (at creation or altered), not inherited from
        the broker's defaults."""
        return {
            name: value
            for name, (value, source) in self._config_entries(topic).items()
            if source == ConfigSource.DYNAMIC_TOPIC_CONFIG
        }

    def _config_entries(self, topic: str) -> dict[str, tuple[str, ConfigSource]]:
        """Each set configuration entry of ``topic``: its value and where the value comes from."""
        resource = ConfigResource(ResourceType.TOPIC, topic)
        futures = self._admin.describe_configs([resource], request_timeout=self.config.timeout_s)
        entries = self._result(futures[resource], f"describing the configuration of {topic}")
        # describe_configs gives the source as a plain int, despite its annotation.
        return {
            name: (entry.value, ConfigSource(entry.source))
            for name, entry in entries.items()
            if entry.value is not None
        }

    def alter_topic_config(self, topic: str, settings: Mapping[str, str]) -> None:
        """Set ``settings`` on ``topic`` (other settings stay as they are)."""
        resource = ConfigResource(
            ResourceType.TOPIC,
            topic,
            incremental_configs=[
                ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
                for name, value in sorted(settings.items())
            ],
        )
        futures = self._admin.incremental_alter_configs(
            [resource], request_timeout=self.config.timeout_s
        )
        self._result(futures[resource], f"altering the configuration of {topic}")
        log.info("set %s on topic %s", dict(settings), topic)

    def replication(self, topic: str) -> tuple[int, int]:
        """``(replicas, brokers)``: the fewest replicas of any partition of ``topic``, and the
        number of brokers in the cluster."""
        metadata, info = self._metadata(topic)
        return min(len(p.replicas) for p in info.partitions.values()), len(metadata.brokers)

    def refuse_compacted(self, topics: Iterable[str], role: str) -> None:
        """Raise :class:`CompactedTopicError` if any topic's ``cleanup.policy`` has ``compact``.

        ``role`` ("input", "output") goes into the message: compaction can remove input records
        inside a range that is not replayed yet, and would drop output retractions.
        """
        for topic in topics:
            policy = self.topic_config(topic).get("cleanup.policy", "delete")
            if "compact" in policy.split(","):
                raise CompactedTopicError(
                    f"{role} topic {topic} has cleanup.policy={policy}: compaction can remove "
                    f"records sparkstep must still read or keep; use cleanup.policy=delete"
                )

    # -- offsets --------------------------------------------------------------------------

    def offsets(
        self, partitions: Iterable[TopicPartitionKey], kind: OffsetKind
    ) -> dict[TopicPartitionKey, int]:
        """The ``kind`` offset of each topic-partition (see the module docstring)."""
        keys = list(partitions)
        if not keys:
            return {}
        # OffsetSpec ships without annotations.
        spec: OffsetSpec = (
            OffsetSpec.earliest() if kind == "earliest" else OffsetSpec.latest()  # type: ignore[no-untyped-call]
        )
        isolation = (
            IsolationLevel.READ_COMMITTED if kind == "stable" else IsolationLevel.READ_UNCOMMITTED
        )
        return self._list_offsets(keys, spec, isolation, f"listing the {kind} offsets")

    def offsets_for_time(
        self, partitions: Iterable[TopicPartitionKey], timestamp_ms: int
    ) -> dict[TopicPartitionKey, int]:
        """Per partition, the first offset whose timestamp is >= ``timestamp_ms`` (or the end)."""
        keys = list(partitions)
        if not keys:
            return {}
        return self._list_offsets(
            keys,
            OffsetSpec.for_timestamp(timestamp_ms),
            IsolationLevel.READ_UNCOMMITTED,
            f"listing offsets for time {timestamp_ms}",
        )

    def _list_offsets(
        self,
        keys: Sequence[TopicPartitionKey],
        spec: OffsetSpec,
        isolation: IsolationLevel,
        action: str,
    ) -> dict[TopicPartitionKey, int]:
        """The offset ``spec`` names for each of ``keys``.

        A partition whose answer is a settling-leadership error (``_LEADERSHIP_SETTLING``) is
        asked again after a short pause until ``timeout_s`` has passed since the first request;
        then its last error is raised like any other (translated, naming the partition). Any
        other error is raised at once.
        """
        deadline = time.monotonic() + self.config.timeout_s
        out: dict[TopicPartitionKey, int] = {}
        pending = list(keys)
        while pending:
            request = {TopicPartition(topic, partition): spec for topic, partition in pending}
            futures = self._admin.list_offsets(
                request, isolation_level=isolation, request_timeout=self.config.timeout_s
            )
            pending = []
            for tp, future in futures.items():
                key = (tp.topic, tp.partition)
                what = f"{action} of {tp.topic}[{tp.partition}]"
                try:
                    out[key] = int(self._result(future, what).offset)
                except StreamIOError as exc:
                    error = kafka_error_of(exc.__cause__) if exc.__cause__ else None
                    if error is None or error.code() not in _LEADERSHIP_SETTLING:
                        raise
                    if time.monotonic() >= deadline:
                        raise
                    log.debug("%s: %s; asking again", what, error.str())
                    pending.append(key)
            if pending:
                time.sleep(_SETTLING_BACKOFF_S)
        return out

    # -- checkpoint-time duties -----------------------------------------------------------

    def commit_group_offsets(self, group_id: str, offsets: Mapping[TopicPartitionKey, int]) -> None:
        """Commit ``offsets`` (the next offset to read) for ``group_id``, for lag tools only.

        sparkstep never reads these back: its position is the step log and the manifest. The
        consumer used here never joins the group (no subscribe), it only commits.
        """
        if not offsets:
            return
        consumer = Consumer(self.config.consumer(group_id))
        try:
            tps = [TopicPartition(t, p, off) for (t, p), off in sorted(offsets.items())]
            consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException as exc:
            raise translate_kafka_error(
                exc, f"committing the offsets of consumer group {group_id}", self.config
            ) from exc
        finally:
            consumer.close()

    def size_retention_warnings(self, topics: Iterable[str]) -> list[str]:
        """Warn (and return the warnings) for each input topic with a finite ``retention.bytes``:
        Kafka then deletes a partition's oldest records once it holds that many bytes, whether
        a checkpoint covers them or not (which offsets that reaches is not known in advance, so
        unlike :meth:`retention_warnings` this is said once, when the runtime starts)."""
        warnings = []
        for topic in sorted(set(topics)):
            size = int(self.topic_config(topic).get("retention.bytes", "-1"))
            if size >= 0:
                warnings.append(
                    f"input topic {topic} has retention.bytes={size}: Kafka deletes a partition's "
                    "oldest records past that size even if they are not checkpointed yet, and "
                    "recovery then fails; use retention.bytes=-1 and bound the topic by "
                    "retention.ms"
                )
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def retention_warnings(
        self,
        checkpointed: Mapping[TopicPartitionKey, int],
        now_ms: int | None = None,
        margin: float = 0.5,
    ) -> list[str]:
        """Warn (and return the warnings) where retention could delete input not checkpointed.

        ``checkpointed`` maps each input partition to the first offset NOT yet in a checkpoint:
        recovery replays from there, so Kafka must keep it. A warning is given when

        - the partition's log start is already past it (input needed for recovery is gone), or
        - the records at it are older than ``margin`` x ``retention.ms`` (a slow checkpoint
          interval or a stalled pipeline will let retention delete them).

        Topics with ``retention.ms=-1`` keep everything and are not checked by age.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        warnings: list[str] = []
        keys = sorted(checkpointed)
        earliest = self.offsets(keys, "earliest")
        for key in keys:
            if earliest[key] > checkpointed[key]:
                warnings.append(
                    f"input {key[0]}[{key[1]}] offsets {checkpointed[key]}..{earliest[key]} were "
                    "deleted by retention before they were checkpointed: recovery cannot replay "
                    "them; raise retention.ms or checkpoint more often"
                )
        by_topic: dict[str, list[TopicPartitionKey]] = {}
        for key in keys:
            by_topic.setdefault(key[0], []).append(key)
        for topic, topic_keys in sorted(by_topic.items()):
            retention_ms = int(self.topic_config(topic).get("retention.ms", "-1"))
            if retention_ms < 0:
                continue
            horizon = now - int(retention_ms * margin)
            first_young = self.offsets_for_time(topic_keys, horizon)
            ends = self.offsets(topic_keys, "latest")
            for key in topic_keys:
                # -1: no record is as young as the horizon, so all of them are older.
                young = first_young[key] if first_young[key] >= 0 else ends[key]
                if earliest[key] <= checkpointed[key] < young:
                    warnings.append(
                        f"input {key[0]}[{key[1]}] offsets {checkpointed[key]}..{young} are older "
                        f"than {margin:.0%} of retention.ms={retention_ms} and not checkpointed: "
                        "retention may delete them before the next checkpoint"
                    )
        for warning in warnings:
            log.warning("%s", warning)
        return warnings
