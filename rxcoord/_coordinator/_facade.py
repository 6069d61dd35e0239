"""TenantTaskCoordinator: Reactor's per-tenant coordinator, ported to RxPY and made correct.

Its meaning is the Reactor composition the project started from, kept as a public reference in
``_reference.py`` (:class:`~rxcoord.ReactorCoordinator`): a Subject as the task sink ->
``serialize_by_key(key, run, max_concurrent)`` -> each job under its timeout -> the WIP counter
with ``TooManyTasks``. A differential test in virtual time proves this class equivalent to it.
This class is the same thing without an Observable per job. The path of a job, one module of
this package a step::

    execute ──► count ──► order ──► admit ──► guard ──► run ──► end ──► deliver
    _execution  _table (WIP, lanes)  _admit   _run (key guard, runners)  _facade (_end, _deliver)
                                   the awaited path: _awaited; timeouts, retries: _attempts

* **count and order** - :class:`~._table.TaskTable`, pure state behind the coordinator's one
  lock: the work-in-progress limit (``TooManyTasks``, or ``overflow="wait"``), per-key lanes
  and the cap (``rxcoord._core.lanes``). Every event returns the tasks whose turn came; they
  are started after the lock is let go (``_turn``).
* **admit** - an optional :class:`~rxcoord.Admission` (a tenant scheduler's fair-share gate, a
  fleet, a rate) is asked for a permit when a task's turn comes (``_ask``); a permit with a life
  of its own (:class:`~rxcoord.Permit`) is entered around the job and checked at its end.
* **guard** - an optional :class:`~rxcoord.KeyGuard` (``leases=``) a keyed job enters on its own
  thread or task right before it runs, and exits when its work has ended.
* **run** - a sync job on a runner (``_runners``: worker threads, an asyncio loop, a
  scheduler), in a copy of its submitter's context; an async job (or the awaitable a sync job
  returned) on an asyncio loop, inside the awaiting task when awaited (``_await``: the one
  awaited path, no task per job), else in a task of its own (``_run_async``); what else a job
  returns (an Observable, a ``concurrent.futures.Future``) runs to its end through the shared
  job-shape runner (``rxcoord._core.jobs``).
* **end and deliver** - ``_end``: the table frees the key and the slot and starts the next
  tasks, the permit goes back, then the outcome is delivered (on the subscriber's loop if it
  subscribed on one).

Cancellation (a dispose, a timeout, a close) decides the outcome first (``TaskTable.settle``)
and then stops the work: a queued job never starts; an async job is cancelled on its loop; a
sync job's thread cannot be stopped, so it keeps its slot until it returns and its result is
dropped. Where the port diverges from Reactor, correctness demands it:

* a cancelled sync job keeps its slot until its thread returns (Reactor frees it at once and runs
  more than ``maxConcurrency`` jobs);
* WIP is decremented *before* the result is delivered, so a caller resubmitting from its callback
  is not refused spuriously; a task cancelled while queued leaves the counters at once (Reactor
  leaked its WIP slot); a failing scheduler or loop fails the task's subscriber;
* job timeouts use one timer thread for the whole process (``rxcoord._core.timer``), or the
  virtual scheduler's clock in virtual time;
* a subscriber whose ``on_next`` raises is logged; it cannot break the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, TypeVarTuple, cast, overload

from loguru import logger
from reactivex import abc
from reactivex.disposable import Disposable
from reactivex.scheduler import VirtualTimeScheduler
from reactivex.scheduler.eventloop import AsyncIOScheduler

from .._admission import Admission, RateAdmission
from .._core import telemetry
from .._core.checks import check_count, check_deadline, check_length, check_name, check_overflow
from .._core.clock import clock_for
from .._core.futures import running_loop
from .._core.lifecycle import Closeable, CoordinatorState
from .._core.retry import Retry, gave_up
from .._core.workers import WorkerPool
from .._errors import CoordinatorClosed, TooManyTasks
from .._fleet import FleetAdmission, FleetStats
from .._key_guard import KeyGuard, LeaseKeyGuard
from .._rate import Rate, RateStats, check_rate
from . import _admit, _attempts, _awaited, _run
from ._execution import Execution, execution
from ._run import NO_LOOP
from ._runners import LoopRunner, Runner, SchedulerRunner, WorkerRunner
from ._table import (
    CANCELLED,
    CLOSED,
    DONE,
    GATED,
    QUEUED,
    RETRYING,
    RUNNING,
    TIMED_OUT,
    WAITING,
    TaskTable,
)
from ._task import STREAMED, Task

if TYPE_CHECKING:
    from ..leases import LeaseProvider

__all__ = ["CoordinatorStats", "TenantTaskCoordinator"]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

Overflow = Literal["reject", "wait"]


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A consistent snapshot of a coordinator's counters.

    Every subscription to ``execute`` (and every ``await``) is ``submitted``; it ends as exactly
    one of ``rejected`` (refused at once: ``TooManyTasks`` or ``CoordinatorClosed``),
    ``completed``, ``failed`` (the job raised, or could not be started), ``cancelled`` (the
    subscriber disposed, or the coordinator closed) or ``timed_out`` - or it is still pending.
    ``work_in_progress`` is ``queued + running + retrying``; a cancelled sync job stays
    ``running`` until its thread returns. ``queued`` counts jobs waiting for their turn or their
    admission's permit; ``retrying`` jobs waiting for their next attempt (they keep their key,
    hold no slot), and ``retries`` the attempts beyond the first so far. ``waiting`` counts
    submissions beyond the limits waiting for room (``overflow="wait"``): not work in progress
    yet. With ``stall_after``, ``stalled`` counts jobs in progress (attempts and waits
    together) for longer than that, and ``oldest`` is the longest any job in progress has been
    at it, in seconds. ``fleet`` is the fleet admission's snapshot (fleet-wide running counts
    as last seen from the store, and its rate waits) with ``fleet=``; ``rate`` the waits for a
    rate (``rate=``, or a tenant's rates in a ``TenantScheduler``).
    """

    name: str
    submitted: int
    completed: int
    failed: int
    rejected: int
    cancelled: int
    timed_out: int
    queued: int
    running: int
    max_concurrency: int
    max_queue_size: int
    waiting: int = 0
    fleet: FleetStats | None = None
    retries: int = 0
    retrying: int = 0
    stalled: int = 0
    oldest: float = 0.0
    rate: RateStats | None = None

    @property
    def work_in_progress(self) -> int:
        """Jobs queued, running or waiting for their next attempt."""
        return self.queued + self.running + self.retrying


class TenantTaskCoordinator(Closeable):
    """Runs jobs with a concurrency limit, a bounded queue, per-key ordering and cancellation.

    ``execute(fn, *args)`` returns a cold Observable: each subscription submits ``fn(*args)``
    once; it emits the job's return value and completes, or errors with the job's own
    exception. ``await`` it for the value. Subscribing counts the job as work in progress;
    beyond ``max_concurrency + max_queue_size`` the subscriber gets :class:`TooManyTasks` at
    once (or waits for room, with ``overflow="wait"``). At most ``max_concurrency`` jobs run at
    any moment, also while a cancelled sync job is still running. Jobs with equal ``key`` run
    one at a time in submission order. Disposing the subscription (or cancelling the awaiting
    task) cancels: a queued job never starts; a running async job gets
    ``asyncio.CancelledError``; a running sync job's result is discarded (its thread cannot be
    stopped, so it keeps its slot until it returns).

    Where a job runs: ``async def`` functions (and partials of them, and ``lambda: handle(m)``
    once such a lambda has shown it returns an awaitable) on the asyncio loop where the job was
    awaited or subscribed (or the loop of an ``AsyncIOScheduler`` given as ``scheduler``), inside
    the awaiting task when awaited; everything else on ``scheduler`` (by default worker threads
    the coordinator owns, at most ``max_concurrency``, shut down by :meth:`close`), never on a
    loop's thread. A job returning an Observable runs until it ends, its items forwarded. Every
    job runs in a copy of its submitter's ``contextvars`` context. Subscribers that subscribe on
    a running loop get their results on it, so ``await coordinator.execute(job)`` works, and so
    does ``execute(job).run()``.

    The coordinator is thread-safe, a context manager and a ``reactivex`` Disposable
    (``dispose()`` is :meth:`close`). Every parameter is keyword-only.

    Args:
        scheduler: Where sync jobs run; ``None`` for an owned pool of worker threads.
        max_concurrency: Most jobs running at once (>= 1).
        max_queue_size: Most jobs waiting beyond those running (>= 0).
        name: Names the coordinator in errors, logs, thread names and lease names.
        timeout: Default per-job timeout in seconds, counted from the job's start; ``None`` (or
            ``inf``) for none. On expiry the subscriber gets ``TimeoutError`` and the job is
            cancelled. (0 is refused: see ``rxcoord._core.checks`` for the one policy.)
        leases: A distributed lease provider (``rxcoord.leases``): keyed jobs then also hold
            the lease named ``"<name>:<key>"`` while they run, so per-key exclusion holds
            across processes (needs a ``name``). Shorthand for
            ``key_guard=LeaseKeyGuard(leases, name, ...)``.
        lease_at_most_for: ``at_most_for`` of those leases (kept alive while the job runs).
        key_guard: A :class:`~rxcoord.KeyGuard` every keyed job enters right before it runs
            and exits when its work has ended (not with ``leases``).
        admission: An :class:`~rxcoord.Admission` asked for a permit each time a job's turn
            comes; the job runs once granted (counted as queued until then). ``None``: only
            this coordinator's own limits apply.
        fleet: A lease provider (``rxcoord.leases``): ``max_concurrency`` then holds across
            every coordinator with the same ``name`` (required) on the same store, in any
            process (see :class:`~rxcoord.FleetAdmission`). Not with ``admission``.
        permit_at_most_for: With ``fleet``: seconds a fleet permit outlives its last renewal
            (renewed while its job runs), i.e. the most a crashed process keeps its slots. A
            job whose permit lapsed (its process was paused past it) fails with ``LeaseLost``.
        on_idle: Called (outside the coordinator's lock, on the thread that finished the last
            job) each time the work in progress drops to zero.
        log_context: Extra fields bound to the coordinator's log records (loguru ``extra``),
            e.g. ``{"tenant": tenant}``.
        overflow: What a submission beyond ``max_concurrency + max_queue_size`` gets:
            ``"reject"`` (``TooManyTasks`` at once, the default) or ``"wait"`` (it waits for
            room in FIFO order: ``await`` suspends, ``.run()`` blocks, a subscription is
            admitted later; disposing it withdraws it). ``execute(overflow=...)`` overrides it
            per call.
        retry: A :class:`~rxcoord.Retry` policy for every job (``execute(retry=...)`` overrides
            it per call): a job that fails with a retried exception waits for its next attempt
            keeping its key (later jobs of the key stay behind it) but holding no slot, permit
            or thread, then queues for a slot again; ``timeout`` applies to each attempt.
            ``None``: no retries.
        stall_after: Seconds a job may be in progress (its attempts and the waits between
            them) before it counts as stalled: ``on_stall(key, seconds)`` is called once and
            ``stats()`` shows it. ``None``: not watched.
        on_stall: Called (on a worker thread) with a stalled job's key (None if unkeyed) and
            the seconds it has been in progress.
        metrics_name: The ``rxcoord.name`` its OpenTelemetry metrics and spans carry
            (default: ``name``); a ``TenantScheduler`` gives its tenants its own.
        metrics_label: An ``rxcoord.tenant`` attribute for them: a label from a small set (a
            tier, a region), never an unbounded id.
        rate: A :class:`~rxcoord.Rate` on this coordinator's job starts (with ``fleet``, on
            the whole fleet's, on the store's clock). A job over it waits for its time holding
            no slot and no thread, in order (per-key order kept); ``TooManyTasks`` and
            ``overflow`` still bound the queue. In virtual time with a virtual ``scheduler``.

    Raises:
        TypeError: an argument has the wrong type (``leases`` not a lease provider, ``name``
            not a str, ...).
        ValueError: a limit or a duration is out of range, both ``leases`` and ``key_guard``
            (or ``fleet`` and ``admission``) are given, or ``leases``/``fleet`` without a name.
    """

    # The steps of a job's path, one module each, each function taking the coordinator first:
    # admit (_admit), guard and run (_run), the awaited path (_awaited), an attempt's time -
    # timeouts, retries, stalls - (_attempts). What one step asks of another is bound here.
    _await = _awaited.await_job
    _turn = _admit.turn
    _withdraw = _admit.withdraw
    _go = _run.go
    _run_async = _run.run_async
    _run_sync = _run.run_sync
    _work_ended = _run.work_ended
    _stop = _run.stop
    _retried = _attempts.retried
    _first_start = _attempts.first_start
    _timeout_error = _attempts.timeout_error
    _arm_timeout = _attempts.arm_timeout

    def __init__(
        self,
        *,
        scheduler: abc.SchedulerBase | None = None,
        max_concurrency: int = 1,
        max_queue_size: int = 50,
        name: str = "",
        timeout: float | None = None,
        leases: LeaseProvider | None = None,
        lease_at_most_for: float = 30.0,
        key_guard: KeyGuard | None = None,
        admission: Admission | None = None,
        fleet: LeaseProvider | None = None,
        permit_at_most_for: float = 30.0,
        on_idle: Callable[[], object] | None = None,
        log_context: Mapping[str, Any] | None = None,
        overflow: Overflow = "reject",
        retry: Retry | None = None,
        stall_after: float | None = None,
        on_stall: Callable[[Hashable | None, float], object] | None = None,
        metrics_name: str | None = None,
        metrics_label: str | None = None,
        rate: Rate | None = None,
    ) -> None:
        self._max_concurrency = check_count(max_concurrency, "max_concurrency", 1)
        self._max_queue_size = check_count(max_queue_size, "max_queue_size", 0)
        self._name = check_name(name)
        self._timeout = check_deadline(timeout)
        self._wait = check_overflow(overflow)
        self._log = logger.bind(coordinator=name, **(log_context or {}))
        lease_for = check_length(lease_at_most_for, "lease_at_most_for")
        if leases is not None:
            if key_guard is not None:
                raise ValueError("pass leases= or key_guard=, not both")
            key_guard = LeaseKeyGuard(leases, name, lease_for)
        self._guard = key_guard
        if admission is not None and not isinstance(admission, Admission):
            raise TypeError(
                f"admission must implement rxcoord.Admission (request, withdraw, release), "
                f"not {admission!r}"
            )
        permit_for = check_length(permit_at_most_for, "permit_at_most_for")
        rate = check_rate(rate)
        self._fleet: FleetAdmission | None = None
        # A rate alone: most jobs pass it without a ticket (``_turn``'s fast path).
        self._rate: RateAdmission | None = None
        if fleet is not None:
            if admission is not None:
                raise ValueError("pass fleet= or admission=, not both")
            # Every coordinator named like this one on the same store shares max_concurrency
            # (and the rate: taken in the same store step as the permit).
            self._fleet = FleetAdmission(
                fleet, name, max_concurrency, permit_at_most_for=permit_for, rate=rate
            )
            admission = self._fleet.lane(name)
        elif rate is not None:
            admission = RateAdmission(rate, clock=clock_for(scheduler), then=admission)
            if admission.then is None:
                self._rate = admission
        self._admission = admission
        # What the admission says of its rate waits, if it keeps any (a rate, a tenant's lane).
        self._rate_stats = getattr(admission, "stats", None) if self._fleet is None else None
        if on_idle is not None and not callable(on_idle):
            raise TypeError(f"on_idle must be callable or None, not {on_idle!r}")
        self._on_idle = on_idle
        self._idle_callbacks: list[Callable[[], object]] = []  # a draining close waits here
        if retry is not None and not isinstance(retry, Retry):
            raise TypeError(f"retry must be a rxcoord.Retry or None, not {retry!r}")
        self._retry = retry
        self._stall_after = check_deadline(stall_after, "stall_after")
        if on_stall is not None and not callable(on_stall):
            raise TypeError(f"on_stall must be callable or None, not {on_stall!r}")
        if on_stall is not None and self._stall_after is None:
            raise ValueError("on_stall needs stall_after: the seconds after which a job stalls")
        self._on_stall = on_stall
        # Metrics and spans (a branch per job while nothing listens: rxcoord._core.telemetry).
        self._tel = telemetry.coordinator(
            name if metrics_name is None else check_name(metrics_name, "metrics_name"),
            metrics_label,
        )
        self._tel.observe(self, _counts)

        self._lock = threading.Lock()
        self._table: TaskTable[Task] = TaskTable(
            max_concurrency, max_queue_size, gated=admission is not None
        )
        self._state = CoordinatorState.OPEN
        self._closing = False  # close() has begun settling (after a drain, or at once)

        # Where sync jobs run, and the loop async jobs run on when it is not the caller's.
        self._pool: WorkerPool | None = None
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        self._virtual: VirtualTimeScheduler | None = None  # timeouts on its clock
        self._runner: Runner
        if scheduler is None:
            self._pool = WorkerPool(max_concurrency, f"rxcoord-{name or 'coordinator'}")
            self._runner = WorkerRunner(self._pool)
        elif isinstance(scheduler, WorkerPool):  # internal: a pool shared with its owner
            self._runner = WorkerRunner(scheduler)
        elif isinstance(scheduler, AsyncIOScheduler):
            self._scheduler_loop = scheduler._loop
            self._runner = LoopRunner(scheduler._loop)
        elif isinstance(scheduler, abc.SchedulerBase):
            if isinstance(scheduler, VirtualTimeScheduler):
                self._virtual = scheduler
            self._runner = SchedulerRunner(scheduler)
        else:
            raise TypeError(f"scheduler must be a reactivex scheduler or None, not {scheduler!r}")
        # Time for timeouts, retry waits, stall watches and rates: virtual with a virtual
        # scheduler (exact, no sleeping), else the monotonic clock and the one timer thread.
        self._clock = clock_for(scheduler)

    # -- public API --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The coordinator's name."""
        return self._name

    @property
    def max_concurrency(self) -> int:
        """Most jobs running at once."""
        return self._max_concurrency

    @property
    def max_queue_size(self) -> int:
        """Most jobs waiting beyond those running."""
        return self._max_queue_size

    @property
    def state(self) -> CoordinatorState:
        """Open, closing or closed."""
        return self._state

    @property
    def work_in_progress(self) -> int:
        """Jobs queued or running (never more than ``max_concurrency + max_queue_size``)."""
        with self._lock:
            return self._table.wip

    @property
    def running(self) -> int:
        """Jobs running now, including cancelled sync jobs whose thread has not returned."""
        return self._table.counts[RUNNING]

    @property
    def queued(self) -> int:
        """Jobs accepted and waiting for their turn (or their admission's permit)."""
        counts = self._table.counts
        return counts[QUEUED] + counts[GATED]

    def stats(self) -> CoordinatorStats:
        """A consistent snapshot of the counters."""
        stalled, oldest = 0, 0.0
        with self._lock:
            table = self._table
            counts = table.counts
            if self._stall_after is not None:
                now = self._clock.now()
                ages = [
                    now - t.first_start for t in table.lanes.items() if t.first_start is not None
                ]
                oldest = max(ages, default=0.0)
                stalled = sum(age > self._stall_after for age in ages)
            return CoordinatorStats(
                name=self._name,
                submitted=table.submitted,
                completed=table.completed,
                failed=table.failed,
                rejected=table.rejected,
                cancelled=table.cancelled,
                timed_out=table.timed_out,
                queued=counts[QUEUED] + counts[GATED],
                running=counts[RUNNING],
                max_concurrency=self._max_concurrency,
                max_queue_size=self._max_queue_size,
                waiting=counts[WAITING],
                fleet=None if self._fleet is None else self._fleet.stats(),
                retries=table.retries,
                retrying=counts[RETRYING],
                stalled=stalled,
                oldest=oldest,
                rate=self._rate_snapshot(),
            )

    def _rate_snapshot(self) -> RateStats | None:
        reader = self._rate_stats
        if reader is None:
            return None
        snapshot = reader()
        return snapshot if isinstance(snapshot, RateStats) else None

    @overload
    def execute(
        self,
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
        fn: Callable[..., Any],
        /,
        *args: Any,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: Overflow | None = None,
        retry: Retry | None = None,
    ) -> Execution[Any]:
        """Return a cold Observable that runs ``fn(*args)`` under this coordinator once per
        subscription (or ``await``).

        Args:
            fn: The job: a callable (runs on the scheduler) or an ``async def`` function
                (awaited on the loop where it was awaited or subscribed, or the
                AsyncIOScheduler's); see the class docstring for which shapes run where.
            *args: Positional arguments for ``fn`` (``execute(handle, message)``, the
                ``start_soon(fn, *args)`` convention of anyio and trio).
            key: Jobs with equal keys run one at a time in submission order; ``None`` for no
                ordering.
            timeout: Seconds the job may run, counted from its start; overrides the
                coordinator's default.
            overflow: ``"reject"`` or ``"wait"`` for this call; ``None``: the coordinator's.
            retry: The retry policy for this call (``Retry(attempts=1)``: none); ``None``: the
                coordinator's.

        Returns:
            An Observable emitting the job's result once, or erroring with the job's exception,
            ``TooManyTasks``, ``CoordinatorClosed`` or ``TimeoutError``; awaitable for the
            result.

        Raises:
            TypeError: ``fn`` is not callable or cannot be called with ``args``, ``key`` is
                unhashable, ``timeout`` is not a number, or ``retry`` is not a ``Retry``.
            ValueError: ``timeout`` is not positive, ``overflow`` not one of the two strings.
        """
        return execution(self, fn, args, key, timeout, self._timeout, overflow, retry)

    def close(self, wait: bool = True, *, drain: bool = False) -> None:
        """Close the coordinator; idempotent.

        New subscriptions fail with ``CoordinatorClosed``, and so do submissions waiting for
        room (``overflow="wait"``). With ``drain=False`` (the default) queued and running jobs
        fail with it too (running async jobs are cancelled, running sync jobs' results are
        discarded: a thread cannot be stopped). With ``drain=True`` every accepted job, queued
        or running, runs to its end and delivers its result first; this blocks until then, so
        on an event loop running async jobs of this coordinator use :meth:`aclose`.
        The owned worker threads are shut down; with ``wait`` this returns once they have all
        exited, which means once running sync jobs have returned.

        Raises:
            RuntimeError: ``drain=True`` on the event loop that runs this coordinator's async
                jobs while any is live (they could never finish): use ``await aclose(drain=True)``.
        """
        if drain:
            loop = running_loop()
            with self._lock:
                blocked = loop is not None and any(
                    t.job_loop is loop for t in self._table.lanes.items()
                )
            if blocked:
                raise RuntimeError(
                    "close(drain=True) would block the event loop its async jobs need: "
                    "use `await coordinator.aclose(drain=True)`"
                )
            idle = threading.Event()
            if self._start_draining(idle.set):
                idle.wait()
        self._close(wait)

    async def aclose(self, *, drain: bool = False) -> None:
        """:meth:`close` for asyncio code: never blocks the loop.

        It awaits what ``close`` would wait for (the drained jobs, the worker threads) instead
        of blocking the loop's thread. ``drain`` as for :meth:`close`.
        """
        loop = asyncio.get_running_loop()
        if drain:
            drained: asyncio.Future[None] = loop.create_future()

            def on_idle() -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_resolve, drained)

            if self._start_draining(on_idle):
                await drained
        self._close(wait=False, close_fleet=False)
        if self._pool is not None:
            # Joining the workers waits for running sync jobs: on a helper thread, not here.
            await loop.run_in_executor(None, self._pool.shutdown, True)
        if self._fleet is not None:
            await loop.run_in_executor(None, self._fleet.close)  # round trips: not on the loop

    async def __aenter__(self) -> TenantTaskCoordinator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"<TenantTaskCoordinator {self._name!r} {self._state.value} "
            f"running={self.running}/{self._max_concurrency} queued={self.queued}>"
        )

    # -- execute -> count -> order: a subscription -------------------------------------------

    def _subscribe(
        self,
        execution: Execution[Any],
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        loop = running_loop()
        if loop is None and isinstance(scheduler, AsyncIOScheduler):
            loop = scheduler._loop
        is_async = execution.is_async
        job_loop = (self._scheduler_loop or loop) if is_async else None
        task = Task(
            self,
            execution.job,
            execution.args,
            execution.key,
            execution.deadline,
            is_async,
            observer,
            loop,
            job_loop,
            contextvars.copy_context(),
            self._retry if execution.retry_policy is None else execution.retry_policy,
        )
        if is_async and job_loop is None:
            with self._lock:
                self._table.submitted += 1
                self._table.failed += 1
            observer.on_error(RuntimeError(NO_LOOP))
            return Disposable()
        wait = self._wait if execution.wait is None else execution.wait
        with self._lock:
            state = self._table.accept(task, wait)
        if state < 0:
            observer.on_error(self._refusal(state))
            return Disposable()
        task.tel = self._tel.accepted()
        if state is RUNNING or state is GATED:
            self._turn(task)
        return task

    def _refusal(self, state: int) -> Exception:
        if state is CLOSED:
            self._tel.rejected("closed")
            return CoordinatorClosed(f"coordinator {self._name!r} is closed")
        self._tel.rejected("too_many_tasks")
        table = self._table
        error = TooManyTasks(
            f"coordinator {self._name!r}: {table.wip} jobs in progress, limit {table.limit} "
            f"(max_concurrency={self._max_concurrency} + max_queue_size={self._max_queue_size});"
            ' pass overflow="wait" to wait for room'
        )
        self._log.info("rejected: {}", error)
        return error

    # -- the awaited path ----------------------------------------------------------------------

    def _end(self, task: Task, value: Any, error: BaseException | None) -> None:
        """The task's work ended (or it never ran): retry it, or free its key and slot and
        deliver its outcome."""
        expired = task.expired
        if expired:  # its attempt ran out of time (and was stopped) with a retry in view
            task.expired = False
            value, error = None, self._timeout_error(task)
        permit = task.permit
        if permit is not None and error is None:
            try:
                permit.check()  # lapsed while the job ran: its result must not count
            except Exception as exc:
                value, error = None, exc
        if error is not None and task.retry is not None and self._retried(task, error):
            return  # it waits for its next attempt
        lock = self._lock
        lock.acquire()
        try:
            if task.state is DONE:
                return
            # An attempt that ran out of time and may not be retried after all: timed out.
            timed_out = expired and self._table.settle(task, TIMED_OUT) is not None
            decided, starts = self._table.end(task, error is not None)
            decided = decided or timed_out
            idle = self._table.wip == 0
        finally:
            lock.release()
        timer = task.timer
        if timer is not None:
            task.timer = None
            timer()
        stall = task.stall
        if stall is not None:
            task.stall = None
            stall()
        if decided and error is not None and task.attempt > 1:
            gave_up(error, task.attempt, f"coordinator {self._name!r}")
        if task.tel is not None:
            task.tel.ended(_OUTCOMES[task.verdict], error)
            task.tel = None
        task.job = None  # no references kept by a finished task
        task.inside = None
        # Start this coordinator's next jobs first: they then ask the admission before the
        # permit is handed back, and compete for it fairly.
        for started in starts:
            self._turn(started)
        ticket = task.ticket
        if ticket is not None:
            task.ticket = None
            ticket._give_back()
        if idle:
            self._became_idle()
        if decided:
            if error is not None:
                self._log.opt(exception=error).debug("job failed on {!r}", self._name)
            if task.observer is None and running_loop() is task.loop:
                task.land(value, error)  # the awaiter's own loop: no hops (bench_asyncio's rows)
            else:
                self._deliver(task, value, error)

    def _deliver(self, task: Task, value: Any, error: BaseException | None) -> None:
        """Send the outcome to the subscriber (or awaiter), on its loop if it has one."""
        loop = task.loop
        if loop is not None and running_loop() is not loop:
            try:
                loop.call_soon_threadsafe(self._deliver_now, task, value, error)
            except RuntimeError:  # the subscriber's loop is closed: nobody is listening
                self._log.warning("dropped a result: the subscriber's event loop is closed")
            return
        self._deliver_now(task, value, error)

    def _deliver_now(self, task: Task, value: Any, error: BaseException | None) -> None:
        observer = task.observer
        if observer is None:
            task.land(task.value if value is STREAMED else value, error)
            return
        try:
            if error is None:
                if value is not STREAMED:  # an Observable job's items went out already
                    observer.on_next(value)
                observer.on_completed()
            else:
                observer.on_error(cast(Exception, error))
        except Exception:  # a subscriber's bug must not break the coordinator or other jobs
            self._log.opt(exception=True).error("a subscriber of {!r} raised", self._name)

    def _deliver_item(self, task: Task, item: Any) -> None:
        """One item of an Observable job, to the subscriber (on its loop if it has one)."""
        loop = task.loop
        if loop is not None and running_loop() is not loop:
            with contextlib.suppress(RuntimeError):  # the subscriber's loop is closed
                loop.call_soon_threadsafe(self._deliver_item_now, task, item)
            return
        self._deliver_item_now(task, item)

    def _deliver_item_now(self, task: Task, item: Any) -> None:
        observer = task.observer
        if observer is None:
            task.value = item  # ``await`` gives the last item
            return
        try:
            observer.on_next(item)
        except Exception:  # a subscriber's bug must not break the coordinator or other jobs
            self._log.opt(exception=True).error("a subscriber of {!r} raised", self._name)

    def _became_idle(self) -> None:
        on_idle = self._on_idle
        if on_idle is not None:
            on_idle()
        if self._idle_callbacks:
            with self._lock:
                callbacks: list[Callable[[], object]] = []
                if self._table.wip == 0:
                    callbacks, self._idle_callbacks = self._idle_callbacks, []
            for callback in callbacks:
                callback()

    # -- cancellation --------------------------------------------------------------------------

    def _cancel(self, task: Task, outcome: int = CANCELLED, error: Exception | None = None) -> None:
        """Decide ``task``'s outcome now (a dispose, a timeout, a close) and stop its work."""
        with self._lock:
            state = task.state
            starts = self._table.settle(task, outcome)
        if starts is not None:
            self._settled(task, state, starts, error)

    def _settled(
        self, task: Task, state: int, starts: list[Task], error: BaseException | None
    ) -> None:
        """After ``settle``: stop what ``task`` was doing in ``state``; start what it freed."""
        if state is GATED:
            self._withdraw(task)
        elif state is RUNNING:
            self._stop(task)
            # Handed to its runner (or its awaiter) but not taken yet: it never starts, so its
            # slot and key go on now, as a queued task's would. The runner sets ``begun`` and
            # then looks at ``settled``; this looks at ``begun`` after ``settled`` was set: one
            # of the two sees the other's flag, and ``_end`` is once-only, so the job either
            # runs (and ends itself) or is ended here - never both, never neither.
            if not task.begun:
                self._end(task, None, None)
        elif state is RETRYING:
            timer = task.timer
            if timer is not None:
                task.timer = None
                timer()
        if task.tel is not None and (state is WAITING or state is QUEUED or state is RETRYING):
            task.tel.ended(_OUTCOMES[task.verdict])  # it never runs again
            task.tel = None
        for started in starts:
            self._turn(started)
        if error is not None:
            self._deliver(task, None, error)
        if starts or state is WAITING or state is QUEUED or state is RETRYING:
            with self._lock:
                idle = self._table.wip == 0
            if idle:
                self._became_idle()

    def _start_draining(self, on_idle: Callable[[], object]) -> bool:
        """Refuse new work and fail waiting submissions; True if ``on_idle`` will be called
        once no job is left, False if there is nothing to wait for."""
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return False
            self._state = CoordinatorState.CLOSING
            table = self._table
            table.close()
            waiting = [t for t in table.live() if t.state is WAITING]
            settled = [(t, t.state, table.settle(t, CANCELLED)) for t in waiting]
            busy = table.wip > 0
            if busy:
                self._idle_callbacks.append(on_idle)
        error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task, state, starts in settled:
            assert starts is not None
            self._settled(task, state, starts, error)
        return busy

    def _close(self, wait: bool, close_fleet: bool = True) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._state = CoordinatorState.CLOSING
            table = self._table
            table.close()
            # Settle every live task in one step, before any subscriber code runs: otherwise a
            # job finishing meanwhile could hand its slot to a queued task not yet reached.
            # Queued tasks first, so a retrying task's key goes to none of them.
            live = sorted(table.live(), key=_by_state)
            settled = [(t, t.state, table.settle(t, CANCELLED)) for t in live]
            table.purge()
        self._log.debug("closing coordinator {!r} with {} live jobs", self._name, len(settled))
        error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task, state, starts in settled:
            assert starts is not None
            self._settled(task, state, starts, error)
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        if self._fleet is not None and close_fleet:
            self._fleet.close()  # after the jobs: their permits go back first
        if isinstance(self._admission, RateAdmission):
            self._admission.close()  # its timer
        self._tel.forget(self)
        with self._lock:
            self._state = CoordinatorState.CLOSED


_OUTCOMES: Final[tuple[telemetry.JobOutcome, ...]] = (
    "completed",
    "failed",
    "cancelled",
    "timed_out",
)  # by the table's outcome (COMPLETED, FAILED, CANCELLED, TIMED_OUT)


def _counts(coordinator: TenantTaskCoordinator) -> tuple[int, int, int]:
    """``rxcoord.jobs.active``, ``queued`` and ``waiting``, read at collection."""
    counts = coordinator._table.counts
    return counts[RUNNING], counts[QUEUED] + counts[GATED] + counts[RETRYING], counts[WAITING]


def _by_state(task: Task) -> int:
    return task.state


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
