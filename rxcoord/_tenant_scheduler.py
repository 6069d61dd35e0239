"""TenantScheduler: many tenants, one global limit, fair shares, idle tenants evicted.

Composition, not subclassing: each tenant gets a plain ``TenantTaskCoordinator`` of its own,
so everything a coordinator promises holds per tenant (its concurrency limit, ``TooManyTasks``
beyond its queue, keyed order, cancellation, timeouts, async jobs). The tenants' coordinators
are built with three seams, all public or plainly internal:

* ``admission=`` one lane of the scheduler's :class:`~rxcoord._admission.FairShareGate`: when
  a tenant's job would start it asks for one of the ``max_concurrency`` global permits, and
  waits (counted as queued, its timeout not yet running) until it gets one;
* ``scheduler=`` the scheduler's worker pool, shared by all tenants;
* ``on_idle=`` the scheduler's eviction check.

Rates (``rate=`` for all tenants, ``tenant_rate=`` per tenant) are inside the same gate (or,
with ``fleet=``, the same store step): a job over a rate waits as a ticket, holding no global
slot, and a tenant waiting for its own rate sleeps outside the fair-share heap, so it never
holds back a tenant within its rate.

Fairness is the gate's stride scheduling over job starts (see ``FairShareGate``): a tenant
that becomes runnable again starts from the current virtual time, so being idle earns no credit
and a returning tenant cannot monopolise the slots. A flooding tenant therefore delays another
tenant's next job by at most one job per competing tenant: its flood waits in its own
coordinator's queue, not at the gate (each tenant has at most ``tenant_max_concurrency`` jobs
there).

Memory does not grow with tenants that went quiet: when a tenant's work in progress drops to
zero and stays there for ``idle_timeout`` seconds, its coordinator is closed and forgotten, and
its counters are folded into the scheduler's totals. Submissions pin their tenant while they
enter it, so eviction can never close a coordinator under a job that is being submitted.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, overload

from loguru import logger
from reactivex import abc
from reactivex.disposable import Disposable

from ._admission import FairShareGate
from ._coordinator import CoordinatorStats, Execution, TenantTaskCoordinator
from ._coordinator._execution import execution
from ._coordinator._facade import Overflow
from ._core import telemetry
from ._core.checks import (
    check_count,
    check_deadline,
    check_delay,
    check_hashable,
    check_name,
    check_overflow,
    check_weight,
)
from ._core.clock import clock_for
from ._core.lifecycle import Closeable, CoordinatorState
from ._core.retry import Retry
from ._core.timer import TimerHandle, call_later
from ._core.workers import WorkerPool
from ._errors import CoordinatorClosed
from ._fleet import FleetAdmission, FleetStats
from ._rate import Rate, TenantRates, check_rate, check_tenant_rates, rate_of

if TYPE_CHECKING:
    from .leases import LeaseProvider

__all__ = ["SchedulerStats", "TenantScheduler"]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

Weights = Mapping[Hashable, float] | Callable[[Hashable], float]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Totals over all tenants: live ones (sum of their snapshots) and evicted ones.

    ``running`` counts jobs holding a global slot (never more than ``max_concurrency``);
    ``queued`` counts jobs accepted and not yet running, in tenants' queues or at the gate;
    ``waiting`` submissions beyond their tenant's limits waiting for room (``overflow="wait"``);
    ``retrying`` jobs waiting for their next attempt, ``retries`` attempts beyond the first.
    ``fleet``: with ``fleet=``, the fleet admission's snapshot: fleet-wide running counts (in
    total and per tenant) as last seen from the store.
    """

    tenants: int
    evicted: int
    submitted: int
    completed: int
    failed: int
    rejected: int
    cancelled: int
    timed_out: int
    queued: int
    running: int
    max_concurrency: int
    waiting: int = 0
    fleet: FleetStats | None = None
    retries: int = 0
    retrying: int = 0

    @property
    def work_in_progress(self) -> int:
        """Jobs queued, running or waiting for their next attempt."""
        return self.queued + self.running + self.retrying


class _Tenant:
    """A live tenant: its coordinator and the scheduler's bookkeeping for eviction."""

    __slots__ = ("coordinator", "idle_since", "idle_timer", "pins", "tenant")

    def __init__(self, tenant: Hashable) -> None:
        self.tenant = tenant
        self.coordinator: TenantTaskCoordinator
        self.pins = 0  # submissions entering this coordinator right now (scheduler's lock)
        self.idle_since = 0.0
        self.idle_timer: TimerHandle | None = None


class TenantScheduler(Closeable):
    """Runs jobs of many tenants under per-tenant limits, one global limit and fair sharing.

    ``execute(tenant, job)`` has the contract of :meth:`TenantTaskCoordinator.execute`, per
    tenant: each tenant runs at most ``tenant_max_concurrency`` jobs and queues at most
    ``tenant_max_queue_size`` more (``TooManyTasks`` beyond), with keyed order, cancellation,
    timeouts and async jobs. Across tenants at most ``max_concurrency`` jobs run at once; when
    that is the bottleneck, a free slot goes to the tenant furthest behind its weighted share
    of job starts (stride scheduling; round robin for equal weights), so a flooding tenant
    delays another tenant by about one job per competing tenant, never by its flood.

    A tenant's state is dropped once it has no queued or running work for ``idle_timeout``
    seconds (0: at once), so tenants that went quiet cost no memory. ``stats(tenant)`` is that
    tenant's current snapshot (zeros once evicted); ``stats()`` the totals, evicted tenants
    included.

    Args:
        max_concurrency: Most jobs running at once across all tenants (the only positional
            parameter; the others are keyword-only).
        tenant_max_concurrency: Most jobs of one tenant running (or waiting for a global slot).
        tenant_max_queue_size: Most jobs of one tenant queued beyond those.
        scheduler: Where sync jobs run; ``None`` for ``max_concurrency`` owned worker threads.
        timeout: Default per-job timeout in seconds, counted from the job's start; ``None``
            (or ``inf``) for none.
        weights: Tenant -> weight (a finite number > 0; default 1), as a mapping (checked
            here) or a callable (checked on the tenant's first job, which fails if it is bad).
        idle_timeout: Seconds a tenant stays idle before its state is dropped (0: at once,
            ``inf``: never).
        name: Names the scheduler in logs and thread names; with ``fleet``, the name the fleet
            shares (required).
        overflow: ``"reject"`` (``TooManyTasks`` beyond a tenant's limits, the default) or
            ``"wait"`` (wait for room in the tenant's FIFO), as for ``TenantTaskCoordinator``;
            ``execute(overflow=...)`` overrides it per call.
        fleet: A lease provider (``rxcoord.leases``): the limits then hold across every
            scheduler with the same ``name`` on the same store, in any process and host:
            ``max_concurrency`` fleet-wide, ``tenant_max_concurrency`` per tenant fleet-wide
            (tenants are identified by ``str(tenant)``), fair shares decided in the store.
            Queues (``tenant_max_queue_size``, ``TooManyTasks``, ``overflow``) stay per
            process. See :class:`~rxcoord.FleetAdmission`.
        permit_at_most_for: With ``fleet``: seconds a fleet permit outlives its last renewal
            (renewed while its job runs): the most a crashed process keeps its slots. A job
            whose permit lapsed (its process was paused past it) fails with ``LeaseLost``;
            :func:`~rxcoord.current_permit` gives a job its permit's fencing token.
        retry: A :class:`~rxcoord.Retry` policy for every job (``execute(retry=...)``
            overrides it per call), as for ``TenantTaskCoordinator``: between attempts a job
            keeps its key and holds neither its tenant's slot nor a global (or fleet) permit.
        metrics_tenant: Maps a tenant to a label its jobs' metrics carry as ``rxcoord.tenant``
            (a tier, a region: a small set; beyond 100 labels per name the rest report as
            ``"other"``). ``None``: no tenant attribute (tenants are unbounded). Metrics and
            spans carry the scheduler's ``name`` as ``rxcoord.name``.
        rate: A :class:`~rxcoord.Rate` on the starts of all tenants together (with ``fleet``,
            of the whole fleet, on the store's clock). A job over it waits, holding no slot.
        tenant_rate: Each tenant's rate: one :class:`~rxcoord.Rate` for every tenant, a
            mapping tenant -> Rate (others have none; checked here), or a callable tenant ->
            Rate or None (checked on the tenant's first job, which fails if it is bad). A
            tenant waiting for its own rate never holds back another tenant within its rate.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a limit, a weight, the timeout or the idle timeout is out of range.
    """

    def __init__(
        self,
        max_concurrency: int = 16,
        *,
        tenant_max_concurrency: int = 2,
        tenant_max_queue_size: int = 50,
        scheduler: abc.SchedulerBase | None = None,
        timeout: float | None = None,
        weights: Weights | None = None,
        idle_timeout: float = 0.0,
        name: str = "",
        overflow: Overflow = "reject",
        fleet: LeaseProvider | None = None,
        permit_at_most_for: float = 30.0,
        retry: Retry | None = None,
        metrics_tenant: Callable[[Any], str] | None = None,
        rate: Rate | None = None,
        tenant_rate: TenantRates | None = None,
    ) -> None:
        self._max_concurrency = check_count(max_concurrency, "max_concurrency", 1)
        tenant_limit = check_count(tenant_max_concurrency, "tenant_max_concurrency", 1)
        tenant_queue = check_count(tenant_max_queue_size, "tenant_max_queue_size", 0)
        self._timeout = check_deadline(timeout)
        self._idle_timeout = check_delay(idle_timeout, "idle_timeout")
        check_overflow(overflow)
        if isinstance(weights, Mapping):
            for tenant, weight in weights.items():
                check_weight(weight, f"weights[{tenant!r}]")
        elif weights is not None and not callable(weights):
            raise TypeError(f"weights must be a mapping or a callable, not {weights!r}")
        if scheduler is not None and not isinstance(scheduler, abc.SchedulerBase):
            raise TypeError(f"scheduler must be a reactivex scheduler or None, not {scheduler!r}")
        self._weights = weights
        if metrics_tenant is not None and not callable(metrics_tenant):
            raise TypeError(f"metrics_tenant must be callable or None, not {metrics_tenant!r}")
        self._metrics_tenant = metrics_tenant
        self._name = check_name(name)
        self._tel = telemetry.coordinator(self._name)
        self._log = logger.bind(scheduler=name)
        rate = check_rate(rate)
        self._tenant_rates = check_tenant_rates(tenant_rate)
        self._gate = FairShareGate(max_concurrency, rate=rate, clock=clock_for(scheduler))
        # fleet=: the store's permit table replaces the in-process gate (it counts this
        # process's jobs too, and decides fair shares and rates across the fleet).
        self._fleet = (
            None
            if fleet is None
            else FleetAdmission(
                fleet, name, max_concurrency, permit_at_most_for=permit_at_most_for, rate=rate
            )
        )
        self._tenant_limit = tenant_limit
        self._pool = (
            WorkerPool(max_concurrency, f"rxcoord-{name or 'tenants'}")
            if scheduler is None
            else None
        )
        # What every tenant's coordinator is built with (besides its name and its own lane).
        self._tenant_options: dict[str, Any] = {
            "scheduler": scheduler if self._pool is None else self._pool,
            "max_concurrency": tenant_limit,
            "max_queue_size": tenant_queue,
            "timeout": self._timeout,
            "overflow": overflow,
            "retry": retry,
        }
        self._lock = threading.Lock()
        self._state = CoordinatorState.OPEN
        self._tenants: dict[Hashable, _Tenant] = {}
        self._evicted = 0
        # Counters of evicted tenants, and refusals made by the scheduler itself.
        self._retired = dict.fromkeys(
            ("submitted", "completed", "failed", "rejected", "cancelled", "timed_out", "retries"), 0
        )

    # -- public API --------------------------------------------------------------------------

    @property
    def tenant_count(self) -> int:
        """Tenants with live state (queued or running work, or not yet idle long enough)."""
        return len(self._tenants)

    @property
    def state(self) -> CoordinatorState:
        """Open, closing or closed."""
        return self._state

    @overload
    def execute(
        self,
        tenant: Hashable,
        fn: Callable[[*_Ts], Awaitable[_T]],
        /,
        *args: *_Ts,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[_T]: ...

    @overload
    def execute(
        self,
        tenant: Hashable,
        fn: Callable[[*_Ts], _T],
        /,
        *args: *_Ts,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[_T]: ...

    # No arguments, any callable: mypy cannot infer ``lambda n=n: work(n)`` against
    # ``Callable[[], ...]`` (a lambda's defaults need a context with parameters), so such a job
    # would be a false alarm above. The call itself is still checked at run time.
    @overload
    def execute(
        self,
        tenant: Hashable,
        fn: Callable[..., Awaitable[_T]],
        /,
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[_T]: ...

    @overload
    def execute(
        self,
        tenant: Hashable,
        fn: Callable[..., _T],
        /,
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[_T]: ...

    def execute(  # type: ignore[misc]  # mypy: an Any-typed *args "misses" the *_Ts of the above
        self,
        tenant: Hashable,
        fn: Callable[..., Any],
        /,
        *args: Any,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[Any]:
        """Return a cold Observable that runs ``fn(*args)`` for ``tenant`` once per
        subscription (or ``await``).

        Same contract as :meth:`TenantTaskCoordinator.execute`, within the tenant's limits and
        the global limit.

        Raises:
            TypeError: ``tenant`` or ``key`` is unhashable, ``fn`` is not callable or cannot
                be called with ``args``, ``timeout`` is not a number, or ``retry`` is not a
                ``Retry``.
            ValueError: ``timeout`` is not positive, ``overflow`` not one of the two strings.
        """
        check_hashable(tenant, "tenant")  # an unhashable tenant fails here, at the call
        return execution(
            _TenantOwner(self, tenant), fn, args, key, timeout, self._timeout, overflow, retry
        )

    @overload
    def stats(self) -> SchedulerStats: ...

    @overload
    def stats(self, tenant: Hashable) -> CoordinatorStats: ...

    def stats(self, tenant: Hashable | None = None) -> CoordinatorStats | SchedulerStats:
        """``stats(tenant)``: that tenant's snapshot; ``stats()``: the totals over all tenants.

        A tenant without live state (never seen, or evicted) reports zeros: per-tenant
        counters restart when an idle tenant's state is dropped. The totals keep them.
        """
        if tenant is not None:
            live = self._tenants.get(tenant)
            if live is not None:
                return live.coordinator.stats()
            return CoordinatorStats(
                name=str(tenant),
                submitted=0,
                completed=0,
                failed=0,
                rejected=0,
                cancelled=0,
                timed_out=0,
                queued=0,
                running=0,
                max_concurrency=self._tenant_options["max_concurrency"],
                max_queue_size=self._tenant_options["max_queue_size"],
            )
        with self._lock:
            tenants = list(self._tenants.values())
            totals = dict(self._retired)
            evicted = self._evicted
        queued = waiting = running = retrying = 0
        for live in tenants:
            snapshot = live.coordinator.stats()
            for field in totals:
                totals[field] += getattr(snapshot, field)
            queued += snapshot.queued
            waiting += snapshot.waiting
            retrying += snapshot.retrying
            # From the tenants, not the gate: a job being admitted holds its global permit a
            # moment before its tenant counts it as running (it would count twice).
            running += snapshot.running
        return SchedulerStats(
            tenants=len(tenants),
            evicted=evicted,
            queued=queued,
            running=running,
            max_concurrency=self._max_concurrency,
            waiting=waiting,
            retrying=retrying,
            fleet=None if self._fleet is None else self._fleet.stats(),
            **totals,
        )

    def close(self, wait: bool = True, *, drain: bool = False) -> None:
        """Close every tenant as :meth:`TenantTaskCoordinator.close` does; idempotent.

        New subscriptions fail with ``CoordinatorClosed``, and so do submissions waiting for
        room. With ``drain=False`` queued and running jobs fail with it too; with
        ``drain=True`` every accepted job runs to its end and delivers its result first (the
        global limit and fair shares still apply meanwhile). With ``wait``, returns once the
        owned worker threads have exited.

        Raises:
            RuntimeError: ``drain=True`` on the event loop its async jobs need: use
                ``await aclose(drain=True)``.
        """
        tenants = self._begin_close()
        if tenants is None:
            return
        if drain:
            for tenant in tenants:
                tenant.coordinator.close(wait=False, drain=True)
        self._finish_close(tenants)
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        if self._fleet is not None:
            self._fleet.close()  # after the jobs: their permits go back first
        self._closed()

    async def aclose(self, *, drain: bool = False) -> None:
        """:meth:`close` for asyncio code: awaits the drain and the workers, never blocks."""
        tenants = self._begin_close()
        if tenants is None:
            return
        if drain:
            await asyncio.gather(*(t.coordinator.aclose(drain=True) for t in tenants))
        self._finish_close(tenants)
        loop = asyncio.get_running_loop()
        if self._pool is not None:
            await loop.run_in_executor(None, self._pool.shutdown, True)
        if self._fleet is not None:
            await loop.run_in_executor(None, self._fleet.close)  # round trips: not on the loop
        self._closed()

    async def __aenter__(self) -> TenantScheduler:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _begin_close(self) -> list[_Tenant] | None:
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return None
            self._state = CoordinatorState.CLOSING  # refuses new submissions from here on
            return list(self._tenants.values())

    def _finish_close(self, tenants: list[_Tenant]) -> None:
        # First stop the gate: while the tenants are closed one after another, a job finishing
        # in one tenant must not hand its global slot to a job of a tenant not closed yet.
        self._gate.close()
        for tenant in tenants:
            tenant.coordinator.close(wait=False)

    def _closed(self) -> None:
        with self._lock:
            for tenant in self._tenants.values():  # those not evicted while closing
                self._retire(tenant, evicted=False)
            self._tenants.clear()
            self._state = CoordinatorState.CLOSED

    def __repr__(self) -> str:
        return (
            f"<TenantScheduler {self._name!r} {self._state.value} tenants={len(self._tenants)} "
            f"running={self.stats().running}/{self._max_concurrency}>"
        )

    # -- submission and eviction ---------------------------------------------------------------

    def _enter(self, tenant: Hashable) -> _Tenant:
        """Pin ``tenant``'s live state (made if new) while a submission enters it.

        Raises:
            CoordinatorClosed: the scheduler is closed.
            TypeError, ValueError: the tenant's weight (from a callable) is bad.
        """
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                self._retired["submitted"] += 1
                self._retired["rejected"] += 1
                self._tel.rejected("closed")
                raise CoordinatorClosed(f"tenant scheduler {self._name!r} is closed")
            entry = self._tenants.get(tenant)
            if entry is None:
                entry = self._new_tenant(tenant)
            entry.pins += 1
            return entry

    def _leave(self, entry: _Tenant) -> None:
        """The submission has entered (or was refused by) the tenant's coordinator."""
        with self._lock:
            entry.pins -= 1
            idle = not entry.pins and not entry.coordinator.work_in_progress
        if idle:  # refused, or done already: nobody else will notice it went idle
            self._tenant_idle(entry)

    def _subscribe(
        self,
        tenant: Hashable,
        execution: Execution[Any],
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        try:
            entry = self._enter(tenant)
        except (CoordinatorClosed, TypeError, ValueError) as exc:  # closed, or a bad weight
            observer.on_error(exc)
            return Disposable()
        try:
            return entry.coordinator._subscribe(execution, observer, scheduler)
        finally:
            self._leave(entry)

    async def _await(self, tenant: Hashable, execution: Execution[Any]) -> Any:
        entry = self._enter(tenant)
        left = False

        def entered() -> None:
            nonlocal left
            left = True
            self._leave(entry)

        try:
            return await entry.coordinator._await(execution, entered)
        finally:
            if not left:  # failed before it was counted
                self._leave(entry)

    def _new_tenant(self, tenant: Hashable) -> _Tenant:
        weight: Any = 1.0
        if self._weights is not None:
            if isinstance(self._weights, Mapping):
                weight = self._weights.get(tenant, 1.0)
            else:
                weight = self._weights(tenant)
        weight = check_weight(weight, f"the weight of tenant {tenant!r}")
        rate = rate_of(self._tenant_rates, tenant)
        entry = _Tenant(tenant)
        coordinator = TenantTaskCoordinator(
            name=str(tenant),
            admission=(
                self._gate.lane(weight, rate=rate, key=tenant)
                if self._fleet is None
                else self._fleet.lane(
                    str(tenant), weight=weight, tenant_limit=self._tenant_limit, rate=rate
                )
            ),
            on_idle=lambda: self._tenant_idle(entry),
            log_context={"tenant": tenant},
            metrics_name=self._name,
            metrics_label=None if self._metrics_tenant is None else self._metrics_tenant(tenant),
            **self._tenant_options,
        )
        entry.coordinator = coordinator
        self._tenants[tenant] = entry
        return entry

    def _tenant_idle(self, tenant: _Tenant) -> None:
        """A tenant's work in progress dropped to zero: evict it now or after idle_timeout."""
        if self._idle_timeout == 0:
            self._evict_if_idle(tenant)
            return
        if self._idle_timeout == math.inf:
            return  # never evicted
        with self._lock:
            tenant.idle_since = time.monotonic()
            if tenant.idle_timer is None and self._tenants.get(tenant.tenant) is tenant:
                tenant.idle_timer = call_later(self._idle_timeout, lambda: self._expire(tenant))

    def _expire(self, tenant: _Tenant) -> None:
        with self._lock:
            tenant.idle_timer = None
            if self._tenants.get(tenant.tenant) is not tenant:
                return
            if tenant.pins or tenant.coordinator.work_in_progress:
                return  # busy again: its next idle moment arms a new timer
            remaining = tenant.idle_since + self._idle_timeout - time.monotonic()
            if remaining > 0:  # it worked and went idle again meanwhile
                tenant.idle_timer = call_later(remaining, lambda: self._expire(tenant))
                return
        self._evict_if_idle(tenant)

    def _evict_if_idle(self, tenant: _Tenant) -> None:
        with self._lock:
            if self._tenants.get(tenant.tenant) is not tenant:
                return
            if tenant.pins or tenant.coordinator.work_in_progress:
                return
            del self._tenants[tenant.tenant]
            self._retire(tenant, evicted=True)
        tenant.coordinator.close(wait=False)  # no work: this only tears its pipeline down

    def _retire(self, tenant: _Tenant, evicted: bool) -> None:
        """Fold a dropped tenant's counters into the totals (lock held)."""
        snapshot = tenant.coordinator.stats()
        for field in self._retired:
            self._retired[field] += getattr(snapshot, field)
        self._evicted += evicted


class _TenantOwner:
    """The owner of a tenant's executions: the scheduler, seen through that tenant."""

    __slots__ = ("scheduler", "tenant")

    def __init__(self, scheduler: TenantScheduler, tenant: Hashable) -> None:
        self.scheduler = scheduler
        self.tenant = tenant

    def _subscribe(
        self,
        execution: Execution[Any],
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        return self.scheduler._subscribe(self.tenant, execution, observer, scheduler)

    def _await(self, execution: Execution[Any]) -> Coroutine[Any, Any, Any]:
        return self.scheduler._await(self.tenant, execution)
