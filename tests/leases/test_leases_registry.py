"""The backend registry: a backend is one module declaring ``BACKEND`` plus one registry entry."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rxcoord.leases import LeaseProvider, MemoryLeases, SqliteLeases, leases_from_url
from rxcoord.leases import _registry as registry
from rxcoord.leases._registry import LeaseBackend, backend_for_scheme, backends

from .conftest import STORES, VARIANTS


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """The registry re-read from BACKEND_MODULES (which the test may patch), then restored."""
    registry.backends.cache_clear()
    try:
        yield
    finally:
        registry.backends.cache_clear()


def test_every_backend_declares_itself() -> None:
    names = [entry.name for entry in backends()]
    assert names == ["memory", "sqlite", "postgres", "redis"]
    for entry in backends():
        assert entry.provider.backend == entry.name
        for scheme in entry.schemes:
            assert backend_for_scheme(scheme) is entry
            assert backend_for_scheme(scheme.upper()) is entry


def test_the_suite_opens_a_store_of_every_registered_backend() -> None:
    # The contract runs over the registry; each backend needs a throwaway store to run on.
    # (plus test variants of a registered backend, such as RedisLeases on a Redis Cluster)
    assert set(STORES) == {entry.name for entry in backends()} | set(VARIANTS)
    assert set(VARIANTS.values()) <= {entry.name for entry in backends()}


def test_urls_open_their_backend(tmp_path: Path) -> None:
    with leases_from_url("MEMORY://") as memory:
        assert isinstance(memory, MemoryLeases)
    with leases_from_url(f"sqlite://{tmp_path / 'a.db'}") as sqlite:
        assert isinstance(sqlite, SqliteLeases)
        assert sqlite.path == str(tmp_path / "a.db")


def test_an_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown lease store scheme 'mongodb'") as raised:
        leases_from_url("mongodb://db.example/leases")
    message = str(raised.value)
    for entry in backends():
        for scheme in entry.schemes:
            assert f"{scheme}://" in message
    with pytest.raises(ValueError, match="not a lease store URL"):
        leases_from_url("leases.db")
    with pytest.raises(ValueError, match="no database path"):
        leases_from_url("sqlite://")


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("postgresql://127.0.0.1/x", "psycopg", "postgres"),
        ("redis://127.0.0.1:1/0", "redis", "redis"),
    ],
)
def test_a_missing_driver_says_which_extra_installs_it(
    monkeypatch: pytest.MonkeyPatch, url: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'rxcoord\[{extra}\]'"):
        leases_from_url(url)


def _declare(monkeypatch: pytest.MonkeyPatch, path: str, backend: object | None) -> None:
    """A backend module at ``path`` declaring ``backend``, appended to the registry."""
    module = types.ModuleType(path)
    if backend is not None:
        module.BACKEND = backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, path, module)
    monkeypatch.setattr(registry, "BACKEND_MODULES", (*registry.BACKEND_MODULES, path))


def test_a_new_backend_is_one_module_and_one_entry(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    opened: list[tuple[str, str, dict[str, Any]]] = []

    def from_url(url: str, rest: str, **options: Any) -> LeaseProvider:
        opened.append((url, rest, options))
        return MemoryLeases()

    entry = LeaseBackend(name="fake", provider=MemoryLeases, schemes=("fake",), from_url=from_url)
    _declare(monkeypatch, "_rxcoord_test_fake_backend", entry)
    with leases_from_url("fake://somewhere", option=1) as leases:
        assert isinstance(leases, MemoryLeases)
    assert opened == [("fake://somewhere", "somewhere", {"option": 1})]
    with pytest.raises(ValueError, match="fake://"):
        leases_from_url("nope://")


def test_two_backends_claiming_one_scheme_is_an_error(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    clash = LeaseBackend(
        name="other", provider=MemoryLeases, schemes=("redis",), from_url=MemoryLeases
    )
    _declare(monkeypatch, "_rxcoord_test_clashing_backend", clash)
    with pytest.raises(RuntimeError, match="'redis' is claimed by redis and other"):
        backends()


def test_a_module_without_a_declaration_is_an_error(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _declare(monkeypatch, "_rxcoord_test_undeclared_backend", None)
    with pytest.raises(RuntimeError, match="declares no BACKEND"):
        backends()
