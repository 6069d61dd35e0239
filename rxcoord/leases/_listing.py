"""What a lease store holds right now, as ``rxcoord inspect`` shows it: the listing records.

Each backend answers one read-only primitive, ``LeaseProvider._store_list()``, with a
:class:`StoreListing`: the unexpired leases (name, fencing token, seconds left by the store's
clock, released early but kept by ``at_least_for``, the holder the store recorded, whether a
waiter marked the lease) and the busy fleet groups (permits out per tenant, each tenant's
recorded limit, which tenants some process is waiting for). Nothing is written, created or
swept; a store whose tables or keys do not exist yet lists nothing.

What a store does not keep is None rather than a guess: a holder's identity (Redis and memory
record none), waiter marks (only PostgreSQL marks a lease a waiter is waiting for), and a
fleet group's overall limit, which every process passes with each call and no store keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["GroupEntry", "LeaseEntry", "StoreListing", "TenantEntry", "group_entry"]


@dataclass(frozen=True, slots=True)
class LeaseEntry:
    """One unexpired lease.

    Attributes:
        name: The lease name.
        token: The fencing token of the current grant.
        expires_in: Seconds until it expires, by the store's clock.
        released: Released early, kept taken by ``at_least_for`` until it expires.
        holder: Who took it, as the store recorded it (``host:pid``), or None if the store
            records no holder.
        waited: Whether a waiter marked it (its release will notify), or None if the store
            marks no waiters (waiters are woken otherwise, or poll).
    """

    name: str
    token: int
    expires_in: float
    released: bool
    holder: str | None = None
    waited: bool | None = None


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One tenant of a busy fleet group.

    Attributes:
        tenant: The tenant, as the scheduler names it in the store.
        running: Permits it holds (unexpired).
        limit: Its tenant limit, recorded while it waits for permits (None otherwise).
        demand: Whether some process is waiting for permits for it.
    """

    tenant: str
    running: int
    limit: int | None
    demand: bool


@dataclass(frozen=True, slots=True)
class GroupEntry:
    """One busy fleet group (a ``TenantScheduler(name=..., fleet=...)``).

    Attributes:
        name: The group's name.
        running: Permits out in the group (unexpired), every tenant's.
        tenants: The tenants holding or wanting permits, by name.
        next_expiry: Seconds until its earliest permit expires (None: no permit out).
    """

    name: str
    running: int
    tenants: tuple[TenantEntry, ...]
    next_expiry: float | None


@dataclass(frozen=True, slots=True)
class StoreListing:
    """A read-only snapshot of a lease store.

    Attributes:
        backend: ``memory``, ``sqlite``, ``postgres`` or ``redis``.
        leases: Unexpired leases, by name.
        groups: Busy fleet groups, by name.
        holders: Whether the store records who holds a lease.
        waiter_marks: Whether the store marks leases that waiters wait for.
    """

    backend: str
    leases: tuple[LeaseEntry, ...]
    groups: tuple[GroupEntry, ...]
    holders: bool
    waiter_marks: bool


def group_entry(
    name: str,
    now: float,
    permits: Iterable[tuple[str, float]],
    limits: Mapping[str, int],
    demand: Mapping[str, float],
) -> GroupEntry | None:
    """A group's entry from its permit table (``_permits.py``), read without changing it.

    Args:
        name: The group.
        now: The store's clock, in the unit of the ``until`` times.
        permits: ``(tenant, until)`` of every permit recorded.
        limits: Tenant limits recorded with their demand.
        demand: ``tenant -> until`` of the registered demand.

    Returns:
        The entry, or None when everything in it has expired (the group is idle).
    """
    running: dict[str, int] = {}
    soonest: float | None = None
    for tenant, until in permits:
        if until > now:
            running[tenant] = running.get(tenant, 0) + 1
            soonest = until if soonest is None else min(soonest, until)
    wanting = {tenant for tenant, until in demand.items() if until > now}
    if not running and not wanting:
        return None
    tenants = tuple(
        TenantEntry(
            tenant,
            running.get(tenant, 0),
            limits.get(tenant) if tenant in wanting else None,
            tenant in wanting,
        )
        for tenant in sorted(set(running) | wanting)
    )
    return GroupEntry(
        name,
        sum(running.values()),
        tenants,
        None if soonest is None else max(0.0, soonest - now),
    )
