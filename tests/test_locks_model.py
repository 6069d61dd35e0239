"""KeyedLocks against a model of its one rule, driven by hypothesis - twice.

Once through the facade (Observables, try-locks, stats, as a user sees them) and once against
the pure grant table directly (``rxcoord/_locks/_table.py``: enqueue, take out, withdraw, and
the grants each transition returns), so a failure says which layer broke the rule.

The rule (see ``rxcoord/_locks/_table.py``): a request is granted exactly when no earlier *present*
request (granted and not released, or waiting) conflicts with it; two requests conflict when
they share a key or either is global. So the set of granted requests is a pure function of the
sequence of present requests, and after every step of any interleaving of requests (single, bulk
in any key order, global), releases, withdrawals (disposal) and try-locks, the implementation
must have granted - and delivered - exactly the requests the model says, and kept exactly the
state the model implies (no leaked keys). This one check covers exclusion, FIFO among
conflicting requests, eager granting of non-conflicting ones, all-or-nothing bulk grants and the
global barrier, including for keys never seen before.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reactivex import abc

from rxcoord import KeyedLocks, Lease
from rxcoord._errors import LeaseReleasedError, LockTimeout
from rxcoord._locks._table import DONE, HELD, PENDING, GrantTable
from rxcoord._locks._table import Request as TableRequest

KEYS = ("a", "b", "c", "d", "e")


@dataclass(eq=False)
class Request:
    number: int
    keys: frozenset[Hashable]
    is_global: bool
    subscription: abc.DisposableBase | None = None
    leases: list[Lease] = field(default_factory=list)  # what the subscriber received

    def conflicts(self, other: Request) -> bool:
        return self.is_global or other.is_global or bool(self.keys & other.keys)


def expected_granted(present: list[Request]) -> list[Request]:
    """The model: the present requests that no earlier present request conflicts with."""
    return [r for i, r in enumerate(present) if not any(e.conflicts(r) for e in present[:i])]


class KeyedLocksMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.locks = KeyedLocks()
        self.present: list[Request] = []  # in request order
        self.numbers = itertools.count()
        self.cancelled = 0

    def _subscribe(self, request: Request) -> None:
        if request.is_global:
            source = self.locks.acquire_all()
        elif len(request.keys) == 1 and request.number % 2:
            (key,) = request.keys
            source = self.locks.acquire(key)
        else:
            source = self.locks.acquire_many(sorted(request.keys, key=str))
        request.subscription = source.subscribe(request.leases.append)

    @rule(key=st.sampled_from(KEYS))
    def request_one(self, key: str) -> None:
        request = Request(next(self.numbers), frozenset({key}), False)
        self.present.append(request)
        self._subscribe(request)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def request_many(self, keys: list[str]) -> None:
        request = Request(next(self.numbers), frozenset(keys), False)
        self.present.append(request)
        # Random key order (with duplicates): the grant must not depend on it.
        request.subscription = self.locks.acquire_many(keys).subscribe(request.leases.append)

    @rule()
    def request_all(self) -> None:
        request = Request(next(self.numbers), frozenset(), True)
        self.present.append(request)
        self._subscribe(request)

    @precondition(lambda self: any(r.leases for r in self.present))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = [r for r in self.present if r.leases]
        request = data.draw(st.sampled_from(held))
        self.present.remove(request)
        request.leases[0].release()
        with pytest.raises(LeaseReleasedError):
            request.leases[0].release()

    @precondition(lambda self: any(not r.leases for r in self.present))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        waiting = [r for r in self.present if not r.leases]
        request = data.draw(st.sampled_from(waiting))
        self.present.remove(request)
        assert request.subscription is not None
        request.subscription.dispose()
        self.cancelled += 1

    @precondition(lambda self: any(r.leases for r in self.present))
    @rule(data=st.data())
    def dispose_after_grant(self, data: st.DataObject) -> None:
        # Disposing a subscription whose lease was already delivered changes nothing.
        request = data.draw(st.sampled_from([r for r in self.present if r.leases]))
        assert request.subscription is not None
        request.subscription.dispose()

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def try_lock(self, keys: list[str]) -> None:
        # timeout=0 succeeds exactly when the request would be granted at once, and a failed
        # attempt leaves no trace. An empty list stands for a global try-lock.
        probe = Request(-1, frozenset(keys), not keys)
        free = not any(r.conflicts(probe) for r in self.present)
        if not keys:
            lease = self.locks.hold_all(timeout=0)
        elif len(keys) == 1:
            lease = self.locks.hold(keys[0], timeout=0)
        else:
            lease = self.locks.hold_many(keys, timeout=0)
        if free:
            with lease:
                assert not lease.released
            assert lease.released
        else:
            with pytest.raises(LockTimeout), lease:
                pass

    @invariant()
    def grants_follow_the_rule(self) -> None:
        expected = expected_granted(self.present)
        actual = [r for r in self.present if r.leases]
        assert actual == expected
        for request in self.present:
            assert len(request.leases) <= 1  # one lease per subscription, ever
            for lease in request.leases:
                assert not lease.released
                assert lease.keys == request.keys
                assert lease.is_global == request.is_global

    @invariant()
    def state_matches_the_model(self) -> None:
        keys = set().union(*(r.keys for r in self.present))
        assert len(self.locks) == len(keys)  # no key without a present request: no leak
        stats = self.locks.stats()
        granted = expected_granted(self.present)
        assert stats.held == len(granted)
        assert stats.waiting == len(self.present) - len(granted)
        assert stats.global_held == any(r.is_global for r in granted)
        assert stats.global_waiting == sum(r.is_global and r not in granted for r in self.present)
        assert stats.cancelled_total == self.cancelled

    def teardown(self) -> None:
        # Release everything in any order: all must drain to an empty KeyedLocks.
        while self.present:
            granted = [r for r in self.present if r.leases]
            assert granted  # something is always granted while anything is present
            for request in granted:
                self.present.remove(request)
                request.leases[0].release()
        assert len(self.locks) == 0
        assert self.locks.stats().waiting == 0


TestKeyedLocksModel = KeyedLocksMachine.TestCase
TestKeyedLocksModel.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- the grant table alone ------------------------------------------------------------------------


class GrantTableMachine(RuleBasedStateMachine):
    """The same model, checked against :class:`GrantTable` with no lock, thread or delivery.

    A request counts as granted when ``_enqueue`` returned True or a later transition returned
    it among its grants: each grant is reported exactly once, by the transition that made it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = GrantTable()
        self.present: list[Request] = []
        self.requests: dict[Request, TableRequest] = {}
        self.granted: set[Request] = set()
        self.by_table: dict[TableRequest, Request] = {}
        self.numbers = itertools.count()

    def _add(self, keys: list[str], is_global: bool) -> None:
        request = Request(next(self.numbers), frozenset(keys), is_global)
        # Keys in the caller's order, deduplicated (as KeyedLocks' _check_keys does).
        entry = TableRequest(() if is_global else tuple(dict.fromkeys(keys)))
        self.present.append(request)
        self.requests[request] = entry
        self.by_table[entry] = request
        if self.table._enqueue(entry):
            self.granted.add(request)
        else:
            assert entry._state == PENDING

    def _granted(self, grants: list[TableRequest] | None) -> None:
        for entry in grants or ():
            request = self.by_table[entry]
            assert request not in self.granted, "a grant reported twice"
            assert entry._state == HELD
            self.granted.add(request)

    @rule(key=st.sampled_from(KEYS))
    def request_one(self, key: str) -> None:
        self._add([key], False)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
    def request_many(self, keys: list[str]) -> None:
        self._add(keys, False)

    @rule()
    def request_all(self) -> None:
        self._add([], True)

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.present if r in self.granted]))
        self.present.remove(request)
        self.granted.remove(request)
        entry = self.requests.pop(request)
        self._granted(self.table._take_out(entry))
        assert entry._state == DONE

    @precondition(lambda self: len(self.granted) < len(self.present))
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.present if r not in self.granted]))
        self.present.remove(request)
        entry = self.requests.pop(request)
        self._granted(self.table._withdraw(entry))
        assert entry._state == DONE

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def probe(self, keys: list[str]) -> None:
        # _can_grant_now (the try-lock's question) answers the model and changes nothing.
        probe = Request(-1, frozenset(keys), not keys)
        free = not any(r.conflicts(probe) for r in self.present)
        before = len(self.table._queues)
        assert self.table._can_grant_now(TableRequest(tuple(keys))) == free
        assert len(self.table._queues) == before

    @invariant()
    def grants_follow_the_rule(self) -> None:
        expected = expected_granted(self.present)
        assert [r for r in self.present if r in self.granted] == expected
        for request in self.present:
            state = self.requests[request]._state
            assert state == (HELD if request in self.granted else PENDING)

    @invariant()
    def state_matches_the_model(self) -> None:
        keys = set().union(*(r.keys for r in self.present))
        assert set(self.table._queues) == keys  # no key without a present request: no leak
        counts = self.table._counts()
        assert counts.keys == len(keys)
        assert counts.held == len(self.granted)
        assert counts.waiting == len(self.present) - len(self.granted)
        assert counts.global_held == any(r.is_global for r in self.granted)
        assert counts.global_waiting == sum(
            r.is_global and r not in self.granted for r in self.present
        )

    def teardown(self) -> None:
        while self.present:
            granted = [r for r in self.present if r in self.granted]
            assert granted
            for request in granted:
                self.present.remove(request)
                self.granted.remove(request)
                self._granted(self.table._take_out(self.requests.pop(request)))
        assert not self.table._queues
        assert self.table._first is self.table._tail  # no segment left behind


TestGrantTableModel = GrantTableMachine.TestCase
TestGrantTableModel.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
