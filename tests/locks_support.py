"""Helpers shared by the KeyedLocks tests.

Windows between threads are held open with events and gates, never with sleeps. ``WAIT``
(``support.waiting``'s, with the polling helpers) only bounds a wait that a correct
implementation ends at once (a bug fails instead of hanging).
Timeouts that the logic only needs to *fire* go through :class:`ManualTimer`, a controllable
clock for the shared timer thread, instead of waiting for real time to pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import pytest
from reactivex import abc

from rxcoord import KeyedLocks
from rxcoord._errors import LockTimeout
from rxcoord._locks import _waiting


def is_free(locks: KeyedLocks, key: Hashable) -> bool:
    """True if a try-lock on ``key`` succeeds right now (and it is released at once)."""
    try:
        with locks.hold(key, timeout=0):
            return True
    except LockTimeout:
        return False


def daemon(fn: Callable[[], object]) -> threading.Thread:
    """Start ``fn`` on a daemon thread (a hang on broken code must not block the exit)."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


class Notifications(abc.ObserverBase[Any]):
    """Thread-safe record of one subscription's notifications and the threads they came on."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.errors: list[Exception] = []
        self.threads: list[int] = []
        self.done = threading.Event()

    def on_next(self, value: Any) -> None:
        self.threads.append(threading.get_ident())
        self.items.append(value)

    def on_error(self, error: Exception) -> None:
        self.threads.append(threading.get_ident())
        self.errors.append(error)
        self.done.set()

    def on_completed(self) -> None:
        self.threads.append(threading.get_ident())
        self.done.set()


class _ManualHandle:
    __slots__ = ("callback", "delay")

    def __init__(self, delay: float, callback: Callable[[], object]) -> None:
        self.delay = delay
        self.callback: Callable[[], object] | None = callback

    @property
    def cancelled(self) -> bool:
        return self.callback is None

    def cancel(self) -> None:
        self.callback = None


class ManualTimer:
    """A controllable clock for ``acquire*``/``run*`` timeouts: they fire when told to.

    Replaces the shared timer thread for KeyedLocks' subscriptions (see :meth:`install`);
    :meth:`fire` runs every pending, uncancelled callback on the calling thread, as the
    timer thread would.
    """

    def __init__(self) -> None:
        self.handles: list[_ManualHandle] = []

    def call_later(self, delay: float, callback: Callable[[], object]) -> _ManualHandle:
        handle = _ManualHandle(delay, callback)
        self.handles.append(handle)
        return handle

    @property
    def pending(self) -> int:
        """Timers set and neither fired nor cancelled."""
        return sum(not h.cancelled for h in self.handles)

    def fire(self) -> int:
        """Expire every pending timer now; the number fired."""
        due, self.handles = self.handles, []
        fired = 0
        for handle in due:
            callback = handle.callback
            if callback is not None:
                handle.callback = None
                callback()
                fired += 1
        return fired

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> ManualTimer:
        timer = cls()
        monkeypatch.setattr(_waiting, "call_later", timer.call_later)
        return timer
