"""Time for the admissions that wait on it: what time it is, and a call at a later time.

Rate admissions wait until a time (the next token), never for an event, so they need both
halves of a clock. Two kinds:

* :data:`MONOTONIC`: ``time.monotonic`` and rxcoord's one timer thread (``timer.py``): no
  thread per waiter, cancelling is O(1);
* :class:`SchedulerClock`: a reactivex ``VirtualTimeScheduler`` (``TestScheduler`` included),
  so a coordinator or a scheduler built with ``scheduler=`` a virtual one waits in virtual
  time, exactly and without sleeping (tests, simulations).

:func:`clock_for` picks the one a component built with ``scheduler=`` should use, the same
rule the coordinator follows for its job timeouts. :class:`Alarm` is what an admission keeps on
its clock: one pending call, the earliest time asked for wins.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from reactivex import abc
from reactivex.scheduler import VirtualTimeScheduler

from .timer import call_later

__all__ = ["MONOTONIC", "Alarm", "Clock", "SchedulerClock", "clock_for"]

Cancel = Callable[[], object]


class Clock(Protocol):
    """Seconds on one clock, and callbacks at times on it."""

    def now(self) -> float:
        """The current time in seconds (only differences mean anything)."""

    def call_later(self, delay: float, callback: Callable[[], object]) -> Cancel:
        """Call ``callback()`` once, at least ``delay`` seconds from now; returns its cancel.

        The callback must be short and must not block (it runs on a shared timer thread, or
        inside a virtual scheduler's ``advance_by``).
        """


class _Monotonic:
    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, callback: Callable[[], object]) -> Cancel:
        return call_later(delay, callback).cancel

    def __repr__(self) -> str:
        return "<Clock monotonic>"


#: Real time: ``time.monotonic`` and the shared timer thread.
MONOTONIC: Clock = _Monotonic()

_MICROSECOND = 1e-6


class SchedulerClock:
    """The clock of a reactivex virtual-time scheduler.

    Delays are rounded *up* to whole microseconds: a virtual scheduler adds relative times as
    ``timedelta`` (microsecond resolution, rounded to nearest), and a callback that ran a
    fraction of a microsecond early would find its time not come yet and ask for a delay that
    rounds to zero, forever, at the same virtual instant.
    """

    __slots__ = ("scheduler",)

    def __init__(self, scheduler: VirtualTimeScheduler) -> None:
        self.scheduler = scheduler

    def now(self) -> float:
        clock = self.scheduler.clock
        return clock if isinstance(clock, float | int) else self.scheduler.to_seconds(clock)

    def call_later(self, delay: float, callback: Callable[[], object]) -> Cancel:
        due = max(0.0, math.ceil(delay / _MICROSECOND - 1e-6) * _MICROSECOND)

        def action(_scheduler: abc.SchedulerBase, _state: object = None) -> None:
            callback()

        return self.scheduler.schedule_relative(due, action).dispose

    def __repr__(self) -> str:
        return f"<Clock {self.scheduler!r}>"


def clock_for(scheduler: abc.SchedulerBase | None) -> Clock:
    """The clock of a component built with ``scheduler=``: virtual for a virtual scheduler."""
    if isinstance(scheduler, VirtualTimeScheduler):
        return SchedulerClock(scheduler)
    return MONOTONIC


class Alarm:
    """One pending call of ``callback`` on ``clock``: asked again, the earliest time wins.

    An admission that waits for a time (its next token) needs one call at the earliest time any
    of its waiters may pass, not one per waiter. :meth:`set` keeps the earlier of the pending
    call and the new one, :meth:`stop` cancels it, :meth:`rang` forgets it once it has run.

    No lock of its own, on purpose: the owner calls every method under the owner's lock, and
    ``callback`` starts by taking that lock and calling :meth:`rang`. So whether a call is
    pending, and for when, changes in the same critical sections as the state that decides
    whether one is needed (no second lock, no window between the two), exactly as when each
    owner kept the two fields itself. A call cancelled too late (already running, waiting for
    the lock) makes one callback more than needed, which finds nothing due and may set the
    alarm again; never one fewer: a pending call is only ever replaced by an earlier one.
    """

    __slots__ = ("_at", "_callback", "_cancel", "_clock")

    def __init__(self, clock: Clock, callback: Callable[[], object]) -> None:
        self._clock = clock
        self._callback = callback
        self._cancel: Cancel | None = None
        self._at = math.inf

    def set(self, now: float, delay: float) -> None:
        """Owner's lock held: call back at ``now + delay``, unless a call is due no later."""
        at = now + delay
        if at >= self._at:
            return
        if self._cancel is not None:
            self._cancel()
        self._at = at
        self._cancel = self._clock.call_later(delay, self._callback)

    def stop(self) -> None:
        """Owner's lock held: cancel the pending call, if any."""
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
        self._at = math.inf

    def rang(self) -> None:
        """Owner's lock held, first thing in the callback: no call is pending any more."""
        self._cancel = None
        self._at = math.inf
