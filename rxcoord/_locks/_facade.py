"""The KeyedLocks facade: the public API over the grant table, the lease and the waiting side.

KeyedLocks is an in-process lock manager: ownerless leases on keys, bulk and global requests,
FIFO, no polling, no leaks, waited on by blocking, by asyncio and by Rx subscriptions. This
module validates the arguments, owns the mutex that guards the grant table (``_table.py``),
and wires the lease, the waiting side and the job runner together (see the package docstring
for the layout).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from reactivex import Observable, abc
from reactivex.disposable import Disposable

from .._core.checks import check_wait
from .._core.futures import AwaitableObservable, LoopObserver, last_value
from .._core.jobs import subscriber_loop
from .._errors import LeaseReleasedError
from ._lease import Lease
from ._run import RunSink, Work, job_takes_lease
from ._table import HELD, NEW, GrantTable
from ._waiting import (
    Acquisition,
    AsyncHold,
    ObserverTarget,
    acquire_async,
    acquire_blocking,
    notify,
)

__all__ = ["KeyedLocks", "KeyedLocksStats", "Lease"]

_R = TypeVar("_R")


@dataclass(frozen=True, slots=True)
class KeyedLocksStats:
    """A consistent snapshot of a :class:`KeyedLocks` (from :meth:`KeyedLocks.stats`).

    Attributes:
        keys: Keys with state: held, or waited for by some request (``len(locks)``).
        held: Leases granted and not yet released (a global lease counts as one).
        waiting: Requests waiting to be granted (single, bulk and global).
        global_held: True while a global lease is held.
        global_waiting: Global requests waiting to be granted.
        contended_total: Requests that could not be granted at once and had to wait.
        timeouts_total: Requests withdrawn because their timeout expired.
        cancelled_total: Pending requests withdrawn by disposal or cancellation.
    """

    keys: int
    held: int
    waiting: int
    global_held: bool
    global_waiting: int
    contended_total: int
    timeouts_total: int
    cancelled_total: int


def _wait(timeout: float | None) -> float | None:
    """A lock timeout, by the one validation policy (``check_wait``: None or inf wait forever,
    0 is a try-lock; NaN, negatives, bools and non-numbers are refused)."""
    # (acquire, hold_async and run inline this: None, the common case, then costs no call.)
    return timeout if timeout is None else check_wait(timeout)


def _check_keys(keys: Iterable[Hashable]) -> tuple[Hashable, ...]:
    if isinstance(keys, str | bytes):
        raise TypeError(
            f"keys must be an iterable of keys, not {type(keys).__name__} {keys!r}; "
            "use acquire(key)/hold(key) for a single key"
        )
    distinct = tuple(dict.fromkeys(keys))  # hashes every key (TypeError here) and deduplicates
    if not distinct:
        raise ValueError("acquire_many/hold_many/run_many need at least one key")
    return distinct


class KeyedLocks(GrantTable):
    """An in-process lock manager: exclusive leases on keys, bulk and global, FIFO, no polling.

    Keys are any hashable values (with a cheap, well-behaved ``__hash__``/``__eq__``: they run
    under the internal lock, as dict operations); an unhashable key raises ``TypeError`` at the
    call. Per-key state exists only while a key is held or waited for, so millions of distinct
    keys leave nothing behind (``len(locks) == 0`` whenever nothing is held or waited on).

    Example::

        locks = KeyedLocks()
        with locks.hold("order-42"):                    # blocking, for threads
            ...
        async with locks.hold_many_async(["a", "b"]):   # asyncio
            ...
        locks.acquire_all().subscribe(lambda lease: audit_then(lease.release))  # Rx

    Guarantees (``rxcoord/_locks/_table.py`` explains the algorithm):

    * **Exclusion**: no two live leases cover the same key; a global lease coexists with no
      other lease.
    * **Ownerless leases**: acquire on one thread, release on another. Double release raises
      :class:`LeaseReleasedError`; releasing another KeyedLocks' lease through this one raises
      ``ValueError``. Not reentrant: a second request for a key you hold waits for your own
      release (with ``timeout=0`` it fails at once).
    * **Non-blocking waits**: ``acquire*`` return Observables that emit the lease when granted
      (on the releasing thread, or on ``scheduler``); waiting blocks no thread. ``hold*``
      (threads) and ``hold*_async`` (asyncio) are thin wrappers over the same requests (the
      uncontended ``hold`` is a direct fast path).
    * **All-or-nothing bulk**: a bulk request is granted in one step when all its keys are
      free, so any key order is deadlock-free and disjoint bulk requests run in parallel.
    * **Global without polling**: a global request waits for earlier leases to be released
      (event-driven) and, from the moment it is made, nothing on any key - seen before or
      not - is granted ahead of it.
    * **FIFO**: conflicting requests are granted in request order; a request that conflicts
      with nothing earlier is granted at once.
    * **Cancellation**: disposing a pending subscription, cancelling a waiting task or a
      ``timeout`` expiring (``LockTimeout``) withdraws the request and its state.

    ``timeout=None`` waits forever, ``timeout=0`` only takes a lease that is free right now.
    """

    # The grant table's fields come from GrantTable (see its docstring for why the facade
    # extends it); the mutex guards every one of them.
    __slots__ = ("__weakref__", "_cancelled", "_mutex", "_timeouts")

    def __init__(self) -> None:
        super().__init__()
        self._mutex = threading.Lock()
        self._timeouts = 0  # requests whose wait expired (LockTimeout, try-locks aside)
        self._cancelled = 0  # pending requests withdrawn by disposal or cancellation

    # -- public API: Observables -------------------------------------------------------------

    def acquire(
        self,
        key: Hashable,
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Lease]:
        """An Observable that emits one :class:`Lease` on ``key`` when granted, then completes.

        Nothing happens until it is subscribed; each subscription is a new request. Waiting
        blocks no thread: the lease is emitted by the thread that makes it free (or at once,
        inside ``subscribe``, if the key is free), or on ``scheduler`` if one is given.

        Disposing the subscription before the lease is emitted withdraws the request; a lease
        granted to a disposed subscription is released, never lost. Release the lease you
        receive (``lease.release()`` or ``with lease:``) on any thread.

        Grants that become due while a thread is already delivering one (say, ``on_next``
        releases another lease) are delivered right after that ``on_next`` returns, so a chain
        of hand-overs is a loop, not a recursion. Hence ``on_next`` must not block waiting for
        another ``acquire`` subscriber that the same release would serve; pass a
        ``scheduler`` if handlers block. Subscribed on a running asyncio loop (``await
        locks.acquire(key)``, or ``subscribe`` in a coroutine) and without ``scheduler``, the
        lease is delivered on that loop's thread; :meth:`hold_async` is the simpler form.
        ``await locks.acquire(key)`` itself waits as :meth:`hold_async` does (whatever the
        ``scheduler``), so a task cancelled right after the grant releases the lease.
        If the scheduler refuses the delivery (``schedule()`` raises: it was disposed), the
        lease is released and the error goes to ``on_error``.

        Args:
            key: Any hashable value.
            timeout: Seconds to wait before erroring with :class:`LockTimeout` (the request is
                withdrawn); ``None`` waits forever, ``0`` only takes a free key.
            scheduler: Deliver ``on_next``/``on_completed``/``on_error`` on this scheduler
                instead of the granting thread.

        Returns:
            An Observable of one Lease.

        Raises:
            TypeError: ``key`` is unhashable, or ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        hash(key)
        return self._observable(
            (key,), timeout if timeout is None else check_wait(timeout), scheduler
        )

    def acquire_many(
        self,
        keys: Iterable[Hashable],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Lease]:
        """Like :meth:`acquire` for several keys, granted all at once (duplicates collapse).

        The request holds nothing while it waits and is granted in one step when every key is
        free (and no earlier conflicting request waits), so bulk requests in any key order can
        never deadlock, and bulk requests on disjoint keys run in parallel.

        Args:
            keys: A non-empty iterable of hashable keys (a ``str`` is refused, not split).
            timeout: As for :meth:`acquire`.
            scheduler: As for :meth:`acquire`.

        Returns:
            An Observable of one Lease covering every key.

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, or ``timeout`` is
                not a number.
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
        """
        return self._observable(_check_keys(keys), _wait(timeout), scheduler)

    def acquire_all(
        self,
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Lease]:
        """An Observable that emits one global :class:`Lease`: every key, exclusively.

        Granted when every lease requested before it has been released (no polling: the last
        release grants it). From the moment it is requested, no request made later - on any
        key, including keys never seen before - is granted ahead of it.

        Args:
            timeout: As for :meth:`acquire`.
            scheduler: As for :meth:`acquire`.

        Returns:
            An Observable of one global Lease.

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        return self._observable((), _wait(timeout), scheduler)

    # -- public API: blocking ----------------------------------------------------------------

    def hold(self, key: Hashable, *, timeout: float | None = None) -> Lease:
        """A lease on ``key`` to use as a context manager: entering blocks until it is granted.

        ``with locks.hold(key) as lease: ...`` - released on exit (unless released already).
        The uncontended case is a direct fast path (no Rx subscription, no waiter object).
        Each call makes a new request; enter it once.

        Args:
            key: Any hashable value.
            timeout: Seconds ``__enter__`` waits; ``None`` waits forever, ``0`` is a try-lock.

        Returns:
            The (not yet granted) :class:`Lease`; ``__enter__`` returns it granted.

        Raises:
            TypeError: ``key`` is unhashable, or ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__enter__``) not granted within ``timeout``.
        """
        hash(key)
        # Lease(...) inlined: skipping the __init__ frame is a tenth of an uncontended hold
        # (bench_asyncio's hold_async uncontended row).
        lease: Lease = object.__new__(Lease)
        lease._owner = self
        lease._keys = (key,)
        lease._key = key
        lease._state = NEW
        # _entered is left unset (read as True: entering it is the request, there is no second
        # entry) - one store less on the hot path.
        lease._timeout = timeout if timeout is None else check_wait(timeout)
        return lease

    def hold_many(self, keys: Iterable[Hashable], *, timeout: float | None = None) -> Lease:
        """Blocking form of :meth:`acquire_many`; see :meth:`hold`.

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, or ``timeout`` is
                not a number.
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__enter__``) not granted within ``timeout``.
        """
        lease = Lease(self, _check_keys(keys))
        lease._entered = True
        lease._timeout = _wait(timeout)
        return lease

    def hold_all(self, *, timeout: float | None = None) -> Lease:
        """Blocking form of :meth:`acquire_all`; see :meth:`hold`.

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__enter__``) not granted within ``timeout``.
        """
        lease = Lease(self, ())
        lease._entered = True
        lease._timeout = _wait(timeout)
        return lease

    # -- public API: asyncio -----------------------------------------------------------------

    def hold_async(self, key: Hashable, *, timeout: float | None = None) -> AsyncHold:
        """An async context manager that waits (without blocking the loop) for ``key``.

        ``async with locks.hold_async(key) as lease: ...``. Cancelling the waiting task
        withdraws the request; a lease granted at that moment is released.

        Args:
            key: Any hashable value.
            timeout: Seconds to wait; ``None`` waits forever, ``0`` is a try-lock.

        Returns:
            An async context manager whose ``__aenter__`` returns the :class:`Lease`.

        Raises:
            TypeError: ``key`` is unhashable, or ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__aenter__``) not granted within ``timeout``.
        """
        hash(key)
        # AsyncHold(...) inlined: a frame less on every hold_async (bench_asyncio's hold rows).
        hold: AsyncHold = object.__new__(AsyncHold)
        hold._locks = self
        hold._keys = (key,)
        hold._timeout = timeout if timeout is None else check_wait(timeout)
        hold._lease = None
        return hold

    def hold_many_async(
        self, keys: Iterable[Hashable], *, timeout: float | None = None
    ) -> AsyncHold:
        """Asyncio form of :meth:`acquire_many`; see :meth:`hold_async`.

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, or ``timeout`` is
                not a number.
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__aenter__``) not granted within ``timeout``.
        """
        return AsyncHold(self, _check_keys(keys), _wait(timeout))

    def hold_all_async(self, *, timeout: float | None = None) -> AsyncHold:
        """Asyncio form of :meth:`acquire_all`; see :meth:`hold_async`.

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__aenter__``) not granted within ``timeout``.
        """
        return AsyncHold(self, (), _wait(timeout))

    # -- public API: run under a lease -------------------------------------------------------

    @overload
    def run(
        self,
        key: Hashable,
        fn: Callable[[], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        key: Hashable,
        fn: Callable[[Lease], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        key: Hashable,
        fn: Callable[[], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        key: Hashable,
        fn: Callable[[Lease], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    def run(
        self,
        key: Hashable,
        fn: Callable[..., Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """Run ``fn`` under a lease on ``key``; the lease is released when ``fn``'s work ends.

        ``fn`` is called when the lease is granted, on the granting thread (or ``scheduler``),
        as ``fn()`` or - like ``LeaseProvider.run``'s jobs - as ``fn(lease)``, so the job can
        see its keys or release early: a ``fn`` callable without arguments is called so, one
        that needs exactly one positional argument gets the :class:`Lease` (decided once, here,
        from its signature). What ``fn`` returns decides what the Observable emits and when the
        lease is released:

        * a plain value - the lease is released, then the value is emitted and the Observable
          completes;
        * a coroutine (``fn`` is an ``async def``, or returns one), an asyncio future or any
          other awaitable - run on the event loop that was running when ``run``'s Observable
          was subscribed (without one, an awaitable is a ``TypeError`` to ``on_error``); the
          lease is released when it has finished, then its result is emitted;
        * a ``concurrent.futures.Future`` (say, from ``executor.submit``) - the lease is
          released when it is done, then its result is emitted;
        * an Observable - subscribed at once; its items are forwarded while the lease is held,
          and the lease is released just before its completion or error is forwarded.

        So the Observable emits one value (or, for an Observable job, its items) and completes,
        or errors with ``fn``'s exception, the work's, or :class:`LockTimeout`. An exception
        from ``fn`` releases the lease and becomes ``on_error``. Disposing the subscription
        withdraws a waiting request, or disposes/cancels ``fn``'s work and releases the lease
        once that work has ended: a running executor job that refuses ``cancel()``, or a
        cancelled coroutine running its cleanup, keeps the lease until it finishes (exclusion
        holds for as long as the work runs).

        Subscribed on a running asyncio loop (``await locks.run(...)``), the notifications
        reach the subscriber on the loop's thread, whichever thread granted the lease.

        Args:
            key: Any hashable value.
            fn: The work to run under the lease: ``fn()`` or ``fn(lease)``.
            timeout: Seconds to wait for the lease (``LockTimeout`` on expiry); ``fn``'s own
                run time is not limited.
            scheduler: Call ``fn`` and deliver the results on this scheduler.

        Returns:
            An Observable of ``fn``'s result(s).

        Raises:
            TypeError: ``key`` is unhashable, ``timeout`` is not a number, or ``fn`` can be
                called neither as ``fn()`` nor as ``fn(lease)``.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        hash(key)
        return self._run((key,), fn, timeout if timeout is None else check_wait(timeout), scheduler)

    @overload
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[Lease], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[Lease], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[..., Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """:meth:`run` under a bulk lease on ``keys`` (see :meth:`acquire_many`).

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, ``timeout`` is
                not a number, or ``fn`` takes neither no argument nor one (the lease).
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
        """
        return self._run(_check_keys(keys), fn, _wait(timeout), scheduler)

    @overload
    def run_all(
        self,
        fn: Callable[[], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_all(
        self,
        fn: Callable[[Lease], Work[_R]],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_all(
        self,
        fn: Callable[[], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run_all(
        self,
        fn: Callable[[Lease], _R],
        *,
        timeout: float | None = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    def run_all(
        self,
        fn: Callable[..., Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """:meth:`run` under a global lease (see :meth:`acquire_all`).

        Raises:
            TypeError: ``timeout`` is not a number, or ``fn`` takes neither no argument nor
                one (the lease).
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        return self._run((), fn, _wait(timeout), scheduler)

    # -- public API: misc --------------------------------------------------------------------

    def release(self, lease: Lease) -> None:
        """Release ``lease``, checking that it belongs to this KeyedLocks.

        Raises:
            TypeError: ``lease`` is not a :class:`Lease`.
            ValueError: ``lease`` was granted by another KeyedLocks.
            LeaseReleasedError: The lease was already released.
        """
        if not isinstance(lease, Lease):
            raise TypeError(f"expected a Lease, got {lease!r}")
        if lease._owner is not self:
            raise ValueError(
                f"{lease!r} belongs to another KeyedLocks; release it through that one"
            )
        self._release(lease)

    def __len__(self) -> int:
        """Keys with state: held, or waited for by some request."""
        return len(self._queues)

    def __bool__(self) -> bool:
        """Always true: an idle KeyedLocks (``len() == 0``) is still a lock manager."""
        return True

    def stats(self) -> KeyedLocksStats:
        """A consistent snapshot of the lock manager's state and counters."""
        with self._mutex:
            counts = self._counts()
            return KeyedLocksStats(
                keys=counts.keys,
                held=counts.held,
                waiting=counts.waiting,
                global_held=counts.global_held,
                global_waiting=counts.global_waiting,
                contended_total=self._contended,
                timeouts_total=self._timeouts,
                cancelled_total=self._cancelled,
            )

    def __repr__(self) -> str:
        s = self.stats()
        return f"<KeyedLocks keys={s.keys} held={s.held} waiting={s.waiting}>"

    # -- release (the one transition anyone may trigger) ---------------------------------------

    def _release(self, lease: Lease) -> None:
        mutex = self._mutex
        mutex.acquire()
        try:
            state = lease._state
            if state == HELD:
                granted = self._take_out(lease)
        finally:
            mutex.release()
        # Messages are built outside the mutex: repr() of a key is user code.
        if state != HELD:
            if lease.released:
                raise LeaseReleasedError(f"{lease!r} was already released")
            raise RuntimeError(f"{lease!r} was never granted: enter it with 'with' first")
        if granted is not None:
            notify(granted)

    def _release_if_held(self, lease: Lease) -> bool:
        """Release ``lease`` unless it is already released; True if this call released it."""
        mutex = self._mutex
        mutex.acquire()
        try:
            if lease._state != HELD:
                return False
            granted = self._take_out(lease)
        finally:
            mutex.release()
        if granted is not None:
            notify(granted)
        return True

    def _acquire_blocking(self, lease: Lease, timeout: float | None) -> Lease:
        """``Lease.__enter__`` off its fast path (see ``_waiting.acquire_blocking``)."""
        return acquire_blocking(self, lease, timeout)

    # -- Observables -------------------------------------------------------------------------

    def _observable(
        self,
        keys: tuple[Hashable, ...],
        timeout: float | None,
        scheduler: abc.SchedulerBase | None,
    ) -> Observable[Lease]:
        def subscribe(
            observer: abc.ObserverBase[Lease], default: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            # Grants come from any thread. A subscriber on an asyncio loop (``await``, or
            # subscribed in a coroutine) gets the lease on its loop's thread, through
            # call_soon_threadsafe: the subscribe-time scheduler itself (an AsyncIOScheduler)
            # is not thread-safe. An explicit ``scheduler=`` takes precedence.
            loop = None if scheduler is not None else subscriber_loop(default)
            acquisition = Acquisition(
                Lease(self, keys), ObserverTarget(observer), scheduler, timeout, loop
            )
            return acquisition.start()

        # ``await``: the hold_async path, not reactivex's (which resolves its future from the
        # delivering thread, never waking the loop with ``scheduler=``, and drops a lease
        # granted just before the awaiting task is cancelled: held forever).
        return AwaitableObservable(
            subscribe, lambda: acquire_async(self, Lease(self, keys), timeout)
        )

    def _run(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        timeout: float | None,
        scheduler: abc.SchedulerBase | None,
    ) -> Observable[Any]:
        pass_lease = job_takes_lease(fn)  # once per call, not per subscription

        def subscribe(
            observer: abc.ObserverBase[Any], default: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            # On an asyncio loop, coroutines run there and every notification is passed on
            # from its thread (``fn`` itself still runs on the granting thread or scheduler).
            loop = subscriber_loop(default)
            if loop is not None:
                observer = LoopObserver(observer, loop)
            sink = RunSink(self, fn, pass_lease, observer, loop, contextvars.copy_context())
            acquisition = Acquisition(Lease(self, keys), sink, scheduler, timeout)
            sink.acquisition = acquisition
            acquisition.start()
            return Disposable(sink.dispose)

        # ``await``: like reactivex's, but a StopIteration from ``fn`` arrives as a RuntimeError
        # instead of breaking the future (see rxcoord._core.futures).
        observable: AwaitableObservable[Any] = AwaitableObservable(
            subscribe, lambda: last_value(observable)
        )
        return observable
