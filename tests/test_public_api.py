"""Public modules keep ``__all__`` sorted and complete (what they export exists)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import sparkstep


def _modules() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages(sparkstep.__path__, prefix="sparkstep.")
        if not info.name.rsplit(".", 1)[-1].startswith("_")
    )


@pytest.mark.parametrize("name", _modules())
def test_all_is_sorted_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return
    assert list(exported) == sorted(exported), f"{name}.__all__ is not sorted"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.__all__ names {attr}, which does not exist"
