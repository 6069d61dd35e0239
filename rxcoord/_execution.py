"""The cold Observable ``execute`` returns, shared by the coordinator and the scheduler.

Each subscription is one submission, handed to a ``submit`` function (the coordinator's, or the
scheduler's for a tenant). :meth:`Execution.submit` is the seam the scheduler uses to hand a
subscription on to a tenant's coordinator without going through ``Observable.subscribe``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Generator, Hashable
from typing import Any, Protocol, TypeVar, cast

from reactivex import Observable, abc

from ._core.checks import check_deadline, check_hashable, check_overflow
from ._core.futures import FutureObserver

__all__ = ["Execution", "Submit", "execution"]

_T = TypeVar("_T")


class Submit(Protocol):
    def __call__(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        wait: bool | None,
        observer: abc.ObserverBase[Any],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase: ...


class Execution(Observable[_T]):
    """The cold Observable ``execute`` returns: each subscription is one submission."""

    def __init__(
        self,
        submit: Submit,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        wait: bool | None,
    ) -> None:
        super().__init__()
        self._submit = submit  # TenantTaskCoordinator._submit, or TenantScheduler's for a tenant
        self._job = job
        self._key = key
        self._timeout = timeout
        self._is_async = is_async
        self._wait = wait  # overflow="wait" for this call (None: the coordinator's default)

    def _subscribe_core(
        self, observer: abc.ObserverBase[_T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        return self._submit(
            self._job, self._key, self._timeout, self._is_async, self._wait, observer, scheduler
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
            self._job, self._key, self._timeout, self._is_async, self._wait, observer, scheduler
        )

    def submit(
        self, observer: abc.ObserverBase[Any], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        """Submit once for ``observer``: a subscription without ``subscribe``'s wrapping."""
        return self._submit(
            self._job, self._key, self._timeout, self._is_async, self._wait, observer, scheduler
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
            self._job,
            self._key,
            self._timeout,
            self._is_async,
            self._wait,
            FutureObserver(future),
            None,
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


def execution(
    submit: Submit,
    job: Callable[[], Any],
    key: Hashable | None,
    timeout: float | None,
    default_timeout: float | None,
    overflow: str | None = None,
) -> Execution[Any]:
    """Validate ``execute``'s arguments at the call and build its cold Observable."""
    wait = None if overflow is None else check_overflow(overflow)
    if not callable(job):
        raise TypeError(f"job must be callable, not {job!r}")
    if key is not None:
        check_hashable(key, "key")  # an unhashable key fails here, at the call
    timeout = default_timeout if timeout is None else check_deadline(timeout)
    return Execution(submit, job, key, timeout, inspect.iscoroutinefunction(job), wait)
