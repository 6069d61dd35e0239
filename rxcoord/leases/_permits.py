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
    rates    tenant -> (tat, tolerance)   a tenant's rate bucket (GCRA, ``_core/rate.py``),
    group    (tat, tolerance)             and the group's, kept only until full again

Three operations, each one atomic step (one round trip) on the store:

``acquire(tenant, want, weight, tenant_limit, limit, most, demand_for, more, rate, tenant_rate)``
    Forget expired permits, demand and full rate buckets. The tenant's pass is ``max(pass,
    clock)`` (an idle tenant earns no credit; a new one starts at the clock). It is granted up
    to ``want`` permits, no more than its tenant limit and the global limit allow, no more than
    the group's ``rate`` and its own ``tenant_rate`` have tokens for now (``(interval, burst)``
    each, or None), *and* leaving one free permit (and group token) for every other waiting
    tenant with a smaller pass that is below its own tenant limit and within its own rate
    now: so when the fleet is full, a freed permit goes to the tenant furthest behind its
    weighted share, whichever process asks first (the others find it reserved and wait for
    the next release), while a tenant waiting for its own rate reserves nothing (it never
    holds back a tenant within its rate). Each grant sets ``clock = pass``, adds ``1 /
    weight`` to the pass and takes a token of each rate, at the store's ``now``: the grant is
    the start the rates count, in the same atomic step as the permit.
    If it got fewer than ``want`` (or ``more`` says the caller has other jobs waiting), the
    tenant's demand is registered until ``now + demand_for``; otherwise its demand is removed
    (and if that was a pure withdrawal, ``want == 0``, with permits free, waiters are
    notified: one of them may have yielded to it). Replies with the tokens granted, the
    seconds until the earliest permit or demand expires (when nothing was granted, the
    waiter's wake-up besides notifications, and the next group token beyond those reserved
    for tenants further behind), the running counts (group and tenant), and when fewer than
    ``want`` were granted, the seconds until the rates allow this tenant its next start (and
    the group's rate alone allows anybody one): the waiter sleeps until then, it never polls.
    A tenant's rate tolerance is recorded with its bucket, so other callers can tell whether
    it is within its rate.

``release(permits)``
    Remove those of ``(token, tenant)`` still held (not expired); notify the group's waiters
    if any was. Replies with how many were still held.

``extend(permits, most)``
    Set ``until = now + most`` on those still held; replies with the tokens that were not
    (expired, taken over: their jobs must be told).

A tenant with neither permits nor demand is forgotten (its pass and limit), its rate bucket
once full again (``tat <= now``: the same as a fresh one), and a group with neither permits,
demand nor a bucket still filling is deleted, so the store holds nothing per idle tenant.
Every group also records when everything in it will have expired (``expires``: the latest
permit, demand and bucket), so a store can sweep groups nobody calls any more (a crashed
fleet): Redis by key expiry, PostgreSQL and SQLite by deleting such rows now and then.
Redis runs the steps as Lua scripts, PostgreSQL as functions, SQLite as transactions over
this module's :class:`PermitGroup` (as JSON), the memory store directly on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rxcoord._core import rate as gcra

__all__ = ["PermitGroup", "PermitReply", "RateArgs", "hub_name", "rate_args"]

#: A rate as the stores take it: ``(interval in seconds, burst)``.
RateArgs = tuple[float, int]


def rate_args(rate: Any) -> RateArgs | None:
    """An ``rxcoord.Rate`` (or None) as the stores take it."""
    return None if rate is None else (float(rate.interval), int(rate.burst))


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
        rate_wait: Seconds by the store's clock until the rates allow the tenant its next
            start (0.0: now, or no rates). Only meaningful when fewer than ``want`` were
            granted.
        group_rate_wait: Seconds until the group's rate allows anybody a start (0.0: now).
        at: The store's clock at the step, in seconds (the permits' grant time: the start
            the rates counted).
    """

    tokens: tuple[int, ...]
    wake_in: float | None
    running: int
    tenant_running: int
    rate_wait: float = 0.0
    group_rate_wait: float = 0.0
    at: float = 0.0


class PermitGroup:
    """One group's state and the three operations on it (the reference implementation).

    Not thread-safe: the caller holds the store's lock (memory) or a write transaction
    (SQLite) around each operation.
    """

    __slots__ = ("clock", "demand", "group_rate", "limits", "passes", "permits", "rates")

    def __init__(self) -> None:
        self.permits: dict[int, tuple[str, float]] = {}
        self.passes: dict[str, float] = {}
        self.limits: dict[str, int] = {}
        self.demand: dict[str, float] = {}
        self.clock = 0.0
        self.rates: dict[str, tuple[float, float]] = {}  # tenant -> (tat, tolerance)
        self.group_rate: tuple[float, float] | None = None  # the group's (tat, tolerance)

    @property
    def empty(self) -> bool:
        """True when the group holds nothing (after :meth:`expire`): the store may delete it."""
        return not self.permits and not self.demand and not self.rates and not self.group_rate

    @property
    def expires(self) -> float:
        """When everything in the group will have expired, if nobody calls (-inf: empty)."""
        times = [until for _, until in self.permits.values()]
        times += self.demand.values()
        times += (tat for tat, _ in self.rates.values())
        if self.group_rate is not None:
            times.append(self.group_rate[0])
        return max(times, default=-math.inf)

    # -- serialization (SQLite keeps a group as one JSON document) ------------------------------

    def dumps(self) -> str:
        return json.dumps(
            {
                "p": [[token, tenant, until] for token, (tenant, until) in self.permits.items()],
                "s": self.passes,
                "l": self.limits,
                "d": self.demand,
                "c": self.clock,
                "r": {tenant: list(state) for tenant, state in self.rates.items()},
                "g": None if self.group_rate is None else list(self.group_rate),
                # When it all expires, read by a store's sweep (SQLite: json_extract).
                "x": expires if math.isfinite(expires := self.expires) else None,
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
            group.rates = {str(k): (float(t), float(w)) for k, (t, w) in data.get("r", {}).items()}
            if data.get("g") is not None:
                group.group_rate = (float(data["g"][0]), float(data["g"][1]))
        return group

    # -- the operations --------------------------------------------------------------------------

    def _count(self, tenant: str) -> int:
        return sum(1 for owner, _ in self.permits.values() if owner == tenant)

    def _forget_if_idle(self, tenant: str) -> None:
        if tenant not in self.demand and all(o != tenant for o, _ in self.permits.values()):
            self.passes.pop(tenant, None)
            self.limits.pop(tenant, None)

    def _within_rate(self, tenant: str, now: float) -> bool:
        """Whether ``tenant``'s own rate (as its bucket recorded it) allows a start now."""
        state = self.rates.get(tenant)
        return state is None or state[0] - state[1] <= now + gcra.EPSILON

    def expire(self, now: float) -> None:
        """Forget permits and demand that expired by ``now``, and buckets full again."""
        self.rates = {t: state for t, state in self.rates.items() if state[0] > now}
        if self.group_rate is not None and self.group_rate[0] <= now:
            self.group_rate = None
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
        rate: RateArgs | None = None,
        tenant_rate: RateArgs | None = None,
    ) -> tuple[PermitReply, bool]:
        """The ``acquire`` step; also whether waiters must be notified."""
        self.expire(now)
        running = len(self.permits)
        mine = self._count(tenant)
        pass_ = max(self.passes.get(tenant, self.clock), self.clock)
        group_tat = -math.inf if self.group_rate is None else self.group_rate[0]
        tenant_tat = -math.inf if tenant not in self.rates else self.rates[tenant][0]
        free = limit - running
        if rate is not None:
            free = min(free, gcra.available(group_tat, now, *rate))
        grant = min(want, tenant_limit - mine, free)
        if tenant_rate is not None:
            grant = min(grant, gcra.available(tenant_tat, now, *tenant_rate))
        better = 0
        if grant > 0 and self.demand:
            for other in self.demand:
                if (
                    other != tenant
                    and max(self.passes.get(other, self.clock), self.clock) < pass_
                    and self._count(other) < self.limits.get(other, 0)
                    and self._within_rate(other, now)
                ):
                    better += 1
            grant = min(grant, free - better)
        tokens: list[int] = []
        for _ in range(max(0, grant)):
            token = next_token()
            self.permits[token] = (tenant, now + most)
            self.clock = pass_
            pass_ += 1.0 / weight
            tokens.append(token)
        if rate is not None and tokens:
            group_tat = gcra.take(group_tat, now, rate[0], len(tokens))
            self.group_rate = (group_tat, (rate[1] - 1) * rate[0])
        if tenant_rate is not None and tokens:
            tenant_tat = gcra.take(tenant_tat, now, tenant_rate[0], len(tokens))
            self.rates[tenant] = (tenant_tat, (tenant_rate[1] - 1) * tenant_rate[0])
        notify = False
        if len(tokens) < want or more:
            self.demand[tenant] = max(self.demand.get(tenant, now), now + demand_for)
            self.limits[tenant] = tenant_limit
        elif self.demand.pop(tenant, None) is not None and want == 0:
            notify = len(self.permits) < limit
        self.passes[tenant] = pass_
        self._forget_if_idle(tenant)
        wake_in = None
        rate_wait = group_wait = 0.0
        if len(tokens) < want:
            untils = [until for _, until in self.permits.values()]
            untils += [u for other, u in self.demand.items() if other != tenant]
            if untils:
                wake_in = max(0.0, min(untils) - now)
            if rate is not None:
                group_wait = gcra.wait(group_tat, now, *rate)
                # The next group token nobody further behind has a claim on.
                beyond = gcra.wait(group_tat, now, rate[0], rate[1], better + 1)
                if beyond > 0 and (wake_in is None or beyond < wake_in):
                    wake_in = beyond
            rate_wait = group_wait
            if tenant_rate is not None:
                rate_wait = max(rate_wait, gcra.wait(tenant_tat, now, *tenant_rate))
        return (
            PermitReply(
                tuple(tokens),
                wake_in,
                len(self.permits),
                mine + len(tokens),
                rate_wait,
                group_wait,
                now,
            ),
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
