"""Per-customer ordered processing of a message stream with ``serialize_by_key``.

Messages of one customer are handled one after another, in arrival order; customers run in
parallel on a thread pool. Handlers take a random time, so without the operator a customer's
messages would finish out of order. Run: ``python examples/ordered_messages.py``.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import reactivex
from reactivex import operators as ops
from reactivex.scheduler import ThreadPoolScheduler

from rxcoord import serialize_by_key


@dataclass(frozen=True)
class Message:
    customer: str
    seq: int  # position in that customer's own stream


def main() -> None:
    rng = random.Random(42)
    customers = [f"customer-{i}" for i in range(8)]
    counters = dict.fromkeys(customers, 0)
    messages = []
    for _ in range(400):  # interleaved arrivals
        customer = rng.choice(customers)
        messages.append(Message(customer, counters[customer]))
        counters[customer] += 1

    pool = ThreadPoolScheduler(8)
    lock = threading.Lock()
    running: set[str] = set()
    most_at_once = 0
    handled: dict[str, list[int]] = {c: [] for c in customers}

    def handle(m: Message) -> reactivex.Observable[Message]:
        def work() -> Message:
            nonlocal most_at_once
            with lock:
                assert m.customer not in running, "two messages of one customer at once"
                running.add(m.customer)
                most_at_once = max(most_at_once, len(running))
            time.sleep(rng.random() * 0.004)  # a handler with random latency
            with lock:
                running.discard(m.customer)
                handled[m.customer].append(m.seq)
            return m

        return reactivex.from_callable(work, scheduler=pool)

    started = time.perf_counter()
    reactivex.from_iterable(messages).pipe(
        serialize_by_key(lambda m: m.customer, handle, max_concurrent=6),
        ops.to_list(),
    ).run()
    elapsed = time.perf_counter() - started

    in_order = all(seqs == sorted(seqs) for seqs in handled.values())
    print(f"{len(messages)} messages from {len(customers)} customers in {elapsed:.2f} s")
    print(f"customers processed at the same time: up to {most_at_once} (cap 6)")
    for customer, seqs in handled.items():
        print(f"  {customer}: {len(seqs):3d} messages, in arrival order: {seqs == sorted(seqs)}")
    print("per-customer ordering violations:", 0 if in_order else "SOME")
    pool.executor.shutdown()
    if not in_order:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
