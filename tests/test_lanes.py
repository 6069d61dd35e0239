"""The lane table (``rxcoord._core.lanes``) against a reference model of its rule.

The rule: an item starts only as the head of its key's lane (every earlier item of its key has
finished), at most ``cap`` heads hold a slot, heads whose turn came over the cap start in the
order their turn came, and an item that arrives to an idle key with a free slot starts at once.
The model below is that rule written as plainly as possible (lists, no cleverness); hypothesis
drives random adds, finishes, suspends, resumes, drops and purges through both, and every step
must start exactly the same items.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rxcoord._core.lanes import LaneTable


class Item:
    def __init__(self, key: str, n: int) -> None:
        self.key = key
        self.n = n
        self.dead = False

    def __repr__(self) -> str:
        return f"{self.key}{self.n}{'x' if self.dead else ''}"


class Model:
    """The rule, plainly: lanes as lists, ready heads as a list of keys, a set of slot holders."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lanes: dict[str, list[Item]] = {}
        self.ready: list[str] = []  # keys whose head waits for a slot, in the order it came
        self.holding: set[str] = set()  # keys whose head holds a slot

    def _fill(self) -> Item | None:
        if self.ready and len(self.holding) < self.cap:
            key = self.ready.pop(0)
            self.holding.add(key)
            return self.lanes[key][0]
        return None

    def add(self, item: Item) -> bool:
        lane = self.lanes.setdefault(item.key, [])
        lane.append(item)
        if len(lane) > 1:
            return False
        self.ready.append(item.key)
        return self._fill() is item

    def _pop(self, key: str) -> None:
        self.lanes[key].pop(0)
        if self.lanes[key]:
            self.ready.append(key)
        else:
            del self.lanes[key]

    def finish(self, key: str) -> Item | None:
        self.holding.discard(key)
        self._pop(key)
        return self._fill()

    def suspend(self, key: str) -> Item | None:
        self.holding.discard(key)
        return self._fill()

    def resume(self, key: str) -> bool:
        self.ready.append(key)
        return self._fill() is self.lanes[key][0]

    def drop(self, key: str) -> Item | None:
        self._pop(key)
        return self._fill()

    def purge(self) -> int:
        removed = 0
        for key in list(self.lanes):
            lane = self.lanes[key]
            started = key not in self.ready
            kept = lane[:1] if started else []
            kept += [i for i in lane[len(kept) :] if not i.dead]
            removed += len(lane) - len(kept)
            if kept:
                self.lanes[key] = kept
            else:
                del self.lanes[key]
        self.ready = [k for k in self.ready if k in self.lanes]
        return removed


ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["add", "add", "add", "finish", "suspend", "resume", "drop", "kill", "purge"]
        ),
        st.sampled_from("abcd"),
        st.integers(0, 20),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(cap=st.integers(1, 3), steps=ops)
def test_the_lane_table_starts_exactly_what_the_rule_starts(
    cap: int, steps: list[tuple[str, str, int]]
) -> None:
    table: LaneTable[str, Item] = LaneTable(cap)
    model = Model(cap)
    active: set[str] = set()  # keys whose head holds a slot (started, not suspended)
    suspended: set[str] = set()
    made = 0
    for op, key, pick in steps:
        if op == "add":
            item = Item(key, made)
            made += 1
            started = table.add(key, item)
            assert started == model.add(item)
            if started:
                active.add(key)
        elif op in ("finish", "suspend") and active:
            key = sorted(active)[pick % len(active)]
            active.discard(key)
            if op == "suspend":
                suspended.add(key)
            got: Any = getattr(table, op)(key)
            assert got is getattr(model, op)(key)
            if got is not None:
                active.add(got.key)
        elif op in ("resume", "drop") and suspended:
            key = sorted(suspended)[pick % len(suspended)]
            suspended.discard(key)
            if op == "resume":
                started = table.resume(key)
                assert started == model.resume(key)
                if started:
                    active.add(key)
            else:
                got = table.drop(key)
                assert got is model.drop(key)
                if got is not None:
                    active.add(got.key)
        elif op == "kill":
            items = list(table.items())
            if items:
                items[pick % len(items)].dead = True
        elif op == "purge":
            assert table.purge(lambda i: i.dead) == model.purge()
        # The same state, and the rule's invariants, after every step.
        assert table.active == len(model.holding) == len(active) <= cap
        assert [repr(i) for i in table.items()] == [
            repr(i) for k in table_keys(table) for i in model.lanes[k]
        ]
        assert sorted(model.lanes) == sorted(table_keys(table))
        assert table.ready == len(model.ready)
        if table.ready:
            assert table.active == cap  # a head waits only while every slot is taken
    # Finishing everything starts everything left, once each, in key order.
    assert table.idle == (not model.lanes and not model.holding)


def table_keys(table: LaneTable[str, Item]) -> list[str]:
    return list(table._lanes)


def test_a_lane_of_one_item_allocates_no_queue() -> None:
    table: LaneTable[str, Item] = LaneTable(2)
    item = Item("a", 0)
    assert table.add("a", item)
    assert table._lanes["a"] is item  # the bare item: the uncontended case allocates nothing
    assert not table.add("a", Item("a", 1))
    assert table.longest() == 2
    assert table.finish("a") is not None
    assert type(table._lanes["a"]) is Item  # back to a bare head once one is left
    table.finish("a")
    assert table.idle
    assert len(table) == 0


def test_keys_is_a_live_view_of_the_keys_with_work() -> None:
    table: LaneTable[str, Item] = LaneTable(1)
    keys = table.keys()
    assert "a" not in keys
    table.add("a", Item("a", 0))
    table.add("b", Item("b", 0))  # a ready head: its key has work too
    assert set(keys) == {"a", "b"}
    table.finish("a")
    table.finish("b")
    assert not keys


def test_none_is_a_key_and_an_item_like_any_other() -> None:
    table: LaneTable[Any, Any] = LaneTable(1)
    assert table.add(None, None)
    assert not table.add(None, "second")
    assert table.finish(None) == "second"
    assert table.finish(None) is None
    assert table.idle
