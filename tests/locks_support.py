"""Helpers shared by the KeyedLocks tests."""

from __future__ import annotations

from collections.abc import Hashable

from rxcoord import KeyedLocks
from rxcoord._errors import LockTimeout


def is_free(locks: KeyedLocks, key: Hashable) -> bool:
    """True if a try-lock on ``key`` succeeds right now (and it is released at once)."""
    try:
        with locks.hold(key, timeout=0):
            return True
    except LockTimeout:
        return False
