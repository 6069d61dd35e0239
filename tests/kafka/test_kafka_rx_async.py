"""The Rx pieces (kafka_records + serialize_by_key + commit_records), async handlers, exports."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import reactivex as rx
from reactivex import operators as ops
from reactivex.scheduler import ThreadPoolScheduler

import rxcoord.kafka
from rxcoord import TenantScheduler, TenantTaskCoordinator, serialize_by_key
from rxcoord.kafka import KeyedConsumer, Record, commit_records, kafka_records
from rxcoord.leases import MemoryLeases, MemoryLeaseStore

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


def test_exported_names() -> None:
    assert sorted(rxcoord.kafka.__all__) == [
        "BrokerUnavailable", "ConsumerClosed", "ConsumerState", "ConsumerStats",
        "DeadLetterFailed", "KafkaConsumerError", "KeyedConsumer", "OffsetStoreError",
        "OffsetStoreMisconfigured",
        "OffsetStoreStats", "OffsetStoreUnavailable", "OnError", "PartitionStats",
        "PostgresOffsets", "Record", "UnknownTopic", "commit_records", "kafka_records",
    ]  # fmt: skip
    for name in rxcoord.kafka.__all__:
        assert getattr(rxcoord.kafka, name) is not None


def test_rx_pipeline_orders_keys_and_commits_the_prefix(cluster: Cluster) -> None:
    topic = cluster.topic(4)
    produced = cluster.produce(topic, keyed_items(1000, 50))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    handle = logging_handler(log, sleep=0.001)
    pool = ThreadPoolScheduler(8)

    def work(record: Record) -> rx.Observable[Record]:
        return rx.from_callable(lambda: handle(record), scheduler=pool).pipe(
            ops.map(lambda _: record)
        )

    errors: list[Exception] = []
    subscription = (
        kafka_records(cluster.config(group), [topic], commit_interval=0.1)
        .pipe(serialize_by_key(lambda r: r.key, work, max_concurrent=8), commit_records())
        .subscribe(on_error=errors.append)
    )
    try:
        wait_for(all_done(cluster, produced), 60, "all records")
        wait_for(lambda: cluster.committed(topic, group, 4) == produced.end, 30, "commit at end")
    finally:
        subscription.dispose()
        pool.executor.shutdown()
    assert errors == []
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_rx_source_reports_start_errors(cluster: Cluster) -> None:
    errors: list[Exception] = []
    done = threading.Event()

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        done.set()

    subscription = kafka_records(cluster.config(cluster.group()), ["missing-topic"]).subscribe(
        on_error=on_error
    )
    assert done.wait(30)
    subscription.dispose()
    assert isinstance(errors[0], rxcoord.kafka.UnknownTopic)


async def test_async_handlers_run_on_the_loop_of_run_async(cluster: Cluster) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(300, 20))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    loop = asyncio.get_running_loop()
    on_loop: list[bool] = []

    async def handle(record: Record) -> None:
        started = log.start(record)
        on_loop.append(asyncio.get_running_loop() is loop)
        await asyncio.sleep(0.001)
        log.end(record, started)

    consumer = KeyedConsumer(cluster.config(group), [topic], handle, commit_interval=0.1)
    task = asyncio.create_task(consumer.run_async())
    deadline = time.monotonic() + 60
    while not all_done(cluster, produced)():
        assert time.monotonic() < deadline, "records not processed"
        await asyncio.sleep(0.05)
    await consumer.aclose()
    await task
    assert all(on_loop)
    assert len(on_loop) >= 300
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_tenant_scheduler_runs_the_records(cluster: Cluster) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(400, 40))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    with TenantScheduler(max_concurrency=4, tenant_max_concurrency=2) as scheduler:
        consumer = KeyedConsumer(
            cluster.config(group), [topic], logging_handler(log, sleep=0.001),
            scheduler=scheduler, tenant=lambda r: (r.key or b"")[-1:], commit_interval=0.1,
        )  # fmt: skip
        running = Running(consumer)
        wait_for(all_done(cluster, produced), 60, "all records")
        wait_for(lambda: cluster.committed(topic, group, 2) == produced.end, 30, "commit at end")
        assert running.stop() is None
        stats = scheduler.stats()
        assert stats.completed == 400  # every record ran as a job of the scheduler
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_sync_handlers_returning_futures(cluster: Cluster) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(200, 20))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    handle = logging_handler(log, sleep=0.001)
    with ThreadPoolExecutor(4) as pool:
        consumer = KeyedConsumer(
            cluster.config(group), [topic], lambda r: pool.submit(handle, r), commit_interval=0.1
        )
        running = Running(consumer)
        wait_for(all_done(cluster, produced), 60, "all records")
        assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_a_future_returned_under_a_lease_scheduler_keeps_the_keys_lease_until_it_ends(
    cluster: Cluster,
) -> None:
    topic = cluster.topic(1)
    produced = cluster.produce(topic, [("K", i) for i in range(5)])
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    store = MemoryLeaseStore()
    watcher = MemoryLeases(store)  # another process's view of the store
    held_while_working: list[bool] = []
    handle = logging_handler(log)

    def work(record: Record) -> None:
        time.sleep(0.05)  # long after the handler returned the future
        held_while_working.append(watcher.holder("keys:b'K'") is not None)
        handle(record)

    with (
        ThreadPoolExecutor(2) as pool,
        TenantTaskCoordinator(
            max_concurrency=4, max_queue_size=100, name="keys", leases=MemoryLeases(store)
        ) as coordinator,
    ):
        consumer = KeyedConsumer(
            cluster.config(group), [topic], lambda r: pool.submit(work, r),
            scheduler=coordinator, commit_interval=0.1,
        )  # fmt: skip
        running = Running(consumer)
        wait_for(all_done(cluster, produced), 60, "all records")
        assert running.stop() is None
    # The record's work is the future's: the key's lease covers it, as it covers a handler
    # that does its work before returning.
    assert held_while_working == [True] * 5
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_records_refused_by_a_full_coordinator_are_offered_again(cluster: Cluster) -> None:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(200, 50))
    group = cluster.group()
    log = RunLog(cluster.log_for("w0"), "w0")
    # One job at a time and no queue, while the consumer offers up to 8: most offers are
    # refused with TooManyTasks and must come back, not be lost or skipped.
    with TenantTaskCoordinator(max_concurrency=1, max_queue_size=0) as coordinator:
        consumer = KeyedConsumer(
            cluster.config(group), [topic], logging_handler(log, sleep=0.002),
            scheduler=coordinator, max_concurrency=8, commit_interval=0.1,
        )  # fmt: skip
        running = Running(consumer)
        wait_for(all_done(cluster, produced), 90, "all records")
        wait_for(lambda: cluster.committed(topic, group, 2) == produced.end, 30, "commit at end")
        assert running.stop() is None
        assert coordinator.stats().rejected > 0
    check_invariants(produced, cluster.runs(), duplicates=False)
