"""The lane table: per-key FIFO lanes under a cap on active items. Pure state, no threads, no Rx.

Every layer of rxcoord that orders work by key needs the same thing: ``serialize_by_key`` (one
inner Observable per key at a time), the coordinator (one job per key at a time, at most
``max_concurrency`` running) and the Kafka dispatcher (one record per key at a time, at most
``max_concurrency`` in flight). This module is that thing, written once; its owners guard it with
their own lock and do everything else (subscribing, running, delivering) outside it.

The rule
--------
Items enter with a key. The items of one key form its *lane*, in arrival order; the first item of
a lane is its *head*. A head is *active* (it holds one of the ``cap`` slots), *ready* (its turn
came but every slot is taken) or *suspended* (it keeps its key but gave its slot back, e.g. a job
waiting for its next attempt). Then:

* an item starts only as the head of its lane: never before every earlier item of its key has
  finished (per-key order, one at a time);
* at most ``cap`` heads are active;
* ready heads start in the order they became ready, as soon as a slot frees (no key starves);
* an item that arrives while its key is idle and a slot is free starts at once.

A slot is free exactly when no head is ready (a ready head takes the first free slot), so
"start at once" never overtakes anybody.

Transitions *return* what they started: :meth:`add` says whether the new item starts now, and
:meth:`finish`, :meth:`suspend` and :meth:`resume` return the item that takes the slot they
freed. Telling those items is the owner's business, after it has let go of its lock. The owner
may also give items a key of their own that no other item shares (an unkeyed job is its own
key): they then only share the cap.

State lives only while a key has work: an idle key leaves nothing behind. A lane of one item is
the bare item (the uncontended case allocates no queue).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator, KeysView
from typing import Any, Generic, TypeVar

__all__ = ["LaneTable"]

_K = TypeVar("_K", bound=Hashable)
_T = TypeVar("_T")


class _Queue(deque[Any]):
    """A lane of several items (its head first); a lane of one is the bare item."""

    __slots__ = ()


class LaneTable(Generic[_K, _T]):
    """Per-key FIFO lanes with at most ``cap`` active heads; see the module docstring.

    Not thread-safe: the owner holds its lock around every call.
    """

    __slots__ = ("_lanes", "_ready", "active", "cap")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.active = 0  # heads holding a slot
        self._lanes: dict[_K, Any] = {}  # key -> its head, or a _Queue with the head first
        self._ready: deque[_K] = deque()  # keys whose head waits for a slot, in order

    def __len__(self) -> int:
        """Keys with work (an active, ready or suspended head)."""
        return len(self._lanes)

    @property
    def idle(self) -> bool:
        """True when no key has work and no slot is taken."""
        return not self._lanes and not self.active

    def keys(self) -> KeysView[_K]:
        """A live view of the keys with work. An owner may read it without its lock as a hint
        that only the thread which adds keys can rely on (the Kafka dispatcher's inline check)."""
        return self._lanes.keys()

    @property
    def ready(self) -> int:
        """Heads waiting for a slot."""
        return len(self._ready)

    def add(self, key: _K, item: _T) -> bool:
        """``item`` enters at the back of ``key``'s lane; True if it starts now (takes a slot).

        False: it waits behind its key's earlier items, or (its key idle, every slot taken) as
        a ready head.
        """
        lanes = self._lanes
        lane = lanes.get(key, _NONE)
        if lane is not _NONE:
            if type(lane) is _Queue:
                lane.append(item)
            else:
                lanes[key] = _Queue((lane, item))
            return False
        lanes[key] = item
        if self.active < self.cap:
            self.active += 1
            return True
        self._ready.append(key)
        return False

    def head(self, key: _K) -> _T:
        """The head of ``key``'s lane (the key must have work)."""
        lane = self._lanes[key]
        return lane[0] if type(lane) is _Queue else lane  # type: ignore[no-any-return]

    def finish(self, key: _K) -> _T | None:
        """The active head of ``key`` is done: it leaves, and its slot goes on.

        The next item of ``key`` becomes a ready head; the freed slot goes to the oldest ready
        head, which is returned (it starts now), or stays free (None).
        """
        # _pop and _fill inlined: every job of every owner ends here (bench_asyncio's rows).
        lanes = self._lanes
        lane = lanes[key]
        ready = self._ready
        if type(lane) is _Queue:
            lane.popleft()
            if len(lane) == 1:
                lanes[key] = lane[0]
            ready.append(key)
        else:
            del lanes[key]
        if ready:  # (ready heads exist only while every slot is taken: the freed one goes on)
            lane = lanes[ready.popleft()]
            return lane[0] if type(lane) is _Queue else lane  # type: ignore[no-any-return]
        self.active -= 1
        return None

    def drop(self, key: _K) -> _T | None:
        """The suspended head of ``key`` leaves without a slot (say, cancelled while waiting).

        Its key goes to its next item, which starts now if a slot is free (returned).
        """
        self._pop(key)
        return self._fill()

    def suspend(self, key: _K) -> _T | None:
        """The active head of ``key`` gives its slot back but keeps its key.

        Returns the ready head that takes the slot (it starts now), if any.
        """
        self.active -= 1
        return self._fill()

    def resume(self, key: _K) -> bool:
        """The suspended head of ``key`` wants a slot again; True if it takes one now.

        False: it waits as a ready head, behind the heads that were ready before it.
        """
        if self.active < self.cap:
            self.active += 1
            return True
        self._ready.append(key)
        return False

    def _pop(self, key: _K) -> None:
        """Remove ``key``'s head; a next item becomes a ready head."""
        lanes = self._lanes
        lane = lanes[key]
        if type(lane) is _Queue:
            lane.popleft()
            if len(lane) == 1:
                lanes[key] = lane[0]
            self._ready.append(key)
        else:
            del lanes[key]

    def _fill(self) -> _T | None:
        """Give one free slot to the oldest ready head, if there is a free slot and a ready head."""
        ready = self._ready
        if ready and self.active < self.cap:
            self.active += 1
            lane = self._lanes[ready.popleft()]
            return lane[0] if type(lane) is _Queue else lane  # type: ignore[no-any-return]
        return None

    def items(self) -> Iterator[_T]:
        """Every item in the table: heads (active, ready or suspended) and the items behind them."""
        for lane in list(self._lanes.values()):
            if type(lane) is _Queue:
                yield from list(lane)
            else:
                yield lane

    def longest(self) -> int:
        """The most items any one key has (0 when idle)."""
        return max(
            (len(lane) if type(lane) is _Queue else 1 for lane in self._lanes.values()), default=0
        )

    def purge(self, is_dead: Callable[[_T], bool]) -> int:
        """Remove every item that has not started and for which ``is_dead`` is true; how many.

        Items that never started are the ready heads and everything behind a head; active and
        suspended heads stay. Order is kept. ``is_dead`` runs under the owner's lock: a cheap
        check. The cost is one pass over the items.
        """
        waiting = set(self._ready)
        removed = 0
        lanes = self._lanes
        for key in list(lanes):
            lane = lanes[key]
            items = list(lane) if type(lane) is _Queue else [lane]
            head_started = key not in waiting
            kept = items[:1] if head_started else []
            kept += [item for item in items[len(kept) :] if not is_dead(item)]
            removed += len(items) - len(kept)
            if not kept:
                del lanes[key]
            elif len(kept) == 1:
                lanes[key] = kept[0]
            elif len(kept) < len(items):
                lanes[key] = _Queue(kept)
        if removed:
            # A ready key whose items all went leaves the ready FIFO; the others keep their place.
            self._ready = deque(key for key in self._ready if key in lanes)
        return removed

    def clear(self) -> list[_T]:
        """Empty the table; every item it held (the owner tears them down)."""
        items = list(self.items())
        self._lanes.clear()
        self._ready.clear()
        self.active = 0
        return items


_NONE: Any = object()  # "no lane": items may be None, so the dict's default must be private
