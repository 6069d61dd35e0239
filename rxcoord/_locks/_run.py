"""The job runner of KeyedLocks: ``run*`` calls a job under a lease, released when the work ends.

One contract with the other job runners of rxcoord (``TenantTaskCoordinator.execute``,
``LeaseProvider.run``): a job is called as ``fn()`` or, like ``LeaseProvider.run``'s, as
``fn(lease)`` (decided once per ``run*`` call from its signature, see :func:`job_takes_lease`),
and what it returns decides what is emitted:

* an Observable - subscribed at once; its items are forwarded while the lease is held, and the
  lease is released just before its completion or error is forwarded;
* a coroutine (an ``async def`` job), an asyncio future or another awaitable - run on the event
  loop that was running when ``run``'s Observable was subscribed; the lease is released when it
  has finished, then its result is emitted;
* a ``concurrent.futures.Future`` - the lease is released when it is done, then its result is
  emitted;
* any other value - the lease is released, then the value is emitted and the Observable
  completes.

The lease is released only when the work has really ended: disposal asks a future or task to
stop, and its done-callback releases the lease once it has (see :class:`RunSink`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from types import FunctionType, MethodType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from reactivex import Observable, abc
from reactivex.disposable import Disposable, SingleAssignmentDisposable

from ._lease import Lease
from ._waiting import Acquisition, Target

if TYPE_CHECKING:
    from ._facade import KeyedLocks

__all__ = ["RunSink", "Work", "job_takes_lease"]

_R = TypeVar("_R")

# What ``run`` accepts from ``fn`` besides a plain value: work whose result(s) it emits.
Work: TypeAlias = Observable[_R] | Awaitable[_R] | concurrent.futures.Future[_R]

_CO_VARARGS = inspect.CO_VARARGS


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


class RunSink(Target):
    """One subscription to ``run*``: call ``fn`` under the lease, forward, release.

    The lease is released when the work has really ended, never before - exclusion holds for
    as long as the work can run:

    * ``fn`` itself (and the subscription to the Observable it returned) cannot be stopped:
      disposed meanwhile, ``on_lease`` releases the lease when it returns;
    * an Observable's work is stopped by disposing its subscription (the Rx contract);
    * a future or coroutine is only *asked* to stop: a running executor job refuses
      (``cancel()`` returns False), a cancelled task still runs its cleanup. The lease is
      released by the done-callback, when the work has finished. (A concurrent future that
      accepted ``cancel()`` had not started and never will.) Coroutines run as tasks on the
      subscriber's loop, so their end is observed exactly.
    """

    __slots__ = (
        "acquisition",
        "done",
        "fn",
        "inner",
        "lease",
        "locks",
        "loop",
        "observer",
        "pass_lease",
        "running",
    )

    acquisition: Acquisition

    def __init__(
        self,
        locks: KeyedLocks,
        fn: Callable[..., Any],
        pass_lease: bool,
        observer: abc.ObserverBase[Any],
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.locks = locks
        self.fn = fn
        self.pass_lease = pass_lease  # fn(lease) rather than fn() (see job_takes_lease)
        self.observer = observer
        self.loop = loop
        self.lease: Lease | None = None
        self.done = False  # disposed or terminated: nothing more is forwarded
        # fn (or the inner subscribe call) is executing, or the work it started is in flight:
        # whoever ends it releases the lease, not dispose().
        self.running = False
        self.inner = SingleAssignmentDisposable()

    def on_lease(self, lease: Lease) -> None:
        mutex = self.locks._mutex
        with mutex:
            abandoned = self.done
            if not abandoned:
                self.lease = lease
                self.running = True
        if abandoned:
            self.locks._release_if_held(lease)
            return
        in_flight = False
        try:
            in_flight = self._start_work(lease)
        finally:
            if not in_flight:
                with mutex:
                    self.running = False
                    # Disposed while the work ran: dispose() left the lease to us.
                    orphaned = self.done and self.lease is not None
                if orphaned:
                    self._release()

    def _start_work(self, lease: Lease) -> bool:
        """Call ``fn``, start what it returned; True if a done-callback will release the lease."""
        try:
            result = self.fn(lease) if self.pass_lease else self.fn()
        except Exception as exc:
            self._terminate(exc)
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
            self._terminate(
                TypeError(
                    "fn returned an awaitable but run() was not subscribed on a running "
                    "event loop; subscribe (or await) it from a coroutine, or use hold_async"
                )
            )
            return False
        if self.done:  # disposed while fn ran: never start it
            coroutine.close()
            return False
        if asyncio._get_running_loop() is loop:
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
        if asyncio._get_running_loop() is loop:
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
        if asyncio._get_running_loop() is loop:
            future.cancel()
            return
        try:
            loop.call_soon_threadsafe(future.cancel)
        except RuntimeError:  # the loop is closed: the work cannot run any more
            self._release()

    def on_error(self, error: Exception) -> None:
        self._terminate(error)

    def _release(self) -> bool:
        """Release the lease (once); True if the caller should forward its terminal."""
        with self.locks._mutex:
            forward = not self.done
            self.done = True
            lease = self.lease
            self.lease = None
        if lease is not None:
            self.locks._release_if_held(lease)
        return forward

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

    def dispose(self) -> None:
        self.acquisition.dispose()  # withdraws the request if it still waits
        with self.locks._mutex:
            self.done = True
            lease = None if self.running else self.lease
            if lease is not None:
                self.lease = None
        self.inner.dispose()  # stop the work first, then free the keys
        if lease is not None:
            self.locks._release_if_held(lease)


def _cancel_concurrent(future: concurrent.futures.Future[Any]) -> None:
    # True: it had not started and never will; its done-callback runs now and releases.
    # False: it runs (or ran); its done-callback releases when it has finished.
    future.cancel()


async def _await(awaitable: Awaitable[_R]) -> _R:
    return await awaitable
