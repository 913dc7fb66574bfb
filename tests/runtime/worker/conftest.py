"""Fixtures of the worker tests (defined in :mod:`tests.runtime.worker.fixtures`)."""

from tests.runtime.worker.fixtures import module_dir, token_file, worker_factory

__all__ = ["module_dir", "token_file", "worker_factory"]
