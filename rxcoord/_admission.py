"""Admission: the seam between a coordinator and whoever decides when its jobs may run.

A :class:`TenantTaskCoordinator` orders its jobs by key and caps them at its own
``max_concurrency``; when a job's turn comes it may also have to ask somebody else for a slot
(a limit shared with other coordinators, in one process or across a fleet). That somebody is
an :class:`Admission`: three calls, nothing more::

    coordinator                     admission
    -----------                     ---------
    request(ticket)   ---------->   queue it; later, from any thread: ticket.grant(permit)
    withdraw(ticket)  ---------->   the job left before its grant: forget the ticket
    release(permit)   ---------->   a granted job ended: the slot is free again

A ticket is a one-shot grant that may be cancelled (``rxcoord._core.waiter``), so the one
ownership rule holds here too: a permit granted to a job that already left (disposed, timed
out, coordinator closed) is handed straight back to ``release``, never lost. A withdrawal that
races with a grant is therefore safe on both sides: whichever wins, the permit ends up in
exactly one place.

:class:`FairShareGate` is the in-process admission ``TenantScheduler`` composes its tenants
with: at most ``limit`` permits out, and a free one goes to the waiting lane furthest behind
its weighted share (stride scheduling, below).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Protocol, runtime_checkable

from ._core.waiter import PENDING, Waiter

__all__ = ["Admission", "AdmissionTicket", "FairShareGate", "Permit"]


class Permit:
    """Base class of a permit with a life of its own: it may lapse while its job runs.

    An admission may grant any object as a permit (``None`` included). When it grants an
    instance of this class, the coordinator also calls, on the job's thread or task:

    * :meth:`enter` right before the job runs, in the job's context (say, to make itself what
      :func:`~rxcoord.current_permit` returns), and :meth:`exit` with its token right after;
    * :meth:`check` once the job's work has ended without an error: raising there (say,
      :class:`~rxcoord.LeaseLost` for a permit that lapsed meanwhile) fails the job with that
      error instead of delivering its result, since the work may have overlapped a newer
      holder's.

    The defaults do nothing.
    """

    __slots__ = ()

    def enter(self) -> object:
        """Called right before the job runs, in its context; a token for :meth:`exit`."""
        return None

    def exit(self, token: object) -> None:
        """Called right after the job's call returned (or its awaitable finished)."""

    def check(self) -> None:
        """Raise if the permit no longer covers the job's work (it then fails with that)."""


class AdmissionTicket:
    """One job's request for a permit, handed to :meth:`Admission.request`.

    The admission keeps it until it has a permit for the job and then calls :meth:`grant`
    (once, from any thread, outside its own locks), or until the coordinator withdraws it.

    Attributes:
        key: The job's ordering key (``None`` for an unkeyed job); an admission may use it,
            e.g. to name a permit.
        permit: What :meth:`grant` handed over (``None`` until then); passed back to
            ``release`` when the job ends.
    """

    __slots__ = ("_release", "_waiter", "error", "key", "permit")

    def __init__(self, release: Callable[[object], object], key: Hashable | None) -> None:
        self._release = release
        # The waiter hands over the ticket itself (its permit set just before): one allocation
        # per job, and a permit may be anything, None included.
        self._waiter: Waiter[AdmissionTicket] = Waiter(self._give_back)
        self.key = key
        self.permit: object = None
        self.error: BaseException | None = None

    def _give_back(self, _ticket: AdmissionTicket | None = None) -> None:
        if self.error is None:  # a refused ticket holds nothing
            self._release(self.permit)

    def grant(self, permit: object = None) -> bool:
        """Give the job its permit.

        Returns:
            True if the job takes it: it calls ``release(permit)`` when it ends. False if the
            job had left already: ``release(permit)`` has been called now.

        Raises:
            RuntimeError: The ticket was granted before.
        """
        self.permit = permit
        return self._waiter.grant(self)

    def refuse(self, error: BaseException) -> bool:
        """Fail the job with ``error`` instead of granting it (e.g. the store is down).

        Returns:
            True if the job takes the refusal (it fails with ``error`` and releases nothing);
            False if it had left already.

        Raises:
            RuntimeError: The ticket was granted (or refused) before.
        """
        self.error = error
        return self._waiter.grant(self)

    @property
    def pending(self) -> bool:
        """True until the ticket is granted or its job leaves."""
        return self._waiter.state is PENDING

    def __repr__(self) -> str:
        return f"<AdmissionTicket key={self.key!r} {self._waiter!r}>"


@runtime_checkable
class Admission(Protocol):
    """Decides when a job whose turn came may run; see the module docstring.

    Implementations must be thread-safe: the three methods are called from any thread, and
    :meth:`AdmissionTicket.grant` must be called outside the admission's own locks (the job may
    start, finish and call :meth:`release` on the granting thread).
    """

    def request(self, ticket: AdmissionTicket) -> None:
        """Queue ``ticket``; grant it (now or later, from any thread) when a permit is free."""

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        """Forget a ticket not granted yet; False if it was granted (or is unknown)."""

    def release(self, permit: object) -> None:
        """A permit granted earlier comes back (its job ended, or left before taking it)."""


class _Lane:
    """One lane of a :class:`FairShareGate`: its weight, pass and waiting tickets."""

    __slots__ = ("in_heap", "pass_", "waiting", "weight")

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.pass_ = 0.0
        self.waiting: deque[AdmissionTicket] = deque()
        self.in_heap = False


class _Granting(threading.local):
    active = False


class FairShareGate:
    """At most ``limit`` permits out; a free one goes to the lane with the lowest pass.

    Fairness is stride scheduling over job starts (weighted round robin in virtual time). Each
    lane has a *pass*; a free permit goes to the waiting lane with the smallest pass, whose
    pass then grows by ``1 / weight``. With equal weights that is round robin; over a long run
    lanes with backlogs get starts in proportion to their weights. A lane that becomes runnable
    again starts from the current virtual time (the pass of the latest start), never from its
    old pass, so being idle earns no credit.

    ``lane(weight)`` returns the :class:`Admission` of one lane (one per tenant).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._running = 0
        self._heap: list[tuple[float, int, _Lane]] = []
        self._seq = itertools.count()
        self._clock = 0.0  # virtual time: the pass of the latest start
        self._stale = 0  # heap entries of lanes whose waiting tickets were all withdrawn
        self._closed = False  # closing: grant nothing more
        self._granting = _Granting()

    @property
    def running(self) -> int:
        """Permits out now."""
        return self._running

    def lane(self, weight: float) -> Admission:
        """A new lane with ``weight`` (> 0), as an :class:`Admission`."""
        return _LaneAdmission(self, _Lane(weight))

    def close(self) -> None:
        """Grant nothing from now on; waiting tickets stay until they are withdrawn."""
        with self._lock:
            self._closed = True

    def _request(self, lane: _Lane, ticket: AdmissionTicket) -> None:
        with self._lock:
            lane.waiting.append(ticket)
            if not lane.in_heap:
                # Joining (again): start from the current virtual time, so idling earns no
                # credit and the newcomer does not wait behind long-running backlogs either.
                lane.pass_ = max(lane.pass_, self._clock)
                heapq.heappush(self._heap, (lane.pass_, next(self._seq), lane))
                lane.in_heap = True
            if self._granting.active:
                return  # requested from a job our own grant loop started: the loop hands out
            granted = self._next() if self._running < self._limit else None
        if granted is not None:
            self._grant(granted)

    def _withdraw(self, lane: _Lane, ticket: AdmissionTicket) -> bool:
        with self._lock:
            try:
                lane.waiting.remove(ticket)  # at most tenant_max_concurrency entries
            except ValueError:
                return False  # already granted
            if not lane.waiting and lane.in_heap:
                self._stale += 1
                if self._stale > 64 and self._stale * 2 > len(self._heap):
                    self._compact()
            return True

    def _release(self) -> None:
        with self._lock:
            self._running -= 1
            if self._granting.active:
                return  # released inside our own grant loop on this thread: it hands out next
            granted = self._next()
        if granted is not None:
            self._grant(granted)

    def _next(self) -> AdmissionTicket | None:
        """Take a permit for the next ticket, fairly (lock held)."""
        if self._closed:
            return None
        heap = self._heap
        while heap:
            pass_, _, lane = heapq.heappop(heap)
            if not lane.waiting:  # every ticket it had here was withdrawn
                lane.in_heap = False
                self._stale -= 1
                continue
            ticket = lane.waiting.popleft()
            self._clock = pass_
            lane.pass_ = pass_ + 1.0 / lane.weight
            if lane.waiting:
                heapq.heappush(heap, (lane.pass_, next(self._seq), lane))
            else:
                lane.in_heap = False
            self._running += 1
            return ticket
        return None

    def _grant(self, ticket: AdmissionTicket | None) -> None:
        """Grant outside the lock. A job that left hands its permit straight back, and a job
        that runs to its end on this thread, or a job whose turn that end brings, comes back
        to this loop: a loop, not a recursion (see ``_request`` and ``_release``)."""
        granting = self._granting
        granting.active = True
        try:
            while ticket is not None:
                ticket.grant(None)
                with self._lock:
                    ticket = self._next() if self._running < self._limit else None
        finally:
            granting.active = False

    def _compact(self) -> None:
        live = [entry for entry in self._heap if entry[2].waiting]
        for entry in self._heap:
            if not entry[2].waiting:
                entry[2].in_heap = False
        heapq.heapify(live)
        self._heap = live
        self._stale = 0


class _LaneAdmission:
    """One lane of a :class:`FairShareGate` seen as an :class:`Admission`."""

    __slots__ = ("_gate", "_lane")

    def __init__(self, gate: FairShareGate, lane: _Lane) -> None:
        self._gate = gate
        self._lane = lane

    def request(self, ticket: AdmissionTicket) -> None:
        self._gate._request(self._lane, ticket)

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        return self._gate._withdraw(self._lane, ticket)

    def release(self, permit: object) -> None:
        self._gate._release()
