"""Fleet admission: one global limit and fair tenant shares across every process of a fleet.

``TenantScheduler(name="payments", fleet=provider)`` (or a coordinator with ``fleet=``) admits
its jobs through a :class:`FleetAdmission`: an :class:`~rxcoord.Admission` whose permits are
rows of a permit table in the lease store (``rxcoord/leases/_permits.py``), so every process
using the same store and name shares the limits. What each piece is for:

* **One atomic step per admission.** A job's tenant permit and its global permit are one
  permit, granted by one store step that checks both limits: no partial grant is ever held
  while waiting, so there is nothing to deadlock on and nothing to leak.
* **Crash safety by expiry.** A permit expires ``permit_at_most_for`` seconds after its last
  renewal by the store's clock. One keep-alive per admission renews every permit it holds in
  one round trip; a process killed with ``kill -9`` stops renewing and its permits come back
  by expiry. A process paused past expiry finds them reclaimed: the job's permit is *lost*, its
  result is dropped and its subscriber gets ``LeaseLost``. Locally a permit counts as valid
  until ``sent + permit_at_most_for`` (``sent`` = when the granting or renewing request left,
  on the monotonic clock, which keeps counting while a process is stopped): never later than
  the store's own expiry.
* **Fairness in the store.** Which tenant a freed permit goes to is decided by the store step
  (stride scheduling with its virtual time kept in the store, see ``_permits.py``): a process
  waiting for a tenant registers its *demand* there, and a permit stays reserved for the
  waiting tenant furthest behind whichever process asks first.
* **Rates in the same step.** With ``rate=`` (the group's) and a lane's ``rate=`` (its
  tenant's), the store's step grants a permit only if both rates have a token, takes them at
  its own clock in the same atomic step, and says when they will have the next one. A lane
  told to wait for its rate makes no round trip before that time (the store's answer cannot
  change earlier: tokens only come back with time), and holds nothing meanwhile; its demand
  is still refreshed so that, once its time comes, the fair-share rule reserves for it.
* **No polling.** Waiters are woken by the store's notification on release (Redis pub/sub,
  PostgreSQL LISTEN/NOTIFY, the memory store directly), at the expiry times and the rates'
  next-token times the store reports; SQLite polls with backoff for releases. Waiting demand
  is refreshed while it waits, so a crashed waiter's demand stops counting after
  ``demand_for``.
* **Few round trips.** All tickets waiting for one tenant in this process are asked for in one
  step, and releases queued while one is in flight go out together: an uncontended job costs
  one round trip to admit and one to release, a busy process fewer.

Store round trips run on a small worker pool of the admission's own (never on the caller's
thread, which may be an event loop); no thread per waiter.
"""

from __future__ import annotations

import contextvars
import threading
from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from time import monotonic
from typing import TYPE_CHECKING, Final

from loguru import logger

from ._admission import Admission, AdmissionTicket, Permit
from ._core import telemetry
from ._core.checks import check_count, check_length, check_weight
from ._core.timer import TimerHandle, call_later
from ._core.workers import WorkerPool
from ._errors import LeaseLost, LeaseStoreMisconfigured, LeaseStoreUnavailable
from ._rate import Rate, RateStats, check_rate

if TYPE_CHECKING:
    from .leases import LeaseProvider
    from .leases._permits import PermitReply, RateArgs

__all__ = ["FleetAdmission", "FleetPermit", "FleetStats", "current_permit"]

_WORKERS: Final = 4  # store round trips in flight at once, per admission
_POLL_FIRST: Final = 0.01  # seconds: polling backoff while no notification is guaranteed
_POLL_MAX: Final = 0.25
_WAKE_MARGIN: Final = 0.002  # seconds after a reported expiry before retrying

_current: contextvars.ContextVar[FleetPermit | None] = contextvars.ContextVar(
    "rxcoord_fleet_permit", default=None
)


def current_permit() -> FleetPermit | None:
    """The fleet permit of the job running in this context, or None.

    Inside a job admitted through ``fleet=`` (sync jobs on their worker thread, ``async def``
    jobs in their task), this is the permit the job holds: pass ``permit.token`` to a fenced
    resource (``rxcoord.leases.FencedResource`` or your own ``WHERE token >= ...``) so a job
    whose permit was reclaimed cannot overwrite the work of a newer holder.
    """
    return _current.get()


class FleetPermit(Permit):
    """One fleet permit held by one job: a fencing token and an expiry.

    Attributes:
        token: The fencing token, from the store-wide sequence: larger than the token of every
            permit (and lease) granted earlier in the store.
        tenant: The tenant the permit counts against.
        granted_at: When the store granted it, in seconds on the store's clock (Redis
            ``TIME``, PostgreSQL ``clock_timestamp()``, SQLite and memory: the machine's):
            the start the fleet's rates counted.
    """

    __slots__ = ("_deadline", "granted_at", "lost", "tenant", "token")

    def __init__(self, token: int, tenant: str, deadline: float, granted_at: float = 0.0) -> None:
        self.token = token
        self.tenant = tenant
        self.granted_at = granted_at
        self._deadline = deadline  # monotonic: never later than the store's expiry
        self.lost = False  # the store said it was no longer held

    @property
    def valid(self) -> bool:
        """True while the permit is certainly still held (it may be held a little longer)."""
        return not self.lost and monotonic() < self._deadline

    def check(self) -> None:
        """Raise :class:`~rxcoord.LeaseLost` unless the permit is still valid."""
        if not self.valid:
            raise LeaseLost(
                f"fleet permit {self.token} of tenant {self.tenant!r} expired or was "
                "reclaimed before its job ended (a paused or partitioned process, or a "
                "keep-alive that failed): the job's work may overlap another holder's"
            )

    def enter(self) -> object:
        """Make this the permit :func:`current_permit` returns (in the job's context)."""
        return _current.set(self)

    def exit(self, token: object) -> None:
        _current.reset(token)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<FleetPermit token={self.token} tenant={self.tenant!r} valid={self.valid}>"


@dataclass(frozen=True, slots=True)
class FleetStats:
    """A snapshot of a fleet admission.

    Attributes:
        name: The group name shared by the fleet.
        backend: The lease provider's backend.
        limit: The fleet-wide limit.
        fleet_running: Permits out across the fleet, as last seen from the store.
        tenants_running: Per tenant seen by this process, its permits out across the fleet,
            as last seen from the store (tenants forgotten once they are idle here).
        held: Permits held by this process's running jobs.
        waiting: Jobs of this process waiting for a permit.
        granted: Permits granted to this process so far.
        lost: Permits found expired or reclaimed before their job ended.
        round_trips: Store round trips so far (admit, release, renew, withdraw).
        store_errors: Round trips that failed with a store error.
        rate_waits: Jobs of this process the fleet's rates (the group's or their tenant's)
            held back before they started.
        rate_waited: Seconds those jobs waited from then until their grant, in total.
        rate_limited: Per tenant of this process waiting for a rate now, the seconds until
            the store said it may start again (as last seen).
    """

    name: str
    backend: str
    limit: int
    fleet_running: int
    tenants_running: Mapping[str, int] = field(default_factory=dict)
    held: int = 0
    waiting: int = 0
    granted: int = 0
    lost: int = 0
    round_trips: int = 0
    store_errors: int = 0
    rate_waits: int = 0
    rate_waited: float = 0.0
    rate_limited: Mapping[str, float] = field(default_factory=dict)


class _Lane:
    """One tenant's tickets waiting in this process, and its store-side demand."""

    __slots__ = (
        "busy",
        "dirty",
        "held",
        "rate",
        "ready_at",
        "refresh",
        "registered",
        "tenant",
        "tenant_limit",
        "waiting",
        "weight",
    )

    def __init__(
        self, tenant: str, weight: float, tenant_limit: int, rate: RateArgs | None
    ) -> None:
        self.tenant = tenant
        self.weight = weight
        self.tenant_limit = tenant_limit
        self.rate = rate  # the tenant's own rate, as the store takes it
        self.waiting: deque[AdmissionTicket] = deque()
        self.busy = False  # a store step for this lane is in flight (on a worker)
        self.dirty = False  # something changed meanwhile: step again when it returns
        self.registered = False  # the store holds demand of ours for this tenant
        self.ready_at = 0.0  # monotonic: the store said the rates allow nothing before then
        self.refresh = False  # step even before ready_at: the demand must be refreshed
        self.held: dict[AdmissionTicket, float] = {}  # held back by a rate since (monotonic)


class FleetAdmission:
    """Fleet-wide limits in a lease store; :meth:`lane` gives one tenant's :class:`Admission`.

    Args:
        provider: The lease provider (``rxcoord.leases``) whose store the fleet shares.
        name: The group name: every admission with this name on the same store shares its
            limits (non-empty).
        limit: Most permits out across the fleet (>= 1). Every member must use the same.
        permit_at_most_for: Seconds a permit outlives its last renewal (> 0): the most a
            crashed process holds its permits. Renewed every third of it while held.
        demand_for: Seconds a waiting process's demand outlives its last refresh (how long a
            crashed waiter can keep a freed permit reserved); default ``min(3,
            permit_at_most_for)``.
        rate: A :class:`~rxcoord.Rate` on the starts of the whole group (every member, every
            tenant), kept in the store on its clock. Every member must use the same.

    Raises:
        TypeError: ``provider`` is not a lease provider, or keeps no fleet permits, or
            ``rate`` is not a Rate.
        ValueError: An empty ``name``, a limit < 1, or a duration <= 0.
    """

    def __init__(
        self,
        provider: LeaseProvider,
        name: str,
        limit: int,
        *,
        permit_at_most_for: float = 30.0,
        demand_for: float | None = None,
        rate: Rate | None = None,
    ) -> None:
        from .leases import LeaseProvider
        from .leases._permits import rate_args

        if not isinstance(provider, LeaseProvider):
            raise TypeError(
                "fleet must be a lease provider such as rxcoord.leases.RedisLeases(...) or "
                f"leases_from_url(url), not {provider!r}"
            )
        if type(provider)._permits_acquire is LeaseProvider._permits_acquire:
            raise TypeError(f"{type(provider).__name__} keeps no fleet permits")
        if not isinstance(name, str) or not name:
            raise ValueError(
                "a fleet needs a name shared by its members: pass name='payments' (a "
                f"non-empty str), not {name!r}"
            )
        self._provider = provider
        self._name = name
        self._limit = check_count(limit, "max_concurrency", 1)
        self._most = check_length(permit_at_most_for, "permit_at_most_for")
        self._demand_for = (
            min(3.0, self._most) if demand_for is None else check_length(demand_for, "demand_for")
        )
        self._rate = rate_args(check_rate(rate))
        self._group_ready_at = 0.0  # monotonic: the group's rate allows nobody before then
        self._rate_waits = 0
        self._rate_waited = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._lanes: dict[str, _Lane] = {}
        # rxcoord.fleet.permit.wait: when each waiting ticket asked (only while metrics are on).
        self._permit_tel = telemetry.fleet(name)
        self._begun: dict[
            AdmissionTicket, float
        ] = {}  # lanes with tickets, demand or a step in flight
        self._held: dict[int, FleetPermit] = {}
        self._releases: list[FleetPermit] = []
        self._releasing = False
        self._renewing = False
        self._workers = WorkerPool(_WORKERS, f"rxcoord-fleet-{name}")
        self._wake_timer: TimerHandle | None = None
        self._wake_at = float("inf")
        self._refresh_timer: TimerHandle | None = None
        self._renew_timer: TimerHandle | None = None
        self._poll = _POLL_FIRST
        self._sweeping = False
        self._sweep_again = False
        self._sweep_from = 0
        self._seen_running = 0
        self._seen_tenants: dict[str, int] = {}
        self._granted = 0
        self._lost = 0
        self._round_trips = 0
        self._store_errors = 0
        from .leases._permits import hub_name

        # One subscription for the admission's lifetime: waking on a release needs no
        # subscribe/confirm dance per wait (the callback only schedules work).
        self._watch = provider._hub.watch(hub_name(name), self._wake_all)

    # -- public ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def limit(self) -> int:
        return self._limit

    def lane(
        self,
        tenant: str,
        *,
        weight: float = 1.0,
        tenant_limit: int | None = None,
        rate: Rate | None = None,
    ) -> Admission:
        """The :class:`Admission` of one tenant (its jobs count against ``tenant_limit``, and
        start within ``rate``, the tenant's own :class:`~rxcoord.Rate`).

        Lanes of the same tenant (in any process) share its limit, its fair share and its
        rate's state (every member must give it the same rate).
        """
        from .leases._permits import rate_args

        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, not {tenant!r}")
        limit = self._limit
        if tenant_limit is not None:
            limit = check_count(tenant_limit, "tenant_limit", 1)
        return _LaneAdmission(
            self,
            tenant,
            check_weight(weight, "weight"),
            min(limit, self._limit),
            rate_args(check_rate(rate)),
        )

    def stats(self) -> FleetStats:
        """A snapshot (fleet-wide counts as last seen from the store)."""
        with self._lock:
            now = monotonic()
            limited = {
                lane.tenant: at - now
                for lane in self._lanes.values()
                if lane.waiting and (at := max(lane.ready_at, self._group_ready_at)) > now
            }
            return FleetStats(
                self._name,
                self._provider.backend,
                self._limit,
                self._seen_running,
                dict(self._seen_tenants),
                len(self._held),
                sum(len(lane.waiting) for lane in self._lanes.values()),
                self._granted,
                self._lost,
                self._round_trips,
                self._store_errors,
                self._rate_waits,
                self._rate_waited,
                limited,
            )

    def rate_stats(self, tenant: str | None = None) -> RateStats:
        """Waits for the rates: this process's, or (``tenant``) one tenant's jobs waiting now.

        The counts of past waits are per process (``stats()``); per tenant only what waits now
        is known here (``waits`` and ``waited`` are 0).
        """
        with self._lock:
            if tenant is None:
                waiting = sum(len(lane.held) for lane in self._lanes.values())
                return RateStats(self._rate_waits, self._rate_waited, waiting)
            lane = self._lanes.get(tenant)
            return RateStats(0, 0.0, 0 if lane is None else len(lane.held))

    def close(self) -> None:
        """Stop: withdraw this process's demand, release what is queued for release, stop the
        keep-alive. Jobs still running keep their permits until they expire (close the
        coordinators first, which waits for them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            timers = [self._wake_timer, self._refresh_timer, self._renew_timer]
            self._wake_timer = self._refresh_timer = self._renew_timer = None
            withdraw = [lane for lane in self._lanes.values() if lane.registered]
        for timer in timers:
            if timer is not None:
                timer.cancel()
        self._watch.close()
        for lane in withdraw:
            # The demand would expire after demand_for anyway: a failure changes nothing.
            with suppress(LeaseStoreUnavailable, LeaseStoreMisconfigured):
                self._acquire(lane, 0, False)
        self._flush()
        self._workers.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"<FleetAdmission {self._name!r} limit={self._limit} {self._provider!r}>"

    # -- admission (through _LaneAdmission) -----------------------------------------------------

    def _request(
        self, key: tuple[str, float, int, RateArgs | None], ticket: AdmissionTicket
    ) -> None:
        tenant, weight, tenant_limit, rate = key
        with self._lock:
            lane = self._lanes.get(tenant)
            if lane is None:
                lane = self._lanes[tenant] = _Lane(tenant, weight, tenant_limit, rate)
            lane.waiting.append(ticket)
            begun = self._permit_tel.begin()  # (0.0 while no metrics are recorded)
            if begun:
                self._begun[ticket] = begun
            start = self._kick(lane)
        if start:
            self._workers.submit(lambda: self._step(lane))

    def _withdraw(self, tenant: str, ticket: AdmissionTicket) -> bool:
        with self._lock:
            lane = self._lanes.get(tenant)
            if lane is None:
                return False
            try:
                lane.waiting.remove(ticket)
            except ValueError:
                return False
            lane.held.pop(ticket, None)
            begun = self._begun.pop(ticket, 0.0) if self._begun else 0.0
            # The last ticket left: take our demand back from the store, or a freed permit
            # would stay reserved for a tenant nobody here waits for any more.
            start = not lane.waiting and self._kick(lane)
        self._permit_tel.waited(begun, "cancelled")
        if start:
            self._workers.submit(lambda: self._step(lane))
        return True

    def _release(self, permit: object) -> None:
        if not isinstance(permit, FleetPermit):
            return  # a refused ticket (None): nothing was granted
        with self._lock:
            self._held.pop(permit.token, None)
            self._releases.append(permit)
            if self._releasing:
                return  # the flush in flight takes it along
            self._releasing = True
            closed = self._closed
        if closed:
            self._flush()  # a job that outlived close(): no workers any more, release here
        else:
            self._workers.submit(self._flush)

    # -- the store steps (on the workers) -------------------------------------------------------

    def _kick(self, lane: _Lane) -> bool:
        """Lane needs a store step (lock held): True if the caller must start one."""
        if lane.busy:
            lane.dirty = True
            return False
        lane.busy = True
        return True

    def _step(self, lane: _Lane) -> bool:
        """Ask the store for as many permits as the lane has tickets; hand them out.

        Returns True if the store said the fleet is at its limit (a sweep may stop there).
        """
        full = False
        while True:
            with self._lock:
                lane.dirty = False
                want = 0 if self._closed else min(len(lane.waiting), lane.tenant_limit)
                more = len(lane.waiting) > want
                if want == 0 and not lane.registered:
                    lane.busy = False
                    if not lane.waiting:
                        self._forget(lane)
                    return full
                ready_at = max(lane.ready_at, self._group_ready_at)
                if want and lane.registered and not lane.refresh and ready_at > monotonic():
                    # The store said the rates allow this tenant nothing before then: asking
                    # earlier could only be refused. (The one wake-up timer may be set for
                    # another lane's earlier time: make sure it comes back for this one.)
                    self._arm_wake(None, ready_at)
                    lane.busy = False
                    return full
                lane.refresh = False
                self._round_trips += 1
            sent = monotonic()
            try:
                reply = self._acquire(lane, want, more)
            except (LeaseStoreUnavailable, LeaseStoreMisconfigured) as exc:
                self._refuse(lane, exc)
                continue
            except Exception as exc:
                # Not a store error the backend mapped (a bug, a driver error it let through):
                # the same refusal, or the lane stays busy and its jobs wait forever.
                logger.opt(exception=True).error(
                    "rxcoord fleet {!r}: a permit step failed unexpectedly", self._name
                )
                self._refuse(lane, exc)
                continue
            received = monotonic()
            deadline = sent + self._most
            full = reply.running >= self._limit
            grants: list[tuple[AdmissionTicket, FleetPermit]] = []
            spare: list[FleetPermit] = []
            with self._lock:
                self._seen_running = reply.running
                self._seen_tenants[lane.tenant] = reply.tenant_running
                lane.registered = len(reply.tokens) < want or more
                for token in reply.tokens:
                    permit = FleetPermit(token, lane.tenant, deadline, reply.at)
                    if lane.waiting:
                        ticket = lane.waiting.popleft()
                        grants.append((ticket, permit))
                        self._held[token] = permit
                        since = lane.held.pop(ticket, None)
                        if since is not None:
                            self._rate_waits += 1
                            self._rate_waited += received - since
                    else:
                        spare.append(permit)  # its ticket was withdrawn meanwhile
                self._granted += len(grants)
                if grants and self._renew_timer is None and not self._closed:
                    self._renew_timer = call_later(self._most / 3, self._renew_soon)
                waiting = bool(lane.waiting)
                rate_at = None
                if waiting and len(reply.tokens) < want and reply.rate_wait > 0:
                    # Held back by a rate until then (by the store's clock: counted from the
                    # reply, which left the store after its step): no round trip before it.
                    rate_at = lane.ready_at = received + reply.rate_wait
                    if reply.group_rate_wait > 0:
                        self._group_ready_at = max(
                            self._group_ready_at, received + reply.group_rate_wait
                        )
                    for held in lane.waiting:
                        lane.held.setdefault(held, received)
                if waiting and (rate_at is not None or not reply.tokens):
                    self._arm_wake(reply.wake_in, rate_at)
                if grants:
                    self._poll = _POLL_FIRST
            for permit in spare:
                self._release(permit)
            for ticket, permit in grants:
                if self._begun:
                    with self._lock:
                        begun = self._begun.pop(ticket, 0.0)
                    self._permit_tel.waited(begun, "acquired")
                ticket.grant(permit)  # a job that left gives it back through _release
            with self._lock:
                if lane.dirty or (waiting and reply.tokens and not self._closed):
                    continue  # tickets came, went, or may get more now
                lane.busy = False
                if not lane.waiting and not lane.registered:
                    self._forget(lane)
                return full

    def _forget(self, lane: _Lane) -> None:
        """Drop an idle lane (lock held) - only if it is still the tenant's current lane: a
        sweep may step a lane after it was dropped and a new one made for new tickets."""
        if self._lanes.get(lane.tenant) is lane:
            del self._lanes[lane.tenant]

    def _acquire(self, lane: _Lane, want: int, more: bool) -> PermitReply:
        return self._provider._permits_acquire(
            self._name,
            lane.tenant,
            want,
            lane.weight,
            lane.tenant_limit,
            self._limit,
            self._most,
            self._demand_for,
            more,
            rate=self._rate,
            tenant_rate=lane.rate,
        )

    def _refuse(self, lane: _Lane, error: BaseException) -> None:
        """The store failed: the lane's waiting jobs fail with its error (new ones try again)."""
        with self._lock:
            self._store_errors += 1
            tickets = list(lane.waiting)
            lane.waiting.clear()
            lane.held.clear()
            lane.registered = False  # whatever we registered expires with demand_for
            begun = [self._begun.pop(t, 0.0) for t in tickets] if self._begun else []
        for stamp in begun:
            self._permit_tel.waited(stamp, "failed")
        for ticket in tickets:
            ticket.refuse(error)

    def _flush(self) -> None:
        """Release every permit queued for release, in one round trip."""
        while True:
            with self._lock:
                batch, self._releases = self._releases, []
                if not batch:
                    self._releasing = False
                    return
                self._round_trips += 1
            pairs = [(permit.token, permit.tenant) for permit in batch]
            try:
                held = self._provider._permits_release(self._name, pairs)
            except Exception:
                # A store error (or one the backend did not map): the permits expire by
                # themselves; nothing else to do about them (the next batch goes on).
                logger.opt(exception=True).warning(
                    "rxcoord fleet {!r}: releasing {} permits failed", self._name, len(batch)
                )
                with self._lock:
                    self._store_errors += 1
                continue
            known = sum(1 for permit in batch if permit.lost)  # counted by the keep-alive
            if held < len(batch) - known:
                with self._lock:
                    self._lost += len(batch) - known - held
            # Our own waiters step now rather than after the notification's trip through the
            # store and the listener thread (it comes too; if our sweep is still going, the
            # two coalesce into one more round).
            self._wake_all()

    # -- waking ---------------------------------------------------------------------------------

    def _wake_all(self) -> None:
        """A release (anywhere), an expiry time or a poll: the waiting lanes step again."""
        with self._lock:
            if self._closed:
                return
            self._sweep_again = True
            if self._sweeping:
                return  # the sweep in flight goes round once more
            self._sweeping = True
        self._workers.submit(self._sweep)

    def _sweep(self) -> None:
        """Step the waiting lanes one after another, until the store says the fleet is full.

        One release frees one permit: stepping every lane at once would cost a round trip
        per lane per release in every process, and all but one would come back empty. The
        store, not this order, decides who gets the permit (a lane ahead of its share finds
        it reserved and the sweep goes on to the next); the start rotates so that no lane
        always pays the first round trip.
        """
        while True:
            with self._lock:
                if not self._sweep_again or self._closed:
                    self._sweeping = False
                    return
                self._sweep_again = False
                lanes = [lane for lane in self._lanes.values() if lane.waiting]
                if lanes:
                    k = self._sweep_from % len(lanes)
                    lanes = lanes[k:] + lanes[:k]
                    self._sweep_from += 1
            for lane in lanes:
                with self._lock:
                    if self._lanes.get(lane.tenant) is not lane:
                        continue  # dropped since the snapshot (its successor is in _lanes)
                    if not self._kick(lane):
                        continue  # a step is in flight: it goes again when it returns
                if self._step(lane):
                    break

    def _arm_wake(self, wake_in: float | None, rate_at: float | None = None) -> None:
        """Lock held: wake at the reported expiry (or at ``rate_at``, when the rates allow the
        next start), poll while notifications are not certain, and keep our demand alive while
        we wait."""
        if self._closed:
            return
        now = monotonic()
        delay = float("inf") if wake_in is None else wake_in + _WAKE_MARGIN
        if rate_at is not None:
            delay = min(delay, max(0.0, rate_at - now))
        if not self._watch.confirmed:
            delay = min(delay, self._poll)
            self._poll = min(_POLL_MAX, self._poll * 2)
        at = now + delay
        if delay != float("inf") and at < self._wake_at:
            if self._wake_timer is not None:
                self._wake_timer.cancel()
            self._wake_at = at
            self._wake_timer = call_later(delay, self._woken)
        if self._refresh_timer is None:
            self._refresh_timer = call_later(self._demand_for / 3, self._refresh)

    def _woken(self) -> None:
        with self._lock:
            self._wake_timer = None
            self._wake_at = float("inf")
        self._wake_all()

    def _refresh(self) -> None:
        with self._lock:
            self._refresh_timer = None
            again = False
            if not self._closed:
                for lane in self._lanes.values():
                    if lane.waiting:
                        lane.refresh = again = True  # even a lane waiting for its rate
            if again:
                self._refresh_timer = call_later(self._demand_for / 3, self._refresh)
        if again:
            self._wake_all()  # a step refreshes the demand (and may find a permit)

    # -- keep-alive -----------------------------------------------------------------------------

    def _renew_soon(self) -> None:
        # The timer thread must not make round trips: hand the renewal to a worker.
        with self._lock:
            self._renew_timer = None
            if self._closed or self._renewing:
                return
            self._renewing = True
        self._workers.submit(self._renew)

    def _renew(self) -> None:
        with self._lock:
            permits = list(self._held.values())
            self._round_trips += 1 if permits else 0
        try:
            if permits:
                sent = monotonic()
                lost = self._provider._permits_extend(
                    self._name,
                    [(p.token, p.tenant) for p in permits],
                    self._most,
                    timeout=max(0.001, min(p._deadline for p in permits) - sent),
                )
                gone = set(lost)
                with self._lock:
                    for permit in permits:
                        if permit.token in gone:
                            permit.lost = True
                            self._lost += 1
                            self._held.pop(permit.token, None)
                        else:
                            permit._deadline = sent + self._most
                if lost:
                    logger.warning(
                        "rxcoord fleet {!r}: {} permits were reclaimed before their jobs "
                        "ended (they get LeaseLost)",
                        self._name,
                        len(lost),
                    )
        except (LeaseStoreUnavailable, LeaseStoreMisconfigured):
            # Retried at the next period; permits past their deadline count as lost locally.
            logger.opt(exception=True).warning(
                "rxcoord fleet {!r}: renewing permits failed", self._name
            )
            with self._lock:
                self._store_errors += 1
        finally:
            with self._lock:
                self._renewing = False
                if self._held and not self._closed and self._renew_timer is None:
                    self._renew_timer = call_later(self._most / 3, self._renew_soon)


class _LaneAdmission:
    """One tenant of a :class:`FleetAdmission`, as an :class:`Admission`."""

    __slots__ = ("_fleet", "_key")

    def __init__(
        self,
        fleet: FleetAdmission,
        tenant: str,
        weight: float,
        limit: int,
        rate: RateArgs | None,
    ) -> None:
        self._fleet = fleet
        self._key = (tenant, weight, limit, rate)

    def request(self, ticket: AdmissionTicket) -> None:
        self._fleet._request(self._key, ticket)

    def withdraw(self, ticket: AdmissionTicket) -> bool:
        return self._fleet._withdraw(self._key[0], ticket)

    def release(self, permit: object) -> None:
        self._fleet._release(permit)

    @property
    def fleet(self) -> FleetAdmission:
        return self._fleet

    def stats(self) -> RateStats:
        """This tenant's jobs waiting for a rate now (see :meth:`FleetAdmission.rate_stats`)."""
        return self._fleet.rate_stats(self._key[0])
