"""KeyedLocks: the in-process lock manager (see the modules of this package)."""

from ._facade import KeyedLocks, KeyedLocksStats, Lease

__all__ = ["KeyedLocks", "KeyedLocksStats", "Lease"]
