"""Lease metrics on every backend, read back from the real OpenTelemetry SDK.

``rxcoord.lease.wait`` (by backend and outcome), ``rxcoord.leases.held`` and
``rxcoord.leases.lost`` after known workloads: waits that succeed at once, after a release,
that find the name taken, that time out, that are cancelled; a lease lost by expiry.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.otel import Telemetry
from support.waiting import wait_until

from rxcoord.leases import LeaseLost, LockTimeout

from .conftest import Backend

WAIT = "rxcoord.lease.wait"


def outcome(backend: Backend, name: str) -> dict[str, str]:
    return {"rxcoord.backend": backend.name, "rxcoord.outcome": name}


def test_lease_waits_by_outcome(backend: Backend, otel: Telemetry, name: str) -> None:
    leases, other = backend.new(), backend.new()
    held = other.acquire(name)  # acquired at once (1)
    assert leases.try_acquire(name) is None  # taken (1)
    with pytest.raises(LockTimeout):
        leases.acquire(name, timeout=0.2)  # timed out after waiting (1)
    with pytest.raises(LockTimeout):
        leases.acquire(name, timeout=0)  # timed out at once (2)
    skipped = threading.Event()
    ran: list[object] = []
    leases.run(name, lambda: 1).subscribe(ran.append, on_completed=skipped.set)  # taken (2)
    assert skipped.wait(10)
    assert ran == []
    threading.Timer(0.2, held.release).start()
    lease = leases.acquire(name, timeout=10)  # acquired after a wait of >= 0.2 s (2)
    lease.release()
    metrics = otel.collect()
    assert metrics.count(WAIT, outcome(backend, "acquired")) == 2
    assert metrics.count(WAIT, outcome(backend, "timed_out")) == 2
    assert metrics.count(WAIT, outcome(backend, "failed")) == 0
    assert metrics.max(WAIT, outcome(backend, "acquired")) >= 0.15
    assert metrics.min(WAIT, outcome(backend, "timed_out")) < 0.15  # the one that did not wait
    assert metrics.max(WAIT, outcome(backend, "timed_out")) >= 0.15
    assert metrics.count(WAIT, outcome(backend, "taken")) == 2


async def test_async_waits_acquired_and_cancelled(
    backend: Backend, otel: Telemetry, name: str
) -> None:
    leases, other = backend.new(), backend.new()
    held = await other.acquire_async(name)
    waiting = asyncio.create_task(leases.acquire_async(name, timeout=30))
    await asyncio.sleep(0.1)
    waiting.cancel()  # cancelled (1)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await held.release_async()
    lease = await leases.acquire_async(name)
    await lease.release_async()
    metrics = otel.collect()
    assert metrics.count(WAIT, outcome(backend, "acquired")) == 2
    assert metrics.count(WAIT, outcome(backend, "cancelled")) == 1


def test_leases_held_is_the_number_held_now(backend: Backend, otel: Telemetry, name: str) -> None:
    held = {"rxcoord.backend": backend.name}
    leases = backend.new()
    before = otel.collect().value("rxcoord.leases.held", held)
    first, second = leases.acquire(name), leases.acquire(name + "-2")
    assert otel.collect().value("rxcoord.leases.held", held) == before + 2
    first.release()
    assert otel.collect().value("rxcoord.leases.held", held) == before + 1
    second.release()
    assert otel.collect().value("rxcoord.leases.held", held) == before


def test_a_lost_lease_is_counted(backend: Backend, otel: Telemetry, name: str) -> None:
    leases = backend.new()
    held = {"rxcoord.backend": backend.name}
    before = otel.collect().value("rxcoord.leases.held", held)
    lease = leases.acquire(name, at_most_for=0.3)
    wait_until(lambda: leases.holder(name) is None, what="the lease's expiry on the store")
    with pytest.raises(LeaseLost):
        lease.release()
    metrics = otel.collect()
    assert metrics.value("rxcoord.leases.lost", held) == 1
    assert metrics.value("rxcoord.leases.held", held) == before  # a lost lease is not held
