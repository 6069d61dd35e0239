"""The cold Observable ``execute`` returns, shared by the coordinator and the scheduler.

Each subscription is one submission, handed to a ``submit`` function (the coordinator's, or the
scheduler's for a tenant). :meth:`Execution.submit` is the seam the scheduler uses to hand a
subscription on to a tenant's coordinator without going through ``Observable.subscribe``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Hashable
from inspect import CO_COROUTINE
from types import FunctionType
from typing import Any, Final, Protocol, TypeVar, cast

from reactivex import Observable, abc

from ._core.checks import check_deadline, check_hashable, check_overflow
from ._core.waiter import Waiter

__all__ = ["AwaitObserver", "Awaited", "Execution", "Submit", "await_submission", "execution"]

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


class Awaited(Protocol):
    """``await`` of an async job, done whole by the awaiting task (the coordinator's fast path)."""

    def __call__(
        self,
        job: Callable[[], Any],
        key: Hashable | None,
        timeout: float | None,
        wait: bool | None,
    ) -> Coroutine[Any, Any, Any]: ...


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
        awaited: Awaited | None = None,
    ) -> None:
        # Not Observable.__init__: its RLock is for subclasses that use it (Subjects); this one
        # never does, and one lock per execute() call is measurable on the hot path.
        self._subscribe = None
        self._submit = submit  # TenantTaskCoordinator._submit, or TenantScheduler's for a tenant
        self._job = job
        self._key = key
        self._timeout = timeout
        self._is_async = is_async
        self._wait = wait  # overflow="wait" for this call (None: the coordinator's default)
        self._awaited = awaited if is_async else None

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
        On a coordinator without an admission the awaiting task does the whole submission
        (``TenantTaskCoordinator._awaited``). Cancelling the awaiting task cancels the job.
        """
        awaited = self._awaited
        if awaited is not None:
            return awaited(self._job, self._key, self._timeout, self._wait).__await__()
        return await_submission(
            self._submit, self._job, self._key, self._timeout, self._is_async, self._wait
        ).__await__()


async def await_submission(
    submit: Submit,
    job: Callable[[], Any],
    key: Hashable | None,
    timeout: float | None,  # noqa: ASYNC109 - the job's, counted from its start
    is_async: bool,
    wait: bool | None,
) -> Any:
    """Submit once for the awaiting task; the job's outcome (see ``Execution.__await__``)."""
    loop = asyncio.get_running_loop()
    observer = AwaitObserver(loop)
    subscription = submit(job, key, timeout, is_async, wait, observer, None)
    task = observer.now  # an async job whose turn came at once: no future, no waiter
    if task is None and not observer.ended:
        # Its turn (or its outcome) comes later: wait on one future. The turn is handed
        # over through the one waiter primitive, so a turn granted as the awaiting task is
        # cancelled is given back (its slot freed), never lost.
        turn: Waiter[Any] = Waiter(_give_back)
        observer.turn = turn
        future = observer.arm()
        turn.bind(observer.wake)
        try:
            await future
        except asyncio.CancelledError:
            subscription.dispose()
            turn.cancel()
            raise
        task = turn.take()
    if task is not None:
        return await task.coordinator.run_inline(task, observer)
    return observer.result()


class AwaitObserver(abc.ObserverBase[Any]):
    """The observer of an awaited execution: the job's outcome, or its turn to run inline.

    Every notification reaches it on the awaiter's loop thread (the coordinator delivers to a
    subscriber on a loop through that loop, and hands turns over the same way), so its state
    needs no lock of its own. A turn handed over while the awaiter is still inside ``submit``
    is taken at once (``now``); later ones go through ``turn``, a :class:`Waiter`.
    """

    __slots__ = ("_error", "_future", "_value", "ended", "loop", "now", "turn")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.now: Any = None
        self.turn: Waiter[Any] | None = None
        self.ended = False  # the outcome has arrived
        self._value: Any = None
        self._error: BaseException | None = None
        self._future: asyncio.Future[None] | None = None

    def hand(self, task: Any) -> None:
        """The coordinator hands ``task``'s turn over (on the loop thread)."""
        turn = self.turn
        if turn is None:  # still inside submit: the awaiter takes it as soon as that returns
            self.now = task
        else:
            turn.grant(task)

    def arm(self) -> asyncio.Future[None]:
        """A future that wakes the awaiter on the next turn or outcome."""
        future: asyncio.Future[None] = self.loop.create_future()
        self._future = future
        return future

    def wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def on_next(self, value: Any) -> None:
        self._value = value

    def on_error(self, error: Exception) -> None:
        if isinstance(error, StopIteration):  # as asyncio would refuse it from a future
            wrapped = RuntimeError(f"the job raised {error!r}")
            wrapped.__cause__ = error
            self._error = wrapped
        else:
            self._error = error
        self.ended = True
        self.wake()

    def on_completed(self) -> None:
        self.ended = True
        self.wake()

    def result(self) -> Any:
        """The outcome that has arrived: the job's value, or raise its error."""
        if self._error is not None:
            raise self._error
        return self._value

    async def outcome(self) -> Any:
        """After an inline run: the job's value, or raise its error.

        A timeout or a close decided on another thread delivers its error through the loop,
        possibly after the run ended here: wait for it rather than guess.
        """
        if not self.ended:
            await self.arm()
        return self.result()


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
    awaited: Awaited | None = None,
) -> Execution[Any]:
    """Validate ``execute``'s arguments at the call and build its cold Observable."""
    wait = None if overflow is None else check_overflow(overflow)
    if not callable(job):
        raise TypeError(f"job must be callable, not {job!r}")
    if key is not None:
        check_hashable(key, "key")  # an unhashable key fails here, at the call
    timeout = default_timeout if timeout is None else check_deadline(timeout)
    return Execution(submit, job, key, timeout, _is_async(job), wait, awaited)


def _is_async(job: Callable[[], Any]) -> bool:
    """``inspect.iscoroutinefunction(job)``, without its calls for the common shapes."""
    # An ``async def`` function, or a partial of one: its code flag says so. Everything else
    # (sync functions included, which may carry a coroutine mark on 3.12+) asks inspect.
    target = job.func if type(job) is functools.partial else job
    if type(target) is FunctionType and target.__code__.co_flags & CO_COROUTINE:
        return True
    return inspect.iscoroutinefunction(job)
