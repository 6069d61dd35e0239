"""A partition revoked while a record runs (or waits for its key's lease) and assigned back to
the same consumer."""

from __future__ import annotations

import threading

from confluent_kafka import Consumer

from rxcoord import TenantTaskCoordinator
from rxcoord.kafka import KeyedConsumer, Record
from rxcoord.leases import MemoryLeases, MemoryLeaseStore

from .support import (
    Cluster,
    RunLog,
    Running,
    all_done,
    check_invariants,
    logging_handler,
    wait_for,
)


def test_reassigned_partition_never_runs_a_key_twice_at_once(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    other_topic = cluster.topic(1)
    items = [("K", 0), ("K", 1), ("K", 2), *[(f"o{i}", 0) for i in range(20)]]
    produced = cluster.produce(topic, items)
    group = cluster.group()
    release = threading.Event()
    started = threading.Event()
    log = RunLog(cluster.log_for("w0"), "w0")

    def hook(record: Record) -> None:
        if record.value == b"K:0" and not started.is_set():
            started.set()
            release.wait(60)  # the first run of K:0 outlives the revoke deadline

    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=hook),
        revoke_timeout=0.5, commit_interval=0.1,
    )  # fmt: skip
    running = Running(consumer)
    assert started.wait(60)
    wait_for(lambda: consumer.stats().rebalances >= 1, 30, "assigned")
    # A second member subscribing to another topic of the same group forces a rebalance: the
    # partition is revoked from our consumer and, being the only subscriber, given back to it.
    other = Consumer(cluster.config(group))
    other.subscribe([other_topic])
    stop = threading.Event()
    poller = threading.Thread(target=lambda: [other.poll(0.1) for _ in iter(stop.is_set, True)])
    poller.start()
    try:
        wait_for(
            lambda: [p.epoch for p in consumer.stats().partitions] not in ([], [1]),
            60,
            "the partition back under a new epoch",
        )
        # K:0 was re-fetched (its first run never completed) and waits behind the old run.
        wait_for(lambda: consumer.stats().longest_key_queue >= 1, 30, "K:0 queued again")
        release.set()
        wait_for(all_done(cluster, produced), 60, "all records")
        wait_for(lambda: cluster.committed(topic, group, 1)[0] == len(items), 30, "commit at end")
    finally:
        release.set()
        stop.set()
        poller.join()
        other.close()
    assert running.stop() is None
    runs = cluster.runs()
    k0 = [r for r in runs if r.key == "K" and r.seq == 0]
    assert len(k0) == 2  # once under each epoch ...
    check_invariants(produced, runs, duplicates=True)  # ... never overlapping
    assert consumer.stats().dropped >= 1  # the late result of the first epoch was dropped


def test_a_record_waiting_for_its_lease_never_runs_once_revoked(cluster: Cluster) -> None:
    topic = cluster.topic(1)
    other_topic = cluster.topic(1)
    items = [("K", 0), ("K", 1), *[(f"o{i}", 0) for i in range(20)]]
    produced = cluster.produce(topic, items)
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    store = MemoryLeaseStore()
    # Someone else (another process, say) holds K's lease: K:0 waits for it inside the
    # coordinator, after our consumer gave it a slot.
    holder = MemoryLeases(store).acquire("keys:b'K'", 60, keep_alive=True)
    with TenantTaskCoordinator(
        max_concurrency=8, max_queue_size=100, name="keys", leases=MemoryLeases(store)
    ) as coordinator:
        consumer = KeyedConsumer(
            cluster.config(group), [topic], logging_handler(log), scheduler=coordinator,
            revoke_timeout=0.5, commit_interval=0.1,
        )  # fmt: skip
        running = Running(consumer)
        others = {(f"o{i}", 0) for i in range(20)}
        wait_for(lambda: others <= {(r.key, r.seq) for r in cluster.runs() if r.end}, 60, "others")
        assert consumer.stats().running == 1  # K:0, waiting for the lease
        other = Consumer(cluster.config(group))
        other.subscribe([other_topic])
        stop = threading.Event()
        poller = threading.Thread(target=lambda: [other.poll(0.1) for _ in iter(stop.is_set, True)])
        poller.start()
        try:
            wait_for(
                lambda: [p.epoch for p in consumer.stats().partitions] not in ([], [1]),
                60,
                "the partition back under a new epoch",
            )
            # The revoke did not wait for K:0 (it had not started), and K:0 of the new epoch
            # queues behind the old one in K's lane.
            holder.release()
            wait_for(all_done(cluster, produced), 60, "all records")
            wait_for(lambda: cluster.committed(topic, group, 1)[0] == len(items), 30, "commit")
        finally:
            if holder.held:
                holder.release()
            stop.set()
            poller.join()
            other.close()
        assert running.stop() is None
    runs = cluster.runs()
    # The old epoch's K:0 got the lease first, and the start gate dropped it: K:0 ran once.
    assert len([r for r in runs if r.key == "K" and r.seq == 0]) == 1
    check_invariants(produced, runs, duplicates=True)
    assert consumer.stats().dropped >= 1
