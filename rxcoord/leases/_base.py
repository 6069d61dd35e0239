"""The lease provider contract and everything the backends share.

A backend implements three atomic primitives against its store, each one round trip where the
store allows (Redis: one Lua script; PostgreSQL: one statement):

* ``_store_try_grant(name, at_most_for, at_least_for) -> (token, remaining)``: if the name is
  free by the store's clock, take it *and* mint the next fencing token in the same atomic step;
  token 0 means taken, with ``remaining`` seconds until the current lease expires;
* ``_store_extend(name, token, at_most_for) -> bool``: only for the grant (name, token), only
  while unexpired and unreleased;
* ``_store_release(name, token) -> bool``: same condition; the name stays taken until
  ``at_least_for`` after the grant; notifies waiters; leaves no record of the name behind
  once it is free (tokens come from a store-wide sequence, not from the name's record);
* ``_store_holder(name) -> (token, remaining, released) | None``: the store's current grant.

Everything else lives here once: argument validation, ``lock()``, keep-alive, ``run()``
(ShedLock's executor as an Observable), ``acquire_rx`` and the asyncio forms, the lifecycle
(open -> closing -> closed) and statistics.

Waiting is one state machine for every form (``_waiting.py``), with no thread per waiter: a
waiting acquisition is a small object in its name's queue, woken by a release notification,
by the expiry time the store reported for the current holder (a crashed holder's lease is
picked up when it lapses, with no notification at all), by its own timeout, and only while the
store's subscription is not confirmed yet (or never can be: SQLite) by polling with backoff.
Its grant is handed over through the core :class:`~rxcoord._core.waiter.Waiter`, whose one
rule (a grant to a waiter that is gone is released, never lost) covers dispose, timeout, task
cancellation and close racing with the grant.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from time import monotonic
from typing import Any, Final, Literal, TypeVar, overload

from loguru import logger
from reactivex import Observable, abc
from reactivex.disposable import Disposable
from reactivex.internal.exceptions import SequenceContainsNoElementsError
from reactivex.observer import AutoDetachObserver

from rxcoord._core import telemetry
from rxcoord._core.futures import AwaitableObservable, last_value
from rxcoord._core.jobs import JobRun, Work, job_takes_lease, subscriber_loop
from rxcoord._core.lifecycle import Closeable
from rxcoord._errors import LeaseProviderClosed, LeaseStoreUnavailable, LockTimeout

from .._core.checks import (
    MAX_DURATION,
    MAX_NAME_BYTES,
    check_lease_args,
    check_lease_name,
    check_wait,
)
from .._core.futures import running_loop
from ._background import Background
from ._lease import DistributedLease, LeaseHolder
from ._listing import StoreListing
from ._notify import WaitHub
from ._permits import PermitReply, RateArgs
from ._waiting import Failure, LeaseWait, Outcome, Waits

__all__ = ["LeaseProvider", "LeaseProviderStats"]

_R = TypeVar("_R")

_OPEN: Final = "open"
_CLOSING: Final = "closing"
_CLOSED: Final = "closed"
ProviderState = Literal["open", "closing", "closed"]


@dataclass(frozen=True, slots=True)
class LeaseProviderStats:
    """A snapshot of a lease provider.

    Attributes:
        backend: ``"memory"``, ``"sqlite"``, ``"postgres"`` or ``"redis"``.
        state: ``"open"``, ``"closing"`` or ``"closed"``.
        held: Leases granted through this provider and neither released nor lost.
        waiting: Callers currently waiting for a lease.
        keep_alive: Leases being renewed in the background.
        granted: Grants so far.
        busy: Attempts that found the name taken.
        released: Successful releases.
        extended: Successful extensions (explicit and keep-alive).
        lost: Leases found lost (refused extend/release, failed keep-alive).
        store_errors: Operations that failed with ``LeaseStoreUnavailable``.
        notifications: Release notifications received from the store (0 for polling stores).
        reconnects: Times the notification connection was re-established.
    """

    backend: str
    state: ProviderState
    held: int
    waiting: int
    keep_alive: int
    granted: int
    busy: int
    released: int
    extended: int
    lost: int
    store_errors: int
    notifications: int
    reconnects: int


class LeaseProvider(Closeable):
    """Distributed leases in a shared store: the API every backend offers.

    A lease is a named lock with a "locked until" time on the store's clock (ShedLock's model):
    ``at_most_for`` bounds how long a crashed holder blocks the name, ``at_least_for`` keeps the
    name taken for a minimum time after the grant even if released early (so a short scheduled
    job does not run twice on nodes whose clocks differ slightly). Every grant carries a fencing
    token larger than any earlier grant of the name.

    Providers are thread-safe, context managers and reactivex Disposables (``close()`` on exit
    and on ``dispose()``). Use one provider per
    process and store; leases from it may be used from any thread or task.

    Threads of one provider, whatever the number of waiters (each started on first use):

    * up to 4 workers for the waiters' store round trips (``rxcoord-<backend>-lease-wait``;
      waiters of one name share one round trip at a time, so a release costs one round trip
      per provider, not one per waiter); they run no user code;
    * up to 2 background workers for keep-alive renewals and cleanups
      (``rxcoord-<backend>-leases``): renewals must not run on the shared timer thread;
    * PostgreSQL and Redis: one listener thread owning the notification connection;
    * while a subscriber's code runs (``acquire_rx``'s ``on_next``, ``run``'s job) without a
      ``scheduler``: a thread of its own for that delivery, gone when it returns; likewise for
      ``run``'s release (and the notifications after it) when the job's work ended on an event
      loop, which a store round trip must not block.

    Timeouts, expiry wake-ups, poll backoff and renewals are entries on rxcoord's one shared
    timer thread. Blocking ``acquire``/``lock`` park the caller's own thread.
    """

    backend: str = "abstract"
    # Seconds one round trip to the store may take (None: unbounded, a local store). Also the
    # most close() waits for background work and for releasing the leases still held.
    _op_timeout: float | None = None
    #: The longest name this backend stores, in bytes of UTF-8 (checked at every call).
    max_name_bytes: int = MAX_NAME_BYTES
    #: The longest ``at_most_for``/``at_least_for`` in seconds (checked at every call).
    max_duration: float = MAX_DURATION

    def __init__(self, hub: WaitHub, *, poll: tuple[float, float]) -> None:
        """Set up the shared machinery.

        Args:
            hub: Where waiters register; fed by the backend's notifications.
            poll: (first, max) polling interval in seconds, used while the hub cannot
                guarantee a wake-up on release.
        """
        self._hub = hub
        self._lock = threading.Lock()
        self._state: ProviderState = _OPEN
        # Weak: a lease its holder dropped without releasing it must be collectable, so that its
        # keep-alive stops and the name frees by at_most_for (see DistributedLease).
        self._held: weakref.WeakSet[DistributedLease] = weakref.WeakSet()
        self._background = Background(f"rxcoord-{self.backend}-leases")
        # rxcoord.lease.wait and rxcoord.leases.lost; rxcoord.leases.held is read from _held.
        self._telemetry = telemetry.leases(self.backend)
        # Waiting: name queues, timers on the shared timer thread, and a bounded worker pool
        # for the waiters' round trips (see _waiting.py). No thread per waiter.
        self._waits = Waits(self, poll)
        self._deliver_name = f"rxcoord-{self.backend}-lease-deliver"
        self._granted = 0
        self._busy = 0
        self._released = 0
        self._extended = 0
        self._lost = 0
        self._store_errors = 0
        self._telemetry.observe_held(self, LeaseProvider._held_count)

    # -- primitives (one round trip each, atomic on the store) ---------------------------------

    @abstractmethod
    def _store_try_grant(
        self, name: str, at_most_for: float, at_least_for: float
    ) -> tuple[int, float]:
        """Grant ``name`` if free; ``(token, 0.0)`` or ``(0, seconds until it expires)``.

        Raises:
            LeaseStoreUnavailable: The store failed; the driver error is the ``__cause__``.
        """

    @abstractmethod
    def _store_extend(
        self, name: str, token: int, at_most_for: float, *, timeout: float | None = None
    ) -> bool:
        """Extend the grant (name, token) if unexpired and unreleased; False otherwise.

        ``timeout`` caps the round trip below the backend's own limit (keep-alive passes the
        time the lease has left); a store that does not answer in time raises
        ``LeaseStoreUnavailable``.
        """

    @abstractmethod
    def _store_release(
        self, name: str, token: int, *, timeout: float | None = None, kept: bool = True
    ) -> bool:
        """Release the grant (name, token) if unexpired and unreleased; False otherwise.

        ``kept=False`` promises the grant had no ``at_least_for`` (so nothing is kept after the
        release); a backend may then use a simpler statement. The default is always correct.
        """

    @abstractmethod
    def _store_holder(self, name: str) -> tuple[int, float, bool] | None:
        """The store's current grant of ``name``: ``(token, remaining, released)`` or None.

        One round trip. ``remaining`` is by the store's clock; ``released`` is True for a grant
        released early that still keeps the name taken (``at_least_for``).

        Raises:
            LeaseStoreUnavailable, LeaseStoreMisconfigured: As the other primitives.
        """

    @abstractmethod
    def _store_close(self) -> None:
        """Close connections; must not raise."""

    @abstractmethod
    def _store_list(self) -> StoreListing:
        """Everything the store holds right now, read-only (``rxcoord inspect``; ``_listing.py``).

        Writes nothing, creates no table or key and sweeps nothing: a store the provider never
        set up lists empty. Every lease and group in the store (this provider's namespace:
        its table or prefix), whoever holds it.

        Raises:
            LeaseStoreUnavailable, LeaseStoreMisconfigured: As the other primitives.
        """

    # -- fleet permits (see _permits.py): a backend offers them by overriding all three ----------

    def _permits_acquire(
        self,
        group: str,
        tenant: str,
        want: int,
        weight: float,
        tenant_limit: int,
        limit: int,
        most: float,
        demand_for: float,
        more: bool,
        *,
        rate: RateArgs | None = None,
        tenant_rate: RateArgs | None = None,
    ) -> PermitReply:
        """The permit table's ``acquire`` step (``_permits.py``), one round trip.

        Raises:
            LeaseStoreUnavailable, LeaseStoreMisconfigured: As the lease primitives.
        """
        raise TypeError(f"{type(self).__name__} does not keep fleet permits")

    def _permits_release(
        self, group: str, permits: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> int:
        """The ``release`` step: how many of ``(token, tenant)`` were still held; notifies."""
        raise TypeError(f"{type(self).__name__} does not keep fleet permits")

    def _permits_extend(
        self,
        group: str,
        permits: Sequence[tuple[int, str]],
        most: float,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        """The ``extend`` step: the tokens of ``permits`` no longer held."""
        raise TypeError(f"{type(self).__name__} does not keep fleet permits")

    def _describe(self) -> str:
        return ""

    def __repr__(self) -> str:
        where = self._describe()
        return f"<{type(self).__name__} {where + ' ' if where else ''}{self._state}>"

    # -- acquiring ----------------------------------------------------------------------------

    def try_acquire(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        keep_alive: bool = False,
    ) -> DistributedLease | None:
        """Take the lease if it is free right now; one round trip, never waits.

        Args:
            name: The lease name: a non-empty str of at most ``max_name_bytes`` bytes of UTF-8,
                without NUL.
            at_most_for: Seconds until the lease expires unless extended (> 0).
            at_least_for: Seconds after the grant the name stays taken even if released early
                (0 <= at_least_for <= at_most_for).
            keep_alive: Renew the lease in the background (see ``start_keep_alive``).

        Returns:
            The lease, or None if another holder has it.

        Raises:
            TypeError: An argument of the wrong type (a name that is not a str, a duration
                that is not a number).
            ValueError: Bad arguments (empty name, ``at_most_for <= 0``, ``at_least_for >
                at_most_for``...), refused before any round trip.
            LeaseStoreUnavailable: The store could not be reached (an outage: retry later).
            LeaseStoreMisconfigured: The store refused for good (credentials, permissions, a
                database it does not have: the message names the fix; retrying will not help).
            LeaseProviderClosed: The provider was closed.
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        begun = self._telemetry.begin()
        try:
            result = self._attempt(name, most, least)
        except Exception:
            self._telemetry.waited(begun, "failed")
            raise
        if type(result) is float:
            self._telemetry.waited(begun, "taken")
            return None
        self._telemetry.waited(begun, "acquired")
        assert isinstance(result, DistributedLease)
        if keep_alive:
            result.start_keep_alive()
        return result

    def acquire(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        timeout: float | None = None,
        keep_alive: bool = False,
    ) -> DistributedLease:
        """Take the lease, waiting while another holder has it.

        Waits without polling where the store can notify (PostgreSQL, Redis): the waiter wakes
        when the holder releases, or when the holder's lease expires by the store's clock. Not
        reentrant: a holder that acquires its own name again waits for itself.

        Args:
            name: The lease name, as for :meth:`try_acquire`.
            at_most_for: As for :meth:`try_acquire`.
            at_least_for: As for :meth:`try_acquire`.
            keep_alive: As for :meth:`try_acquire`.
            timeout: Most seconds to wait; None waits as long as it takes, 0 tries once.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            TypeError: An argument of the wrong type (as :meth:`try_acquire`; ``timeout`` too).
            ValueError: Bad arguments (as :meth:`try_acquire`; a negative ``timeout`` too).
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (the message names the fix).
            LeaseProviderClosed: The provider was closed (also while waiting).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait = check_wait(timeout)
        deadline = None if wait is None else monotonic() + wait
        begun = self._telemetry.begin()
        # The first attempt on the caller's thread: the uncontended path is one round trip.
        try:
            result = self._attempt(name, most, least)
        except Exception:
            self._telemetry.waited(begun, "failed")
            raise
        if isinstance(result, float):
            if wait == 0:
                self._telemetry.waited(begun, "timed_out")
                raise self._timeout_error(name, wait)
            # Then the one waiting state machine (see _waiting.py), this thread parked until
            # the wait's Waiter is granted: its own deadline timer, not this thread, ends it
            # with LockTimeout. Interrupted (KeyboardInterrupt), nothing stays granted. The
            # wait records its outcome (rxcoord.lease.wait) from ``begun``.
            pending = self._waits.new(name, most, least, wait, deadline=deadline, begun=begun)
            result = _lease_or_raise(self._waits.wait_blocking(pending, result))
        else:
            self._telemetry.waited(begun, "acquired")
        if keep_alive:
            _start_keep_alive(result)
        return result

    @contextmanager
    def lock(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        timeout: float | None = None,
        keep_alive: bool = False,
    ) -> Iterator[DistributedLease]:
        """Hold the lease for the duration of a ``with`` block.

        On a normal exit the lease is released, and :class:`LeaseLost` is raised if it had
        been lost meanwhile (the block's work may overlap a newer holder's). If the block
        raises, that exception propagates and a failing release is only logged.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            TypeError: An argument of the wrong type.
            ValueError: Bad arguments.
            LeaseStoreUnavailable: The store could not be reached (when acquiring, or when
                releasing on a normal exit).
            LeaseStoreMisconfigured: The store refused for good.
            LeaseProviderClosed: The provider was closed.
            LeaseLost: On a normal exit, the lease had been lost before it could be released
                (the block's work may overlap a newer holder's).
        """
        lease = self.acquire(
            name, at_most_for, at_least_for, timeout=timeout, keep_alive=keep_alive
        )
        with lease:
            yield lease

    # -- the store's view -----------------------------------------------------------------------

    def holder(self, name: str) -> LeaseHolder | None:
        """Ask the store who holds ``name`` right now: None, or its current grant.

        One round trip; the answer is the store's (token, and time left by the store's clock),
        not this process's bookkeeping, so it sees grants made by other processes and expiries
        this process has not noticed. It is a snapshot: the grant may end right after.

        Raises:
            TypeError: ``name`` is not a str (checked before the round trip).
            ValueError: ``name`` is empty or too long for the store (likewise).
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (see the message).
            LeaseProviderClosed: The provider was closed.
        """
        self._check_name(name)
        return self._holder_of(name)

    async def holder_async(self, name: str) -> LeaseHolder | None:
        """:meth:`holder` for asyncio; the round trip runs on the provider's workers.

        Raises:
            TypeError: ``name`` is not a str (checked before the round trip).
            ValueError: ``name`` is empty or too long for the store (likewise).
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (see the message).
            LeaseProviderClosed: The provider was closed.
        """
        self._check_name(name)
        return await self._waits.call_async(lambda: self._holder_of(name))

    def _holder_of(self, name: str) -> LeaseHolder | None:
        self._check_open()
        try:
            found = self._store_holder(name)
        except LeaseStoreUnavailable:
            with self._lock:
                self._store_errors += 1
            raise
        if found is None:
            return None
        token, remaining, released = found
        return LeaseHolder(name, token, max(0.0, remaining), released)

    def _check_name(self, name: object) -> None:
        check_lease_name(name, self.max_name_bytes, type(self).__name__)

    def _check_lease_args(
        self, name: object, at_most_for: object, at_least_for: object
    ) -> tuple[float, float]:
        """check_lease_args with this backend's limits (every public call goes through it)."""
        return check_lease_args(
            name,
            at_most_for,
            at_least_for,
            max_name_bytes=self.max_name_bytes,
            max_duration=self.max_duration,
            backend=type(self).__name__,
        )

    # -- reactive forms -----------------------------------------------------------------------

    @overload
    def run(
        self,
        name: str,
        job: Callable[[], Work[_R]],
        *,
        at_most_for: float = ...,
        at_least_for: float = ...,
        wait: bool = ...,
        timeout: float | None = ...,
        keep_alive: bool = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        name: str,
        job: Callable[[DistributedLease], Work[_R]],
        *,
        at_most_for: float = ...,
        at_least_for: float = ...,
        wait: bool = ...,
        timeout: float | None = ...,
        keep_alive: bool = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        name: str,
        job: Callable[[], _R],
        *,
        at_most_for: float = ...,
        at_least_for: float = ...,
        wait: bool = ...,
        timeout: float | None = ...,
        keep_alive: bool = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    @overload
    def run(
        self,
        name: str,
        job: Callable[[DistributedLease], _R],
        *,
        at_most_for: float = ...,
        at_least_for: float = ...,
        wait: bool = ...,
        timeout: float | None = ...,
        keep_alive: bool = ...,
        scheduler: abc.SchedulerBase | None = ...,
    ) -> Observable[_R]: ...
    def run(
        self,
        name: str,
        job: Callable[..., Any],
        *,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        wait: bool = False,
        timeout: float | None = None,
        keep_alive: bool = False,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[Any]:
        """Run ``job`` only while holding the lease: ShedLock's executor, as an Observable.

        On subscription the lease is taken (the store's round trips on the provider's worker
        threads, or the first one on ``scheduler`` if given; waiting parks no thread), then
        ``job`` is called with the lease on ``scheduler``, by default on a thread started for
        the job alone (never on the provider's workers, which a long job would starve, nor on
        the timer thread or an event loop). It is called as ``job(lease)`` - the fencing token
        is ``lease.token`` - or as ``job()``: one callable without arguments is called so, one
        that needs exactly one positional argument gets the lease (decided once, here, from its
        signature, as ``KeyedLocks.run`` decides). What ``job`` returns is run to its real end
        *under the lease*, the lease is released, and the Observable emits:

        * a plain value - the value, then completion;
        * a coroutine (``job`` is an ``async def``, or returns one), an asyncio future or any
          other awaitable - run on the event loop that was running when ``run``'s Observable
          was subscribed (``await provider.run(...)``: the awaiting loop); its result, then
          completion. Without a running loop it is a ``TypeError`` to ``on_error``;
        * a ``concurrent.futures.Future`` (say, from ``executor.submit``) - its result, then
          completion;
        * an Observable - subscribed at once; its items are forwarded while the lease is held,
          and the lease is released before its completion (or error) is forwarded.

        ::

            free:   --(result)|
            taken:  --|                  wait=False: skipped, completes empty
            taken:  ------(result)|      wait=True: runs once the lease is free

        The release is a store round trip: when the work ended on an event loop's thread (a
        coroutine's task, an Observable completing there), the release and what follows it run
        on a thread started for them, never blocking the loop.

        Errors: ``job``'s exception or its work's (the lease is released first);
        :class:`LeaseLost` instead of the completion if the lease was lost before the work
        ended (its work may overlap a newer holder's; an Observable's items already emitted
        stay emitted); ``LockTimeout`` when waiting past ``timeout``;
        ``LeaseStoreUnavailable``. Disposing the subscription cancels a pending wait, or
        disposes/cancels the work and releases the lease once that work has ended: a
        cancelled coroutine keeps the lease until its cleanup has finished, a running
        executor job that refuses ``cancel()`` until it is done; a running synchronous job is
        not interrupted (check ``lease.lost`` or use ``keep_alive``), but its result is
        dropped. ``await provider.run(...)`` calls the job on a thread of its own (or on
        ``scheduler``, if given: not the awaiting loop's, which the job would block) and
        returns the result; skipped (``wait=False``), it raises
        ``SequenceContainsNoElementsError``, as awaiting any empty Observable does.

        Raises:
            TypeError: ``job`` can be called neither as ``job()`` nor as ``job(lease)``, or
                an argument has the wrong type (raised here, not on subscription).
            ValueError: Bad arguments (raised here, not on subscription).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait_for = check_wait(timeout)
        pass_lease = job_takes_lease(job)  # once per call, not per subscription

        def subscribe(
            observer: abc.ObserverBase[Any], scheduler_: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            pending = self._waits.new(
                name, most, least, wait_for if wait else 0.0, skip_taken=not wait
            )
            # The job runs in a copy of the subscriber's context (its contextvars: a request
            # id, loguru's contextualize, the current span), whatever thread it runs on.
            sink = _LeaseRun(
                self,
                job,
                pass_lease,
                keep_alive,
                pending,
                observer,
                subscriber_loop(scheduler_),
                contextvars.copy_context(),
            )

            def action() -> None:
                outcome = pending.waiter.take()
                if outcome is None:  # disposed first: whoever cancelled released the lease
                    return
                if isinstance(outcome, Failure):
                    if outcome.error is None:
                        observer.on_completed()  # taken, wait=False: skipped
                    else:
                        observer.on_error(outcome.error)
                    return
                sink.on_lease(outcome)

            self._start_rx(pending, action, scheduler or scheduler_)
            return Disposable(sink.dispose)

        # ``await``: the subscription itself, on a thread of its own (through reactivex, the
        # wait and the job would run on the awaiting loop's thread), its outcome passed to the loop.
        observable: AwaitableObservable[Any] = AwaitableObservable(
            subscribe, lambda: last_value(observable)
        )
        return observable

    async def _try_acquire_or_empty(
        self, name: str, most: float, least: float, keep_alive: bool
    ) -> DistributedLease:
        lease = await self.try_acquire_async(name, most, least, keep_alive=keep_alive)
        if lease is None:  # what awaiting an Observable that completed empty raises
            raise SequenceContainsNoElementsError(f"lease {name!r} is taken (wait=False)")
        return lease

    def acquire_rx(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        wait: bool = True,
        timeout: float | None = None,
        keep_alive: bool = False,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[DistributedLease]:
        """The lease as an Observable: emits it once granted, then completes.

        The subscriber owns the emitted lease and must release it (for instance in
        ``ops.finally_action``). With ``wait=False`` it completes empty when the name is
        taken. Waiting parks no thread: the grant arrives through the wait's
        :class:`~rxcoord._core.waiter.Waiter`, and is emitted on ``scheduler`` if given (the
        first attempt runs there too), otherwise on a thread started for the delivery alone
        (so a subscriber that works inside ``on_next`` holds no provider thread). Disposing
        before the delivery takes the lease from the Waiter cancels the wait, and a lease
        granted meanwhile is released; once taken, the lease is passed to the subscriber's own
        ``on_next`` even if a disposal from another thread overlaps (a disposed observer would
        drop it), so the lease is released or the subscriber's, never dropped. A disposal from
        the emitting thread itself (``take(1)``, ``first()``) leaves it to the subscriber. If
        ``on_next`` raises, the lease is released and the error reported. Errors as
        :meth:`acquire`. ``await provider.acquire_rx(...)`` is :meth:`acquire_async` (with
        ``wait=False``: :meth:`try_acquire_async`, raising ``SequenceContainsNoElementsError``
        when taken, as awaiting any empty Observable does).

        Raises:
            TypeError: An argument of the wrong type (raised here, not on subscription).
            ValueError: Bad arguments (raised here, not on subscription).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait_for = check_wait(timeout)

        def subscribe(
            observer: abc.ObserverBase[DistributedLease],
            scheduler_: abc.SchedulerBase | None = None,
        ) -> abc.DisposableBase:
            pending = self._waits.new(
                name, most, least, wait_for if wait else 0.0, skip_taken=not wait
            )
            on_next = _wrapped_on_next(observer)

            def action() -> None:
                outcome = pending.waiter.take()
                if outcome is None:  # disposed first: whoever cancelled released the lease
                    return
                if isinstance(outcome, Failure):
                    if outcome.error is None:
                        observer.on_completed()  # taken, wait=False
                    else:
                        observer.on_error(outcome.error)
                    return
                # Taken from the Waiter: the lease is the subscriber's from here, and goes to
                # its callback even if a disposal is under way (the observer would drop it).
                lease = outcome
                try:
                    if keep_alive:
                        _start_keep_alive(lease)
                    on_next(lease)
                except Exception as exc:
                    # Nobody can be relied on to release it: release it (a later release by
                    # the subscriber raises, loudly) and report.
                    lease._release_quietly()
                    observer.on_error(exc)
                    return
                except BaseException:  # interrupted: same reasoning, no on_error
                    lease._release_quietly()
                    raise
                observer.on_completed()

            return self._start_rx(pending, action, scheduler or scheduler_)

        # ``await``: acquire_async (through reactivex, the wait would block the awaiting loop, and
        # a task cancelled after the grant would drop the lease).
        if wait:
            return AwaitableObservable(
                subscribe,
                lambda: self.acquire_async(
                    name, most, least, timeout=wait_for, keep_alive=keep_alive
                ),
            )
        return AwaitableObservable(
            subscribe, lambda: self._try_acquire_or_empty(name, most, least, keep_alive)
        )

    # -- asyncio forms ------------------------------------------------------------------------

    async def try_acquire_async(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        keep_alive: bool = False,
    ) -> DistributedLease | None:
        """:meth:`try_acquire` for asyncio; the round trip runs on the provider's workers.

        Cancelling the task while the round trip is in flight releases a lease it grants.

        Raises:
            TypeError: An argument of the wrong type.
            ValueError: Bad arguments.
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (the message names the fix).
            LeaseProviderClosed: The provider was closed.
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        pending = self._waits.new(name, most, least, 0.0, skip_taken=True)
        lease = await self._wait_async(pending)
        if lease is not None and keep_alive:
            _start_keep_alive(lease)
        return lease

    async def acquire_async(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (bounds the wait, as in acquire())
        keep_alive: bool = False,
    ) -> DistributedLease:
        """:meth:`acquire` for asyncio: the task awaits, round trips on the provider's workers.

        No thread is parked for the wait (see :meth:`acquire_rx`). Cancelling the task cancels
        the wait; a grant that was in flight at that moment is released in the background,
        never leaked.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            TypeError: An argument of the wrong type.
            ValueError: Bad arguments.
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (the message names the fix).
            LeaseProviderClosed: The provider was closed (also while waiting).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait = check_wait(timeout)
        lease = await self._wait_async(self._waits.new(name, most, least, wait))
        assert lease is not None  # a taken name raised LockTimeout
        if keep_alive:
            _start_keep_alive(lease)
        return lease

    async def _wait_async(self, pending: LeaseWait) -> DistributedLease | None:
        self._waits.start(pending)
        try:
            outcome = await pending.waiter.wait_async()
        except BaseException:  # the Waiter is cancelled: a grant racing with this is released
            self._waits.withdraw(pending)
            raise
        if isinstance(outcome, Failure) and outcome.error is None:
            return None  # taken, and not waiting
        return _lease_or_raise(outcome)

    @asynccontextmanager
    async def lock_async(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (bounds the wait, as in lock())
        keep_alive: bool = False,
    ) -> AsyncIterator[DistributedLease]:
        """:meth:`lock` for asyncio: ``async with provider.lock_async(name) as lease: ...``.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            TypeError: An argument of the wrong type.
            ValueError: Bad arguments.
            LeaseStoreUnavailable: The store could not be reached (when acquiring, or when
                releasing on a normal exit).
            LeaseStoreMisconfigured: The store refused for good.
            LeaseProviderClosed: The provider was closed.
            LeaseLost: On a normal exit, the lease had been lost before it could be released.
        """
        lease = await self.acquire_async(
            name, at_most_for, at_least_for, timeout=timeout, keep_alive=keep_alive
        )
        try:
            yield lease
        except BaseException:
            await self._waits.call_async(lease._release_quietly)
            raise
        if lease.held or lease.lost:
            await lease.release_async()

    # -- lifecycle and statistics -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._state is not _OPEN

    def close(self) -> None:
        """Release the leases still held, wake waiters, close connections. Idempotent.

        Waiters fail with :class:`LeaseProviderClosed`; later calls raise it too. A
        ``release()`` in flight on another thread is waited for; if it fails because of the
        close, the lease is released here. With a server that does not answer (PostgreSQL,
        Redis), close() spends about the provider's ``timeout`` on background work and
        releases together; leases it could not release become lost and expire on their own.
        """
        with self._lock:
            if self._state is not _OPEN:
                return
            self._state = _CLOSING
            held = list(self._held)
        # A store that stopped answering must not make close() hang: background work and the
        # releases below share one budget; what does not fit is left to expire on its own.
        budget = self._op_timeout
        deadline = None if budget is None else monotonic() + budget
        self._waits.close()  # waiters fail with LeaseProviderClosed
        self._hub.close()
        self._background.close(grace=budget)
        for lease in held:
            self._release_for_close(lease, None if deadline is None else deadline - monotonic())
        self._store_close()
        with self._lock:
            self._state = _CLOSED

    def stats(self) -> LeaseProviderStats:
        """A snapshot of the provider's state and counters."""
        notifications, reconnects = self._listener_counts()
        with self._lock:
            return LeaseProviderStats(
                backend=self.backend,
                state=self._state,
                held=len(self._held),
                waiting=self._waits.waiting(),
                keep_alive=self._background.active(),
                granted=self._granted,
                busy=self._busy,
                released=self._released,
                extended=self._extended,
                lost=self._lost,
                store_errors=self._store_errors,
                notifications=notifications,
                reconnects=reconnects,
            )

    def _listener_counts(self) -> tuple[int, int]:
        return 0, 0

    def _held_count(self) -> int:
        """Leases held through this provider (``rxcoord.leases.held``, read at collection)."""
        with self._lock:
            return len(self._held)

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _OPEN:
            raise LeaseProviderClosed(
                f"{type(self).__name__} is closed: it grants, extends and releases no leases; "
                "open a new provider"
            )

    def _timeout_error(self, name: str, timeout: float | None) -> LockTimeout:
        return LockTimeout(
            f"lease {name!r} was not granted within {timeout}s: another holder has it"
        )

    def _attempt(self, name: str, most: float, least: float) -> DistributedLease | float:
        """One grant attempt: the lease, or seconds until the current holder's lease expires."""
        if self._state is not _OPEN:
            self._check_open()
        sent = monotonic()
        try:
            token, remaining = self._store_try_grant(name, most, least)
        except LeaseStoreUnavailable:
            with self._lock:
                self._store_errors += 1
            raise
        if not token:
            with self._lock:
                self._busy += 1
            return remaining
        lease = DistributedLease(self, name, token, most, least, sent)
        with self._lock:
            is_open = self._state is _OPEN
            if is_open:
                self._held.add(lease)
                self._granted += 1
        if not is_open:  # closed while the grant was in flight: give it back
            self._release_for_close(lease, self._op_timeout)
            self._check_open()
        return lease

    def _start_rx(
        self,
        pending: LeaseWait,
        action: Callable[[], None],
        scheduler: abc.SchedulerBase | None,
    ) -> abc.DisposableBase:
        """Start a subscription's wait; ``action`` takes the outcome from the Waiter.

        ``action`` runs on ``scheduler`` if given, else on a thread started for it alone: it
        runs the subscriber's code (``on_next``, the job), which must neither hold one of the
        provider's few workers nor run on the thread that decided the grant (a worker, the
        timer thread, a closing thread). The thread exists only while ``action`` runs: a
        waiting subscription has none.
        """

        def scheduled(_: abc.SchedulerBase, __: object = None) -> None:
            action()

        def first(_: abc.SchedulerBase, __: object = None) -> None:
            self._waits.first_attempt(pending)

        def deliver() -> None:
            try:
                if scheduler is not None:
                    scheduler.schedule(scheduled)
                else:
                    threading.Thread(target=action, name=self._deliver_name, daemon=True).start()
            except Exception:  # nowhere to run it: the outcome reaches nobody, so release it
                logger.opt(exception=True).error(
                    "rxcoord lease {!r}: could not deliver the outcome", pending.name
                )
                self._waits.leave(pending)
                outcome = pending.waiter.take()
                if isinstance(outcome, DistributedLease):
                    outcome._release_quietly()

        pending.waiter.bind(deliver)
        if scheduler is None:
            self._waits.start(pending)
        else:
            scheduler.schedule(first)
        return Disposable(lambda: self._waits.leave(pending))

    def _extend_lease(
        self, lease: DistributedLease, most: float, *, timeout: float | None = None
    ) -> bool:
        self._check_open()
        try:
            ok = self._store_extend(lease.name, lease.token, most, timeout=timeout)
        except LeaseStoreUnavailable:
            with self._lock:
                self._store_errors += 1
            raise
        if ok:
            with self._lock:
                self._extended += 1
        return ok

    def _release_lease(self, lease: DistributedLease) -> bool:
        self._check_open()
        try:
            return self._store_release(lease.name, lease.token, kept=lease.at_least_for > 0)
        except LeaseStoreUnavailable:
            with self._lock:
                self._store_errors += 1
            raise

    def _lease_ended(self, lease: DistributedLease, *, lost: bool) -> None:
        with self._lock:
            self._held.discard(lease)
            if lost:
                self._lost += 1
            else:
                self._released += 1
        if lost:
            self._telemetry.lost()

    def _forget_quietly(self, lease: DistributedLease) -> None:
        """Best effort for a lease known lost: free it if the store still has it as ours."""
        with suppress(LeaseStoreUnavailable):
            self._store_release(lease.name, lease.token)

    def _release_for_close(self, lease: DistributedLease, timeout: float | None) -> None:
        lease._release_on_close(timeout)


def _lease_or_raise(outcome: Outcome) -> DistributedLease:
    if isinstance(outcome, Failure):
        assert outcome.error is not None
        raise outcome.error
    return outcome


def _start_keep_alive(lease: DistributedLease) -> None:
    """Start keep-alive; if that fails (the provider closed), release instead of leaking."""
    try:
        lease.start_keep_alive()
    except BaseException:
        lease._release_quietly()
        raise


def _wrapped_on_next(observer: abc.ObserverBase[Any]) -> Callable[[Any], None]:
    # AutoDetachObserver.on_next drops the item once dispose() has begun; for a lease taken
    # from its Waiter that would mean a lease nobody releases. Call the wrapped callback so a
    # lease racing with disposal still reaches the subscriber (as rxcoord._locks does).
    wrapped = getattr(observer, "_on_next", None)
    if type(observer) is AutoDetachObserver and callable(wrapped):
        return wrapped  # type: ignore[no-any-return]
    return observer.on_next


class _LeaseRun(JobRun):
    """One subscription to ``run``: call the job under the lease, run its work, release, forward.

    The work is run to its end by :class:`~rxcoord._core.jobs.JobRun` (the contract shared
    with ``KeyedLocks.run``); this adds the distributed lease: keep-alive, the release (a
    store round trip, kept off event loops) that turns a success into :class:`LeaseLost` if
    the lease was lost meanwhile, and disposal. The job itself (and the subscription to the
    Observable it returned) cannot be stopped: disposed meanwhile, ``on_lease`` releases the
    lease when it returns.
    """

    __slots__ = (
        "context",
        "job",
        "keep_alive",
        "lease",
        "lock",
        "pass_lease",
        "pending",
        "provider",
        "running",
    )

    no_loop_message = (
        "the job returned an awaitable but run() was not subscribed on a running event loop; "
        "subscribe (or await) it from a coroutine, or use lock_async"
    )

    def __init__(
        self,
        provider: LeaseProvider,
        job: Callable[..., Any],
        pass_lease: bool,
        keep_alive: bool,
        pending: LeaseWait,
        observer: abc.ObserverBase[Any],
        loop: asyncio.AbstractEventLoop | None,
        context: contextvars.Context,
    ) -> None:
        super().__init__(observer, loop)
        self.context = context  # the subscriber's, copied: the job and its work run in it
        self.provider = provider
        self.job = job
        self.pass_lease = pass_lease  # job(lease) rather than job() (see job_takes_lease)
        self.keep_alive = keep_alive
        self.pending = pending
        self.lock = threading.Lock()
        self.lease: DistributedLease | None = None
        # The job (or the inner subscribe call) is executing, or the work it started is in
        # flight: whoever ends it releases the lease, not dispose().
        self.running = False

    def on_lease(self, lease: DistributedLease) -> None:
        """The lease, taken from the Waiter (on the delivery thread or ``scheduler``)."""
        with self.lock:
            abandoned = self.done
            if not abandoned:
                self.lease = lease
                self.running = True
        if abandoned:  # disposed since: the job never runs
            lease._release_quietly()
            return
        in_flight = False
        try:
            # In the subscriber's context: the job itself, and what starts its work (a
            # coroutine's task is created in it, so it inherits the context too).
            in_flight = self.context.run(self._start_job, lease)
        finally:
            if not in_flight:
                with self.lock:
                    self.running = False
                    # Disposed while the job ran: dispose() left the lease to us.
                    orphaned = self.done and self.lease is not None
                if orphaned:
                    self._release()

    def _start_job(self, lease: DistributedLease) -> bool:
        """Call the job, start what it returned; True if a done-callback releases the lease."""
        try:
            if self.keep_alive:
                _start_keep_alive(lease)
            result = self.job(lease) if self.pass_lease else self.job()
        except Exception as exc:
            self._terminate(exc)
            return False
        except BaseException as exc:  # SystemExit, a CancelledError from asyncio.run...
            forward, _ = self._claim()
            lease._release_quietly()  # never kept (and kept alive) by a dead job
            if forward:
                failure = RuntimeError(f"the job raised {exc!r}")
                failure.__cause__ = exc
                self.observer.on_error(failure)
            raise
        return self.start(result)

    def _claim(self) -> tuple[bool, DistributedLease | None]:
        """End the run (once): (forward its terminal?, the lease to release or None)."""
        with self.lock:
            forward = not self.done
            self.done = True
            lease, self.lease = self.lease, None
        return forward, lease

    def _off_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a release, then maybe the subscriber's code) here, unless on a loop."""
        if running_loop() is None:
            fn()
            return
        try:
            threading.Thread(target=fn, name=self.provider._deliver_name, daemon=True).start()
        except RuntimeError:  # no thread to be had: better a blocked loop than a held lease
            fn()

    def _release(self) -> bool:
        forward, lease = self._claim()
        if lease is not None:
            self._off_loop(lease._release_quietly)
        return forward

    def _finish_value(self, value: Any) -> None:
        self._end(lambda: (self.observer.on_next(value), self.observer.on_completed()))

    def _completed(self) -> None:
        self._end(self.observer.on_completed)

    def _end(self, success: Callable[[], object]) -> None:
        """The work succeeded: release; forward ``success`` or the error the release found."""
        forward, lease = self._claim()
        if lease is None and not forward:
            return

        def finish() -> None:
            if not forward:  # disposed: nobody to tell
                if lease is not None:
                    lease._release_quietly()
                return
            try:
                if lease is not None and (lease.held or lease.lost):
                    lease.release()  # lost: raises the LeaseLost that explains the loss
            except Exception as exc:
                self.observer.on_error(exc)
                return
            success()

        self._off_loop(finish)

    def _terminate(self, error: Exception) -> None:
        forward, lease = self._claim()
        if lease is None and not forward:
            return

        def finish() -> None:
            if lease is not None:
                lease._release_quietly()
            if forward:
                self.observer.on_error(error)

        self._off_loop(finish)

    def dispose(self) -> None:
        if self.done:  # final once set: the work has ended (or was disposed) and released
            return
        self.provider._waits.leave(self.pending)  # cancels the wait if it still waits
        with self.lock:
            self.done = True
            lease = None if self.running else self.lease
            if lease is not None:
                self.lease = None
        self.inner.dispose()  # stop the work first, then release the lease
        if lease is not None:
            self._off_loop(lease._release_quietly)
