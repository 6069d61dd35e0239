"""One submission's object: its place in the task table, its job, and who waits for it."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from reactivex import abc

from .._admission import AdmissionTicket, Permit
from .._core import telemetry
from .._core.jobs import JobRun
from .._core.retry import Retry
from ._table import Entry

if TYPE_CHECKING:
    from ._facade import TenantTaskCoordinator

__all__ = ["STREAMED", "Task", "Work"]


class Task(Entry, abc.DisposableBase):
    """One accepted submission: a subscription's, or an awaiting task's.

    It is also the Disposable its subscriber holds (``dispose`` cancels). For an awaiting task
    (``observer`` None) it is the outcome's landing place: ``ended``, ``value`` and ``error``,
    and ``future`` while the awaiter waits; everything on that side happens on the awaiter's
    loop thread (the coordinator hands notifications over through the loop), so it needs no
    lock of its own.
    """

    __slots__ = (
        "args",
        "attempt",
        "begun",
        "context",
        "coordinator",
        "ended",
        "error",
        "expired",
        "first_start",
        "future",
        "gone",
        "inside",
        "is_async",
        "job",
        "job_loop",
        "loop",
        "observer",
        "ours",
        "permit",
        "retry",
        "stall",
        "tel",
        "ticket",
        "timeout",
        "timer",
        "turn",
        "value",
        "work",
    )

    def __init__(
        self,
        coordinator: TenantTaskCoordinator,
        job: Callable[..., Any],
        args: tuple[Any, ...],
        key: Hashable | None,
        timeout: float | None,
        is_async: bool,
        observer: abc.ObserverBase[Any] | None,
        loop: asyncio.AbstractEventLoop | None,
        job_loop: asyncio.AbstractEventLoop | None,
        context: contextvars.Context | None,
        retry: Retry | None,
    ) -> None:
        self.key = key
        self.state = 0  # NEW (Entry.__init__ inlined: a frame less per job, bench_asyncio)
        self.settled = False
        self.verdict = 0  # COMPLETED, until decided
        self.coordinator = coordinator
        self.job: Callable[..., Any] | None = job
        self.args = args
        self.timeout = timeout
        self.is_async = is_async  # called on the loop (see _execution)
        self.observer = observer  # the subscriber; None: an awaiting task
        self.loop = loop  # the subscriber's (or awaiter's) loop: outcomes are delivered on it
        self.job_loop = job_loop  # where async work runs
        self.context = context  # the job runs in it; None: in the awaiting task's own
        self.timer: Callable[[], object] | None = None  # cancels the pending timeout
        self.ticket: AdmissionTicket | None = None  # asked for, or holding, a permit
        self.permit: Permit | None = None  # a granted permit with a life of its own
        self.inside: asyncio.Task[Any] | None = None  # the asyncio task the job runs in
        self.ours = False  # the coordinator cancelled ``inside`` (a timeout, close, dispose)
        self.begun = False  # its runner took it (see TenantTaskCoordinator._settled)
        self.retry = retry  # its retry policy, if it has one
        self.attempt = 1
        self.first_start: float | None = None  # its first attempt's start (coordinator's clock)
        self.expired = False  # its attempt timed out and is being stopped (to be retried)
        self.stall: Callable[[], object] | None = None  # cancels its stall watch
        self.tel: telemetry.Job | None = None  # its metrics and span, while anything listens
        self.work: Work | None = None  # what the job returned, run to its end (JobRun)
        # The awaiting task's side:
        self.future: asyncio.Future[None] | None = None  # what it waits on, while it waits
        self.turn = False  # it may run the job now
        self.gone = False  # it left (cancelled) before running the job
        self.ended = False  # the outcome has arrived
        self.value: Any = None
        self.error: BaseException | None = None

    def dispose(self) -> None:
        """The subscriber gives up: cancel (see ``TenantTaskCoordinator.execute``)."""
        self.coordinator._cancel(self)

    def run_sync(self) -> None:
        """Run the sync job on the runner's thread (a bound method: no closure per job)."""
        self.coordinator._run_sync(self)

    # -- the awaiting task's side (on its loop thread) -----------------------------------------

    def wake(self) -> None:
        future = self.future
        if future is not None and not future.done():
            future.set_result(None)

    def land(self, value: Any, error: BaseException | None) -> None:
        """The outcome arrives."""
        if isinstance(error, StopIteration):  # as asyncio would refuse it from a coroutine
            wrapped = RuntimeError(f"the job raised {error!r}")
            wrapped.__cause__ = error
            error = wrapped
        self.value = value
        self.error = error
        self.ended = True
        if self.future is not None:  # (the inline run's outcome lands with nobody waiting)
            self.wake()

    def result(self) -> Any:
        """The outcome that has arrived: the job's value, or raise its error."""
        error = self.error
        if error is not None:
            self.error = None  # no reference cycle through the traceback
            raise error
        return self.value

    async def outcome(self) -> Any:
        """The outcome, once it arrives (a timeout or a close decided elsewhere sends it later)."""
        loop = self.loop
        assert loop is not None
        while not self.ended:
            self.future = loop.create_future()
            await self.future
        self.future = None
        return self.result()


STREAMED: Any = object()  # the "value" of an Observable job: its items went out already


class Work(JobRun):
    """What a sync job returned besides a plain value or an awaitable, run to its real end.

    An Observable (its items forwarded while it runs) or a ``concurrent.futures.Future``: the
    job-shape contract of :mod:`rxcoord._core.jobs`, shared with ``KeyedLocks.run`` and
    ``LeaseProvider.run``. Its end ends the task; :meth:`cancel` stops it (a dispose, a timeout,
    a close), and the task ends once it has really stopped.
    """

    __slots__ = ("coordinator", "pending", "task", "token")

    def __init__(self, coordinator: TenantTaskCoordinator, task: Task, token: Any) -> None:
        JobRun.__init__(self, _Items(coordinator, task), None)
        self.coordinator = coordinator
        self.task = task
        self.token = token  # the key guard's, if any: exited when the work has ended
        self.pending = False  # a done-callback will end the task

    def _release(self) -> bool:
        if self.done:
            return False
        self.done = True
        return True

    def _finish_value(self, value: Any) -> None:
        if self._release():
            self.coordinator._work_ended(self, value, None)

    def _completed(self) -> None:
        if self._release():
            self.coordinator._work_ended(self, STREAMED, None)

    def _terminate(self, error: Exception) -> None:
        if self._release():
            self.coordinator._work_ended(self, None, error)

    def cancel(self) -> None:
        """Stop the work; the task ends when it has stopped (at once for an Observable)."""
        self.inner.dispose()
        if not self.pending and self._release():
            self.coordinator._work_ended(self, None, None)


class _Items(abc.ObserverBase[Any]):
    """Forwards an Observable job's items to its subscriber while its outcome is open."""

    __slots__ = ("coordinator", "task")

    def __init__(self, coordinator: TenantTaskCoordinator, task: Task) -> None:
        self.coordinator = coordinator
        self.task = task

    def on_next(self, value: Any) -> None:
        if not self.task.settled:
            self.coordinator._deliver_item(self.task, value)

    def on_error(self, error: Exception) -> None:  # pragma: no cover - JobRun routes terminals
        pass

    def on_completed(self) -> None:  # pragma: no cover - JobRun routes terminals
        pass
