"""Offset bookkeeping of one assigned partition: the contiguous completed prefix.

Records of one partition complete out of offset order (keys run in parallel), but only an offset
whose every predecessor completed may be committed, or a crash would skip the unfinished ones.
The state keeps the offsets fetched but not yet passed by the prefix in fetch order (a deque:
offsets only grow within a partition, gaps from compaction or transactions included) and the set
of those that completed out of order. Advancing pops completed heads: each offset is pushed,
added and popped once, so the cost is O(1) per record, amortised over a batch.

A record completed while nothing earlier of its partition is outstanding (the common case of an
inline handler) never enters the deque: the prefix moves past it directly.

A ``PartitionState`` is one *assignment* of the partition (an epoch): a partition revoked and
assigned again gets a new state, so a late completion reported to the old one is dropped instead
of moving the new assignment's commit point.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from ._offsets import Claim

__all__ = ["ACTIVE", "REVOKED", "REVOKING", "PartitionState", "lag"]

ACTIVE: Final = 0  # owned: records start, completions count
REVOKING: Final = 1  # being revoked: no record starts, completions still count (final commit)
REVOKED: Final = 2  # gone: completions are dropped


class PartitionState:
    """One assignment of one partition. Mutated by the poll thread, and under the consumer's lock
    by completions (``done``, ``running``, ``started``) and the start gate (``started``)."""

    __slots__ = (
        "claim",
        "committable",
        "committed",
        "done",
        "epoch",
        "fetched",
        "high",
        "order",
        "owner",
        "partition",
        "paused",
        "phase",
        "position",
        "requested",
        "running",
        "started",
        "topic",
    )

    def __init__(self, topic: str, partition: int, epoch: int, owner: object = None) -> None:
        self.owner = owner  # the engine that fetched it (the Rx commit step reports to it)
        self.topic = topic
        self.partition = partition
        self.epoch = epoch
        self.phase = ACTIVE
        self.order: deque[int] = deque()  # fetched, not yet passed by the prefix, in offset order
        self.done: set[int] = set()  # offsets in ``order`` that completed
        self.committable = -1  # next offset to commit (end of the completed prefix); -1: none yet
        self.requested = -1  # last offset we asked the broker to commit
        self.committed = -1  # last offset the broker confirmed as committed
        self.position = -1  # next offset to fetch (last fetched + 1)
        self.fetched = 0
        self.high = -1  # high watermark of the last fetch response (read by the poll thread)
        self.running = 0  # records of this assignment holding a slot (started or about to)
        self.started = 0  # records whose handler passed the start gate and has not ended
        self.paused = False
        # With ``offsets=``: this assignment's claim in the store (its epoch, the offsets done
        # before it began); see ``_offsets.py``. None without a store, or until claimed.
        self.claim: Claim | None = None

    def advance(self) -> None:
        """Move the prefix past the completed head of ``order`` (poll thread, under the lock)."""
        order = self.order
        done = self.done
        last = -1
        while order and order[0] in done:
            last = order.popleft()
            done.discard(last)
        if last >= 0:
            self.committable = last + 1

    @property
    def lag(self) -> int | None:
        """The high watermark minus the committed (else committable) offset, when both known."""
        return lag(self.high, self.committed if self.committed >= 0 else self.committable)

    @property
    def in_flight(self) -> int:
        """Records fetched and not yet passed by the completed prefix."""
        return len(self.order)


def lag(high: int, base: int) -> int | None:
    """Records between ``base`` (the committed, else committable offset) and the high
    watermark ``high``; None while either is unknown (negative)."""
    return None if base < 0 or high < 0 else max(0, high - base)
