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
its weighted share (stride scheduling, below), among the lanes whose rates allow a start.

Rates (``rxcoord.Rate``, a GCRA bucket from ``rxcoord._core.rate``) are admissions too, so a job
waiting for its rate holds no permit and no thread: it is a ticket in a queue, woken by one
timer per admission on its clock (``rxcoord._core.clock``: real time, or a reactivex virtual
scheduler's). A rate's token is taken at the very moment the job is granted, never before it:
the bound on *starts* holds exactly, however long a job then waits for anything else.

* :class:`RateAdmission`: one rate, alone or in front of another admission (``then``). It hands
  a ticket on to ``then`` only while the rate has a token for it that no ticket handed on
  earlier has claimed, and takes that token when ``then`` grants: a ticket waiting for the
  rate asks ``then`` for nothing, and one waiting at ``then`` cannot start beyond the rate.
* ``FairShareGate(limit, rate=...)`` and ``lane(weight, rate=..., key=tenant)``: a global rate
  and one rate per lane, inside the gate's one step. A lane waiting for its own rate sleeps
  outside the fair-share heap until its time, so it never holds back a lane within its rate
  (no head-of-line blocking across tenants); among the lanes that may start, the weights
  decide; within a lane, FIFO.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from ._core.clock import MONOTONIC, Cancel, Clock
from ._core.rate import Bucket
from ._core.waiter import GRANTED, PENDING, Waiter
from ._rate import RateStats

if TYPE_CHECKING:
    from ._rate import Rate

__all__ = [
    "Admission",
    "AdmissionTicket",
    "FairShareGate",
    "GateStats",
    "Permit",
    "RateAdmission",
]


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


class _Granting(threading.local):
    active = False


# -- one rate, alone or in front of another admission --------------------------------------------


class _Queued:
    """A ticket waiting in a :class:`RateAdmission`: since when, and whether the rate held it."""

    __slots__ = ("held", "since", "ticket")

    def __init__(self, ticket: AdmissionTicket, since: float, held: bool) -> None:
        self.ticket = ticket
        self.since = since
        self.held = held


class RateAdmission:
    """At most ``rate`` job starts, FIFO; alone or in front of another admission.

    ``request`` queues a ticket. While the rate has a token nobody has claimed, the head of the
    queue passes: without ``then`` it is granted at once (permit ``None``) and the token is
    taken; with ``then`` it is handed on to ``then`` with the token claimed, and the token is
    taken when ``then`` grants (the job's start), with ``then``'s permit. So a job waiting for
    the rate holds nothing of ``then``'s, and jobs waiting at ``then`` cannot start faster
    than the rate when ``then`` lets several go at once. Waiting is a timer on ``clock`` at the
    next token's time (one for the admission), never a thread or a poll.

    This is what ``TenantTaskCoordinator(rate=...)`` asks; a coordinator's own admission goes
    in ``then``.

    Args:
        rate: The rate.
        clock: Where time comes from: :data:`rxcoord._core.clock.MONOTONIC` (real time), or
            ``clock_for(scheduler)`` for a coordinator on a virtual-time scheduler.
        then: The admission asked after the rate (a gate, a fleet lane); None: the rate alone.
    """

    def __init__(self, rate: Rate, *, clock: Clock = MONOTONIC, then: Admission | None = None):
        self.rate = rate
        self._bucket = Bucket(rate.interval, rate.burst)
        self._clock = clock
        self._then = then
        self._lock = threading.Lock()
        self._queue: deque[_Queued] = deque()
        self._claimed = 0  # tokens of tickets handed on to `then` and not granted there yet
        self._handed: dict[AdmissionTicket, AdmissionTicket] = {}  # ticket -> its ticket at then
        self._cancel_timer: Cancel | None = None
        self._timer_at = math.inf
        self._closed = False
        self._granting = _Granting()
        self._waits = 0
        self._waited = 0.0

    @property
    def then(self) -> Admission | None:
        """The admission asked after the rate, if any."""
        return self._then

    def request(self, ticket: AdmissionTicket) -> None:
        """Queue ``ticket``; it passes (granted, or handed on) when the rate has its token."""
        with self._lock:
            now = self._clock.now()
            held = bool(self._queue) or self._bucket.available(now) <= self._claimed
            self._queue.append(_Queued(ticket, now, held))
            if self._granting.active:
                return  # requested from a job our own hand-out started: the loop picks it up
            out = self._passing(now)
        if out:
            self._hand_out(out)

    def try_pass(self) -> bool:
        """Take a token now if nobody waits and the rate has one: True means the caller may
        start its job at once, without a ticket (a coordinator's fast path).

        False (somebody waits, the rate has no token, there is an admission behind, or it is
        closed): go through :meth:`request`, which keeps FIFO order.
        """
        if self._then is not None:
            return False
        with self._lock:
            if self._queue or self._closed:
                return False
            now = self._clock.now()
            if self._bucket.wait(now) > 0.0:
                return False
            self._bucket.take(now)
            return True

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        """Forget ``ticket`` if it has not been granted (here or by ``then``)."""
        with self._lock:
            for queued in self._queue:
                if queued.ticket is ticket:
                    self._queue.remove(queued)  # at most the coordinator's cap of entries
                    if not self._queue:
                        self._stop_timer()
                    return True
            onward = self._handed.get(ticket)
        if onward is None:
            return False
        state = onward._waiter.cancel()
        if state is PENDING:
            assert self._then is not None
            # True or False alike: a grant `then` decided meanwhile reaches a cancelled ticket
            # and goes straight back to `then` (the waiter rule).
            self._then.withdraw(onward)
        elif state is not GRANTED:
            return False  # taken: _onward_granted grants `ticket`, whose job gives it back
        # Granted here (released back to `then` by the cancel) or withdrawn: no start, and
        # the claimed token is free again.
        with self._lock:
            self._handed.pop(ticket, None)
            self._claimed -= 1
            out = [] if self._granting.active else self._passing(self._clock.now())
        if out:
            self._hand_out(out)
        return True

    def release(self, permit: object) -> None:
        """A granted job ended (or left): ``then``'s permit goes back to ``then``."""
        if self._then is not None:
            self._then.release(permit)

    def stats(self) -> RateStats:
        """Waits for the rate so far, and jobs waiting for it now."""
        with self._lock:
            return RateStats(self._waits, self._waited, len(self._queue))

    def close(self) -> None:
        """Pass nothing from now on (tickets stay until withdrawn); stop the timer."""
        with self._lock:
            self._closed = True
            self._stop_timer()

    def __repr__(self) -> str:
        return f"<RateAdmission {self.rate!r} waiting={len(self._queue)} then={self._then!r}>"

    # -- internals ------------------------------------------------------------------------------

    def _passing(self, now: float) -> list[tuple[AdmissionTicket, AdmissionTicket | None]]:
        """Lock held: take every ticket the rate lets pass now, with its onward ticket."""
        out: list[tuple[AdmissionTicket, AdmissionTicket | None]] = []
        queue = self._queue
        bucket = self._bucket
        while queue and not self._closed:
            free = bucket.available(now) - self._claimed
            if free <= 0:
                self._start_timer(now, bucket.wait(now, self._claimed + 1))
                break
            queued = queue.popleft()
            if queued.held:
                self._waits += 1
                self._waited += now - queued.since
            ticket = queued.ticket
            if self._then is None:
                bucket.take(now)
                out.append((ticket, None))
            else:
                onward = AdmissionTicket(self._then.release, ticket.key)
                self._claimed += 1
                self._handed[ticket] = onward
                out.append((ticket, onward))
        if not queue:
            self._stop_timer()
        return out

    def _hand_out(self, out: list[tuple[AdmissionTicket, AdmissionTicket | None]]) -> None:
        """Outside the lock: grant, or hand on; a job ending on this thread (and the requests
        it makes) comes back to this loop, not into a recursion."""
        granting = self._granting
        granting.active = True
        try:
            while out:
                for ticket, onward in out:
                    if onward is None:
                        ticket.grant(None)  # a job that left gives it back (nothing to give)
                    else:
                        assert self._then is not None
                        onward._waiter.bind(functools.partial(self._onward_granted, ticket, onward))
                        if onward.pending:  # not withdrawn meanwhile
                            self._then.request(onward)
                with self._lock:
                    out = self._passing(self._clock.now())
        finally:
            granting.active = False

    def _onward_granted(self, ticket: AdmissionTicket, onward: AdmissionTicket) -> None:
        """``then`` granted (or refused) the onward ticket: the job starts now, its token too."""
        if onward._waiter.take() is None:
            return  # withdrawn meanwhile: withdraw() settled it, the permit went back to then
        with self._lock:
            self._handed.pop(ticket, None)
            self._claimed -= 1
            now = self._clock.now()
            if onward.error is None:
                self._bucket.take(now)  # claimed when handed on: still there (see the docs)
            out = [] if self._granting.active else self._passing(now)
        if onward.error is not None:
            ticket.refuse(onward.error)
        else:
            ticket.grant(onward.permit)  # a job that left gives it back through release()
        if out:
            self._hand_out(out)

    def _start_timer(self, now: float, delay: float) -> None:
        """Lock held: wake at ``now + delay`` (one timer: the earliest wins)."""
        at = now + delay
        if at >= self._timer_at:
            return
        if self._cancel_timer is not None:
            self._cancel_timer()
        self._timer_at = at
        self._cancel_timer = self._clock.call_later(delay, self._tick)

    def _stop_timer(self) -> None:
        if self._cancel_timer is not None:
            self._cancel_timer()
            self._cancel_timer = None
        self._timer_at = math.inf

    def _tick(self) -> None:
        with self._lock:
            self._cancel_timer = None
            self._timer_at = math.inf
            out = self._passing(self._clock.now())
        if out:
            self._hand_out(out)


# -- the fair-share gate -------------------------------------------------------------------------

_NOWHERE: Final = 0  # a lane with no waiting tickets (or withdrawn ones only)
_RUNNABLE: Final = 1  # in the heap: may start as soon as a permit is free
_SLEEPING: Final = 2  # waiting for its own rate: in the sleepers' heap until its time


class _Lane:
    """One lane of a :class:`FairShareGate`: its weight, pass, rate and waiting tickets."""

    __slots__ = (
        "bucket",
        "head_since",
        "held",
        "pass_",
        "waited",
        "waiting",
        "waits",
        "weight",
        "where",
    )

    def __init__(self, weight: float, bucket: Bucket | None) -> None:
        self.weight = weight
        self.pass_ = 0.0
        self.waiting: deque[AdmissionTicket] = deque()
        self.where = _NOWHERE
        self.bucket = bucket  # its own rate, or None
        self.head_since = 0.0  # when the ticket at the front got there
        self.held = False  # the ticket at the front was held back by the lane's rate
        self.waits = 0
        self.waited = 0.0


@dataclass(frozen=True, slots=True)
class GateStats:
    """A snapshot of a :class:`FairShareGate`.

    Attributes:
        limit: Most permits out at once.
        running: Permits out now.
        waiting: Tickets waiting in the gate's lanes.
        rate_waits: Jobs held back by a rate (the gate's or their lane's) before they started.
        rate_waited: Seconds those jobs spent at the front of their lane, in total.
        rate_buckets: Lane rates kept by key (tenants that started recently: a bucket is
            forgotten once full again).
    """

    limit: int
    running: int
    waiting: int
    rate_waits: int = 0
    rate_waited: float = 0.0
    rate_buckets: int = 0


class FairShareGate:
    """At most ``limit`` permits out; a free one goes to the lane with the lowest pass.

    Fairness is stride scheduling over job starts (weighted round robin in virtual time). Each
    lane has a *pass*; a free permit goes to the waiting lane with the smallest pass, whose
    pass then grows by ``1 / weight``. With equal weights that is round robin; over a long run
    lanes with backlogs get starts in proportion to their weights. A lane that becomes runnable
    again starts from the current virtual time (the pass of the latest start), never from its
    old pass, so being idle earns no credit.

    Rates: ``rate`` bounds the starts of all lanes together (nothing starts while it has no
    token), a lane's own rate its starts. A lane whose rate has no token sleeps outside the
    heap until it has (being held back by its rate earns no credit either); its tokens are
    taken at the grant. A lane's bucket is kept per ``key`` beyond the lane (a tenant evicted
    and back at once is still within its rate), and forgotten once full again.

    ``lane(weight)`` returns the :class:`Admission` of one lane (one per tenant).

    Args:
        limit: Most permits out at once.
        rate: A rate on the starts of every lane together; None: none.
        clock: The clock rates wait on (see :mod:`rxcoord._core.clock`).
    """

    def __init__(self, limit: int, *, rate: Rate | None = None, clock: Clock = MONOTONIC) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._running = 0
        self._heap: list[tuple[float, int, _Lane]] = []
        self._seq = itertools.count()
        self._clock = 0.0  # virtual time: the pass of the latest start
        self._stale = 0  # heap entries of lanes whose waiting tickets were all withdrawn
        self._closed = False  # closing: grant nothing more
        self._granting = _Granting()
        self._time = clock
        self._rate = None if rate is None else Bucket(rate.interval, rate.burst)
        self._rate_blocked_at = -math.inf  # the latest time the gate's rate held a start back
        self._sleepers: list[tuple[float, int, _Lane]] = []  # lanes waiting for their rate
        self._buckets: dict[Hashable, Bucket] = {}  # lane rates by key, until full again
        self._buckets_sweep_at = 64
        self._cancel_timer: Cancel | None = None
        self._timer_at = math.inf
        self._waits = 0
        self._waited = 0.0

    @property
    def running(self) -> int:
        """Permits out now."""
        return self._running

    def lane(
        self, weight: float, *, rate: Rate | None = None, key: Hashable | None = None
    ) -> Admission:
        """A new lane with ``weight`` (> 0) and its own ``rate``, as an :class:`Admission`.

        ``key`` names the lane's rate state (a tenant): a later lane with the same key goes on
        from it while it is not full again, so a lane dropped and made again at once cannot
        start beyond its rate.
        """
        bucket = None
        if rate is not None:
            with self._lock:
                bucket = self._bucket(rate, key)
        return _LaneAdmission(self, _Lane(weight, bucket))

    def stats(self) -> GateStats:
        """A snapshot."""
        with self._lock:
            waiting = sum(len(entry[2].waiting) for entry in (*self._heap, *self._sleepers))
            return GateStats(
                self._limit, self._running, waiting, self._waits, self._waited, len(self._buckets)
            )

    def close(self) -> None:
        """Grant nothing from now on; waiting tickets stay until they are withdrawn."""
        with self._lock:
            self._closed = True
            self._stop_timer()

    def _bucket(self, rate: Rate, key: Hashable | None) -> Bucket:
        """The bucket of a new lane (lock held)."""
        bucket = Bucket(rate.interval, rate.burst)
        if key is None:
            return bucket
        now = self._time.now()
        old = self._buckets.get(key)
        if old is not None and not old.full(now):
            bucket.tat = old.tat  # the rate may have changed; the starts it counted have not
        if len(self._buckets) >= self._buckets_sweep_at:
            for name in [name for name, b in self._buckets.items() if b.full(now)]:
                del self._buckets[name]
            self._buckets_sweep_at = max(64, 2 * len(self._buckets))
        self._buckets[key] = bucket
        return bucket

    def _request(self, lane: _Lane, ticket: AdmissionTicket) -> None:
        with self._lock:
            now = self._time.now()
            if not lane.waiting:
                lane.head_since = now
                lane.held = lane.where == _SLEEPING  # back at a lane that sleeps on its rate
            lane.waiting.append(ticket)
            if lane.where == _NOWHERE:
                self._enlist(lane, now)
            if self._granting.active:
                return  # requested from a job our own grant loop started: the loop hands out
            granted = self._next(now) if self._running < self._limit else None
        if granted is not None:
            self._grant(granted)

    def _enlist(self, lane: _Lane, now: float) -> None:
        """A lane with waiting tickets joins the heap, or the sleepers if its rate says so."""
        bucket = lane.bucket
        if bucket is not None:
            delay = bucket.wait(now)
            if delay > 0:
                lane.where = _SLEEPING
                lane.held = True
                heapq.heappush(self._sleepers, (now + delay, next(self._seq), lane))
                return
        # Joining (again): start from the current virtual time, so idling (or sleeping on its
        # rate) earns no credit and the newcomer does not wait behind long backlogs either.
        lane.pass_ = max(lane.pass_, self._clock)
        heapq.heappush(self._heap, (lane.pass_, next(self._seq), lane))
        lane.where = _RUNNABLE

    def _withdraw(self, lane: _Lane, ticket: AdmissionTicket) -> bool:
        with self._lock:
            head = bool(lane.waiting) and lane.waiting[0] is ticket
            try:
                lane.waiting.remove(ticket)  # at most tenant_max_concurrency entries
            except ValueError:
                return False  # already granted
            if head:  # the next ticket is at the front from now on
                lane.head_since = self._time.now()
                lane.held = lane.where == _SLEEPING
            if not lane.waiting and lane.where == _RUNNABLE:
                self._stale += 1
                if self._stale > 64 and self._stale * 2 > len(self._heap):
                    self._compact()
            return True

    def _release(self) -> None:
        with self._lock:
            self._running -= 1
            if self._granting.active:
                return  # released inside our own grant loop on this thread: it hands out next
            granted = self._next(self._time.now())
        if granted is not None:
            self._grant(granted)

    def _next(self, now: float) -> AdmissionTicket | None:
        """Take a permit for the next ticket, fairly, within the rates (lock held; the caller
        checked that a permit is free)."""
        if self._closed:
            return None
        sleepers = self._sleepers
        while sleepers and sleepers[0][0] <= now:
            _, _, lane = heapq.heappop(sleepers)
            lane.where = _NOWHERE
            if lane.waiting:  # else every ticket it had here was withdrawn
                self._enlist(lane, now)
        heap = self._heap
        while heap and not heap[0][2].waiting:  # every ticket it had here was withdrawn
            heapq.heappop(heap)[2].where = _NOWHERE
            self._stale -= 1
        if not heap:
            if sleepers:
                self._start_timer(now, sleepers[0][0] - now)
            return None
        rate = self._rate
        if rate is not None:
            delay = rate.wait(now)
            if delay > 0:
                self._rate_blocked_at = now
                self._start_timer(now, min(delay, sleepers[0][0] - now) if sleepers else delay)
                return None
        pass_, _, lane = heapq.heappop(heap)
        ticket = lane.waiting.popleft()
        self._clock = pass_
        lane.pass_ = pass_ + 1.0 / lane.weight
        if rate is not None:
            rate.take(now)
        if lane.bucket is not None:
            lane.bucket.take(now)
        # Held back by a rate: its lane's, or the gate's (which held back every runnable lane
        # the last time it blocked, this one too if it was at the front by then).
        if lane.held or self._rate_blocked_at >= lane.head_since:
            lane.waits += 1
            lane.waited += now - lane.head_since
            self._waits += 1
            self._waited += now - lane.head_since
        lane.head_since = now
        lane.held = False
        lane.where = _NOWHERE
        if lane.waiting:
            self._enlist(lane, now)
        if sleepers and not heap:
            self._start_timer(now, sleepers[0][0] - now)
        self._running += 1
        return ticket

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
                    ticket = self._next(self._time.now()) if self._running < self._limit else None
        finally:
            granting.active = False

    def _start_timer(self, now: float, delay: float) -> None:
        """Lock held: look again at ``now + delay`` (one timer: the earliest wins)."""
        at = now + delay
        if at >= self._timer_at or self._closed:
            return
        if self._cancel_timer is not None:
            self._cancel_timer()
        self._timer_at = at
        self._cancel_timer = self._time.call_later(delay, self._tick)

    def _stop_timer(self) -> None:
        if self._cancel_timer is not None:
            self._cancel_timer()
            self._cancel_timer = None
        self._timer_at = math.inf

    def _tick(self) -> None:
        with self._lock:
            self._cancel_timer = None
            self._timer_at = math.inf
            if self._running >= self._limit or self._granting.active:
                return  # a release calls _next (and sets the timer again if still needed)
            granted = self._next(self._time.now())
        if granted is not None:
            self._grant(granted)

    def _compact(self) -> None:
        live = [entry for entry in self._heap if entry[2].waiting]
        for entry in self._heap:
            if not entry[2].waiting:
                entry[2].where = _NOWHERE
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

    def stats(self) -> RateStats:
        """This lane's waits for a rate (its own or the gate's), and its waiting tickets."""
        lane = self._lane
        with self._gate._lock:
            return RateStats(lane.waits, lane.waited, len(lane.waiting))
