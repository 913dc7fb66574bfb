"""Fixtures of the rescale tests (defined in :mod:`tests.runtime.driver.fixtures` and
:mod:`tests.runtime.worker.fixtures`)."""

from tests.runtime.driver.fixtures import harness_factory, runtime_factory
from tests.runtime.worker.fixtures import module_dir, token_file, worker_factory

__all__ = ["harness_factory", "module_dir", "runtime_factory", "token_file", "worker_factory"]
