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

Everything else lives here once: argument validation, the waiting loop, ``lock()``, keep-alive,
``run()`` (ShedLock's executor as an Observable), ``acquire_rx`` and the asyncio forms, the
lifecycle (open -> closing -> closed) and statistics.

The waiting loop never polls a store that can notify. It sleeps until the earliest of: a release
notification for the name, the expiry time the store reported for the current holder (so a
crashed holder's lease is picked up when it lapses, with no notification at all), and the
caller's timeout. Only while the store's subscription is not confirmed yet (or never can be:
SQLite) does it poll, with exponential backoff.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from time import monotonic
from typing import Final, Literal, TypeVar

from loguru import logger
from reactivex import Observable, abc
from reactivex.disposable import CompositeDisposable, Disposable
from reactivex.internal.exceptions import SequenceContainsNoElementsError
from reactivex.scheduler import NewThreadScheduler

from rxcoord._core.futures import AwaitableObservable, last_value
from rxcoord._core.lifecycle import Closeable
from rxcoord._errors import LeaseProviderClosed, LeaseStoreUnavailable, LockTimeout

from ._background import Background
from ._lease import DistributedLease, LeaseHolder
from ._notify import WaitHub, Watch
from ._validate import MAX_DURATION, MAX_NAME_BYTES, check_lease_args, check_timeout

__all__ = ["LeaseProvider", "LeaseProviderStats"]

_R = TypeVar("_R")

_OPEN: Final = "open"
_CLOSING: Final = "closing"
_CLOSED: Final = "closed"
ProviderState = Literal["open", "closing", "closed"]

# Wake this long after the reported expiry, so the store surely sees the lease as expired.
_EXPIRY_SLACK: Final = 0.001


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


class _Cancel:
    """Cancels one waiting acquisition (used when a subscription is disposed).

    It also decides who owns a lease emitted while the subscription is being disposed. Reactive
    observers drop values once disposed (``AutoDetachObserver`` marks itself stopped *before* it
    disposes our subscription, and operators such as ``timeout`` stop forwarding before they
    dispose upstream), so a lease emitted concurrently with a disposal from another thread may
    reach nobody. The rule: the subscriber owns the lease only if the subscription was not
    disposed before the delivery began, nor from another thread before it ended. A disposal on
    the delivering thread itself (``take(1)``, ``first()`` completing downstream) comes after
    the lease was received and leaves it to the subscriber.
    """

    __slots__ = ("_by", "_lock", "_watch", "cancelled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        self._by = 0  # the thread that cancelled first
        self.cancelled = False

    def set(self) -> None:
        with self._lock:  # never held while a lease is delivered: this does not wait for one
            if not self.cancelled:
                self._by = threading.get_ident()
                self.cancelled = True
            watch = self._watch
        if watch is not None:
            watch.fire()

    def begin_delivery(self) -> bool:
        """False if the subscription is already disposed: do not emit, release the lease."""
        return not self.cancelled

    def delivered(self) -> bool:
        """After emitting: False if another thread disposed the subscription meanwhile."""
        return not self.cancelled or self._by == threading.get_ident()

    def bind(self, watch: Watch) -> None:
        with self._lock:
            self._watch = watch
            cancelled = self.cancelled
        if cancelled:
            watch.fire()


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
        self._poll_min, self._poll_max = poll
        self._lock = threading.Lock()
        self._state: ProviderState = _OPEN
        # Weak: a lease its holder dropped without releasing it must be collectable, so that its
        # keep-alive stops and the name frees by at_most_for (see DistributedLease).
        self._held: weakref.WeakSet[DistributedLease] = weakref.WeakSet()
        self._background = Background(f"rxcoord-{self.backend}-leases")
        self._granted = 0
        self._busy = 0
        self._released = 0
        self._extended = 0
        self._lost = 0
        self._store_errors = 0

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
            name: The lease name (non-empty str, at most 1024 characters).
            at_most_for: Seconds until the lease expires unless extended (> 0).
            at_least_for: Seconds after the grant the name stays taken even if released early
                (0 <= at_least_for <= at_most_for).
            keep_alive: Renew the lease in the background (see ``start_keep_alive``).

        Returns:
            The lease, or None if another holder has it.

        Raises:
            ValueError: Bad arguments (empty name, ``at_most_for <= 0``, ``at_least_for >
                at_most_for``...). TypeError for wrong types.
            LeaseStoreUnavailable: The store could not be reached.
            LeaseProviderClosed: The provider was closed.
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        result = self._attempt(name, most, least)
        if type(result) is float:
            return None
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
            name, at_most_for, at_least_for, keep_alive: As for :meth:`try_acquire`.
            timeout: Most seconds to wait; None waits as long as it takes, 0 tries once.

        Raises:
            LockTimeout: Not granted within ``timeout``.
            ValueError: Bad arguments.
            LeaseStoreUnavailable: The store could not be reached.
            LeaseProviderClosed: The provider was closed (also while waiting).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait = check_timeout(timeout)
        lease = self._acquire_blocking(name, most, least, wait, None)
        assert lease is not None
        if keep_alive:
            lease.start_keep_alive()
        return lease

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
            LockTimeout, ValueError, LeaseStoreUnavailable, LeaseProviderClosed: As
                :meth:`acquire`.
            LeaseLost: On exit, if the lease was lost before it could be released.
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
            ValueError, TypeError: Bad name (checked before the round trip).
            LeaseStoreUnavailable: The store could not be reached.
            LeaseStoreMisconfigured: The store refused for good (see the message).
            LeaseProviderClosed: The provider was closed.
        """
        self._check_name(name)
        return self._holder_of(name)

    async def holder_async(self, name: str) -> LeaseHolder | None:
        """:meth:`holder` for asyncio; the round trip runs in a worker thread."""
        self._check_name(name)
        return await asyncio.get_running_loop().run_in_executor(None, self._holder_of, name)

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
        check_lease_args(
            name, 1.0, 0.0, max_name_bytes=self.max_name_bytes, backend=type(self).__name__
        )

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

    def run(
        self,
        name: str,
        job: Callable[[DistributedLease], _R],
        *,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        wait: bool = False,
        timeout: float | None = None,
        keep_alive: bool = False,
        scheduler: abc.SchedulerBase | None = None,
    ) -> Observable[_R]:
        """Run ``job(lease)`` only while holding the lease: ShedLock's executor, as an Observable.

        On subscription the lease is taken on ``scheduler`` (default: a new thread, since
        waiting blocks it), ``job`` runs with the lease, the lease is released, and the result
        is emitted followed by completion::

            free:   --(result)|
            taken:  --|                  wait=False: skipped, completes empty
            taken:  ------(result)|      wait=True: runs once the lease is free

        Errors: ``job``'s exception (the lease is released first); :class:`LeaseLost` if the
        lease was lost before the job ended (its work may overlap a newer holder's);
        ``LockTimeout`` when waiting past ``timeout``; ``LeaseStoreUnavailable``.
        Disposing the subscription cancels a pending wait; a running job is not interrupted
        (check ``lease.lost`` or use ``keep_alive``), but its result is dropped.
        ``await provider.run(...)`` runs it all on a thread of its own (or on ``scheduler``,
        if given: not the awaiting loop's, which the wait would block) and returns the result;
        skipped (``wait=False``), it raises ``SequenceContainsNoElementsError``, as awaiting
        any empty Observable does.

        Raises:
            ValueError: Bad arguments (raised here, not on subscription).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait_for = check_timeout(timeout)

        def subscribe(
            observer: abc.ObserverBase[_R], scheduler_: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            cancel = _Cancel()

            def action(_: abc.SchedulerBase, __: object = None) -> None:
                try:
                    if wait:
                        lease = self._acquire_blocking(name, most, least, wait_for, cancel)
                    else:
                        got = self._attempt(name, most, least)
                        lease = got if isinstance(got, DistributedLease) else None
                    if lease is None:
                        if not cancel.cancelled:
                            observer.on_completed()
                        return
                    if cancel.cancelled:
                        lease._release_quietly()
                        return
                    if keep_alive:
                        lease.start_keep_alive()
                except Exception as exc:
                    observer.on_error(exc)
                    return
                try:
                    result = job(lease)
                except Exception as exc:
                    lease._release_quietly()
                    observer.on_error(exc)
                    return
                except BaseException as exc:  # SystemExit, a CancelledError from asyncio.run...
                    lease._release_quietly()  # never kept (and kept alive) by a dead job
                    failure = RuntimeError(f"the job raised {exc!r}")
                    failure.__cause__ = exc
                    observer.on_error(failure)
                    raise
                try:
                    if lease.held:
                        lease.release()
                    elif lease.lost:
                        lease.release()  # raises the LeaseLost that explains the loss
                except Exception as exc:
                    observer.on_error(exc)
                    return
                observer.on_next(result)
                observer.on_completed()

            chosen = scheduler or scheduler_ or NewThreadScheduler()
            return CompositeDisposable(chosen.schedule(action), Disposable(cancel.set))

        # ``await``: the subscription itself, on a thread of its own (through reactivex, the
        # wait and the job would run on the awaiting loop's thread), its outcome passed to the loop.
        observable: AwaitableObservable[_R] = AwaitableObservable(
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
        taken. Disposing before the grant cancels the wait; a lease granted after disposal is
        released right away, and so is one whose emission is overlapped by a disposal from
        another thread (a disposed observer drops what it is sent, so the lease may have
        reached nobody). A disposal from the emitting thread itself (``take(1)``, ``first()``)
        happens after the lease was received: the subscriber keeps it. Errors as
        :meth:`acquire`. ``await provider.acquire_rx(...)`` is :meth:`acquire_async` (with
        ``wait=False``: :meth:`try_acquire_async`, raising ``SequenceContainsNoElementsError``
        when taken, as awaiting any empty Observable does).

        Raises:
            ValueError: Bad arguments (raised here, not on subscription).
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait_for = check_timeout(timeout)

        def subscribe(
            observer: abc.ObserverBase[DistributedLease],
            scheduler_: abc.SchedulerBase | None = None,
        ) -> abc.DisposableBase:
            cancel = _Cancel()

            def action(_: abc.SchedulerBase, __: object = None) -> None:
                try:
                    lease = self._acquire_blocking(
                        name, most, least, wait_for if wait else 0.0, cancel, raise_timeout=wait
                    )
                    if lease is not None and keep_alive:
                        lease.start_keep_alive()
                except Exception as exc:
                    observer.on_error(exc)
                    return
                if lease is None:
                    if not cancel.cancelled:
                        observer.on_completed()
                    return
                # See _Cancel for who owns a lease emitted while the subscription is disposed.
                if not cancel.begin_delivery():
                    lease._release_quietly()
                    return
                try:
                    observer.on_next(lease)
                finally:
                    delivered = cancel.delivered()
                if not delivered:
                    logger.info(
                        "rxcoord lease {!r}: subscription disposed while the lease was emitted; "
                        "released",
                        name,
                    )
                    lease._release_quietly()
                    return
                observer.on_completed()

            chosen = scheduler or scheduler_ or NewThreadScheduler()
            return CompositeDisposable(chosen.schedule(action), Disposable(cancel.set))

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
        """:meth:`try_acquire` for asyncio; the round trip runs in a worker thread."""
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        result = await self._attempt_async(name, most, least)
        if isinstance(result, float):
            return None
        if keep_alive:
            result.start_keep_alive()
        return result

    async def acquire_async(
        self,
        name: str,
        at_most_for: float = 30.0,
        at_least_for: float = 0.0,
        *,
        timeout: float | None = None,  # noqa: ASYNC109  (bounds the wait, as in acquire())
        keep_alive: bool = False,
    ) -> DistributedLease:
        """:meth:`acquire` for asyncio: waits on the event loop, round trips in worker threads.

        Cancelling the task cancels the wait; a grant that was in flight at that moment is
        released in the background, never leaked.
        """
        most, least = self._check_lease_args(name, at_most_for, at_least_for)
        wait = check_timeout(timeout)
        deadline = None if wait is None else monotonic() + wait
        result = await self._attempt_async(name, most, least)
        if isinstance(result, float) and wait != 0:
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            watch = self._hub.watch(name, lambda: loop.call_soon_threadsafe(wake.set))
            try:
                if watch.confirmed:  # as in _acquire_blocking: no confirmation will wake us
                    result = await self._attempt_async(name, most, least)
                poll = self._poll_min
                while isinstance(result, float):
                    delay, poll = self._next_delay(result, watch, poll, deadline, name, wait)
                    # asyncio.timeout, not wait_for: on 3.11, wait_for can swallow a
                    # cancellation that arrives just as the wake-up does.
                    with suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await wake.wait()
                    wake.clear()
                    result = await self._attempt_async(name, most, least)
            finally:
                watch.close()
        if isinstance(result, float):
            raise self._timeout_error(name, wait)
        if keep_alive:
            result.start_keep_alive()
        return result

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
        """:meth:`lock` for asyncio: ``async with provider.lock_async(name) as lease: ...``."""
        lease = await self.acquire_async(
            name, at_most_for, at_least_for, timeout=timeout, keep_alive=keep_alive
        )
        try:
            yield lease
        except BaseException:
            await asyncio.get_running_loop().run_in_executor(None, lease._release_quietly)
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
                waiting=self._hub.waiting(),
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

    async def _attempt_async(
        self, name: str, most: float, least: float
    ) -> DistributedLease | float:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._attempt, name, most, least)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._release_orphan)
            raise

    def _release_orphan(self, future: asyncio.Future[DistributedLease | float]) -> None:
        # A grant that completed after its waiter was cancelled: nobody will release it.
        if future.cancelled() or future.exception() is not None:
            return
        result = future.result()
        if isinstance(result, DistributedLease):
            self._background.submit(result._release_quietly)

    def _acquire_blocking(
        self,
        name: str,
        most: float,
        least: float,
        timeout: float | None,
        cancel: _Cancel | None,
        *,
        raise_timeout: bool = True,
    ) -> DistributedLease | None:
        """Try, then wait as the module docstring describes; None if cancelled."""
        deadline = None if timeout is None else monotonic() + timeout
        result = self._attempt(name, most, least)
        if not isinstance(result, float):
            return result
        if timeout == 0:
            if raise_timeout:
                raise self._timeout_error(name, timeout)
            return None
        watch = self._hub.watch(name)
        if cancel is not None:
            cancel.bind(watch)
        try:
            if watch.confirmed:
                # Registered on a subscription already in place (another waiter's, or a hub that
                # sees every release): a release between the failed try and the registration
                # woke nobody, and no confirmation will come to make us retry. Retry now.
                result = self._attempt(name, most, least)
                if not isinstance(result, float):
                    return result
            poll = self._poll_min
            while True:
                delay, poll = self._next_delay(result, watch, poll, deadline, name, timeout)
                watch.wait(delay)
                if cancel is not None and cancel.cancelled:
                    return None
                result = self._attempt(name, most, least)
                if not isinstance(result, float):
                    return result
        finally:
            watch.close()

    def _next_delay(
        self,
        remaining: float,
        watch: Watch,
        poll: float,
        deadline: float | None,
        name: str,
        timeout: float | None,
    ) -> tuple[float, float]:
        """How long to sleep before the next attempt, and the next polling interval.

        Raises:
            LockTimeout: The caller's deadline has passed.
        """
        delay = remaining + _EXPIRY_SLACK
        if not watch.confirmed:
            delay = min(delay, poll)
            poll = min(poll * 2, self._poll_max)
        if deadline is not None:
            left = deadline - monotonic()
            if left <= 0:
                raise self._timeout_error(name, timeout)
            delay = min(delay, left)
        return delay, poll

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

    def _forget_quietly(self, lease: DistributedLease) -> None:
        """Best effort for a lease known lost: free it if the store still has it as ours."""
        with suppress(LeaseStoreUnavailable):
            self._store_release(lease.name, lease.token)

    def _release_for_close(self, lease: DistributedLease, timeout: float | None) -> None:
        lease._release_on_close(timeout)
