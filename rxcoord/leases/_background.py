"""Background work of one lease provider: keep-alive renewals and best-effort cleanups.

Renewals do network I/O, so they must not run on rxcoord's shared timer thread (a slow store
would delay every timeout in the process). The shared timer only *schedules*: when a renewal is
due, its callback hands the work to this provider's small executor and returns at once. Two
workers suffice: a renewal is one round trip, and a store slow enough to queue them is a store
whose leases are in trouble anyway (the renewal policy then retries faster, see
``DistributedLease._keep_alive_tick``).

Every registration of a lease carries a generation number. A renewal in flight belongs to the
generation that scheduled it, and when it finishes it may only reschedule or remove *that*
registration: if keep-alive was stopped and started again meanwhile (a failed ``release()``
restarts it), or rescheduled (``extend()`` changed the period), the finished renewal leaves the
newer registration alone instead of cancelling it or putting back the old period.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Final

from loguru import logger

from rxcoord._core.timer import TimerHandle, call_later

if TYPE_CHECKING:
    from ._lease import DistributedLease

__all__ = ["Background"]

_WORKERS: Final = 2


class Background:
    """Keep-alive timers and a small executor, owned by one provider."""

    __slots__ = (
        "_closed",
        "_executor",
        "_generations",
        "_idle",
        "_lock",
        "_name",
        "_running",
        "_timers",
    )

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _running drops to 0
        self._executor: ThreadPoolExecutor | None = None
        # lease -> (generation of its registration, pending timer or None)
        self._timers: dict[DistributedLease, tuple[int, TimerHandle | None]] = {}
        self._generations = itertools.count(1)
        self._running = 0  # tasks submitted to the executor and not finished (or cancelled)
        self._closed = False

    def start(self, lease: DistributedLease, delay: float) -> bool:
        """Renew ``lease`` every so often, first after ``delay``; False if already running."""
        with self._lock:
            if self._closed or lease in self._timers:
                return False
            generation = next(self._generations)
            self._timers[lease] = (generation, None)
        self._schedule(lease, generation, delay)
        return True

    def reschedule(self, lease: DistributedLease, delay: float) -> bool:
        """Replace the pending renewal of ``lease`` by one after ``delay``; False if not running.

        A renewal already in flight still finishes, but it no longer schedules the next one.
        """
        with self._lock:
            entry = self._timers.get(lease)
            if self._closed or entry is None:
                return False
            generation = next(self._generations)
            self._timers[lease] = (generation, None)
        if entry[1] is not None:
            entry[1].cancel()
        self._schedule(lease, generation, delay)
        return True

    def stop(self, lease: DistributedLease) -> bool:
        """Stop renewing ``lease``; True if it was being renewed. A renewal in flight finishes."""
        with self._lock:
            entry = self._timers.pop(lease, None)
        if entry is None:
            return False
        if entry[1] is not None:
            entry[1].cancel()
        return True

    def active(self) -> int:
        """Leases being kept alive."""
        with self._lock:
            return len(self._timers)

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the executor (used for cleanups that must not block the caller)."""
        self._submit(_logged, fn)

    def close(self, grace: float | None = None) -> None:
        """Cancel every renewal and wait for the executor's work to finish.

        Args:
            grace: Most seconds to wait for work in flight (None: as long as it takes). Work
                still running after that (a round trip to a store that does not answer; each is
                bounded by the provider's own timeout) finishes on its own, in the background.
        """
        with self._lock:
            self._closed = True
            handles = [h for _, h in self._timers.values() if h is not None]
            self._timers.clear()
            executor, self._executor = self._executor, None
        for handle in handles:
            handle.cancel()
        if executor is None:
            return
        executor.shutdown(wait=False, cancel_futures=True)
        # Closed from one of our own workers (a loss callback closing the provider), a worker
        # cannot wait for itself: let the others finish on their own.
        if threading.current_thread().name.startswith(self._name):
            return
        with self._idle:
            idle = self._idle.wait_for(lambda: self._running == 0, timeout=grace)
        if idle:
            executor.shutdown(wait=True)  # nothing left to run: only joins the idle threads
        else:
            logger.warning(
                "rxcoord {}: background work still running {}s after close; it ends on its own",
                self._name,
                grace,
            )

    def _submit(self, fn: Callable[..., object], *args: object) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_WORKERS, thread_name_prefix=self._name)
            executor = self._executor
            self._running += 1
        try:
            future = executor.submit(fn, *args)
        except RuntimeError:  # shut down concurrently: the provider is closing
            self._finished(None)
            return False
        # Also called for a future cancelled by close() before it ran.
        future.add_done_callback(self._finished)
        return True

    def _finished(self, _future: Future[object] | None) -> None:
        with self._idle:
            self._running -= 1
            if not self._running:
                self._idle.notify_all()

    def _schedule(self, lease: DistributedLease, generation: int, delay: float) -> None:
        with self._lock:
            entry = self._timers.get(lease)
            if self._closed or entry is None or entry[0] != generation:
                return
            handle = call_later(delay, partial(self._due, lease, generation))
            self._timers[lease] = (generation, handle)

    def _due(self, lease: DistributedLease, generation: int) -> None:
        # On the shared timer thread: hand the I/O to the executor and return at once.
        with self._lock:
            entry = self._timers.get(lease)
            if entry is None or entry[0] != generation:
                return
        self._submit(self._tick, lease, generation)

    def _tick(self, lease: DistributedLease, generation: int) -> None:
        try:
            delay = lease._keep_alive_tick()
        except Exception:
            logger.opt(exception=True).error("rxcoord lease keep-alive failed unexpectedly")
            delay = None
        if delay is None:
            with self._lock:
                entry = self._timers.get(lease)
                if entry is not None and entry[0] == generation:
                    del self._timers[lease]
            return
        self._schedule(lease, generation, delay)


def _logged(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        logger.opt(exception=True).warning("rxcoord lease background task failed")
