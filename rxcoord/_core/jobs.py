"""The one job-runner contract: what a job may return, and running it to its real end.

Shared by ``KeyedLocks.run*`` (``rxcoord._locks._run``) and ``LeaseProvider.run``
(``rxcoord.leases``). A job is called as ``fn()`` or ``fn(lease)`` (decided once per ``run``
call from its signature, see :func:`job_takes_lease`), and what it returns decides what is
emitted:

* an Observable - subscribed at once; its items are forwarded while the lease is held, and the
  lease is released just before its completion or error is forwarded;
* a coroutine (an ``async def`` job), an asyncio future or another awaitable - run on the event
  loop that was running when ``run``'s Observable was subscribed (without one: a ``TypeError``
  to ``on_error``); the lease is released when it has finished, then its result is emitted;
* a ``concurrent.futures.Future`` - the lease is released when it is done, then its result is
  emitted;
* any other value - the lease is released, then the value is emitted and the Observable
  completes.

The lease is released only when the work has really ended: disposal asks a future or task to
stop, and its done-callback releases the lease once it has. :class:`JobRun` is that machinery;
each runner says how its lease is released and its terminal forwarded (an in-process lease is
released in memory; a distributed one by a store round trip that may report the lease lost).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from types import FunctionType, MethodType
from typing import Any, ClassVar, TypeAlias, TypeVar

from reactivex import Observable, abc
from reactivex.disposable import Disposable, SingleAssignmentDisposable
from reactivex.scheduler.eventloop import AsyncIOScheduler

from .futures import running_loop

__all__ = ["JobRun", "Work", "is_work", "job_takes_lease", "subscriber_loop"]

_R = TypeVar("_R")

# What a job may return besides a plain value: work whose result(s) the runner emits.
Work: TypeAlias = Observable[_R] | Awaitable[_R] | concurrent.futures.Future[_R]


def job_takes_lease(fn: Callable[..., Any]) -> bool:
    """How to call a job: False for ``fn()``, True for ``fn(lease)``.

    A job that can be called without arguments is called so (the shape ``run`` always had, so
    ``def job(retries=3)`` keeps its default); otherwise one that takes one positional argument
    gets the lease. Decided once per ``run*`` call: a plain function or bound method is read
    from its code object (a few attribute reads), anything else (``functools.partial``, a
    callable object, a builtin) through ``inspect.signature``. A callable whose signature
    cannot be read is called without arguments.

    Raises:
        TypeError: ``fn`` is not callable, or can be called neither as ``fn()`` nor as
            ``fn(lease)`` (say, it needs two arguments or a keyword-only one).
    """
    target: object = fn
    bound = 0
    if type(fn) is MethodType:
        target = fn.__func__
        bound = 1
    if type(target) is FunctionType:
        code = target.__code__
        if not code.co_kwonlyargcount or len(target.__kwdefaults__ or ()) == code.co_kwonlyargcount:
            required = code.co_argcount - bound - len(target.__defaults__ or ())
            if required <= 0:
                return False
            if required == 1:
                return True
            # Needs more arguments than a lease: the signature path explains it.
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return False
    for args in ((), (None,)):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return bool(args)
    raise TypeError(
        f"fn must be callable as fn() or fn(lease), but its signature is {signature}; "
        "wrap it, e.g. lambda lease: fn(lease, ...)"
    )


def is_work(result: object) -> bool:
    """Whether what a job returned is work to run to its end (an Observable, an awaitable or a
    ``concurrent.futures.Future``: :meth:`JobRun.start` runs it) rather than a plain value."""
    if type(result) in _PLAIN:  # the common case, without the checks below
        return False
    if isinstance(result, abc.ObservableBase | concurrent.futures.Future):
        return True
    return inspect.isawaitable(result)


class JobRun:
    """Run what a job returned to its real end, then release the lease and forward.

    The lease is released when the work has really ended, never before - exclusion holds for
    as long as the work can run:

    * an Observable's work is stopped by disposing its subscription (the Rx contract);
    * a future or coroutine is only *asked* to stop: a running executor job refuses
      (``cancel()`` returns False), a cancelled task still runs its cleanup. The lease is
      released by the done-callback, when the work has finished. (A concurrent future that
      accepted ``cancel()`` had not started and never will.) Coroutines run as tasks on the
      subscriber's loop, so their end is observed exactly.

    A subclass owns the lease and the ``done`` flag (disposed or terminated: nothing more is
    forwarded) and implements :meth:`_release`; it may override how a value, a completion or
    an error is forwarded (by default: release, then forward unless already done). ``inner``
    holds what stops the work; disposing it stops (or asks to stop) the work.
    """

    __slots__ = ("done", "inner", "loop", "observer")

    #: The ``TypeError`` for an awaitable with no loop to run on: what happened, and the fix.
    no_loop_message: ClassVar[str] = (
        "fn returned an awaitable but run() was not subscribed on a running event loop; "
        "subscribe (or await) it from a coroutine"
    )

    def __init__(
        self, observer: abc.ObserverBase[Any], loop: asyncio.AbstractEventLoop | None
    ) -> None:
        self.observer = observer
        self.loop = loop  # where coroutines run: the subscriber's loop, if any
        self.done = False
        self.inner = SingleAssignmentDisposable()

    # -- what a subclass provides ----------------------------------------------------------

    def _release(self) -> bool:
        """Release the lease (once); True if the caller should forward its terminal."""
        raise NotImplementedError

    def _finish_value(self, value: Any) -> None:
        if self._release():
            self.observer.on_next(value)
            self.observer.on_completed()

    def _completed(self) -> None:
        if self._release():
            self.observer.on_completed()

    def _terminate(self, error: Exception) -> None:
        if self._release():
            self.observer.on_error(error)

    # -- running the work ------------------------------------------------------------------

    def start(self, result: Any) -> bool:
        """Start what the job returned; True if a done-callback will release the lease.

        False: the work has ended (a value, an error) and the lease was released, or it is an
        Observable, whose terminal (or disposal) releases the lease.
        """
        if type(result) in _PLAIN:  # the common case, without the four checks below
            self._finish_value(result)
            return False
        if isinstance(result, abc.ObservableBase):
            if not self.done:  # disposed while fn ran: do not start it
                self.inner.disposable = result.subscribe(
                    self.observer.on_next, self._terminate, self._completed
                )
            return False
        if isinstance(result, concurrent.futures.Future):
            future: concurrent.futures.Future[Any] = result
            future.add_done_callback(self._future_done)
            # If dispose() came while fn ran, the assignment cancels at once.
            self.inner.disposable = Disposable(lambda: _cancel_concurrent(future))
            return True
        if asyncio.isfuture(result):
            return self._watch(result)
        if inspect.isawaitable(result):
            coroutine = result if inspect.iscoroutine(result) else _await(result)
            return self._start_coroutine(coroutine)
        self._finish_value(result)
        return False

    def _start_coroutine(self, coroutine: Coroutine[Any, Any, Any]) -> bool:
        loop = self.loop
        if loop is None:
            coroutine.close()
            self._terminate(TypeError(self.no_loop_message))
            return False
        if self.done:  # disposed while fn ran: never start it
            coroutine.close()
            return False
        if running_loop() is loop:
            self._spawn(loop, coroutine)
            return True
        try:
            loop.call_soon_threadsafe(self._spawn, loop, coroutine)
        except RuntimeError as exc:  # the loop is closed
            coroutine.close()
            self._terminate(exc)
            return False
        return True

    def _spawn(self, loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> None:
        """On the loop: run the coroutine as a task; its done-callback releases the lease."""
        if self.done:  # disposed before it could start: it never runs
            coroutine.close()
            self._release()
            return
        try:
            task = loop.create_task(coroutine)
        except Exception as exc:  # a task factory failed
            coroutine.close()
            self._terminate(exc)
            return
        self._watch(task)

    def _watch(self, future: asyncio.Future[Any]) -> bool:
        """Release and forward when an asyncio future is done (on its loop's thread)."""
        loop = future.get_loop()
        if running_loop() is loop:
            future.add_done_callback(self._future_done)
        else:
            try:
                loop.call_soon_threadsafe(future.add_done_callback, self._future_done)
            except RuntimeError as exc:  # the loop is closed: the future will not change
                if future.done():
                    self._future_done(future)
                else:
                    self._terminate(exc)
                return False
        # If dispose() came first, the assignment cancels at once.
        self.inner.disposable = Disposable(lambda: self._cancel(future))
        return True

    def _cancel(self, future: asyncio.Future[Any]) -> None:
        """Ask an asyncio future to stop; the done-callback releases the lease when it has."""
        loop = future.get_loop()
        if running_loop() is loop:
            future.cancel()
            return
        try:
            loop.call_soon_threadsafe(future.cancel)
        except RuntimeError:  # the loop is closed: the work cannot run any more
            self._release()

    def _future_done(self, future: Any) -> None:
        if future.cancelled():
            # concurrent.futures.CancelledError is an Exception (asyncio's is a BaseException).
            self._terminate(
                concurrent.futures.CancelledError("the work under the lease was cancelled")
            )
            return
        error = future.exception()
        if error is not None:
            self._terminate(error)
        else:
            self._finish_value(future.result())


def subscriber_loop(scheduler: abc.SchedulerBase | None) -> asyncio.AbstractEventLoop | None:
    """The asyncio loop a subscriber waits on: its subscribe-time scheduler's, or the running one.

    (``await observable`` subscribes with an ``AsyncIOScheduler`` of the running loop.)
    """
    if isinstance(scheduler, AsyncIOScheduler):
        return scheduler._loop
    return running_loop()


# Exact types that are never work to run (a subclass could be an awaitable: not listed).
_PLAIN: frozenset[type] = frozenset(
    {type(None), bool, int, float, str, bytes, tuple, list, dict, set, frozenset}
)


def _cancel_concurrent(future: concurrent.futures.Future[Any]) -> None:
    # True: it had not started and never will; its done-callback runs now and releases.
    # False: it runs (or ran); its done-callback releases when it has finished.
    future.cancel()


async def _await(awaitable: Awaitable[_R]) -> _R:
    return await awaitable
