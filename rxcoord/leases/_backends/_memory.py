"""In-process leases: the reference implementation of the contract, for tests and one process.

The store is a dict guarded by a lock; its clock (``time.monotonic`` unless given) decides
expiry. Every release goes through the store, so it wakes waiters of every provider attached to
it directly: the hub is authoritative and nobody polls.

Nothing is left behind: a record exists only while its name is taken. A release (outside
``at_least_for``) deletes it at once; records that expired are swept when the dict has doubled
since the last sweep, or by the first grant a second after the last one (amortized O(1) per
grant). Tokens come from one store-wide counter, so
they keep increasing per name however often its record is deleted; they live as long as the
store object. Fleet groups whose permits, demand and rate buckets have all expired (nobody called
them since) are dropped by the next permit step at most once a second.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any as _Any

from .._base import LeaseProvider
from .._listing import LeaseEntry, StoreListing, group_entry
from .._notify import WaitHub
from .._permits import PermitGroup, PermitReply, hub_name

__all__ = ["MemoryLeaseStore", "MemoryLeaseStoreStats", "MemoryLeases"]

_SWEEP_EVERY = 1.0  # store-clock seconds between time-based sweeps of expired records


@dataclass(frozen=True, slots=True)
class MemoryLeaseStoreStats:
    """A snapshot of a :class:`MemoryLeaseStore`.

    Attributes:
        names: Names with a record: taken, or expired and not swept yet (see the module
            docstring); 0 once every lease was released.
        held: Names whose lease is currently unexpired (released ones inside ``at_least_for``
            included: they are still taken).
        providers: Open providers attached to the store.
    """

    names: int
    held: int
    providers: int


class _Record:
    __slots__ = ("least", "released", "token", "until")

    def __init__(self, token: int) -> None:
        self.token = token
        self.until = float("-inf")
        self.least = float("-inf")
        self.released = False


class MemoryLeaseStore:
    """A lease store in this process's memory, shareable by several :class:`MemoryLeases`.

    Args:
        clock: Seconds on a monotonic clock; the store's clock decides expiry. Pass a fake
            clock to test expiry logic without sleeping (waiting still uses real time).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._last_token = 0  # store-wide: every grant of any name takes the next one
        self._sweep_at = 64  # sweep expired records when the dict reaches this size...
        self._sweep_after = clock() + _SWEEP_EVERY  # ...or, on a grant, once this has passed
        self._hubs: weakref.WeakSet[WaitHub] = weakref.WeakSet()
        self._groups: dict[str, PermitGroup] = {}  # fleet permits, one entry per busy group
        self._groups_sweep_after = clock() + _SWEEP_EVERY

    def attach(self, hub: WaitHub) -> None:
        with self._lock:
            self._hubs.add(hub)

    def detach(self, hub: WaitHub) -> None:
        with self._lock:
            self._hubs.discard(hub)

    def stats(self) -> MemoryLeaseStoreStats:
        """A consistent snapshot of the store."""
        with self._lock:
            now = self.clock()
            held = sum(1 for record in self._records.values() if record.until > now)
            return MemoryLeaseStoreStats(len(self._records), held, len(self._hubs))

    def try_grant(self, name: str, most: float, least: float) -> tuple[int, float]:
        with self._lock:
            now = self.clock()
            record = self._records.get(name)
            if record is not None and record.until > now:
                return 0, record.until - now
            self._last_token += 1
            if record is None:
                if len(self._records) >= self._sweep_at or now >= self._sweep_after:
                    self._sweep(now)
                record = self._records[name] = _Record(self._last_token)
            record.token = self._last_token
            record.until = now + most
            record.least = now + least
            record.released = False
            return record.token, 0.0

    def _sweep(self, now: float) -> None:
        """Drop expired records (under the lock); the next sweep when the dict has doubled."""
        expired = [name for name, record in self._records.items() if record.until <= now]
        for name in expired:
            del self._records[name]
        self._sweep_at = max(64, 2 * len(self._records))
        self._sweep_after = now + _SWEEP_EVERY

    def holder(self, name: str) -> tuple[int, float, bool] | None:
        with self._lock:
            now = self.clock()
            record = self._records.get(name)
            if record is None or record.until <= now:
                return None
            return record.token, record.until - now, record.released

    def extend(self, name: str, token: int, most: float) -> bool:
        with self._lock:
            now = self.clock()
            record = self._records.get(name)
            if record is None or not _owned(record, token, now):
                return False
            record.until = max(record.least, now + most)
            return True

    def release(self, name: str, token: int) -> bool:
        with self._lock:
            now = self.clock()
            record = self._records.get(name)
            if record is None or not _owned(record, token, now):
                return False
            if record.least > now:
                record.until = record.least  # still taken until at_least_for has passed
                record.released = True
            else:
                del self._records[name]
        self._notify(name)
        return True

    # -- fleet permits (the reference table of _permits.py, under the store's lock) -------------

    def _next_token(self) -> int:
        self._last_token += 1
        return self._last_token

    def _notify(self, name: str) -> None:
        with self._lock:
            hubs = list(self._hubs)
        for hub in hubs:
            hub.notify(name)

    def permits_acquire(self, group: str, *args: _Any, **rates: _Any) -> PermitReply:
        with self._lock:
            table = self._groups.get(group) or PermitGroup()
            reply, notify = table.acquire(self.clock(), self._next_token, *args, **rates)
            self._keep(group, table)
            self._sweep_groups(reply.at)
        if notify:
            self._notify(hub_name(group))
        return reply

    def permits_release(self, group: str, permits: Sequence[tuple[int, str]]) -> int:
        with self._lock:
            table = self._groups.get(group)
            if table is None:
                return 0
            held = table.release(self.clock(), permits)
            self._keep(group, table)
        if held:
            self._notify(hub_name(group))
        return held

    def permits_extend(
        self, group: str, permits: Sequence[tuple[int, str]], most: float
    ) -> list[int]:
        with self._lock:
            table = self._groups.get(group)
            if table is None:
                return [token for token, _ in permits]
            lost = table.extend(self.clock(), permits, most)
            self._keep(group, table)
        return lost

    def listing(self) -> StoreListing:
        """What the store holds now: unexpired leases and busy groups (read-only)."""
        with self._lock:
            now = self.clock()
            leases = tuple(
                LeaseEntry(name, record.token, record.until - now, record.released)
                for name, record in sorted(self._records.items())
                if record.until > now
            )
            groups = [
                group_entry(name, now, table.permits.values(), table.limits, table.demand)
                for name, table in sorted(self._groups.items())
            ]
        return StoreListing(
            "memory",
            leases,
            tuple(g for g in groups if g is not None),
            holders=False,
            waiter_marks=False,
        )

    def permit_groups(self) -> int:
        """Groups with state in the store (0 once every group is idle)."""
        with self._lock:
            return len(self._groups)

    def _keep(self, group: str, table: PermitGroup) -> None:
        if table.empty:
            self._groups.pop(group, None)
        else:
            self._groups[group] = table

    def _sweep_groups(self, now: float) -> None:
        """Drop groups whose permits, demand and rate buckets have all expired (nobody called
        them since: a crashed fleet), at most every ``_SWEEP_EVERY`` (lock held)."""
        if now < self._groups_sweep_after:
            return
        self._groups_sweep_after = now + _SWEEP_EVERY
        for name in [name for name, table in self._groups.items() if table.expires <= now]:
            del self._groups[name]


def _owned(record: _Record, token: int, now: float) -> bool:
    return record.token == token and not record.released and record.until > now


class MemoryLeases(LeaseProvider):
    """Leases held in this process: the contract without a server (tests, single process).

    Args:
        store: The store to use; providers given the same store compete for the same names.
            A new private store by default.
    """

    backend = "memory"

    def __init__(self, store: MemoryLeaseStore | None = None) -> None:
        self.store = store if store is not None else MemoryLeaseStore()
        hub = WaitHub(authoritative=True)
        super().__init__(hub, poll=(0.001, 0.05))
        self.store.attach(hub)

    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        return self.store.try_grant(name, at_most_for, at_least_for)

    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        return self.store.extend(name, token, at_most_for)  # never blocks: no timeout needed

    def _store_release(
        self, name: str, token: int, *, timeout: float | None = None, kept: bool = True
    ) -> bool:
        return self.store.release(name, token)

    def _store_holder(self, name: str) -> tuple[int, float, bool] | None:
        return self.store.holder(name)

    def _store_close(self) -> None:
        self.store.detach(self._hub)

    def _store_list(self) -> StoreListing:
        return self.store.listing()

    def _permits_acquire(self, group: str, *args: _Any, **rates: _Any) -> PermitReply:
        return self.store.permits_acquire(group, *args, **rates)

    def _permits_release(
        self, group: str, permits: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> int:
        return self.store.permits_release(group, permits)

    def _permits_extend(
        self,
        group: str,
        permits: Sequence[tuple[int, str]],
        most: float,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        return self.store.permits_extend(group, permits, most)


# -- registry entry (see rxcoord/leases/_registry.py) ------------------------------------------
# Kept in one block with its imports, so that a backend's registration reads as one unit.

from typing import Final as _Final  # noqa: E402

from .._registry import LeaseBackend  # noqa: E402


def _from_url(url: str, rest: str, **options: _Any) -> MemoryLeases:
    """``memory://``: a provider with a private in-process store."""
    return MemoryLeases(**options)


BACKEND: _Final = LeaseBackend(
    name="memory", provider=MemoryLeases, schemes=("memory",), from_url=_from_url, shared=False
)
