"""KeyedLocks: exclusive per-key leases that can move between threads, bulk and global requests.

Why not the textbook design? A refcounted dict of ``Semaphore(1)`` ties a waiting operation to a
blocked thread, a ``bulk_mutex`` serialises every bulk operation (even on disjoint keys), and a
global operation polls a counter with ``sleep(0.1)`` behind a fair read-write lock. Here one small
state machine under one internal ``threading.Lock`` serves every kind of request, waiting blocks
no thread (a waiter is a queue entry that is *notified*), and per-key state exists only while
someone holds or waits for the key.

The rule
--------
Every request - one key, several keys, or *global* - takes its place in a single request order
when it is made. Two requests *conflict* when they share a key or either is global. A request is
*present* from the moment it is made until it is released (if granted) or withdrawn (timeout or
disposal). The whole algorithm implements one rule:

    **A request is granted exactly when no earlier present request conflicts with it.**

Everything the issue promises follows from it:

* *exclusion* - two granted requests never conflict (the later one would have had an earlier
  present conflicting request);
* *FIFO among conflicting requests* - a request never overtakes an earlier one it conflicts with,
  so neither single, bulk nor global requests can be starved by a stream of others;
* *eagerness* - a request conflicting with nothing earlier is granted at once (no bulk mutex:
  bulk requests on disjoint keys run in parallel);
* *all-or-nothing bulk* - a bulk request is granted in one step or not at all; nothing is held
  while waiting, so no key order can deadlock;
* *global barrier* - a global request conflicts with everything, so no request made after it
  (on any key, seen or never seen) is granted before it, and it is granted when every earlier
  request is gone. Event-driven: the release that removes the last earlier request grants it.

Because the set of granted requests is a pure function of the sequence of present requests, the
hypothesis test checks the implementation against a ten-line model of that rule.

The data structures
-------------------
*Per-key queues.* ``_queues[key]`` holds the present non-global requests on ``key`` in request
order: the bare request when it is the only one (the uncontended case allocates no queue), a
``deque`` otherwise. A granted request is at the head of each of its keys' queues. Each pending
request counts, in ``_waiting``, the keys whose queue it is not the head of; when a head leaves,
the next request's count drops, and at zero it conflicts with nothing earlier *on any key*.

*Segments and barriers* (for global requests, without ever scanning keys). Global requests cut
the request order into segments::

    [ segment 0 ] G1 [ segment 1 ] G2 [ segment 2 = tail ]

A ``_Segment`` counts its present non-global requests; its ``barrier`` is the global request that
closes it. Only the first segment (``_first``) is free of earlier global requests, so:

* a non-global request is granted when ``_waiting == 0`` *and* its segment is ``_first``; when
  ``_waiting`` reaches zero in a later segment, it parks in that segment's ``ready`` set (and
  leaves it if withdrawn);
* the first global request ``_first.barrier`` is granted when ``_first.count == 0``;
* releasing it makes the next segment first and grants its ``ready`` requests (and the next
  global request, if that segment is empty);
* withdrawing a *pending* global request merges the segment after it into the one before it
  (``merged`` pointers, resolved lazily like a union-find), since nothing separates them now.

With no global request present, ``_first is _tail`` and the global machinery costs one identity
check per request.

Cost: a request or release does O(its keys) dict work plus O(1) per waiter it promotes; a
withdrawal also removes itself from the middle of its keys' queues (O(conflicting waiters)). The
internal lock is held for exactly that, never while user code runs (except the keys' own
``__hash__``/``__eq__``, as in any dict).

The hot path. An uncontended ``with locks.hold(key)`` is what most programs do most of the
time, so it is inlined in ``Lease.__enter__``/``__exit__``: no global request present and the
key absent means one dict insert, and a lease alone on its key with no global request means
one dict delete - no waiter object, no Rx subscription, no function calls in between. The lease
*is* the request (one allocation), and the mutex is taken with explicit ``acquire()``/
``release()``, which costs half of a ``with`` block in CPython 3.11.

Notification and delivery
-------------------------
Grants are decided under the lock and *delivered* after it is released, by the thread that
caused them (the releasing, withdrawing or disposing thread): a blocking ``hold`` waiter's own
``threading.Lock`` is released, an asyncio waiter's future is resolved through
``call_soon_threadsafe``, and an ``acquire`` subscriber gets ``on_next(lease)`` - on the given
scheduler if there is one, on its event loop's thread if it subscribed on one (``await``).
Deliveries to subscribers go through a per-thread trampoline, so a chain of "release -> next
subscriber runs -> releases -> ..." is a loop, not a recursion. If a delivery raises a
``BaseException`` (``KeyboardInterrupt``), the other grants of the same release are still
delivered (on the grant workers) before it propagates.

Timeouts of ``acquire`` subscriptions fire on rxcoord's shared timer thread, which only withdraws
the request. The ``LockTimeout`` goes to rxcoord's shared delivery workers (``hand_off``);
the grants the withdrawal unblocks go to KeyedLocks' own grant workers, because their
subscribers' work (``on_next``, ``run``'s ``fn``) runs as long as it likes and must not delay
the process's other timeouts.

A lease granted to a subscription that was disposed before it could be delivered is released by
KeyedLocks - by ``dispose()`` itself, since a scheduler may never run the delivery. If disposal
races with delivery, the lease is either released or handed to the subscriber's ``on_next`` -
never dropped, never both (the two decide under the mutex): the ``AutoDetachObserver`` that
reactivex wraps every observer in would silently drop an ``on_next`` after ``dispose`` began,
so delivery calls the wrapped callback directly. (Rx operators placed between ``acquire`` and
the subscriber, such as ``timeout`` or ``take_until``, may still drop an item on disposal, as
they do with any item: use the ``timeout=`` argument rather than ``ops.timeout``.) A delivery
the scheduler refuses (``schedule()`` raises) releases the lease and errors the subscriber.

``run`` releases its lease only when the work has really ended: disposal asks a future or task
to stop, and its done-callback releases the lease once it has (see ``_RunSink``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeAlias, TypeVar, overload

from loguru import logger
from reactivex import Observable, abc
from reactivex.disposable import Disposable, SingleAssignmentDisposable
from reactivex.observer.autodetachobserver import AutoDetachObserver
from reactivex.scheduler.eventloop import AsyncIOScheduler

from .._core.futures import AwaitableObservable, LoopObserver, last_value
from .._core.timer import TimerHandle, call_later
from .._core.workers import WorkerPool, hand_off
from .._errors import LeaseReleasedError, LockTimeout

__all__ = ["KeyedLocks", "KeyedLocksStats", "Lease"]

_R = TypeVar("_R")

# What ``run`` accepts from ``fn`` besides a plain value: work whose result(s) it emits.
_Work: TypeAlias = Observable[_R] | Awaitable[_R] | concurrent.futures.Future[_R]

# Request states: NEW (made by hold*, not entered yet), PENDING (waiting), HELD (granted) and
# DONE (released, withdrawn or timed out). A request is *present* while PENDING or HELD.
_NEW: Final = 0
_PENDING: Final = 1
_HELD: Final = 2
_DONE: Final = 3

_TIMEOUT_MAX: Final = threading.TIMEOUT_MAX
_MANY: Final[Hashable] = object()  # Lease._key of a bulk or global lease


class _Segment:
    """A run of the request order between two global requests (see the module docstring)."""

    __slots__ = ("barrier", "count", "merged", "ready")

    def __init__(self) -> None:
        self.count = 0  # present (held or pending) non-global requests in this segment
        self.barrier: Lease | None = None  # the global request that closes the segment
        self.merged: _Segment | None = None  # absorbed into this earlier segment
        # Pending requests at the head of all their keys' queues, held back only by an earlier
        # global request; granted when this segment becomes the first. A dict used as an
        # insertion-ordered set: a request withdrawn meanwhile leaves it at once (O(1)), so a
        # long-held global barrier cannot accumulate withdrawn requests.
        self.ready: dict[Lease, None] | None = None


def _resolve(lease: Lease) -> _Segment:
    """The live segment of a non-global request (following merges, compressing the path)."""
    seg = lease._segment
    if seg.merged is not None:
        while seg.merged is not None:
            seg = seg.merged
        lease._segment = seg
    return seg


class Lease:
    """Exclusive hold on some keys of a :class:`KeyedLocks` (or on all of them).

    A lease is a token, not a thread: it may be released on any thread, exactly once. It is
    also a context manager that releases it on exit (if it is still held)::

        def on_next(lease: Lease) -> None:  # from acquire(): already granted
            with lease:
                update(lease.keys)

    ``hold*`` return a lease that is not granted yet: entering it waits for the grant.
    Leases are created only by :class:`KeyedLocks`.
    """

    __slots__ = (
        "_before",
        "_entered",
        "_key",
        "_keys",
        "_notify",
        "_owner",
        "_segment",
        "_state",
        "_timeout",
        "_waiting",
    )

    # Internal request state, kept on the lease itself so that the uncontended path allocates
    # one object. Only the owning KeyedLocks touches these, under its lock.
    _owner: KeyedLocks
    _keys: tuple[Hashable, ...]  # distinct keys in request order; () for a global lease
    _key: Hashable  # the key of a single-key lease, else _MANY (for the inlined hot paths)
    _state: int
    _waiting: int  # keys whose queue this pending request is not yet the head of
    _segment: _Segment  # non-global: its segment; global: the segment it opens
    _before: _Segment  # global only: the segment it closes
    _notify: Callable[[], None] | None  # how a pending request is told it was granted
    _timeout: float | None  # hold* only: how long __enter__ waits
    # A ``with`` block owns the lease: hold* leases from the start (entering one is what
    # requests it), granted leases (acquire*, hold*_async) once entered. A second entry is a
    # lease shared as if it were a lock: refused loudly instead of letting two users in.
    # (Left unset by hold(), meaning True; read only on the cold path.)
    _entered: bool

    def __init__(self, owner: KeyedLocks, keys: tuple[Hashable, ...]) -> None:
        self._owner = owner
        self._keys = keys
        self._key = keys[0] if len(keys) == 1 else _MANY
        self._state = _NEW
        self._timeout = None
        self._entered = False

    @property
    def keys(self) -> frozenset[Hashable]:
        """The keys this lease covers; empty for a global lease (which covers every key)."""
        return frozenset(self._keys)

    @property
    def is_global(self) -> bool:
        """True for a lease from ``acquire_all``/``hold_all``: every key, nothing else held."""
        return not self._keys

    @property
    def released(self) -> bool:
        """True once the lease has been released (or its ``hold*`` attempt timed out)."""
        return self._state == _DONE

    @property
    def owner(self) -> KeyedLocks:
        """The :class:`KeyedLocks` that granted this lease."""
        return self._owner

    def release(self) -> None:
        """Give the keys back; the next waiting requests are granted. Any thread may call it.

        Raises:
            LeaseReleasedError: The lease was already released.
            RuntimeError: The lease (from ``hold*``) was never entered, so never granted.
        """
        self._owner._release(self)

    def __enter__(self) -> Lease:
        """Wait for a lease from ``hold*`` (blocking); a granted lease is returned as is.

        A lease is entered once: it is a token, not a lock object to share. Each ``with``
        block (each thread, each use) needs its own ``hold()`` call.

        Raises:
            LockTimeout: Not granted within the ``timeout`` given to ``hold*``.
            LeaseReleasedError: The lease was released already (a lease is entered once).
            RuntimeError: The lease is already entered (by this or another thread).
        """
        state = self._state
        if state == _NEW:
            locks = self._owner
            key = self._key
            if key is not _MANY:
                # The hot path the benchmark measures, inlined: a free key and no global
                # request is one dict insert under the mutex. (Explicit acquire/release: a
                # ``with`` block on a lock costs twice as much in CPython 3.11.) The key being
                # absent also proves that no other thread entered this lease meanwhile.
                mutex = locks._mutex
                mutex.acquire()
                try:
                    queues = locks._queues
                    seg = locks._tail
                    if key not in queues and seg is locks._first and self._state == _NEW:
                        queues[key] = self
                        seg.count += 1
                        self._segment = seg
                        self._state = _HELD
                        return self
                finally:
                    mutex.release()
            return locks._acquire_blocking(self, self._timeout)
        if state == _HELD:
            with self._owner._mutex:
                entered = getattr(self, "_entered", True)  # unset on hold() leases: True
                self._entered = True
            if not entered:
                return self  # a lease granted by acquire*/hold*_async, entered the first time
        elif state == _DONE:
            raise LeaseReleasedError(f"{self!r} was already released; call hold() again")
        raise _entered_twice(self, "hold()")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release the lease unless it was released already (inside the block)."""
        locks = self._owner
        key = self._key
        if key is not _MANY:
            mutex = locks._mutex
            mutex.acquire()
            try:
                # Nobody waits for the key and no global request exists (only then is the
                # lease's segment the tail): nothing to grant, just forget the key.
                if self._state == _HELD and self._segment is locks._tail:
                    seg = self._segment
                    queues = locks._queues
                    entry = queues.pop(key)
                    if entry is self:
                        seg.count -= 1
                        self._state = _DONE
                        return
                    queues[key] = entry  # waiters: the general path below grants the next
            finally:
                mutex.release()
        locks._release_if_held(self)

    def __repr__(self) -> str:
        state = ("new", "pending", "held", "released")[self._state]
        what = f"keys={list(self._keys)!r}" if self._keys else "all keys"
        return f"<Lease {what} {state}>"


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


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
    if math.isinf(timeout):
        return None  # forever
    if timeout > _TIMEOUT_MAX:  # beyond what threads and the timer can wait for
        raise ValueError(f"timeout must be at most {_TIMEOUT_MAX:g} s (or None), got {timeout!r}")
    return timeout


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


def _describe(lease: Lease) -> str:
    if not lease._keys:
        return "the global lock"
    if len(lease._keys) == 1:
        return f"the lock on key {lease._keys[0]!r}"
    return f"the locks on {len(lease._keys)} keys"


def _timeout_error(lease: Lease, timeout: float) -> LockTimeout:
    return LockTimeout(
        f"{_describe(lease)} was not granted within {timeout:g} s; "
        "raise the timeout or shorten what the holders do under their leases"
    )


def _entered_twice(lease: Lease, call: str) -> RuntimeError:
    example = (
        "'async with locks.hold_async(key):' in each task"
        if call == "hold_async()"
        else "'with locks.hold(key):' in each thread"
    )
    return RuntimeError(
        f"{lease!r} is already entered: a lease is one use, not a lock to share between "
        f"threads or tasks; call {call} per use (e.g. {example})"
    )


def _timed_out(lease: Lease, timeout: float) -> LockTimeout:
    """The error for a wait that expired, logged (at INFO, like the coordinator's timeouts)."""
    error = _timeout_error(lease, timeout)
    logger.info("rxcoord: {}", error)
    return error


class KeyedLocks:
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

    Guarantees (see the module docstring for the algorithm):

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

    __slots__ = (
        "__weakref__",
        "_cancelled",
        "_contended",
        "_first",
        "_globals",
        "_mutex",
        "_pending",
        "_queues",
        "_tail",
        "_timeouts",
    )

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._queues: dict[Hashable, Lease | deque[Lease]] = {}
        self._first = self._tail = _Segment()
        self._pending = 0  # requests waiting
        self._globals = 0  # global requests present (held or waiting)
        self._contended = 0
        self._timeouts = 0
        self._cancelled = 0

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
        return self._observable((key,), _check_timeout(timeout), scheduler)

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
        return self._observable(_check_keys(keys), _check_timeout(timeout), scheduler)

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
        return self._observable((), _check_timeout(timeout), scheduler)

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
        # Lease(...) inlined: skipping the __init__ frame is a tenth of an uncontended hold.
        lease: Lease = object.__new__(Lease)
        lease._owner = self
        lease._keys = (key,)
        lease._key = key
        lease._state = _NEW
        # _entered is left unset (read as True: entering it is the request, there is no second
        # entry) - one store less on the hot path.
        lease._timeout = timeout if timeout is None else _check_timeout(timeout)
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
        lease._timeout = _check_timeout(timeout)
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
        lease._timeout = _check_timeout(timeout)
        return lease

    # -- public API: asyncio -----------------------------------------------------------------

    def hold_async(self, key: Hashable, *, timeout: float | None = None) -> _AsyncHold:
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
        return _AsyncHold(self, (key,), _check_timeout(timeout))

    def hold_many_async(
        self, keys: Iterable[Hashable], *, timeout: float | None = None
    ) -> _AsyncHold:
        """Asyncio form of :meth:`acquire_many`; see :meth:`hold_async`.

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, or ``timeout`` is
                not a number.
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__aenter__``) not granted within ``timeout``.
        """
        return _AsyncHold(self, _check_keys(keys), _check_timeout(timeout))

    def hold_all_async(self, *, timeout: float | None = None) -> _AsyncHold:
        """Asyncio form of :meth:`acquire_all`; see :meth:`hold_async`.

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
            LockTimeout: (from ``__aenter__``) not granted within ``timeout``.
        """
        return _AsyncHold(self, (), _check_timeout(timeout))

    # -- public API: run under a lease -------------------------------------------------------

    @overload
    def run(
        self,
        key: Hashable,
        fn: Callable[[], _Work[_R]],
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
    def run(
        self,
        key: Hashable,
        fn: Callable[[], Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """Run ``fn`` under a lease on ``key``; the lease is released when ``fn``'s work ends.

        ``fn`` is called when the lease is granted, on the granting thread (or ``scheduler``).
        What it returns decides what the Observable emits and when the lease is released:

        * an Observable - subscribed at once; its items are forwarded while the lease is held,
          and the lease is released just before its completion or error is forwarded;
        * an awaitable (coroutine, asyncio or concurrent future) - run on the event loop that
          was running when ``run``'s Observable was subscribed (a coroutine without one is an
          error); the lease is released when it finishes, then its result is emitted;
        * anything else - the lease is released, then the value is emitted and the
          Observable completes.

        An exception from ``fn`` releases the lease and becomes ``on_error``. Disposing the
        subscription withdraws a waiting request, or disposes/cancels ``fn``'s work and
        releases the lease once that work has ended: a running executor job that refuses
        ``cancel()``, or a cancelled coroutine running its cleanup, keeps the lease until it
        finishes (exclusion holds for as long as the work runs).

        Subscribed on a running asyncio loop (``await locks.run(...)``), the notifications
        reach the subscriber on the loop's thread, whichever thread granted the lease.

        Args:
            key: Any hashable value.
            fn: The work to run under the lease, called without arguments.
            timeout: Seconds to wait for the lease (``LockTimeout`` on expiry); ``fn``'s own
                run time is not limited.
            scheduler: Call ``fn`` and deliver the results on this scheduler.

        Returns:
            An Observable of ``fn``'s result(s).

        Raises:
            TypeError: ``key`` is unhashable, or ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        hash(key)
        return self._run((key,), fn, _check_timeout(timeout), scheduler)

    @overload
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[], _Work[_R]],
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
    def run_many(
        self,
        keys: Iterable[Hashable],
        fn: Callable[[], Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """:meth:`run` under a bulk lease on ``keys`` (see :meth:`acquire_many`).

        Raises:
            TypeError: A key is unhashable, ``keys`` is a ``str``/``bytes``, or ``timeout`` is
                not a number.
            ValueError: ``keys`` is empty, or ``timeout`` is negative or beyond
                ``threading.TIMEOUT_MAX``.
        """
        return self._run(_check_keys(keys), fn, _check_timeout(timeout), scheduler)

    @overload
    def run_all(
        self,
        fn: Callable[[], _Work[_R]],
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
    def run_all(
        self,
        fn: Callable[[], Any],
        *,
        timeout: float | None = None,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """:meth:`run` under a global lease (see :meth:`acquire_all`).

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative or beyond ``threading.TIMEOUT_MAX``.
        """
        return self._run((), fn, _check_timeout(timeout), scheduler)

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
            # Held leases are not counted on the hot path; derive them from the segments'
            # present-request counts (O(global requests present)).
            present = 0
            seg = self._first
            while True:
                present += seg.count
                if seg.barrier is None:
                    break
                seg = seg.barrier._segment
            barrier = self._first.barrier
            global_held = barrier is not None and barrier._state == _HELD
            global_waiting = self._globals - global_held
            return KeyedLocksStats(
                keys=len(self._queues),
                held=present - (self._pending - global_waiting) + global_held,
                waiting=self._pending,
                global_held=global_held,
                global_waiting=global_waiting,
                contended_total=self._contended,
                timeouts_total=self._timeouts,
                cancelled_total=self._cancelled,
            )

    def __repr__(self) -> str:
        s = self.stats()
        return f"<KeyedLocks keys={s.keys} held={s.held} waiting={s.waiting}>"

    # -- the state machine (callers hold _mutex) ---------------------------------------------

    def _enqueue(self, lease: Lease) -> bool:
        """Make ``lease`` present; grant it and return True if nothing earlier conflicts."""
        if not lease._keys:
            return self._enqueue_global(lease)
        queues = self._queues
        seg = self._tail
        waiting = 0
        done = 0
        try:
            for key in lease._keys:
                entry = queues.setdefault(key, lease)
                if entry is not lease:
                    if isinstance(entry, deque):
                        entry.append(lease)
                    else:
                        queues[key] = deque((entry, lease))
                    waiting += 1
                done += 1
        except BaseException:
            # A key's __hash__/__eq__ misbehaved midway: undo, so no half-request lingers.
            for key in lease._keys[:done]:
                self._unqueue(key, lease)
            raise
        seg.count += 1
        lease._segment = seg
        if not waiting and seg is self._first:
            lease._state = _HELD
            return True
        lease._waiting = waiting
        lease._state = _PENDING
        self._pending += 1
        self._contended += 1
        if not waiting:  # free keys, but an earlier global request is present
            self._park(seg, lease)
        return False

    def _enqueue_global(self, lease: Lease) -> bool:
        before = self._tail
        after = _Segment()
        before.barrier = lease
        lease._before = before
        lease._segment = after
        self._tail = after
        self._globals += 1
        if before is self._first and not before.count:
            lease._state = _HELD
            return True
        lease._state = _PENDING
        self._pending += 1
        self._contended += 1
        return False

    def _can_grant_now(self, lease: Lease) -> bool:
        """Would ``lease`` be granted at once? (For try-locks, which must not leave a trace.)"""
        if self._tail is not self._first:
            return False
        if not lease._keys:
            return not self._first.count
        queues = self._queues
        return all(key not in queues for key in lease._keys)

    @staticmethod
    def _park(seg: _Segment, lease: Lease) -> None:
        if seg.ready is None:
            seg.ready = {lease: None}
        else:
            seg.ready[lease] = None

    def _grant(self, lease: Lease, granted: list[Lease] | None) -> list[Lease]:
        lease._state = _HELD
        self._pending -= 1
        if granted is None:
            return [lease]
        granted.append(lease)
        return granted

    def _promote(self, head: Lease, granted: list[Lease] | None) -> list[Lease] | None:
        """``head`` became the head of one more of its keys' queues."""
        head._waiting -= 1
        if head._waiting:
            return granted
        seg = _resolve(head)
        if seg is self._first:
            return self._grant(head, granted)
        self._park(seg, head)
        return granted

    def _unqueue(self, key: Hashable, lease: Lease) -> None:
        """Undo a partial enqueue of ``lease`` on ``key`` (where it is last in the queue)."""
        queues = self._queues
        entry = queues[key]
        if entry is lease:
            del queues[key]
        else:
            assert isinstance(entry, deque)
            entry.remove(lease)  # identity: Lease keeps object equality

    def _segment_left(self, seg: _Segment, granted: list[Lease] | None) -> list[Lease] | None:
        """A non-global request left ``seg``: the first global request may now be due."""
        seg.count -= 1
        if not seg.count and seg.barrier is not None and seg is self._first:
            return self._grant(seg.barrier, granted)
        return granted

    def _remove(self, lease: Lease) -> list[Lease] | None:
        """Take a released or withdrawn non-global request out; return what that grants."""
        granted: list[Lease] | None = None
        queues = self._queues
        seg = _resolve(lease)
        if lease._state == _PENDING and not lease._waiting:
            # Withdrawn while parked behind a global request: leave the ready set now rather
            # than when the segment becomes first, which may be never (memory, not just time).
            ready = seg.ready
            assert ready is not None
            del ready[lease]
        for key in lease._keys:
            entry = queues[key]
            if entry is lease:
                del queues[key]
                continue
            assert isinstance(entry, deque)
            if entry[0] is lease:
                entry.popleft()
                if entry:
                    granted = self._promote(entry[0], granted)
                else:
                    del queues[key]
            else:  # only a pending request can be behind others
                entry.remove(lease)
        return self._segment_left(seg, granted)

    def _remove_global(self, lease: Lease) -> list[Lease] | None:
        """Take a released or withdrawn global request out; return what that grants."""
        self._globals -= 1
        after = lease._segment
        if lease._state == _HELD:
            # It was first and alone: the segment after it becomes the first.
            self._first = first = after
        else:
            # Withdrawn while pending: nothing separates the segments around it any more.
            before = lease._before
            after.merged = before
            before.count += after.count
            before.barrier = after.barrier
            if before.barrier is not None:
                before.barrier._before = before
            if self._tail is after:
                self._tail = before
            ready, after.ready = after.ready, None
            if before is not self._first:
                if ready:
                    if before.ready is None:
                        before.ready = ready
                    else:
                        before.ready.update(ready)  # after's requests come later: order kept
                return None
            # The first segment has no parked requests (they are granted at once), so the
            # merged segment's are exactly those that were held back by ``lease``.
            before.ready = ready
            first = before
        granted: list[Lease] | None = None
        ready, first.ready = first.ready, None
        if ready:
            for waiter in ready:  # all pending: a withdrawn request leaves the set
                granted = self._grant(waiter, granted)
        if not first.count and first.barrier is not None:
            granted = self._grant(first.barrier, granted)
        return granted

    # -- release, withdraw, deliver ----------------------------------------------------------

    def _release(self, lease: Lease) -> None:
        mutex = self._mutex
        mutex.acquire()
        try:
            state = lease._state
            if state == _HELD:
                granted = self._remove(lease) if lease._keys else self._remove_global(lease)
                lease._state = _DONE
        finally:
            mutex.release()
        # Messages are built outside the mutex: repr() of a key is user code.
        if state == _DONE:
            raise LeaseReleasedError(f"{lease!r} was already released")
        if state != _HELD:
            raise RuntimeError(f"{lease!r} was never granted: enter it with 'with' first")
        if granted is not None:
            _notify(granted)

    def _release_if_held(self, lease: Lease) -> bool:
        """Release ``lease`` unless it is already released; True if this call released it."""
        mutex = self._mutex
        mutex.acquire()
        try:
            if lease._state != _HELD:
                return False
            granted = self._remove(lease) if lease._keys else self._remove_global(lease)
            lease._state = _DONE
        finally:
            mutex.release()
        if granted is not None:
            _notify(granted)
        return True

    def _withdraw(self, lease: Lease) -> list[Lease] | None:
        """Withdraw a pending request (mutex held); return what that grants."""
        granted = self._remove(lease) if lease._keys else self._remove_global(lease)
        lease._state = _DONE
        lease._notify = None  # drop the waiter (and the subscriber it reaches) with the request
        self._pending -= 1
        return granted

    def _take_back(self, lease: Lease) -> list[Lease] | None:
        """Release a held lease (mutex held); return what that grants."""
        granted = self._remove(lease) if lease._keys else self._remove_global(lease)
        lease._state = _DONE
        return granted

    def _abandon(self, lease: Lease) -> None:
        """The requester gave up (cancelled, interrupted): withdraw or release the lease."""
        with self._mutex:
            if lease._state != _PENDING:
                granted = None
            else:
                granted = self._withdraw(lease)
                self._cancelled += 1
        if granted is not None:
            _notify(granted)
        else:
            self._release_if_held(lease)

    # -- blocking and asyncio waits ----------------------------------------------------------

    def _acquire_blocking(self, lease: Lease, timeout: float | None) -> Lease:
        mutex = self._mutex
        mutex.acquire()
        try:
            shared = lease._state != _NEW  # another thread entered this very lease first
            busy = not shared and timeout == 0 and not self._can_grant_now(lease)
            if shared:
                pass
            elif busy:
                lease._state = _DONE
            elif self._enqueue(lease):
                return lease
            else:
                # The waiter is a plain lock the granting thread releases: no Condition, no
                # polling, and nothing allocated on the uncontended path.
                waiter = threading.Lock()
                waiter.acquire()
                lease._notify = waiter.release
        finally:
            mutex.release()
        if shared:
            if lease._state == _DONE:
                raise LeaseReleasedError(f"{lease!r} was already released; call hold() again")
            raise _entered_twice(lease, "hold()")
        if busy:
            raise _timeout_error(lease, 0)
        try:
            granted = waiter.acquire(True, -1 if timeout is None else min(timeout, _TIMEOUT_MAX))
        except BaseException:
            self._abandon(lease)
            raise
        if granted:
            return lease
        with self._mutex:
            if lease._state != _PENDING:
                return lease  # granted right at the deadline: take it
            unblocked = self._withdraw(lease)
            self._timeouts += 1
        if unblocked is not None:
            _notify(unblocked)
        assert timeout is not None
        raise _timed_out(lease, timeout)

    async def _acquire_async(self, lease: Lease, limit: float | None) -> Lease:
        loop = asyncio.get_running_loop()
        with self._mutex:
            busy = limit == 0 and not self._can_grant_now(lease)
            if busy:
                lease._state = _DONE
            elif self._enqueue(lease):
                return lease
            else:
                future: asyncio.Future[None] = loop.create_future()
                lease._notify = _AsyncWaiter(self, lease, loop, future).notify
        if busy:
            raise _timeout_error(lease, 0)
        try:
            if limit is None:
                await future
            else:
                async with asyncio.timeout(limit):
                    await future
        except TimeoutError:
            with self._mutex:
                if lease._state != _PENDING:
                    return lease  # granted right at the deadline: take it
                unblocked = self._withdraw(lease)
                self._timeouts += 1
            if unblocked is not None:
                _notify(unblocked)
            assert limit is not None
            raise _timed_out(lease, limit) from None
        except BaseException:
            self._abandon(lease)
            raise
        return lease

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
            loop = None if scheduler is not None else _subscriber_loop(default)
            acquisition = _Acquisition(
                Lease(self, keys), _ObserverTarget(observer), scheduler, timeout, loop
            )
            return acquisition.start()

        # ``await``: the hold_async path, not reactivex's (which resolves its future from the
        # delivering thread, never waking the loop with ``scheduler=``, and drops a lease
        # granted just before the awaiting task is cancelled: held forever).
        return AwaitableObservable(
            subscribe, lambda: self._acquire_async(Lease(self, keys), timeout)
        )

    def _run(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[[], Any],
        timeout: float | None,
        scheduler: abc.SchedulerBase | None,
    ) -> Observable[Any]:
        def subscribe(
            observer: abc.ObserverBase[Any], default: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            # On an asyncio loop, coroutines run there and every notification is passed on
            # from its thread (``fn`` itself still runs on the granting thread or scheduler).
            loop = _subscriber_loop(default)
            if loop is not None:
                observer = LoopObserver(observer, loop)
            sink = _RunSink(self, fn, observer, loop)
            acquisition = _Acquisition(Lease(self, keys), sink, scheduler, timeout)
            sink.acquisition = acquisition
            acquisition.start()
            return Disposable(sink.dispose)

        # ``await``: like reactivex's, but a StopIteration from ``fn`` arrives as a RuntimeError
        # instead of breaking the future (see rxcoord._core.futures).
        observable: AwaitableObservable[Any] = AwaitableObservable(
            subscribe, lambda: last_value(observable)
        )
        return observable


# -- delivery ----------------------------------------------------------------------------------


def _notify(granted: list[Lease]) -> None:
    """Tell each newly granted request (outside the mutex).

    The grants are already made: each one must be told, or its lease stays held with nobody
    to release it. If telling one raises (a ``KeyboardInterrupt`` or ``SystemExit`` escaping a
    subscriber), the rest are handed to the grant workers before the exception propagates.
    """
    told = 0
    try:
        for lease in granted:
            told += 1
            notify = lease._notify
            if notify is not None:
                lease._notify = None
                notify()
    except BaseException:
        rest = granted[told:]
        if rest:
            _grant_off(lambda: _notify(rest))
        raise


class _AsyncHold:
    """``async with locks.hold_async(...)``: acquire on enter, release on exit."""

    __slots__ = ("_keys", "_lease", "_locks", "_timeout")

    def __init__(
        self,
        locks: KeyedLocks,
        keys: tuple[Hashable, ...],
        timeout: float | None,
    ) -> None:
        self._locks = locks
        self._keys = keys
        self._timeout = timeout
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        """Wait for the lease.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            RuntimeError: This context manager is already entered (it holds one lease at a
                time: call ``hold_async()`` per use, e.g. in each task).
        """
        if self._lease is not None:
            raise _entered_twice(self._lease, "hold_async()")
        lease = Lease(self._locks, self._keys)
        self._lease = lease
        try:
            return await self._locks._acquire_async(lease, self._timeout)
        except BaseException:
            self._lease = None  # not granted (or released by the cancellation): nothing to exit
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        if lease is not None:
            self._lease = None
            lease._owner._release_if_held(lease)


class _AsyncWaiter:
    """Wakes an asyncio waiter from whichever thread grants its lease."""

    __slots__ = ("future", "lease", "locks", "loop")

    def __init__(
        self,
        locks: KeyedLocks,
        lease: Lease,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
    ) -> None:
        self.locks = locks
        self.lease = lease
        self.loop = loop
        self.future = future

    def notify(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody will ever take the lease
            logger.warning("rxcoord: event loop closed before {} was taken", self.lease)
            self.locks._release_if_held(self.lease)

    def _wake(self) -> None:
        if not self.future.done():
            self.future.set_result(None)
        # A cancelled future means the waiting task was cancelled: its except-branch sees the
        # lease HELD and releases it.


class _Target:
    """Who receives an acquisition's outcome: a user observer, or a ``run`` sink."""

    __slots__ = ()

    def on_lease(self, lease: Lease) -> None:
        raise NotImplementedError

    def on_error(self, error: Exception) -> None:
        raise NotImplementedError


class _ObserverTarget(_Target):
    __slots__ = ("_observer", "_on_next")

    def __init__(self, observer: abc.ObserverBase[Lease]) -> None:
        self._observer = observer
        # AutoDetachObserver.on_next drops the item once dispose() has begun; for a lease that
        # would mean a key locked forever. Call the wrapped callback so a lease racing with
        # disposal still reaches the subscriber (it was not withdrawn in time).
        wrapped = getattr(observer, "_on_next", None)
        if type(observer) is AutoDetachObserver and callable(wrapped):
            self._on_next: Callable[[Lease], None] = wrapped
        else:
            self._on_next = observer.on_next

    def on_lease(self, lease: Lease) -> None:
        try:
            self._on_next(lease)
        except Exception as exc:
            # The subscriber failed while taking the lease; nobody can be relied on to release
            # it. Release it (a later release by the subscriber raises, loudly) and report.
            if lease._owner._release_if_held(lease):
                logger.debug("rxcoord: released {} because on_next raised", lease)
            self._observer.on_error(exc)
            return
        except BaseException:  # interrupted (KeyboardInterrupt...): same reasoning, no on_error
            lease._owner._release_if_held(lease)
            raise
        self._observer.on_completed()

    def on_error(self, error: Exception) -> None:
        self._observer.on_error(error)


class _Trampoline(threading.local):
    """Per-thread queue of deliveries; set while a thread is delivering."""

    queue: deque[_Acquisition] | None = None


_trampoline = _Trampoline()


class _Acquisition:
    """One subscription to ``acquire*`` (or ``run*``): its request, timer and delivery.

    Delivery goes to ``scheduler`` if one was given, else to ``loop`` (the asyncio loop the
    subscriber waits on, from another thread) or straight to the target. ``delivered`` and
    ``disposed`` are set under the mutex: until the lease has reached the target, disposal
    takes it back - whatever the scheduler does with the delivery (a disposed
    ``EventLoopScheduler`` or a closed loop drops it silently) - and a delivery that runs after
    the disposal releases it instead. Exactly one of the two happens.
    """

    __slots__ = (
        "delivered",
        "disposed",
        "lease",
        "loop",
        "scheduler",
        "target",
        "timeout",
        "timer",
    )

    def __init__(
        self,
        lease: Lease,
        target: _Target,
        scheduler: abc.SchedulerBase | None,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.lease = lease
        self.target = target
        self.scheduler = scheduler
        self.timeout = timeout
        self.loop = loop
        self.timer: TimerHandle | None = None
        self.disposed = False  # disposed, timed out or failed: nothing more reaches the target
        self.delivered = False  # the lease was handed to the target

    def start(self) -> abc.DisposableBase:
        lease = self.lease
        locks = lease._owner
        timeout = self.timeout
        with locks._mutex:
            if timeout == 0 and not locks._can_grant_now(lease):
                granted = None
            else:
                lease._notify = self.granted
                granted = locks._enqueue(lease)
        if granted:
            lease._notify = None
            self.granted(reraise=True)
        elif granted is None:  # try-lock failed: leave no trace
            self.disposed = True
            self._emit_error(_timeout_error(lease, 0))
        elif timeout is not None:
            timer = call_later(timeout, self._on_timeout)
            self.timer = timer
            if lease._state != _PENDING:  # granted meanwhile; the deliverer may have missed it
                timer.cancel()
        return Disposable(self.dispose)

    def dispose(self) -> None:
        lease = self.lease
        locks = lease._owner
        granted = None
        with locks._mutex:
            if self.disposed:
                return
            self.disposed = True
            state = lease._state
            if state == _PENDING:
                granted = locks._withdraw(lease)
                locks._cancelled += 1
            elif state == _HELD and not self.delivered:
                # Granted, but the delivery has not run - and may never run (its scheduler
                # was disposed, its loop closed). Nobody else can release the lease.
                granted = locks._take_back(lease)
        timer = self.timer
        if timer is not None:
            timer.cancel()
        if granted is not None:
            _notify(granted)

    def granted(self, reraise: bool = False) -> None:
        """The lease was granted (this is its ``_notify``): deliver it, or schedule that."""
        scheduler = self.scheduler
        loop = self.loop
        if scheduler is None and (loop is None or asyncio._get_running_loop() is loop):
            self._deliver_trampolined(reraise)
            return
        try:
            if scheduler is not None:
                scheduler.schedule(self._scheduled)
            else:
                assert loop is not None
                loop.call_soon_threadsafe(self._deliver_trampolined, False)
        except Exception as exc:  # a disposed scheduler, a closed loop
            self._undeliverable(exc, reraise)

    def _undeliverable(self, error: Exception, reraise: bool) -> None:
        """The delivery could not be scheduled: release the lease, then tell the subscriber."""
        lease = self.lease
        locks = lease._owner
        with locks._mutex:
            disposed = self.disposed
            self.disposed = True  # should the delivery run after all, it finds nothing to do
            held = lease._state == _HELD and not self.delivered
            granted = locks._take_back(lease) if held else None
        logger.opt(exception=error).error(
            "rxcoord: could not schedule the delivery of a lease; released it"
        )
        timer = self.timer
        if timer is not None:
            timer.cancel()
        if granted is not None:
            _notify(granted)
        if not disposed:
            self._fail(error, reraise)

    def _fail(self, error: Exception, reraise: bool = False) -> None:
        """``on_error`` from a thread that must not see the subscriber's exceptions."""
        try:
            self.target.on_error(error)
        except Exception:
            if reraise:
                raise
            logger.opt(exception=True).error("rxcoord: a lease subscriber failed")

    def _scheduled(self, _scheduler: abc.SchedulerBase, _state: Any = None) -> None:
        self._deliver_trampolined(False)

    def _deliver_trampolined(self, reraise: bool) -> None:
        """Deliver now, unless this thread is already delivering: then right after that one.

        ``reraise``: the delivery happens inside ``subscribe`` (the lease was free), where
        reactivex routes an exception to ``on_error`` or the caller, as for ``of(1)``.
        """
        trampoline = _trampoline
        queue = trampoline.queue
        if queue is not None:
            queue.append(self)
            return
        trampoline.queue = queue = deque()
        error: Exception | None = None
        current = self
        try:
            while True:
                try:
                    current._deliver()
                except Exception as exc:
                    if current is self and reraise:
                        error = exc
                    else:
                        logger.opt(exception=exc).error("rxcoord: a lease subscriber failed")
                if not queue:
                    break
                current = queue.popleft()
        finally:
            trampoline.queue = None
            # Interrupted (KeyboardInterrupt...): the rest must still get their leases.
            for pending in queue:
                _grant_off(pending._deliver)
        if error is not None:
            raise error

    def _deliver(self) -> None:
        timer = self.timer
        if timer is not None:
            self.timer = None
            timer.cancel()
        lease = self.lease
        locks = lease._owner
        with locks._mutex:
            disposed = self.disposed
            if not disposed:
                self.delivered = True
        if disposed:
            if locks._release_if_held(lease):
                logger.debug("rxcoord: released {}: its subscription was disposed", lease)
            return
        self.target.on_lease(lease)

    def _on_timeout(self) -> None:
        """On the timer thread: withdraw the request; hand the user-visible part off."""
        lease = self.lease
        locks = lease._owner
        with locks._mutex:
            if self.disposed or lease._state != _PENDING:
                return
            self.disposed = True
            granted = locks._withdraw(lease)
            locks._timeouts += 1
        assert self.timeout is not None
        error = _timed_out(lease, self.timeout)
        if granted is not None:
            # The grants run their subscribers' work (on_next, run()'s fn) for as long as it
            # takes: on the grant workers, never in front of the process's other timeouts.
            unblocked: list[Lease] = granted
            _grant_off(lambda: _notify(unblocked))
        _hand_off(lambda: self._emit_error(error))

    def _emit_error(self, error: Exception) -> None:
        scheduler = self.scheduler
        loop = self.loop
        try:
            if scheduler is not None:
                scheduler.schedule(lambda _s, _st: self.target.on_error(error))
                return
            if loop is not None and asyncio._get_running_loop() is not loop:
                loop.call_soon_threadsafe(self.target.on_error, error)
                return
        except Exception:  # a disposed scheduler, a closed loop: tell the subscriber here
            logger.opt(exception=True).error("rxcoord: could not schedule an error delivery")
        self.target.on_error(error)


def _subscriber_loop(scheduler: abc.SchedulerBase | None) -> asyncio.AbstractEventLoop | None:
    """The asyncio loop a subscriber waits on: its subscribe-time scheduler's, or the running one.

    (``await observable`` subscribes with an ``AsyncIOScheduler`` of the running loop.)
    """
    if isinstance(scheduler, AsyncIOScheduler):
        return scheduler._loop
    return asyncio._get_running_loop()


class _RunSink(_Target):
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
        "running",
    )

    acquisition: _Acquisition

    def __init__(
        self,
        locks: KeyedLocks,
        fn: Callable[[], Any],
        observer: abc.ObserverBase[Any],
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.locks = locks
        self.fn = fn
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
            in_flight = self._start_work()
        finally:
            if not in_flight:
                with mutex:
                    self.running = False
                    # Disposed while the work ran: dispose() left the lease to us.
                    orphaned = self.done and self.lease is not None
                if orphaned:
                    self._release()

    def _start_work(self) -> bool:
        """Call ``fn``, start what it returned; True if a done-callback will release the lease."""
        try:
            result = self.fn()
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


# -- deliveries off the caller's thread ----------------------------------------------------------

# Grants unblocked on the timer thread (a request timing out) and the rest of a release that a
# BaseException interrupted are delivered here. Their subscribers' work - on_next, run()'s fn -
# runs for as long as it takes, so it gets workers of its own: in rxcoord's shared delivery
# pool it would sit in front of every timeout in the process.
_grants: Final = WorkerPool(16, "rxcoord-grants")


def _grant_off(fn: Callable[[], None]) -> None:
    """Deliver grants on the grant workers; log their failures."""

    def call() -> None:
        try:
            fn()
        except Exception:
            logger.opt(exception=True).error("rxcoord: a lease subscriber failed")

    _grants.submit(call)


def _hand_off(fn: Callable[[], None]) -> None:
    """Deliver a timeout's ``LockTimeout`` on rxcoord's delivery workers (not the timer thread)."""
    hand_off(fn, "a lease subscriber")
