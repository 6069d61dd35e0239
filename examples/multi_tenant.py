"""A multi-tenant service on ``TenantScheduler``, with one tenant flooding it.

Two mechanisms protect the tenants from each other, and this example shows them one at a time:

1. **The per-tenant cap and queue bound.** ``acme`` alone sends 100 jobs to a scheduler with 4
   global slots, ``tenant_max_concurrency=2`` and ``tenant_max_queue_size=50``: at most 2 of its
   jobs ever run at once, although 4 slots are free, and what does not fit in its queue is
   refused at once with ``TooManyTasks`` instead of queueing without bound.
2. **Fair sharing of the global slots.** Now the cap equals the global limit (4 and 4), so the
   cap protects nobody: ``acme`` takes all 4 slots and queues 400 jobs; then three small
   tenants send 10 jobs each. The scheduler gives the next free slot to the tenant furthest
   behind its share, so the small tenants wait about one job per competing tenant. The
   baseline is measured, not estimated: the same submissions, in the same order, go to a FIFO
   ``ThreadPoolExecutor`` with 4 workers, where the small tenants wait behind the whole flood.

Idle tenants leave no state behind. Latencies depend on the machine; the limits do not.
Run: ``python examples/multi_tenant.py``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rxcoord import TenantScheduler, TooManyTasks

JOB_SECONDS = 0.004
SLOTS = 4
FLOOD = 400
SMALL_TENANTS = ("bolt", "cider", "dune")
SMALL_JOBS = 10


class Running:
    """Counts the jobs running now, per tenant and in all, and the peaks they reached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.peak_total = 0

    def job(self, tenant: str) -> Callable[[], None]:
        def work() -> None:
            with self._lock:
                self._now[tenant] += 1
                self.peak[tenant] = max(self.peak[tenant], self._now[tenant])
                self.peak_total = max(self.peak_total, self._now.total())
            try:
                time.sleep(JOB_SECONDS)  # a handler doing I/O
            finally:
                with self._lock:
                    self._now[tenant] -= 1

        return work


class Outcomes:
    """Latency (submission to completion) of each finished job, refusals, and a countdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.rejected: Counter[str] = Counter()
        self._settled = threading.Semaphore(0)
        self._submitted = 0

    def submit(self, scheduler: TenantScheduler, tenant: str, job: Callable[[], None]) -> None:
        start = time.perf_counter()

        def done() -> None:
            with self._lock:
                self.latencies[tenant].append(time.perf_counter() - start)
            self._settled.release()

        def failed(error: Exception) -> None:
            if isinstance(error, TooManyTasks):
                with self._lock:
                    self.rejected[tenant] += 1
            self._settled.release()

        scheduler.execute(tenant, job).subscribe(on_completed=done, on_error=failed)
        self._submitted += 1

    def wait(self) -> None:
        for _ in range(self._submitted):
            self._settled.acquire()


def per_tenant_cap() -> None:
    running, outcomes = Running(), Outcomes()
    with TenantScheduler(
        SLOTS, tenant_max_concurrency=2, tenant_max_queue_size=50, name="capped"
    ) as scheduler:
        for _ in range(100):
            outcomes.submit(scheduler, "acme", running.job("acme"))
        outcomes.wait()
    print(f"1. per-tenant cap: acme alone, 100 jobs, {SLOTS} global slots, cap 2, queue 50")
    print(f"   acme ran at most {running.peak['acme']} jobs at once (cap 2, {SLOTS} slots free)")
    print(
        f"   {len(outcomes.latencies['acme'])} done, {outcomes.rejected['acme']} refused with "
        "TooManyTasks (how many fit depends on how fast the first ones finish)"
    )
    if running.peak["acme"] > 2:
        raise SystemExit("the per-tenant cap was exceeded")


def fair_sharing() -> tuple[list[float], int]:
    """The small tenants' latencies under the scheduler, and tenants left after idling."""
    running, outcomes = Running(), Outcomes()
    with TenantScheduler(
        SLOTS, tenant_max_concurrency=SLOTS, tenant_max_queue_size=FLOOD, name="fair"
    ) as scheduler:
        for _ in range(FLOOD + SLOTS):  # what acme's cap and queue hold: nothing is refused
            outcomes.submit(scheduler, "acme", running.job("acme"))
        for _ in range(SMALL_JOBS):
            for tenant in SMALL_TENANTS:
                outcomes.submit(scheduler, tenant, running.job(tenant))
        outcomes.wait()
        time.sleep(0.05)  # idle_timeout=0: tenants are evicted as they go idle
        left = scheduler.tenant_count
        totals = scheduler.stats()
    print(
        f"2. fair sharing: cap = global limit = {SLOTS}; acme floods {FLOOD + SLOTS} jobs, "
        f"then {len(SMALL_TENANTS)} small tenants send {SMALL_JOBS} each"
    )
    print(
        f"   acme reached {running.peak['acme']} running jobs (the cap protects nobody here); "
        f"all tenants together at most {running.peak_total} (limit {SLOTS}); "
        f"refused: {outcomes.rejected.total()}"
    )
    if running.peak_total > SLOTS:
        raise SystemExit("the global limit was exceeded")
    print(f"   scheduler totals: {totals}")
    return [v for t in SMALL_TENANTS for v in outcomes.latencies[t]], left


def fifo_baseline() -> list[float]:
    """The same submissions, in the same order, on a FIFO pool of as many threads."""
    latencies: list[tuple[str, float]] = []
    lock = threading.Lock()
    running = Running()

    def timed(tenant: str, start: float) -> None:
        running.job(tenant)()
        with lock:
            latencies.append((tenant, time.perf_counter() - start))

    with ThreadPoolExecutor(max_workers=SLOTS) as pool:
        for _ in range(FLOOD + SLOTS):
            pool.submit(timed, "acme", time.perf_counter())
        for _ in range(SMALL_JOBS):
            for tenant in SMALL_TENANTS:
                pool.submit(timed, tenant, time.perf_counter())
    return [v for t, v in latencies if t in SMALL_TENANTS]


def main() -> None:
    per_tenant_cap()
    ours, left = fair_sharing()
    fifo = fifo_baseline()
    ours_mean, fifo_mean = statistics.mean(ours), statistics.mean(fifo)
    print("   small tenants' mean latency, measured:")
    for label, mean in (("TenantScheduler", ours_mean), (f"FIFO pool of {SLOTS}", fifo_mean)):
        print(f"     {label:<18} {mean * 1000:7.1f} ms = {mean / JOB_SECONDS:5.1f} job times")
    print(f"     {fifo_mean / ours_mean:.1f}x lower with fair sharing")
    print(f"tenants with state left after going idle: {left}")
    if left:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
