"""Pick a lease provider from a URL (for configuration files and command lines).

The schemes are the backends' own declarations, looked up in the registry (``_registry.py``).
"""

from __future__ import annotations

from ._base import LeaseProvider
from ._registry import backend_for_scheme, known_schemes

__all__ = ["leases_from_url"]


def leases_from_url(url: str, **options: object) -> LeaseProvider:
    """Open the lease provider a URL names.

    * ``memory://`` - :class:`MemoryLeases` (a private in-process store);
    * ``sqlite:///abs/path.db`` (``sqlite://`` then an absolute path) - :class:`SqliteLeases`;
    * ``postgresql://...`` or ``postgres://...`` - :class:`PostgresLeases`;
    * ``redis://...``, ``rediss://...``, ``unix://...`` - :class:`RedisLeases`.

    Args:
        url: The URL.
        **options: Keyword arguments for the provider (``table=``, ``prefix=``...).

    Raises:
        ValueError: Unknown scheme (the message lists the known ones), or an SQLite URL
            without an absolute path (``sqlite://rel.db``; the message shows the right form).
        LeaseStoreMisconfigured: As the provider's constructor (an SQLite file in a directory
            that does not exist or cannot be written).
        ImportError: The backend's driver is missing (the message says which extra to
            install: ``pip install 'rxcoord[postgres]'``).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a lease store URL: {url!r} (expected scheme://...)")
    backend = backend_for_scheme(scheme)
    if backend is None:
        raise ValueError(
            f"unknown lease store scheme {scheme.lower()!r} in {url!r}: use {known_schemes()}"
        )
    return backend.from_url(url, rest, **options)
