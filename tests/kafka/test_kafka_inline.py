"""Inline handlers (the default for fast sync handlers) and the watchdog's hand-over.

A sync handler measured fast runs on the poll thread. A call that blocks there would stall
every key, so the watchdog takes it over: the poll loop moves to a new thread, the call ends as
a worker's. These tests block calls on events, not on time: a blocked call can only let other
records run if it was taken over.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rxcoord.kafka import KeyedConsumer, Record

from .support import (
    Cluster,
    RunLog,
    Running,
    all_done,
    check_invariants,
    keyed_items,
    logging_handler,
    wait_for,
)


def _on_poll_thread() -> bool:
    # Workers of the consumer are "rxcoord-kafka-<n>"; poll threads are run()'s own thread or,
    # after a hand-over, "rxcoord-kafka-poll".
    name = threading.current_thread().name
    return name == "rxcoord-kafka-poll" or not name.startswith("rxcoord-kafka-")


@pytest.mark.parametrize("inline", [None, True], ids=["default", "inline"])
@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_blocking_inline_call_is_taken_over(
    cluster: Cluster, inline: bool | None, outcome: str
) -> None:
    topic = cluster.topic(1)  # one partition: without a hand-over nothing else could run
    items = [("slow", 0), ("slow", 1), *[(f"k{i}", 0) for i in range(200)], ("slow", 2)]
    produced = cluster.produce(topic, items)
    group = cluster.group()
    release = threading.Event()
    where: list[bool] = []
    log = RunLog(cluster.log_for("w0"), "w0")

    def hook(record: Record) -> None:
        if record.value == b"slow:0":
            where.append(_on_poll_thread())
            release.wait(60)
            if outcome == "raises":
                raise RuntimeError("failed after its hand-over")

    kwargs: dict[str, Any] = {} if inline is None else {"inline": inline}
    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=hook),
        on_error="skip", commit_interval=0.1, **kwargs,
    )  # fmt: skip
    running = Running(consumer)
    others = {(f"k{i}", 0) for i in range(200)}
    try:
        # The first record runs inline (the first call always does) and blocks: the other
        # keys of its partition complete only because the poll loop moved on without it.
        wait_for(lambda: others <= {(r.key, r.seq) for r in cluster.runs() if r.end}, 60, "others")
        stats = consumer.stats()
        assert where == [True]
        assert stats.handovers >= 1  # (more only if a busy machine preempted another call)
        assert stats.running >= 1  # the taken-over call, now a worker's record
        assert stats.longest_key_queue >= 1  # slow:1 waits behind it: the key stays in order
        assert not any(r.key == "slow" and r.seq > 0 for r in cluster.runs())
        (part,) = stats.partitions
        assert part.committable in (None, 0)  # the commit point waits for it
    finally:
        release.set()
    wait_for(all_done(cluster, produced), 60, "all records after release")
    wait_for(lambda: cluster.committed(topic, group, 1)[0] == len(items), 30, "commit at end")
    assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)
    assert consumer.stats().failed == (1 if outcome == "raises" else 0)


def test_repeated_hand_overs_keep_every_guarantee(cluster: Cluster) -> None:
    topic = cluster.topic(4)
    produced = cluster.produce(topic, keyed_items(2000, 100))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    consumer: KeyedConsumer
    stalled: list[int] = []

    def hook(record: Record) -> None:
        # Every 50th record that runs on a poll thread blocks until it has been taken over,
        # so each of them moves the poll loop to a new thread (a chain of poll threads).
        if record.offset % 50 == 7 and _on_poll_thread():
            before = consumer.stats().handovers
            stalled.append(record.offset)
            wait_for(lambda: consumer.stats().handovers > before, 30, "the hand-over")

    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=hook), inline=True,
        commit_interval=0.1,
    )  # fmt: skip
    running = Running(consumer)
    wait_for(all_done(cluster, produced), 90, "all records")
    wait_for(lambda: cluster.committed(topic, group, 4) == produced.end, 30, "commit at end")
    assert running.stop() is None
    stats = consumer.stats()
    assert stalled
    # Each stalled call was taken over; on a busy machine a call preempted for a while can
    # look stalled too and be taken over as well (which is just as safe).
    assert stats.handovers >= len(stalled)
    assert stats.completed == 2000
    check_invariants(produced, cluster.runs(), duplicates=False)


@pytest.mark.parametrize("inline", [None, True, False], ids=["default", "inline", "workers"])
def test_where_sync_handlers_run(cluster: Cluster, inline: bool | None) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(400, 40))
    group = cluster.group()
    threads: set[str] = set()

    def handle(record: Record) -> None:
        threads.add(threading.current_thread().name)

    kwargs: dict[str, Any] = {} if inline is None else {"inline": inline}
    consumer = KeyedConsumer(cluster.config(group), [topic], handle, commit_interval=0.1, **kwargs)
    running = Running(consumer)
    wait_for(lambda: consumer.stats().completed == 400, 60, "all records")
    wait_for(lambda: cluster.committed(topic, group, 2) == produced.end, 30, "commit at end")
    assert running.stop() is None
    stats = consumer.stats()
    if inline is False:
        assert stats.inline == 0
        assert all(name.startswith("rxcoord-kafka-") for name in threads)
    else:
        # The first call always runs on the poll thread (then the measurement decides).
        assert stats.inline + stats.handovers >= 1
        assert running.thread.name in threads
