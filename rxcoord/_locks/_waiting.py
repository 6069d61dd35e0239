"""The waiting side of KeyedLocks: how a granted request reaches whoever asked for it.

Every waiter - a thread blocked in ``with locks.hold(...)``, a task in ``async with
locks.hold_async(...)``, an ``acquire*``/``run*`` subscription - is one
:class:`rxcoord._core.waiter.Waiter` stored on its pending lease (``Lease._waiter``). So one
ownership rule covers every way a waiter leaves (disposed, timed out, task cancelled, loop
closed, delivery refused): the granted lease is taken by the waiter's side, or released by the
waiter primitive - never lost, never both. Leaving is always the same two steps: ``cancel()``
the waiter and, if it was still pending, withdraw the request from the table under the mutex.
A grant decided concurrently finds the waiter cancelled and is released.

Notification and delivery
-------------------------
Grants are decided under the lock and *delivered* after it is released, by the thread that
caused them (the releasing, withdrawing or disposing thread): ``waiter.grant(lease)`` wakes a
blocking waiter's own ``threading.Lock``, resolves an asyncio waiter's future through
``call_soon_threadsafe``, and makes an ``acquire`` subscriber's ``on_next(lease)`` happen - on
the given scheduler if there is one, on its event loop's thread if it subscribed on one
(``await``). Deliveries to subscribers go through a per-thread trampoline, so a chain of
"release -> next subscriber runs -> releases -> ..." is a loop, not a recursion. If a delivery
raises a ``BaseException`` (``KeyboardInterrupt``), the other grants of the same release are
still delivered (on the grant workers) before it propagates.

Timeouts of ``acquire`` subscriptions fire on rxcoord's shared timer thread, which only
withdraws the request. The ``LockTimeout`` goes to rxcoord's shared delivery workers
(``hand_off``); the grants the withdrawal unblocks go to KeyedLocks' own grant workers, because
their subscribers' work (``on_next``, ``run``'s ``fn``) runs as long as it likes and must not
delay the process's other timeouts. A timeout withdraws only a request that is still pending:
a grant decided before it is delivered.

A lease granted to a subscription that was disposed before it could be delivered is released
by ``dispose()`` itself (``waiter.cancel()``), since a scheduler may never run the delivery.
The delivery takes the lease (``waiter.take()``) before handing it on; whichever of the two
comes first wins. The ``AutoDetachObserver`` that reactivex wraps every observer in would
silently drop an ``on_next`` after ``dispose`` began, so a taken lease goes to the wrapped
callback directly. (Rx operators placed between ``acquire`` and the subscriber, such as
``timeout`` or ``take_until``, may still drop an item on disposal, as they do with any item:
use the ``timeout=`` argument rather than ``ops.timeout``.) A delivery the scheduler refuses
(``schedule()`` raises) releases the lease and errors the subscriber.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, cast

from loguru import logger
from reactivex import abc
from reactivex.disposable import Disposable
from reactivex.observer.autodetachobserver import AutoDetachObserver

from .._core import waiter as w
from .._core.futures import running_loop
from .._core.timer import TimerHandle, call_later
from .._core.waiter import Waiter
from .._core.workers import WorkerPool, hand_off
from .._errors import LeaseReleasedError
from ._lease import MANY, Lease, entered_twice, timed_out, timeout_error
from ._table import DONE, HELD, NEW, PENDING, Request

if TYPE_CHECKING:
    from ._facade import KeyedLocks

__all__ = [
    "Acquisition",
    "AsyncHold",
    "ObserverTarget",
    "Target",
    "acquire_async",
    "acquire_blocking",
    "notify",
]


# -- the ownership rule, applied to leases -------------------------------------------------------


def _release_unwanted(lease: Lease) -> None:
    """Every lease waiter's release callback: granted after (or as) the waiter left."""
    if lease._owner._release_if_held(lease):
        logger.debug("rxcoord: released {}: its waiter left before taking it", lease)


def withdraw(locks: KeyedLocks, lease: Lease) -> list[Request] | None:
    """Withdraw a pending request and drop its waiter (mutex held); return what that grants."""
    lease._waiter = None  # drop the waiter (and the subscriber it reaches) with the request
    return locks._withdraw(lease)


def leave(lease: Lease, waiter: Waiter[Lease]) -> None:
    """The waiter of ``lease`` gives up: its task was cancelled, its thread interrupted.

    Cancels the waiter; a request still pending is withdrawn (counted as a cancellation), a
    grant already decided is released by the waiter rule, and a lease already taken (the
    waiter was interrupted right after taking it) is released here.
    """
    locks = lease._owner
    if waiter.cancel() is w.TAKEN:
        locks._release_if_held(lease)
        return
    granted = None
    with locks._mutex:
        if lease._state == PENDING:
            granted = withdraw(locks, lease)
            locks._cancelled += 1
    if granted is not None:
        notify(granted)


def expire(lease: Lease, waiter: Waiter[Lease]) -> bool:
    """The deadline of ``lease``'s wait passed: True if it timed out (the request is withdrawn).

    Only a pending request times out. A request the table granted before the deadline is
    False: its hand-over to the waiter is on the way and is used, not wasted. (The Rx timer
    follows the same rule, see ``Acquisition._on_timeout``.)
    """
    locks = lease._owner
    with locks._mutex:
        # cancel() of a pending waiter releases nothing, so it is safe under the mutex.
        if lease._state != PENDING or waiter.cancel() is not w.PENDING:
            return False
        granted = withdraw(locks, lease)
        locks._timeouts += 1
    if granted is not None:
        notify(granted)
    return True


def notify(granted: list[Request]) -> None:
    """Hand each newly granted request to its waiter (outside the mutex).

    The grants are already made: each one must reach its waiter (which takes it, or releases it
    if it left), or its lease stays held with nobody to release it. If that raises (a
    ``KeyboardInterrupt`` or ``SystemExit`` escaping a subscriber), the rest are handed to the
    grant workers before the exception propagates.
    """
    told = 0
    try:
        for lease in cast("list[Lease]", granted):  # a KeyedLocks' requests are its leases
            told += 1
            waiter = lease._waiter
            if waiter is not None:
                lease._waiter = None
                waiter.grant(lease)
    except BaseException:
        rest = granted[told:]
        if rest:
            _grant_off(lambda: notify(rest))
        raise


# -- blocking and asyncio waits ------------------------------------------------------------------


def acquire_blocking(locks: KeyedLocks, lease: Lease, timeout: float | None) -> Lease:
    """Enter a ``hold*`` lease off the fast path: wait (blocking this thread) for the grant.

    Raises:
        LockTimeout: Not granted within ``timeout`` (the request is withdrawn).
        LeaseReleasedError, RuntimeError: The lease was entered before.
    """
    mutex = locks._mutex
    mutex.acquire()
    try:
        shared = lease._state != NEW  # another thread entered this very lease first
        busy = not shared and timeout == 0 and not locks._can_grant_now(lease)
        if shared:
            pass
        elif busy:
            lease._state = DONE
        elif locks._enqueue(lease):
            return lease
        else:
            waiter = lease._waiter = Waiter(_release_unwanted)
    finally:
        mutex.release()
    if shared:
        if lease._state == DONE:
            raise LeaseReleasedError(f"{lease!r} was already released; call hold() again")
        raise entered_twice(lease, "hold()")
    if busy:
        raise timeout_error(lease, 0)
    try:
        # Blocks on a plain lock the granting thread releases; at the deadline the table says
        # whether the request is still pending (withdrawn: LockTimeout) or already granted.
        taken = waiter.wait(timeout, expire=lambda: expire(lease, waiter))
    except BaseException:
        leave(lease, waiter)
        raise
    if taken is not None:
        return taken
    assert timeout is not None
    raise timed_out(lease, timeout)


async def acquire_async(locks: KeyedLocks, lease: Lease, limit: float | None) -> Lease:
    """Wait (suspending the running task, not the loop) for ``lease`` to be granted.

    Cancelling the task withdraws the request; a lease granted at that moment is released.

    Raises:
        LockTimeout: Not granted within ``limit`` (the request is withdrawn).
    """
    with locks._mutex:
        busy = limit == 0 and not locks._can_grant_now(lease)
        if busy:
            lease._state = DONE
        elif locks._enqueue(lease):
            return lease
        else:
            waiter = lease._waiter = Waiter(_release_unwanted)
    if busy:
        raise timeout_error(lease, 0)
    try:
        if limit is None:
            return await waiter.wait_async()
        return await waiter.wait_async(limit, expire=lambda: expire(lease, waiter))
    except TimeoutError:
        assert limit is not None
        raise timed_out(lease, limit) from None
    except BaseException:
        leave(lease, waiter)
        raise


class AsyncHold:
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
            raise entered_twice(self._lease, "hold_async()")
        locks = self._locks
        keys = self._keys
        # Lease(...) inlined (see KeyedLocks.hold): a frame less on every entry.
        lease: Lease = object.__new__(Lease)
        lease._owner = locks
        lease._keys = keys
        lease._state = NEW
        lease._timeout = None
        lease._entered = False
        self._lease = lease
        key = lease._key = keys[0] if len(keys) == 1 else MANY
        timeout = self._timeout
        # One pass under the mutex (bench_asyncio's hold_async rows): the uncontended grant,
        # inlined as in Lease.__enter__ (a free key and no global request is one dict insert -
        # no waiter, no future, no await; a try-lock, timeout=0, takes a free key the same
        # way), else, without a timeout, acquire_async(locks, lease, None) and its wait
        # inlined: two coroutines less per contended wait (enqueue, or wait on a future).
        mutex = locks._mutex
        mutex.acquire()
        try:
            seg = locks._tail
            if key is not MANY and seg is locks._first and key not in locks._queues:
                locks._queues[key] = lease
                seg.count += 1
                lease._segment = seg
                lease._state = HELD
                return lease
            if timeout is None:
                try:
                    loop = asyncio.get_running_loop()  # (before the request is made)
                except RuntimeError:
                    self._lease = None
                    raise
                if locks._enqueue(lease):
                    return lease
                waiter, future = Waiter.on_loop(_release_unwanted, loop)
                lease._waiter = waiter
        finally:
            mutex.release()
        if timeout is not None:
            try:
                return await acquire_async(locks, lease, timeout)
            except BaseException:
                self._lease = None  # not granted (or released by its cancellation)
                raise
        try:
            await future
        except BaseException:
            self._lease = None  # not granted (or released by the cancellation): nothing to exit
            leave(lease, waiter)  # cancels the waiter: a grant racing with this is released
            raise
        if waiter.take() is None:  # cancelled from elsewhere after the wake-up
            self._lease = None
            raise asyncio.CancelledError()
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        if lease is None:
            return
        self._lease = None
        locks = lease._owner
        # _release_if_held(lease) inlined, with Lease.__exit__'s release that grants nothing:
        # nobody waits for the key and no global request exists (only then is the segment
        # the tail) - one dict delete. Otherwise the table's release, under the same mutex.
        granted = None
        mutex = locks._mutex
        mutex.acquire()
        try:
            if lease._state == HELD:
                key = lease._key
                queues = locks._queues
                if key is not MANY and lease._segment is locks._tail and queues[key] is lease:
                    del queues[key]
                    lease._segment.count -= 1
                    lease._state = DONE
                else:
                    granted = locks._take_out(lease)
        finally:
            mutex.release()
        if granted is not None:
            notify(granted)


# -- Rx subscriptions ----------------------------------------------------------------------------


class Target:
    """Who receives an acquisition's outcome: a user observer, or a ``run`` sink."""

    __slots__ = ()

    def on_lease(self, lease: Lease) -> None:
        """The lease, taken: from now on the target owns it."""
        raise NotImplementedError

    def on_error(self, error: Exception) -> None:
        """No lease: the request timed out or could not be delivered."""
        raise NotImplementedError


class ObserverTarget(Target):
    """An ``acquire*`` subscriber: ``on_next(lease)`` then ``on_completed()``."""

    __slots__ = ("_observer", "_on_next")

    def __init__(self, observer: abc.ObserverBase[Lease]) -> None:
        self._observer = observer
        # AutoDetachObserver.on_next drops the item once dispose() has begun; for a lease that
        # would mean a key locked forever. Call the wrapped callback so a lease taken before
        # the disposal still reaches the subscriber (it was not withdrawn in time).
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

    queue: deque[Acquisition] | None = None


_trampoline = _Trampoline()


class Acquisition:
    """One subscription to ``acquire*`` (or ``run*``): its request, waiter, timer and delivery.

    Delivery goes to ``scheduler`` if one was given, else to ``loop`` (the asyncio loop the
    subscriber waits on, from another thread) or straight to the target. Whatever the scheduler
    does with the delivery (a disposed ``EventLoopScheduler`` or a closed loop drops it
    silently), the waiter decides: ``dispose()`` cancels it (releasing a lease not yet taken),
    the delivery takes the lease before handing it on. Exactly one of the two gets it.
    """

    __slots__ = ("lease", "loop", "scheduler", "target", "timeout", "timer", "waiter")

    def __init__(
        self,
        lease: Lease,
        target: Target,
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
        self.waiter: Waiter[Lease] = Waiter(_release_unwanted)

    def start(self) -> abc.DisposableBase:
        """Make the request (inside ``subscribe``); deliver at once if the keys are free."""
        lease = self.lease
        locks = lease._owner
        timeout = self.timeout
        waiter = self.waiter
        with locks._mutex:
            if timeout == 0 and not locks._can_grant_now(lease):
                granted = None
            else:
                lease._waiter = waiter
                granted = locks._enqueue(lease)
                if granted:
                    lease._waiter = None  # granted here: told below, by this thread
        if granted:
            waiter.grant(lease)  # nothing bound yet: this only records the grant
            self._granted(reraise=True)
        elif granted is None:  # try-lock failed: leave no trace
            waiter.cancel()
            self._emit_error(timeout_error(lease, 0))
        else:
            # A grant since the mutex was released found no wake-up bound: bind() runs it now.
            waiter.bind(self._granted)
            if timeout is not None:
                timer = call_later(timeout, self._on_timeout)
                self.timer = timer
                if lease._state != PENDING:  # granted meanwhile; the deliverer may have missed it
                    timer.cancel()
        return Disposable(self.dispose)

    def dispose(self) -> None:
        """The subscriber leaves: withdraw a pending request; a lease not yet taken is released."""
        state = self.waiter.cancel()  # GRANTED: released right here (the waiter rule)
        timer = self.timer
        if timer is not None:
            timer.cancel()
        if state is not w.PENDING:
            return
        lease = self.lease
        locks = lease._owner
        granted = None
        with locks._mutex:
            # Not pending any more: a grant is on its way to the cancelled waiter, which
            # releases it.
            if lease._state == PENDING:
                granted = withdraw(locks, lease)
                locks._cancelled += 1
        if granted is not None:
            notify(granted)

    def _granted(self, reraise: bool = False) -> None:
        """The waiter was granted its lease: deliver it, or schedule that."""
        scheduler = self.scheduler
        loop = self.loop
        if scheduler is None and (loop is None or running_loop() is loop):
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
        # GRANTED: released here; should the delivery run after all, it finds nothing to take.
        state = self.waiter.cancel()
        timer = self.timer
        if timer is not None:
            timer.cancel()
        if state is not w.GRANTED:
            return  # disposed meanwhile (the lease went with it), or already delivered
        logger.opt(exception=error).error(
            "rxcoord: could not schedule the delivery of a lease; released it"
        )
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
        lease = self.waiter.take()
        if lease is None:
            return  # the subscription left first; whoever cancelled the waiter released it
        self.target.on_lease(lease)

    def _on_timeout(self) -> None:
        """On the timer thread: withdraw the request; hand the user-visible part off."""
        lease = self.lease
        locks = lease._owner
        with locks._mutex:
            # Only a pending request times out (a grant decided first is delivered), and only
            # once: a waiter cancelled by dispose() meanwhile is withdrawn by dispose().
            # (cancel() of a pending waiter releases nothing, so it is safe under the mutex.)
            if lease._state != PENDING or self.waiter.cancel() is not w.PENDING:
                return
            granted = withdraw(locks, lease)
            locks._timeouts += 1
        assert self.timeout is not None
        error = timed_out(lease, self.timeout)
        if granted is not None:
            # The grants run their subscribers' work (on_next, run()'s fn) for as long as it
            # takes: on the grant workers, never in front of the process's other timeouts.
            unblocked: list[Request] = granted
            _grant_off(lambda: notify(unblocked))
        _hand_off(lambda: self._emit_error(error))

    def _emit_error(self, error: Exception) -> None:
        scheduler = self.scheduler
        loop = self.loop
        try:
            if scheduler is not None:
                scheduler.schedule(lambda _s, _st: self.target.on_error(error))
                return
            if loop is not None and running_loop() is not loop:
                loop.call_soon_threadsafe(self.target.on_error, error)
                return
        except Exception:  # a disposed scheduler, a closed loop: tell the subscriber here
            logger.opt(exception=True).error("rxcoord: could not schedule an error delivery")
        self.target.on_error(error)


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
