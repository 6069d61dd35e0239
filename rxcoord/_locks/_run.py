"""The job runner of KeyedLocks: ``run*`` calls a job under a lease, released when the work ends.

One contract with the other job runners of rxcoord (``TenantTaskCoordinator.execute``,
``LeaseProvider.run``): a job is called as ``fn()`` or, like ``LeaseProvider.run``'s, as
``fn(lease)`` (decided once per ``run*`` call from its signature, see :func:`job_takes_lease`),
and what it returns decides what is emitted:

* an Observable - subscribed at once; its items are forwarded while the lease is held, and the
  lease is released just before its completion or error is forwarded;
* a coroutine (an ``async def`` job), an asyncio future or another awaitable - run on the event
  loop that was running when ``run``'s Observable was subscribed; the lease is released when it
  has finished, then its result is emitted;
* a ``concurrent.futures.Future`` - the lease is released when it is done, then its result is
  emitted;
* any other value - the lease is released, then the value is emitted and the Observable
  completes.

The lease is released only when the work has really ended: disposal asks a future or task to
stop, and its done-callback releases the lease once it has. The shapes and the running of the
work are shared with ``LeaseProvider.run`` (:mod:`rxcoord._core.jobs`); :class:`RunSink` adds
the in-process lease: its grant, its release in memory and disposal.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reactivex import abc

from .._core.jobs import JobRun, Work, job_takes_lease
from ._lease import Lease
from ._waiting import Acquisition, Target

if TYPE_CHECKING:
    from ._facade import KeyedLocks

__all__ = ["RunSink", "Work", "job_takes_lease"]


class RunSink(JobRun, Target):
    """One subscription to ``run*``: call ``fn`` under the lease, forward, release.

    The lease is released when the work has really ended, never before (see
    :class:`~rxcoord._core.jobs.JobRun` for futures, coroutines and Observables). ``fn`` itself
    (and the subscription to the Observable it returned) cannot be stopped: disposed
    meanwhile, ``on_lease`` releases the lease when it returns.
    """

    __slots__ = ("acquisition", "context", "fn", "lease", "locks", "pass_lease", "running")

    no_loop_message = (
        "fn returned an awaitable but run() was not subscribed on a running event loop; "
        "subscribe (or await) it from a coroutine, or use hold_async"
    )

    acquisition: Acquisition

    def __init__(
        self,
        locks: KeyedLocks,
        fn: Callable[..., Any],
        pass_lease: bool,
        observer: abc.ObserverBase[Any],
        loop: asyncio.AbstractEventLoop | None,
        context: contextvars.Context,
    ) -> None:
        JobRun.__init__(self, observer, loop)
        # The subscriber's context, copied: fn runs in it on whichever thread grants the keys
        # (another holder's, on its release) or on the scheduler, and so does its work.
        self.context = context
        self.locks = locks
        self.fn = fn
        self.pass_lease = pass_lease  # fn(lease) rather than fn() (see job_takes_lease)
        self.lease: Lease | None = None
        # fn (or the inner subscribe call) is executing, or the work it started is in flight:
        # whoever ends it releases the lease, not dispose().
        self.running = False

    def on_lease(self, lease: Lease) -> None:
        mutex = self.locks._mutex
        with mutex:
            abandoned = self.done
            if not abandoned:
                self.lease = lease
                self.running = True
        if abandoned:
            self.locks._release_if_held(lease)
            return
        in_flight = False
        try:
            in_flight = self.context.run(self._start_work, lease)
        finally:
            if not in_flight:
                with mutex:
                    self.running = False
                    # Disposed while the work ran: dispose() left the lease to us.
                    orphaned = self.done and self.lease is not None
                if orphaned:
                    self._release()

    def _start_work(self, lease: Lease) -> bool:
        """Call ``fn``, start what it returned; True if a done-callback will release the lease."""
        try:
            result = self.fn(lease) if self.pass_lease else self.fn()
        except Exception as exc:
            self._terminate(exc)
            return False
        return self.start(result)

    def on_error(self, error: Exception) -> None:
        self._terminate(error)

    def _release(self) -> bool:
        """Release the lease (once); True if the caller should forward its terminal."""
        with self.locks._mutex:
            forward = not self.done
            self.done = True
            lease = self.lease
            self.lease = None
        if lease is not None:
            self.locks._release_if_held(lease)
        return forward

    def dispose(self) -> None:
        self.acquisition.dispose()  # withdraws the request if it still waits
        with self.locks._mutex:
            self.done = True
            lease = None if self.running else self.lease
            if lease is not None:
                self.lease = None
        self.inner.dispose()  # stop the work first, then free the keys
        if lease is not None:
            self.locks._release_if_held(lease)
