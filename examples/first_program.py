import asyncio

from rxcoord import TenantScheduler


async def charge(customer: str, order: int) -> str:
    await asyncio.sleep(0.01)  # a call to a payment provider
    return f"{customer}: order {order} charged"


async def main() -> None:
    # 4 jobs at once in all, 2 per tenant; one customer's orders run one at a time, in order.
    async with TenantScheduler(4, tenant_max_concurrency=2) as scheduler:
        jobs = [
            scheduler.execute(tenant, charge, customer, order, key=customer)
            for tenant, customer in [("acme", "alice"), ("acme", "bob"), ("globex", "carol")]
            for order in range(3)
        ]
        for line in await asyncio.gather(*jobs):
            print(line)
        print(f"completed: {scheduler.stats().completed} of {len(jobs)}")


asyncio.run(main())
