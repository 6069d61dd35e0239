"""Where a sync job runs: one runner per place (worker threads, an asyncio loop, a scheduler).

A runner calls a task's sync run on its thread(s); the run itself (calling the job, its key
guard, what the job returned, the end) is the coordinator's and the same everywhere. ``async
def`` jobs do not need a runner: they run on an asyncio loop, inside the awaiting task or in a
task of their own (``spawn``).

* :class:`WorkerRunner` - worker threads: the coordinator's own pool (``scheduler=None``) or a
  pool shared with its ``TenantScheduler``. One C-level queue hand-off per job.
* :class:`LoopRunner` - ``scheduler=AsyncIOScheduler(loop)``: sync jobs run on that loop's
  thread, handed over the thread-safe way (the scheduler itself is not thread-safe).
* :class:`SchedulerRunner` - any other reactivex scheduler, virtual time included. A scheduler
  may run an action right inside ``schedule`` (``ImmediateScheduler``,
  ``CurrentThreadScheduler``); a job that ends there starts the next job of its key from inside
  the same call, and a long queue would recurse without bound. A per-thread trampoline turns
  that recursion into a loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from reactivex import abc

from .._core.futures import running_loop
from .._core.workers import WorkerPool

__all__ = ["LoopRunner", "Runner", "SchedulerRunner", "WorkerRunner", "spawn"]


class Runner(Protocol):
    """Calls ``run`` on the runner's thread(s); raises if it cannot take work any more."""

    def run(self, run: Callable[[], object]) -> None: ...


class WorkerRunner:
    """Worker threads; see the module docstring."""

    __slots__ = ("pool", "run")

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.run = pool.submit  # bound once: one call per job, no frame of ours in between


class LoopRunner:
    """An asyncio loop's thread (``AsyncIOScheduler``); see the module docstring."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def run(self, run: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(run)


class _Trampoline(threading.local):
    def __init__(self) -> None:  # once per thread
        self.active = False
        self.queue: deque[Callable[[], object]] = deque()


class SchedulerRunner:
    """Any other reactivex scheduler, behind a per-thread trampoline (module docstring)."""

    __slots__ = ("_trampoline", "scheduler")

    def __init__(self, scheduler: abc.SchedulerBase) -> None:
        self.scheduler = scheduler
        self._trampoline = _Trampoline()

    def run(self, run: Callable[[], object]) -> None:
        trampoline = self._trampoline
        if trampoline.active:  # scheduled from inside a run on this thread: after it returns
            trampoline.queue.append(run)
            return
        trampoline.active = True
        try:
            self._schedule(run)
            queue = trampoline.queue
            while queue:
                self._schedule(queue.popleft())
        finally:
            trampoline.active = False
            trampoline.queue.clear()

    def _schedule(self, run: Callable[[], object]) -> None:
        def action(_scheduler: abc.SchedulerBase, _state: object) -> None:
            run()

        self.scheduler.schedule(action)


def spawn(
    loop: asyncio.AbstractEventLoop,
    coroutine: Callable[[], Coroutine[Any, Any, Any]],
    context: contextvars.Context | None,
) -> None:
    """Run ``coroutine()`` as a task of ``loop`` (in ``context``), from any thread.

    Raises:
        RuntimeError: ``loop`` is closed.
    """
    if running_loop() is loop:
        loop.create_task(coroutine(), context=context)
    else:
        loop.call_soon_threadsafe(_create, loop, coroutine, context)


def _create(
    loop: asyncio.AbstractEventLoop,
    coroutine: Callable[[], Coroutine[Any, Any, Any]],
    context: contextvars.Context | None,
) -> None:
    loop.create_task(coroutine(), context=context)
