"""The grant table of KeyedLocks: who is granted, decided by one rule. Pure state, no threads.

Why not the textbook design? A refcounted dict of ``Semaphore(1)`` ties a waiting operation to a
blocked thread, a ``bulk_mutex`` serialises every bulk operation (even on disjoint keys), and a
global operation polls a counter with ``sleep(0.1)`` behind a fair read-write lock. Here one small
state machine serves every kind of request; the facade (``_facade.py``) guards it with one
internal ``threading.Lock``, waiting blocks no thread (a waiter is a queue entry that is
*notified*, see ``_waiting.py``), and per-key state exists only while someone holds or waits for
the key.

This module knows nothing of threads, Rx or delivery: a transition takes a request in or out
and *returns* the requests it granted; telling them is the caller's business, after it has let
go of its lock. So the table can be driven directly, step by step, against the hypothesis model
in ``tests/test_locks_model.py``.

The rule
--------
Every request - one key, several keys, or *global* - takes its place in a single request order
when it is made. Two requests *conflict* when they share a key or either is global. A request is
*present* from the moment it is made until it is released (if granted) or withdrawn (timeout or
disposal). The whole algorithm implements one rule:

    **A request is granted exactly when no earlier present request conflicts with it.**

Everything KeyedLocks promises follows from it:

* *exclusion* - two granted requests never conflict (the later one would have had an earlier
  present conflicting request);
* *FIFO among conflicting requests* - a request never overtakes an earlier one it conflicts with,
  so neither single, bulk nor global requests can be starved by a stream of others;
* *eagerness* - a request conflicting with nothing earlier is granted at once (no bulk mutex:
  bulk requests on disjoint keys run in parallel);
* *all-or-nothing bulk* - a bulk request is granted in one step or not at all; nothing is held
  while waiting, so no key order can deadlock;
* *global barrier* - a global request conflicts with everything, so no request made after it
  (on any key, seen or never seen) is granted before it, and it is granted when every earlier
  request is gone. Event-driven: the release that removes the last earlier request grants it.

Because the set of granted requests is a pure function of the sequence of present requests, the
hypothesis test checks the implementation against a ten-line model of that rule.

The data structures
-------------------
*Per-key queues.* ``_queues[key]`` holds the present non-global requests on ``key`` in request
order: the bare request when it is the only one (the uncontended case allocates no queue), a
``deque`` otherwise. A granted request is at the head of each of its keys' queues. Each pending
request counts, in ``_waiting``, the keys whose queue it is not the head of; when a head leaves,
the next request's count drops, and at zero it conflicts with nothing earlier *on any key*.

*Segments and barriers* (for global requests, without ever scanning keys). Global requests cut
the request order into segments::

    [ segment 0 ] G1 [ segment 1 ] G2 [ segment 2 = tail ]

A ``_Segment`` counts its present non-global requests; its ``barrier`` is the global request that
closes it. Only the first segment (``_first``) is free of earlier global requests, so:

* a non-global request is granted when ``_waiting == 0`` *and* its segment is ``_first``; when
  ``_waiting`` reaches zero in a later segment, it parks in that segment's ``ready`` set (and
  leaves it if withdrawn);
* the first global request ``_first.barrier`` is granted when ``_first.count == 0``;
* releasing it makes the next segment first and grants its ``ready`` requests (and the next
  global request, if that segment is empty);
* withdrawing a *pending* global request merges the segment after it into the one before it
  (``merged`` pointers, resolved lazily like a union-find), since nothing separates them now.

With no global request present, ``_first is _tail`` and the global machinery costs one identity
check per request.

Cost: a request or release does O(its keys) dict work plus O(1) per waiter it promotes; a
withdrawal also removes itself from the middle of its keys' queues (O(conflicting waiters)). The
caller's lock is held for exactly that, never while user code runs (except the keys' own
``__hash__``/``__eq__``, as in any dict).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Final

__all__ = ["DONE", "HELD", "NEW", "PENDING", "GrantTable", "Request", "TableCounts"]

# Request states: NEW (made, not entered into the table yet), PENDING (waiting), HELD (granted)
# and DONE (released or withdrawn). A request is *present* while PENDING or HELD. Ints: they are
# compared on the hot paths.
NEW: Final = 0
PENDING: Final = 1
HELD: Final = 2
DONE: Final = 3


class Request:
    """One request's place in the table: its keys and its progress through the rule.

    :class:`~rxcoord._locks._lease.Lease` extends it, so the uncontended path allocates one
    object (the lease *is* the request). Only the table (under its owner's lock) writes these.
    """

    __slots__ = ("_before", "_keys", "_segment", "_state", "_waiting")

    _keys: tuple[Hashable, ...]  # distinct keys in request order; () for a global request
    _state: int
    _waiting: int  # keys whose queue this pending request is not yet the head of
    _segment: _Segment  # non-global: its segment; global: the segment it opens
    _before: _Segment  # global only: the segment it closes

    def __init__(self, keys: tuple[Hashable, ...]) -> None:
        self._keys = keys
        self._state = NEW

    # No public ``state`` property: Lease inherits from this class, and its public face is
    # ``released`` (the states are the table's business).


class _Segment:
    """A run of the request order between two global requests (see the module docstring)."""

    __slots__ = ("barrier", "count", "merged", "ready")

    def __init__(self) -> None:
        self.count = 0  # present (held or pending) non-global requests in this segment
        self.barrier: Request | None = None  # the global request that closes the segment
        self.merged: _Segment | None = None  # absorbed into this earlier segment
        # Pending requests at the head of all their keys' queues, held back only by an earlier
        # global request; granted when this segment becomes the first. A dict used as an
        # insertion-ordered set: a request withdrawn meanwhile leaves it at once (O(1)), so a
        # long-held global barrier cannot accumulate withdrawn requests.
        self.ready: dict[Request, None] | None = None


def _resolve(request: Request) -> _Segment:
    """The live segment of a non-global request (following merges, compressing the path)."""
    seg = request._segment
    if seg.merged is not None:
        while seg.merged is not None:
            seg = seg.merged
        request._segment = seg
    return seg


class TableCounts:
    """What the table holds right now (see :meth:`GrantTable._counts`)."""

    __slots__ = ("global_held", "global_waiting", "held", "keys", "waiting")

    def __init__(
        self, keys: int, held: int, waiting: int, global_held: bool, global_waiting: int
    ) -> None:
        self.keys = keys
        self.held = held
        self.waiting = waiting
        self.global_held = global_held
        self.global_waiting = global_waiting


class GrantTable:
    """The present requests and which of them are granted; the rule of the module docstring.

    Not thread-safe: the owner serialises every call (KeyedLocks holds its mutex). Transitions
    return the requests they granted (``None`` for none, to allocate nothing on the common
    path); the caller tells them once it has let go of its lock.

    Its methods are underscore-named because :class:`~rxcoord._locks._facade.KeyedLocks`
    *extends* the table instead of holding one: the inlined hot paths of ``Lease`` then read the
    table's fields with one attribute lookup, and the facade's public namespace stays its own.
    """

    __slots__ = ("_contended", "_first", "_globals", "_pending", "_queues", "_tail")

    def __init__(self) -> None:
        self._queues: dict[Hashable, Request | deque[Request]] = {}
        self._first = self._tail = _Segment()
        self._pending = 0  # requests waiting
        self._globals = 0  # global requests present (held or waiting)
        self._contended = 0  # requests that could not be granted at once, ever

    # -- transitions ---------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> bool:
        """Make a NEW ``request`` present; grant it and return True if nothing earlier conflicts.

        A key whose ``__hash__``/``__eq__`` raises midway leaves no trace (the exception
        propagates, the request stays NEW).
        """
        if not request._keys:
            return self._enqueue_global(request)
        queues = self._queues
        seg = self._tail
        waiting = 0
        done = 0
        try:
            for key in request._keys:
                entry = queues.setdefault(key, request)
                if entry is not request:
                    if isinstance(entry, deque):
                        entry.append(request)
                    else:
                        queues[key] = deque((entry, request))
                    waiting += 1
                done += 1
        except BaseException:
            # A key's __hash__/__eq__ misbehaved midway: undo, so no half-request lingers.
            for key in request._keys[:done]:
                self._unqueue(key, request)
            raise
        seg.count += 1
        request._segment = seg
        if not waiting and seg is self._first:
            request._state = HELD
            return True
        request._waiting = waiting
        request._state = PENDING
        self._pending += 1
        self._contended += 1
        if not waiting:  # free keys, but an earlier global request is present
            self._park(seg, request)
        return False

    def _enqueue_global(self, request: Request) -> bool:
        before = self._tail
        after = _Segment()
        before.barrier = request
        request._before = before
        request._segment = after
        self._tail = after
        self._globals += 1
        if before is self._first and not before.count:
            request._state = HELD
            return True
        request._state = PENDING
        self._pending += 1
        self._contended += 1
        return False

    def _can_grant_now(self, request: Request) -> bool:
        """Would ``request`` be granted at once? (For try-locks, which must not leave a trace.)"""
        if self._tail is not self._first:
            return False
        if not request._keys:
            return not self._first.count
        queues = self._queues
        return all(key not in queues for key in request._keys)

    def _take_out(self, request: Request) -> list[Request] | None:
        """Release a HELD request (it becomes DONE); return the requests that grants."""
        keys = request._keys
        if len(keys) == 1 and self._tail is self._first:
            # One key and no global request present, the common case (bench_asyncio's
            # "hold_async contended" row): the request heads its key's queue in the only
            # segment, and the one request it can grant is the next on that key.
            request._state = DONE
            self._first.count -= 1
            queues = self._queues
            key = keys[0]
            entry = queues[key]
            if entry is request:
                del queues[key]
                return None
            assert isinstance(entry, deque)
            entry.popleft()
            if not entry:
                del queues[key]
                return None
            head = entry[0]
            head._waiting -= 1
            if head._waiting:
                return None
            head._state = HELD
            self._pending -= 1
            return [head]
        granted = self._remove(request) if keys else self._remove_global(request)
        request._state = DONE
        return granted

    def _withdraw(self, request: Request) -> list[Request] | None:
        """Withdraw a PENDING request (it becomes DONE); return the requests that grants."""
        granted = self._remove(request) if request._keys else self._remove_global(request)
        request._state = DONE
        self._pending -= 1
        return granted

    # -- observation ---------------------------------------------------------------------------

    def _counts(self) -> TableCounts:
        """Keys with state, held and waiting requests (O(global requests present))."""
        # Held requests are not counted on the hot path; derive them from the segments'
        # present-request counts.
        present = 0
        seg = self._first
        while True:
            present += seg.count
            if seg.barrier is None:
                break
            seg = seg.barrier._segment
        barrier = self._first.barrier
        global_held = barrier is not None and barrier._state == HELD
        global_waiting = self._globals - global_held
        return TableCounts(
            keys=len(self._queues),
            held=present - (self._pending - global_waiting) + global_held,
            waiting=self._pending,
            global_held=global_held,
            global_waiting=global_waiting,
        )

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _park(seg: _Segment, request: Request) -> None:
        if seg.ready is None:
            seg.ready = {request: None}
        else:
            seg.ready[request] = None

    def _grant(self, request: Request, granted: list[Request] | None) -> list[Request]:
        request._state = HELD
        self._pending -= 1
        if granted is None:
            return [request]
        granted.append(request)
        return granted

    def _promote(self, head: Request, granted: list[Request] | None) -> list[Request] | None:
        """``head`` became the head of one more of its keys' queues."""
        head._waiting -= 1
        if head._waiting:
            return granted
        seg = _resolve(head)
        if seg is self._first:
            return self._grant(head, granted)
        self._park(seg, head)
        return granted

    def _unqueue(self, key: Hashable, request: Request) -> None:
        """Undo a partial enqueue of ``request`` on ``key`` (where it is last in the queue)."""
        queues = self._queues
        entry = queues[key]
        if entry is request:
            del queues[key]
        else:
            assert isinstance(entry, deque)
            entry.remove(request)  # identity: requests keep object equality

    def _segment_left(self, seg: _Segment, granted: list[Request] | None) -> list[Request] | None:
        """A non-global request left ``seg``: the first global request may now be due."""
        seg.count -= 1
        if not seg.count and seg.barrier is not None and seg is self._first:
            return self._grant(seg.barrier, granted)
        return granted

    def _remove(self, request: Request) -> list[Request] | None:
        """Take a released or withdrawn non-global request out; return what that grants."""
        granted: list[Request] | None = None
        queues = self._queues
        seg = _resolve(request)
        if request._state == PENDING and not request._waiting:
            # Withdrawn while parked behind a global request: leave the ready set now rather
            # than when the segment becomes first, which may be never (memory, not just time).
            ready = seg.ready
            assert ready is not None
            del ready[request]
        for key in request._keys:
            entry = queues[key]
            if entry is request:
                del queues[key]
                continue
            assert isinstance(entry, deque)
            if entry[0] is request:
                entry.popleft()
                if entry:
                    granted = self._promote(entry[0], granted)
                else:
                    del queues[key]
            else:  # only a pending request can be behind others
                entry.remove(request)
        return self._segment_left(seg, granted)

    def _remove_global(self, request: Request) -> list[Request] | None:
        """Take a released or withdrawn global request out; return what that grants."""
        self._globals -= 1
        after = request._segment
        if request._state == HELD:
            # It was first and alone: the segment after it becomes the first.
            self._first = first = after
        else:
            # Withdrawn while pending: nothing separates the segments around it any more.
            before = request._before
            after.merged = before
            before.count += after.count
            before.barrier = after.barrier
            if before.barrier is not None:
                before.barrier._before = before
            if self._tail is after:
                self._tail = before
            ready, after.ready = after.ready, None
            if before is not self._first:
                if ready:
                    if before.ready is None:
                        before.ready = ready
                    else:
                        before.ready.update(ready)  # after's requests come later: order kept
                return None
            # The first segment has no parked requests (they are granted at once), so the
            # merged segment's are exactly those that were held back by ``request``.
            before.ready = ready
            first = before
        granted: list[Request] | None = None
        ready, first.ready = first.ready, None
        if ready:
            for waiter in ready:  # all pending: a withdrawn request leaves the set
                granted = self._grant(waiter, granted)
        if not first.count and first.barrier is not None:
            granted = self._grant(first.barrier, granted)
        return granted
