"""Checking a rate's bound on logged start times, and a clock tests move by hand.

The bound of ``Rate(count, per, burst)``: over any interval of length ``t`` at most
``burst + count * t / per`` starts. :func:`rate_excess` sweeps a log for the worst interval in
one pass: with the starts sorted, the interval from start ``i`` to start ``j`` holds ``j - i + 1``
of them, and ``j - i + 1 <= burst + r * (t_j - t_i)`` for every ``i <= j`` is
``(j - r * t_j) - (i - r * t_i) <= burst - 1``, so it is enough to keep the running minimum of
``i - r * t_i``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from rxcoord import Rate

# Seconds of clock resolution forgiven: admission times are floats of epoch seconds (about
# 0.2 us apart at today's dates) that stores keep at microseconds, so a start may be logged a
# few microseconds before the bound's exact time (seen: 134 starts in 6.549995 s at Rate(20,
# burst=3), whose bound is 134 at 6.55 s). A real excess is a whole start, 1 / rate seconds.
CLOCK_RESOLUTION = 5e-5


def rate_excess(times: Iterable[float], rate: Rate, slack: float = 0.0) -> float:
    """How far the worst interval of ``times`` exceeds the rate's bound (<= 0: within it).

    Args:
        times: Start times in seconds (any order).
        rate: The rate the starts were made under.
        slack: Seconds added to every interval's length: the most a logged time may lag its
            admission (0 where the log holds the admission's own times).
    """
    per_second = rate.count / rate.per
    ordered = sorted(times)
    worst = float("-inf")
    lowest = float("inf")
    for j, t in enumerate(ordered):
        lowest = min(lowest, j - per_second * t)
        # starts in [t_i, t_j] minus the bound, maximised over i <= j
        worst = max(worst, (j - per_second * t) - lowest + 1 - rate.burst)
    return worst - per_second * slack if ordered else float("-inf")


def assert_within_rate(times: Iterable[float], rate: Rate, slack: float = 0.0) -> None:
    """Fail with the worst interval if ``times`` break ``rate``'s bound (beyond ``slack``)."""
    ordered = sorted(times)
    slack += CLOCK_RESOLUTION
    excess = rate_excess(ordered, rate, slack)
    if excess > 0:
        per_second = rate.count / rate.per
        detail = ""
        for i, j in itertools.combinations(range(len(ordered)), 2):
            allowed = rate.burst + per_second * (ordered[j] - ordered[i] + slack)
            if j - i + 1 > allowed:
                detail = (
                    f"{j - i + 1} starts in [{ordered[i]:.6f}, {ordered[j]:.6f}] "
                    f"(allowed {allowed:.3f})"
                )
                break
        raise AssertionError(f"starts exceed {rate!r} by {excess:.3f}: {detail}")


class ManualClock:
    """A clock for admissions (``rxcoord._core.clock.Clock``) that moves when told to.

    ``advance(dt)`` runs the callbacks that fall due, in time order, each at its own time.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.time = start
        self._due: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._cancelled: set[int] = set()

    def now(self) -> float:
        return self.time

    def call_later(self, delay: float, callback: Callable[[], object]) -> Callable[[], None]:
        seq = next(self._seq)
        heapq.heappush(self._due, (self.time + max(0.0, delay), seq, callback))
        return lambda: self._cancelled.add(seq)

    @property
    def pending(self) -> int:
        """Callbacks scheduled and neither run nor cancelled."""
        return sum(1 for _, seq, _ in self._due if seq not in self._cancelled)

    def advance(self, dt: float) -> None:
        end = self.time + dt
        while self._due and self._due[0][0] <= end:
            at, seq, callback = heapq.heappop(self._due)
            self.time = max(self.time, at)
            if seq not in self._cancelled:
                callback()
        self.time = end
