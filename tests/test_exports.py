"""The curated public API: exactly these names, each importable and documented."""

from __future__ import annotations

import importlib

import pytest

import rxcoord
import rxcoord.operators

EXPECTED_ROOT = {
    "CoordinatorClosed",
    "CoordinatorState",
    "CoordinatorStats",
    "KeyedLocks",
    "KeyedLocksStats",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "LeaseNotHeld",
    "LeaseProviderClosed",
    "LeaseReleasedError",
    "LeaseStoreMisconfigured",
    "LeaseStoreUnavailable",
    "LockTimeout",
    "RxcoordError",
    "SchedulerStats",
    "StaleToken",
    "TenantScheduler",
    "TenantTaskCoordinator",
    "TooManyTasks",
    "__version__",
    "serialize_by_key",
}


def test_root_exports_exactly_the_curated_names() -> None:
    assert set(rxcoord.__all__) == EXPECTED_ROOT


def test_operators_module_exports() -> None:
    assert rxcoord.operators.__all__ == ["serialize_by_key"]


@pytest.mark.parametrize("module_name", ["rxcoord", "rxcoord.operators"])
def test_every_exported_name_exists_and_is_documented(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if name.startswith("__"):
            continue
        assert obj.__doc__, f"{module_name}.{name} has no docstring"
        assert obj.__module__.startswith("rxcoord."), f"{name} is defined outside rxcoord"


def test_public_objects_come_from_private_modules() -> None:
    for name in rxcoord.__all__:
        obj = getattr(rxcoord, name)
        if hasattr(obj, "__module__"):
            parts = obj.__module__.split(".")[1:]
            assert any(p.startswith("_") for p in parts), (
                f"{name} lives in public module {obj.__module__}"
            )


def test_package_is_typed() -> None:
    from importlib.resources import files

    assert files("rxcoord").joinpath("py.typed").is_file()
