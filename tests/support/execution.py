"""Test doubles shared by the coordinator, scheduler and execution contract tests.

``Outcome`` records what one subscription received, ``Gate`` is a job that holds its slot until
the test opens it, ``ManualScheduler`` runs a scheduled job only when the test says so, and
``ThreadedVirtualScheduler`` runs jobs on real threads while their timeouts wait on a virtual
clock the test advances: no test has to sleep to let a timeout fire.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import reactivex
from reactivex import abc
from reactivex.disposable import Disposable
from reactivex.scheduler.scheduler import Scheduler
from reactivex.testing import TestScheduler

from .waiting import WAIT

__all__ = ["WAIT", "Gate", "ManualScheduler", "Outcome", "ThreadedVirtualScheduler"]

_TState = TypeVar("_TState")


class Outcome(abc.ObserverBase[Any]):
    """Collects what one subscription received.

    ``events`` keeps the notifications in order, comparable across runs: ``("value", v)``,
    ``("error", "TypeName")``, ``"completed"``.
    """

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.error: Exception | None = None
        self.completed = False
        self.events: list[Any] = []
        self.done = threading.Event()

    def on_next(self, value: Any) -> None:
        self.values.append(value)
        self.events.append(("value", value))

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.events.append(("error", type(error).__name__))
        self.done.set()

    def on_completed(self) -> None:
        self.completed = True
        self.events.append("completed")
        self.done.set()

    def subscribe_to(self, observable: reactivex.Observable[Any]) -> abc.DisposableBase:
        """Subscribe with callbacks (the path most callers take)."""
        return observable.subscribe(self.on_next, self.on_error, self.on_completed)


class ManualScheduler(Scheduler):
    """Runs a scheduled action only when the test says so: 'running' jobs stay running."""

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[Callable[[], Any]] = []

    def schedule(self, action: Any, state: Any = None) -> abc.DisposableBase:
        self.actions.append(lambda: action(self, state))
        return Disposable()

    def schedule_relative(self, duetime: Any, action: Any, state: Any = None) -> Any:
        raise NotImplementedError

    def schedule_absolute(self, duetime: Any, action: Any, state: Any = None) -> Any:
        raise NotImplementedError

    def run_next(self) -> None:
        """Run the oldest action scheduled and not run yet."""
        self.actions.pop(0)()


class Gate:
    """A job that records that it started and returns ``value`` once opened."""

    def __init__(self, value: Any = None) -> None:
        self.value = value
        self.started = threading.Event()
        self.opened = threading.Event()
        self.returned = threading.Event()

    def __call__(self) -> Any:
        self.started.set()
        assert self.opened.wait(WAIT), "gate never opened"
        self.returned.set()
        return self.value

    def open(self) -> None:
        self.opened.set()


class ThreadedVirtualScheduler(TestScheduler):
    """Work on real threads, time on a virtual clock.

    ``schedule(action)`` - work due now, which is how a coordinator hands a sync job over - runs
    the action on a thread of its own, so a job may block while the test advances the clock.
    Everything due later (a coordinator's job timeouts) waits on the virtual clock until the
    test calls ``advance_by`` on its own thread. ``wait_returned(n)`` blocks until ``n``
    hand-offs have returned: a job's hand-off returns only after the coordinator has freed its
    slot, so this is the event "the job is over", where a test would otherwise poll counters.
    """

    def __init__(self) -> None:
        super().__init__()
        self._changed = threading.Condition()
        self._returned = 0
        self._threads: list[threading.Thread] = []

    def schedule(
        self, action: abc.ScheduledAction[_TState], state: _TState | None = None
    ) -> abc.DisposableBase:
        def run() -> None:
            try:
                action(self, state)
            finally:
                with self._changed:
                    self._returned += 1
                    self._changed.notify_all()

        thread = threading.Thread(target=run, name="virtual-worker", daemon=True)
        with self._changed:
            self._threads.append(thread)
        thread.start()
        return Disposable()

    @property
    def handed_off(self) -> int:
        """Hand-offs started so far."""
        with self._changed:
            return len(self._threads)

    def wait_returned(self, count: int) -> None:
        """Block until ``count`` hand-offs have returned."""
        with self._changed:
            assert self._changed.wait_for(lambda: self._returned >= count, WAIT), (
                f"{self._returned} of {count} hand-offs returned"
            )

    def wait_quiescent(self) -> None:
        """Block until every hand-off has returned.

        A hand-off that starts another job (a slot freed, a permit passed on) does so before it
        returns, so once all have returned no work is left anywhere.
        """
        with self._changed:
            assert self._changed.wait_for(lambda: self._returned == len(self._threads), WAIT), (
                f"{self._returned} of {len(self._threads)} hand-offs returned"
            )

    def join(self) -> None:
        """Wait for every hand-off thread (test teardown)."""
        with self._changed:
            threads = list(self._threads)
        for thread in threads:
            thread.join(WAIT)
