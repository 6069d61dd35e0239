"""TenantTaskCoordinator: Reactor's per-tenant coordinator, ported to RxPY and made correct.

The shape is the Reactor original's, kept visible::

    execute(job) --subscribe--> WIP check --> sink (Subject) --> serialize_by_key(key, cap)
                                                                          |
          subscriber <-- result (after WIP is decremented) <-- job on the scheduler

* **Work in progress.** Subscribing counts the job; beyond ``max_concurrency + max_queue_size``
  the subscriber gets ``TooManyTasks`` at once and nothing is counted.
* **The sink.** A ``Subject`` into which every accepted task is pushed, from any thread.
  ``serialize_by_key`` is safe with concurrent source emissions, so the Subject's unlocked
  fan-out (one of the traps of reactivex 6.1) cannot hurt here.
* **Ordering and the limit.** ``serialize_by_key`` orders tasks of equal key and caps active
  tasks at ``max_concurrency`` (a race-free ``flat_map(max_concurrent)``). Unkeyed tasks are
  their own key, so they only share the cap.
* **The work.** Each task *is* the inner Observable its turn subscribes: subscribing it drops
  the task if it was cancelled while queued, or hands the job to the scheduler. That is one
  inner subscription and one hand-off per job, no operator layers per task.
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
from collections.abc import Awaitable, Callable, Generator, Hashable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, cast, overload

from loguru import logger
from reactivex import Observable, Observer, abc
from reactivex.disposable import Disposable
from reactivex.scheduler import VirtualTimeScheduler
from reactivex.scheduler.eventloop import AsyncIOScheduler
from reactivex.subject import Subject

from ._core.futures import FutureObserver
from ._core.lifecycle import Closeable, CoordinatorState
from ._core.timer import call_later
from ._core.workers import WorkerPool, hand_off
from ._errors import CoordinatorClosed, TooManyTasks
from .operators._serialize_by_key import SerializedSubscription, subscribe_serialized

if TYPE_CHECKING:
    from .leases import DistributedLease, LeaseProvider

__all__ = ["CoordinatorStats", "TenantTaskCoordinator"]

_T = TypeVar("_T")

_get_running_loop: Final = asyncio._get_running_loop  # C fast path, no exception when none

# Task states
_QUEUED: Final = 0
_RUNNING: Final = 1
_DONE: Final = 2
_GATED: Final = 3  # its turn came, waiting for a global slot (TenantScheduler's gate)


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    """A consistent snapshot of a coordinator's counters.

    Every subscription to ``execute`` is ``submitted``; it ends as exactly one of ``rejected``
    (refused at subscription: ``TooManyTasks`` or ``CoordinatorClosed``), ``completed``,
    ``failed`` (the job raised, or could not be started), ``cancelled`` (the subscriber
    disposed, or the coordinator closed) or ``timed_out`` - or it is still pending.
    ``work_in_progress`` is ``queued + running``; a cancelled sync job stays ``running`` until
    its thread returns.
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

    @property
    def work_in_progress(self) -> int:
        """Jobs queued or running."""
        return self.queued + self.running


class _Task(abc.ObservableBase[None], abc.DisposableBase):
    """One accepted submission.

    It is the inner Observable that ``serialize_by_key`` subscribes when the task's turn comes
    (``subscribe`` starts the job, the job's return completes it and frees the slot) and the
    Disposable its subscriber holds (``dispose`` cancels).
    """

    __slots__ = (
        "coordinator",
        "handle",
        "is_async",
        "job",
        "job_loop",
        "lane",
        "lane_key",
        "loop",
        "observer",
        "settled",
        "state",
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
        self.lane_key: Hashable = self if key is None else (_KEYED, key)
        self.timeout = timeout
        self.observer = observer
        self.loop = loop  # the subscriber's running loop, if any: results are delivered on it
        self.job_loop = job_loop  # where an async job runs
        self.is_async = is_async
        self.state = _QUEUED
        self.settled = False  # the subscriber got (or gave up) its outcome: the cancel signal
        self.lane: abc.ObserverBase[None] | None = None  # serialize_by_key's observer of us
        self.handle: asyncio.Future[Any] | None = None  # a running async job
        self.timer: Callable[[], None] | None = None  # cancels the pending timeout

    # -- as the pipeline's inner Observable ------------------------------------------------------

    def subscribe(  # type: ignore[override]
        self,
        observer: abc.ObserverBase[None],
        on_error: Any = None,
        on_completed: Any = None,
        *,
        scheduler: abc.SchedulerBase | None = None,
    ) -> abc.DisposableBase:
        self.lane = observer
        self.coordinator._start(self)
        # Not ``self``: tearing the pipeline down must not look like the subscriber's cancel.
        # close() and the fault handler settle every live task themselves, with a reason.
        return _DETACHED

    # -- as the subscriber's Disposable ----------------------------------------------------------

    def dispose(self) -> None:
        self.coordinator._cancel(self, None)


_DETACHED: Final = Disposable()
_is_settled: Final = attrgetter("settled")  # a queued task cancelled: the pipeline may drop it
_PURGE_AT_LEAST: Final = 64  # tombstones (cancelled queued tasks) that make a purge worth it
# What _settle leaves to do outside the lock: state, async handle, timer cancel, idle, purge.
_Cleanup = tuple[int, "asyncio.Future[Any] | None", Any, bool, bool]
_KEYED: Final = object()  # tags user keys so they can never equal an unkeyed task's own key


class _Submit(Protocol):
    def __call__(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase: ...


class _Execution(Observable[_T]):
    """The cold Observable ``execute`` returns: each subscription is one submission."""

    def __init__(
        self,
        submit: _Submit,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
    ) -> None:
        super().__init__()
        self._submit = submit  # TenantTaskCoordinator._submit, or TenantScheduler's for a tenant
        self._job = job
        self._key = key
        self._timeout = timeout
        self._is_async = is_async

    def _subscribe_core(
        self, observer: abc.ObserverBase[_T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        return self._submit(
            self._job, self._key, self._timeout, self._is_async, observer, scheduler
        )

    def subscribe(
        self,
        on_next: abc.ObserverBase[_T] | Callable[[_T], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        on_completed: Callable[[], None] | None = None,
        *,
        scheduler: abc.SchedulerBase | None = None,
    ) -> abc.DisposableBase:
        """Submit the job once (same contract as ``Observable.subscribe``).

        ``Observable.subscribe`` routes every subscription through an AutoDetachObserver and a
        CurrentThreadScheduler trampoline pass, there so that synchronous emissions cannot
        outrun the returned disposable; that is most of a trivial job's cost. A submission never
        emits during subscribe (except a refusal, which needs no disposable), and the task
        delivers at most one outcome and then holds nothing, so it subscribes directly.
        """
        if hasattr(on_next, "on_next"):
            observer = cast(abc.ObserverBase[_T], on_next)
        else:
            observer = _Callbacks(on_next, on_error, on_completed)
        return self._submit(
            self._job, self._key, self._timeout, self._is_async, observer, scheduler
        )

    def __await__(self) -> Generator[Any, None, _T]:
        """``await coordinator.execute(job)``: the job's result, or its exception.

        Same outcome as reactivex's ``Observable.__await__``, minus its ``to_future`` operator
        layer: the outcome is delivered on this loop straight into a future. Cancelling the
        awaiting task cancels the job.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        subscription = self._submit(
            self._job, self._key, self._timeout, self._is_async, FutureObserver(future), None
        )

        def on_done(f: asyncio.Future[_T]) -> None:
            if f.cancelled():
                subscription.dispose()

        future.add_done_callback(on_done)
        return future.__await__()


class _Callbacks(abc.ObserverBase[Any]):
    """The observer behind ``subscribe(on_next, on_error, on_completed)`` callbacks."""

    __slots__ = ("_on_completed", "_on_error", "_on_next")

    def __init__(
        self,
        on_next: Callable[[Any], None] | None,
        on_error: Callable[[Exception], None] | None,
        on_completed: Callable[[], None] | None,
    ) -> None:
        self._on_next = on_next or _ignore
        self._on_error = on_error or _unhandled
        self._on_completed = on_completed or _nothing

    def on_next(self, value: Any) -> None:
        self._on_next(value)

    def on_error(self, error: Exception) -> None:
        self._on_error(error)

    def on_completed(self) -> None:
        self._on_completed()


def _ignore(_: Any) -> None:
    pass


def _nothing() -> None:
    pass


def _unhandled(error: Exception) -> None:
    # Like reactivex's default_error: an error nobody handles is raised (and logged by
    # _deliver_now, so it is never silently lost).
    raise error


def _execution(
    submit: _Submit,
    job: Callable[[], Any],
    key: Hashable | None,
    timeout: float | None,
    default_timeout: float | None,
) -> _Execution[Any]:
    """Validate ``execute``'s arguments at the call and build its cold Observable."""
    if not callable(job):
        raise TypeError(f"job must be callable, not {job!r}")
    if key is not None:
        hash(key)  # an unhashable key fails here, at the call
    timeout = default_timeout if timeout is None else _validate_timeout(timeout, "timeout")
    return _Execution(submit, job, key, timeout, inspect.iscoroutinefunction(job))


def _validate_timeout(timeout: float | None, what: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{what} must be a number of seconds or None, not {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{what} must be positive, got {timeout!r}")
    return float(timeout)


def _validate_count(value: int, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return value


def _identity(task: _Task) -> _Task:
    return task


class _Gate(Protocol):
    """A global admission limit shared by several coordinators (see TenantScheduler).

    ``request`` queues a task whose turn came; the gate calls ``coordinator._granted(task)``
    (outside its own lock) once a global slot is free. ``withdraw`` takes back a task that was
    not granted yet; ``release`` returns a granted slot.
    """

    def request(self, lane: Any, task: _Task) -> None: ...

    def withdraw(self, lane: Any, task: _Task) -> bool: ...

    def release(self) -> None: ...


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
    (``dispose()`` is :meth:`close`).

    Args:
        scheduler: Where sync jobs run; ``None`` for an owned pool of worker threads.
        max_concurrency: Most jobs running at once (>= 1).
        max_queue_size: Most jobs waiting beyond those running (>= 0).
        name: Names the coordinator in errors, logs and thread names.
        timeout: Default per-job timeout in seconds, counted from the job's start; ``None`` for
            none. On expiry the subscriber gets ``TimeoutError`` and the job is cancelled.
        leases: A distributed lease provider (``rxcoord.leases``): keyed jobs then also hold
            the lease named after their key while they run, so per-key exclusion holds across
            processes.
        lease_at_most_for: ``at_most_for`` of those leases (kept alive while the job runs).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a limit or the timeout is out of range.
    """

    def __init__(
        self,
        scheduler: abc.SchedulerBase | None = None,
        max_concurrency: int = 1,
        max_queue_size: int = 50,
        name: str = "",
        timeout: float | None = None,
        *,
        leases: LeaseProvider | None = None,
        lease_at_most_for: float = 30.0,
    ) -> None:
        self._max_concurrency = _validate_count(max_concurrency, "max_concurrency", 1)
        self._max_queue_size = _validate_count(max_queue_size, "max_queue_size", 0)
        self._limit = max_concurrency + max_queue_size
        self._name = name
        self._timeout = _validate_timeout(timeout, "timeout")
        self._log = logger.bind(coordinator=name)
        self._leases = leases
        lease_for = _validate_timeout(lease_at_most_for, "lease_at_most_for")
        if lease_for is None:
            raise TypeError("lease_at_most_for must be a number of seconds, not None")
        self._lease_at_most_for = lease_for
        self._lock = threading.Lock()
        self._state = CoordinatorState.OPEN
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

        self._scheduler = scheduler
        self._pool: WorkerPool | None = None
        self._scheduler_loop: asyncio.AbstractEventLoop | None = None
        self._virtual: VirtualTimeScheduler | None = None
        if scheduler is None:
            self._pool = self._make_pool()
        elif isinstance(scheduler, AsyncIOScheduler):
            self._scheduler_loop = scheduler._loop
        elif isinstance(scheduler, VirtualTimeScheduler):
            self._virtual = scheduler
        elif not isinstance(scheduler, abc.SchedulerBase):
            raise TypeError(f"scheduler must be a reactivex scheduler or None, not {scheduler!r}")

        self._sink, self._pipeline = self._build_pipeline()

    # Hooks for TenantScheduler's per-tenant coordinators: a shared pool, a global gate and a
    # callback when the coordinator runs out of work.
    _gate: _Gate | None = None
    _gate_lane: Any = None
    _owns_pool = True

    def _make_pool(self) -> WorkerPool:
        return WorkerPool(self._max_concurrency, f"rxcoord-{self._name or 'coordinator'}")

    def _became_idle(self) -> None:
        """Called (outside the lock) each time the work in progress drops to zero."""

    def _build_pipeline(self) -> tuple[Subject[_Task], SerializedSubscription[_Task, None]]:
        """The sink, and the pipeline from it: per-key order and the cap; each task runs itself.

        That is ``sink.pipe(serialize_by_key(...)).subscribe(on_error=...)``, subscribed through
        ``subscribe_serialized`` to keep the subscription's ``purge()`` (see ``_settle``).
        """
        sink: Subject[_Task] = Subject()
        pipeline = subscribe_serialized(
            sink,
            attrgetter("lane_key"),
            _identity,
            Observer(on_error=self._pipeline_fault),
            max_concurrent=self._max_concurrency,
        )
        return sink, pipeline

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
            )

    @overload
    def execute(
        self,
        job: Callable[[], Awaitable[_T]],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[_T]: ...

    @overload
    def execute(
        self,
        job: Callable[[], _T],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[_T]: ...

    def execute(
        self,
        job: Callable[[], Any],
        *,
        key: Hashable | None = None,
        timeout: float | None = None,
    ) -> Observable[Any]:
        """Return a cold Observable that runs ``job`` under this coordinator once per subscription.

        Args:
            job: A callable ``() -> T`` (runs on the scheduler) or an ``async def`` function
                (awaited on the subscriber's asyncio loop or the AsyncIOScheduler's).
            key: Jobs with equal keys run one at a time in subscription order; ``None`` for no
                ordering.
            timeout: Seconds the job may run, counted from its start; overrides the
                coordinator's default.

        Returns:
            An Observable emitting the job's result once, or erroring with the job's exception,
            ``TooManyTasks``, ``CoordinatorClosed`` or ``TimeoutError``.

        Raises:
            TypeError: ``job`` is not callable, ``key`` is unhashable, or ``timeout`` is not a
                number.
            ValueError: ``timeout`` is not positive.
        """
        return _execution(self._submit, job, key, timeout, self._timeout)

    def close(self, wait: bool = True) -> None:
        """Close the coordinator; idempotent.

        New subscriptions fail with ``CoordinatorClosed``; queued jobs and running jobs fail
        with it too (running async jobs are cancelled, running sync jobs' results discarded).
        The owned worker threads are shut down; with ``wait`` this returns once they have all
        exited, which means once running sync jobs have returned.
        """
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return
            self._state = CoordinatorState.CLOSING
            # Settle every live task in one step, before any subscriber code runs: otherwise a
            # job finishing meanwhile could hand its slot to a queued task not yet reached.
            settled = [(task, self._settle(task)) for task in list(self._tasks) if not task.settled]
        self._log.debug("closing coordinator {!r} with {} live jobs", self._name, len(settled))
        error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task, cleanup in settled:
            self._after_settle(task, cleanup, error)
        self._pipeline.dispose()
        if self._pool is not None and self._owns_pool:
            self._pool.shutdown(wait=wait)
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
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        loop = _get_running_loop()
        if loop is None and isinstance(scheduler, AsyncIOScheduler):
            loop = scheduler._loop
        job_loop = (self._scheduler_loop or loop) if is_async else None
        task = _Task(self, job, key, timeout, observer, loop, job_loop, is_async)
        error: Exception | None = None
        with self._lock:
            self._submitted += 1
            if self._state is not CoordinatorState.OPEN:
                self._rejected += 1
                error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
            elif is_async and job_loop is None:
                self._failed += 1
                error = RuntimeError(
                    "an async job needs a running asyncio loop: subscribe from asyncio code (e.g. "
                    "`await coordinator.execute(job)`) or pass scheduler=AsyncIOScheduler(loop)"
                )
            elif self._queued + self._running >= self._limit:
                self._rejected += 1
                error = TooManyTasks(
                    f"coordinator {self._name!r}: {self._queued + self._running} jobs in "
                    f"progress, limit {self._limit} (max_concurrency={self._max_concurrency} + "
                    f"max_queue_size={self._max_queue_size})"
                )
            else:
                self._queued += 1
                self._tasks.add(task)
        if error is not None:
            if isinstance(error, TooManyTasks):
                self._log.info("rejected: {}", error)
            observer.on_error(error)
            return Disposable()
        self._sink.on_next(task)
        return task

    # -- running -------------------------------------------------------------------------------

    def _start(self, task: _Task) -> None:
        """The task's turn came (serialize_by_key subscribed it): start the job, or drop it."""
        gate = self._gate
        with self._lock:
            if task.settled:  # cancelled (or closed) while queued: it never starts
                task.state = _DONE
                drop = True
                self._tombstones = max(0, self._tombstones - 1)  # it has left the queue
            elif gate is not None:
                task.state = _GATED
                drop = False
            else:
                task.state = _RUNNING
                self._queued -= 1
                self._running += 1
                drop = False
        if drop:
            self._release_slot(task)
        elif gate is not None:
            gate.request(self._gate_lane, task)  # counted as queued until a global slot frees
            # A dispose between the unlock above and the request could not withdraw the task
            # (it was not at the gate yet): take it back now, or it would wait there for a turn.
            with self._lock:
                stranded = task.settled and task.state is _GATED
            if stranded and self._withdraw(task):
                self._became_idle()
        else:
            self._begin(task)

    def _granted(self, task: _Task) -> bool:
        """The gate gave ``task`` a global slot; False if it was cancelled meanwhile."""
        with self._lock:
            self._queued -= 1
            if task.settled:
                task.state = _DONE
                self._tasks.discard(task)
                idle = self._queued + self._running == 0
            else:
                task.state = _RUNNING
                self._running += 1
        if task.state is _DONE:
            self._release_slot(task)
            if idle:
                self._became_idle()
            return False
        self._begin(task)
        return True

    def _begin(self, task: _Task) -> None:
        """Run the job now: arm its timeout (counted from here) and hand it off."""
        if task.timeout is not None:
            self._arm_timeout(task, task.timeout)
        try:
            if task.is_async:
                self._start_async(task)
            elif self._pool is not None:
                self._pool.submit(lambda: self._run_sync(task))
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
        lease: DistributedLease | None = None
        if job is not None and not task.settled:  # not cancelled between hand-off and now
            try:
                if self._leases is not None and task.lane_key is not task:
                    # Keyed: hold the key's distributed lease too (blocking here is fine: this
                    # thread is the job's), so the key is exclusive across processes as well.
                    lease = self._leases.acquire(
                        self._lease_name(task), self._lease_at_most_for, keep_alive=True
                    )
                value = job()
            except BaseException as exc:  # the job's error goes to its subscriber
                error = exc
            if error is None and (inspect.iscoroutine(value) or asyncio.isfuture(value)):
                # ``lambda: fetch(i)`` is an async job in disguise: await what it returned
                # (still under the lease, which is released when the awaitable is done).
                self._continue_async(task, value, lease)
                return
            if lease is not None:
                try:
                    lease.release()  # LeaseLost if it expired: the work may overlap another's
                except Exception as exc:
                    if error is None:
                        value, error = None, exc
                    else:
                        self._log.opt(exception=True).warning("lease release failed")
        self._finish(task, value, error)

    def _continue_async(
        self, task: _Task, awaitable: Any, lease: DistributedLease | None = None
    ) -> None:
        loop = self._scheduler_loop or task.loop
        if loop is None:
            self._discard_awaitable(awaitable, lease)
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
            self._discard_awaitable(awaitable, lease)
            self._finish(task, None, None)
            return
        task.job_loop = loop
        if lease is not None:
            task.job = lambda: _awaited_then_released(awaitable, lease)
        else:
            task.job = lambda: awaitable
        try:
            self._start_async(task)
        except Exception as exc:  # e.g. the loop was closed meanwhile: tell the caller
            self._discard_awaitable(awaitable, lease)
            self._finish(task, None, exc)

    @staticmethod
    def _discard_awaitable(awaitable: Any, lease: DistributedLease | None) -> None:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never awaited: say so, not with a RuntimeWarning
        if lease is not None:
            with contextlib.suppress(Exception):
                lease.release()

    def _start_async(self, task: _Task) -> None:
        loop = task.job_loop
        assert loop is not None

        def create() -> None:
            job = task.job
            if job is None or task.settled:
                self._finish(task, None, None)
                return
            try:
                awaitable = job()
                if self._leases is not None and task.lane_key is not task and task.is_async:
                    awaitable = self._under_lease_async(task, awaitable)
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

    def _async_done(self, task: _Task, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._finish(task, None, asyncio.CancelledError())
        else:
            self._finish(
                task, future.result() if future.exception() is None else None, future.exception()
            )

    def _finish(self, task: _Task, value: Any, error: BaseException | None) -> None:
        """The job returned (or never could start): free the slot, then deliver the outcome."""
        with self._lock:
            if task.state is _DONE:
                return
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
            task.handle = None
            idle = self._queued + self._running == 0
        if timer is not None:
            timer()
        # Free the tenant's own slot first: its next job then queues at the gate before the
        # global slot is handed out, and competes for it fairly.
        self._release_slot(task)
        if self._gate is not None:
            self._gate.release()
        if idle:
            self._became_idle()
        if deliver:
            if error is None:
                self._deliver(task, value, None)
            else:
                self._log.opt(exception=error).debug("job failed on {!r}", self._name)
                self._deliver(task, None, error)

    def _release_slot(self, task: _Task) -> None:
        lane = task.lane
        task.lane = None
        if lane is not None:
            lane.on_completed()  # serialize_by_key starts the next task (just a hand-off)

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
        if state is _QUEUED:
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
        """Take a settled task back from the gate if it is still waiting there.

        The gate's lock makes this atomic: exactly one of the withdrawer and the gate's grant
        (``_granted`` then sees the task settled) cleans it up. True if that left the
        coordinator idle.
        """
        if self._gate is None or not self._gate.withdraw(self._gate_lane, task):
            return False
        with self._lock:
            task.state = _DONE
            self._queued -= 1
            self._tasks.discard(task)
            task.job = None
            idle = self._queued + self._running == 0
        self._release_slot(task)
        return idle

    def _cancel_async(self, task: _Task, handle: asyncio.Future[Any]) -> None:
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
        sink, pipeline = self._build_pipeline()
        with self._lock:
            tasks = list(self._tasks)
            self._sink, self._pipeline = sink, pipeline
        for task in tasks:
            task.lane = None  # its slot belonged to the dead pipeline
            self._cancel(task, error)

    # -- distributed leases --------------------------------------------------------------------

    def _lease_name(self, task: _Task) -> str:
        """The distributed lease of a keyed job: ``"<coordinator name>:<key>"``."""
        return f"{self._name}:{task.lane_key[1]!s}"  # type: ignore[index]

    async def _under_lease_async(self, task: _Task, awaitable: Awaitable[Any]) -> Any:
        assert self._leases is not None
        try:
            async with self._leases.lock_async(
                self._lease_name(task), self._lease_at_most_for, keep_alive=True
            ):
                return await awaitable
        finally:
            if inspect.iscoroutine(awaitable) and inspect.getcoroutinestate(awaitable) == (
                inspect.CORO_CREATED
            ):
                awaitable.close()  # the lease never came (cancelled, timed out, store down)


async def _awaited_then_released(awaitable: Awaitable[Any], lease: DistributedLease) -> Any:
    """Await a job's result, then release the lease it ran under (LeaseLost if it was lost)."""
    try:
        result = await awaitable
    except BaseException:
        with contextlib.suppress(Exception):
            await lease.release_async()
        raise
    await lease.release_async()
    return result
