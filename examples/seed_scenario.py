"""The seed scenario: ten threads, one customer, three consecutive numbers each, no interleaving.

Ten threads submit a job for the same customer at the same moment; each job appends three
consecutive numbers to a shared list, pausing between them to invite interleaving. Because the
jobs carry the customer as their key, the coordinator runs them one at a time, in subscription
order, and every triple lands in one piece - without a lock per customer and without a thread
blocked per waiting job. Run: ``python examples/seed_scenario.py``.
"""

from __future__ import annotations

import threading
import time

from rxcoord import TenantTaskCoordinator


def main() -> None:
    shared: list[int] = []
    finished = threading.Semaphore(0)  # released once per finished job

    with TenantTaskCoordinator(max_concurrency=4, max_queue_size=20, name="seed") as coordinator:

        def append_three(start: int) -> None:
            for n in range(start, start + 3):
                shared.append(n)
                time.sleep(0.002)  # another job of this customer would interleave here

        start_together = threading.Barrier(10)

        def submit(i: int) -> None:
            start_together.wait()
            coordinator.execute(lambda: append_three(i * 10), key="customer-42").subscribe(
                on_completed=finished.release, on_error=lambda _: finished.release()
            )

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in threads:
            finished.acquire()

    triples = [shared[i : i + 3] for i in range(0, len(shared), 3)]
    broken = [t for t in triples if t != list(range(t[0], t[0] + 3))]
    print(f"{len(shared)} numbers appended by 10 threads for one customer:")
    for triple in triples:
        print("  ", triple)
    print("interleaving violations:", len(broken))
    if broken or len(shared) != 30:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
