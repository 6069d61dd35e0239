"""The cold Observable ``execute`` returns, shared by the coordinator and the scheduler.

Each subscription is one submission, handed to a ``submit`` function (the coordinator's, or the
scheduler's for a tenant). :meth:`Execution.submit` is the seam the scheduler uses to hand a
subscription on to a tenant's coordinator without going through ``Observable.subscribe``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Generator, Hashable
from typing import Any, Final, Protocol, TypeVar, cast

from reactivex import Observable, abc

from ._core.checks import check_deadline, check_hashable, check_overflow
from ._core.futures import FutureObserver
from ._core.waiter import Waiter

__all__ = ["AwaitObserver", "Execution", "Submit", "execution"]

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
        layer: the outcome is delivered on this loop straight into a future, and an ``async
        def`` job whose turn comes runs inside the awaiting task itself (no task per job).
        Cancelling the awaiting task cancels the job.
        """
        return self._await().__await__()

    async def _await(self) -> _T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        observer = AwaitObserver(future, loop)
        subscription = self._submit(
            self._job, self._key, self._timeout, self._is_async, self._wait, observer, None
        )
        try:
            result = await future
        except asyncio.CancelledError:
            subscription.dispose()
            # A turn granted as we were cancelled is given back (the slot freed), never lost.
            observer.turn.cancel()
            raise
        if result is not _TURN:
            return cast(_T, result)
        task = observer.turn.take()
        assert task is not None
        return cast(_T, await task.coordinator.run_inline(task, observer))


class AwaitObserver(FutureObserver):
    """The observer of an awaited execution: an outcome, or the job's turn to run inline.

    ``turn`` is the one waiter primitive: the coordinator grants it the task when the job's
    turn comes (the awaiting task then runs the job); an awaiter that is gone by then gives it
    back, and the coordinator frees the slot. After the turn the outcome is kept here, since
    the future already woke the awaiter.
    """

    __slots__ = ("_ended", "_error", "_later", "loop", "turn")

    def __init__(self, future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(future)
        self.loop = loop
        self.turn: Waiter[Any] = Waiter(_give_back)
        self._error: Exception | None = None
        self._ended = False  # the outcome after the turn has arrived
        self._later: asyncio.Future[None] | None = None  # awaited if it had not yet
        self.turn.bind(self._wake)

    def _wake(self) -> None:
        if not self._future.done():
            self._future.set_result(_TURN)

    def on_error(self, error: Exception) -> None:
        if self._future.done():  # woken for the turn already: keep it for outcome()
            self._error = error
            self._end()
        else:
            super().on_error(error)

    def on_completed(self) -> None:
        if self._future.done():
            self._end()
        else:
            super().on_completed()

    def _end(self) -> None:
        self._ended = True
        later = self._later
        if later is not None and not later.done():
            later.set_result(None)

    async def outcome(self) -> Any:
        """After an inline run: the job's value, or raise its error.

        A timeout or a close decided on another thread delivers its error through the loop,
        possibly after the run ended here: wait for it rather than guess.
        """
        if not self._ended:
            self._later = self.loop.create_future()
            await self._later
        if self._error is not None:
            raise self._error
        return self._value


def _give_back(task: Any) -> None:
    task.coordinator._abandon(task)


_TURN: Final = object()  # resolves an awaiter's future: "your job's turn, run it here"


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
