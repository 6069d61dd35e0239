"""Order, parallelism and prefix commits on a real broker, one consumer in this process."""

from __future__ import annotations

import threading
import time

import pytest

from rxcoord.kafka import ConsumerState, KeyedConsumer

from .support import (
    Cluster,
    RunLog,
    Running,
    all_done,
    check_invariants,
    keyed_items,
    logging_handler,
    max_parallel_in_partition,
    wait_for,
)


def test_order_parallelism_and_prefix_commit(cluster: Cluster) -> None:
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(3000, 1000))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    consumer = KeyedConsumer(
        cluster.config(group),
        [topic],
        logging_handler(log, sleep=0.002),
        max_concurrency=32,
        commit_interval=0.2,
    )
    running = Running(consumer)
    wait_for(all_done(cluster, produced), 60, "every record processed")
    # The periodic commit reaches the end once every record completed.
    wait_for(
        lambda: cluster.committed(topic, group) == produced.end, 30, "commits at the end offsets"
    )
    stats = consumer.stats()
    assert running.stop() is None
    assert consumer.state is ConsumerState.CLOSED
    runs = cluster.runs()
    check_invariants(produced, runs, duplicates=False)
    # Keys of one partition ran concurrently: throughput is not bounded by partitions.
    assert max_parallel_in_partition(runs) > 1
    assert stats.fetched == 3000
    assert stats.completed == 3000
    assert stats.in_flight == 0
    # Commits are periodic, not one per record.
    assert 0 < stats.commits < 300
    assert {p.partition: p.committed for p in stats.partitions} == produced.end


def test_commit_holds_at_first_unfinished_record(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    # Key "slow" first, then 50 records of other keys: they complete, the commit must not.
    items = [("slow", 0), *[(f"k{i}", 0) for i in range(50)]]
    produced = cluster.produce(topic, items)
    group = cluster.group()
    release = threading.Event()
    log = RunLog(cluster.log_for("w0"), "w0")

    def hook(record: object) -> None:
        if getattr(record, "key", None) == b"slow":
            release.wait(30)

    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=hook), commit_interval=0.1
    )
    running = Running(consumer)
    others = {(f"k{i}", 0) for i in range(50)}
    wait_for(lambda: others <= {(r.key, r.seq) for r in cluster.runs() if r.end}, 60, "others")
    # Several commit intervals pass (an observation window for a negative property): nothing
    # may be committed past the slow record, offset 0.
    time.sleep(0.5)
    stats = consumer.stats()
    (part,) = stats.partitions
    assert part.committable in (None, 0)
    assert cluster.committed(topic, group, 1)[0] < 1
    assert part.in_flight == 51
    release.set()
    wait_for(lambda: cluster.committed(topic, group, 1)[0] == 51, 30, "commit after release")
    assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)


@pytest.mark.parametrize("inline", [True, None], ids=["inline", "inline-measured"])
def test_inline_handlers_keep_order_and_commit(cluster: Cluster, inline: bool | None) -> None:
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(3000, 100))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log), inline=inline, commit_interval=0.2
    )
    running = Running(consumer)
    wait_for(all_done(cluster, produced), 60, "every record processed")
    wait_for(lambda: cluster.committed(topic, group) == produced.end, 30, "commit at the end")
    assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)
