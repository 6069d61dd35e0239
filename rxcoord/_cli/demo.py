"""``rxcoord demo``: a message-processing service and a scheduled job, with their checks.

Part 1 simulates a service: customers spread over tenants send messages that arrive
interleaved; one tenant floods. Every message is a keyed job (key = customer) submitted to a
``TenantScheduler``; handlers take a random time, a few fail, a few run past their timeout, a few
are cancelled by their caller (some while queued, some while running). An invariant checker
inside the handlers records per-customer order and exclusion and the concurrency reached per
tenant and globally.

Part 2 is ShedLock's scenario: several OS processes run the same scheduled job on the same
schedule; a distributed lease (``at_least_for`` most of the period) lets exactly one of them run
each tick. The processes log every run with its fencing token; a tick run twice is a failure.

Part 3 shares one set of limits across processes: each of the scheduled job's processes runs a
``TenantScheduler(name="demo-fleet", fleet=provider)`` on the same store and submits jobs of
three tenants at once; every job logs its start and end on the machine's monotonic clock, and
the checker replays the logs: at no instant more than the fleet limit, nor more than the tenant
limit of one tenant, ran across all processes.

Part 4, when a Kafka broker is reachable, is a keyed workload through ``rxcoord.kafka``'s
``KeyedConsumer`` on a real broker (:mod:`rxcoord._cli.kafka_stage`): nothing lost, per-key order,
no overlap of one key, committed offsets equal to the end offsets. Without a broker it is skipped
with a one-line note.

What ``--seed`` fixes, and what it cannot: the workload - every message, its tenant, customer
and position, the order of submission, and which messages are planned to fail, to overrun their
timeout or to be cancelled - is a pure function of the config (:func:`make_workload`, summarised
with a fingerprint in :class:`Workload`). The outcomes are not: whether a message is rejected
depends on how full its tenant's queue is when it arrives, which depends on how fast this machine
drains it; rejected messages are then not completed, failed or cancelled either, and latencies are
measured. Those figures are reported as timing-dependent (``DemoReport.TIMING_DEPENDENT``). The
checks hold on every run whatever the timing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .._errors import TooManyTasks
from .._tenant_scheduler import TenantScheduler
from .kafka_stage import KafkaPlan, KafkaReport, resolve_kafka, run_kafka_stage

__all__ = ["DemoConfig", "DemoReport", "Workload", "describe_workload", "make_workload", "run_demo"]

GLOBAL_LIMIT = 8
TENANT_LIMIT = 3
TENANT_QUEUE = 60
JOB_TIMEOUT = 0.05


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs; every figure of the workload derives from it.

    Raises:
        ValueError: A count is below 1, or there are fewer customers than tenants (a tenant
            without a customer would send nothing, and the report would list fewer tenants
            than asked for).
    """

    tenants: int = 4
    customers: int = 24
    messages: int = 3000
    seed: int = 7
    store_url: str | None = None  # None: a SQLite file in a temporary directory
    processes: int = 3
    ticks: int = 10
    period: float = 0.25
    kafka: KafkaPlan | None = None  # None: the default broker, if any (see resolve_kafka)

    def __post_init__(self) -> None:
        for name in ("tenants", "customers", "messages", "processes", "ticks"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.customers < self.tenants:
            raise ValueError(
                f"customers ({self.customers}) must be at least tenants ({self.tenants}): "
                "every tenant needs a customer to send its messages"
            )


@dataclass(frozen=True)
class Message:
    index: int
    tenant: str
    customer: str
    seq: int  # position in its customer's stream
    latency: float  # seconds the handler takes
    fails: bool
    cancel_after: float | None  # the caller disposes this long after submitting


@dataclass
class TenantRow:
    tenant: str
    jobs: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    cancelled: int = 0
    timed_out: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_running: int = 0
    limit: int = TENANT_LIMIT


@dataclass(frozen=True)
class TenantPlan:
    """One tenant's share of the workload (fixed by the seed)."""

    tenant: str
    customers: int
    messages: int
    planned_failures: int  # the handler raises
    planned_timeouts: int  # the handler runs past the job timeout
    planned_cancels: int  # the caller disposes (while queued or while running)


@dataclass(frozen=True)
class Workload:
    """What is submitted, to whom, in what order: identical for one config on every run."""

    seed: int
    messages: int
    tenants: list[TenantPlan]
    fingerprint: str  # sha256 of every message in submission order


def describe_workload(config: DemoConfig, messages: list[Message] | None = None) -> Workload:
    """The workload of ``config`` as figures and a fingerprint (no timing in it)."""
    messages = make_workload(config) if messages is None else messages
    digest = hashlib.sha256()
    for m in messages:
        digest.update(repr(astuple_message(m)).encode())
    plans = []
    for t in range(config.tenants):
        tenant = f"tenant-{t}"
        mine = [m for m in messages if m.tenant == tenant]
        plans.append(
            TenantPlan(
                tenant=tenant,
                customers=len(range(t, config.customers, config.tenants)),
                messages=len(mine),
                planned_failures=sum(m.fails for m in mine),
                planned_timeouts=sum(m.latency > JOB_TIMEOUT for m in mine),
                planned_cancels=sum(m.cancel_after is not None for m in mine),
            )
        )
    return Workload(
        seed=config.seed,
        messages=len(messages),
        tenants=plans,
        fingerprint=digest.hexdigest()[:16],
    )


def astuple_message(m: Message) -> tuple[object, ...]:
    """A message as plain values, floats rounded to the microsecond (stable across runs)."""
    cancel = None if m.cancel_after is None else round(m.cancel_after, 6)
    return (m.index, m.tenant, m.customer, m.seq, round(m.latency, 6), m.fails, cancel)


@dataclass
class DemoReport:
    """The demo's figures and checks.

    ``workload`` is fixed by the seed; the fields named in :attr:`TIMING_DEPENDENT` (per-tenant
    outcomes, latencies, the concurrency reached) depend on the machine's timing and change from
    run to run; the violation counts must be 0 on every run.
    """

    TIMING_DEPENDENT: ClassVar[tuple[str, ...]] = (
        "tenants[].completed",
        "tenants[].failed",
        "tenants[].rejected",
        "tenants[].cancelled",
        "tenants[].timed_out",
        "tenants[].p50_ms",
        "tenants[].p99_ms",
        "tenants[].max_running",
        "global_max_running",
        "scheduled_runs",
        "scheduled_ticks",
        "fleet_max_running",
        "fleet_tenant_max_running",
        "tokens",
        "seconds",
        *KafkaReport.TIMING_DEPENDENT,
    )

    workload: Workload
    tenants: list[TenantRow]
    global_max_running: int
    global_limit: int
    ordering_violations: int
    exclusion_violations: int
    limit_violations: int
    scheduled_runs: int
    scheduled_ticks: int
    double_runs: int
    token_order_violations: int
    fleet_jobs: int = 0
    fleet_processes: int = 0
    fleet_max_running: int = 0
    fleet_tenant_max_running: int = 0
    fleet_violations: int = 0
    fleet_limit: int = 0
    fleet_tenant_limit: int = 0
    tokens: list[int] = field(default_factory=list)
    store: str = ""
    seconds: float = 0.0
    kafka: KafkaReport = field(default_factory=lambda: KafkaReport(ran=False, skipped="not run"))

    @property
    def ok(self) -> bool:
        return self.kafka.ok and not (
            self.ordering_violations
            or self.exclusion_violations
            or self.limit_violations
            or self.double_runs
            or self.token_order_violations
            or self.fleet_violations
        )

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        data["kafka"]["ok"] = self.kafka.ok
        data["timing_dependent"] = list(self.TIMING_DEPENDENT)
        return json.dumps(data, indent=2)


# -- part 1: the message service --------------------------------------------------------------


def make_workload(config: DemoConfig) -> list[Message]:
    """The messages, in arrival order; the same seed gives the same list."""
    rng = random.Random(config.seed)
    tenants = [f"tenant-{t}" for t in range(config.tenants)]
    customers = [(tenants[c % len(tenants)], f"customer-{c:03d}") for c in range(config.customers)]
    flood_tenant = tenants[0]
    flood_customers = [c for c in customers if c[0] == flood_tenant] or customers[:1]
    seqs: Counter[str] = Counter()
    messages: list[Message] = []
    while len(messages) < config.messages:
        if rng.random() < 0.012:  # a burst from the flooding tenant
            burst = [rng.choice(flood_customers) for _ in range(rng.randint(30, 80))]
        else:
            burst = [rng.choice(customers)]
        for tenant, customer in burst[: config.messages - len(messages)]:
            roll = rng.random()
            latency = rng.uniform(0.0005, 0.004)
            if roll < 0.01:
                latency = JOB_TIMEOUT * 2  # will time out
            cancel_after = None
            if 0.01 <= roll < 0.03:
                cancel_after = rng.choice([0.0, latency / 2])  # while queued, or while running
            messages.append(
                Message(
                    index=len(messages),
                    tenant=tenant,
                    customer=customer,
                    seq=seqs[customer],
                    latency=latency,
                    fails=0.03 <= roll < 0.06,
                    cancel_after=cancel_after,
                )
            )
            seqs[customer] += 1
    return messages


class Checker:
    """Records what handlers see: per-customer order and exclusion, concurrency reached."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active_customers: set[str] = set()
        self.last_seq: dict[str, int] = {}
        self.running: Counter[str] = Counter()
        self.max_running: Counter[str] = Counter()
        self.total = 0
        self.max_total = 0
        self.ordering_violations = 0
        self.exclusion_violations = 0

    def enter(self, m: Message) -> None:
        with self.lock:
            if m.customer in self.active_customers:
                self.exclusion_violations += 1
            self.active_customers.add(m.customer)
            if self.last_seq.get(m.customer, -1) >= m.seq:
                self.ordering_violations += 1
            self.last_seq[m.customer] = m.seq
            self.running[m.tenant] += 1
            self.max_running[m.tenant] = max(self.max_running[m.tenant], self.running[m.tenant])
            self.total += 1
            self.max_total = max(self.max_total, self.total)

    def leave(self, m: Message) -> None:
        with self.lock:
            self.active_customers.discard(m.customer)
            self.running[m.tenant] -= 1
            self.total -= 1


def run_service(
    config: DemoConfig, progress: Callable[[int], None] | None = None
) -> tuple[list[TenantRow], Checker]:
    messages = make_workload(config)
    checker = Checker()
    outcomes: dict[int, tuple[str, float]] = {}
    lock = threading.Lock()
    finished = threading.Event()

    def record(m: Message, outcome: str, submitted: float) -> None:
        with lock:
            if m.index in outcomes:
                return
            outcomes[m.index] = (outcome, time.perf_counter() - submitted)
            count = len(outcomes)
        if progress is not None:
            progress(count)
        if count == len(messages):
            finished.set()

    def handler(m: Message) -> Callable[[], int]:
        def run() -> int:
            checker.enter(m)
            try:
                time.sleep(m.latency)
                if m.fails:
                    raise RuntimeError(f"handler failed on message {m.index}")
                return m.index
            finally:
                checker.leave(m)

        return run

    with TenantScheduler(
        max_concurrency=GLOBAL_LIMIT,
        tenant_max_concurrency=TENANT_LIMIT,
        tenant_max_queue_size=TENANT_QUEUE,
        timeout=JOB_TIMEOUT,
        idle_timeout=1.0,
        name="demo",
    ) as scheduler:
        rng = random.Random(config.seed + 1)
        for m in messages:
            submitted = time.perf_counter()

            def on_error(error: Exception, m: Message = m, t: float = submitted) -> None:
                if isinstance(error, TooManyTasks):
                    record(m, "rejected", t)
                elif isinstance(error, TimeoutError):
                    record(m, "timed_out", t)
                else:
                    record(m, "failed", t)

            def on_completed(m: Message = m, t: float = submitted) -> None:
                record(m, "completed", t)

            subscription = scheduler.execute(m.tenant, handler(m), key=m.customer).subscribe(
                on_error=on_error, on_completed=on_completed
            )
            if m.cancel_after is not None:

                def cancel(m: Message = m, t: float = submitted, sub: Any = subscription) -> None:
                    sub.dispose()
                    record(m, "cancelled", t)

                if m.cancel_after == 0:
                    cancel()
                else:
                    threading.Timer(m.cancel_after, cancel).start()
            if rng.random() < 0.6:
                time.sleep(0.0008)  # arrivals are spread out (bursts excepted)
        finished.wait(60)
    # One row per configured tenant, in order, so that the table matches the header.
    rows = {f"tenant-{t}": TenantRow(tenant=f"tenant-{t}") for t in range(config.tenants)}
    latencies: dict[str, list[float]] = {t: [] for t in rows}
    for m in messages:
        row = rows[m.tenant]
        row.jobs += 1
        outcome, latency = outcomes.get(m.index, ("failed", 0.0))
        setattr(row, outcome, getattr(row, outcome) + 1)
        if outcome == "completed":
            latencies[m.tenant].append(latency)
    for tenant, row in rows.items():
        values = sorted(latencies[tenant])
        if values:
            row.p50_ms = statistics.median(values) * 1000
            row.p99_ms = values[min(len(values) - 1, int(0.99 * len(values)))] * 1000
        row.max_running = checker.max_running[tenant]
    return list(rows.values()), checker


# -- part 2: the scheduled job across processes -----------------------------------------------


def _scheduled_worker(url: str, log: str, start: float, ticks: int, period: float) -> None:
    """One OS process of the scheduled job (runs in a child process)."""
    from reactivex import operators as ops
    from reactivex.scheduler import ImmediateScheduler

    from ..leases import leases_from_url

    provider = leases_from_url(url)
    pid = os.getpid()
    with provider, open(log, "a", encoding="utf-8") as out:
        for tick in range(ticks):
            due = start + tick * period
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            elif -delay > period / 2:
                continue  # woke up too late for this tick: skip it, like a cron scheduler

            def job(lease: Any, tick: int = tick) -> None:
                time.sleep(0.02)  # the report takes a moment
                out.write(json.dumps({"tick": tick, "pid": pid, "token": lease.token}) + "\n")
                out.flush()

            # ShedLock's executor: skipped (empty) when another process holds the lease, which
            # stays taken for most of the period so a slightly late process cannot run the
            # same tick again.
            provider.run(
                "demo-scheduled-report",
                job,
                wait=False,
                at_most_for=period * 4,
                at_least_for=period * 0.9,
                scheduler=ImmediateScheduler(),
            ).pipe(ops.to_list()).run()


def run_scheduled_job(
    config: DemoConfig, progress: Callable[[int], None] | None = None
) -> tuple[int, int, int, list[int], str]:
    """Returns (runs, ticks, double runs, tokens in run order, store description)."""
    with tempfile.TemporaryDirectory(prefix="rxcoord-demo-") as tmp:
        url = config.store_url or f"sqlite:///{Path(tmp) / 'leases.db'}"
        logs = [str(Path(tmp) / f"runs-{i}.jsonl") for i in range(config.processes)]
        start = time.time() + 2.0  # every process starts on the same schedule
        workers = [
            # Separate interpreters (not forks): the lease store is all they share.
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rxcoord._cli.demo",
                    url,
                    log,
                    repr(start),
                    str(config.ticks),
                    repr(config.period),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for log in logs
        ]
        while any(w.poll() is None for w in workers):
            if progress is not None:
                progress(max(0, min(config.ticks, int((time.time() - start) / config.period))))
            time.sleep(0.05)
        for w in workers:
            _, err = w.communicate()
            if w.returncode != 0:
                last = err.strip().splitlines()[-1] if err.strip() else f"exit {w.returncode}"
                raise RuntimeError(f"a scheduled-job process failed: {last}")
        runs: list[dict[str, int]] = []
        for log in logs:
            if os.path.exists(log):
                with open(log, encoding="utf-8") as f:
                    runs.extend(json.loads(line) for line in f if line.strip())
    per_tick = Counter(r["tick"] for r in runs)
    double = sum(n - 1 for n in per_tick.values() if n > 1)
    tokens = [r["token"] for r in sorted(runs, key=lambda r: (r["tick"], r["token"]))]
    store = url.split("://", 1)[0]
    return len(runs), len(per_tick), double, tokens, store


# -- part 3: limits shared by the fleet ---------------------------------------------------------

FLEET_LIMIT = 4
FLEET_TENANT_LIMIT = 2
FLEET_TENANTS = ("north", "south", "east")
FLEET_JOBS = 24  # per process


def _fleet_worker(url: str, log: str, seed: int) -> None:
    """One OS process of the fleet stage: 24 jobs of three tenants, submitted at once."""
    from .._fleet import current_permit
    from ..leases import leases_from_url

    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    done = threading.Semaphore(0)

    def job(tenant: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            permit = current_permit()
            token = permit.token if permit is not None else 0
            # One os.write per line on an O_APPEND file: lines of processes never interleave.
            os.write(fd, f"{tenant} 1 {time.monotonic()!r} {token}\n".encode())
            time.sleep(seconds)
            os.write(fd, f"{tenant} -1 {time.monotonic()!r} {token}\n".encode())

        return run

    with (
        leases_from_url(url) as provider,
        TenantScheduler(
            FLEET_LIMIT,
            tenant_max_concurrency=FLEET_TENANT_LIMIT,
            name="demo-fleet",
            fleet=provider,
        ) as scheduler,
    ):
        for i in range(FLEET_JOBS):
            tenant = FLEET_TENANTS[i % len(FLEET_TENANTS)]
            scheduler.execute(tenant, job(tenant, rng.uniform(0.005, 0.03))).subscribe(
                on_completed=done.release, on_error=lambda _e: done.release()
            )
        for _ in range(FLEET_JOBS):
            done.acquire()
    os.close(fd)


def run_fleet_stage(config: DemoConfig) -> tuple[int, int, int, int]:
    """Returns (jobs, most running at once, most of one tenant at once, violations)."""
    with tempfile.TemporaryDirectory(prefix="rxcoord-demo-fleet-") as tmp:
        url = config.store_url or f"sqlite:///{Path(tmp) / 'fleet.db'}"
        log = str(Path(tmp) / "fleet.log")
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "rxcoord._cli.demo", "--fleet", url, log, str(seed)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(config.seed, config.seed + config.processes)
        ]
        for w in workers:
            _, err = w.communicate()
            if w.returncode != 0:
                last = err.strip().splitlines()[-1] if err.strip() else f"exit {w.returncode}"
                raise RuntimeError(f"a fleet process failed: {last}")
        lines = Path(log).read_text(encoding="utf-8").split() if os.path.exists(log) else []
    events = sorted(
        (float(lines[i + 2]), int(lines[i + 1]), lines[i]) for i in range(0, len(lines), 4)
    )  # an end sorts before a start at the same instant: a slot handed over is no overlap
    running = most = most_tenant = violations = 0
    per: Counter[str] = Counter()
    for _, delta, tenant in events:
        running += delta
        per[tenant] += delta
        most, most_tenant = max(most, running), max(most_tenant, per[tenant])
        if delta > 0 and (running > FLEET_LIMIT or per[tenant] > FLEET_TENANT_LIMIT):
            violations += 1
    return len(events) // 2, most, most_tenant, violations


def run_demo(
    config: DemoConfig,
    on_message: Callable[[int], None] | None = None,
    on_tick: Callable[[int], None] | None = None,
    on_record: Callable[[int], None] | None = None,
) -> DemoReport:
    """Run the parts of the demo and check them.

    Args:
        config: What to run.
        on_message: Called with the number of messages settled so far (a progress bar).
        on_tick: Called with the number of scheduled-job ticks elapsed so far.
        on_record: Called with the number of Kafka records handled so far.

    Raises:
        RuntimeError: A scheduled-job process failed (its last stderr line is in the message),
            or the Kafka broker failed during the Kafka stage.
    """
    started = time.perf_counter()
    rows, checker = run_service(config, on_message)
    runs, ticks, double, tokens, store = run_scheduled_job(config, on_tick)
    fleet_jobs, fleet_most, fleet_tenant_most, fleet_violations = run_fleet_stage(config)
    plan = config.kafka if config.kafka is not None else resolve_kafka(None, disabled=False)
    kafka = run_kafka_stage(plan, config.seed, on_record)
    token_violations = sum(1 for a, b in itertools.pairwise(tokens) if b <= a)
    limit_violations = sum(1 for r in rows if r.max_running > r.limit) + (
        checker.max_total > GLOBAL_LIMIT
    )
    return DemoReport(
        workload=describe_workload(config),
        tenants=rows,
        global_max_running=checker.max_total,
        global_limit=GLOBAL_LIMIT,
        ordering_violations=checker.ordering_violations,
        exclusion_violations=checker.exclusion_violations,
        limit_violations=limit_violations,
        scheduled_runs=runs,
        scheduled_ticks=ticks,
        double_runs=double,
        token_order_violations=token_violations,
        fleet_jobs=fleet_jobs,
        fleet_processes=config.processes,
        fleet_max_running=fleet_most,
        fleet_tenant_max_running=fleet_tenant_most,
        fleet_violations=fleet_violations,
        fleet_limit=FLEET_LIMIT,
        fleet_tenant_limit=FLEET_TENANT_LIMIT,
        tokens=tokens,
        store=store,
        seconds=time.perf_counter() - started,
        kafka=kafka,
    )


if __name__ == "__main__":
    if (
        sys.argv[1] == "--fleet"
    ):  # a fleet process: python -m rxcoord._cli.demo --fleet URL LOG SEED
        _fleet_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:  # a scheduled-job process: python -m rxcoord._cli.demo URL LOG START N P
        _url, _log, _start, _ticks, _period = sys.argv[1:6]
        _scheduled_worker(_url, _log, float(_start), int(_ticks), float(_period))
