"""``TenantTaskCoordinator(leases=...)``: keyed jobs also hold their key's distributed lease."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.waiting import WAIT

from rxcoord import LeaseKeyGuard, TenantTaskCoordinator
from rxcoord.leases import MemoryLeases, MemoryLeaseStore


class KeyMeter:
    """How many jobs of one key run at once, across coordinators."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0

    def job(self, seconds: float = 0.01) -> Callable[[], None]:
        def run() -> None:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            time.sleep(seconds)
            with self.lock:
                self.running -= 1

        return run


def run_on_two_coordinators(leased: bool) -> int:
    """Two coordinators of the same name stand in for two processes sharing a lease store."""
    store = MemoryLeaseStore()
    meter = KeyMeter()
    providers = [MemoryLeases(store), MemoryLeases(store)] if leased else [None, None]
    coordinators = [
        TenantTaskCoordinator(max_concurrency=2, max_queue_size=20, name="orders", leases=p)
        for p in providers
    ]
    done = threading.Semaphore(0)
    for _ in range(6):
        for c in coordinators:
            c.execute(meter.job(), key="customer-7").subscribe(
                on_completed=done.release, on_error=lambda e: done.release()
            )
    for _ in range(12):
        assert done.acquire(timeout=WAIT)
    for c in coordinators:
        c.close()
    for p in providers:
        if p is not None:
            p.close()
    return meter.most


def test_keyed_jobs_are_exclusive_across_coordinators_sharing_a_lease_store() -> None:
    assert run_on_two_coordinators(leased=False) == 2  # the control: each orders only its own
    assert run_on_two_coordinators(leased=True) == 1


async def test_async_keyed_jobs_hold_the_lease_too() -> None:
    store = MemoryLeaseStore()
    running = 0
    most = 0

    async def job() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.005)
        running -= 1

    providers = [MemoryLeases(store), MemoryLeases(store)]
    coordinators = [
        TenantTaskCoordinator(max_concurrency=2, max_queue_size=20, name="o", leases=p)
        for p in providers
    ]
    await asyncio.gather(*(c.execute(job, key="k") for _ in range(5) for c in coordinators))
    for c in coordinators:
        c.close()
    for p in providers:
        p.close()
    assert most == 1
    assert store.stats().held == 0  # every lease released


def test_unkeyed_jobs_take_no_lease() -> None:
    store = MemoryLeaseStore()
    with MemoryLeases(store) as leases, TenantTaskCoordinator(name="o", leases=leases) as c:
        assert c.execute(lambda: 1).run() == 1
        assert leases.stats().granted == 0
        assert c.execute(lambda: 2, key="k").run() == 2
        assert leases.stats().granted == 1
        assert leases.stats().held == 0


def test_leases_without_a_name_are_refused_at_construction_like_fleet() -> None:
    # Unnamed, every coordinator on a store would take the lease ":<key>" for its keyed jobs,
    # excluding other unnamed coordinators' keys by accident (issue 26).
    with MemoryLeases() as leases:
        with pytest.raises(ValueError, match=r"pass name='orders'.* to the coordinator"):
            TenantTaskCoordinator(leases=leases)
        with pytest.raises(ValueError, match="pass name="):
            LeaseKeyGuard(leases, "", 30.0)  # the check lives where lease names are made
        with pytest.raises(TypeError, match="name must be a str"):
            LeaseKeyGuard(leases, None, 30.0)  # type: ignore[arg-type]
        with TenantTaskCoordinator(name="orders", leases=leases) as named:
            held = named.execute(lambda: leases.holder("orders:k"), key="k").run()
        assert held is not None  # the job ran under the lease "orders:k"


def test_bad_lease_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="lease_at_most_for"):
        TenantTaskCoordinator(lease_at_most_for=0)


WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from rxcoord import LeaseKeyGuard, TenantTaskCoordinator
    from rxcoord.leases import SqliteLeases

    db, counter = sys.argv[1], Path(sys.argv[2])

    def increment() -> None:  # a read-modify-write that loses updates unless exclusive
        value = int(counter.read_text())
        time.sleep(0.002)
        counter.write_text(str(value + 1))

    with SqliteLeases(db) as leases, TenantTaskCoordinator(
        max_concurrency=2, max_queue_size=100, name="counter", leases=leases
    ) as c:
        for _ in range(15):
            c.execute(increment, key="the-counter").run()
    """
)


@pytest.mark.slow
def test_no_lost_update_across_os_processes(tmp_path: Path) -> None:
    counter = tmp_path / "counter.txt"
    counter.write_text("0")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "leases.db"), str(counter)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    errors: list[Any] = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode:
            errors.append(err)
    assert errors == []
    assert int(counter.read_text()) == 45
