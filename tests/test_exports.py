"""The curated public API: derived from the modules, never copied by hand, and kept stable.

* each package's ``__all__`` is exactly what its ``__init__`` imports from private modules
  (read from the source, so adding a name means adding one import line);
* every exported object is documented and defined in a private module;
* everything 0.1 exported is still importable from where it was (the compatibility promise).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import rxcoord
import rxcoord.kafka
import rxcoord.leases
import rxcoord.operators

PACKAGES = [rxcoord, rxcoord.kafka, rxcoord.leases, rxcoord.operators]

# What rxcoord 0.1 exported: these names must stay importable from these modules.
API_0_1 = {
    "rxcoord": [
        "CoordinatorClosed", "CoordinatorState", "CoordinatorStats", "KeyedLocks",
        "KeyedLocksStats", "Lease", "LeaseError", "LeaseLost", "LeaseProviderClosed",
        "LeaseReleasedError", "LeaseStoreUnavailable", "LockTimeout", "RxcoordError",
        "SchedulerStats", "StaleToken", "TenantScheduler", "TenantTaskCoordinator",
        "TooManyTasks", "__version__", "serialize_by_key",
    ],
    "rxcoord.operators": ["serialize_by_key"],
    "rxcoord.leases": [
        "DistributedLease", "FencingGuard", "FencingGuardStats", "LeaseError", "LeaseLost",
        "LeaseProvider", "LeaseProviderClosed", "LeaseProviderStats", "LeaseStats",
        "LeaseStoreUnavailable", "LockTimeout", "MemoryLeaseStore", "MemoryLeaseStoreStats",
        "MemoryLeases", "PostgresLeases", "RedisLeases", "SqliteLeases", "StaleToken",
        "leases_from_url",
    ],
}  # fmt: skip


def _imported_names(package: ModuleType) -> set[str]:
    """The public names ``package/__init__.py`` imports from rxcoord's own modules."""
    assert package.__file__ is not None
    tree = ast.parse(Path(package.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        source = node.module or ""
        if node.level > 0 or source.startswith("rxcoord"):  # rxcoord's own modules only
            names.update(alias.asname or alias.name for alias in node.names)
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_exports_are_exactly_what_init_imports(package: ModuleType) -> None:
    """``__all__`` is derived from the imports: nothing imported is left out, nothing extra."""
    exported = set(package.__all__) - {"__version__"}
    assert exported == _imported_names(package)


def _defined(obj: object) -> bool:
    """A class or function (a type alias such as ``OnError`` has no module or docstring)."""
    return inspect.isclass(obj) or inspect.isfunction(obj)


@pytest.mark.parametrize("module_name", sorted(API_0_1))
def test_everything_0_1_exported_is_still_there(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in API_0_1[module_name]:
        assert name in module.__all__, f"{module_name}.{name} is no longer exported"
        assert hasattr(module, name)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_every_exported_name_exists_and_is_documented(package: ModuleType) -> None:
    for name in package.__all__:
        obj = getattr(package, name)
        if name.startswith("__") or not _defined(obj):
            continue
        assert obj.__doc__, f"{package.__name__}.{name} has no docstring"
        assert obj.__module__.startswith("rxcoord."), f"{name} is defined outside rxcoord"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.__name__)
def test_public_objects_come_from_private_modules(package: ModuleType) -> None:
    for name in package.__all__:
        obj = getattr(package, name)
        if _defined(obj):
            parts = obj.__module__.split(".")[1:]
            assert any(p.startswith("_") for p in parts), (
                f"{name} lives in public module {obj.__module__}"
            )


def test_all_is_unique() -> None:
    for package in PACKAGES:
        assert len(set(package.__all__)) == len(package.__all__)


def test_package_is_typed() -> None:
    from importlib.resources import files

    assert files("rxcoord").joinpath("py.typed").is_file()


def test_the_rate_policy_is_public() -> None:
    """One policy class for every layer (``TenantScheduler(rate=...)``, fleets, coordinators),
    with the statistics its admissions report."""
    for name in ("Rate", "RateStats"):
        assert name in rxcoord.__all__
        assert getattr(rxcoord, name).__module__ == "rxcoord._rate"
