"""Key guards: exclusion of a keyed job's key beyond its own coordinator.

A coordinator orders the jobs of one key inside itself. When several coordinators (in several
processes) serve the same keys, each keyed job must also hold something that excludes the
others: a key guard. The coordinator knows nothing about what that is; it enters the guard on
the job's thread (or task) right before the job runs and exits it once the job's work has
ended, including the awaitable a sync job may return::

    token = guard.enter(key)        # blocking, on the job's worker thread
    try: result = job()
    finally: guard.exit(token)      # raises if exclusion was lost meanwhile

:class:`LeaseKeyGuard` is the guard behind ``TenantTaskCoordinator(leases=provider)``: a
distributed lease per key, kept alive while the job runs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Protocol

from ._core.checks import check_length, check_name

if TYPE_CHECKING:
    from .leases import DistributedLease, LeaseProvider

__all__ = ["KeyGuard", "LeaseKeyGuard"]


class KeyGuard(Protocol):
    """Cross-coordinator exclusion for keyed jobs (thread-safe; see the module docstring)."""

    def enter(self, key: Hashable) -> Any:
        """Block until ``key`` is exclusively ours; a token for :meth:`exit`."""

    def exit(self, token: Any) -> None:
        """Give the key up; raises if exclusion was lost while the job ran."""

    async def enter_async(self, key: Hashable) -> Any:
        """:meth:`enter` for a job on an asyncio loop (never blocks the loop)."""

    async def exit_async(self, token: Any) -> None:
        """:meth:`exit` for a job on an asyncio loop."""


class LeaseKeyGuard:
    """A distributed lease named ``"<prefix>:<key>"`` per keyed job, kept alive while it runs.

    Exiting releases the lease, raising :class:`~rxcoord.LeaseLost` if it expired meanwhile
    (the job's work may have overlapped another holder's).

    Args:
        provider: The lease provider (``rxcoord.leases``).
        prefix: The first part of every lease name: the coordinator's ``name``. It must not
            be empty: every coordinator without a name would take the same lease names
            (``":<key>"``) on a shared store, excluding each other's keys by accident.
        at_most_for: ``at_most_for`` of each lease, in seconds (kept alive while the job runs).

    Raises:
        TypeError: ``provider`` is not a lease provider, ``prefix`` not a str, or
            ``at_most_for`` not a number.
        ValueError: ``prefix`` is empty (the message says to pass ``name=`` to the
            coordinator), or ``at_most_for`` is not a finite number > 0.
    """

    __slots__ = ("_at_most_for", "_prefix", "_provider")

    def __init__(self, provider: LeaseProvider, prefix: str, at_most_for: float) -> None:
        from .leases import LeaseProvider

        if not isinstance(provider, LeaseProvider):
            raise TypeError(
                f"leases must be a lease provider such as rxcoord.leases.SqliteLeases(...) "
                f"or leases_from_url(url), not {provider!r}"
            )
        if not check_name(prefix, "name"):
            # Checked here, where lease names are made, so every way to a LeaseKeyGuard
            # (leases=, or one built by hand) is refused alike, as fleet= refuses no name.
            raise ValueError(
                "leases= needs a name: pass name='orders' (a non-empty str) to the "
                "coordinator, whose keyed jobs then hold leases named 'orders:<key>'; without "
                "one, every unnamed coordinator on the store would share the names ':<key>'"
            )
        self._provider = provider
        self._prefix = prefix
        self._at_most_for = check_length(at_most_for, "lease_at_most_for")

    def _name(self, key: Hashable) -> str:
        return f"{self._prefix}:{key!s}"

    def enter(self, key: Hashable) -> DistributedLease:
        return self._provider.acquire(self._name(key), self._at_most_for, keep_alive=True)

    def exit(self, token: DistributedLease) -> None:
        token.release()

    async def enter_async(self, key: Hashable) -> DistributedLease:
        return await self._provider.acquire_async(
            self._name(key), self._at_most_for, keep_alive=True
        )

    async def exit_async(self, token: DistributedLease) -> None:
        await token.release_async()
