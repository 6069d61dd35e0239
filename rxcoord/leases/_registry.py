"""The lease backends, by name and URL scheme: adding a backend is one file and one entry here.

A backend module (``rxcoord/leases/_backends/_<name>.py``) implements a :class:`LeaseProvider`
and declares, at its bottom, a :class:`LeaseBackend`: its name, the URL schemes it answers to
and how to build a provider from such a URL. :data:`BACKEND_MODULES` below lists the modules;
:func:`leases_from_url` looks schemes up here, and the test suite runs its contract over
:func:`backends` (each backend also has one entry in the tests' table of throwaway stores,
``tests/leases/conftest.py``, which fails if one is missing).

Backend modules import their optional drivers only when a provider is constructed
(``_drivers.require``), so importing them all here costs nothing and a missing driver surfaces
as the install hint when that backend is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Final

from ._base import LeaseProvider

__all__ = ["BACKEND_MODULES", "LeaseBackend", "backend_for_scheme", "backends", "known_schemes"]

# One entry per backend: the module that declares its ``BACKEND``.
BACKEND_MODULES: Final = (
    "rxcoord.leases._backends._memory",
    "rxcoord.leases._backends._sqlite",
    "rxcoord.leases._backends._postgres",
    "rxcoord.leases._backends._redis",
)


@dataclass(frozen=True, slots=True)
class LeaseBackend:
    """What a backend module declares about itself.

    Attributes:
        name: The provider's ``backend`` (``"memory"``...): the id in stats and tests.
        provider: The provider class.
        schemes: URL schemes (lower case, without ``://``) that open this backend.
        from_url: ``from_url(url, rest, **options)`` -> a new provider, where ``rest`` is the
            URL after ``scheme://``. Raises ``ValueError`` for a URL it cannot use.
        server: Whether the store is a server (tests start a throwaway one, or need its URL).
        notifies: Whether waiters in other processes are woken by the store (else they poll).
        shared: Whether other processes can reach the store at all.
    """

    name: str
    provider: type[LeaseProvider]
    schemes: tuple[str, ...]
    from_url: Callable[..., LeaseProvider]
    server: bool = False
    notifies: bool = True
    shared: bool = True


@cache
def backends() -> tuple[LeaseBackend, ...]:
    """Every registered backend, in registry order.

    Raises:
        RuntimeError: A module declares no ``BACKEND``, or two claim one scheme or name.
    """
    found: list[LeaseBackend] = []
    schemes: dict[str, str] = {}
    for path in BACKEND_MODULES:
        backend = getattr(importlib.import_module(path), "BACKEND", None)
        if not isinstance(backend, LeaseBackend):
            raise RuntimeError(f"lease backend module {path} declares no BACKEND")
        if any(other.name == backend.name for other in found):
            raise RuntimeError(f"two lease backends are named {backend.name!r}")
        for scheme in backend.schemes:
            if scheme in schemes:
                raise RuntimeError(
                    f"URL scheme {scheme!r} is claimed by {schemes[scheme]} and {backend.name}"
                )
            schemes[scheme] = backend.name
        found.append(backend)
    return tuple(found)


def backend_for_scheme(scheme: str) -> LeaseBackend | None:
    """The backend that opens ``scheme://`` URLs (case-insensitive), or None."""
    scheme = scheme.lower()
    for backend in backends():
        if scheme in backend.schemes:
            return backend
    return None


def known_schemes() -> str:
    """The registered schemes, for error messages: ``memory://, sqlite://, ...``."""
    return ", ".join(f"{scheme}://" for backend in backends() for scheme in backend.schemes)
