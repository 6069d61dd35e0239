"""The lease a holder owns: name, fencing token, extend, release, and news of its loss.

Ownership is the grant itself. The store knows a lease by (name, token); this object carries
both, and nothing else identifies the holder: no hostname, thread or ``threading.local``. Any
thread or task holding the object may extend or release it, and no other grant of the same name
(another thread's, another task's, another process's) can be extended or released with it: the
store compares the token.

States: ``held`` -> ``releasing`` -> ``released``, or ``held``/``releasing`` -> ``lost``. A
failed round trip (store unavailable) returns ``releasing`` to ``held`` so the holder can retry.
``lost`` means the store refused the token (expired, taken over) or keep-alive could not renew
before the local conservative estimate of the expiry passed.

The local expiry estimate is ``monotonic time before the request + at_most_for``: the store
started the lease *after* the request left, by its own clock, so the estimate errs on the early
side and never compares two machines' wall clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from loguru import logger
from reactivex import Observable, abc
from reactivex.disposable import Disposable

from rxcoord._errors import (
    LeaseError,
    LeaseLost,
    LeaseProviderClosed,
    LeaseReleasedError,
    LeaseStoreMisconfigured,
    LeaseStoreUnavailable,
)

from .._core.checks import check_length

if TYPE_CHECKING:
    from ._base import LeaseProvider

__all__ = ["DistributedLease", "LeaseHolder", "LeaseStats"]

_HELD: Final = "held"
_RELEASING: Final = "releasing"
_RELEASED: Final = "released"
_LOST: Final = "lost"
_MIN_RETRY: Final = 0.005  # seconds between renewal retries when the store is unavailable

LeaseState = Literal["held", "releasing", "released", "lost"]


@dataclass(frozen=True, slots=True)
class LeaseStats:
    """A snapshot of one :class:`DistributedLease`.

    Attributes:
        name: The lease name.
        token: The fencing token of this grant.
        state: ``"held"``, ``"releasing"``, ``"released"`` or ``"lost"``.
        keep_alive: Whether background renewal is running.
        extensions: Successful extensions (by ``extend`` or keep-alive).
        expires_in: Seconds left by the local, conservative estimate (<= 0: may have expired).
    """

    name: str
    token: int
    state: LeaseState
    keep_alive: bool
    extensions: int
    expires_in: float


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """The store's current grant of a name, as :meth:`LeaseProvider.holder` read it.

    Attributes:
        name: The lease name.
        token: The fencing token of the current grant.
        remaining: Seconds until the grant expires, by the store's clock, when it was read.
        released: True if the holder released it early and the name is only kept taken by
            ``at_least_for``: nobody works under it any more, but it is not free yet.
    """

    name: str
    token: int
    remaining: float
    released: bool


class _Renewal:
    """What keep-alive holds of a lease: a weak reference, so a dropped lease stops renewing.

    The provider's background timers keep their tasks alive; if they held the lease itself, a
    lease dropped without release would be renewed until the provider closed, keeping its name
    for the process's lifetime. Through this handle the next renewal finds the lease gone, logs
    a warning naming it, and stops: the name frees by ``at_most_for`` after the last renewal.
    """

    __slots__ = ("__weakref__", "_lease", "name", "token")

    def __init__(self, lease: DistributedLease) -> None:
        self._lease = weakref.ref(lease)
        self.name = lease.name
        self.token = lease.token

    def _keep_alive_tick(self) -> float | None:
        lease = self._lease()
        if lease is None:
            logger.warning(
                "rxcoord lease {!r} (token {}) was dropped without release(): keep-alive "
                "stopped, the name frees when the lease expires; release leases, or hold them "
                "with `with provider.lock(...)`",
                self.name,
                self.token,
            )
            return None
        return lease._keep_alive_tick()


_LostCallback = Callable[[LeaseLost], object]
_EndCallback = Callable[[], object]


class DistributedLease:
    """A granted lease. Obtain one from a provider; release it exactly once.

    Attributes:
        name: The lease name.
        token: The fencing token, strictly larger than every earlier grant's of this name.
        at_most_for: The current lease duration (seconds); ``extend`` may change it.
        at_least_for: How long after the grant the name stays taken even if released.
    """

    __slots__ = (
        "__weakref__",
        "_expires",
        "_extensions",
        "_keep_alive",
        "_lock",
        "_lost_error",
        "_observers",
        "_provider",
        "_renewal",
        "_settled",
        "_state",
        "at_least_for",
        "at_most_for",
        "name",
        "token",
    )

    def __init__(
        self,
        provider: LeaseProvider,
        name: str,
        token: int,
        at_most_for: float,
        at_least_for: float,
        sent_at: float,
    ) -> None:
        self._provider = provider
        self.name = name
        self.token = token
        self.at_most_for = at_most_for
        self.at_least_for = at_least_for
        self._lock = threading.Lock()
        self._state: LeaseState = _HELD
        self._expires = sent_at + at_most_for
        self._extensions = 0
        self._keep_alive = False
        self._lost_error: LeaseLost | None = None
        self._observers: list[tuple[_LostCallback, _EndCallback | None]] | None = None
        # Set when the lease leaves ``releasing``; created only when a closing provider has to
        # wait for a release in flight (see _release_on_close).
        self._settled: threading.Event | None = None
        self._renewal: _Renewal | None = None  # created when keep-alive first starts

    def __repr__(self) -> str:
        return (
            f"<DistributedLease {self.name!r} token={self.token} {self._state} "
            f"via {type(self._provider).__name__}>"
        )

    # -- state --------------------------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        """``"held"``, ``"releasing"``, ``"released"`` or ``"lost"``."""
        return self._state

    @property
    def held(self) -> bool:
        """True until the lease is released or known to be lost: this process's local view.

        It is not asked of the store: after a long pause the lease may have expired there and
        been granted to another process while this still reads True. :meth:`verify` asks the
        store (one round trip); a resource should check the fencing token.
        """
        return self._state is _HELD

    @property
    def lost(self) -> bool:
        """True once the lease is known to be no longer ours (see :class:`LeaseLost`)."""
        return self._state is _LOST

    @property
    def released(self) -> bool:
        """True once a release was decided (``release()`` called, its round trip in flight or
        done); False again only if that round trip failed and the lease is held again."""
        return self._state is _RELEASED or self._state is _RELEASING

    @property
    def remaining(self) -> float:
        """Seconds until expiry by the local conservative estimate (<= 0: may have expired)."""
        return self._expires - monotonic()

    def stats(self) -> LeaseStats:
        """A snapshot of this lease."""
        with self._lock:
            return LeaseStats(
                self.name,
                self.token,
                self._state,
                self._keep_alive,
                self._extensions,
                self._expires - monotonic(),
            )

    # -- extend and release -------------------------------------------------------------------

    def extend(self, at_most_for: float | None = None) -> None:
        """Make the lease expire ``at_most_for`` seconds from now (store clock).

        Never shortens it below ``at_least_for`` after the grant. One round trip.

        Args:
            at_most_for: New duration in seconds; None keeps the current one. It also becomes
                the lease's ``at_most_for`` (and so the keep-alive period, a third of it).

        Raises:
            LeaseReleasedError: The lease was released by its holder (a bug in the caller's
                bookkeeping, but nothing was lost; catch :class:`~rxcoord.LeaseNotHeld` for
                this and :class:`~rxcoord.LeaseLost` alike).
            LeaseLost: The lease expired or was taken over (the store refused to extend it),
                or was already lost.
            LeaseStoreUnavailable: The store could not be reached; the lease is unchanged and
                may still be held (retry, or treat it as lost once ``remaining`` runs out).
            LeaseStoreMisconfigured: The store refused for good (the message names the fix).
            LeaseProviderClosed: The provider was closed.
            TypeError: ``at_most_for`` is not a number.
            ValueError: ``at_most_for`` is not a finite number > 0, or beyond the store's
                ``max_duration``.
        """
        most = (
            self.at_most_for
            if at_most_for is None
            else check_length(at_most_for, "at_most_for", maximum=self._provider.max_duration)
        )
        state = self._state
        if state is not _HELD:
            raise self._not_held_error("extend")
        sent = monotonic()
        if not self._provider._extend_lease(self, most):
            error = LeaseLost(
                f"lease {self.name!r} (token {self.token}) could not be extended: it expired "
                "or was taken over by another holder"
            )
            self._end(_LOST, error, "the store refused to extend it")
            raise error
        with self._lock:
            reschedule = False
            if self._state is _HELD:
                self._expires = sent + most
                reschedule = self._keep_alive and most != self.at_most_for
                self.at_most_for = most
                self._extensions += 1
        if reschedule:
            # The pending renewal was timed for the old duration: a shorter lease would expire
            # before it, while it still reads as held.
            self._provider._background.reschedule(self._renewal_handle(), most / 3)

    def release(self) -> None:
        """Give the lease back. One round trip.

        The name stays taken until ``at_least_for`` after the grant, then it is free; waiters
        are notified either way. Releasing also stops keep-alive.

        Raises:
            LeaseReleasedError: The lease was already released (or its release is in flight):
                nothing was lost, the first release is the one that counts.
            LeaseLost: The lease had expired or been taken over (then it was not ours to
                release, and the other holder keeps it).
            LeaseStoreUnavailable: The store could not be reached; the lease is still held and
                ``release()`` may be called again.
            LeaseStoreMisconfigured: The store refused for good; the lease is still held (and
                expires on its own).
            LeaseProviderClosed: The provider was closed (and released the lease then).
        """
        self._finish_release(self._begin_release(forget_lost=True))

    def _begin_release(self, *, forget_lost: bool) -> bool:
        """Decide the release (``held`` -> ``releasing``); True if keep-alive was running.

        Raises:
            LeaseReleasedError, LeaseLost, LeaseProviderClosed: The lease is not held.
        """
        with self._lock:
            state = self._state
            if state is _HELD:
                self._state = _RELEASING
                keep_alive, self._keep_alive = self._keep_alive, False
        if state is not _HELD:
            if state is _LOST and forget_lost:
                self._provider._forget_quietly(self)
            raise self._not_held_error("release")
        if keep_alive:
            self._provider._background.stop(self._renewal_handle())
        return keep_alive

    def _finish_release(self, keep_alive: bool) -> None:
        """The round trip of a release decided by :meth:`_begin_release`."""
        try:
            ok = self._provider._release_lease(self)
        except BaseException:
            with self._lock:
                if self._state is _RELEASING:
                    self._state = _HELD
                    self._keep_alive = keep_alive
                settled, self._settled = self._settled, None
            if settled is not None:
                # A closing provider waits for this release (LeaseProviderClosed, most likely):
                # the lease is held again, and the provider releases it now.
                settled.set()
            if keep_alive:
                self._provider._background.start(self._renewal_handle(), self.at_most_for / 3)
            raise
        if ok:
            self._end(_RELEASED, None, "")
            return
        error = LeaseLost(
            f"lease {self.name!r} (token {self.token}) was lost before release: it expired and "
            "may have been granted to another holder; work done under it may overlap theirs"
        )
        self._end(_LOST, error, "it had expired when released")
        raise error

    async def release_async(self) -> None:
        """:meth:`release` for asyncio: the round trip runs in a worker thread.

        Cancel-safe: the release is decided on the calling task before the first ``await``, so
        from then on the lease reads as released (``held`` False, ``released`` True) and a
        cancellation of the task no longer stops it; the round trip finishes in the background
        (a failure of it is logged, and the lease is held again). Calling ``release()`` or
        ``release_async()`` again raises :class:`LeaseReleasedError`, never a false loss.

        Raises:
            LeaseReleasedError: The lease was already released (or its release is in flight).
            LeaseLost: The lease had expired or been taken over.
            LeaseStoreUnavailable: The store could not be reached; the lease is still held.
            LeaseStoreMisconfigured: The store refused for good; the lease is still held.
            LeaseProviderClosed: The provider was closed (and released the lease then).
        """
        loop = asyncio.get_running_loop()
        try:
            keep_alive = self._begin_release(forget_lost=False)
        except LeaseLost:
            # The best-effort cleanup is a round trip: not on the event loop.
            await loop.run_in_executor(None, self._provider._forget_quietly, self)
            raise
        future = loop.run_in_executor(None, self._finish_release, keep_alive)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._log_orphaned_release)
            raise

    def _log_orphaned_release(self, future: asyncio.Future[None]) -> None:
        # The release_async that started this round trip was cancelled: nobody else hears of it.
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            logger.warning(
                "rxcoord lease {!r} (token {}): release after a cancelled release_async() "
                "failed: {}",
                self.name,
                self.token,
                exc,
            )

    async def extend_async(self, at_most_for: float | None = None) -> None:
        """:meth:`extend` for asyncio: the round trip runs in a worker thread.

        Raises:
            LeaseReleasedError: The lease was released by its holder.
            LeaseLost: The lease expired or was taken over, or was already lost.
            LeaseStoreUnavailable: The store could not be reached (the lease is unchanged).
            LeaseStoreMisconfigured: The store refused for good.
            LeaseProviderClosed: The provider was closed.
            TypeError: ``at_most_for`` is not a number.
            ValueError: ``at_most_for`` is not a finite number > 0.
        """
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.extend, at_most_for)

    def verify(self) -> bool:
        """Ask the store whether this grant is still its current one. One round trip.

        :attr:`held` is this process's view; this is the store's. If the store has another
        grant of the name (a takeover after an expiry), or none (it expired), the lease is
        marked lost (``on_lost``/``when_lost`` are told) and False is returned. If it is still
        current, the local expiry estimate is corrected by the store's remaining time.

        Returns:
            True if the store still has this grant; False if the lease is lost.

        Raises:
            LeaseReleasedError: The lease was released by its holder.
            LeaseStoreUnavailable: The store could not be reached (nothing is concluded).
            LeaseStoreMisconfigured: The store refused for good.
            LeaseProviderClosed: The provider was closed.
        """
        state = self._state
        if state is _LOST:
            return False
        if state is not _HELD:
            raise self._not_held_error("verify")
        sent = monotonic()
        current = self._provider._holder_of(self.name)
        if current is not None and current.token == self.token and not current.released:
            with self._lock:
                if self._state is _HELD:
                    self._expires = min(self._expires, sent + current.remaining)
            return True
        if current is None:
            seen = "the store has no grant of the name (it expired)"
        elif current.token == self.token:
            seen = "the store has it as released"
        else:
            seen = f"the store has granted it again, with token {current.token}"
        error = LeaseLost(
            f"lease {self.name!r} (token {self.token}) is no longer the current grant: {seen}; "
            "work done under it may overlap a newer holder's"
        )
        self._end(_LOST, error, "verify() found it is no longer the store's grant", held_only=True)
        return self._state is _HELD  # False, unless released concurrently (then it raised above)

    async def verify_async(self) -> bool:
        """:meth:`verify` for asyncio: the round trip runs in a worker thread.

        Raises:
            LeaseReleasedError: The lease was released by its holder.
            LeaseStoreUnavailable: The store could not be reached (nothing is concluded).
            LeaseStoreMisconfigured: The store refused for good.
            LeaseProviderClosed: The provider was closed.
        """
        return await asyncio.get_running_loop().run_in_executor(None, self.verify)

    def _release_quietly(self) -> None:
        """Release if still held; log instead of raising (cleanup after another error)."""
        if self._state is not _HELD:
            return
        try:
            self.release()
        except LeaseLost as exc:
            logger.warning("rxcoord lease {!r}: {}", self.name, exc)
        except (LeaseStoreUnavailable, LeaseProviderClosed) as exc:
            logger.warning(
                "rxcoord lease {!r} not released ({}); it expires on its own", self.name, exc
            )

    def _release_on_close(self, timeout: float | None = None) -> None:
        """Release on behalf of a closing provider (which no longer accepts ``release()``).

        A ``release()`` in flight on another thread is waited for (up to ``timeout``): it either
        succeeds, or fails (the provider is closing) and hands the lease back, held, to be
        released here. ``timeout`` also bounds the store's round trip.
        """
        deadline = None if timeout is None else monotonic() + timeout
        with self._lock:
            settled = None
            if self._state is _RELEASING:
                if self._settled is None:
                    self._settled = threading.Event()
                settled = self._settled
        if settled is not None:
            settled.wait(timeout)
        with self._lock:
            if self._state is not _HELD:
                return
            self._state = _RELEASING
            self._keep_alive = False
        try:
            left = None if deadline is None else deadline - monotonic()
            if left is not None and left <= 0:
                raise LeaseStoreUnavailable("no time left to release it before close() returns")
            ok = self._provider._store_release(self.name, self.token, timeout=left)
        except (LeaseStoreUnavailable, LeaseStoreMisconfigured) as exc:
            # close() must finish either way: a refusal for good (the user's rights revoked
            # meanwhile) leaves the lease to expire on its own, as an outage does.
            error = LeaseLost(
                f"lease {self.name!r} (token {self.token}) could not be released when its "
                f"provider closed ({exc}); it expires on its own"
            )
            error.__cause__ = exc
            self._end(_LOST, error, "its provider closed and could not release it")
            return
        if ok:
            self._end(_RELEASED, None, "")
        else:
            error = LeaseLost(
                f"lease {self.name!r} (token {self.token}) had expired when its provider closed"
            )
            self._end(_LOST, error, "it had expired when its provider closed")

    def _not_held_error(self, action: str) -> LeaseError:
        self._provider._check_open()
        if self._state is _LOST:
            lost = LeaseLost(
                f"cannot {action} lease {self.name!r} (token {self.token}): {self._lost_error}"
            )
            lost.__cause__ = self._lost_error
            return lost
        return LeaseReleasedError(
            f"cannot {action} lease {self.name!r} (token {self.token}): it was already released "
            "(a second release is a bug in the caller, but nothing was lost)"
        )

    # -- keep-alive ---------------------------------------------------------------------------

    @property
    def keep_alive(self) -> bool:
        """Whether the lease is being renewed in the background."""
        return self._keep_alive

    def start_keep_alive(self) -> None:
        """Renew the lease every ``at_most_for / 3`` seconds until it is released.

        If a renewal is refused (the lease was lost) or the store stays unreachable until the
        lease may have expired, the lease becomes ``lost``, the loss is logged, and the
        ``on_lost`` callbacks and ``when_lost`` subscribers are told. A renewal waits for the
        store no longer than the lease has left, so a store that stops answering is reported
        by the lease's expiry at the latest. Idempotent.

        Raises:
            LeaseLost: The lease was lost (expired or taken over).
            LeaseReleasedError: The lease was released by its holder.
            LeaseProviderClosed: The provider was closed.
        """
        with self._lock:
            if self._state is not _HELD:
                state_ok = False
            else:
                state_ok = True
                already, self._keep_alive = self._keep_alive, True
                if self._renewal is None:
                    self._renewal = _Renewal(self)
        if not state_ok:
            raise self._not_held_error("keep alive")
        if not already:
            self._provider._check_open()
            self._provider._background.start(self._renewal_handle(), self.at_most_for / 3)

    def stop_keep_alive(self) -> None:
        """Stop background renewal (the lease then expires ``at_most_for`` after its last one)."""
        with self._lock:
            was, self._keep_alive = self._keep_alive, False
        if was:
            self._provider._background.stop(self._renewal_handle())

    def _renewal_handle(self) -> DistributedLease:
        """What the background timers hold of this lease (see :class:`_Renewal`)."""
        renewal = self._renewal
        assert renewal is not None, "keep-alive was started, so the handle exists"
        # Background only ever calls _keep_alive_tick() on what it is given.
        return cast("DistributedLease", cast(Any, renewal))

    def _keep_alive_tick(self) -> float | None:
        """Renew once (on the provider's background executor); the delay until the next try."""
        with self._lock:
            if self._state is not _HELD or not self._keep_alive:
                return None
            most = self.at_most_for
        sent = monotonic()
        left = self._expires - sent
        try:
            if left <= 0:
                raise LeaseStoreUnavailable("no renewal succeeded in time")
            # The round trip may take no longer than the lease has left: a store that stops
            # answering must not keep the holder believing in a lease that has expired.
            ok = self._provider._extend_lease(self, most, timeout=left)
        except LeaseProviderClosed:
            return None
        except LeaseStoreUnavailable as exc:
            left = self._expires - monotonic()
            if left <= 0:
                error = LeaseLost(
                    f"lease {self.name!r} (token {self.token}) could not be renewed before it "
                    f"expired: {exc}"
                )
                error.__cause__ = exc
                self._end(_LOST, error, "keep-alive could not reach the store in time")
                return None
            retry = max(_MIN_RETRY, min(most / 3, left / 3))
            logger.warning(
                "rxcoord lease {!r}: renewal failed ({}); retrying in {:.3f}s, {:.3f}s left",
                self.name,
                exc,
                retry,
                left,
            )
            return retry
        if not ok:
            error = LeaseLost(
                f"lease {self.name!r} (token {self.token}) was lost: keep-alive found it expired "
                "or taken over by another holder"
            )
            self._end(_LOST, error, "keep-alive renewal was refused")
            return None
        with self._lock:
            if self._state is not _HELD:
                return None
            self._expires = sent + most
            self._extensions += 1
            return most / 3 if self._keep_alive else None

    # -- loss notification --------------------------------------------------------------------

    def on_lost(self, callback: Callable[[LeaseLost], object]) -> Callable[[], None]:
        """Call ``callback(error)`` once if the lease is lost; returns a function to unregister.

        Called on the thread that detected the loss (a keep-alive worker, or the caller of
        ``extend``/``release``); immediately if the lease is already lost. Never called for a
        lease that is released normally. Exceptions from the callback are logged.
        """
        return self._observe(callback, None)

    @property
    def when_lost(self) -> Observable[LeaseLost]:
        """Emits the :class:`LeaseLost` error and completes if the lease is lost.

        Completes without emitting when the lease is released normally, so it can be used to
        cancel work (``work.pipe(ops.take_until(lease.when_lost))``).
        """

        def subscribe(
            observer: abc.ObserverBase[LeaseLost], scheduler: abc.SchedulerBase | None = None
        ) -> abc.DisposableBase:
            def lost(error: LeaseLost) -> None:
                observer.on_next(error)
                observer.on_completed()

            return Disposable(self._observe(lost, observer.on_completed))

        return Observable(subscribe)

    def _observe(self, on_lost: _LostCallback, on_end: _EndCallback | None) -> Callable[[], None]:
        entry = (on_lost, on_end)
        with self._lock:
            state = self._state
            if state is _HELD or state is _RELEASING:
                if self._observers is None:
                    self._observers = []
                self._observers.append(entry)
        if state is _LOST:
            assert self._lost_error is not None
            _call(on_lost, self._lost_error)
        elif state is _RELEASED and on_end is not None:
            _call(on_end)

        def unregister() -> None:
            with self._lock:
                if self._observers is not None:
                    with contextlib.suppress(ValueError):
                        self._observers.remove(entry)

        return unregister

    def _end(
        self, state: LeaseState, error: LeaseLost | None, reason: str, *, held_only: bool = False
    ) -> None:
        """Move to ``released`` or ``lost`` (once) and tell whoever asked.

        ``held_only``: only from ``held`` (a release decided meanwhile wins over a verdict
        reached without it).
        """
        with self._lock:
            if self._state is not _HELD and (held_only or self._state is not _RELEASING):
                return
            self._state = state
            self._lost_error = error
            keep_alive, self._keep_alive = self._keep_alive, False
            observers, self._observers = self._observers, None
            settled, self._settled = self._settled, None
        if settled is not None:
            settled.set()
        if keep_alive:
            self._provider._background.stop(self._renewal_handle())
        self._provider._lease_ended(self, lost=error is not None)
        if error is not None:
            logger.warning("rxcoord lease {!r} (token {}) lost: {}", self.name, self.token, reason)
        for on_lost, on_end in observers or ():
            if error is not None:
                _call(on_lost, error)
            elif on_end is not None:
                _call(on_end)

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> DistributedLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Release on exit; see ``LeaseProvider.lock`` for how errors are reported."""
        if exc is not None:
            self._release_quietly()
        elif self._state is _HELD or self._state is _LOST:
            # A lost lease (keep-alive found it gone during the block) raises LeaseLost here:
            # the block's work may overlap a newer holder's, and the caller must hear of it.
            self.release()


def _call(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception:
        logger.opt(exception=True).error("rxcoord lease loss callback failed")
