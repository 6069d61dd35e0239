"""Waiting for a taken lease without a thread per waiter.

Every waiting form of a provider (``acquire``, ``lock``, ``acquire_rx``, ``run``,
``acquire_async``, ``lock_async``) is one :class:`LeaseWait`: the grant's arguments, a deadline,
and a :class:`rxcoord._core.waiter.Waiter` through which the outcome is handed over. The forms
differ only in how they wait on that Waiter (the caller's thread blocks, a task awaits, an
Observable's delivery is bound to it); the state machine below is the same for all of them.

Queues, not a thread per waiter
-------------------------------
Waiters of one name in one provider form a FIFO :class:`_NameQueue` with *one* registration in
the provider's :class:`WaitHub`, *one* timer and at most *one* store round trip in flight, made
for the queue's head. What wakes a queue, whichever comes first:

* a release notification for the name (or the store confirming the subscription, or the
  listener losing its connection: a release may have been missed);
* the expiry time the store reported for the current holder (a crashed holder's lease is
  picked up when it lapses, with no notification at all);
* the poll backoff, only while the hub cannot guarantee a wake-up on release (the store has not
  confirmed the subscription yet, or never can: SQLite), bounded by that expiry time.

A waiter's own timeout is a timer of its own. Timers run on rxcoord's one timer thread and only
*schedule*: the round trip runs on the provider's :class:`WorkerPool`, a constant number of
threads per provider whatever the number of waiters, or, when the queue's head is a blocking
``acquire``, on that caller's own parked thread (one thread wake-up from the notification to
the round trip). The same store state answers every waiter
of a name alike, so one attempt per queue loses nothing, and a release costs one round trip per
provider instead of one per waiter (no thundering herd).

Invariant: a live queue with waiters has an attempt queued or in flight, a pending timer, or
is being registered with the hub (whose registration then decides which). An attempt that
returns while a wake-up arrived in the meantime (``again``) tries again at once: that wake-up
may concern a release after the attempt read the store.

The ownership rule
------------------
Exactly one outcome settles a wait, decided under the machinery's lock (``settled``): the grant
of its head attempt, its timeout, the provider closing, or the waiter's side withdrawing. The
outcome is then handed over through the Waiter, whose rule covers the waiter leaving at the same
moment: a lease granted to a waiter that is gone is released, never lost. A lease an attempt
won for a head that had already left is released too (the release wakes the queue again).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial
from time import monotonic
from typing import TYPE_CHECKING, Final, TypeVar

from loguru import logger

from rxcoord._core.telemetry import LeaseOutcome
from rxcoord._core.timer import TimerHandle, call_later
from rxcoord._core.waiter import PENDING, Waiter
from rxcoord._core.workers import WorkerPool
from rxcoord._errors import LeaseProviderClosed, LockTimeout

from ._lease import DistributedLease

if TYPE_CHECKING:
    from ._base import LeaseProvider
    from ._notify import Watch

__all__ = ["WORKERS", "Failure", "LeaseWait", "Outcome", "Waits"]

_R = TypeVar("_R")
_Dead = tuple["TimerHandle | None", "Watch | None"]  # a dead queue's timer and registration

# Wake this long after the reported expiry, so the store surely sees the lease as expired.
_EXPIRY_SLACK: Final = 0.001

# Store round trips of waiters run on this many threads per provider. Within one name the queue
# makes one round trip at a time; four let waits on different names (and a store that is slow
# to answer one of them) proceed side by side. They run rxcoord's own work only (round trips,
# releases of leases nobody took), never a subscriber's or a job's code, so user code blocking
# can never starve them of threads.
WORKERS: Final = 4


class Failure:
    """The outcome of a wait that ended without a lease: ``error``, or None if skipped."""

    __slots__ = ("error",)

    def __init__(self, error: Exception | None) -> None:
        self.error = error


Outcome = DistributedLease | Failure


class LeaseWait:
    """One waiting acquisition; its outcome arrives through ``waiter``.

    Attributes:
        waiter: Granted a :class:`DistributedLease` or a :class:`Failure`. A lease granted
            after the waiter's side left is released by the Waiter's rule.
        try_once: ``timeout == 0``: one attempt, no waiting.
        skip_taken: With ``try_once``, a taken name ends in ``Failure(None)`` (complete empty,
            return None) instead of ``LockTimeout``.
    """

    __slots__ = (
        "begun",
        "deadline",
        "least",
        "most",
        "name",
        "queue",
        "runner",
        "settled",
        "skip_taken",
        "timeout",
        "timer",
        "try_once",
        "waiter",
    )

    def __init__(
        self,
        waits: Waits,
        name: str,
        most: float,
        least: float,
        timeout: float | None,
        *,
        skip_taken: bool,
        deadline: float | None,
        begun: float,
    ) -> None:
        self.name = name
        self.begun = begun  # telemetry's stamp of the request (0.0: not recorded)
        self.most = most
        self.least = least
        self.timeout = timeout
        self.try_once = timeout == 0
        self.skip_taken = skip_taken
        self.deadline = deadline
        self.waiter: Waiter[Outcome] = Waiter(waits._release_unwanted)
        self.queue: _NameQueue | None = None
        self.timer: TimerHandle | None = None
        self.runner: _OwnThread | None = None  # a blocking waiter's own thread
        self.settled = False  # under Waits._lock: an outcome was decided (or the wait withdrawn)


class _OwnThread:
    """A blocking waiter's parked thread, which also runs its queue's attempts while head.

    The thread is parked anyway (its caller chose to block); running the round trip there
    instead of on a worker saves a thread hand-off on the release-to-grant path. The thread
    wakes for a job or for the grant (a binary semaphore: wake-ups merge, and after each the
    thread looks at both). Jobs offered after :meth:`close` are refused and go to the workers;
    jobs offered before it and not run are returned by it, for the workers.
    """

    __slots__ = ("_closed", "_jobs", "_lock", "_parked")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[Callable[[], None]] = []
        self._closed = False
        self._parked = threading.Lock()
        self._parked.acquire()

    def offer(self, job: Callable[[], None]) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._jobs.append(job)
        self.wake()
        return True

    def wake(self) -> None:
        with self._lock:
            if self._parked.locked():
                self._parked.release()

    def park(self) -> None:
        self._parked.acquire()

    def jobs(self) -> list[Callable[[], None]]:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        return jobs

    def close(self) -> list[Callable[[], None]]:
        with self._lock:
            self._closed = True
            jobs, self._jobs = self._jobs, []
        return jobs


class _NameQueue:
    """The waiters of one name in one provider (see the module docstring)."""

    __slots__ = (
        "again",
        "attempting",
        "dead",
        "name",
        "poll",
        "timer",
        "timer_gen",
        "waits",
        "watch",
    )

    def __init__(self, name: str, poll: float) -> None:
        self.name = name
        self.waits: dict[LeaseWait, None] = {}  # FIFO; O(1) removal of any waiter
        self.attempting = False  # an attempt is queued on the workers or in flight
        self.again = False  # woken while attempting: try again when the attempt returns
        self.timer: TimerHandle | None = None
        self.timer_gen = 0  # tells a stale timer callback from the current one
        self.poll = poll
        self.dead = False  # removed from the provider (empty, or the provider closed)
        self.watch: Watch | None = None  # the queue's registration with the hub


class Waits:
    """The waiting machinery of one provider: name queues, timers and a bounded worker pool.

    Threads: at most :data:`WORKERS` pool threads, started on first use and stopped by
    :meth:`close`; timers use rxcoord's one shared timer thread; blocking callers lend their
    own parked threads (:class:`_OwnThread`). Outcomes are handed over
    through each wait's Waiter on the thread that decided them (a worker, the timer thread, the
    closing thread), whose wake-up must therefore be short: unpark a thread, resolve a future
    via ``call_soon_threadsafe``, or hand a delivery to a thread of its own.
    """

    def __init__(self, provider: LeaseProvider, poll: tuple[float, float]) -> None:
        self._provider = provider
        self._poll_min, self._poll_max = poll
        self._lock = threading.Lock()
        self._queues: dict[str, _NameQueue] = {}
        self._count = 0
        self._closed = False
        self._pool = WorkerPool(WORKERS, f"rxcoord-{provider.backend}-lease-wait")
        self._telemetry = provider._telemetry

    # -- the waiter's side ------------------------------------------------------------------------

    def new(
        self,
        name: str,
        most: float,
        least: float,
        timeout: float | None,
        *,
        skip_taken: bool = False,
        deadline: float | None = None,
        begun: float | None = None,
    ) -> LeaseWait:
        """A wait, not started yet; bind to its ``waiter`` first, then :meth:`start` it.

        ``begun``: when the request began, for ``rxcoord.lease.wait`` (default: now).
        """
        if deadline is None and timeout is not None:
            deadline = monotonic() + timeout
        if begun is None:
            begun = self._telemetry.begin()
        return LeaseWait(
            self,
            name,
            most,
            least,
            timeout,
            skip_taken=skip_taken,
            deadline=deadline,
            begun=begun,
        )

    def start(self, wait: LeaseWait) -> None:
        """Make the first attempt on a worker, then wait as needed."""
        if not self._submit(partial(self.first_attempt, wait)):
            self._settle(wait, Failure(self._closed_error()))

    def first_attempt(self, wait: LeaseWait) -> None:
        """Make the first attempt on the calling thread, then wait as needed."""
        if wait.settled:  # withdrawn before it started (disposed early): no round trip
            return
        try:
            result = self._provider._attempt(wait.name, wait.most, wait.least)
        except Exception as exc:
            self._settle(wait, Failure(exc))
            return
        self.proceed(wait, result)

    def proceed(self, wait: LeaseWait, result: DistributedLease | float) -> None:
        """Go on from a first attempt made by the caller: settle, or join the name's queue."""
        if isinstance(result, DistributedLease):
            self._settle(wait, result)
        elif wait.try_once:
            taken = None if wait.skip_taken else self._timeout_error(wait)
            self._settle(wait, Failure(taken))
        else:
            self._enqueue(wait, result)

    def wait_blocking(self, wait: LeaseWait, result: DistributedLease | float) -> Outcome:
        """Go on from the caller's failed first attempt, parking the caller's thread.

        The same state machine as every other form; the parked thread also runs its queue's
        attempts while it is the head (see :class:`_OwnThread`). Interrupted, the wait is
        left (nothing stays granted) and attempts handed to this thread go to the workers.
        """
        runner = wait.runner = _OwnThread()
        wait.waiter.bind(runner.wake)
        try:
            self.proceed(wait, result)
            while True:
                runner.park()
                for job in runner.jobs():
                    job()
                outcome = wait.waiter.take()
                if outcome is not None:
                    return outcome
        except BaseException:
            self.leave(wait)
            raise
        finally:
            for job in runner.close():  # offered just before we left: the workers run them
                if not self._submit(job):
                    job()

    def leave(self, wait: LeaseWait) -> None:
        """The waiter's side gives up (disposed, cancelled, interrupted); idempotent.

        Whatever was granted and not taken is released by the Waiter; a grant decided at the
        same moment arrives at a cancelled Waiter and is released as well.
        """
        if wait.waiter.cancel() == PENDING:
            self.withdraw(wait)

    def withdraw(self, wait: LeaseWait) -> None:
        """Take a wait out of its queue without an outcome (its Waiter is cancelled)."""
        with self._lock:
            if wait.settled:
                return
            wait.settled = True
            cleanup = self._remove_locked(wait)
        self._cleanup(cleanup)
        self._telemetry.waited(wait.begun, "cancelled")

    def waiting(self) -> int:
        """Waits in a queue (registered with the hub, not settled)."""
        with self._lock:
            return self._count

    # -- running work off the caller's thread -----------------------------------------------------

    async def call_async(self, fn: Callable[[], _R]) -> _R:
        """Await ``fn()`` run on a worker; cancelling the task does not stop ``fn``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_R] = loop.create_future()

        def run() -> None:
            try:
                value = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, value)

        if not self._submit(run):
            return fn()  # the provider closed: run here (fn is a quick, failing call then)
        return await future

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Fail every waiter with :class:`LeaseProviderClosed` and stop the workers."""
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
            self._queues.clear()
            waits: list[LeaseWait] = []
            deads: list[_Dead] = []
            for queue in queues:
                deads.append(self._kill_locked(queue))
                for wait in queue.waits:
                    wait.settled = True
                    wait.queue = None
                    waits.append(wait)
                queue.waits.clear()
            self._count = 0
        for dead in deads:
            self._cleanup(dead)
        if waits:
            error = self._closed_error()
            for wait in waits:
                if wait.timer is not None:
                    wait.timer.cancel()
                self._telemetry.waited(wait.begun, "failed")
                wait.waiter.grant(Failure(error))
        # Attempts still queued run and find the provider closed (their waiters fail with it);
        # the workers exit once the queue is drained. Not waited for: close() may run on one.
        self._pool.shutdown(wait=False)

    # -- internals --------------------------------------------------------------------------------

    def _closed_error(self) -> LeaseProviderClosed:
        try:
            self._provider._check_open()
        except LeaseProviderClosed as exc:
            return exc
        return LeaseProviderClosed(f"{type(self._provider).__name__} is closed")

    def _timeout_error(self, wait: LeaseWait) -> LockTimeout:
        return self._provider._timeout_error(wait.name, wait.timeout)

    def _submit(self, fn: Callable[[], object]) -> bool:
        try:
            self._pool.submit(fn)
        except RuntimeError:  # shut down: the provider closed
            return False
        return True

    def _release_unwanted(self, outcome: Outcome) -> None:
        """A lease nobody will take (its waiter left): release it off the caller's thread."""
        if isinstance(outcome, DistributedLease):
            logger.debug("rxcoord lease {!r}: granted to a waiter that left; released", outcome)
            if not self._submit(outcome._release_quietly):
                outcome._release_quietly()

    def _settle(self, wait: LeaseWait, outcome: Outcome) -> None:
        """Decide ``wait``'s outcome if nothing else did; else release a lease that lost."""
        with self._lock:
            if wait.settled:
                decided = False
                cleanup = None
            else:
                decided = wait.settled = True
                cleanup = self._remove_locked(wait)
        self._cleanup(cleanup)
        if decided:
            if wait.timer is not None:
                wait.timer.cancel()
            self._telemetry.waited(wait.begun, _outcome_name(outcome))
            wait.waiter.grant(outcome)  # released by the Waiter if its side has left
        else:
            self._release_unwanted(outcome)

    def _enqueue(self, wait: LeaseWait, remaining: float) -> None:
        with self._lock:
            if wait.settled:  # withdrawn during the first attempt
                return
            if self._closed:
                closed = True
                queue = None
                new = False
            else:
                closed = False
                queue = self._queues.get(wait.name)
                new = queue is None
                if queue is None:
                    queue = self._queues[wait.name] = _NameQueue(wait.name, self._poll_min)
                queue.waits[wait] = None
                wait.queue = queue
                self._count += 1
                if wait.deadline is not None:
                    wait.timer = call_later(
                        wait.deadline - monotonic(), partial(self._expire, wait)
                    )
        if closed:
            self._settle(wait, Failure(self._closed_error()))
            return
        assert queue is not None
        if new:
            self._register(queue, remaining)

    def _register(self, queue: _NameQueue, remaining: float) -> None:
        # Outside the lock: a closed hub fires the callback from inside watch().
        watch = self._provider._hub.watch(queue.name, partial(self._wake, queue))
        with self._lock:
            if queue.dead:
                dead = True
            else:
                dead = False
                queue.watch = watch
                submit = False
                if not queue.attempting and queue.timer is None:
                    if watch.confirmed:
                        # Registered on a subscription already in place (another waiter's, or
                        # a hub that sees every release): a release between the failed try and
                        # the registration woke nobody, and no confirmation will come to make
                        # us retry. Retry now.
                        queue.attempting = submit = True
                    else:
                        self._schedule_locked(queue, watch, remaining)
        if dead:
            watch.close()
        elif submit:
            self._submit_attempt(queue)

    def _wake(self, queue: _NameQueue) -> None:
        """A notification for the queue's name (any thread): attempt now."""
        with self._lock:
            if queue.dead:
                return
            if queue.attempting:
                queue.again = True
                return
            queue.attempting = True
            timer, queue.timer = queue.timer, None
        if timer is not None:
            timer.cancel()
        self._submit_attempt(queue)

    def _due(self, queue: _NameQueue, generation: int) -> None:
        """The queue's timer (timer thread): attempt now, on a worker."""
        with self._lock:
            if queue.dead or queue.attempting or queue.timer_gen != generation:
                return
            queue.timer = None
            queue.attempting = True
        self._submit_attempt(queue)

    def _expire(self, wait: LeaseWait) -> None:
        """A waiter's deadline (timer thread)."""
        self._settle(wait, Failure(self._timeout_error(wait)))

    def _submit_attempt(self, queue: _NameQueue) -> None:
        job = partial(self._attempt, queue)
        with self._lock:
            head = next(iter(queue.waits), None)
        # A blocking head runs its queue's attempt on its own parked thread: one thread wake
        # from the notification to the round trip, as without the queue.
        if head is not None and head.runner is not None and head.runner.offer(job):
            return
        if not self._submit(job):
            with self._lock:
                queue.attempting = False  # closing: close() fails the waiters

    def _attempt(self, queue: _NameQueue) -> None:
        """One round trip for the queue's head (on a worker), then what it implies."""
        with self._lock:
            head = next(iter(queue.waits), None)
            if queue.dead or head is None:
                queue.attempting = False
                return
            queue.again = False  # a wake-up from now on may follow our read of the store
        result: DistributedLease | float | Failure
        try:
            result = self._provider._attempt(queue.name, head.most, head.least)
        except Exception as exc:
            result = Failure(exc)
        except BaseException:
            # Interrupted (KeyboardInterrupt on a blocking head's own thread): the queue must
            # not stay "attempting" forever; its attempt goes to the next runner or a worker.
            with self._lock:
                queue.attempting = False
            self._wake(queue)
            raise
        winner: LeaseWait | None = None
        unwanted: DistributedLease | None = None
        submit = False
        cleanup = None
        with self._lock:
            queue.attempting = False
            if isinstance(result, float):
                remaining = result
            else:
                if head.queue is queue and not head.settled:
                    head.settled = True
                    winner = head
                    cleanup = self._remove_locked(head)
                elif isinstance(result, DistributedLease):
                    unwanted = result  # the head left while we asked
                # The name is ours now (or the store failed): ask again after the lease's
                # length, or after the shortest poll if the store failed, unless woken first.
                remaining = head.most if isinstance(result, DistributedLease) else 0.0
                if isinstance(result, Failure):
                    queue.poll = self._poll_min
            if not queue.dead and queue.waits:
                if queue.again and not isinstance(result, Failure):
                    queue.attempting = submit = True
                else:
                    watch = queue.watch
                    if isinstance(result, Failure):
                        self._schedule_delay_locked(queue, self._poll_min)
                    else:
                        self._schedule_locked(queue, watch, remaining)
        self._cleanup(cleanup)
        if winner is not None:
            assert not isinstance(result, float)
            if winner.timer is not None:
                winner.timer.cancel()
            self._telemetry.waited(winner.begun, _outcome_name(result))
            winner.waiter.grant(result)
        if unwanted is not None:
            self._release_unwanted(unwanted)
        if submit:
            self._submit_attempt(queue)

    def _schedule_locked(self, queue: _NameQueue, watch: Watch | None, remaining: float) -> None:
        delay = remaining + _EXPIRY_SLACK
        if watch is None or not watch.confirmed:
            delay = min(delay, queue.poll)
            queue.poll = min(queue.poll * 2, self._poll_max)
        self._schedule_delay_locked(queue, delay)

    def _schedule_delay_locked(self, queue: _NameQueue, delay: float) -> None:
        queue.timer_gen += 1
        queue.timer = call_later(delay, partial(self._due, queue, queue.timer_gen))

    def _remove_locked(self, wait: LeaseWait) -> _Dead | None:
        """Take a settled wait out of its queue; what to close if that emptied the queue."""
        queue = wait.queue
        if queue is None:
            return None
        wait.queue = None
        del queue.waits[wait]
        self._count -= 1
        if queue.waits:
            return None
        if self._queues.get(queue.name) is queue:
            del self._queues[queue.name]
        return self._kill_locked(queue)

    def _kill_locked(self, queue: _NameQueue) -> _Dead:
        # A registration still in progress sees ``dead`` and closes its watch itself.
        queue.dead = True
        dead = (queue.timer, queue.watch)
        queue.timer = queue.watch = None
        return dead

    def _cleanup(self, dead: _Dead | None) -> None:
        if dead is not None:
            timer, watch = dead
            if timer is not None:
                timer.cancel()
            if watch is not None:
                watch.close()


def _outcome_name(outcome: Outcome) -> LeaseOutcome:
    """What ``rxcoord.lease.wait`` calls the outcome of a wait."""
    if isinstance(outcome, DistributedLease):
        return "acquired"
    if outcome.error is None:
        return "taken"  # wait=False / try_acquire_async: the name was taken
    if isinstance(outcome.error, LockTimeout):
        return "timed_out"
    return "failed"


def _set_result(future: asyncio.Future[_R], value: _R) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[_R], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
