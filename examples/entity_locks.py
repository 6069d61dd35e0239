"""Exclusive per-entity operations, bulk transfers and global audits with ``KeyedLocks``.

A toy bank: worker threads run operations on accounts (the entities).

* a **deposit** needs its account: ``with locks.hold(account)``;
* a **transfer** needs two accounts at once, taken in whatever order the request names them:
  ``locks.hold_many([source, target])`` is granted all-or-nothing, so opposite orders cannot
  deadlock and transfers between disjoint accounts run in parallel;
* a **settlement** starts on one thread and finishes on another: the lease arrives through
  ``locks.acquire(account)`` and is handed to a settlement thread, which releases it;
* an **audit** needs every account, including accounts opened while it waits:
  ``locks.hold_all()`` waits for the operations already granted and lets nothing overtake it.

Transfers preserve the total, so every audit must see exactly the deposits made so far; a
checker records any two operations inside one account at once. Accounts are opened all the
time (new keys), and when everything is done no lock state is left behind.
Run: ``python examples/entity_locks.py``.
"""

from __future__ import annotations

import queue
import random
import threading
import time

from rxcoord import KeyedLocks, Lease


class Bank:
    def __init__(self) -> None:
        self.locks = KeyedLocks()
        self.balances: dict[str, int] = {}
        self.deposited = 0  # the total every audit must find
        self.ledger_lock = threading.Lock()  # guards the two figures above between threads
        self.busy: set[str] = set()  # accounts inside an operation, to catch overlaps
        self.violations = 0
        self.counts = {"deposits": 0, "transfers": 0, "settlements": 0, "audits": 0}
        self.opened = 0  # accounts created along the way (new keys)

    # -- the checker: who is inside which account ----------------------------------------------

    def enter(self, accounts: list[str]) -> None:
        with self.ledger_lock:
            if self.busy.intersection(accounts):
                self.violations += 1
            self.busy.update(accounts)

    def leave(self, accounts: list[str]) -> None:
        with self.ledger_lock:
            self.busy.difference_update(accounts)

    # -- operations ----------------------------------------------------------------------------

    def deposit(self, account: str, amount: int) -> None:
        with self.locks.hold(account):
            self.enter([account])
            with self.ledger_lock:
                if account not in self.balances:
                    self.opened += 1
                self.balances[account] = self.balances.get(account, 0) + amount
                self.deposited += amount
                self.counts["deposits"] += 1
            time.sleep(0)  # the operation does some work; others run meanwhile
            self.leave([account])

    def transfer(self, source: str, target: str, amount: int) -> None:
        with self.locks.hold_many([source, target]):  # any order: no deadlock
            self.enter([source, target])
            balance = self.balances.get(source, 0)
            time.sleep(0)  # a half-done transfer: an audit now would see money missing
            moved = min(balance, amount)
            with self.ledger_lock:
                self.balances[source] = balance - moved
                self.balances[target] = self.balances.get(target, 0) + moved
                self.counts["transfers"] += 1
            self.leave([source, target])

    def audit(self) -> bool:
        # Every account, also ones opened while we waited.
        with self.locks.hold_all(), self.ledger_lock:
            self.counts["audits"] += 1
            return sum(self.balances.values()) == self.deposited and not self.busy


def main() -> None:
    bank = Bank()
    accounts = [f"acct-{i}" for i in range(12)]
    for account in accounts:
        bank.deposit(account, 100)
    audits: list[bool] = []
    settlement_threads: list[tuple[str, str]] = []  # (granted on, released on)

    # Settlements: the lease is granted wherever the key is freed and handed to this thread,
    # which finishes the operation and releases it - a lease belongs to no thread.
    handovers: queue.SimpleQueue[tuple[Lease, str, str] | None] = queue.SimpleQueue()

    def settler() -> None:
        while (item := handovers.get()) is not None:
            lease, account, granted_on = item
            bank.enter([account])
            with bank.ledger_lock:
                bank.balances[account] += 1  # a settled cent of interest
                bank.deposited += 1
                bank.counts["settlements"] += 1
            bank.leave([account])
            settlement_threads.append((granted_on, threading.current_thread().name))
            lease.release()  # on a thread that never asked for it

    def start_settlement(account: str) -> None:
        def granted(lease: Lease) -> None:
            handovers.put((lease, account, threading.current_thread().name))

        bank.locks.acquire(account).subscribe(granted)

    def worker(seed: int) -> None:
        local = random.Random(seed)
        for step in range(300):
            roll = local.random()
            if roll < 0.35:
                bank.deposit(local.choice(accounts), local.randint(1, 50))
            elif roll < 0.80:
                source, target = local.sample(accounts, 2)
                bank.transfer(source, target, local.randint(1, 80))
            elif roll < 0.93:
                start_settlement(local.choice(accounts))
            elif roll < 0.97:
                # A customer opens an account: a key nobody has used before.
                bank.deposit(f"new-{seed}-{step}", 10)
            else:
                audits.append(bank.audit())

    settler_thread = threading.Thread(target=settler, name="settler")
    settler_thread.start()
    workers = [threading.Thread(target=worker, args=(n,), name=f"worker-{n}") for n in range(6)]
    started = time.perf_counter()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    audits.append(bank.audit())  # waits for any settlement still in flight
    handovers.put(None)
    settler_thread.join()
    elapsed = time.perf_counter() - started
    stats = bank.locks.stats()

    print(f"{sum(bank.counts.values())} operations on 6 threads in {elapsed:.2f} s")
    for kind, count in bank.counts.items():
        print(f"  {kind:<12} {count}")
    print(f"accounts opened (keys never seen before): {bank.opened}")
    print(f"audits consistent (total == deposits, nobody inside): {sum(audits)}/{len(audits)}")
    moved = [granted for granted, released in settlement_threads if granted != released]
    print(
        f"settlement leases released on another thread than they were granted on: "
        f"{len(moved)}/{len(settlement_threads)} (granted on {', '.join(sorted(set(moved)))})"
    )
    print(f"requests that had to wait: {stats.contended_total}")
    print(f"per-account overlaps (violations): {bank.violations}")
    print(f"lock state left behind: {len(bank.locks)} keys, {stats.held} leases held")
    ok = bank.violations == 0 and all(audits) and len(bank.locks) == 0 and stats.held == 0
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
