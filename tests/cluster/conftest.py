"""Fixtures of the cluster tests (defined in :mod:`tests.cluster.fixtures`)."""

from tests.cluster.fixtures import spark_standalone, state_host_factory

__all__ = ["spark_standalone", "state_host_factory"]
