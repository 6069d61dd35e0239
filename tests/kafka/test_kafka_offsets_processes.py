"""Exactly once into PostgreSQL across real processes: ``kill -9``, scaling, ``SIGSTOP``, a restart.

Each member is a real process (``offsets_worker.py``) in one consumer group, on the real broker
and a real PostgreSQL; its handler inserts into an effects table without a unique constraint
inside the record's transaction. The checker (``effects.py``) asserts over that table that
every produced (key, seq) was applied exactly once, per key in seq order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.servers import ThrowawayPostgres, start_postgres

from .effects import Effects, check_exactly_once
from .support import SESSION_TIMEOUT_MS, Cluster, Produced, keyed_items, wait_for

ROOT = Path(__file__).resolve().parents[2]
# Real processes, kill -9, SIGSTOP, a database restart: stress tests (make test-slow).
pytestmark = pytest.mark.slow


class Member:
    """One consumer process of the group."""

    def __init__(
        self, cluster: Cluster, effects: Effects, topic: str, group: str, name: str,
        *options: str,
    ) -> None:  # fmt: skip
        self.name = name
        self.output = cluster.tmp / f"{name}.out"
        args = [
            sys.executable, "-m", "tests.kafka.offsets_worker", cluster.bootstrap, topic, group,
            effects.url, effects.offsets_table, effects.table, name, *options,
        ]  # fmt: skip
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def terminate(self, timeout: float = 60) -> dict[str, Any]:
        """SIGTERM (drain, commit, leave); the store's statistics it printed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        output = self.output.read_text()
        assert self.proc.returncode == 0, f"{self.name}: {output[-3000:]}"
        stats: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        return stats

    def assigned(self) -> bool:
        """Whether the member got partitions (it logs each assignment)."""
        return "assigned [" in self.output.read_text(errors="replace")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def members() -> Iterator[list[Member]]:
    started: list[Member] = []
    try:
        yield started
    finally:
        for member in started:
            member.stop()
            # Shown with a failure's report: what each member printed (its last lines).
            lines = member.output.read_text(errors="replace").splitlines()
            print(f"--- {member.name} (exit {member.proc.returncode}):", *lines[-15:], sep="\n")


@pytest.fixture
def effects(cluster: Cluster, postgres_url: str) -> Iterator[Effects]:
    table = Effects(postgres_url, cluster.tag)
    try:
        yield table
    finally:
        table.drop()


def _applied(effects: Effects) -> set[tuple[str, int]]:
    return {(r.key, r.seq) for r in effects.rows()}


def _all_applied(effects: Effects, produced: Produced) -> bool:
    return _applied(effects) >= set(produced.where)


def _folded(effects: Effects, produced: Produced) -> None:
    """Bounded storage: at the end, one row per partition, at the partition's end."""
    rows = effects.stored()
    assert {(r[2], r[3], r[5]) for r in rows} == {(p, -1, end) for p, end in produced.end.items()}


def test_kill_9_of_one_of_three_members_mid_stream(
    cluster: Cluster, effects: Effects, members: list[Member]
) -> None:
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(6000, 1000))
    group = cluster.group()
    for i in range(3):
        members.append(Member(cluster, effects, topic, group, f"w{i}", "--sleep-ms", "5"))
    # Each member got partitions (whether it has applied a record yet is a matter of timing).
    wait_for(lambda: all(m.assigned() for m in members), 90, "3 members with partitions")
    wait_for(lambda: len(_applied(effects)) >= 2500, 120, "progress before the kill")
    members[1].kill()  # transactions in flight roll back with its connections
    wait_for(lambda: _all_applied(effects, produced), 180, "the survivors finish the stream")
    members[0].terminate()
    time.sleep(SESSION_TIMEOUT_MS / 1000)  # Tansu: members leave a rebalance apart
    members[2].terminate()
    check_exactly_once(produced, effects.rows())
    _folded(effects, produced)


def test_scale_1_to_3_and_back_to_1(
    cluster: Cluster, effects: Effects, members: list[Member]
) -> None:
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(8000, 1000))
    group = cluster.group()
    members.append(Member(cluster, effects, topic, group, "w0", "--sleep-ms", "10"))
    wait_for(lambda: len(_applied(effects)) >= 500, 90, "w0 alone")
    for name in ("w1", "w2"):  # one join at a time: the group settles in between
        members.append(Member(cluster, effects, topic, group, name, "--sleep-ms", "10"))
        wait_for(members[-1].assigned, 90, f"{name} with partitions")
    wait_for(lambda: len(_applied(effects)) >= 4000, 180, "progress with 3")
    # Tansu: two members leaving at the same moment can leave the survivor without
    # partitions, so they leave one after the other (see the guide's Tansu notes).
    members[1].terminate()
    time.sleep(SESSION_TIMEOUT_MS / 1000)
    members[2].terminate()
    wait_for(lambda: _all_applied(effects, produced), 180, "w0 alone again finishes")
    members[0].terminate()
    check_exactly_once(produced, effects.rows())
    # Every partition changed hands at least twice (out to the new members, back to w0):
    # each assignment took a new epoch.
    assert all(row[4] >= 3 for row in effects.stored()), effects.stored()
    _folded(effects, produced)


@pytest.mark.parametrize("idle", ["60", "3"], ids=["transactions-kept", "transactions-ended"])
def test_a_member_stopped_past_the_session_timeout_rolls_its_late_transactions_back(
    cluster: Cluster, effects: Effects, members: list[Member], idle: str
) -> None:
    """A is frozen (``SIGSTOP``) with transactions open; past the session timeout the group
    gives its partitions to B, which claims them and finishes the stream while A is frozen;
    then A resumes. Every record is applied exactly once.

    * ``transactions-kept`` (``--idle 60``, longer than the freeze): A's open transactions
      survive; resumed, they reach their marks and find B's epochs: they roll back (fenced).
    * ``transactions-ended`` (``--idle 3``): PostgreSQL ends A's idle transactions while it is
      frozen; resumed, A finds its connections closed, and its retries end dropped or fenced.
    """
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(8000, 800))
    group = cluster.group()
    options = ("--sleep-ms", "20", "--idle", idle, "--concurrency", "8")
    member_a = Member(cluster, effects, topic, group, "A", *options)
    members.append(member_a)
    wait_for(lambda: len(_applied(effects)) >= 300, 90, "A alone")
    member_b = Member(cluster, effects, topic, group, "B", *options)
    members.append(member_b)
    wait_for(member_b.assigned, 90, "B with partitions")
    wait_for(lambda: {r.worker for r in effects.rows()} == {"A", "B"}, 90, "A and B applying")
    os.kill(member_a.proc.pid, signal.SIGSTOP)
    at_stop = effects.rows()
    stopped_at = max(r.id for r in at_stop)
    applied = {(r.key, r.seq) for r in at_stop}
    left = {p for ks, (p, _) in produced.where.items() if ks not in applied}
    assert len(applied) < len(produced.where) - 1000, "stopped too late to test a takeover"
    # Past the session timeout B owns every partition, claims them and finishes the stream
    # alone, while A is still frozen.
    wait_for(lambda: _all_applied(effects, produced), 180, "B finishing the stream")
    after = {r.partition for r in effects.rows() if r.id > stopped_at and r.worker == "B"}
    assert after >= left
    os.kill(member_a.proc.pid, signal.SIGCONT)
    time.sleep(SESSION_TIMEOUT_MS / 1000)  # A wakes up, tries its transactions, rejoins
    stats_b = member_b.terminate()
    time.sleep(SESSION_TIMEOUT_MS / 1000)
    stats_a = member_a.terminate()
    check_exactly_once(produced, effects.rows())
    assert not [r for r in effects.rows() if r.worker == "A" and r.id > stopped_at]
    if idle == "60":
        assert stats_a["fenced"] >= 1, stats_a  # its late marks met B's epochs
    else:
        assert stats_a["retried"] >= 1, stats_a  # its connections had been closed
    assert stats_b["claims"] >= 8
    _folded(effects, produced)


@pytest.fixture
def restartable_postgres() -> Iterator[ThrowawayPostgres]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.remove()


def test_a_postgresql_restart_mid_run(
    cluster: Cluster, members: list[Member], restartable_postgres: ThrowawayPostgres
) -> None:
    """The database restarts (a fast shutdown, then a start) while two members run: the
    transactions in flight fail as an outage and are tried again once it is back (within
    ``outage_timeout``), claims and folds too; every record is applied exactly once."""
    topic = cluster.topic(8)
    produced = cluster.produce(topic, keyed_items(5000, 500))
    group = cluster.group()
    effects = Effects(restartable_postgres.url, cluster.tag)
    for name in ("w0", "w1"):
        members.append(Member(cluster, effects, topic, group, name, "--sleep-ms", "5"))
    wait_for(lambda: all(m.assigned() for m in members), 90, "2 members with partitions")
    wait_for(lambda: len(_applied(effects)) >= 1500, 120, "progress before the restart")
    restartable_postgres.stop("fast")
    time.sleep(2)  # down for a while: transactions, folds and commits fail meanwhile
    restartable_postgres.start()
    wait_for(lambda: _all_applied(effects, produced), 180, "every record after the restart")
    stats = [members[0].terminate()]
    time.sleep(SESSION_TIMEOUT_MS / 1000)
    stats.append(members[1].terminate())
    check_exactly_once(produced, effects.rows())
    assert sum(s["retried"] for s in stats) >= 1  # the outage was met, and ridden out
    _folded(effects, produced)
