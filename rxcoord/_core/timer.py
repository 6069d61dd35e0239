"""One timer thread for all of rxcoord's timeouts, lock deadlines and keep-alive renewals.

Why not reactivex's schedulers? ``TimeoutScheduler`` starts one OS thread per pending timer, and a
timer on ``ThreadPoolScheduler`` ties up a pool worker until its due time even when cancelled:
ten thousand pending job timeouts would mean ten thousand threads or blocked workers. Here every
timer is an entry in one heap served by one daemon thread, and cancelling is O(1).

Callbacks run on the timer thread, so they must be short and must not block (signal something,
hand work to a pool). An exception in a callback is logged, never propagated.

The thread lingers for a moment when the heap empties and then exits, so an idle process keeps no
timer thread; the next ``call_later`` starts it again.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Final

from loguru import logger

__all__ = ["TimerHandle", "Timers", "call_later"]

_LINGER: Final = 1.0  # seconds the idle thread waits for new timers before exiting


class TimerHandle:
    """A pending call; ``cancel()`` withdraws it (a no-op once it ran or was cancelled)."""

    __slots__ = ("_owner", "callback", "deadline")

    def __init__(self, owner: Timers, deadline: float, callback: Callable[[], object]) -> None:
        self._owner = owner
        self.deadline = deadline
        self.callback: Callable[[], object] | None = callback

    @property
    def cancelled(self) -> bool:
        """True once the timer was cancelled or has fired."""
        return self.callback is None

    def cancel(self) -> None:
        """Withdraw the call if it has not run yet."""
        if self.callback is not None:
            self._owner._cancel(self)

    # Only the deadline orders handles in the heap; equal deadlines keep insertion order via a
    # sequence number stored alongside (see Timers.call_later).


class Timers:
    """A heap of deadlines served by one lazily started daemon thread."""

    def __init__(self, name: str = "rxcoord-timer") -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._cancelled = 0
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, callback: Callable[[], object]) -> TimerHandle:
        """Run ``callback`` on the timer thread after ``delay`` seconds (monotonic clock)."""
        deadline = time.monotonic() + max(0.0, delay)
        handle = TimerHandle(self, deadline, callback)
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0][2] is handle:
                self._cond.notify()  # the new timer is the earliest: shorten the sleep
        return handle

    def pending(self) -> int:
        """Timers scheduled and neither fired nor cancelled."""
        with self._cond:
            return len(self._heap) - self._cancelled

    def _cancel(self, handle: TimerHandle) -> None:
        with self._cond:
            # Decided under the lock the timer thread pops under: a handle it took (to run it,
            # or to drop it as cancelled) in between is not counted as a cancelled entry again.
            if handle.callback is None:
                return
            handle.callback = None
            self._cancelled += 1
            # Cancelled entries stay in the heap until due; compact when they dominate so that
            # many cancelled long timeouts cannot pile up.
            if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if entry[2].callback is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        heap = self._heap
        while True:
            with self._cond:
                while True:
                    heap = self._heap
                    while heap and heap[0][2].callback is None:
                        heapq.heappop(heap)
                        self._cancelled = max(0, self._cancelled - 1)
                    if not heap:
                        self._cond.wait(_LINGER)
                        if not self._heap:
                            self._thread = None
                            self._cancelled = 0
                            return
                        continue
                    delay = heap[0][0] - time.monotonic()
                    if delay <= 0:
                        handle = heapq.heappop(heap)[2]
                        callback = handle.callback
                        handle.callback = None
                        break
                    # Waits are capped at TIMEOUT_MAX (about 49 days) so a huge delay just
                    # means waking up early and checking again, not an OverflowError that would
                    # kill the thread and silently stall every other timer.
                    self._cond.wait(min(delay, threading.TIMEOUT_MAX))
            if callback is not None:
                try:
                    callback()
                except BaseException:  # even SystemExit: a dead timer thread stalls every timer
                    logger.opt(exception=True).error("rxcoord timer callback failed")


_default = Timers()


def call_later(delay: float, callback: Callable[[], object]) -> TimerHandle:
    """Run ``callback`` after ``delay`` seconds on rxcoord's shared timer thread."""
    return _default.call_later(delay, callback)
