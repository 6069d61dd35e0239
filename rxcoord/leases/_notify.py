"""Waking lease waiters without polling: a per-name registry of waiters and a listener thread.

A waiter for a taken lease needs to wake up in two cases: the holder released it (wake within a
few milliseconds) or the holder's lease expires (wake at the expiry time the store reported, the
waiter's deadline). The second case needs no help from the store. The first needs a
notification: PostgreSQL ``NOTIFY`` and Redis ``PUBLISH`` sent by the release itself, in the same
round trip, on a channel per lease name.

:class:`WaitHub` is the local half: waiters register a :class:`Watch` for a name and are woken
when a notification for it arrives. Several waiters of one name in one process share one
subscription. A hub is *authoritative* when every release passes through it (``MemoryLeases``);
otherwise a watch counts as reliable only once the store confirmed the subscription, and the
waiting loop polls with backoff until then (and forever for SQLite, which has no notifications).

:class:`Listener` is the remote half: one daemon thread per provider owns one connection to the
store, subscribes and unsubscribes as names gain and lose waiters, and feeds notifications to the
hub. The thread is the connection's only user, so no driver object is shared between threads;
other threads only queue subscription changes and wake it through a pipe. If the connection
drops, every waiter is woken (a release may have been missed), watches fall back to polling, and
the thread reconnects with backoff and subscribes again.

The race "released after my failed try, before my subscription took effect" is closed by order:
a waiter tries, registers, and tries again after the confirmation (which wakes it); any release
after the confirmation is notified.
"""

from __future__ import annotations

import os
import select
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from typing import Final

from loguru import logger

__all__ = ["Listener", "WaitHub", "Watch"]

_BACKOFF_MIN: Final = 0.05  # seconds before the first reconnection attempt
_BACKOFF_MAX: Final = 2.0


class Watch:
    """One waiter's registration for one lease name; wakes on notifications for that name."""

    __slots__ = ("_callback", "_hub", "_sub", "_wake", "closed", "name")

    def __init__(
        self,
        hub: WaitHub,
        name: str,
        sub: threading.Event | None,
        callback: Callable[[], object] | None,
    ) -> None:
        self._hub = hub
        self.name = name
        self._sub = sub  # the store's subscription confirmation; None: hub decides alone
        # A binary semaphore: locked = nothing pending, unlocked = a wake-up is pending. A bare
        # lock wakes the waiter with less work than an Event (no Condition, no waiter list),
        # which is measurable in the release-to-wake latency.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._callback = callback
        self.closed = False

    @property
    def confirmed(self) -> bool:
        """True when a release of this name is certain to wake this watch."""
        if self._sub is None:
            return self._hub.authoritative
        return self._sub.is_set()

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a notification; True if one arrived.

        Taking the pending wake-up consumes it, before the caller retries: a notification
        arriving later wakes the next wait, one arriving earlier concerns a release the retry
        will see anyway.
        """
        return self._wake.acquire(timeout=min(max(0.0, timeout), threading.TIMEOUT_MAX))

    def fire(self) -> None:
        with suppress(RuntimeError):  # already pending (released by a concurrent fire)
            self._wake.release()
        callback = self._callback
        if callback is not None:
            try:
                callback()
            except Exception:  # a closed event loop, for instance: the waiter is gone
                logger.opt(exception=True).debug("rxcoord lease wake-up callback failed")

    def close(self) -> None:
        """Unregister; idempotent."""
        if not self.closed:
            self.closed = True
            self._hub._unwatch(self)


class WaitHub:
    """Waiters per lease name, woken by :meth:`notify` (from a listener or a local release)."""

    __slots__ = ("__weakref__", "_closed", "_listener", "_lock", "_watches", "authoritative")

    def __init__(self, listener: Listener | None = None, *, authoritative: bool = False) -> None:
        self._lock = threading.Lock()
        self._watches: dict[str, list[Watch]] = {}
        self._listener = listener
        self._closed = False
        self.authoritative = authoritative

    def watch(self, name: str, callback: Callable[[], object] | None = None) -> Watch:
        """Register a waiter for ``name``; subscribe to its notifications if it is the first."""
        with self._lock:
            watches = self._watches.get(name)
            first = watches is None
            if first:
                watches = self._watches[name] = []
            assert watches is not None
            sub = self._listener.want(name) if (self._listener and first) else None
            if self._listener and not first:
                sub = watches[0]._sub
            watch = Watch(self, name, sub, callback)
            watches.append(watch)
            closed = self._closed
        if closed:
            watch.fire()  # the waiter notices the closed provider right away
        return watch

    def _unwatch(self, watch: Watch) -> None:
        with self._lock:
            watches = self._watches.get(watch.name)
            if watches is None:
                return
            try:
                watches.remove(watch)
            except ValueError:
                return
            if not watches:
                del self._watches[watch.name]
                if self._listener is not None:
                    self._listener.unwant(watch.name)

    def notify(self, name: str) -> None:
        """Wake every waiter of ``name``."""
        with self._lock:
            watches = self._watches.get(name)
            targets = list(watches) if watches else ()
        for watch in targets:
            watch.fire()

    def notify_all(self) -> None:
        """Wake every waiter (a connection dropped and notifications may have been missed)."""
        with self._lock:
            targets = [w for watches in self._watches.values() for w in watches]
        for watch in targets:
            watch.fire()

    def waiting(self) -> int:
        """Waiters currently registered."""
        with self._lock:
            return sum(len(w) for w in self._watches.values())

    def close(self) -> None:
        """Wake everyone (they find the provider closed) and stop the listener."""
        with self._lock:
            self._closed = True
        self.notify_all()
        if self._listener is not None:
            self._listener.close()


class _Sub:
    """Subscription state of one name on the listener's connection."""

    __slots__ = ("applied", "confirmed", "inflight", "wanted")

    def __init__(self) -> None:
        self.wanted = True  # some local waiter needs it
        self.applied = False  # the last command sent for it was a subscribe
        self.inflight = 0  # subscribe/unsubscribe commands sent but not yet acknowledged
        self.confirmed = threading.Event()


class Listener(ABC):
    """A daemon thread that keeps a store connection subscribed to the names being waited for.

    Subclasses implement the hooks below; every hook runs on the listener thread only.
    """

    def __init__(self, hub_ref: Callable[[], WaitHub | None], thread_name: str) -> None:
        self._hub_ref = hub_ref
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._subs: dict[str, _Sub] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_event = threading.Event()
        self._wake_r = -1
        self._wake_w = -1
        self._connected = False
        self.notifications = 0
        self.reconnects = 0

    # -- backend hooks (listener thread only) ------------------------------------------------

    @abstractmethod
    def _connect(self) -> None:
        """Open the connection (blocking)."""

    @abstractmethod
    def _fileno(self) -> int:
        """The connection's socket, for ``select``."""

    @abstractmethod
    def _apply(self, subscribe: list[str], unsubscribe: list[str]) -> None:
        """Send subscription changes; acknowledge each name with :meth:`_acked` (now or later)."""

    @abstractmethod
    def _drain(self) -> None:
        """Process what can be read without blocking; report via ``_released``/``_acked``."""

    @abstractmethod
    def _disconnect(self) -> None:
        """Close the connection; must not raise."""

    # -- called by the hooks ------------------------------------------------------------------

    def _released(self, name: str) -> None:
        self.notifications += 1
        hub = self._hub_ref()
        if hub is not None:
            hub.notify(name)

    def _acked(self, name: str) -> None:
        with self._lock:
            sub = self._subs.get(name)
            if sub is None:
                return
            sub.inflight = max(0, sub.inflight - 1)
            if sub.inflight:
                return
            if sub.applied and sub.wanted:
                sub.confirmed.set()
                confirmed = True
            else:
                confirmed = False
                if not sub.wanted and not sub.applied:
                    del self._subs[name]
        if confirmed:
            # Wake the waiters: they retry once now that no release can go unnoticed.
            hub = self._hub_ref()
            if hub is not None:
                hub.notify(name)

    # -- called by the hub (any thread) -------------------------------------------------------

    def watching(self, name: str) -> bool:
        """True while a waiter of this provider wants ``name``'s notifications (any thread).

        Set before the subscription is sent and kept until the last waiter of the name leaves,
        so every attempt a waiter makes after its subscription is confirmed sees True: the
        stores whose releases notify only marked leases (PostgreSQL, Redis) have such attempts
        mark the lease they find (see their module docstrings).
        """
        sub = self._subs.get(name)  # one dict read: atomic, no lock needed
        return sub is not None and sub.wanted

    def want(self, name: str) -> threading.Event:
        with self._lock:
            sub = self._subs.get(name)
            if sub is None:
                sub = self._subs[name] = _Sub()
            else:
                sub.wanted = True
            self._start_locked()
        self._wake()
        return sub.confirmed

    def unwant(self, name: str) -> None:
        with self._lock:
            sub = self._subs.get(name)
            if sub is None:
                return
            # ``confirmed`` stays as it is: a waiter arriving before the listener thread acts
            # on this keeps the subscription, which then stays confirmed. It is cleared when
            # the unsubscribe is actually sent (_take_changes).
            sub.wanted = False
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._stop_event.set()
        self._wake()
        if thread is not None:
            thread.join(timeout=10.0)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the thread ---------------------------------------------------------------------------

    def _start_locked(self) -> None:
        if self._thread is not None or self._stopping:
            return
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        fd = self._wake_w
        if fd >= 0:
            with suppress(OSError):  # a full pipe means a wake-up is pending anyway
                os.write(fd, b"\0")

    def _take_changes(self) -> tuple[list[str], list[str]]:
        subscribe: list[str] = []
        unsubscribe: list[str] = []
        with self._lock:
            for name, sub in list(self._subs.items()):
                if sub.wanted and not sub.applied:
                    sub.applied = True
                    sub.inflight += 1
                    subscribe.append(name)
                elif not sub.wanted and sub.applied:
                    sub.applied = False
                    sub.inflight += 1
                    sub.confirmed.clear()
                    unsubscribe.append(name)
                elif not sub.wanted and not sub.inflight:
                    del self._subs[name]
        return subscribe, unsubscribe

    def _lost_connection(self) -> None:
        with self._lock:
            for sub in self._subs.values():
                sub.applied = False
                sub.inflight = 0
                sub.confirmed.clear()
        self._connected = False
        self._disconnect()
        hub = self._hub_ref()
        if hub is not None:
            hub.notify_all()  # releases may have gone unnoticed; waiters poll until resubscribed

    def _run(self) -> None:
        backoff = _BACKOFF_MIN
        try:
            while not self._stopping:
                try:
                    if not self._connected:
                        self._connect()
                        self._connected = True
                        backoff = _BACKOFF_MIN
                    subscribe, unsubscribe = self._take_changes()
                    if subscribe or unsubscribe:
                        self._apply(subscribe, unsubscribe)
                    fd = self._fileno()
                    # poll, not select: select cannot watch descriptors above FD_SETSIZE (1024).
                    poller = select.poll()
                    poller.register(fd, select.POLLIN)
                    poller.register(self._wake_r, select.POLLIN)
                    ready = {ready_fd for ready_fd, _ in poller.poll()}
                    if self._wake_r in ready:
                        while True:
                            try:
                                if not os.read(self._wake_r, 4096):
                                    break
                            except BlockingIOError:
                                break
                    if fd in ready:
                        self._drain()
                except Exception as exc:
                    if self._stopping:
                        break
                    logger.warning(
                        "rxcoord lease listener {}: {!r}; reconnecting in {:.2f}s",
                        self._thread_name,
                        exc,
                        backoff,
                    )
                    self._lost_connection()
                    self.reconnects += 1
                    self._stop_event.wait(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX)
        finally:
            self._connected = False
            self._disconnect()
