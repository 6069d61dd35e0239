"""Snapshots returned by ``KeyedConsumer.stats()``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ConsumerState", "ConsumerStats", "PartitionStats"]


class ConsumerState(Enum):
    """Lifecycle of a consumer: new -> running -> closing -> closed (a consumer runs once)."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """One assigned partition.

    Attributes:
        topic: The topic.
        partition: The partition number.
        epoch: This assignment's number (a partition assigned again gets a higher one).
        position: The next offset to fetch, or ``None`` before the first record.
        committable: The end of the completed prefix (the next commit), or ``None``.
        committed: The last offset the broker confirmed as committed by this consumer, or ``None``.
        in_flight: Records fetched and not yet passed by the completed prefix.
        lag: High watermark minus the committed (else committable) offset, when known.
        paused: Whether fetching is paused for backpressure.
        oldest_in_progress: Seconds the oldest record of this partition still in progress has
            been so, attempts and retry waits together (``None``: none in progress). Tracked
            for records that ran on a worker, a loop or a scheduler, or failed, when
            ``retry=`` or ``stall_after=`` is set; otherwise ``None``.
    """

    topic: str
    partition: int
    epoch: int
    position: int | None
    committable: int | None
    committed: int | None
    in_flight: int
    lag: int | None
    paused: bool
    oldest_in_progress: float | None


@dataclass(frozen=True, slots=True)
class ConsumerStats:
    """A consistent snapshot of a consumer.

    Attributes:
        state: The lifecycle state.
        fetched: Records received from the broker.
        completed: Records whose handling ended (successfully, skipped or handled by ``on_error``).
        failed: Records whose handler raised (counted also in ``completed`` unless they stopped
            the consumer).
        dropped: Records not run or whose result was dropped because their partition was revoked
            (or the consumer stopped before their turn); the next owner processes them again.
        running: Handlers started and not ended.
        queued: Records waiting for their key's turn or for a free slot.
        in_flight: Records fetched and not yet passed by the completed prefix, all partitions.
        longest_key_queue: Most records waiting behind one key.
        active_keys: Keys with a running or waiting record.
        paused_partitions: Partitions paused for backpressure.
        rebalances: Assignments and revocations seen.
        commits: Commit requests sent.
        inline: Records whose handler ran and ended on the poll thread (see ``inline=``).
        handovers: Inline calls that ran so long that the poll loop moved to a new thread.
        retries: Attempts beyond the first, in total (``retry=``).
        retrying: Records now waiting for their next attempt (each holds its key, no slot).
        dead_lettered: Records that failed their last attempt and went to ``dead_letter``
            (delivered to the topic and acknowledged, or the callable returned).
        stalled_keys: Keys whose record in progress has been so for longer than
            ``stall_after`` (``on_stall`` was called for it).
        partitions: One entry per assigned partition.
    """

    state: ConsumerState
    fetched: int
    completed: int
    failed: int
    dropped: int
    running: int
    queued: int
    in_flight: int
    longest_key_queue: int
    active_keys: int
    paused_partitions: int
    rebalances: int
    commits: int
    inline: int
    handovers: int
    retries: int
    retrying: int
    dead_lettered: int
    stalled_keys: int
    partitions: tuple[PartitionStats, ...]
