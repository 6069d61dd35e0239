"""TenantScheduler: many tenants, one global limit, fair shares, idle tenants evicted.

Each tenant gets a ``TenantTaskCoordinator`` of its own, so everything a coordinator promises
holds per tenant (its concurrency limit, ``TooManyTasks`` beyond its queue, keyed order,
cancellation, timeouts, async jobs). The tenants share one *gate*: when a tenant's job would
start, it asks the gate for one of the ``max_concurrency`` global slots, and waits (counted as
queued, its timeout not yet running) until it gets one.

Fairness is stride scheduling over job starts (weighted round robin in virtual time). Each
tenant has a *pass*; a free slot goes to the waiting tenant with the smallest pass, whose pass
then grows by ``1 / weight``. With equal weights that is round robin; over a long run tenants
with backlogs get starts in proportion to their weights. A tenant that becomes runnable again
starts from the current virtual time (the pass of the latest start), never from its old pass,
so being idle earns no credit and a returning tenant cannot monopolise the slots. A flooding
tenant therefore delays another tenant's next job by at most one job per competing tenant: its
flood waits in its own coordinator's queue, not in the gate (each tenant has at most
``tenant_max_concurrency`` jobs at the gate).

Memory does not grow with tenants that went quiet: when a tenant's work in progress drops to
zero and stays there for ``idle_timeout`` seconds, its coordinator is closed and forgotten, and
its counters are folded into the scheduler's totals. Submissions pin their tenant while they
enter it, so eviction can never close a coordinator under a job that is being submitted.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from loguru import logger
from reactivex import Observable, abc
from reactivex.disposable import Disposable

from ._coordinator import (
    CoordinatorStats,
    TenantTaskCoordinator,
    _execution,
    _Task,
    _validate_count,
    _validate_timeout,
)
from ._core.lifecycle import Closeable, CoordinatorState
from ._core.timer import TimerHandle, call_later
from ._core.workers import WorkerPool
from ._errors import CoordinatorClosed

__all__ = ["SchedulerStats", "TenantScheduler"]

_T = TypeVar("_T")

Weights = Mapping[Hashable, float] | Callable[[Hashable], float]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Totals over all tenants: live ones (sum of their snapshots) and evicted ones.

    ``running`` counts jobs holding a global slot (never more than ``max_concurrency``);
    ``queued`` counts jobs accepted and not yet running, in tenants' queues or at the gate.
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

    @property
    def work_in_progress(self) -> int:
        """Jobs queued or running."""
        return self.queued + self.running


class _Lane:
    """A tenant's place at the gate: its weight, pass, and jobs waiting for a global slot."""

    __slots__ = ("in_heap", "pass_", "waiting", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.pass_ = 0.0
        self.waiting: deque[_Task] = deque()
        self.in_heap = False


class _FairGate:
    """At most ``limit`` jobs hold a slot; a free slot goes to the lane with the lowest pass."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._running = 0
        self._heap: list[tuple[float, int, _Lane]] = []
        self._seq = itertools.count()
        self._clock = 0.0  # virtual time: the pass of the latest start
        self._stale = 0  # heap entries of lanes whose waiting jobs were all withdrawn
        self._closed = False  # closing: grant nothing more (tenants are closed one by one)

    @property
    def running(self) -> int:
        return self._running

    def request(self, lane: _Lane, task: _Task) -> None:
        with self._lock:
            lane.waiting.append(task)
            if not lane.in_heap:
                # Joining (again): start from the current virtual time, so idling earns no
                # credit and the newcomer does not wait behind long-running backlogs either.
                lane.pass_ = max(lane.pass_, self._clock)
                heapq.heappush(self._heap, (lane.pass_, next(self._seq), lane))
                lane.in_heap = True
            granted = self._next() if self._running < self._limit else None
        if granted is not None:
            self._grant(granted)

    def withdraw(self, lane: _Lane, task: _Task) -> bool:
        with self._lock:
            try:
                lane.waiting.remove(task)  # at most tenant_max_concurrency entries
            except ValueError:
                return False  # already granted
            if not lane.waiting and lane.in_heap:
                self._stale += 1
                if self._stale > 64 and self._stale * 2 > len(self._heap):
                    self._compact()
            return True

    def release(self) -> None:
        with self._lock:
            self._running -= 1
            granted = self._next()
        if granted is not None:
            self._grant(granted)

    def close(self) -> None:
        """Grant nothing from now on; waiting jobs stay until their tenants withdraw them."""
        with self._lock:
            self._closed = True

    def _next(self) -> _Task | None:
        """Take a slot for the next job, fairly (lock held)."""
        if self._closed:
            return None
        heap = self._heap
        while heap:
            pass_, _, lane = heapq.heappop(heap)
            if not lane.waiting:  # every job it had here was withdrawn
                lane.in_heap = False
                self._stale -= 1
                continue
            task = lane.waiting.popleft()
            self._clock = pass_
            lane.pass_ = pass_ + 1.0 / lane.weight
            if lane.waiting:
                heapq.heappush(heap, (lane.pass_, next(self._seq), lane))
            else:
                lane.in_heap = False
            self._running += 1
            return task
        return None

    def _grant(self, task: _Task | None) -> None:
        # A job cancelled while being granted hands its slot straight on: loop, don't recurse.
        while task is not None:
            if task.coordinator._granted(task):
                return
            with self._lock:
                self._running -= 1
                task = self._next()

    def _compact(self) -> None:
        live = [entry for entry in self._heap if entry[2].waiting]
        for entry in self._heap:
            if not entry[2].waiting:
                entry[2].in_heap = False
        heapq.heapify(live)
        self._heap = live
        self._stale = 0


class _Tenant(TenantTaskCoordinator):
    """A tenant's coordinator: the scheduler's pool and gate, and eviction when idle."""

    _owns_pool = False

    def __init__(
        self,
        owner: TenantScheduler,
        tenant: Hashable,
        lane: _Lane,
        **options: Any,
    ) -> None:
        self._owner = owner
        self.tenant = tenant
        self.pins = 0  # submissions entering this coordinator right now (scheduler's lock)
        self.idle_since = 0.0
        self.idle_timer: TimerHandle | None = None
        self._gate = owner._gate
        self._gate_lane = lane
        super().__init__(name=str(tenant), **options)
        self._log = self._log.bind(tenant=tenant)

    def _make_pool(self) -> WorkerPool:
        assert self._owner._pool is not None
        return self._owner._pool

    def _became_idle(self) -> None:
        self._owner._tenant_idle(self)


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
        max_concurrency: Most jobs running at once across all tenants.
        tenant_max_concurrency: Most jobs of one tenant running (or waiting for a global slot).
        tenant_max_queue_size: Most jobs of one tenant queued beyond those.
        scheduler: Where sync jobs run; ``None`` for ``max_concurrency`` owned worker threads.
        timeout: Default per-job timeout in seconds, counted from the job's start.
        weights: Tenant -> positive weight, as a mapping or a callable (default 1).
        idle_timeout: Seconds a tenant stays idle before its state is dropped.
        name: Names the scheduler in logs and thread names.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a limit, the timeout or the idle timeout is out of range.
    """

    def __init__(
        self,
        max_concurrency: int = 16,
        tenant_max_concurrency: int = 2,
        tenant_max_queue_size: int = 50,
        scheduler: abc.SchedulerBase | None = None,
        timeout: float | None = None,
        weights: Weights | None = None,
        idle_timeout: float = 0.0,
        *,
        name: str = "",
    ) -> None:
        self._max_concurrency = _validate_count(max_concurrency, "max_concurrency", 1)
        self._tenant_options: dict[str, Any] = {
            "scheduler": scheduler,
            "max_concurrency": _validate_count(tenant_max_concurrency, "tenant_max_concurrency", 1),
            "max_queue_size": _validate_count(tenant_max_queue_size, "tenant_max_queue_size", 0),
            "timeout": _validate_timeout(timeout, "timeout"),
        }
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, int | float):
            raise TypeError(f"idle_timeout must be a number of seconds, not {idle_timeout!r}")
        if idle_timeout < 0:
            raise ValueError(f"idle_timeout must be >= 0, got {idle_timeout}")
        if weights is not None and not callable(weights) and not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping or a callable, not {weights!r}")
        if scheduler is not None and not isinstance(scheduler, abc.SchedulerBase):
            raise TypeError(f"scheduler must be a reactivex scheduler or None, not {scheduler!r}")
        self._idle_timeout = float(idle_timeout)
        self._weights = weights
        self._name = name
        self._log = logger.bind(scheduler=name)
        self._gate = _FairGate(max_concurrency)
        self._pool = (
            WorkerPool(max_concurrency, f"rxcoord-{name or 'tenants'}")
            if scheduler is None
            else None
        )
        self._lock = threading.Lock()
        self._state = CoordinatorState.OPEN
        self._tenants: dict[Hashable, _Tenant] = {}
        self._evicted = 0
        # Counters of evicted tenants, and refusals made by the scheduler itself.
        self._retired = dict.fromkeys(
            ("submitted", "completed", "failed", "rejected", "cancelled", "timed_out"), 0
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
        job: Callable[[], Awaitable[_T]],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[_T]: ...

    @overload
    def execute(
        self,
        tenant: Hashable,
        job: Callable[[], _T],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[_T]: ...

    def execute(
        self,
        tenant: Hashable,
        job: Callable[[], Any],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[Any]:
        """Return a cold Observable that runs ``job`` for ``tenant`` once per subscription.

        Same contract as :meth:`TenantTaskCoordinator.execute`, within the tenant's limits and
        the global limit.

        Raises:
            TypeError: ``tenant`` or ``key`` is unhashable, ``job`` is not callable, or
                ``timeout`` is not a number.
            ValueError: ``timeout`` is not positive.
        """
        hash(tenant)  # an unhashable tenant fails here, at the call
        submit = functools.partial(self._submit, tenant)
        return _execution(submit, job, key, timeout, self._tenant_options["timeout"])

    def stats(self, tenant: Hashable | None = None) -> CoordinatorStats | SchedulerStats:
        """``stats(tenant)``: that tenant's snapshot; ``stats()``: the totals over all tenants.

        A tenant without live state (never seen, or evicted) reports zeros: per-tenant
        counters restart when an idle tenant's state is dropped. The totals keep them.
        """
        if tenant is not None:
            live = self._tenants.get(tenant)
            if live is not None:
                return live.stats()
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
        queued = 0
        for live in tenants:
            snapshot = live.stats()
            for field in totals:
                totals[field] += getattr(snapshot, field)
            queued += snapshot.queued
        return SchedulerStats(
            tenants=len(tenants),
            evicted=evicted,
            queued=queued,
            running=self._gate.running,
            max_concurrency=self._max_concurrency,
            **totals,
        )

    def close(self, wait: bool = True) -> None:
        """Close every tenant as :meth:`TenantTaskCoordinator.close` does; idempotent.

        New subscriptions fail with ``CoordinatorClosed``; queued and running jobs fail with it.
        With ``wait``, returns once the owned worker threads have exited.
        """
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return
            self._state = CoordinatorState.CLOSING
            tenants = list(self._tenants.values())
        # First stop the gate: while the tenants are closed one after another, a job finishing
        # in one tenant must not hand its global slot to a job of a tenant not closed yet.
        self._gate.close()
        for tenant in tenants:
            tenant.close(wait=False)
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        with self._lock:
            for tenant in self._tenants.values():  # those not evicted while closing
                self._retire(tenant, evicted=False)
            self._tenants.clear()
            self._state = CoordinatorState.CLOSED

    def __repr__(self) -> str:
        return (
            f"<TenantScheduler {self._name!r} {self._state.value} tenants={len(self._tenants)} "
            f"running={self._gate.running}/{self._max_concurrency}>"
        )

    # -- submission and eviction ---------------------------------------------------------------

    def _submit(
        self,
        tenant: Hashable,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        coordinator: _Tenant | None = None
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                self._retired["submitted"] += 1
                self._retired["rejected"] += 1
                error: Exception = CoordinatorClosed(f"tenant scheduler {self._name!r} is closed")
            else:
                coordinator = self._tenants.get(tenant)
                if coordinator is None:
                    try:
                        coordinator = self._new_tenant(tenant)
                    except (TypeError, ValueError) as exc:  # a bad weight for this tenant
                        error = exc
                if coordinator is not None:
                    coordinator.pins += 1
        if coordinator is None:
            observer.on_error(error)
            return Disposable()
        try:
            return coordinator._submit(job, key, timeout, is_async, observer, scheduler)
        finally:
            with self._lock:
                coordinator.pins -= 1
                idle = not coordinator.pins and not coordinator.work_in_progress
            if idle:  # refused, or done already: nobody else will notice it went idle
                self._tenant_idle(coordinator)

    def _new_tenant(self, tenant: Hashable) -> _Tenant:
        weight: Any = 1.0
        if self._weights is not None:
            if isinstance(self._weights, Mapping):
                weight = self._weights.get(tenant, 1.0)
            else:
                weight = self._weights(tenant)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ValueError(
                f"weight of tenant {tenant!r} must be a positive number, not {weight!r}"
            )
        coordinator = _Tenant(self, tenant, _Lane(float(weight)), **self._tenant_options)
        self._tenants[tenant] = coordinator
        return coordinator

    def _tenant_idle(self, tenant: _Tenant) -> None:
        """A tenant's work in progress dropped to zero: evict it now or after idle_timeout."""
        if self._idle_timeout == 0:
            self._evict_if_idle(tenant)
            return
        with self._lock:
            tenant.idle_since = time.monotonic()
            if tenant.idle_timer is None and self._tenants.get(tenant.tenant) is tenant:
                tenant.idle_timer = call_later(self._idle_timeout, lambda: self._expire(tenant))

    def _expire(self, tenant: _Tenant) -> None:
        with self._lock:
            tenant.idle_timer = None
            if self._tenants.get(tenant.tenant) is not tenant:
                return
            if tenant.pins or tenant.work_in_progress:
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
            if tenant.pins or tenant.work_in_progress:
                return
            del self._tenants[tenant.tenant]
            self._retire(tenant, evicted=True)
        tenant.close(wait=False)  # no work: this only tears its (empty) pipeline down

    def _retire(self, tenant: _Tenant, evicted: bool) -> None:
        """Fold a dropped tenant's counters into the totals (lock held)."""
        snapshot = tenant.stats()
        for field in self._retired:
            self._retired[field] += getattr(snapshot, field)
        self._evicted += evicted
