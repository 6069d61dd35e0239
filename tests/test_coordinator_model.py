"""Hypothesis drives random submit / cancel / release / timeout / error sequences through a
coordinator on real threads; an invariant checker asserts the limits (points 1 and 2) and
per-key order and exclusion (point 5) at every step, and the accounting at the end."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reactivex import abc
from support.waiting import WAIT

from rxcoord import Retry, TenantTaskCoordinator
from rxcoord._coordinator._table import TaskTable

MAX_CONCURRENCY = 2
MAX_QUEUE = 3


@dataclass
class Checker:
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    most: int = 0
    active_keys: set[Any] = field(default_factory=set)
    started: dict[Any, list[int]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def enter(self, index: int, key: Any) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            if self.running > MAX_CONCURRENCY:
                self.violations.append(f"{self.running} jobs running > {MAX_CONCURRENCY}")
            if key is not None:
                if key in self.active_keys:
                    self.violations.append(f"key {key!r} ran twice at once (job {index})")
                self.active_keys.add(key)
                self.started.setdefault(key, []).append(index)

    def leave(self, key: Any) -> None:
        with self.lock:
            self.running -= 1
            self.active_keys.discard(key)


class Blinked(ConnectionError):
    """What a flaky job raises once: retried when the workload has a retry policy."""


class Job(abc.ObserverBase[int]):
    def __init__(self, checker: Checker, index: int, key: Any, behaviour: str) -> None:
        self.checker = checker
        self.index = index
        self.key = key
        self.behaviour = behaviour
        self.gate = threading.Event()
        if behaviour != "hold":
            self.gate.set()
        self.outcomes: list[str] = []
        self.done = threading.Event()
        self.subscription: abc.DisposableBase | None = None
        self.disposed = False

    def __call__(self) -> int:
        self.checker.enter(self.index, self.key)
        try:
            self.gate.wait(WAIT)
            if self.behaviour == "error":
                raise RuntimeError(f"job {self.index}")
            if self.behaviour == "flaky":  # fails its first attempt, a retry succeeds
                self.behaviour = "ok"
                raise Blinked(f"job {self.index}")
            return self.index
        finally:
            self.checker.leave(self.key)

    def on_next(self, value: Any) -> None:
        self.outcomes.append("value")

    def on_error(self, error: Exception) -> None:
        self.outcomes.append(type(error).__name__)
        self.done.set()

    def on_completed(self) -> None:
        self.outcomes.append("completed")
        self.done.set()


submit = st.tuples(
    st.just("submit"),
    st.sampled_from([None, "a", "b"]),
    st.sampled_from(["ok", "error", "hold"]),
    st.sampled_from([None, None, 0.01]),
)
cancel = st.tuples(st.just("cancel"), st.integers(0, 30))
release = st.tuples(st.just("release"), st.integers(0, 30))
operations = st.lists(st.one_of(submit, submit, cancel, release), min_size=1, max_size=30)
# Queues that fill behind held jobs, then lose some of their tasks: what a purge works on.
holding = st.tuples(
    st.just("submit"),
    st.sampled_from([None, "a", "a", "b"]),
    st.sampled_from(["ok", "hold", "hold"]),
    st.just(None),
)
model_settings = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
cancel_heavy = st.lists(st.one_of(holding, holding, cancel, release), min_size=4, max_size=30)


@model_settings
@given(ops=operations)
def test_random_workloads_keep_limits_order_and_accounting(ops: list[tuple[Any, ...]]) -> None:
    run_workload(ops)


flaky_submit = st.tuples(
    st.just("submit"),
    st.sampled_from([None, "a", "b"]),
    st.sampled_from(["ok", "flaky", "flaky", "hold", "error"]),
    st.sampled_from([None, None, 0.01]),
)
with_retries = st.lists(
    st.one_of(flaky_submit, flaky_submit, cancel, release), min_size=1, max_size=30
)


@model_settings
@given(ops=with_retries)
def test_random_workloads_with_retries_keep_order_limits_and_accounting(
    ops: list[tuple[Any, ...]],
) -> None:
    # A retried job keeps its key between attempts: its second attempt comes before any later
    # job of the key (the per-key start order stays sorted, the same index twice in a row).
    run_workload(ops, retry=Retry(attempts=2, backoff=0.001, on=(Blinked,)))


@model_settings
@given(ops=cancel_heavy)
def test_random_workloads_with_a_purge_on_every_cancel(ops: list[tuple[Any, ...]]) -> None:
    # Tasks cancelled while queued are purged from the pipeline once they outnumber the live
    # ones (and at least 64). Here every such cancel purges, so a purge that lost a live task,
    # reordered a key or broke the accounting fails the same checks.
    due = TaskTable._purge_due
    TaskTable._purge_due = lambda self: True  # type: ignore[method-assign]
    try:
        run_workload(ops)
    finally:
        TaskTable._purge_due = due  # type: ignore[method-assign]


def run_workload(ops: list[tuple[Any, ...]], retry: Retry | None = None) -> None:
    checker = Checker()
    jobs: list[Job] = []
    idle = threading.Event()  # the coordinator's work in progress dropped to zero
    with TenantTaskCoordinator(
        max_concurrency=MAX_CONCURRENCY, max_queue_size=MAX_QUEUE, on_idle=idle.set, retry=retry
    ) as c:
        for op in ops:
            if op[0] == "submit":
                _, key, behaviour, timeout = op
                job = Job(checker, len(jobs), key, behaviour)
                jobs.append(job)
                job.subscription = c.execute(job, key=key, timeout=timeout).subscribe(job)
            elif op[0] == "cancel" and jobs:
                job = jobs[op[1] % len(jobs)]
                assert job.subscription is not None
                job.subscription.dispose()
                job.disposed = True
            elif op[0] == "release" and jobs:
                jobs[op[1] % len(jobs)].gate.set()
            stats = c.stats()
            assert stats.work_in_progress <= MAX_CONCURRENCY + MAX_QUEUE
            assert stats.running <= MAX_CONCURRENCY
        # Nothing is submitted from here on, so the work in progress only drops: once it is
        # zero (or the next time it drops to zero) the coordinator is idle for good.
        idle.clear()
        for job in jobs:
            job.gate.set()
        if c.work_in_progress:
            assert idle.wait(WAIT), "coordinator never became idle"
        stats = c.stats()
        assert stats.work_in_progress == 0

    assert checker.violations == []
    for key, indices in checker.started.items():
        assert indices == sorted(indices), f"key {key!r} started out of subscription order"
    # Every subscriber that stayed got exactly one outcome.
    for job in jobs:
        if not job.disposed:
            assert job.done.wait(WAIT), f"job {job.index} never got an outcome"
            assert job.outcomes in (
                ["value", "completed"],
                ["RuntimeError"],
                ["TooManyTasks"],
                ["TimeoutError"],
                ["Blinked"],
            ), job.outcomes
            if job.outcomes == ["RuntimeError"]:
                assert job.behaviour == "error"
            if job.outcomes == ["Blinked"]:
                assert retry is None, "a flaky job failed although it had a retry"
    assert stats.submitted == len(jobs)
    assert (
        stats.completed + stats.failed + stats.rejected + stats.cancelled + stats.timed_out
        == stats.submitted
    )
    assert stats.rejected == sum(1 for j in jobs if j.outcomes == ["TooManyTasks"])
