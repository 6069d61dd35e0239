"""Fleet permits: the permit table every backend keeps, and its reference implementation.

A *group* (``TenantScheduler(name="payments", fleet=provider)``) is a counting semaphore in the
lease store, shared by every process that uses the same store and name: at most ``limit``
permits out, at most ``tenant_limit`` of one tenant, each permit an expiring grant on the
store's clock with a fencing token from the store-wide sequence (the one the leases use, so a
permit's token is larger than every earlier grant's, permit or lease; on a Redis Cluster the
sequence is per hash slot, so there it holds among the group's permits and the leases whose
names share its slot).

State of one group, on the store (nothing at all once the group is idle)::

    permits  token -> (tenant, until)     expiring grants
    passes   tenant -> pass               stride scheduling's virtual time per tenant,
    limits   tenant -> tenant limit       kept only while the tenant holds or wants permits
    demand   tenant -> until              tenants some process is waiting for (expiring, so a
                                          crashed waiter stops counting)
    clock                                 the pass of the latest grant

Three operations, each one atomic step (one round trip) on the store:

``acquire(tenant, want, weight, tenant_limit, limit, most, demand_for, more)``
    Forget expired permits and demand. The tenant's pass is ``max(pass, clock)`` (an idle
    tenant earns no credit; a new one starts at the clock). It is granted up to ``want``
    permits, no more than its tenant limit and the global limit allow, *and* leaving one free
    permit for every other waiting tenant with a smaller pass that is below its own tenant
    limit: so when the fleet is full, a freed permit goes to the tenant furthest behind its
    weighted share, whichever process asks first (the others find it reserved and wait for
    the next release). Each grant sets ``clock = pass`` and adds ``1 / weight`` to the pass.
    If it got fewer than ``want`` (or ``more`` says the caller has other jobs waiting), the
    tenant's demand is registered until ``now + demand_for``; otherwise its demand is removed
    (and if that was a pure withdrawal, ``want == 0``, with permits free, waiters are
    notified: one of them may have yielded to it). Replies with the tokens granted, the
    seconds until the earliest permit or demand expires (when nothing was granted, the
    waiter's wake-up besides notifications), and the running counts (group and tenant).

``release(permits)``
    Remove those of ``(token, tenant)`` still held (not expired); notify the group's waiters
    if any was. Replies with how many were still held.

``extend(permits, most)``
    Set ``until = now + most`` on those still held; replies with the tokens that were not
    (expired, taken over: their jobs must be told).

A tenant with neither permits nor demand is forgotten (its pass and limit), and a group with
neither is deleted, so the store holds nothing per idle tenant. Redis runs the steps as Lua
scripts, PostgreSQL as functions, SQLite as transactions over this module's
:class:`PermitGroup` (as JSON), the memory store directly on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["PermitGroup", "PermitReply", "hub_name"]


def hub_name(group: str) -> str:
    """The wait-hub name a group's waiters watch (its notification channel's name).

    Starts with a NUL so it cannot be the name of a lease a user takes by accident.
    """
    return "\0fleet:" + group


@dataclass(frozen=True, slots=True)
class PermitReply:
    """The store's answer to ``acquire``.

    Attributes:
        tokens: Fencing tokens of the permits granted now (at most ``want``).
        wake_in: Seconds by the store's clock until the earliest permit or demand expires
            (None: nothing expires; wait for a notification). Only meaningful when fewer than
            ``want`` were granted.
        running: Permits out in the group after the call.
        tenant_running: Permits of the caller's tenant out after the call.
    """

    tokens: tuple[int, ...]
    wake_in: float | None
    running: int
    tenant_running: int


class PermitGroup:
    """One group's state and the three operations on it (the reference implementation).

    Not thread-safe: the caller holds the store's lock (memory) or a write transaction
    (SQLite) around each operation.
    """

    __slots__ = ("clock", "demand", "limits", "passes", "permits")

    def __init__(self) -> None:
        self.permits: dict[int, tuple[str, float]] = {}
        self.passes: dict[str, float] = {}
        self.limits: dict[str, int] = {}
        self.demand: dict[str, float] = {}
        self.clock = 0.0

    @property
    def empty(self) -> bool:
        """True when the group holds nothing: the store may delete it."""
        return not self.permits and not self.demand

    # -- serialization (SQLite keeps a group as one JSON document) ------------------------------

    def dumps(self) -> str:
        return json.dumps(
            {
                "p": [[token, tenant, until] for token, (tenant, until) in self.permits.items()],
                "s": self.passes,
                "l": self.limits,
                "d": self.demand,
                "c": self.clock,
            },
            separators=(",", ":"),
        )

    @classmethod
    def loads(cls, text: str | None) -> PermitGroup:
        group = cls()
        if text:
            data: dict[str, Any] = json.loads(text)
            group.permits = {int(t): (str(n), float(u)) for t, n, u in data["p"]}
            group.passes = {str(k): float(v) for k, v in data["s"].items()}
            group.limits = {str(k): int(v) for k, v in data["l"].items()}
            group.demand = {str(k): float(v) for k, v in data["d"].items()}
            group.clock = float(data["c"])
        return group

    # -- the operations --------------------------------------------------------------------------

    def _count(self, tenant: str) -> int:
        return sum(1 for owner, _ in self.permits.values() if owner == tenant)

    def _forget_if_idle(self, tenant: str) -> None:
        if tenant not in self.demand and all(o != tenant for o, _ in self.permits.values()):
            self.passes.pop(tenant, None)
            self.limits.pop(tenant, None)

    def expire(self, now: float) -> None:
        """Forget permits and demand that expired by ``now``."""
        gone = {o for t, (o, until) in list(self.permits.items()) if until <= now}
        if gone:
            self.permits = {t: p for t, p in self.permits.items() if p[1] > now}
        for tenant, until in list(self.demand.items()):
            if until <= now:
                del self.demand[tenant]
                gone.add(tenant)
        for tenant in gone:
            self._forget_if_idle(tenant)

    def acquire(
        self,
        now: float,
        next_token: Callable[[], int],
        tenant: str,
        want: int,
        weight: float,
        tenant_limit: int,
        limit: int,
        most: float,
        demand_for: float,
        more: bool,
    ) -> tuple[PermitReply, bool]:
        """The ``acquire`` step; also whether waiters must be notified."""
        self.expire(now)
        running = len(self.permits)
        mine = self._count(tenant)
        pass_ = max(self.passes.get(tenant, self.clock), self.clock)
        grant = min(want, tenant_limit - mine, limit - running)
        if grant > 0 and self.demand:
            better = 0
            for other in self.demand:
                if (
                    other != tenant
                    and max(self.passes.get(other, self.clock), self.clock) < pass_
                    and self._count(other) < self.limits.get(other, 0)
                ):
                    better += 1
            grant = min(grant, limit - running - better)
        tokens: list[int] = []
        for _ in range(max(0, grant)):
            token = next_token()
            self.permits[token] = (tenant, now + most)
            self.clock = pass_
            pass_ += 1.0 / weight
            tokens.append(token)
        notify = False
        if len(tokens) < want or more:
            self.demand[tenant] = max(self.demand.get(tenant, now), now + demand_for)
            self.limits[tenant] = tenant_limit
        elif self.demand.pop(tenant, None) is not None and want == 0:
            notify = len(self.permits) < limit
        self.passes[tenant] = pass_
        self._forget_if_idle(tenant)
        wake_in = None
        if len(tokens) < want:
            untils = [until for _, until in self.permits.values()]
            untils += [u for other, u in self.demand.items() if other != tenant]
            if untils:
                wake_in = max(0.0, min(untils) - now)
        return (
            PermitReply(tuple(tokens), wake_in, len(self.permits), mine + len(tokens)),
            notify,
        )

    def release(self, now: float, permits: Iterable[tuple[int, str]]) -> int:
        """The ``release`` step: how many of ``permits`` were still held."""
        self.expire(now)
        held = 0
        for token, tenant in permits:
            entry = self.permits.get(token)
            if entry is not None and entry[0] == tenant:
                del self.permits[token]
                held += 1
                self._forget_if_idle(tenant)
        return held

    def extend(self, now: float, permits: Iterable[tuple[int, str]], most: float) -> list[int]:
        """The ``extend`` step: the tokens of ``permits`` no longer held."""
        self.expire(now)
        lost = []
        for token, tenant in permits:
            entry = self.permits.get(token)
            if entry is None or entry[0] != tenant:
                lost.append(token)
            else:
                self.permits[token] = (tenant, now + most)
        return lost
