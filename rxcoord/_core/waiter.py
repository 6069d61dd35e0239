"""The one waiter primitive: a one-shot grant to a party that may leave at any moment.

Every layer of rxcoord hands something scarce to somebody who asked for it and may be gone by
the time it arrives: KeyedLocks grants a lease to a subscription that is being disposed, the
lease provider grants a distributed lease to a task that was just cancelled, an admission
grants a slot to a job whose subscriber gave up. A value handed to a party that is gone is the
classic leak: a key locked forever, a name blocked until its lease expires, a slot never
returned. This module is the single answer, so the rule is written (and tested) once.

The rule
--------
A :class:`Waiter` moves through::

    WAITING --grant--> GRANTED --take--> TAKEN        (the waiter owns the value)
       |                  |
       +----cancel--------+----------> CANCELLED      (the value, if any, is released)

* ``grant(value)`` on a cancelled waiter calls ``release(value)`` at once;
* ``cancel()`` on a granted waiter that has not taken the value yet calls ``release(value)``;
* after ``take()`` the value belongs to the waiter's side: ``cancel()`` changes nothing.

So for every granted value exactly one of two things happens, whichever way and on whichever
thread the waiter left (disposed, timed out, task cancelled, loop closed): the waiter's side
takes it, or ``release`` is called with it. Never both, never neither. The decision is made
under a small lock of the waiter's own, held for a few attribute writes, never while user code
(``release``, the wake-up) runs.

What cancel() does not do: take a *pending* request out of the granter's queue. The owner does
that after ``cancel()`` returns :data:`PENDING` (a KeyedLocks withdrawal, a gate's withdraw).
If a grant was decided concurrently, the withdrawal finds nothing and the grant, arriving at a
cancelled waiter, is released: the same rule covers the race.

Waiting
-------
No thread is ever parked per waiter by this module. A waiter is woken by a callback
(``bind``) that runs on the granting thread; on top of it:

* :meth:`Waiter.wait` blocks the *calling* thread (the caller chose to block), on a plain lock;
* :meth:`Waiter.wait_async` suspends an asyncio task; the grant arrives through
  ``call_soon_threadsafe``;
* an Observable form is a ``bind`` whose callback takes the value and emits it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from .futures import running_loop

__all__ = ["CANCELLED", "GRANTED", "PENDING", "TAKEN", "Waiter"]

_T = TypeVar("_T")

# States (ints: compared on hot paths). cancel() returns the state it found.
PENDING: Final = 0
GRANTED: Final = 1
TAKEN: Final = 2
CANCELLED: Final = 3


class Waiter(Generic[_T]):
    """A one-shot grant that may be cancelled; see the module docstring for the rule.

    Granted values must not be ``None`` (``take()`` returns None for "nothing to take").

    Args:
        release: Called with a granted value nobody will take (the waiter had left, or leaves
            before taking it). Runs on the thread that decided so, outside any lock.
    """

    __slots__ = ("_lock", "_release", "_state", "_value", "_wake")

    # The lock is taken with explicit acquire()/release() (in try/finally): half the cost of a
    # ``with`` block in CPython 3.11, and every grant, take and cancel of every lock and lease
    # wait goes through it.

    def __init__(self, release: Callable[[_T], object]) -> None:
        self._lock = threading.Lock()
        self._release = release
        self._state = PENDING
        self._value: _T | None = None
        self._wake: Callable[[], object] | None = None

    @property
    def state(self) -> int:
        """:data:`PENDING`, :data:`GRANTED`, :data:`TAKEN` or :data:`CANCELLED`."""
        return self._state

    def bind(self, wake: Callable[[], object]) -> None:
        """Call ``wake()`` once the value is granted (at once if it already is).

        ``wake`` runs on the granting thread, outside the waiter's lock, at most once; it
        usually calls :meth:`take` and hands the value on. Not called for a cancelled waiter.
        """
        lock = self._lock
        lock.acquire()
        try:
            state = self._state
            if state is PENDING:
                self._wake = wake
        finally:
            lock.release()
        if state is GRANTED:
            wake()

    def grant(self, value: _T) -> bool:
        """Hand ``value`` to the waiter; False (and ``release(value)`` called) if it left.

        Raises:
            RuntimeError: The waiter was granted before (a grant is one-shot).
        """
        lock = self._lock
        lock.acquire()
        try:
            state = self._state
            if state is PENDING:
                self._state = GRANTED
                self._value = value
                wake = self._wake
                self._wake = None
        finally:
            lock.release()
        if state is PENDING:
            if wake is not None:
                wake()
            return True
        if state is CANCELLED:
            self._release(value)
            return False
        raise RuntimeError(f"a waiter was granted twice (state {state})")

    def take(self) -> _T | None:
        """Claim the granted value (the caller owns it from now on); None if not granted.

        None also when the waiter was cancelled: whoever cancelled it has released the value.
        """
        lock = self._lock
        lock.acquire()
        try:
            if self._state is not GRANTED:
                return None
            self._state = TAKEN
            value = self._value
            self._value = None
        finally:
            lock.release()
        return value

    def take_or_cancel(self) -> _T | None:
        """Atomically: the granted value (taken), or None and the waiter cancelled.

        For a waiter whose time ran out: a grant that beat the deadline is used, not wasted.
        """
        lock = self._lock
        lock.acquire()
        try:
            state = self._state
            if state is GRANTED:
                self._state = TAKEN
                value = self._value
                self._value = None
                return value
            if state is PENDING:
                self._state = CANCELLED
                self._wake = None
        finally:
            lock.release()
        return None

    def cancel(self) -> int:
        """The waiter leaves; returns the state it was in.

        :data:`PENDING`: nothing was granted; the owner should withdraw the request from its
        queue (a grant racing with that is released when it arrives). :data:`GRANTED`: the
        value had not been taken and was released here. :data:`TAKEN`: too late, the waiter's
        side owns the value and must release it itself. :data:`CANCELLED`: cancelled before.
        """
        lock = self._lock
        lock.acquire()
        try:
            state = self._state
            if state is PENDING or state is GRANTED:
                self._state = CANCELLED
                value = self._value
                self._value = None
                self._wake = None
        finally:
            lock.release()
        if state is GRANTED:
            self._release(value)  # type: ignore[arg-type]
        return state

    # -- waiting ----------------------------------------------------------------------------------

    def wait(
        self, timeout: float | None = None, *, expire: Callable[[], bool] | None = None
    ) -> _T | None:
        """Block the calling thread until granted; the value, or None on timeout.

        On timeout the waiter is cancelled (a grant arriving later is released); if the grant
        won the race it is taken and returned. The owner still withdraws the request when this
        returns None (``state`` is then :data:`CANCELLED`).

        Args:
            timeout: Seconds to wait; None waits until granted.
            expire: Asked at the deadline, on the waiting thread, when no grant has arrived: it
                returns True if the waiter gives up (typically: the owner found the request
                still pending, withdrew it and cancelled the waiter, all under its own lock),
                or False if the owner has already decided a grant that is on its way - which
                is then waited for without a deadline (the grant must not be wasted because
                its hand-over is a moment late). Without ``expire`` the waiter gives up.
        """
        if self._state is GRANTED:
            return self.take()
        parked = threading.Lock()
        parked.acquire()
        self.bind(parked.release)
        if timeout is None:
            parked.acquire()
        elif (
            not parked.acquire(timeout=min(timeout, threading.TIMEOUT_MAX))
            and expire is not None
            and not expire()
        ):
            parked.acquire()  # decided before the deadline: its wake-up is on the way
            return self.take()
        return self.take_or_cancel()

    def arm_async(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future of ``loop`` resolved (on ``loop``) once the value is granted.

        The building block of :meth:`wait_async` for a caller that awaits inline (one
        coroutine less): await the future, then :meth:`take`; if the await raises, cancel the
        waiter (a grant that raced with it is released). Call it on ``loop``'s thread.
        """
        future: asyncio.Future[None] = loop.create_future()
        self.bind(_AsyncWake(self, loop, future))
        return future

    @classmethod
    def on_loop(
        cls, release: Callable[[_T], object], loop: asyncio.AbstractEventLoop
    ) -> tuple[Waiter[_T], asyncio.Future[None]]:
        """A new waiter already armed as by :meth:`arm_async`, and its future.

        For an owner that creates the waiter under its own lock, before any granter can see
        it: the wake-up is set at birth, so arming takes no lock (``bind`` would). Await the
        future, then :meth:`take`, as after :meth:`arm_async`. Call it on ``loop``'s thread.
        """
        # The contended hold_async path (bench_asyncio's "hold_async contended" row).
        waiter = cls(release)
        future: asyncio.Future[None] = loop.create_future()
        waiter._wake = _AsyncWake(waiter, loop, future)
        return waiter, future

    async def wait_async(
        self,
        # A parameter, not the caller's asyncio.timeout(): at the deadline the wait may have to
        # go on (``expire`` returned False), which a cancelling timeout cannot do.
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        expire: Callable[[], bool] | None = None,
    ) -> _T:
        """Suspend the running task until granted; cancelling the task cancels the waiter.

        A grant that raced with the task's cancellation is released, never lost.

        Args:
            timeout: Seconds to wait; None waits until granted.
            expire: As for :meth:`wait`.

        Raises:
            TimeoutError: Not granted within ``timeout`` (the waiter is cancelled).
            asyncio.CancelledError: The task was cancelled, or the waiter was cancelled from
                elsewhere after its wake-up.
        """
        future = self.arm_async(asyncio.get_running_loop())
        try:
            if timeout is not None:
                # asyncio.wait, not asyncio.timeout: the future must survive the deadline, in
                # case ``expire`` says its grant is on the way.
                done, _ = await asyncio.wait((future,), timeout=timeout)
                if not done and (expire is None or expire()):
                    value = self.take_or_cancel()
                    if value is None:
                        raise TimeoutError(f"not granted within {timeout:g} s")
                    return value
            await future
        except BaseException:
            self.cancel()
            raise
        value = self.take()
        if value is None:  # cancelled from elsewhere (e.g. the owner closed) after the wake-up
            raise asyncio.CancelledError()
        return value

    def __repr__(self) -> str:
        names = ("pending", "granted", "taken", "cancelled")
        return f"<Waiter {names[self._state]}>"


class _AsyncWake:
    """The wake-up of an asyncio wait: resolves its future on its loop.

    One small object, not a closure (a function and three cells): every contended asyncio
    lock wait allocates one.
    """

    __slots__ = ("future", "loop", "waiter")

    def __init__(
        self, waiter: Waiter[Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]
    ) -> None:
        self.waiter = waiter
        self.loop = loop
        self.future = future

    def __call__(self) -> None:
        future = self.future
        try:
            if running_loop() is self.loop:
                # Granted by a task of the same loop (the common asyncio case): resolve the
                # future right here. Its callbacks (the task's wake-up) are scheduled by the
                # future itself, so this is one loop hop, not two, and no self-pipe write.
                if not future.done():
                    future.set_result(None)
            else:
                self.loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # the loop is closed: nobody will take the value
            self.waiter.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
