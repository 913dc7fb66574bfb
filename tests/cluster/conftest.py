"""Fixtures of the cluster tests (defined in :mod:`tests.cluster.fixtures`)."""

from tests.cluster.fixtures import spark_standalone

__all__ = ["spark_standalone"]
