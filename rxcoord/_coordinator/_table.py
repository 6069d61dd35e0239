"""The task table of a coordinator: every task's state and every counter, one transition step.

Pure state (no threads, no Rx, no clock), like ``rxcoord._locks._table``: the coordinator holds
its lock around each event, and each event *returns* the tasks whose turn came; starting them is
the coordinator's business, after it has let go of its lock. So the table can be driven step by
step against the reference model in ``tests/test_coordinator_table.py``.

A task moves through::

    accept ──► WAITING ──room──► QUEUED ──turn──► GATED ──permit──► RUNNING ──end──► DONE
                  │                 │               │   (no admission: turn ──► RUNNING)
                  └──── settle ─────┴─► DONE        └── end (withdrawn, refused) ──► DONE
                                              RUNNING ──suspend──► RETRYING ──resume──► QUEUED

* ``WAITING``: beyond the limits with ``overflow="wait"``; not work in progress yet; admitted
  in arrival order as soon as there is room (within the same event that made room).
* ``QUEUED``: work in progress, in its key's lane (``rxcoord._core.lanes``), not started.
* ``GATED``: its turn came (its key and a slot are its own); it waits for its admission's
  permit (only on a coordinator with an admission).
* ``RUNNING``: its work runs. It keeps its key and slot until its work has *really* ended: a
  cancelled sync job's thread cannot be stopped, so it stays here until it returns.
* ``RETRYING``: between two attempts; it keeps its key (later jobs of the key stay behind it)
  but holds no slot; ``resume`` queues it for a slot again, ahead of its key's later jobs.
* ``DONE``: gone. A task settled while ``QUEUED`` is done at once (it leaves the counters) but
  stays in its lane as a *tombstone* until its turn comes, when it is skipped; tombstones are
  purged once they outnumber the live queued tasks, so they stay O(1) amortized.

Separately, a task's *outcome* is decided exactly once (``settled``): completed or failed when
its work ends, or earlier cancelled or timed out. ``_step`` is the only place a state changes
and the per-state counts move with it; outcomes are counted only in ``_settle``.

An unkeyed task is its own lane key: it only shares the cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

from .._core.lanes import LaneTable

__all__ = [
    "CANCELLED",
    "CLOSED",
    "COMPLETED",
    "DONE",
    "FAILED",
    "FULL",
    "GATED",
    "QUEUED",
    "RETRYING",
    "RUNNING",
    "TIMED_OUT",
    "WAITING",
    "Entry",
    "TaskTable",
]

# States (ints: compared on hot paths). NEW: made, not accepted yet.
NEW: Final = 0
WAITING: Final = 1
QUEUED: Final = 2
GATED: Final = 3
RUNNING: Final = 4
RETRYING: Final = 5
DONE: Final = 6

# Outcomes (``settle``; ``end`` decides completed or failed itself).
COMPLETED: Final = 0
FAILED: Final = 1
CANCELLED: Final = 2
TIMED_OUT: Final = 3

# What ``accept`` decides besides a state: the refusals.
FULL: Final = -1  # beyond the limits, and the call rejects: TooManyTasks
CLOSED: Final = -2  # the table no longer accepts

_PURGE_AT_LEAST: Final = 64  # tombstones (or withdrawn waiters) that make a purge worth it


class Entry:
    """A task's place in the table; the coordinator's task extends it (one object per job).

    Only the table writes ``state`` and ``settled``; everybody may read them under the
    coordinator's lock.
    """

    __slots__ = ("key", "settled", "state", "verdict")

    def __init__(self, key: Hashable | None) -> None:
        self.key = key  # its ordering key; None: unkeyed (its own lane key)
        self.state = NEW
        self.settled = False  # its outcome is decided
        self.verdict = COMPLETED  # which outcome, once it is decided


_E = TypeVar("_E", bound=Entry)


def _lane(task: Entry) -> Hashable:
    key = task.key
    return task if key is None else key


class TaskTable(Generic[_E]):
    """States, lanes, waiters and counters of one coordinator; see the module docstring.

    Args:
        max_concurrency: Most tasks holding a slot (``GATED`` or ``RUNNING``).
        max_queue_size: Most work in progress beyond those.
        gated: True if a task whose turn came waits for an admission (``GATED``).
    """

    __slots__ = (
        "_tombstones",
        "_turn",
        "_waiters",
        "cancelled",
        "completed",
        "counts",
        "failed",
        "lanes",
        "limit",
        "open",
        "rejected",
        "retries",
        "submitted",
        "timed_out",
    )

    def __init__(self, max_concurrency: int, max_queue_size: int, *, gated: bool) -> None:
        self.lanes: LaneTable[Hashable, _E] = LaneTable(max_concurrency)
        self.limit = max_concurrency + max_queue_size
        self._turn = GATED if gated else RUNNING  # the state a task's turn takes it to
        self.counts = [0] * 7  # tasks per state (NEW and DONE are not read)
        self.open = True  # accepting new tasks
        self.submitted = 0
        self.rejected = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.timed_out = 0
        self.retries = 0
        self._waiters: deque[_E] = deque()  # WAITING tasks (and settled ones, skipped)
        self._tombstones = 0  # DONE tasks still in the lanes

    # -- reading ------------------------------------------------------------------------------

    @property
    def wip(self) -> int:
        """Work in progress: queued, gated, running and retrying tasks."""
        counts = self.counts
        return counts[QUEUED] + counts[GATED] + counts[RUNNING] + counts[RETRYING]

    def live(self) -> list[_E]:
        """Every task whose outcome is not decided yet (what a close must reach)."""
        tasks: list[_E] = [t for t in self._waiters if not t.settled]
        tasks += [t for t in self.lanes.items() if not t.settled]
        return tasks

    # -- the one transition step ------------------------------------------------------------

    def _step(self, task: _E, state: int) -> None:
        counts = self.counts
        counts[task.state] -= 1
        counts[state] += 1
        task.state = state

    def _settle(self, task: _E, outcome: int) -> bool:
        """Decide the outcome once; False if it was decided before."""
        if task.settled:
            return False
        task.settled = True
        task.verdict = outcome
        if outcome is COMPLETED:
            self.completed += 1
        elif outcome is FAILED:
            self.failed += 1
        elif outcome is CANCELLED:
            self.cancelled += 1
        else:
            self.timed_out += 1
        return True

    # -- events -------------------------------------------------------------------------------

    def accept(self, task: _E, wait: bool) -> int:
        """A new submission: its state (``QUEUED``, ``WAITING``, or its turn's state if it
        starts now), or a refusal (``FULL``, ``CLOSED``)."""
        self.submitted += 1
        if not self.open:
            self.rejected += 1
            return CLOSED
        # Waiters exist only while the limit is reached (room admits them at once), so a
        # submission below the limit overtakes nobody.
        if self.wip >= self.limit:
            if not wait:
                self.rejected += 1
                return FULL
            self._step(task, WAITING)
            self._waiters.append(task)
            return WAITING
        key = task.key
        # (_lane inlined, and one step to where it goes: every job comes here, bench_asyncio)
        self._step(
            task, self._turn if self.lanes.add(task if key is None else key, task) else QUEUED
        )
        return task.state

    def admitted(self, task: _E) -> None:
        """A ``GATED`` task got its permit: it runs."""
        self._step(task, RUNNING)

    def end(self, task: _E, failed: bool) -> tuple[bool, list[_E]]:
        """A ``RUNNING`` task's work ended, or a ``GATED`` one leaves without running.

        Returns whether this decided its outcome (completed, or failed if ``failed``; False if
        it was cancelled or timed out before) and the tasks whose turn came.
        """
        decided = self._settle(task, FAILED if failed else COMPLETED)
        self._step(task, DONE)
        starts: list[_E] = []
        key = task.key
        successor = self.lanes.finish(task if key is None else key)  # (_lane inlined)
        if successor is not None:
            self._start(successor, starts)
        if self._waiters:  # (a look first: every job ends here, bench_asyncio's rows)
            self._admit_waiting(starts)
        return decided, starts

    def settle(self, task: _E, outcome: int) -> list[_E] | None:
        """Decide a task's outcome before its work ends (``CANCELLED``, ``TIMED_OUT``).

        A task that had not started leaves at once; a ``GATED`` or ``RUNNING`` one stays
        until its work is stopped and :meth:`end` is called. Returns the tasks whose turn came,
        or None if the outcome was decided before (nothing changed).
        """
        if not self._settle(task, outcome):
            return None
        state = task.state
        starts: list[_E] = []
        if state is WAITING:
            self._step(task, DONE)
            waiters = self._waiters
            if len(waiters) > 2 * self.counts[WAITING] + _PURGE_AT_LEAST:
                self._waiters = deque(t for t in waiters if t.state is WAITING)
        elif state is QUEUED:
            self._step(task, DONE)
            self._tombstones += 1
            if self._purge_due():
                self.purge()
            self._admit_waiting(starts)
        elif state is RETRYING:
            self._step(task, DONE)
            self._start(self.lanes.drop(_lane(task)), starts)
            self._admit_waiting(starts)
        return starts

    def suspend(self, task: _E) -> list[_E]:
        """A ``RUNNING`` task waits for its next attempt: it keeps its key, gives its slot
        back. Returns the tasks whose turn came."""
        self.retries += 1
        self._step(task, RETRYING)
        starts: list[_E] = []
        self._start(self.lanes.suspend(_lane(task)), starts)
        return starts

    def resume(self, task: _E) -> bool:
        """A ``RETRYING`` task wants a slot again; True if its turn came now."""
        self._step(task, QUEUED)
        if self.lanes.resume(_lane(task)):
            self._step(task, self._turn)
            return True
        return False

    def close(self) -> None:
        """Accept nothing more (the coordinator settles what it must, task by task)."""
        self.open = False

    def _purge_due(self) -> bool:
        """Whether the tombstones are worth a pass over the lanes: once they outnumber the live
        queued tasks (and are more than a few), so a purge costs O(1) per cancel, amortized."""
        return self._tombstones > max(_PURGE_AT_LEAST, self.counts[QUEUED])

    def purge(self) -> None:
        """Drop every tombstone now (after a close settled the queued tasks)."""
        self.lanes.purge(_is_done)
        self._tombstones = 0

    # -- internals ----------------------------------------------------------------------------

    def _start(self, task: _E | None, starts: list[_E]) -> None:
        """``task`` took a slot: its turn came, unless it is a tombstone (then pass it on)."""
        lanes = self.lanes
        while task is not None:
            if task.state is not DONE:
                self._step(task, self._turn)
                starts.append(task)
                return
            self._tombstones -= 1
            task = lanes.finish(_lane(task))

    def _admit_waiting(self, starts: list[_E]) -> None:
        """Move waiters into the lanes while there is room, in arrival order."""
        waiters = self._waiters
        while waiters:
            task = waiters[0]
            if task.state is not WAITING:  # settled while waiting
                waiters.popleft()
                continue
            if self.wip >= self.limit:
                return
            waiters.popleft()
            self._step(task, QUEUED)
            if self.lanes.add(_lane(task), task):
                self._step(task, self._turn)
                starts.append(task)


def _is_done(task: Entry) -> bool:
    return task.state is DONE
