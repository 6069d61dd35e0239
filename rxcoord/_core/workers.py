"""The worker threads a coordinator owns when no scheduler is given.

Why not ``ThreadPoolExecutor``? Each ``submit`` builds a ``Future`` and a work item and takes a
semaphore, costs we pay per job for a result channel the coordinator does not use (it delivers
results itself). This pool is a ``SimpleQueue`` of callables and at most ``max_workers`` threads,
started lazily when every started one is busy, so a job costs one C-level queue hand-off.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

from loguru import logger

__all__ = ["WorkerPool", "hand_off"]


class WorkerPool:
    """At most ``max_workers`` daemon threads running submitted callables in FIFO order.

    A worker that finishes a job takes no lock: it only stores a count (see ``_finished``).
    With a lock there, every job's end contended with the next submit and with the other
    workers' ends: one more place per job where a thread could block on a lock whose holder
    waits for the GIL (bench_coordinator's sync row, same process: 0.99x-1.12x of the locked
    version; the row itself swings 2x with the machine's load).
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._submitted = 0  # under the lock: exact
        # Jobs finished, as last stored by a worker: ``next(self._finishes)`` is atomic, but two
        # workers may store their counts out of order, so this is never above the truth. Jobs
        # in flight are then never under-counted, and a submit never finds too few workers (a
        # job waiting on another job must never sit behind a busy pool); at worst it starts a
        # thread a moment early, still at most ``max_workers``.
        self._finishes = itertools.count(1)
        self._finished = 0
        self._closed = False

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on a worker thread.

        Raises:
            RuntimeError: the pool was shut down.
        """
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise RuntimeError(f"worker pool {self._name!r} is shut down")
            self._submitted = submitted = self._submitted + 1
            threads = self._threads
            if submitted - self._finished > len(threads) and len(threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(threads)}", daemon=True
                )
                threads.append(thread)
                thread.start()
            # Under the lock: shutdown() queues its exit markers under it too, so a job can
            # never land behind them and stay unrun. (SimpleQueue.put never blocks.)
            self._queue.put(fn)
        finally:
            lock.release()

    def _work(self) -> None:
        get = self._queue.get
        finishes = self._finishes
        while True:
            fn = get()
            if fn is None:
                return
            try:
                fn()
            except BaseException:  # the callables handle their own errors; this is a bug
                logger.opt(exception=True).critical("worker {}: job runner failed", self._name)
            self._finished = next(finishes)

    @property
    def threads(self) -> int:
        """Worker threads started and not yet shut down."""
        with self._lock:
            return len(self._threads)

    def shutdown(self, wait: bool = True) -> None:
        """Stop accepting work; workers exit once the queue is drained. Idempotent.

        With ``wait`` the call returns only when every worker thread has exited (it never waits
        for itself when called from a worker), also when an earlier call did not wait.
        """
        with self._lock:
            threads = list(self._threads)
            if not self._closed:
                self._closed = True
                for _ in threads:
                    self._queue.put(None)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()


# Deliveries caused by timers (a job's timeout, a lock request's expiry) run here, never on the
# shared timer thread: a slow or blocking subscriber must not delay every other timer. Daemon
# threads, started on first use; four, so one slow subscriber delays only its own delivery.
_deliveries = WorkerPool(4, "rxcoord-deliver")


def hand_off(fn: Callable[[], object], what: str = "a subscriber") -> None:
    """Run ``fn`` on a delivery worker (never on the timer thread); log its failures."""

    def call() -> None:
        try:
            fn()
        except Exception:
            logger.opt(exception=True).error("rxcoord: {} failed", what)

    _deliveries.submit(call)
