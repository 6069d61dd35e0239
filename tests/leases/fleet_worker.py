"""A fleet member in its own OS process, driven by tests/leases/test_fleet_processes.py.

Usage: ``python fleet_worker.py SPEC`` where SPEC is JSON::

    {"url": ..., "options": {...},            # the store (rxcoord.leases.leases_from_url)
     "name": "pay", "limit": 6, "tenant_limit": 2, "permit_at_most_for": 30.0,
     "fifo": null,                            # a Redis URL: the FIFO baseline instead (below)
     "jobs": [[tenant, hold_seconds], ...],   # submitted at once, in this order
     "rate": [count, per, burst] or null,     # TenantScheduler(rate=Rate(...))
     "tenant_rate": [count, per, burst] or null,
     "start_at": null,                        # CLOCK_MONOTONIC time to submit at (default: now)
     "log": "/path/log"}                      # one line per event, appended

Each job appends ``start <pid> <tenant> <token> <t> <granted_at>`` when it begins (``granted_at``:
the store's clock when it granted the permit, the start the rates counted) and ``end ...`` when it
returns (``t`` is CLOCK_MONOTONIC, one clock for every process of the machine), each line one
``os.write`` on an ``O_APPEND`` file, so lines of concurrent processes never interleave and a
process killed with ``kill -9`` leaves whole lines. Every job's outcome is appended as ``done
<pid> <tenant> <token> <submitted> <finished> <outcome>`` (``ok``, ``LeaseLost``, ...). Prints
``{"ready": true}`` once every job is submitted and ``{"finished": true}`` at the end.

With ``"fifo": REDIS_URL`` the jobs skip rxcoord and go through the baseline the fairness test
compares with: a fleet-wide FIFO semaphore (a ticket per job, ``INCRBY`` for the whole batch at
submission, so jobs are admitted in arrival order across the fleet; a ticket may run once
``ticket <= released + limit``), what a shared work queue with ``limit`` consumers gives.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from loguru import logger

from rxcoord import Rate, TenantScheduler, current_permit
from rxcoord.leases import leases_from_url


def main() -> None:
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # what went wrong shows in the test's output
    logger.enable("rxcoord")
    spec = json.loads(sys.argv[1])
    fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def log(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    jobs: list[tuple[str, float]] = [(str(t), float(h)) for t, h in spec["jobs"]]
    if spec.get("fifo"):
        fifo_baseline(spec, jobs, log, pid)
        os.close(fd)
        print(json.dumps({"finished": True}), flush=True)
        return
    provider = leases_from_url(spec["url"], **spec["options"])
    rates = {
        option: Rate(spec[option][0], per=spec[option][1], burst=spec[option][2])
        for option in ("rate", "tenant_rate")
        if spec.get(option)
    }
    runner = TenantScheduler(
        spec["limit"],
        tenant_max_concurrency=spec["tenant_limit"],
        tenant_max_queue_size=len(jobs),
        name=spec["name"],
        fleet=provider,
        permit_at_most_for=spec["permit_at_most_for"],
        rate=rates.get("rate"),
        tenant_rate=rates.get("tenant_rate"),
    )

    def dump(*_: object) -> None:  # kill -USR1: the state of a member that seems stuck
        fleet = runner._fleet
        assert fleet is not None
        lanes = {
            t: (len(lane.waiting), lane.busy, lane.dirty, lane.registered)
            for t, lane in fleet._lanes.items()
        }
        with open(spec["log"] + f".{pid}.dump", "w") as out:
            out.write(
                f"{runner.stats()}\nlanes {lanes} sweeping {fleet._sweeping} "
                f"again {fleet._sweep_again} held {len(fleet._held)} "
                f"releases {len(fleet._releases)} releasing {fleet._releasing}\n"
            )
            for t, c in runner._tenants.items():
                out.write(f"{t}: {c.coordinator.stats()}\n")
                for task in c.coordinator._table.live():
                    out.write(
                        f"   task state={task.state} settled={task.settled} "
                        f"ticket={task.ticket!r}\n"
                    )

    import signal

    signal.signal(signal.SIGUSR1, dump)
    left = [len(jobs)]
    all_done = threading.Event()
    lock = threading.Lock()

    def make(tenant: str, hold: float) -> Any:
        def job() -> int:
            permit = current_permit()
            assert permit is not None
            log(f"start {pid} {tenant} {permit.token} {time.monotonic()!r} {permit.granted_at!r}")
            time.sleep(hold)
            log(f"end {pid} {tenant} {permit.token} {time.monotonic()!r}")
            return permit.token

        return job

    def finished(tenant: str, submitted: float, token: int, outcome: str) -> None:
        log(f"done {pid} {tenant} {token} {submitted!r} {time.monotonic()!r} {outcome}")
        with lock:
            left[0] -= 1
            if left[0] == 0:
                all_done.set()

    if spec.get("start_at"):  # CLOCK_MONOTONIC: members started one after another begin together
        time.sleep(max(0.0, float(spec["start_at"]) - time.monotonic()))
    for tenant, hold in jobs:
        submitted = time.monotonic()
        observable = runner.execute(tenant, make(tenant, hold))
        box = [0]

        def on_next(token: int, box: list[int] = box) -> None:
            box[0] = token

        def on_completed(t: str = tenant, s: float = submitted, box: list[int] = box) -> None:
            finished(t, s, box[0], "ok")

        def on_error(exc: Exception, t: str = tenant, s: float = submitted) -> None:
            finished(t, s, 0, type(exc).__name__)

        observable.subscribe(on_next, on_error, on_completed)
    print(json.dumps({"ready": True}), flush=True)
    all_done.wait()
    runner.close()
    provider.close()
    os.close(fd)
    print(json.dumps({"finished": True}), flush=True)


def fifo_baseline(spec: dict[str, Any], jobs: list[tuple[str, float]], log: Any, pid: int) -> None:
    """The jobs through a fleet-wide FIFO semaphore in Redis (see the module docstring)."""
    import queue

    import redis

    client = redis.Redis.from_url(spec["fifo"])
    issued, released = f"{spec['name']}:issued", f"{spec['name']}:released"
    limit = int(spec["limit"])
    submitted = time.monotonic()
    last = int(client.incrby(issued, len(jobs)))
    todo: queue.Queue[tuple[int, str, float]] = queue.Queue()
    for i, (tenant, hold) in enumerate(jobs):
        todo.put((last - len(jobs) + 1 + i, tenant, hold))
    print(json.dumps({"ready": True}), flush=True)

    def consume() -> None:
        while True:
            try:
                ticket, tenant, hold = todo.get_nowait()
            except queue.Empty:
                return
            while ticket > int(client.get(released) or 0) + limit:
                time.sleep(0.001)
            log(f"start {pid} {tenant} {ticket} {time.monotonic()!r}")
            time.sleep(hold)
            log(f"end {pid} {tenant} {ticket} {time.monotonic()!r}")
            client.incr(released)
            log(f"done {pid} {tenant} {ticket} {submitted!r} {time.monotonic()!r} ok")

    threads = [threading.Thread(target=consume) for _ in range(limit)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()


if __name__ == "__main__":
    main()
