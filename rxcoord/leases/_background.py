"""Background work of one lease provider: keep-alive renewals and best-effort cleanups.

Renewals do network I/O, so they must not run on rxcoord's shared timer thread (a slow store
would delay every timeout in the process). The shared timer only *schedules*: when a renewal is
due, its callback hands the work to this provider's small executor and returns at once. Two
workers suffice: a renewal is one round trip, and a store slow enough to queue them is a store
whose leases are in trouble anyway (the renewal policy then retries faster, see
``DistributedLease._keep_alive_tick``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from functools import partial
from typing import TYPE_CHECKING, Final

from loguru import logger

from rxcoord._timer import TimerHandle, call_later

if TYPE_CHECKING:
    from ._lease import DistributedLease

__all__ = ["Background"]

_WORKERS: Final = 2


class Background:
    """Keep-alive timers and a small executor, owned by one provider."""

    __slots__ = ("_closed", "_executor", "_lock", "_name", "_timers")

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._timers: dict[DistributedLease, TimerHandle | None] = {}
        self._closed = False

    def start(self, lease: DistributedLease, delay: float) -> bool:
        """Renew ``lease`` every so often, first after ``delay``; False if already running."""
        with self._lock:
            if self._closed or lease in self._timers:
                return False
            self._timers[lease] = None
        self._schedule(lease, delay)
        return True

    def stop(self, lease: DistributedLease) -> bool:
        """Stop renewing ``lease``; True if it was being renewed. A renewal in flight finishes."""
        with self._lock:
            if lease not in self._timers:
                return False
            handle = self._timers.pop(lease)
        if handle is not None:
            handle.cancel()
        return True

    def active(self) -> int:
        """Leases being kept alive."""
        with self._lock:
            return len(self._timers)

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the executor (used for cleanups that must not block the caller)."""
        with self._lock:
            if self._closed:
                return
            executor = self._executor_locked()
        with suppress(RuntimeError):  # shut down concurrently: the provider is closing
            executor.submit(_logged, fn)

    def close(self) -> None:
        """Cancel every renewal and wait for the executor's work to finish."""
        with self._lock:
            self._closed = True
            handles = [h for h in self._timers.values() if h is not None]
            self._timers.clear()
            executor, self._executor = self._executor, None
        for handle in handles:
            handle.cancel()
        if executor is not None:
            # Closed from one of our own workers (a loss callback closing the provider), a
            # worker cannot join itself: let the others finish on their own.
            own = threading.current_thread().name.startswith(self._name)
            executor.shutdown(wait=not own, cancel_futures=True)

    def _executor_locked(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(_WORKERS, thread_name_prefix=self._name)
        return self._executor

    def _schedule(self, lease: DistributedLease, delay: float) -> None:
        with self._lock:
            if self._closed or lease not in self._timers:
                return
            handle = call_later(delay, partial(self._due, lease))
            self._timers[lease] = handle

    def _due(self, lease: DistributedLease) -> None:
        # On the shared timer thread: hand the I/O to the executor and return at once.
        with self._lock:
            if self._closed or lease not in self._timers:
                return
            executor = self._executor_locked()
        with contextlib.suppress(RuntimeError):
            executor.submit(self._tick, lease)

    def _tick(self, lease: DistributedLease) -> None:
        try:
            delay = lease._keep_alive_tick()
        except Exception:
            logger.opt(exception=True).error("rxcoord lease keep-alive failed unexpectedly")
            delay = None
        if delay is None:
            with self._lock:
                self._timers.pop(lease, None)
            return
        self._schedule(lease, delay)


def _logged(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        logger.opt(exception=True).warning("rxcoord lease background task failed")
