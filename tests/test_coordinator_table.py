"""The coordinator's task table (``rxcoord._coordinator._table``), driven step by step.

Hypothesis plays random events through a table - submissions (rejecting or waiting), turns
granted by an admission, ends (completed or failed), cancels and timeouts, suspends and resumes
(retries) and purges - and an invariant checker compares the table with what the tasks say
after every step:

* the per-state counts are the tasks in each state; work in progress never passes the limit;
  the tasks holding a slot are the lane table's active ones and never more than the cap;
* per key, at most one task holds its key (gated, running or retrying), and tasks of a key get
  their turn in submission order; no task waits for a slot while its key is idle and a slot is
  free (eagerness);
* waiters exist only while the limit is reached, and leave in arrival order;
* each event returns exactly the tasks whose turn it brought;
* every outcome is decided once, and the counters add up to the submissions.
"""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rxcoord._coordinator._table import (
    CANCELLED,
    CLOSED,
    DONE,
    FULL,
    GATED,
    NEW,
    QUEUED,
    RETRYING,
    RUNNING,
    TIMED_OUT,
    WAITING,
    Entry,
    TaskTable,
)

CAP = 2
QUEUE = 2


class Task(Entry):
    __slots__ = ("index", "outcomes")

    def __init__(self, key: str | None, index: int) -> None:
        super().__init__(key)
        self.index = index
        self.outcomes = 0  # times its outcome was decided


class Checker:
    def __init__(self, table: TaskTable[Task]) -> None:
        self.table = table
        self.tasks: list[Task] = []
        self.turns: dict[Any, list[int]] = {}  # key -> indices in the order their turn came
        self.left_waiting: list[int] = []  # indices in the order they left WAITING

    def before(self) -> dict[int, int]:
        return {t.index: t.state for t in self.tasks}

    def after(self, before: dict[int, int], starts: list[Any]) -> None:
        table = self.table
        turn_states = (GATED, RUNNING)
        came = [
            t
            for t in self.tasks
            if before.get(t.index, NEW) in (NEW, WAITING, QUEUED, RETRYING)
            and t.state in turn_states
        ]
        assert {t.index for t in starts} == {t.index for t in came}, "starts returned"
        for t in sorted(came, key=lambda t: t.index):
            if t.key is not None:
                self.turns.setdefault(t.key, []).append(t.index)
        for t in self.tasks:
            if before.get(t.index) == WAITING and t.state not in (WAITING, DONE):
                self.left_waiting.append(t.index)  # admitted (a cancelled waiter just leaves)
        counts = table.counts
        for state in (WAITING, QUEUED, GATED, RUNNING, RETRYING):
            assert counts[state] == sum(t.state == state for t in self.tasks), state
        assert table.wip <= table.limit
        holding = [t for t in self.tasks if t.state in turn_states]
        assert len(holding) == table.lanes.active <= CAP
        for key in {t.key for t in self.tasks if t.key is not None}:
            mine = [t for t in self.tasks if t.key == key]
            assert sum(t.state in (GATED, RUNNING, RETRYING) for t in mine) <= 1, key
            assert self.turns.get(key, []) == sorted(self.turns.get(key, [])), key
            # Eagerness: the first live queued task of an idle key has a slot if one is free.
            if not any(t.state in (GATED, RUNNING, RETRYING) for t in mine):
                queued = [t for t in mine if t.state == QUEUED]
                if queued:
                    assert table.lanes.active == CAP, f"{key} idle, a slot free, {queued}"
        if counts[WAITING] and table.open:
            assert table.wip == table.limit, "a waiter waits while there is room"
        assert self.left_waiting == sorted(self.left_waiting), "waiters left out of order"
        assert all(t.outcomes <= 1 for t in self.tasks)
        decided = sum(t.settled for t in self.tasks)
        total = table.completed + table.failed + table.cancelled + table.timed_out
        assert total == decided
        assert table.submitted == len(self.tasks) + table.rejected


def settle(checker: Checker, task: Task, outcome: int) -> list[Any] | None:
    was = task.settled
    starts = checker.table.settle(task, outcome)
    if not was and task.settled:
        task.outcomes += 1
    return starts


events = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "submit",
                "submit_wait",
                "submit_wait",
                "admit",
                "end",
                "fail",
                "cancel",
                "time_out",
                "suspend",
                "resume",
                "purge",
            ]
        ),
        st.sampled_from([None, "a", "a", "b", "c"]),
        st.integers(0, 40),
    ),
    max_size=50,
)


@settings(max_examples=400, deadline=None)
@given(gated=st.booleans(), steps=events)
# Room made by a queued task that leaves must go to the waiters at once.
@example(gated=False, steps=[("submit_wait", "a", 0)] * 6 + [("cancel", None, 2)])
def test_the_task_table_keeps_its_invariants_under_random_events(
    gated: bool, steps: list[tuple[str, str | None, int]]
) -> None:
    table: TaskTable[Task] = TaskTable(CAP, QUEUE, gated=gated)
    checker = Checker(table)
    for op, key, pick in steps:
        before = checker.before()
        starts: list[Any] = []

        def pick_in(*states: int) -> Task | None:
            found = [t for t in checker.tasks if t.state in states]
            return found[pick % len(found)] if found else None  # noqa: B023

        if op in ("submit", "submit_wait"):
            task = Task(key, len(checker.tasks))
            state = table.accept(task, op == "submit_wait")
            if state in (FULL, CLOSED):
                continue  # refused: never a task of the table
            checker.tasks.append(task)
            if state in (GATED, RUNNING):
                starts = [task]
        elif op == "admit":
            gated_task = pick_in(GATED)
            if gated_task is None or gated_task.settled:
                continue
            table.admitted(gated_task)
        elif op in ("end", "fail"):
            ending = pick_in(GATED, RUNNING)
            if ending is None:
                continue
            decided, starts = table.end(ending, op == "fail")
            ending.outcomes += decided
        elif op in ("cancel", "time_out"):
            victim = pick_in(WAITING, QUEUED, GATED, RUNNING, RETRYING)
            if victim is None:
                continue
            outcome = CANCELLED if op == "cancel" else TIMED_OUT
            starts = settle(checker, victim, outcome) or []
        elif op == "suspend":
            running = pick_in(RUNNING)
            if running is None or running.settled:
                continue
            starts = table.suspend(running)
        elif op == "resume":
            retrying = pick_in(RETRYING)
            if retrying is None:
                continue
            if table.resume(retrying):
                starts = [retrying]
        elif op == "purge":
            table.purge()
        checker.after(before, starts)
    # Drain: admit, end and resume until nothing is left; everything accepted ends once.
    for _ in range(10 * len(checker.tasks) + 10):
        live = [t for t in checker.tasks if t.state not in (DONE, WAITING)]
        waiting = [t for t in checker.tasks if t.state == WAITING]
        if not live and not waiting:
            break
        before = checker.before()
        starts = []
        task = live[0] if live else waiting[0]
        if task.state == GATED and not task.settled:
            table.admitted(task)
        elif task.state in (GATED, RUNNING):
            decided, starts = table.end(task, False)
            task.outcomes += decided
        elif task.state == RETRYING:
            if table.resume(task):
                starts = [task]
        else:  # queued (waiting for a slot) or waiting for room: end someone who holds one
            holders = [t for t in checker.tasks if t.state in (GATED, RUNNING)]
            if holders:
                decided, starts = table.end(holders[0], False)
                holders[0].outcomes += decided
            else:
                starts = settle(checker, task, CANCELLED) or []
        checker.after(before, starts)
    assert table.wip == 0
    assert table.counts[WAITING] == 0
    assert table.lanes.idle
    assert all(t.outcomes == 1 for t in checker.tasks)


def test_a_purge_drops_tombstones_and_keeps_the_live_order() -> None:
    table: TaskTable[Task] = TaskTable(1, 100, gated=False)
    tasks = [Task("k", i) for i in range(10)]
    for task in tasks:
        table.accept(task, False)
    assert tasks[0].state == RUNNING
    for task in tasks[1:9]:
        table.settle(task, CANCELLED)
    assert len(list(table.lanes.items())) == 10  # tombstones until their turn, or a purge
    table.purge()
    assert [t.index for t in table.lanes.items()] == [0, 9]
    _, starts = table.end(tasks[0], False)
    assert starts == [tasks[9]]


def test_tombstones_are_purged_once_they_outnumber_the_live_queued_tasks() -> None:
    table: TaskTable[Task] = TaskTable(1, 1_000, gated=False)
    tasks = [Task("k", i) for i in range(500)]
    for task in tasks:
        table.accept(task, False)
    for task in tasks[1:]:
        table.settle(task, CANCELLED)
    # 499 cancelled while queued: the lanes never held more than ~64 of them at once.
    assert len(list(table.lanes.items())) <= 66
