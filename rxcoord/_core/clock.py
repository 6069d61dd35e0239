"""Time for the admissions that wait on it: what time it is, and a call at a later time.

Rate admissions wait until a time (the next token), never for an event, so they need both
halves of a clock. Two kinds:

* :data:`MONOTONIC`: ``time.monotonic`` and rxcoord's one timer thread (``timer.py``): no
  thread per waiter, cancelling is O(1);
* :class:`SchedulerClock`: a reactivex ``VirtualTimeScheduler`` (``TestScheduler`` included),
  so a coordinator or a scheduler built with ``scheduler=`` a virtual one waits in virtual
  time, exactly and without sleeping (tests, simulations).

:func:`clock_for` picks the one a component built with ``scheduler=`` should use, the same
rule the coordinator follows for its job timeouts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from reactivex import abc
from reactivex.scheduler import VirtualTimeScheduler

from .timer import call_later

__all__ = ["MONOTONIC", "Clock", "SchedulerClock", "clock_for"]

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
