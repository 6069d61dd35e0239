"""Retries that keep each customer's order: a payment provider that blinks now and then.

Every fifth charge fails once with ``ConnectionError``; the coordinator's ``Retry`` policy tries
it again after a short wait. While a charge waits for its next attempt, the customer's later
charges wait behind it (their order is kept) but the slot is free for other customers, so the
run does not slow down by the waits. A charge that keeps failing gives up after three attempts
with the last error, the attempts noted on it.

Run: python examples/retries.py
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from rxcoord import Retry, TenantTaskCoordinator

charged: defaultdict[str, list[int]] = defaultdict(list)
attempts: defaultdict[tuple[str, int], int] = defaultdict(int)


async def charge(customer: str, order: int) -> str:
    attempts[customer, order] += 1
    await asyncio.sleep(0.01)  # the provider's round trip
    if customer == "mallory":
        raise ConnectionError(f"provider refused {customer}#{order}")
    if order % 5 == 0 and attempts[customer, order] == 1:
        raise ConnectionError(f"provider blinked on {customer}#{order}")
    charged[customer].append(order)
    return f"{customer}#{order}"


async def main() -> None:
    policy = Retry(attempts=3, backoff=0.05, multiplier=2.0, jitter=0.1, on=ConnectionError)
    async with TenantTaskCoordinator(
        max_concurrency=4, max_queue_size=100, retry=policy, name="payments"
    ) as c:
        started = time.perf_counter()
        jobs = [
            c.execute(charge, customer, order, key=customer)
            for order in range(10)
            for customer in ("alice", "bob", "carol")
        ]
        results = await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - started
        print(f"{len(results)} charges in {elapsed:.2f} s, {c.stats().retries} retries")
        for customer, orders in sorted(charged.items()):
            print(f"{customer}: charged in order: {orders == sorted(orders)}")
        try:
            await c.execute(charge, "mallory", 1, key="mallory")
        except ConnectionError as error:
            print(f"mallory: {error} ({'; '.join(error.__notes__)})")


if __name__ == "__main__":
    asyncio.run(main())
