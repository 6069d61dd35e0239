"""One slow key: other keys progress, the commit is held, partitions pause, stats() shows it."""

from __future__ import annotations

import threading

from rxcoord.kafka import KeyedConsumer, PartitionStats, Record

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


def test_slow_key_pauses_only_its_partition(cluster: Cluster) -> None:
    topic = cluster.topic(4)
    produced = cluster.produce(topic, keyed_items(4000, 200))
    slow_partition, slow_offset = produced.where[("k7", 0)]
    group = cluster.group()
    release = threading.Event()
    log = RunLog(cluster.log_for("w0"), "w0")

    def hook(record: Record) -> None:
        if record.value == b"k7:0":
            release.wait(60)

    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=hook),
        max_in_flight=400, commit_interval=0.1, batch_size=50,
    )  # fmt: skip
    running = Running(consumer)
    others = {(k, s) for (k, s), (p, _) in produced.where.items() if p != slow_partition}
    # Other partitions are processed completely and committed while k7:0 is stuck.
    wait_for(lambda: others <= {(r.key, r.seq) for r in cluster.runs() if r.end}, 90, "others")

    def others_committed() -> bool:
        committed = cluster.committed(topic, group, 4)
        return all(committed[p] == end for p, end in produced.end.items() if p != slow_partition)

    try:
        wait_for(others_committed, 30, "other partitions committed")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}: {consumer.stats()} committed={cluster.committed(topic, group, 4)} "
            f"end={produced.end} slow={slow_partition}"
        ) from None

    def slow_stats() -> PartitionStats:
        return next(p for p in consumer.stats().partitions if p.partition == slow_partition)

    # Its uncommitted records reach the budget: paused. (Once the other partitions are done,
    # the budget they freed lets it fetch a little further first: wait for the pause, do not
    # sample one instant.)
    wait_for(lambda: slow_stats().paused, 30, "the slow partition to pause")
    stats = consumer.stats()
    slow = slow_stats()
    assert slow.paused, stats
    assert stats.paused_partitions == 1
    assert slow.committable in (None, slow_offset)  # the commit point is held by k7:0
    assert cluster.committed(topic, group, 4)[slow_partition] <= slow_offset
    assert slow.lag is None or slow.lag > 0
    assert stats.longest_key_queue > 0  # k7's later records wait behind it
    assert stats.running >= 1
    assert stats.rebalances == 1  # paused, yet still a member: no rebalance since the join
    # Records of other keys in the slow partition progressed too (up to the pause).
    assert any(r.partition == slow_partition and r.key != "k7" and r.end for r in cluster.runs())
    release.set()
    wait_for(all_done(cluster, produced), 90, "all records after release")
    wait_for(lambda: cluster.committed(topic, group, 4) == produced.end, 30, "commit at end")
    assert consumer.stats().paused_partitions == 0
    assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)
