"""Resolving asyncio futures with the outcome of work that ran elsewhere."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Final, TypeVar

from loguru import logger
from reactivex import Observable, abc
from reactivex.internal.exceptions import SequenceContainsNoElementsError

__all__ = [
    "AwaitableObservable",
    "FutureObserver",
    "LoopObserver",
    "last_value",
    "running_loop",
    "set_exception",
]

_T = TypeVar("_T")

# The loop running on this thread, or None: asyncio's own low-level form of get_running_loop
# (in ``asyncio.__all__``), which answers None where no loop runs (a subscriber on a plain
# thread, a worker) instead of raising. "Am I on that loop's thread?" is asked several times
# per job, grant and delivery (bench_asyncio's rows), and a raise-and-catch costs far more.
running_loop: Final = asyncio._get_running_loop


def set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    """``future.set_exception(error)``, for any exception a job can raise.

    asyncio refuses ``StopIteration`` (it would end the awaiting generator instead of raising),
    and the ``TypeError`` it raises instead, inside a loop callback, would leave the awaiter
    waiting forever. It arrives as a ``RuntimeError`` caused by it, as from a coroutine that
    raised ``StopIteration``.
    """
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(f"the job raised {error!r}")
        wrapped.__cause__ = error
        error = wrapped
    future.set_exception(error)


class FutureObserver(abc.ObserverBase[Any]):
    """Resolves an asyncio future with an Observable's last value, or its error.

    What ``await observable`` does in reactivex (``to_future``), for notifications that arrive on
    the future's loop; a ``StopIteration`` error is passed on as :func:`set_exception` does, and
    notifications after the future is done (cancelled) are dropped.
    """

    __slots__ = ("_future", "_has_value", "_value")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self._future = future
        self._value: Any = None
        self._has_value = False

    def on_next(self, value: Any) -> None:
        self._value = value
        self._has_value = True

    def on_error(self, error: Exception) -> None:
        if not self._future.done():
            set_exception(self._future, error)

    def on_completed(self) -> None:
        if self._future.done():
            return
        if self._has_value:
            self._future.set_result(self._value)
        else:
            self._future.set_exception(SequenceContainsNoElementsError())


class LoopObserver(abc.ObserverBase[Any]):
    """Passes a subscriber's notifications on from its asyncio loop's thread.

    An observer that resolves an asyncio future (``await``) must be called on the future's loop:
    called on another thread, ``set_result`` would not even wake the loop (asyncio futures are not
    thread-safe). Notifications made on the loop thread go through at once, unless earlier
    ones are still queued (then they queue too, to keep the order).
    """

    __slots__ = ("_lock", "_loop", "_observer", "_queued")

    def __init__(self, observer: abc.ObserverBase[Any], loop: asyncio.AbstractEventLoop) -> None:
        self._observer = observer
        self._loop = loop
        self._lock = threading.Lock()
        self._queued = 0

    def on_next(self, value: Any) -> None:
        self._forward(self._observer.on_next, value)

    def on_error(self, error: Exception) -> None:
        self._forward(self._observer.on_error, error)

    def on_completed(self) -> None:
        self._forward(self._observer.on_completed)

    def _forward(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        on_loop = running_loop() is loop
        with self._lock:
            direct = on_loop and not self._queued
            if not direct:
                self._queued += 1
        if direct:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(self._run, fn, args)
        except RuntimeError:  # the loop is closed: nobody is left to receive it
            with self._lock:
                self._queued -= 1
            logger.warning("rxcoord: event loop closed before a notification arrived")

    def _run(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        with self._lock:
            self._queued -= 1
        fn(*args)


class AwaitableObservable(Observable[_T]):
    """An Observable whose ``await`` is ``awaiting()`` instead of reactivex's ``to_future``.

    reactivex resolves its future from whatever thread notifies and knows nothing of the
    resources an Observable hands out; rxcoord's Observables that block, hop threads or emit
    leases say here how to await them safely.
    """

    def __init__(
        self,
        subscribe: Callable[[abc.ObserverBase[_T], abc.SchedulerBase | None], abc.DisposableBase],
        awaiting: Callable[[], Awaitable[_T]],
    ) -> None:
        super().__init__(subscribe)
        self._awaiting = awaiting

    def __await__(self) -> Generator[Any, None, _T]:
        return self._awaiting().__await__()


async def last_value(source: Observable[_T]) -> _T:
    """Await ``source``'s last value, whatever threads it notifies on.

    As reactivex's ``await`` (``SequenceContainsNoElementsError`` when it completes empty),
    but notifications are passed to the loop thread-safely and a ``StopIteration`` error
    arrives as :func:`set_exception` says. Cancelling the awaiting task disposes the
    subscription.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()
    subscription = source.subscribe(LoopObserver(FutureObserver(future), loop))
    try:
        return await future
    finally:
        subscription.dispose()
