"""Pick a lease provider from a URL (for configuration files and command lines)."""

from __future__ import annotations

from ._base import LeaseProvider

__all__ = ["leases_from_url"]


def leases_from_url(url: str, **options: object) -> LeaseProvider:
    """Open the lease provider a URL names.

    * ``memory://`` - :class:`MemoryLeases` (a private in-process store);
    * ``sqlite:///abs/path.db``, ``sqlite://relative.db`` - :class:`SqliteLeases`;
    * ``postgresql://...`` or ``postgres://...`` - :class:`PostgresLeases`;
    * ``redis://...``, ``rediss://...``, ``unix://...`` - :class:`RedisLeases`.

    Args:
        url: The URL.
        **options: Keyword arguments for the provider (``table=``, ``prefix=``...).

    Raises:
        ValueError: Unknown scheme or empty SQLite path.
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ValueError(f"not a lease store URL: {url!r} (expected scheme://...)")
    if scheme == "memory":
        from ._backends._memory import MemoryLeases

        return MemoryLeases(**options)  # type: ignore[arg-type]
    if scheme == "sqlite":
        from ._backends._sqlite import SqliteLeases

        if not rest:
            raise ValueError(f"no database path in {url!r}: use sqlite:///path/to/leases.db")
        return SqliteLeases(rest, **options)  # type: ignore[arg-type]
    if scheme in ("postgresql", "postgres"):
        from ._backends._postgres import PostgresLeases

        return PostgresLeases(url, **options)  # type: ignore[arg-type]
    if scheme in ("redis", "rediss", "unix"):
        from ._backends._redis import RedisLeases

        return RedisLeases(url, **options)  # type: ignore[arg-type]
    raise ValueError(
        f"unknown lease store scheme {scheme!r} in {url!r}: use memory://, sqlite://, "
        "postgresql:// or redis://"
    )
