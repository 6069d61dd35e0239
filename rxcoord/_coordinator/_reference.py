"""ReactorCoordinator: the Reactor composition that defines ``TenantTaskCoordinator``, in Rx.

Reactor's ``TenantTaskCoordinator`` is a handful of operators around a sink of tasks::

    execute(job):  wip.incrementAndGet() > maxConcurrency + maxQueueSize ? error(TooManyTasks)
                   : sink.emitNext(task); return task.result.doFinally(wip::decrementAndGet)
    pipeline:      sink.asFlux()
                       .flatMap(task -> task.callable.subscribeOn(scheduler)
                                            .timeout(task.cancelSignal), maxConcurrency)
                       .subscribe()

This module is that composition in RxPY, with the two changes rxcoord makes on purpose: the
``flatMap`` is :func:`~rxcoord.serialize_by_key` (the race-free ``flat_map(max_concurrent)``,
ordered per key), and each job also runs under its own time limit. It is the *meaning* of
:class:`~rxcoord.TenantTaskCoordinator`: a differential test in virtual time
(``tests/test_coordinator_reference.py``) drives both with the same random submissions, keys,
failures, timeouts, cancellations and closes, and requires the same results, the same per-key
order, the same rejections and the same counters. The coordinator is this, without an Observable,
a Subject and a handful of operator layers per job (several times faster).

Use it to read what the coordinator promises, or as a starting point for a pipeline of your own.
The coordinator adds what a composition of operators cannot give cheaply: its own worker
threads, asyncio (an ``async def`` job awaited inline), admissions, key guards,
``overflow="wait"``, draining and statistics per job shape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Final

import reactivex
from reactivex import Observable, abc
from reactivex import operators as ops
from reactivex.disposable import Disposable
from reactivex.subject import Subject

from .._core.checks import check_count, check_deadline, check_name
from .._core.lifecycle import Closeable, CoordinatorState
from .._errors import CoordinatorClosed, TooManyTasks
from ..operators import serialize_by_key
from ._facade import CoordinatorStats

__all__ = ["ReactorCoordinator"]

_QUEUED: Final = 0
_RUNNING: Final = 1
_DONE: Final = 2


class _Task:
    """One accepted submission: its job, its subscriber and its cancel signal."""

    __slots__ = ("cancel", "expired", "job", "key", "observer", "settled", "state", "timeout")

    def __init__(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        observer: abc.ObserverBase[Any],
    ) -> None:
        self.job = job
        self.key = key
        self.timeout = timeout
        self.observer = observer
        self.cancel: Subject[None] = Subject()  # Reactor's cancelSignal
        self.expired: TimeoutError | None = None  # the error its own timeout raises
        self.settled = False  # its outcome is decided
        self.state = _QUEUED


def _lane(task: _Task) -> Hashable:
    return task if task.key is None else task.key  # an unkeyed task is its own key


class ReactorCoordinator(Closeable):
    """Reactor's coordinator as an Rx composition (see the module docstring).

    ``execute(job, key=..., timeout=...)`` returns a cold Observable: each subscription counts
    one task (``TooManyTasks`` beyond ``max_concurrency + max_queue_size``, ``CoordinatorClosed``
    once closed) and pushes it into the sink; its job runs when its turn comes and the
    subscriber gets what it emits (a job may return a value, raise, or return an Observable).
    Disposing the subscription cancels the task: a queued one never starts, a running one's
    Observable is disposed. :meth:`close` fails every live task with ``CoordinatorClosed``.

    Args:
        max_concurrency: Most jobs running at once (>= 1).
        max_queue_size: Most jobs waiting beyond those running (>= 0).
        scheduler: Where jobs are called (``subscribe_on``) and their timeouts timed (virtual
            time in tests); ``None``: jobs are called on the thread whose event started them,
            timeouts on reactivex's default timeout scheduler.
        timeout: Default per-job timeout in seconds, from its start; ``None`` for none.
        name: Names the coordinator in errors.

    Raises:
        TypeError, ValueError: An argument has the wrong type or is out of range.
    """

    def __init__(
        self,
        *,
        max_concurrency: int = 1,
        max_queue_size: int = 50,
        scheduler: abc.SchedulerBase | None = None,
        timeout: float | None = None,
        name: str = "",
    ) -> None:
        self._max_concurrency = check_count(max_concurrency, "max_concurrency", 1)
        self._max_queue_size = check_count(max_queue_size, "max_queue_size", 0)
        self._limit = max_concurrency + max_queue_size
        self._scheduler = scheduler
        self._timeout = check_deadline(timeout)
        self._name = check_name(name)
        self._lock = threading.Lock()
        self._state = CoordinatorState.OPEN
        self._tasks: set[_Task] = set()  # live: what close() must reach
        self._wip = 0
        self._queued = 0
        self._running = 0
        self._counts = dict.fromkeys(
            ("submitted", "rejected", "completed", "failed", "cancelled", "timed_out"), 0
        )
        self._sink: Subject[_Task] = Subject()
        self._pipeline = self._sink.pipe(
            serialize_by_key(_lane, self._run, max_concurrent=max_concurrency)
        ).subscribe()

    @property
    def state(self) -> CoordinatorState:
        """Open or closed."""
        return self._state

    def stats(self) -> CoordinatorStats:
        """The counters, defined as :meth:`TenantTaskCoordinator.stats` defines them."""
        with self._lock:
            counts = self._counts
            return CoordinatorStats(
                name=self._name,
                submitted=counts["submitted"],
                completed=counts["completed"],
                failed=counts["failed"],
                rejected=counts["rejected"],
                cancelled=counts["cancelled"],
                timed_out=counts["timed_out"],
                queued=self._queued,
                running=self._running,
                max_concurrency=self._max_concurrency,
                max_queue_size=self._max_queue_size,
            )

    def execute(
        self, job: Callable[[], Any], *, key: Hashable | None = None, timeout: float | None = None
    ) -> Observable[Any]:
        """A cold Observable that runs ``job`` once per subscription (see the class docstring).

        Raises:
            TypeError: ``job`` is not callable or ``timeout`` not a number.
            ValueError: ``timeout`` is not positive.
        """
        if not callable(job):
            raise TypeError(f"job must be callable, not {job!r}")
        deadline = self._timeout if timeout is None else check_deadline(timeout)

        def subscribe(
            observer: abc.ObserverBase[Any], scheduler: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            task = _Task(job, key, deadline, observer)
            with self._lock:
                self._counts["submitted"] += 1
                error: Exception | None = None
                if self._state is not CoordinatorState.OPEN:
                    error = CoordinatorClosed(f"coordinator {self._name!r} is closed")
                elif self._wip >= self._limit:  # Reactor: wip.incrementAndGet() > limit
                    error = TooManyTasks(f"coordinator {self._name!r}: limit {self._limit}")
                else:
                    self._wip += 1
                    self._queued += 1
                    self._tasks.add(task)
                if error is not None:
                    self._counts["rejected"] += 1
            if error is not None:
                observer.on_error(error)
                return Disposable()
            self._sink.on_next(task)  # Reactor: sink.emitNext(task)
            return Disposable(lambda: self._cancel(task, None))

        return Observable(subscribe)

    def close(self) -> None:
        """Fail every live task with ``CoordinatorClosed``; refuse new ones. Idempotent."""
        with self._lock:
            if self._state is not CoordinatorState.OPEN:
                return
            self._state = CoordinatorState.CLOSED
            tasks = list(self._tasks)
        closed = CoordinatorClosed(f"coordinator {self._name!r} is closed")
        for task in tasks:
            if task.state is _QUEUED:  # queued ones first: a running one ending frees a slot
                self._cancel(task, closed)
        for task in tasks:
            self._cancel(task, closed)
        self._pipeline.dispose()

    # -- the pipeline ---------------------------------------------------------------------------

    def _run(self, task: _Task) -> Observable[Any]:
        """``serialize_by_key``'s mapper: a task's turn came; its job, under its limits."""
        with self._lock:
            if task.settled:  # cancelled while queued: it never starts
                return reactivex.empty()
            task.state = _RUNNING
            self._queued -= 1
            self._running += 1
        work = reactivex.defer(lambda _: _observable(task.job))
        if self._scheduler is not None:  # Reactor: task.callable.subscribeOn(scheduler)
            work = work.pipe(ops.subscribe_on(self._scheduler))
        if task.timeout is not None:
            task.expired = TimeoutError(
                f"job timed out after {task.timeout} s on coordinator {self._name!r}"
            )
            work = work.pipe(
                ops.timeout(task.timeout, reactivex.throw(task.expired), self._scheduler)
            )
        return work.pipe(
            ops.take_until(task.cancel),  # Reactor: .timeout(task.cancelSignal)
            ops.do_action(
                lambda value: self._item(task, value),
                lambda error: self._end(task, error),
                lambda: self._end(task, None),
            ),
            ops.ignore_elements(),
            ops.catch(reactivex.empty()),  # one job's failure never ends the pipeline
        )

    def _item(self, task: _Task, value: Any) -> None:
        if not task.settled:
            task.observer.on_next(value)

    def _end(self, task: _Task, error: Exception | None) -> None:
        """The job ended (or was stopped): the counters first, then the subscriber."""
        with self._lock:
            task.state = _DONE
            self._running -= 1
            self._wip -= 1
            self._tasks.discard(task)
            decided = not task.settled
            if decided:
                task.settled = True
                if error is None:
                    outcome = "completed"
                elif error is task.expired:
                    outcome = "timed_out"
                else:
                    outcome = "failed"
                self._counts[outcome] += 1
        if decided:
            if error is None:
                task.observer.on_completed()
            else:
                task.observer.on_error(error)

    def _cancel(self, task: _Task, error: Exception | None) -> None:
        """Decide a task's outcome as cancelled (a dispose, a close); stop its job."""
        with self._lock:
            if task.settled:
                return
            task.settled = True
            self._counts["cancelled"] += 1
            if task.state is _QUEUED:  # it leaves the counters at once
                task.state = _DONE
                self._queued -= 1
                self._wip -= 1
                self._tasks.discard(task)
        if error is not None:
            task.observer.on_error(error)
        task.cancel.on_next(None)


def _observable(job: Callable[[], Any]) -> Observable[Any]:
    """What a job returned, as an Observable (a value is emitted once)."""
    try:
        result = job()
    except Exception as exc:
        return reactivex.throw(exc)
    if isinstance(result, Observable):
        return result
    return reactivex.just(result)
