"""Per-key exclusion across processes past ``revoke_timeout``, on a real broker and a real Redis.

A revoke gives running records of a revoked partition ``revoke_timeout`` seconds; past it the
partition goes to its new owner while the old run may go on. Nothing inside Kafka can stop that
(the group's rebalance proceeds without a member that does not answer, and a Python thread
cannot be stopped), so within the library the guarantee is: no overlap while records finish
within ``revoke_timeout``. Past it, per-key exclusion across the fleet comes from a lease per
key: ``scheduler=TenantTaskCoordinator(leases=provider)``. These tests run that scenario with
real processes (``tests/kafka/fleet.py``): member A blocks in the first record of every
partition far past ``revoke_timeout``; member B joins and takes some partitions over from the
commit point, so it fetches those very records again while A's runs of them still go on.

* with leases, B's run of such a key waits for A's lease (while B's other keys progress), so no
  two runs of a key overlap, also when A is killed with ``kill -9`` mid-run (its lease expires);
* without leases, B's run overlaps A's: the limit the README documents, shown here.

Handlers log ``(key, seq, worker, start, end)`` to a Redis list; the invariant checker of
``support.py`` runs over it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from .fleet import read_fleet_runs
from .support import (
    SESSION_TIMEOUT_MS,
    Cluster,
    Produced,
    Run,
    check_invariants,
    completed_pairs,
    keyed_items,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
# Real processes, a kill -9 and rebalances: stress tests, run one at a time (make test-slow).
pytestmark = pytest.mark.slow
PARTITIONS = 8


class Member:
    """One fleet process (``python -m tests.kafka.fleet``)."""

    def __init__(self, cluster: Cluster, topic: str, group: str, redis_url: str, prefix: str,
                 name: str, leases: bool) -> None:  # fmt: skip
        self.name = name
        self.output = cluster.tmp / f"{name}.out"
        args = [sys.executable, "-m", "tests.kafka.fleet", cluster.bootstrap, topic, group,
                redis_url, prefix, name, *(["--leases"] if leases else [])]  # fmt: skip
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def terminate(self, timeout: float = 60) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, f"{self.name}: {self.output.read_text()[-3000:]}"

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Fleet:
    """A test's topic, group, Redis log and members."""

    def __init__(self, cluster: Cluster, redis_url: str) -> None:
        self.cluster = cluster
        self.redis_url = redis_url
        self.client = redis.Redis.from_url(redis_url)
        self.prefix = f"fleet-{cluster.tag}"
        self.topic = cluster.topic(PARTITIONS)
        self.group = cluster.group()
        self.produced: Produced = cluster.produce(self.topic, keyed_items(800, 100))
        # The first record of every partition blocks in its first run (see fleet.py).
        self.slow = {p: self.produced.at(p, 0) for p in range(PARTITIONS)}
        self.client.sadd(f"{self.prefix}:slow", *(f"{k}:{s}" for k, s in self.slow.values()))
        self.members: list[Member] = []

    def start(self, name: str, leases: bool) -> Member:
        member = Member(self.cluster, self.topic, self.group, self.redis_url, self.prefix, name,
                        leases)  # fmt: skip
        self.members.append(member)
        return member

    def runs(self) -> list[Run]:
        return read_fleet_runs(self.client, self.prefix)

    def release(self) -> None:
        for k, s in self.slow.values():
            self.client.rpush(f"{self.prefix}:release:{k}:{s}", 1)

    def leave_one_by_one(self) -> None:
        """SIGTERM the live members one after the other, a rebalance apart.

        Tansu: a member leaving while the group still rebalances after the previous leave can
        hang in its drain past any timeout (seen once in a CI run: B never exited after A's
        leave); with a session timeout's wait between leaves the group settles first (see the
        README's Kafka section).
        """
        live = [member for member in self.members if member.proc.poll() is None]
        for i, member in enumerate(live):
            if i:
                time.sleep(SESSION_TIMEOUT_MS / 1000)
            member.terminate()

    def close(self) -> None:
        for member in self.members:
            member.stop()
        self.client.close()

    def first_runs_of_a(self) -> dict[int, Run]:
        """A's blocked runs: the first record of each partition."""
        return {r.partition: r for r in self.runs() if r.worker == "A" and r.offset == 0}

    def b_took_over(self) -> set[int]:
        """Partitions B has processed past their first record (so B fetched it again)."""
        return {r.partition for r in self.runs() if r.worker == "B" and r.end and r.offset > 0}

    def all_done(self) -> bool:
        return set(self.produced.where) <= completed_pairs(self.runs())


def _start_a_then_b(fleet: Fleet, leases: bool) -> None:
    fleet.start("A", leases)
    # A alone owns every partition and blocks in each first record (under its key's lease).
    wait_for(lambda: len(fleet.first_runs_of_a()) == PARTITIONS, 60, "A blocked in 8 records")
    fleet.start("B", leases)


@pytest.mark.parametrize("a_ends", ["released", "kill -9"])
def test_leases_keep_a_key_exclusive_past_revoke_timeout(
    cluster: Cluster, redis_url: str, a_ends: str
) -> None:
    fleet = Fleet(cluster, redis_url)
    try:
        _start_a_then_b(fleet, leases=True)
        # The rebalance moves partitions to B after A's revoke waited revoke_timeout in vain;
        # B fetches them from the commit point (0), past the records A still runs.
        wait_for(lambda: bool(fleet.b_took_over()), 90, "B processing a partition taken from A")
        moved = fleet.b_took_over()
        a_first = fleet.first_runs_of_a()
        # B has not run those records: each waits for its key's lease, held by A's run.
        slow_keys = {fleet.slow[p][0] for p in moved}
        assert not [r for r in fleet.runs() if r.worker == "B" and r.key in slow_keys]
        assert all(a_first[p].end is None for p in moved)
        killed_at = math.inf
        if a_ends == "kill -9":
            fleet.members[0].kill()
            killed_at = time.monotonic()
        fleet.release()
        wait_for(fleet.all_done, 90, "every record completed")
        fleet.leave_one_by_one()
        runs = fleet.runs()
        dead = ["A"] if a_ends == "kill -9" else []
        check_invariants(fleet.produced, runs, duplicates=True, dead=dead)
        a_first = fleet.first_runs_of_a()
        for p in moved:
            k, _ = fleet.slow[p]
            b_runs = [r for r in runs if r.worker == "B" and r.key == k]
            assert b_runs, f"B never ran {k} of partition {p}"
            first_b = min(r.start for r in b_runs)
            if killed_at < math.inf:
                # A's run never ended: it lasted until the kill, and B's began only after it
                # (when A's lease expired).
                assert first_b > killed_at
            else:
                a_end = a_first[p].end
                assert a_end is not None
                assert first_b >= a_end
    finally:
        fleet.release()
        fleet.close()


def test_without_leases_a_run_past_revoke_timeout_overlaps_the_new_owners(
    cluster: Cluster, redis_url: str
) -> None:
    fleet = Fleet(cluster, redis_url)
    try:
        _start_a_then_b(fleet, leases=False)

        def b_ran_a_blocked_key() -> bool:
            keys = {fleet.slow[p][0] for p in range(PARTITIONS)}
            return any(r.worker == "B" and r.key in keys for r in fleet.runs())

        # Nothing holds B back: it runs the records A is still running.
        wait_for(b_ran_a_blocked_key, 90, "B running a record A still runs")
        fleet.release()
        wait_for(fleet.all_done, 90, "every record completed")
        fleet.leave_one_by_one()
        # A's run of each such key and B's overlap (which also puts the key's first
        # completions out of order, the first thing the checker looks at).
        with pytest.raises(AssertionError, match=r"overlap|out of order"):
            check_invariants(fleet.produced, fleet.runs(), duplicates=True)
    finally:
        fleet.release()
        fleet.close()
