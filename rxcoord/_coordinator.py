"""TenantTaskCoordinator: Reactor's per-tenant coordinator, ported to RxPY and made correct.

The shape is the Reactor original's, kept visible::

    execute(job) --subscribe--> WIP check --> sink --> serialize_by_key(key, cap) --> admission
                                                                          |
          subscriber <-- result (after WIP is decremented) <-- job on the scheduler

* **Work in progress.** Subscribing counts the job; beyond ``max_concurrency + max_queue_size``
  the subscriber gets ``TooManyTasks`` at once and nothing is counted.
* **The sink.** Every accepted task is pushed into the ``serialize_by_key`` subscription, from
  any thread (Reactor's sink is a Subject; pushing directly saves a Subject's per-item lock and
  observer-list copy). ``serialize_by_key`` is safe with concurrent source emissions, the
  trap a Subject's unlocked fan-out sets in reactivex 6.1.
* **Ordering and the limit.** ``serialize_by_key`` orders tasks of equal key and caps active
  tasks at ``max_concurrency`` (a race-free ``flat_map(max_concurrent)``). Unkeyed tasks are
  solo items with no key, so they only share the cap.
* **The work.** ``serialize_by_key`` hands each task its turn directly (its ``start=`` seam:
  the inner-Observable protocol without a subscription): the turn drops the task if it was
  cancelled while queued, or hands the job to the scheduler; the job's end completes the
  task's lane. A submission whose key is idle while a slot is free *claims* its turn at once,
  without a pipeline item (exactly when the pipeline would have started it at once, so no
  earlier job of its key is ever overtaken). Unkeyed tasks are solo items: they share the cap
  and never enter the pipeline's key table.
* **The awaited path.** ``await execute(async_job)`` on a coordinator without an admission is
  done whole by the awaiting task (``_awaited``, one ``_Awaited`` per job): it submits, claims
  its turn or waits for it on one future, runs the job inline and reads its outcome, with the
  same counting, order, cap, timeouts and close as any subscription. With an admission it
  takes the general path (``_start`` -> ticket -> ``_admitted``, then ``run_inline``).
* **Admission and key guard.** Two seams, both optional and both given, never subclassed: an
  :class:`~rxcoord.Admission` asked for a permit when a task's turn comes (the fair-share gate
  of ``TenantScheduler``; a fleet-wide limit), and a :class:`~rxcoord.KeyGuard` a keyed job
  enters on its own thread or task before it runs (``leases=``: a distributed lease per key).
  The coordinator knows nothing of tenants or leases.
* **Cancellation.** Reactor cancels through ``timeout(cancelSignal)``. Here the per-task signal
  is the task's own settled flag (a signal that remembers having fired, like an
  ``AsyncSubject``), checked when the task would start and when its job returns; an async job
  is also cancelled on its loop.

Where the port diverges, correctness demands it:

* A cancelled or timed-out *sync* job keeps its slot until its thread returns (a Python thread
  cannot be killed); the inner completes only then. Reactor frees the slot at once and runs more
  than ``maxConcurrency`` jobs.
* WIP is decremented *before* the result is delivered, so a caller resubmitting from its
  callback is not refused spuriously; a task cancelled while queued leaves the counters at once
  (Reactor leaked its WIP slot); a failing scheduler or loop fails the task's subscriber instead
  of leaving it hanging.
* Job timeouts use one timer thread for the whole process (``rxcoord._timer``), not a thread or
  a pool worker per pending timeout; in virtual time they use the virtual scheduler's clock.
* A subscriber whose ``on_next`` raises is logged; it cannot break the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast, overload

from loguru import logger
from reactivex import Observable, Observer, abc
from reactivex.disposable import Disposable
from reactivex.scheduler import VirtualTimeScheduler
from reactivex.scheduler.eventloop import AsyncIOScheduler

from ._admission import Admission, AdmissionTicket
from ._core.checks import (
    check_count,
    check_deadline,
    check_length,
    check_name,
    check_overflow,
)
from ._core.lifecycle import Closeable, CoordinatorState
from ._core.timer import call_later
from ._core.waiter import GRANTED, PENDING
from ._core.workers import WorkerPool, hand_off
from ._errors import CoordinatorClosed, LeaseLost, TooManyTasks
from ._execution import AwaitObserver, await_submission, execution
from ._fleet import FleetAdmission, FleetPermit, FleetStats, with_permit
from ._key_guard import KeyGuard, LeaseKeyGuard
from .operators._serialize_by_key import SerializedSubscription, subscribe_serialized

if TYPE_CHECKING:
    from .leases import LeaseProvider

__all__ = ["CoordinatorStats", "TenantTaskCoordinator"]

_T = TypeVar("_T")

_get_running_loop: Final = asyncio._get_running_loop  # C fast path, no exception when none
_current_task: Final = asyncio.current_task
_OPEN: Final = CoordinatorState.OPEN  # an Enum member read through its class costs ~7x more

# Task states
_QUEUED: Final = 0
_RUNNING: Final = 1
_DONE: Final = 2
_GATED: Final = 3  # its turn came, waiting for its Admission's permit
_WAITING: Final = 4  # overflow="wait": beyond the limits, waiting for room (not yet counted)


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A consistent snapshot of a coordinator's counters.

    Every subscription to ``execute`` is ``submitted``; it ends as exactly one of ``rejected``
    (refused at subscription: ``TooManyTasks`` or ``CoordinatorClosed``), ``completed``,
    ``failed`` (the job raised, or could not be started), ``cancelled`` (the subscriber
    disposed, or the coordinator closed) or ``timed_out`` - or it is still pending.
    ``work_in_progress`` is ``queued + running``; a cancelled sync job stays ``running`` until
    its thread returns. ``waiting`` counts submissions beyond the limits waiting for room
    (``overflow="wait"``): not work in progress yet. ``fleet`` is the fleet admission's
    snapshot (fleet-wide running counts as last seen from the store) with ``fleet=``.
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

    @property
    def work_in_progress(self) -> int:
        """Jobs queued or running."""
        return self.queued + self.running


class _Task(abc.DisposableBase):
    """One accepted submission.

    ``serialize_by_key`` hands it its turn (``TenantTaskCoordinator._turn``, the pipeline's
    ``start``: the inner-Observable protocol without a subscription); the job's return
    completes its lane and frees the slot. It is also the Disposable its subscriber holds
    (``dispose`` cancels).
    """

    __slots__ = (
        "coordinator",
        "handle",
        "is_async",
        "job",
        "job_loop",
        "key",
        "lane",
        "loop",
        "observer",
        "settled",
        "state",
        "ticket",
        "timeout",
        "timer",
    )

    def __init__(
        self,
        coordinator: TenantTaskCoordinator,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        observer: abc.ObserverBase[Any],
        loop: asyncio.AbstractEventLoop | None,
        job_loop: asyncio.AbstractEventLoop | None,
        is_async: bool,
    ) -> None:
        self.coordinator = coordinator
        self.job: Callable[[], Any] | None = job
        self.key = key  # its ordering key; None: unkeyed (a solo item of the pipeline)
        self.timeout = timeout
        self.observer = observer
        self.loop = loop  # the subscriber's running loop, if any: results are delivered on it
        self.job_loop = job_loop  # where an async job runs
        self.is_async = is_async
        self.state = _QUEUED
        self.settled = False  # the subscriber got (or gave up) its outcome: the cancel signal
        self.lane: abc.ObserverBase[None] | None = None  # serialize_by_key's observer of us
        # A running async job (its future), Observable job (its _Streaming) or awaited job
        # (its _Awaited): cancel() stops it.
        self.handle: asyncio.Future[Any] | _Streaming | _Awaited | None = None
        self.timer: Callable[[], None] | None = None  # cancels the pending timeout
        self.ticket: AdmissionTicket | None = None  # asked for, or holding, an admission permit

    # -- as the subscriber's Disposable ----------------------------------------------------------

    def dispose(self) -> None:
        self.coordinator._cancel(self, None)

    def run_sync(self) -> None:
        """Run the sync job (on a worker): a bound method, no closure per job."""
        self.coordinator._run_sync(self)


class _Awaited(_Task, abc.ObserverBase[Any]):
    """``await execute(async_job)`` on a coordinator without an admission, all in one object.

    The awaiting task does the whole submission itself (``TenantTaskCoordinator._awaited``):
    it submits, waits for its turn on one future (none if the turn is free at once), runs the
    job inline and reads the outcome from here. So this object is the task, its subscriber
    (the outcome lands in it) and its cancel handle (``cancel`` cancels the awaiting task
    only while the job runs inside it, so a timeout or a close can never hit the awaiter's
    own code before or after the job).

    Everything here runs on the awaiter's loop thread: the coordinator delivers outcomes to a
    subscriber on a loop through that loop, and hands turns (``_turn``) and cancels
    (``_cancel_async``) over the same way. So none of it needs a lock. The ownership rule of
    ``rxcoord._core.waiter`` holds, confined to that thread: a turn handed to an awaiter that
    has left (``gone``) is given back at once (``_drop``), never lost; one that arrived before
    the awaiter left is given back by the awaiter.
    """

    __slots__ = ("cancelled_run", "ended", "error", "future", "gone", "inside", "turn", "value")

    def __init__(
        self,
        coordinator: TenantTaskCoordinator,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        # _Task.__init__ inlined (keep the two in step): one frame less per awaited job.
        self.coordinator = coordinator
        self.job = job
        self.key = key
        self.timeout = timeout
        # ``observer`` is the object itself (the property below): no reference cycle, so a
        # finished task is freed by its reference count, not by the cycle collector.
        self.loop = self.job_loop = loop
        self.is_async = True
        self.state = _QUEUED
        self.settled = False
        self.lane = None
        self.handle = self
        self.timer = None
        self.ticket = None
        self.turn = False  # its turn came (the lane is ours)
        self.gone = False  # the awaiter left before taking its turn
        self.ended = False  # the outcome has arrived
        self.value: Any = None
        self.error: BaseException | None = None
        self.future: asyncio.Future[None] | None = None  # what the awaiter waits on, if it waits
        self.inside: asyncio.Task[Any] | None = None  # the awaiting task, while the job runs
        self.cancelled_run = False  # cancel() cancelled the job inside the awaiting task

    @property
    def observer(self) -> abc.ObserverBase[Any]:  # type: ignore[override]
        return self  # the subscriber is the task itself

    def hand(self) -> None:
        """Its turn came (on the loop thread)."""
        if self.gone:
            self.coordinator._drop(self)
            return
        self.turn = True
        self._wake()

    def cancel(self) -> None:
        """A timeout, close or fault cancels the job: the awaiting task, if the job runs in it."""
        inside = self.inside
        if inside is not None:
            self.inside = None
            self.cancelled_run = True
            inside.cancel()

    def _wake(self) -> None:
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    def on_next(self, value: Any) -> None:
        self.value = value

    def on_error(self, error: Exception) -> None:
        if isinstance(error, StopIteration):  # as asyncio would refuse it from a future
            wrapped = RuntimeError(f"the job raised {error!r}")
            wrapped.__cause__ = error
            self.error = wrapped
        else:
            self.error = error
        self.ended = True
        self._wake()

    def on_completed(self) -> None:
        self.ended = True
        self._wake()

    def result(self) -> Any:
        """The outcome that has arrived: the job's value, or raise its error."""
        error = self.error
        if error is not None:
            self.error = None  # no reference cycle through the traceback
            raise error
        return self.value

    async def outcome(self) -> Any:
        """The outcome, once it arrives (a timeout or close decided elsewhere sends it later)."""
        loop = self.loop
        assert loop is not None
        while not self.ended:
            self.future = loop.create_future()
            await self.future
        self.future = None
        return self.result()


_is_settled: Final = attrgetter("settled")  # a queued task cancelled: the pipeline may drop it
_PURGE_AT_LEAST: Final = 64  # tombstones (cancelled queued tasks) that make a purge worth it
# What _settle leaves to do outside the lock: state, async handle, timer cancel, idle, purge.
_Cleanup = tuple[int, "asyncio.Future[Any] | _Streaming | _Awaited | None", Any, bool, bool]
_NO_TOKEN: Final = object()  # a job that entered no key guard
# Exact types of values a sync job returns that are neither an Observable nor an awaitable.
_PLAIN: Final = frozenset({type(None), bool, int, float, str, bytes, tuple, list, dict})

# What _accept decided for a new submission (or the error it refuses it with).
_QUEUE: Final = 0  # counted as queued: push it into the pipeline
_CLAIMED: Final = 1  # counted as running, its turn claimed from the pipeline: start it now
_PARKED: Final = 2  # waiting for room (overflow="wait")
_PARKED_ADMIT: Final = 3  # waiting for room behind others: move waiters in now


class TenantTaskCoordinator(Closeable):
    """Runs jobs with a concurrency limit, a bounded queue, per-key ordering and cancellation.

    ``execute(job)`` returns a cold Observable: each subscription submits the job once; it emits
    the job's return value and completes, or errors with the job's own exception. Subscribing
    counts the job as work in progress; beyond ``max_concurrency + max_queue_size`` the
    subscriber gets :class:`TooManyTasks` at once. At most ``max_concurrency`` jobs run at any
    moment, also while a cancelled sync job is still running. Jobs with equal ``key`` run one
    at a time in subscription order. Disposing the subscription cancels: a queued job never
    starts; a running async job gets ``asyncio.CancelledError``; a running sync job's result is
    discarded (its thread cannot be stopped, so it keeps its slot until it returns).

    Sync jobs run on ``scheduler`` (by default on worker threads the coordinator owns, at most
    ``max_concurrency``, shut down by :meth:`close`). ``async def`` jobs run on the asyncio loop
    running where the Observable is subscribed, or on the loop of an ``AsyncIOScheduler`` given
    as ``scheduler``. Subscribers that subscribe on a running loop get their results on it, so
    ``await coordinator.execute(job)`` works, and so does ``execute(job).run()``.

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
            across processes. Shorthand for ``key_guard=LeaseKeyGuard(leases, name, ...)``.
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

    Raises:
        TypeError: an argument has the wrong type (``leases`` not a lease provider, ``name``
            not a str, ...).
        ValueError: a limit or a duration is out of range, or both ``leases`` and
            ``key_guard`` are given.
    """

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
        overflow: str = "reject",
    ) -> None:
        self._max_concurrency = check_count(max_concurrency, "max_concurrency", 1)
        self._max_queue_size = check_count(max_queue_size, "max_queue_size", 0)
        self._limit = max_concurrency + max_queue_size
        self._name = check_name(name)
        self._timeout = check_deadline(timeout)
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
        self._fleet: FleetAdmission | None = None
        if fleet is not None:
            if admission is not None:
                raise ValueError("pass fleet= or admission=, not both")
            # Every coordinator named like this one on the same store shares max_concurrency.
            self._fleet = FleetAdmission(
                fleet, name, max_concurrency, permit_at_most_for=permit_for
            )
            admission = self._fleet.lane(name)
        self._admission = admission
        # ``await`` of an async job: the awaiting task does it all (``_awaited``), except with
        # an admission, whose ticket must come between the turn and the start. Bound once.
        self._awaited_path = self._awaited if admission is None else None
        if on_idle is not None and not callable(on_idle):
            raise TypeError(f"on_idle must be callable or None, not {on_idle!r}")
        self._on_idle = on_idle
        self._lock = threading.Lock()
        self._state = CoordinatorState.OPEN
        self._closing = False  # close() has begun settling (after a drain, or at once)
        self._tasks: set[_Task] = set()  # unsettled or still running: what close() must reach
        self._queued = 0
        self._running = 0
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._rejected = 0
        self._cancelled = 0
        self._timed_out = 0
        self._tombstones = 0  # tasks cancelled while queued, still in the pipeline's queues
        self._wait = check_overflow(overflow)
        # overflow="wait": submissions waiting for room, in FIFO order (cancelled ones are
        # skipped when reached), and whether a thread is moving them into the pipeline.
        self._waiters: deque[_Task] = deque()
        self._waiting_count = 0
        self._admitting = False
        self._idle_callbacks: list[Callable[[], object]] = []  # a draining close waits here

        self._scheduler: abc.SchedulerBase | None = None
        self._pool: WorkerPool | None = None
        self._owns_pool = False
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        self._virtual: VirtualTimeScheduler | None = None
        if scheduler is None:
            self._pool = WorkerPool(max_concurrency, f"rxcoord-{name or 'coordinator'}")
            self._owns_pool = True
        elif isinstance(scheduler, WorkerPool):  # internal: a pool shared with its owner
            self._pool = scheduler
        elif isinstance(scheduler, AsyncIOScheduler):
            self._scheduler = scheduler
            self._scheduler_loop = scheduler._loop
        elif isinstance(scheduler, VirtualTimeScheduler):
            self._scheduler = self._virtual = scheduler
        elif isinstance(scheduler, abc.SchedulerBase):
            self._scheduler = scheduler
        else:
            raise TypeError(f"scheduler must be a reactivex scheduler or None, not {scheduler!r}")

        self._pipeline = self._build_pipeline()

    def _became_idle(self) -> None:
        on_idle = self._on_idle
        if on_idle is not None:
            on_idle()
        if self._idle_callbacks:
            with self._lock:
                callbacks: list[Callable[[], object]] = []
                if self._queued + self._running == 0:
                    callbacks, self._idle_callbacks = self._idle_callbacks, []
            for callback in callbacks:
                callback()

    def _build_pipeline(self) -> SerializedSubscription[_Task, None]:
        """The pipeline: per-key order and the cap; each task runs itself.

        That is ``sink.pipe(serialize_by_key(...)).subscribe(on_error=...)`` with the task sink
        being the pipeline's own ``push`` (Reactor's sink is a Subject; a Subject would add a
        lock and a copy of its observer list per job), subscribed through
        ``subscribe_serialized`` to keep the subscription's ``purge()`` (see ``_settle``).
        """
        return subscribe_serialized(
            None,
            attrgetter("key"),  # unkeyed tasks go in solo (push_solo): never looked up
            None,
            Observer(on_error=self._pipeline_fault),
            max_concurrent=self._max_concurrency,
            start=self._turn,  # each task runs itself when its turn comes
        )

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
            return self._queued + self._running

    @property
    def running(self) -> int:
        """Jobs running now, including cancelled sync jobs whose thread has not returned."""
        return self._running

    @property
    def queued(self) -> int:
        """Jobs accepted and waiting for their turn."""
        return self._queued

    def stats(self) -> CoordinatorStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return CoordinatorStats(
                name=self._name,
                submitted=self._submitted,
                completed=self._completed,
                failed=self._failed,
                rejected=self._rejected,
                cancelled=self._cancelled,
                timed_out=self._timed_out,
                queued=self._queued,
                running=self._running,
                max_concurrency=self._max_concurrency,
                max_queue_size=self._max_queue_size,
                waiting=self._waiting_count,
                fleet=None if self._fleet is None else self._fleet.stats(),
            )

    @overload
    def execute(
        self,
        job: Callable[[], Awaitable[_T]],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: str | None = None,
    ) -> Observable[_T]: ...

    @overload
    def execute(
        self,
        job: Callable[[], _T],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: str | None = None,
    ) -> Observable[_T]: ...

    def execute(
        self,
        job: Callable[[], Any],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
        overflow: str | None = None,
    ) -> Observable[Any]:
        """Return a cold Observable that runs ``job`` under this coordinator once per subscription.

        Args:
            job: A callable ``() -> T`` (runs on the scheduler) or an ``async def`` function
                (awaited on the subscriber's asyncio loop or the AsyncIOScheduler's).
            key: Jobs with equal keys run one at a time in subscription order; ``None`` for no
                ordering.
            timeout: Seconds the job may run, counted from its start; overrides the
                coordinator's default.
            overflow: ``"reject"`` or ``"wait"`` for this call; ``None``: the coordinator's.

        Returns:
            An Observable emitting the job's result once, or erroring with the job's exception,
            ``TooManyTasks``, ``CoordinatorClosed`` or ``TimeoutError``.

        Raises:
            TypeError: ``job`` is not callable, ``key`` is unhashable, or ``timeout`` is not a
                number.
            ValueError: ``timeout`` is not positive, ``overflow`` not one of the two strings.
        """
        return execution(
            self._submit,
            job,
            key,
            timeout,
            self._timeout,
            overflow,
            self._awaited_path,
        )

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
            loop = _get_running_loop()
            with self._lock:
                blocked = loop is not None and any(t.job_loop is loop for t in self._tasks)
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
        if self._owns_pool:
            assert self._pool is not None
            # Joining the workers waits for running sync jobs: on a helper thread, not here.
            await loop.run_in_executor(None, self._pool.shutdown, True)
        if self._fleet is not None:
            await loop.run_in_executor(None, self._fleet.close)  # round trips: not on the loop

    async def __aenter__(self) -> TenantTaskCoordinator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _start_draining(self, on_idle: Callable[[], object]) -> bool:
        """Refuse new work and fail waiting submissions; True if ``on_idle`` will be called
        once no job is left, False if there is nothing to wait for."""
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return False
            self._state = CoordinatorState.CLOSING
            waiting = [task for task in self._waiters if not task.settled]
            settled = [(task, self._settle(task)) for task in waiting]
            busy = self._queued + self._running > 0
            if busy:
                self._idle_callbacks.append(on_idle)
        error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task, cleanup in settled:
            self._after_settle(task, cleanup, error)
        return busy

    def _close(self, wait: bool, close_fleet: bool = True) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._state = CoordinatorState.CLOSING
            # Settle every live task in one step, before any subscriber code runs: otherwise a
            # job finishing meanwhile could hand its slot to a queued task not yet reached.
            settled = [(task, self._settle(task)) for task in list(self._tasks) if not task.settled]
        self._log.debug("closing coordinator {!r} with {} live jobs", self._name, len(settled))
        error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task, cleanup in settled:
            self._after_settle(task, cleanup, error)
        self._pipeline.dispose()
        if self._owns_pool:
            assert self._pool is not None
            self._pool.shutdown(wait=wait)
        if self._fleet is not None and close_fleet:
            self._fleet.close()  # after the jobs: their permits go back first
        with self._lock:
            self._state = CoordinatorState.CLOSED

    def __repr__(self) -> str:
        return (
            f"<TenantTaskCoordinator {self._name!r} {self._state.value} "
            f"running={self._running}/{self._max_concurrency} queued={self._queued}>"
        )

    # -- submission ----------------------------------------------------------------------------

    def _submit(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        wait: bool | None,
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        loop = _get_running_loop()
        if loop is None and isinstance(scheduler, AsyncIOScheduler):
            loop = scheduler._loop
        job_loop = (self._scheduler_loop or loop) if is_async else None
        task = _Task(self, job, key, timeout, observer, loop, job_loop, is_async)
        # The fast lane (a turn claimed at once, no pipeline item) only where starting the job
        # cannot run it right here: a scheduler that runs jobs synchronously would recurse
        # through resubmitting subscribers, which the pipeline's trampoline turns into a loop.
        claim = self._admission is None and (
            is_async or self._pool is not None or self._scheduler_loop is not None
        )
        with self._lock:
            verdict = self._accept(task, wait, claim)
        if verdict is _QUEUE:
            self._push(task)
        elif verdict is _CLAIMED:
            self._begin(task)
        elif verdict is _PARKED_ADMIT:
            self._admit_waiting()
        elif verdict is not _PARKED:
            error = cast(Exception, verdict)
            if isinstance(error, TooManyTasks):
                self._log.info("rejected: {}", error)
            observer.on_error(error)
            return Disposable()
        return task

    def _accept(self, task: _Task, wait: bool | None, claim: bool) -> int | Exception:
        """Count a new submission and decide where it goes (lock held); an error refuses it.

        ``claim``: a submission that may start at once takes its turn from the pipeline right
        here (``serialize_by_key``'s ``claim``: its key idle, a slot free), counted as running,
        instead of going through the pipeline's queues.
        """
        self._submitted += 1
        if self._state is not _OPEN:
            self._rejected += 1
            return CoordinatorClosed(f"coordinator {self._name!r} is closed")
        if task.is_async and task.job_loop is None:
            self._failed += 1
            return RuntimeError(
                "an async job needs a running asyncio loop: subscribe from asyncio code (e.g. "
                "`await coordinator.execute(job)`) or pass scheduler=AsyncIOScheduler(loop)"
            )
        if self._waiters or self._admitting:
            # Others wait for room already: FIFO, nobody overtakes them (per-key order
            # is subscription order). A rejecting call is refused only when really full.
            if not (self._wait if wait is None else wait) and (
                self._queued + self._running >= self._limit
            ):
                return self._too_many()
            self._park(task)
            return _PARKED_ADMIT
        if self._queued + self._running >= self._limit:
            if self._wait if wait is None else wait:
                self._park(task)
                return _PARKED  # admitted when room frees up
            return self._too_many()
        self._tasks.add(task)
        if claim:
            key = task.key
            pipeline = self._pipeline
            lane = pipeline.claim_solo() if key is None else pipeline.claim(key)
            if lane is not None:
                task.lane = lane
                task.state = _RUNNING
                self._running += 1
                return _CLAIMED
        self._queued += 1
        return _QUEUE

    def _push(self, task: _Task) -> None:
        """Queue ``task`` in the pipeline: by its key, or solo (unkeyed: it only shares the cap)."""
        if task.key is None:
            self._pipeline.push_solo(task)
        else:
            self._pipeline.push(task)

    def _too_many(self) -> TooManyTasks:
        """Count a rejection; the error that says why (lock held)."""
        self._rejected += 1
        return TooManyTasks(
            f"coordinator {self._name!r}: {self._queued + self._running} jobs in "
            f"progress, limit {self._limit} (max_concurrency={self._max_concurrency} + "
            f'max_queue_size={self._max_queue_size}); pass overflow="wait" to wait for room'
        )

    def _park(self, task: _Task) -> None:
        """Make ``task`` wait for room, behind every earlier waiter (lock held)."""
        task.state = _WAITING
        self._waiters.append(task)
        self._waiting_count += 1
        self._tasks.add(task)

    def _admit_waiting(self) -> None:
        """Move waiting submissions into the pipeline while there is room, in FIFO order.

        One thread at a time does it (``_admitting``), so the order of waiters is the order
        they enter the pipeline; others that free room meanwhile leave it to that thread,
        which looks again before it stops.
        """
        with self._lock:
            if self._admitting or not self._waiters:
                return
            self._admitting = True
        try:
            while True:
                with self._lock:
                    waiters = self._waiters
                    while waiters and waiters[0].settled:
                        waiters.popleft()  # withdrawn while waiting
                    if not (
                        waiters
                        and self._queued + self._running < self._limit
                        and self._state is CoordinatorState.OPEN
                    ):
                        self._admitting = False
                        return
                    task = waiters.popleft()
                    task.state = _QUEUED
                    self._waiting_count -= 1
                    self._queued += 1
                self._push(task)
        except BaseException:
            with self._lock:
                self._admitting = False
            raise

    # -- running -------------------------------------------------------------------------------

    def _turn(self, task: _Task, lane: abc.ObserverBase[None]) -> None:
        """The pipeline's ``start``: ``task``'s turn came (on the thread that freed its slot)."""
        task.lane = lane
        if type(task) is not _Awaited:
            self._start(task)
            return
        # Its awaiting task starts it, on its loop (``_awaited``).
        loop = task.loop
        assert loop is not None
        if _get_running_loop() is loop:  # (task.hand() inlined: the common case)
            if task.gone:
                self._drop(task)
                return
            task.turn = True
            future = task.future
            if future is not None and not future.done():
                future.set_result(None)
            return
        try:
            loop.call_soon_threadsafe(task.hand)
        except RuntimeError:  # the awaiter's loop is closed: nobody will take the turn
            self._cancel(task, None)
            self._drop(task)

    def _drop(self, task: _Task) -> None:
        """A turn came for a task settled while queued (it never starts): pass the slot on."""
        with self._lock:
            task.state = _DONE
            self._tombstones = max(0, self._tombstones - 1)  # it has left the queue
        self._release_slot(task)

    def _start(self, task: _Task) -> None:
        """The task's turn came (serialize_by_key handed it over): start the job, or drop it."""
        admission = self._admission
        with self._lock:
            if task.settled:  # cancelled (or closed) while queued: it never starts
                task.state = _DONE
                drop = True
                self._tombstones = max(0, self._tombstones - 1)  # it has left the queue
            elif admission is not None:
                task.state = _GATED
                drop = False
            else:
                task.state = _RUNNING
                self._queued -= 1
                self._running += 1
                drop = False
        if drop:
            self._release_slot(task)
        elif admission is not None:
            key = task.key
            ticket = AdmissionTicket(admission.release, key)
            task.ticket = ticket
            ticket._waiter.bind(lambda: self._admitted(task))
            admission.request(ticket)  # counted as queued until the permit comes
            # A dispose before the ticket existed could not withdraw it: take it back now, or
            # it would wait for a permit nobody wants.
            with self._lock:
                stranded = task.settled and task.state is _GATED
            if stranded and self._withdraw(task):
                self._became_idle()
        else:
            self._begin(task)

    def _admitted(self, task: _Task) -> None:
        """The admission granted ``task``'s ticket (on the granting thread): run the job."""
        ticket = task.ticket
        assert ticket is not None
        if ticket._waiter.take() is None:
            return  # the task left first: the ticket gave the permit back, _withdraw cleaned up
        with self._lock:
            self._queued -= 1
            if task.settled:  # settled after the take: _withdraw found it taken, so we clean up
                task.state = _DONE
                task.ticket = None
                self._tasks.discard(task)
                idle = self._queued + self._running == 0
            else:
                task.state = _RUNNING
                self._running += 1
        if task.state is _DONE:
            self._release_slot(task)
            ticket._give_back()
            if idle:
                self._became_idle()
            return
        if ticket.error is not None:  # refused (its store is down): the job fails unrun
            task.ticket = None
            self._finish(task, None, ticket.error)
            return
        permit = ticket.permit
        if type(permit) is FleetPermit:  # current_permit() inside the job
            assert task.job is not None
            task.job = with_permit(task.job, permit, task.is_async)
        self._begin(task)

    def _begin(self, task: _Task) -> None:
        """Run the job now: arm its timeout (counted from here) and hand it off."""
        if task.timeout is not None:
            self._arm_timeout(task, task.timeout)
        try:
            if task.is_async:
                self._start_async(task)
            elif self._pool is not None:
                self._pool.submit(task.run_sync)  # a bound method: no closure per job
            elif self._scheduler_loop is not None:
                # AsyncIOScheduler is not thread-safe: hop onto its loop the thread-safe way.
                self._scheduler_loop.call_soon_threadsafe(self._run_sync, task)
            else:
                assert self._scheduler is not None
                self._scheduler.schedule(lambda _s, _st: self._run_sync(task))
        except Exception as exc:  # the scheduler or the loop itself failed: tell the caller
            self._log.opt(exception=True).error("could not start a job on {!r}", self._name)
            self._finish(task, None, exc)

    def _run_sync(self, task: _Task) -> None:
        job = task.job
        value: Any = None
        error: BaseException | None = None
        guard = self._guard
        token: Any = _NO_TOKEN
        if job is not None and not task.settled:  # not cancelled between hand-off and now
            try:
                if guard is not None and task.key is not None:
                    # Keyed: enter the key guard too (blocking here is fine: this thread is
                    # the job's), so the key is exclusive beyond this coordinator as well.
                    token = guard.enter(task.key)
                value = job()
            except BaseException as exc:  # the job's error goes to its subscriber
                error = exc
            if error is None and type(value) in _PLAIN:
                pass  # a plain value (the common case): none of the checks below can match
            elif error is None and isinstance(value, abc.ObservableBase):
                # An Observable job: run it to its end (still under the guard and its slot),
                # forwarding every item it emits.
                self._continue_observable(task, value, token)
                return
            elif error is None and (inspect.iscoroutine(value) or asyncio.isfuture(value)):
                # ``lambda: fetch(i)`` is an async job in disguise: await what it returned
                # (still under the guard, which is exited when the awaitable is done).
                self._continue_async(task, value, token)
                return
            if token is not _NO_TOKEN:
                assert guard is not None
                try:
                    guard.exit(token)  # LeaseLost if it expired: the work may overlap another's
                except Exception as exc:
                    if error is None:
                        value, error = None, exc
                    else:
                        self._log.opt(exception=True).warning("leaving the key guard failed")
        self._finish(task, value, error)

    def _continue_async(self, task: _Task, awaitable: Any, token: Any = _NO_TOKEN) -> None:
        loop = self._scheduler_loop or task.loop
        if loop is None:
            self._discard_awaitable(awaitable, token)
            self._finish(
                task,
                None,
                RuntimeError(
                    "the job returned an awaitable but no asyncio loop is known: subscribe from "
                    "asyncio code or pass scheduler=AsyncIOScheduler(loop)"
                ),
            )
            return
        if task.settled:  # cancelled (or timed out) while the sync part ran
            self._discard_awaitable(awaitable, token)
            self._finish(task, None, None)
            return
        task.job_loop = loop
        if token is not _NO_TOKEN:
            guard = self._guard
            assert guard is not None
            task.job = lambda: _awaited_then_exited(awaitable, guard, token)
        else:
            task.job = lambda: awaitable
        try:
            self._start_async(task)
        except Exception as exc:  # e.g. the loop was closed meanwhile: tell the caller
            self._discard_awaitable(awaitable, token)
            self._finish(task, None, exc)

    def _continue_observable(self, task: _Task, observable: Any, token: Any) -> None:
        streaming = _Streaming(self, task, token)
        with self._lock:
            cancelled = task.settled
            if not cancelled:
                task.handle = streaming  # cancel() disposes it (dispose, timeout, close)
        if cancelled:
            streaming.end(None)
            return
        try:
            subscription = observable.subscribe(
                streaming.on_next, streaming.on_error, streaming.on_completed
            )
        except Exception as exc:
            streaming.end(exc)
            return
        streaming.attach(subscription)

    def _deliver_item(self, task: _Task, item: Any) -> None:
        """One item of an Observable job, to the subscriber (on its loop if it has one)."""
        loop = task.loop
        if loop is not None and _get_running_loop() is not loop:
            with contextlib.suppress(RuntimeError):  # the subscriber's loop is closed
                loop.call_soon_threadsafe(self._deliver_next, task.observer, item)
            return
        self._deliver_next(task.observer, item)

    def _deliver_next(self, observer: abc.ObserverBase[Any], item: Any) -> None:
        try:
            observer.on_next(item)
        except Exception:  # a subscriber's bug must not break the coordinator or other jobs
            self._log.opt(exception=True).error("a subscriber of {!r} raised", self._name)

    def _discard_awaitable(self, awaitable: Any, token: Any) -> None:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never awaited: say so, not with a RuntimeWarning
        if token is not _NO_TOKEN:
            assert self._guard is not None
            with contextlib.suppress(Exception):
                self._guard.exit(token)

    def _start_async(self, task: _Task) -> None:
        loop = task.job_loop
        assert loop is not None
        observer = task.observer
        if type(observer) is AwaitObserver and task.is_async and observer.loop is loop:
            # ``await execute(job)``: the job runs inside the awaiting task, no task of its own.
            if _get_running_loop() is loop:
                observer.hand(task)
            else:
                loop.call_soon_threadsafe(observer.hand, task)
            return

        def create() -> None:
            job = task.job
            if job is None or task.settled:
                self._finish(task, None, None)
                return
            try:
                awaitable = self._awaitable(task, job)
                if inspect.iscoroutine(awaitable):
                    future: asyncio.Future[Any] = loop.create_task(awaitable)
                else:
                    future = asyncio.ensure_future(awaitable, loop=loop)
            except BaseException as exc:  # reported to the subscriber
                self._finish(task, None, exc)
                return
            with self._lock:
                cancel = task.settled  # cancelled while the loop got round to us
                task.handle = future
            future.add_done_callback(lambda f: self._async_done(task, f))
            if cancel:
                future.cancel()

        if _get_running_loop() is loop:
            create()
        else:
            loop.call_soon_threadsafe(create)

    def _awaitable(self, task: _Task, job: Callable[[], Any]) -> Any:
        """What an async job's run awaits: the job's awaitable, inside the key guard if any."""
        awaitable = job()
        guard = self._guard
        if guard is not None and task.key is not None and task.is_async:
            awaitable = _guarded(guard, task.key, awaitable)
        return awaitable

    def _abandon(self, task: _Task) -> None:
        """A turn handed to an awaiter that had gone (its task was cancelled): free the slot."""
        self._finish(task, None, None)

    async def run_inline(self, task: _Task, observer: AwaitObserver) -> Any:
        """Run an async job's turn in the awaiting task itself; its outcome, or its error.

        This is ``await execute(job)``'s fast path: no task per job, and a job that can start
        at once starts without a trip through the event loop. Cancellation keeps its meaning:
        a dispose, a timeout or a close cancels the awaiting task inside the job (and the
        awaiter gets ``TimeoutError`` / ``CoordinatorClosed``, as it would otherwise); the
        awaiting task's own cancellation cancels the job.
        """
        job = task.job
        if job is None or task.settled:  # timed out or closed between the turn and now
            self._finish(task, None, None)
            return await observer.outcome()
        current = asyncio.current_task()
        try:
            awaitable = self._awaitable(task, job)
        except BaseException as exc:  # reported like any job error
            self._finish(task, None, exc)
            return await observer.outcome()
        with self._lock:
            cancelled = task.settled
            task.handle = current
        if cancelled:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            self._finish(task, None, None)
            return await observer.outcome()
        try:
            value = await awaitable
        except asyncio.CancelledError as exc:
            with self._lock:
                ours = task.settled  # a timeout, close or dispose settled it, then cancelled us
                task.handle = None
            if not ours:  # the awaiting task itself was cancelled: that cancels the job
                self._cancel(task, None)
                self._finish(task, None, None)
                raise
            self._finish(task, None, exc)
            if current is not None:
                current.uncancel()  # the cancellation was our means, not the awaiter's wish
            return await observer.outcome()
        except BaseException as exc:
            self._finish(task, None, exc)
            return await observer.outcome()
        self._finish(task, value, None)
        return await observer.outcome()

    async def _awaited(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,  # noqa: ASYNC109 - the job's, counted from its start
        wait: bool | None,
    ) -> Any:
        """``await execute(async_job)`` without an admission: the whole submission, here.

        Same contract as subscribing (counting, ``TooManyTasks`` or waiting for room, per-key
        order, the cap, timeouts from the start, close), minus its objects: the awaiting task
        submits, claims its turn at once when its key is idle and a slot is free (or waits for
        it on one future), runs the job inline and takes the outcome from its ``_Awaited``. A
        timeout, a close or a dispose cancels the awaiting task while the job runs in it (the
        awaiter then gets ``TimeoutError`` / ``CoordinatorClosed``); cancelling the awaiting
        task cancels the job, or withdraws it if it has not started.
        """
        loop = _get_running_loop()
        assert loop is not None  # a coroutine runs on a loop
        if self._scheduler_loop is not None and self._scheduler_loop is not loop:
            # Its jobs run on the scheduler's loop: not inline in this one.
            return await await_submission(self._submit, job, key, timeout, True, wait)
        task = _Awaited(self, job, key, timeout, loop)
        lock = self._lock
        lock.acquire()  # explicit acquire/release: half a ``with`` block, on the hot path
        try:
            verdict = self._accept(task, wait, True)
        finally:
            lock.release()
        if verdict is not _CLAIMED:
            if verdict is _QUEUE:
                self._push(task)  # the turn may come inside: ``hand`` sets ``turn``
            elif verdict is _PARKED_ADMIT:
                self._admit_waiting()
            elif verdict is not _PARKED:
                if isinstance(verdict, TooManyTasks):
                    self._log.info("rejected: {}", verdict)
                raise cast(Exception, verdict)
            if not task.turn and not task.ended:
                task.future = future = loop.create_future()
                try:
                    await future
                except asyncio.CancelledError:
                    # The awaiter leaves: a waiting or queued job is withdrawn and never runs;
                    # a turn that came meanwhile is given back, as is one still on its way.
                    task.future = None
                    task.gone = True
                    self._cancel(task, None)
                    if task.turn:
                        self._drop(task)
                    raise
                task.future = None
            if not task.turn:  # an outcome instead: closed (or a pipeline fault) meanwhile
                return task.result()
            lock.acquire()
            try:
                start = not task.settled
                if start:
                    task.state = _RUNNING
                    self._queued -= 1
                    self._running += 1
                else:  # cancelled (closed) after its turn came: it never starts
                    task.state = _DONE
                    self._tombstones = max(0, self._tombstones - 1)
            finally:
                lock.release()
            if not start:
                self._release_slot(task)
                return await task.outcome()
        # Its turn: run the job in this task. From here a timeout, close or dispose cancels
        # this task (task.cancel) while the job runs in it, and only then.
        current = _current_task(loop)
        if task.timeout is not None:
            self._arm_timeout(task, task.timeout)
        run = task.job
        try:
            if run is None or task.settled:  # closed meanwhile
                self._end(task, None, None)
                return await task.outcome()
            awaitable = run()
            if self._guard is not None and task.key is not None:
                awaitable = _guarded(self._guard, task.key, awaitable)
        except BaseException as exc:  # reported like any job error
            self._end(task, None, exc)
            return await task.outcome()
        task.inside = current
        try:
            value = await awaitable
        except asyncio.CancelledError as exc:
            task.inside = None
            if not task.cancelled_run:  # the awaiting task itself was cancelled: so is the job
                self._cancel(task, None)
                self._end(task, None, None)
                raise
            # The cancellation was our means (a timeout, close or dispose), not the awaiter's
            # wish - unless it was cancelled as well, which then wins.
            assert current is not None
            self._end(task, None, exc)
            if current.uncancel():
                raise
            return await task.outcome()
        except BaseException as exc:
            task.inside = None
            self._end(task, None, exc)
        else:
            task.inside = None
            self._end(task, value, None)
        if task.cancelled_run:  # the job swallowed our cancellation: take it back
            assert current is not None
            current.uncancel()
        if task.ended:
            return task.result()
        return await task.outcome()

    def _end(self, task: _Awaited, value: Any, error: BaseException | None) -> None:
        """``_finish`` for an awaited job, in its awaiting task: the outcome goes straight in.

        The same steps in the same order (free the slot, then deliver), minus the hops a
        subscriber on another thread would need: this runs on the awaiter's loop thread.
        """
        with self._lock:
            if task.state is _DONE:
                return
            deliver, timer = self._done(task, error)
            idle = self._queued + self._running == 0
        if timer is not None:
            timer()
        self._release_slot(task)
        if idle and (self._on_idle is not None or self._idle_callbacks):
            self._became_idle()
        if deliver:
            if error is None:
                task.value = value
                task.ended = True
            else:
                self._log.opt(exception=error).debug("job failed on {!r}", self._name)
                task.on_error(cast(Exception, error))

    def _async_done(self, task: _Task, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._finish(task, None, asyncio.CancelledError())
        else:
            self._finish(
                task, future.result() if future.exception() is None else None, future.exception()
            )

    def _finish(self, task: _Task, value: Any, error: BaseException | None) -> None:
        """The job returned (or never could start): free the slot, then deliver the outcome."""
        ticket = task.ticket
        if ticket is not None and error is None and type(ticket.permit) is FleetPermit:
            try:
                ticket.permit.check()  # lapsed while the job ran: its result must not count
            except LeaseLost as exc:
                value, error = None, exc
        with self._lock:
            if task.state is _DONE:
                return
            deliver, timer = self._done(task, error)
            ticket = task.ticket
            task.ticket = None
            idle = self._queued + self._running == 0
        if timer is not None:
            timer()
        # Free this coordinator's own slot first: its next job then asks the admission before
        # the permit is handed out, and competes for it fairly.
        self._release_slot(task)
        if ticket is not None:
            ticket._give_back()
        if idle:
            self._became_idle()
        if deliver:
            if error is None:
                self._deliver(task, value, None)
            else:
                self._log.opt(exception=error).debug("job failed on {!r}", self._name)
                self._deliver(task, None, error)

    def _done(
        self, task: _Task, error: BaseException | None
    ) -> tuple[bool, Callable[[], None] | None]:
        """Lock held: a running task ends - counters and the task's references; whether its
        outcome is to be delivered, and its timeout's cancel."""
        task.state = _DONE
        self._running -= 1
        self._tasks.discard(task)
        deliver = not task.settled
        if deliver:
            task.settled = True
            if error is None:
                self._completed += 1
            else:
                self._failed += 1
        timer = task.timer
        task.timer = None
        task.job = None
        task.handle = None  # an awaited task's reference to itself: freed by refcount, not GC
        return deliver, timer

    def _release_slot(self, task: _Task) -> None:
        lane = task.lane
        task.lane = None
        if lane is not None:
            lane.on_completed()  # serialize_by_key starts the next task (just a hand-off)
        if self._waiters:  # room freed up: let submissions waiting for it in
            self._admit_waiting()

    # -- outcomes ------------------------------------------------------------------------------

    def _deliver(self, task: _Task, value: Any, error: BaseException | None) -> None:
        """Send the outcome to the subscriber, on its loop if it subscribed on one."""
        loop = task.loop
        if loop is not None and _get_running_loop() is not loop:
            try:
                loop.call_soon_threadsafe(self._deliver_now, task.observer, value, error)
            except RuntimeError:  # the subscriber's loop is closed: nobody is listening
                self._log.warning("dropped a result: the subscriber's event loop is closed")
            return
        self._deliver_now(task.observer, value, error)

    def _deliver_now(
        self, observer: abc.ObserverBase[Any], value: Any, error: BaseException | None
    ) -> None:
        try:
            if error is None:
                if value is not _STREAMED:  # an Observable job's items went out already
                    observer.on_next(value)
                observer.on_completed()
            else:
                observer.on_error(cast(Exception, error))
        except Exception:  # a subscriber's bug must not break the coordinator or other jobs
            self._log.opt(exception=True).error("a subscriber of {!r} raised", self._name)

    def _cancel(self, task: _Task, error: Exception | None) -> None:
        """Cancel ``task``: on its subscriber's dispose (``error`` None) or a pipeline fault."""
        with self._lock:
            if task.settled:
                return
            cleanup = self._settle(task)
        self._after_settle(task, cleanup, error)

    def _settle(self, task: _Task) -> _Cleanup:
        """Mark an unsettled task cancelled (lock held); what is left to do outside the lock."""
        task.settled = True
        self._cancelled += 1
        state = task.state
        idle = purge = False
        if state is _WAITING:
            # Never counted as work in progress: it just stops waiting. Its deque entry is
            # skipped when reached; purge the deque once such entries outnumber live ones.
            self._waiting_count -= 1
            self._tasks.discard(task)
            task.job = None
            if len(self._waiters) > 2 * self._waiting_count + _PURGE_AT_LEAST:
                self._waiters = deque(t for t in self._waiters if not t.settled)
        elif state is _QUEUED:
            # Leaves the counters at once; the pipeline drops it when its turn comes. Until
            # then it is a tombstone in the pipeline's queues, which the WIP limit no longer
            # bounds (a stuck job and callers that keep giving up would pile them up without
            # end): once they outnumber the live queued tasks, purge them, at O(1) amortized.
            self._queued -= 1
            self._tasks.discard(task)
            task.job = None
            idle = self._queued + self._running == 0
            self._tombstones += 1
            if self._purge_due():
                self._tombstones = 0
                purge = self._state is CoordinatorState.OPEN
        timer = task.timer
        task.timer = None
        return state, task.handle, timer, idle, purge

    def _purge_due(self) -> bool:
        """Whether the tombstones are worth a pass over the queues (lock held)."""
        return self._tombstones > max(_PURGE_AT_LEAST, self._queued)

    def _after_settle(self, task: _Task, cleanup: _Cleanup, error: Exception | None) -> None:
        state, handle, timer, idle, purge = cleanup
        if state is _QUEUED and self._waiters:  # a queued job left: room for a waiting one
            self._admit_waiting()
        if purge:
            self._pipeline.purge(_is_settled)
        if timer is not None:
            timer()
        if handle is not None:
            self._cancel_async(task, handle)
        if state is _GATED:
            idle = self._withdraw(task) or idle
        if error is not None:
            self._deliver(task, None, error)
        if idle:
            self._became_idle()

    def _withdraw(self, task: _Task) -> bool:
        """Take a settled task back from the admission if it has not taken a permit yet.

        The ticket decides: exactly one of this withdrawal and ``_admitted`` (which then sees
        the task settled) cleans it up, and a permit granted to it meanwhile goes back to the
        admission. True if that left the coordinator idle.
        """
        ticket = task.ticket
        if ticket is None:
            return False  # not at the admission yet: _start's stranded check comes after
        state = ticket._waiter.cancel()
        if state is PENDING:
            assert self._admission is not None
            self._admission.withdraw(ticket)  # False: a grant is in flight and will be given back
        elif state is not GRANTED:
            return False  # taken (``_admitted`` cleans up) or withdrawn before
        with self._lock:
            task.state = _DONE
            task.ticket = None
            self._queued -= 1
            self._tasks.discard(task)
            task.job = None
            idle = self._queued + self._running == 0
        self._release_slot(task)
        return idle

    def _cancel_async(
        self, task: _Task, handle: asyncio.Future[Any] | _Streaming | _Awaited
    ) -> None:
        loop = task.job_loop
        if loop is None or _get_running_loop() is loop:
            handle.cancel()
            return
        with contextlib.suppress(RuntimeError):  # loop closed: the job cannot run any more
            loop.call_soon_threadsafe(handle.cancel)

    def _arm_timeout(self, task: _Task, timeout: float) -> None:
        def expire() -> None:
            self._time_out(task, timeout)

        if self._virtual is not None:
            cancel = self._virtual.schedule_relative(timeout, lambda _s, _st: expire()).dispose
        else:
            cancel = call_later(timeout, expire).cancel
        with self._lock:
            if task.state is _RUNNING and task.timer is None:
                task.timer = cancel
                return
        cancel()  # the job finished (or was cancelled) before the timer was armed

    def _time_out(self, task: _Task, timeout: float) -> None:
        with self._lock:
            if task.settled or task.state is not _RUNNING:
                return
            task.settled = True
            task.timer = None
            self._timed_out += 1
            handle = task.handle
        self._log.info("a job on {!r} timed out after {} s", self._name, timeout)
        if handle is not None:
            self._cancel_async(task, handle)
        error = TimeoutError(f"job timed out after {timeout} s on coordinator {self._name!r}")
        if self._virtual is not None or task.loop is not None:
            self._deliver(task, None, error)  # virtual time, or hopping onto the caller's loop
        else:
            # This runs on the process-wide timer thread: subscriber code there would delay
            # every other timeout, lease renewal and eviction (or kill the thread). Hand off.
            hand_off(lambda: self._deliver_now(task.observer, None, error))

    def _pipeline_fault(self, error: Exception) -> None:
        """Nothing in the pipeline raises by design; if it ever does, no caller may hang.

        Every live job fails with the error (running sync jobs finish unobserved) and a fresh
        pipeline takes new submissions, as the Reactor original's ``onErrorResume`` did.
        """
        if self._state is not CoordinatorState.OPEN:
            return  # a fault racing close(): every task is settled by close() already
        self._log.opt(exception=error).critical("pipeline of {!r} failed", self._name)
        pipeline = self._build_pipeline()
        with self._lock:
            tasks = list(self._tasks)
            self._pipeline = pipeline
        for task in tasks:
            task.lane = None  # its slot belonged to the dead pipeline
            self._cancel(task, error)


_STREAMED: Final = object()  # the outcome of an Observable job: its items were delivered


class _Streaming:
    """An Observable job running to its end: forwards its items, then finishes the task.

    ``cancel()`` (a dispose, a timeout, close) disposes the subscription, which by the Rx
    contract ends it without a terminal notification: the task is finished here instead, so
    its slot and key guard are given back exactly once either way.
    """

    __slots__ = ("_coordinator", "_done", "_lock", "_subscription", "_task", "_token")

    def __init__(self, coordinator: TenantTaskCoordinator, task: _Task, token: Any) -> None:
        self._coordinator = coordinator
        self._task = task
        self._token = token
        self._lock = threading.Lock()
        self._done = False
        self._subscription: abc.DisposableBase | None = None

    def attach(self, subscription: abc.DisposableBase) -> None:
        with self._lock:
            done = self._done
            if not done:
                self._subscription = subscription
        if done:  # it ended (or was cancelled) while subscribing
            subscription.dispose()

    def on_next(self, item: Any) -> None:
        if not self._task.settled and not self._done:
            self._coordinator._deliver_item(self._task, item)

    def on_error(self, error: Exception) -> None:
        self.end(error)

    def on_completed(self) -> None:
        self.end(None)

    def cancel(self) -> None:
        with self._lock:
            subscription = self._subscription
            self._subscription = None
        if subscription is not None:
            subscription.dispose()
        if self._token is _NO_TOKEN:
            self.end(None)
        else:  # leaving the key guard is a round trip: never on the timer thread (timeouts)
            hand_off(lambda: self.end(None), "an Observable job's key guard")

    def end(self, error: BaseException | None) -> None:
        """Finish the task once: leave the key guard, free the slot, deliver the terminal."""
        with self._lock:
            if self._done:
                return
            self._done = True
        coordinator = self._coordinator
        if self._token is not _NO_TOKEN:
            assert coordinator._guard is not None
            try:
                coordinator._guard.exit(self._token)
            except Exception as exc:
                if error is None:
                    error = exc
        coordinator._finish(self._task, _STREAMED if error is None else None, error)


async def _guarded(guard: KeyGuard, key: Hashable, awaitable: Awaitable[Any]) -> Any:
    """Await an async job's awaitable inside the key guard (entered on the job's loop)."""
    try:
        token = await guard.enter_async(key)
    except BaseException:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # the guard never came (cancelled, timed out, store down)
        raise
    return await _awaited_then_exited(awaitable, guard, token)


async def _awaited_then_exited(awaitable: Awaitable[Any], guard: KeyGuard, token: Any) -> Any:
    """Await a job's result, then exit the key guard (LeaseLost if exclusion was lost)."""
    try:
        result = await awaitable
    except BaseException:
        with contextlib.suppress(Exception):
            await guard.exit_async(token)
        raise
    await guard.exit_async(token)
    return result


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
