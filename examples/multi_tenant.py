"""A multi-tenant service on ``TenantScheduler``, with one tenant flooding it.

``acme`` dumps 600 jobs at once; three small tenants then send 10 jobs each. All share 4 global
slots. A FIFO pool would make the small tenants wait for the whole flood; the scheduler gives
every tenant with work its turn, so their latency stays near one job time per competitor, and
``acme``'s excess is refused with ``TooManyTasks`` instead of queueing without bound. Idle
tenants leave no state behind. Run: ``python examples/multi_tenant.py``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict

from rxcoord import TenantScheduler, TooManyTasks

JOB_SECONDS = 0.004


def work() -> None:
    time.sleep(JOB_SECONDS)  # a handler doing I/O


def main() -> None:
    latencies: dict[str, list[float]] = defaultdict(list)
    rejected: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    pending = threading.Semaphore(0)
    submitted = 0

    with TenantScheduler(
        max_concurrency=4, tenant_max_concurrency=2, tenant_max_queue_size=400, name="svc"
    ) as scheduler:

        def submit(tenant: str) -> None:
            nonlocal submitted
            start = time.perf_counter()

            def done() -> None:
                with lock:
                    latencies[tenant].append(time.perf_counter() - start)
                pending.release()

            def failed(error: Exception) -> None:
                if isinstance(error, TooManyTasks):
                    with lock:
                        rejected[tenant] += 1
                pending.release()

            scheduler.execute(tenant, work).subscribe(on_completed=done, on_error=failed)
            submitted += 1

        for _ in range(600):
            submit("acme")  # the flood: 402 fit (2 running + 400 queued), the rest is refused
        for _ in range(10):
            for tenant in ("bolt", "cider", "dune"):
                submit(tenant)
        for _ in range(submitted):
            pending.acquire()
        time.sleep(0.05)
        left = scheduler.tenant_count
        totals = scheduler.stats()

    print(f"{'tenant':<8} {'done':>5} {'refused':>8} {'mean latency':>13} {'in job times':>13}")
    for tenant in ("acme", "bolt", "cider", "dune"):
        values = latencies[tenant]
        mean = statistics.mean(values)
        print(
            f"{tenant:<8} {len(values):>5} {rejected[tenant]:>8} {mean * 1000:>10.1f} ms "
            f"{mean / JOB_SECONDS:>12.1f}x"
        )
    small = [v for t in ("bolt", "cider", "dune") for v in latencies[t]]
    print(f"small tenants' mean latency is {statistics.mean(small) / JOB_SECONDS:.1f} job times;")
    print(f"a FIFO pool would have made them wait ~{402 * JOB_SECONDS / 4 / JOB_SECONDS:.0f}.")
    print(f"tenants with state left after going idle: {left}; totals: {totals}")
    if left or statistics.mean(small) / JOB_SECONDS > 20:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
