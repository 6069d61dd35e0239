"""The coordinator is the Reactor composition: a differential test in virtual time.

``ReactorCoordinator`` (``rxcoord/_coordinator/_reference.py``) is the composition the project
was asked for - a Subject as the task sink, ``serialize_by_key`` as the race-free
``flat_map(max_concurrent)``, each job under its timeout, the WIP counter with
``TooManyTasks``. ``TenantTaskCoordinator`` is the same thing without an Observable per job.
Hypothesis drives both with the same random submissions (keys, durations, failures, timeouts),
cancellations and closes, on two ``TestScheduler`` clocks, and every observable fact must
agree: each subscriber's outcome, when each job started (so per-key order and the cap), the
rejections, and the counters after every step.

Both call a job on the clock at its turn (Reactor's ``subscribeOn``); a job cancelled after its
turn but before the clock called it leaves at once in both. Jobs are Observables on the virtual
clock. Submissions, cancels and closes happen at half seconds, jobs take whole seconds
and timeouts end at whole seconds, so a timeout never ties with an end; ties between ends and
steps are ordered alike on both clocks.
"""

from __future__ import annotations

import functools
from typing import Any

import reactivex
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reactivex import abc
from reactivex import operators as ops
from reactivex.testing import TestScheduler
from support.execution import Outcome

from rxcoord import ReactorCoordinator, TenantTaskCoordinator

CAP = 2
QUEUE = 2

submit = st.tuples(
    st.just("submit"),
    st.sampled_from([None, "a", "a", "b", "c"]),  # key
    st.integers(1, 4),  # duration, whole seconds
    st.sampled_from(["ok", "ok", "fail"]),
    st.sampled_from([None, None, 1.5, 2.5]),  # timeout
)
cancel = st.tuples(st.just("cancel"), st.integers(0, 30))
close = st.tuples(st.just("close"))
wait = st.tuples(st.just("wait"), st.integers(1, 3))  # let time pass (steps between: at once)
steps = st.lists(
    st.one_of(submit, submit, submit, cancel, wait, wait, close), min_size=1, max_size=30
)


def play(kind: str, plan: list[tuple[Any, ...]]) -> dict[str, Any]:
    clock = TestScheduler()
    coordinator: TenantTaskCoordinator | ReactorCoordinator
    if kind == "fast":
        coordinator = TenantTaskCoordinator(
            max_concurrency=CAP, max_queue_size=QUEUE, scheduler=clock
        )
    else:
        coordinator = ReactorCoordinator(max_concurrency=CAP, max_queue_size=QUEUE, scheduler=clock)
    outcomes: list[Outcome] = []
    subscriptions: list[abc.DisposableBase] = []
    started: dict[int, float] = {}
    counters: list[Any] = []

    def job(index: int, duration: int, behaviour: str) -> Any:
        def run() -> reactivex.Observable[Any]:
            started[index] = clock.now.timestamp()
            timer = reactivex.timer(float(duration), scheduler=clock)
            if behaviour == "fail":
                return timer.pipe(ops.flat_map(lambda _: reactivex.throw(ValueError(index))))
            return timer.pipe(ops.map(lambda _: index))

        return run

    def step(op: tuple[Any, ...]) -> None:
        if op[0] == "submit":
            _, key, duration, behaviour, timeout = op
            outcome = Outcome()
            index = len(outcomes)
            outcomes.append(outcome)
            subscriptions.append(
                coordinator.execute(
                    job(index, duration, behaviour), key=key, timeout=timeout
                ).subscribe(outcome)
            )
        elif op[0] == "cancel" and subscriptions:
            subscriptions[op[1] % len(subscriptions)].dispose()
        elif op[0] == "close":
            coordinator.close()
        stats = coordinator.stats()
        counters.append(
            (
                stats.submitted,
                stats.rejected,
                stats.completed,
                stats.failed,
                stats.cancelled,
                stats.timed_out,
                stats.queued,
                stats.running,
            )
        )

    at = 0.5
    for op in plan:
        if op[0] == "wait":
            at += op[1]
            continue
        clock.schedule_absolute(at, functools.partial(run_step, step, op))
    clock.advance_to(at + 100.0)  # everything left runs to its end
    final = coordinator.stats()
    coordinator.close()
    return {
        "outcomes": [o.events for o in outcomes],
        "started": started,
        "counters": counters,
        "final": (final.work_in_progress, final.completed, final.failed, final.timed_out),
    }


def run_step(step: Any, op: tuple[Any, ...], _scheduler: Any, _state: Any) -> None:
    step(op)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=steps)
# A burst beyond the limit, keyed and unkeyed, then a cancel of a queued job and a close.
@example(plan=[("submit", "a", 2, "ok", None)] * 3 + [("submit", None, 1, "fail", 1.5)] * 3)
# A job cancelled after its turn, before the clock called it: it frees its place at once.
@example(
    plan=[("submit", None, 1, "ok", None)] * 2
    + [("cancel", 0)]
    + [("submit", None, 1, "ok", None)] * 3
)
@example(
    plan=[("submit", k, 3, "ok", 2.5) for k in "aab"] + [("cancel", 1), ("wait", 1), ("close",)]
)
def test_the_coordinator_behaves_as_the_reactor_composition(plan: list[tuple[Any, ...]]) -> None:
    fast = play("fast", plan)
    reference = play("reference", plan)
    assert fast == reference


def test_the_reference_orders_keys_and_rejects_beyond_the_limit() -> None:
    clock = TestScheduler()
    reference = ReactorCoordinator(max_concurrency=2, max_queue_size=2, scheduler=clock)
    started: list[tuple[str, float]] = []

    def job(name: str) -> Any:
        def run() -> reactivex.Observable[Any]:
            started.append((name, clock.now.timestamp()))
            return reactivex.timer(10.0, scheduler=clock).pipe(ops.map(lambda _: name))

        return run

    outcomes = [Outcome() for _ in range(5)]
    for outcome, (name, key) in zip(
        outcomes, [("a1", "a"), ("a2", "a"), ("b", "b"), ("c", "c"), ("d", "d")], strict=True
    ):
        reference.execute(job(name), key=key).subscribe(outcome)
    assert outcomes[4].events == [("error", "TooManyTasks")]  # 2 running + 2 queued: full
    clock.advance_to(100.0)
    # c was ready (over the cap) before a2 was (a1 still ran): ready heads start in that order
    assert started == [("a1", 0.0), ("b", 0.0), ("c", 10.0), ("a2", 10.0)]
    assert [o.events for o in outcomes[:4]] == [
        [("value", name), "completed"] for name in ("a1", "a2", "b", "c")
    ]
    assert reference.stats().completed == 4
