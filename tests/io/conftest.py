"""Fixtures of the Kafka layer's tests (on the session broker of tests/conftest.py)."""

from __future__ import annotations

import pytest

from sparkstep.io.config import KafkaConfig
from sparkstep.io.topics import TopicAdmin


@pytest.fixture
def kafka_config(bootstrap_servers: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers, timeout_s=20.0)


@pytest.fixture
def admin(kafka_config: KafkaConfig) -> TopicAdmin:
    return TopicAdmin(kafka_config)
