"""Fixtures of the storage tests: factories of store paths on real disk (``tmp_path``)."""

from __future__ import annotations

from tests.storage.fixtures import store_factory, store_path

__all__ = ["store_factory", "store_path"]
