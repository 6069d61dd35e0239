"""on_error policies with a poison record, start-up errors and argument checks."""

from __future__ import annotations

import time
from typing import Any

import pytest

from rxcoord import TenantScheduler
from rxcoord.kafka import BrokerUnavailable, ConsumerClosed, KeyedConsumer, Record, UnknownTopic

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


class Poison(Exception):
    pass


def poison_hook(record: Record) -> None:
    if record.value == b"k3:5":
        raise Poison(f"poison at {record.offset}")


def _setup(cluster: Cluster) -> tuple[str, Any, str, RunLog]:
    topic = cluster.topic(2)
    produced = cluster.produce(topic, keyed_items(400, 10))
    return topic, produced, cluster.group(), RunLog(cluster.log_for("w0"), "w0")


def test_stop_commits_the_safe_prefix_and_raises(cluster: Cluster) -> None:
    topic, produced, group, log = _setup(cluster)
    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, sleep=0.001, hook=poison_hook),
        commit_interval=0.1,
    )  # fmt: skip
    with pytest.raises(Poison, match="poison at"):
        consumer.run()  # returns by itself: the poison record stops it
    partition, offset = produced.where[("k3", 5)]
    committed = cluster.committed(topic, group, 2)
    assert committed[partition] <= offset  # never past the failed record
    runs = cluster.runs()
    ended = {(r.partition, r.offset) for r in runs if r.end is not None}
    for p, upto in committed.items():  # everything below a commit point did complete
        assert all((p, o) in ended for o in range(max(upto, 0)))
    # No later record of the poison key ran after it.
    assert not [r for r in runs if r.key == "k3" and r.seq > 5]
    assert consumer.stats().failed == 1


def test_skip_logs_and_goes_on(cluster: Cluster) -> None:
    topic, produced, group, log = _setup(cluster)
    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=poison_hook),
        on_error="skip", commit_interval=0.1,
    )  # fmt: skip
    running = Running(consumer)
    wait_for(all_done(cluster, produced), 60, "all records")
    wait_for(lambda: cluster.committed(topic, group, 2) == produced.end, 30, "commit at end")
    assert running.stop() is None
    check_invariants(produced, cluster.runs(), duplicates=False)
    assert consumer.stats().failed == 1


def test_callable_decides_and_the_record_is_done(cluster: Cluster) -> None:
    topic, produced, group, log = _setup(cluster)
    dead: list[tuple[int, str]] = []
    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=poison_hook),
        on_error=lambda record, exc: dead.append((record.offset, type(exc).__name__)),
        commit_interval=0.1,
    )  # fmt: skip
    running = Running(consumer)
    wait_for(all_done(cluster, produced), 60, "all records")
    wait_for(lambda: cluster.committed(topic, group, 2) == produced.end, 30, "commit at end")
    assert running.stop() is None
    assert dead == [(produced.where[("k3", 5)][1], "Poison")]
    check_invariants(produced, cluster.runs(), duplicates=False)


def test_callable_that_raises_stops_with_its_exception(cluster: Cluster) -> None:
    topic, _, group, log = _setup(cluster)

    def refuse(record: Record, exc: Exception) -> None:
        raise RuntimeError("dead-letter topic unavailable")

    consumer = KeyedConsumer(
        cluster.config(group), [topic], logging_handler(log, hook=poison_hook), on_error=refuse
    )
    with pytest.raises(RuntimeError, match="dead-letter topic unavailable"):
        consumer.run()


def test_unknown_topic_is_an_error_at_start(cluster: Cluster) -> None:
    consumer = KeyedConsumer(cluster.config(cluster.group()), ["no-such-topic"], print)
    with pytest.raises(UnknownTopic, match="no-such-topic"):
        consumer.run()
    with pytest.raises(ConsumerClosed, match="runs once"):
        consumer.run()


def test_unreachable_broker_is_an_error_at_start() -> None:
    consumer = KeyedConsumer(
        {"bootstrap.servers": "127.0.0.1:1", "group.id": "g", "log_level": 0},
        ["orders"], print, startup_timeout=1,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:1"):
        consumer.run()
    assert time.monotonic() - started < 30  # an error, not a hang


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"config": {"bootstrap.servers": "h:1"}}, ValueError, "group.id"),
        ({"config": {"group.id": "g"}}, ValueError, "bootstrap.servers"),
        ({"config": {"bootstrap.servers": "h:1", "group.id": "g", "enable.auto.commit": True}},
         ValueError, "enable.auto.commit"),
        ({"config": {"bootstrap.servers": "h:1", "group.id": "g", "no.such.property": 1}},
         ValueError, "no.such.property"),
        ({"config": "h:1"}, TypeError, "dict of confluent-kafka settings"),
        ({"topics": "orders"}, TypeError, r"\['orders'\]"),
        ({"topics": []}, ValueError, "at least one topic"),
        ({"handle": 3}, TypeError, "handle must be callable"),
        ({"key": "k"}, TypeError, "key must be a callable"),
        ({"max_concurrency": 0}, ValueError, "max_concurrency must be at least 1"),
        ({"max_concurrency": 2.5}, TypeError, "max_concurrency must be an int"),
        ({"max_in_flight": True}, TypeError, "max_in_flight must be an int"),
        ({"on_error": "retry"}, ValueError, "on_error must be"),
        ({"scheduler": object()}, TypeError, "scheduler must be"),
        ({"tenant": len}, ValueError, "needs scheduler=TenantScheduler"),
        ({"commit_interval": 0}, ValueError, "commit_interval must be a positive"),
        ({"drain_timeout": "5"}, TypeError, "drain_timeout must be a number"),
        ({"inline": 1}, TypeError, "inline must be"),
    ],
)  # fmt: skip
def test_arguments_are_checked_at_the_call(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {
        "config": {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"},
        "topics": ["orders"],
        "handle": print,
    }
    args.update(kwargs)
    config, topics, handle = args.pop("config"), args.pop("topics"), args.pop("handle")
    with pytest.raises(error, match=message):
        KeyedConsumer(config, topics, handle, **args)


def test_tenant_scheduler_needs_tenant() -> None:
    with (
        TenantScheduler(max_concurrency=2) as scheduler,
        pytest.raises(ValueError, match="tenant="),
    ):
        KeyedConsumer(
            {"bootstrap.servers": "127.0.0.1:1", "group.id": "g"}, ["t"], print,
            scheduler=scheduler,
        )  # fmt: skip
