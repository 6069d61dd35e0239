"""The rate bucket: GCRA (the generic cell rate algorithm) as pure arithmetic on one number.

Why GCRA
--------
A rate ``count`` starts per ``per`` seconds with ``burst`` back to back after idling is a token
bucket: ``burst`` tokens at most, one refilled every ``interval = per / count`` seconds, one
taken per start. GCRA keeps the same bucket as a single number, the *theoretical arrival
time* ``tat``: the time at which the bucket would be full again. A start at ``now`` is allowed
when ``tat - now <= tolerance``, where ``tolerance = (burst - 1) * interval``, and moves ``tat``
to ``max(tat, now) + interval``. One number instead of a level and a timestamp means:

* the state of a bucket is one float (one Redis sorted-set score, one PostgreSQL array
  element, one JSON number): the stores keep it next to their permits and update it in the
  same atomic step (``rxcoord/leases/_permits.py``); redis-cell's ``CL.THROTTLE`` is the same
  algorithm;
* a bucket with ``tat <= now`` is exactly a fresh one (full), so its state can be forgotten:
  idle rate state expires by itself (a Redis TTL at ``tat``, a row deleted once ``tat`` has
  passed) without changing any answer;
* the wait is exact: the ``n``-th of ``n`` back-to-back starts is allowed at
  ``max(tat, now) + (n - 1) * interval - tolerance``, so a waiter sleeps until then, never
  polls.

The bound: over any interval of length ``t``, at most ``burst + t / interval`` starts pass (the
bucket holds at most ``burst`` tokens at the interval's start and refills ``t / interval``
during it); with ``burst = 1`` consecutive starts are at least ``interval`` apart.

No clock, no threads: every function takes ``now`` (seconds on whatever clock the caller
uses: monotonic, a reactivex virtual scheduler's, a store's), so the same code runs in real
and in virtual time and in every store that runs Python (memory, SQLite). Times closer than
:data:`EPSILON` to a boundary count as on it, so float rounding in a clock's arithmetic (a
virtual clock's microseconds, a sum of intervals) cannot leave a waiter a nanosecond short.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["EPSILON", "Bucket", "available", "take", "wait"]

#: Seconds of float rounding tolerated at a boundary (a start due within it is due now).
EPSILON: Final = 1e-9

_NEVER: Final = -math.inf  # the tat of a fresh bucket: full


def wait(tat: float, now: float, interval: float, burst: int, n: int = 1) -> float:
    """Seconds from ``now`` until ``n`` starts may pass back to back (0.0: now).

    ``n`` beyond ``burst`` can never pass at once: the wait is then until the last of them
    would pass if the first ``burst`` were taken now (the time the bucket refills enough).
    """
    tolerance = (burst - 1) * interval
    late = max(tat, now) + (n - 1) * interval - tolerance - now
    return late if late > EPSILON else 0.0


def available(tat: float, now: float, interval: float, burst: int) -> int:
    """How many starts may pass back to back at ``now`` (0 to ``burst``)."""
    if tat <= now:
        return burst
    slack = (burst - 1) * interval + EPSILON - (tat - now)
    if slack < 0:
        return 0
    n = min(burst, int(slack // interval) + 1)
    # Settle float rounding in the division on the side wait() decides, so the two agree.
    while n < burst and wait(tat, now, interval, burst, n + 1) == 0.0:
        n += 1
    while n > 0 and wait(tat, now, interval, burst, n) > 0.0:
        n -= 1
    return n


def take(tat: float, now: float, interval: float, n: int = 1) -> float:
    """The ``tat`` after ``n`` starts at ``now`` (the caller checked they may pass)."""
    return max(tat, now) + n * interval


class Bucket:
    """One rate's state for in-process admissions (the stores keep ``tat`` themselves).

    Not thread-safe: its owner's lock guards it.

    Args:
        interval: Seconds per start (``per / count``).
        burst: Starts allowed back to back after idling (>= 1).
    """

    __slots__ = ("burst", "interval", "tat")

    def __init__(self, interval: float, burst: int) -> None:
        self.interval = interval
        self.burst = burst
        self.tat = _NEVER

    def wait(self, now: float, n: int = 1) -> float:
        """Seconds until ``n`` starts may pass back to back (0.0: now)."""
        return wait(self.tat, now, self.interval, self.burst, n)

    def available(self, now: float) -> int:
        """Starts that may pass back to back now."""
        return available(self.tat, now, self.interval, self.burst)

    def take(self, now: float, n: int = 1) -> None:
        """Record ``n`` starts at ``now`` (the caller checked they may pass)."""
        self.tat = take(self.tat, now, self.interval, n)

    def full(self, now: float) -> bool:
        """True when the bucket is as a fresh one: its state may be forgotten."""
        return self.tat <= now

    def __repr__(self) -> str:
        return f"<Bucket interval={self.interval:g} burst={self.burst} tat={self.tat:g}>"
