"""KeyedLocks: each guarantee of the contract, one focused test (or a few) per point.

Most tests use the Observable API on one thread, where delivery is synchronous and so fully
deterministic; guarantees about threads use real threads and events. The exhaustive check of
the granting rule is the hypothesis model in ``test_locks_model.py``; stress, starvation and
the ten-threads-one-customer scenario are in ``test_locks_threads.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import threading
import tracemalloc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from locks_support import ManualTimer, Notifications, daemon, is_free
from loguru import logger
from reactivex import Observable, abc
from reactivex.testing import TestScheduler
from support.waiting import WAIT, wait_until

from rxcoord import KeyedLocks, KeyedLocksStats, Lease
from rxcoord._errors import LeaseReleasedError, LockTimeout, RxcoordError
from rxcoord._locks import _waiting


class Recorder(abc.ObserverBase[Lease]):
    """An observer of ``acquire*``: remembers the lease, the error and the delivering thread."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.errors: list[Exception] = []
        self.completed = False
        self.threads: list[int] = []
        self.done = threading.Event()

    def on_next(self, lease: Lease) -> None:
        self.threads.append(threading.get_ident())
        self.leases.append(lease)

    def on_error(self, error: Exception) -> None:
        self.threads.append(threading.get_ident())
        self.errors.append(error)
        self.done.set()

    def on_completed(self) -> None:
        self.completed = True
        self.done.set()

    @property
    def lease(self) -> Lease:
        assert len(self.leases) == 1, self.leases
        return self.leases[0]

    @property
    def granted(self) -> bool:
        return bool(self.leases)


def watch(source: Observable[Lease]) -> tuple[Recorder, abc.DisposableBase]:
    recorder = Recorder()
    return recorder, source.subscribe(recorder)


def in_thread(fn: Callable[[], object]) -> None:
    """Run ``fn`` on a fresh thread and wait for it, re-raising its exception."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(fn).result(WAIT)


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda locks: locks.acquire([]), id="acquire"),
        pytest.param(lambda locks: locks.acquire_many(["ok", []]), id="acquire_many"),
        pytest.param(lambda locks: locks.hold({}), id="hold"),
        pytest.param(lambda locks: locks.hold_many([{1}]), id="hold_many"),
        pytest.param(lambda locks: locks.hold_async([]), id="hold_async"),
        pytest.param(lambda locks: locks.hold_many_async([[]]), id="hold_many_async"),
        pytest.param(lambda locks: locks.run([], lambda: 1), id="run"),
        pytest.param(lambda locks: locks.run_many([[]], lambda: 1), id="run_many"),
    ],
)
def test_unhashable_key_raises_type_error_at_the_call(
    call: Callable[[KeyedLocks], object],
) -> None:
    locks = KeyedLocks()
    with pytest.raises(TypeError, match="unhashable"):
        call(locks)  # not at subscribe or enter time
    assert len(locks) == 0


def test_bulk_keys_are_checked() -> None:
    locks = KeyedLocks()
    with pytest.raises(TypeError, match="not str"):
        locks.acquire_many("abc")  # would silently mean keys a, b, c
    with pytest.raises(ValueError, match="at least one key"):
        locks.hold_many([])
    with locks.hold_many(["a", "b", "a"]) as lease:  # duplicates collapse
        assert lease.keys == frozenset({"a", "b"})
        assert len(locks) == 2


def test_a_key_whose_hash_fails_midway_leaves_no_half_request() -> None:
    class Flaky:
        """Hashes once (argument check), then fails (inside the lock manager)."""

        calls = 0

        def __hash__(self) -> int:
            Flaky.calls += 1
            if Flaky.calls > 1:
                raise RuntimeError("flaky hash")
            return 1

    locks = KeyedLocks()
    with pytest.raises(RuntimeError, match="flaky"), locks.hold_many(["a", Flaky()]):
        pass
    assert len(locks) == 0  # "a" was queued first and taken out again
    assert is_free(locks, "a")


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (-1, ValueError),
        (float("nan"), ValueError),
        (1e300, ValueError),  # beyond threading.TIMEOUT_MAX: refused, not a dead timer thread
        ("1", TypeError),
        (True, TypeError),
    ],
)
def test_bad_timeouts_are_refused(timeout: Any, error: type[Exception]) -> None:
    locks = KeyedLocks()
    for call in (
        lambda: locks.acquire("k", timeout=timeout),
        lambda: locks.acquire_all(timeout=timeout),
        lambda: locks.hold("k", timeout=timeout),
        lambda: locks.hold_many(["k"], timeout=timeout),
        lambda: locks.hold_all_async(timeout=timeout),
        lambda: locks.run("k", lambda: 1, timeout=timeout),
    ):
        with pytest.raises(error):
            call()


def test_an_infinite_timeout_waits_forever() -> None:
    locks = KeyedLocks()
    holder, _ = watch(locks.acquire("a"))
    waiter, _ = watch(locks.acquire("a", timeout=float("inf")))
    holder.lease.release()
    assert waiter.granted
    waiter.lease.release()
    with locks.hold("a", timeout=float("inf")):
        pass


# -- 1. exclusion ------------------------------------------------------------------------------


def test_hold_excludes_the_same_key_and_not_others() -> None:
    locks = KeyedLocks()
    with locks.hold("a") as lease:
        assert lease.keys == frozenset({"a"})
        assert not lease.is_global
        assert not is_free(locks, "a")
        assert is_free(locks, "b")
        assert len(locks) == 1
    assert lease.released
    assert is_free(locks, "a")
    assert len(locks) == 0


def test_a_waiting_thread_gets_the_key_only_after_release() -> None:
    locks = KeyedLocks()
    inside = threading.Event()
    order: list[str] = []
    first = locks.hold("a")
    first.__enter__()

    def second() -> None:
        with locks.hold("a"):
            order.append("second in")
            inside.set()

    thread = threading.Thread(target=second)
    thread.start()
    # The second holder is parked in the wait queue (not spinning) until the release.
    wait_until(lambda: locks.stats().waiting == 1)
    assert not inside.is_set()
    order.append("first out")
    first.__exit__(None, None, None)
    assert inside.wait(WAIT)
    thread.join(WAIT)
    assert order == ["first out", "second in"]
    assert len(locks) == 0


# -- 2. ownerless leases -----------------------------------------------------------------------


def test_a_lease_acquired_on_one_thread_is_released_on_another() -> None:
    locks = KeyedLocks()
    leases: list[Lease] = []
    in_thread(lambda: leases.append(locks.hold("entity").__enter__()))
    waiter, _ = watch(locks.acquire("entity"))
    assert not waiter.granted
    releaser: list[int] = []

    def release() -> None:
        releaser.append(threading.get_ident())
        leases[0].release()  # a thread that never acquired it (a ReentrantLock would refuse)

    in_thread(release)
    assert waiter.granted
    assert waiter.threads == releaser  # delivered by the releasing thread, synchronously
    waiter.lease.release()
    assert len(locks) == 0


def test_double_release_raises_and_changes_nothing() -> None:
    locks = KeyedLocks()
    recorder, _ = watch(locks.acquire("a"))
    lease = recorder.lease
    lease.release()
    waiter, _ = watch(locks.acquire("a"))
    with pytest.raises(LeaseReleasedError, match="already released") as info:
        lease.release()
    assert isinstance(info.value, RxcoordError)
    assert isinstance(info.value, RuntimeError)
    assert not waiter.lease.released  # the second release did not free someone else's key
    assert not is_free(locks, "a")
    waiter.lease.release()


def test_release_through_another_keyed_locks_raises() -> None:
    mine, theirs = KeyedLocks(), KeyedLocks()
    recorder, _ = watch(mine.acquire("a"))
    with pytest.raises(ValueError, match="another KeyedLocks"):
        theirs.release(recorder.lease)
    assert not recorder.lease.released
    with pytest.raises(TypeError):
        mine.release("a")  # type: ignore[arg-type]
    mine.release(recorder.lease)
    assert recorder.lease.released
    assert recorder.lease.owner is mine
    with pytest.raises(LeaseReleasedError):
        mine.release(recorder.lease)


def test_a_hold_lease_is_entered_once_and_must_be_entered_before_release() -> None:
    locks = KeyedLocks()
    lease = locks.hold("a")
    with pytest.raises(RuntimeError, match="never granted"):
        lease.release()
    with lease:
        pass
    with pytest.raises(LeaseReleasedError), lease:
        pass
    assert len(locks) == 0


def test_leaving_the_block_after_an_explicit_release_is_fine() -> None:
    locks = KeyedLocks()
    with locks.hold("a") as lease:
        lease.release()
        assert is_free(locks, "a")
    with locks.hold_many(["a", "b"]) as lease:
        lease.release()
    assert len(locks) == 0


def test_not_reentrant() -> None:
    locks = KeyedLocks()
    with locks.hold("a"):
        with pytest.raises(LockTimeout):  # the holder's own second request waits like anyone's
            locks.hold("a", timeout=0).__enter__()
        with pytest.raises(LockTimeout):
            locks.hold("a", timeout=0.01).__enter__()
        with pytest.raises(LockTimeout):
            locks.hold_all(timeout=0).__enter__()
    assert len(locks) == 0
    assert locks.stats().waiting == 0


def test_a_hold_lease_shared_as_a_lock_refuses_a_second_entry() -> None:
    locks = KeyedLocks()
    shared = locks.hold("k")
    inside, leave = threading.Event(), threading.Event()

    def first_user() -> None:
        with shared:
            inside.set()
            assert leave.wait(WAIT)

    thread = daemon(first_user)
    assert inside.wait(WAIT)
    with pytest.raises(RuntimeError, match=r"call hold\(\) per use"):
        shared.__enter__()  # the threading.Lock idiom: must not let a second thread in
    assert not shared.released
    leave.set()
    thread.join(WAIT)
    assert len(locks) == 0


def test_a_hold_lease_entered_while_its_first_entry_waits_is_refused() -> None:
    locks = KeyedLocks()
    holder = locks.hold("k").__enter__()
    shared = locks.hold("k")
    entered = threading.Event()

    def first_user() -> None:
        with shared:
            entered.set()

    thread = daemon(first_user)
    wait_until(lambda: locks.stats().waiting == 1)
    with pytest.raises(RuntimeError, match=r"call hold\(\) per use"):
        shared.__enter__()
    assert locks.stats().waiting == 1  # the first entry's request is untouched
    holder.release()
    assert entered.wait(WAIT)
    thread.join(WAIT)
    assert len(locks) == 0


def test_a_granted_lease_is_entered_once() -> None:
    locks = KeyedLocks()
    recorder = Notifications()
    locks.acquire("a").subscribe(recorder)
    lease: Lease = recorder.items[0]
    with lease:
        with pytest.raises(RuntimeError, match=r"per use"):
            lease.__enter__()
        assert not lease.released
    assert lease.released
    assert len(locks) == 0


def test_reentering_a_hold_lease_after_release_still_says_released() -> None:
    # Unchanged contract: a released lease is not entered again (LeaseReleasedError).
    locks = KeyedLocks()
    lease = locks.hold("a")
    with lease:
        pass
    with pytest.raises(RuntimeError, match="already released"):
        lease.__enter__()


# -- 3. non-blocking waits ---------------------------------------------------------------------


def test_acquire_is_lazy_and_each_subscription_is_a_request() -> None:
    locks = KeyedLocks()
    source = locks.acquire("a")
    assert len(locks) == 0  # nothing until subscribed
    first, _ = watch(source)
    second, _ = watch(source)
    assert first.granted
    assert first.completed
    assert not second.granted
    first.lease.release()
    assert second.granted
    assert second.completed
    second.lease.release()


def test_the_releasing_thread_delivers_before_release_returns() -> None:
    locks = KeyedLocks()
    holder, _ = watch(locks.acquire("a"))
    waiter, _ = watch(locks.acquire("a"))
    seen_during_release: list[bool] = []

    def release() -> None:
        holder.lease.release()
        seen_during_release.append(waiter.granted)

    in_thread(release)
    assert seen_during_release == [True]  # no polling thread: the release itself hands over
    assert waiter.threads[0] != threading.get_ident()


def test_delivery_on_a_given_scheduler() -> None:
    locks = KeyedLocks()
    scheduler = TestScheduler()
    holder, _ = watch(locks.acquire("a"))
    waiter, _ = watch(locks.acquire("a", scheduler=scheduler))
    holder.lease.release()
    assert not waiter.granted  # granted, but delivery waits for the scheduler
    assert not is_free(locks, "a")
    scheduler.advance_by(1)
    assert waiter.granted
    assert waiter.completed
    waiter.lease.release()
    assert len(locks) == 0


def test_a_chain_of_synchronous_handovers_does_not_recurse() -> None:
    # Each subscriber releases inside on_next, which grants the next one: without the
    # trampoline this would nest one stack frame group per waiter and overflow.
    locks = KeyedLocks()
    holder, _ = watch(locks.acquire("a"))
    count = 5000
    delivered: list[int] = []

    def take(i: int) -> Callable[[Lease], None]:
        def on_next(lease: Lease) -> None:
            delivered.append(i)
            lease.release()

        return on_next

    for i in range(count):
        locks.acquire("a").subscribe(take(i))
    holder.lease.release()
    assert delivered == list(range(count))
    assert len(locks) == 0


def test_blocking_and_async_forms_use_no_rx_subscription(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> abc.DisposableBase:
        raise AssertionError("hold must not go through an Rx subscription")

    monkeypatch.setattr(Observable, "subscribe", forbidden)
    locks = KeyedLocks()
    with locks.hold("a"):  # uncontended fast path
        pass
    first = locks.hold("a").__enter__()

    def contended() -> None:
        with locks.hold_many(["a", "b"], timeout=WAIT):  # waits for the release below
            pass

    thread = threading.Thread(target=contended)
    thread.start()
    wait_until(lambda: locks.stats().waiting == 1)
    first.release()
    thread.join(WAIT)
    assert locks.stats().contended_total == 1

    async def main() -> None:
        async with locks.hold_all_async():
            pass

    asyncio.run(main())
    assert len(locks) == 0


# -- 4. bulk without a bulk mutex --------------------------------------------------------------


def test_bulk_is_all_or_nothing() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    bulk, _ = watch(locks.acquire_many(["b", "a"]))
    assert not bulk.granted
    assert locks.stats().held == 1  # the bulk request holds nothing while it waits (not b)
    a.lease.release()
    assert bulk.granted  # both keys in one step
    assert bulk.lease.keys == frozenset({"a", "b"})
    assert not is_free(locks, "a")
    assert not is_free(locks, "b")
    bulk.lease.release()
    assert len(locks) == 0


def test_disjoint_bulk_requests_run_in_parallel() -> None:
    locks = KeyedLocks()
    first, _ = watch(locks.acquire_many(["a", "b"]))
    second, _ = watch(locks.acquire_many(["c", "d"]))
    assert first.granted
    assert second.granted  # a bulk mutex would have serialised them
    first.lease.release()
    second.lease.release()


def test_bulk_requests_in_opposite_key_orders_do_not_deadlock() -> None:
    locks = KeyedLocks()
    single, _ = watch(locks.acquire("b"))
    forward, _ = watch(locks.acquire_many(["a", "b", "c"]))
    backward, _ = watch(locks.acquire_many(["c", "b", "a"]))
    assert not forward.granted
    assert not backward.granted
    single.lease.release()
    assert forward.granted
    forward.lease.release()
    assert backward.granted
    backward.lease.release()
    assert len(locks) == 0


# -- 5. global without polling ----------------------------------------------------------------


def test_global_waits_for_granted_leases_and_is_granted_by_the_last_release() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    b, _ = watch(locks.acquire_many(["b", "c"]))
    everything, _ = watch(locks.acquire_all())
    assert not everything.granted
    assert locks.stats().global_waiting == 1
    a.lease.release()
    assert not everything.granted
    releaser: list[int] = []

    def release() -> None:
        releaser.append(threading.get_ident())
        b.lease.release()

    in_thread(release)
    assert everything.granted  # event-driven: granted inside the last release
    assert everything.threads == releaser
    assert everything.lease.is_global
    assert everything.lease.keys == frozenset()
    stats = locks.stats()
    assert stats.global_held
    assert stats.held == 1
    assert stats.keys == 0
    everything.lease.release()
    assert not locks.stats().global_held


def test_nothing_requested_after_a_global_request_overtakes_it() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    everything, _ = watch(locks.acquire_all())
    later = [
        watch(locks.acquire("a"))[0],
        watch(locks.acquire("never seen before"))[0],
        watch(locks.acquire_many(["x", "y"]))[0],
    ]
    assert not any(r.granted for r in later)  # not even keys nobody holds or ever held
    assert not is_free(locks, "another new key")
    assert len(locks) == 4  # a, never seen before, x, y: waited on
    a.lease.release()
    assert everything.granted
    assert not any(r.granted for r in later)
    everything.lease.release()
    assert all(r.granted for r in later)
    for r in later:
        r.lease.release()
    assert len(locks) == 0


def test_global_is_granted_at_once_when_nothing_is_held() -> None:
    locks = KeyedLocks()
    with locks.hold_all() as lease:
        assert lease.is_global
        assert not is_free(locks, "anything")
    assert is_free(locks, "anything")


def test_consecutive_globals_are_granted_one_after_another() -> None:
    locks = KeyedLocks()
    g1, _ = watch(locks.acquire_all())
    g2, _ = watch(locks.acquire_all())
    single, _ = watch(locks.acquire("a"))
    g3, _ = watch(locks.acquire_all())
    assert [g1.granted, g2.granted, single.granted, g3.granted] == [True, False, False, False]
    g1.lease.release()
    assert [g2.granted, single.granted, g3.granted] == [True, False, False]
    g2.lease.release()
    assert [single.granted, g3.granted] == [True, False]
    single.lease.release()
    assert g3.granted
    g3.lease.release()
    assert locks.stats() == KeyedLocksStats(0, 0, 0, False, 0, 3, 0, 0)


def test_withdrawing_a_waiting_global_lets_the_requests_behind_it_through() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    everything, subscription = watch(locks.acquire_all())
    b, _ = watch(locks.acquire("b"))
    late_a, _ = watch(locks.acquire("a"))
    assert not b.granted
    subscription.dispose()  # the barrier is gone: b conflicts with nothing earlier
    assert b.granted
    assert not late_a.granted  # but a is still held
    assert not everything.granted
    a.lease.release()
    assert late_a.granted
    b.lease.release()
    late_a.lease.release()
    assert len(locks) == 0
    assert locks.stats().cancelled_total == 1


class Payload:
    """Something a subscriber's callback closes over."""


def subscriber(payload: Payload) -> Callable[[Lease], None]:
    return lambda lease: print(payload, lease)


def test_disposed_requests_parked_behind_a_global_request_are_not_retained() -> None:
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()  # a long operation ...
    global_request = Notifications()
    locks.acquire_all().subscribe(global_request)  # ... with a global request behind it
    refs: list[weakref.ref[Payload]] = []
    for i in range(200):
        payload = Payload()
        refs.append(weakref.ref(payload))
        locks.acquire(("k", i)).subscribe(subscriber(payload)).dispose()
    del payload
    gc.collect()
    assert [i for i, ref in enumerate(refs) if ref() is not None] == []  # nothing kept alive
    assert len(locks) == 1
    stuck.release()
    assert global_request.done.is_set()
    global_request.items[0].release()
    assert len(locks) == 0


def test_timed_out_requests_parked_behind_a_global_request_are_not_retained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()
    global_request = Notifications()
    locks.acquire_all().subscribe(global_request)
    refs: list[weakref.ref[Payload]] = []
    count = 50
    timed_out = threading.Semaphore(0)
    for i in range(count):
        payload = Payload()
        refs.append(weakref.ref(payload))
        locks.acquire(("t", i), timeout=1).subscribe(
            subscriber(payload), lambda e: timed_out.release()
        )
    del payload
    assert timer.fire() == count  # every deadline passes at once
    for _ in range(count):
        assert timed_out.acquire(timeout=WAIT)
    gc.collect()
    # A worker thread may still hold the closure of the last job it ran (one per delivery
    # worker, plus the timer thread's last callback): bounded, not growing with the requests.
    assert len([ref for ref in refs if ref() is not None]) < 10
    stuck.release()
    global_request.items[0].release()
    assert len(locks) == 0


def test_withdrawing_parked_requests_keeps_the_others_in_order() -> None:
    locks = KeyedLocks()
    stuck = locks.hold("stuck").__enter__()
    first_global = Notifications()
    locks.acquire_all().subscribe(first_global)
    order: list[int] = []

    def take(i: int) -> Callable[[Lease], None]:
        def on_next(lease: Lease) -> None:
            order.append(i)
            lease.release()

        return on_next

    subscriptions = [locks.acquire(("k", i)).subscribe(take(i)) for i in range(6)]
    for i in (1, 4):
        subscriptions[i].dispose()
    second_global = Notifications()
    second = locks.acquire_all().subscribe(second_global)
    more = [locks.acquire(("m", i)).subscribe(lambda lease: lease.release()) for i in range(3)]
    more[1].dispose()
    second.dispose()  # merges the segment behind it into the parked one
    stuck.release()
    first_global.items[0].release()
    assert order == [0, 2, 3, 5]
    assert len(locks) == 0


# -- 6. fairness ------------------------------------------------------------------------------


def test_waiters_on_one_key_are_granted_in_request_order() -> None:
    locks = KeyedLocks()
    holder, _ = watch(locks.acquire("a"))
    waiters = [watch(locks.acquire("a"))[0] for _ in range(5)]
    previous = holder
    for waiter in waiters:
        assert sum(w.granted for w in waiters) == waiters.index(waiter)
        previous.lease.release()
        assert waiter.granted
        previous = waiter
    previous.lease.release()


def test_a_bulk_request_is_not_starved_by_singles_on_its_free_key() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    bulk, _ = watch(locks.acquire_many(["a", "b"]))
    # b is free, but every later request on b conflicts with the earlier bulk request.
    stream = [watch(locks.acquire("b"))[0] for _ in range(3)]
    assert not any(s.granted for s in stream)
    a.lease.release()
    assert bulk.granted
    assert not any(s.granted for s in stream)
    bulk.lease.release()
    assert stream[0].granted


def test_requests_that_conflict_with_nothing_earlier_are_granted_at_once() -> None:
    locks = KeyedLocks()
    watch(locks.acquire("a"))
    watch(locks.acquire_many(["a", "b"]))
    watch(locks.acquire("b"))
    c, _ = watch(locks.acquire("c"))  # nothing earlier touches c
    cd, _ = watch(locks.acquire_many(["c2", "d"]))
    assert c.granted
    assert cd.granted
    assert locks.stats().contended_total == 2


# -- 7. cancellation and timeouts --------------------------------------------------------------


def test_disposing_a_waiting_request_withdraws_it_and_its_state() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    waiter, subscription = watch(locks.acquire_many(["a", "new"]))
    behind, _ = watch(locks.acquire("new"))
    assert len(locks) == 2
    assert not behind.granted
    subscription.dispose()
    assert behind.granted  # it was only waiting behind the withdrawn request
    behind.lease.release()
    assert len(locks) == 1  # "new" is gone with its last request
    a.lease.release()
    assert not waiter.granted
    assert len(locks) == 0
    assert locks.stats().cancelled_total == 1


def test_disposing_after_the_grant_keeps_the_lease() -> None:
    locks = KeyedLocks()
    recorder, subscription = watch(locks.acquire("a"))
    subscription.dispose()
    assert not recorder.lease.released
    recorder.lease.release()


def test_a_lease_granted_to_a_disposed_subscription_is_released() -> None:
    locks = KeyedLocks()
    scheduler = TestScheduler()
    holder, _ = watch(locks.acquire("a"))
    waiter, subscription = watch(locks.acquire("a", scheduler=scheduler))
    holder.lease.release()  # granted to waiter; delivery queued on the scheduler
    assert not is_free(locks, "a")
    subscription.dispose()  # ... and the subscriber leaves before it arrives
    assert is_free(locks, "a")  # released at once, not left to a delivery that may never run
    scheduler.advance_by(1)  # the delivery, when it runs, finds nothing to hand over
    assert not waiter.granted
    assert is_free(locks, "a")
    assert len(locks) == 0


def test_a_lease_racing_with_disposal_is_delivered_not_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # reactivex's AutoDetachObserver drops on_next once dispose() has begun. Open exactly that
    # window: dispose() starts on another thread (marking the observer stopped) and is held
    # before it reaches KeyedLocks while the scheduled delivery runs. The lease must reach
    # on_next (the subscriber releases it) instead of vanishing with the key locked forever.
    original = _waiting.Acquisition.dispose
    entered, proceed = threading.Event(), threading.Event()

    def held_open(self: _waiting.Acquisition) -> None:
        if threading.current_thread().name == "disposer":
            entered.set()
            assert proceed.wait(WAIT)
        original(self)

    monkeypatch.setattr(_waiting.Acquisition, "dispose", held_open)
    locks = KeyedLocks()
    scheduler = TestScheduler()
    holder, _ = watch(locks.acquire("a"))
    got: list[Lease] = []
    subscription = locks.acquire("a", scheduler=scheduler).subscribe(got.append)
    holder.lease.release()
    disposer = threading.Thread(target=subscription.dispose, name="disposer")
    disposer.start()
    assert entered.wait(WAIT)
    scheduler.advance_by(1)  # the delivery runs while dispose() is midway
    proceed.set()
    disposer.join(WAIT)
    assert len(got) == 1
    assert not got[0].released  # delivered first: the disposal leaves it to the subscriber
    got[0].release()
    assert len(locks) == 0


def test_acquire_timeout_errors_and_withdraws() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    bulk, _ = watch(locks.acquire_many(["a", "b"], timeout=0.05))
    behind, _ = watch(locks.acquire("b"))
    assert not behind.granted
    assert bulk.done.wait(WAIT)
    [error] = bulk.errors
    assert isinstance(error, LockTimeout)
    assert isinstance(error, TimeoutError)
    assert "2 keys" in str(error)
    wait_until(lambda: behind.granted)  # unblocked by the withdrawal (on a pool thread)
    timer_threads = {t.ident for t in threading.enumerate() if t.name == "rxcoord-timer"}
    assert not set(bulk.threads + behind.threads) & timer_threads  # user code off the timer
    assert locks.stats().timeouts_total == 1
    behind.lease.release()
    a.lease.release()
    assert len(locks) == 0


def test_a_global_request_that_times_out_lets_the_requests_behind_it_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    everything, _ = watch(locks.acquire_all(timeout=1))
    b, _ = watch(locks.acquire("b"))
    assert not b.granted
    assert timer.fire() == 1
    assert everything.done.wait(WAIT)
    assert isinstance(everything.errors[0], LockTimeout)
    assert "global" in str(everything.errors[0])
    wait_until(lambda: b.granted)  # the barrier went away with the request
    assert not a.lease.released
    stats = locks.stats()
    assert (stats.global_waiting, stats.timeouts_total, stats.held) == (0, 1, 2)
    a.lease.release()
    b.lease.release()
    assert len(locks) == 0


def test_acquire_timeout_error_is_delivered_on_the_scheduler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    scheduler = TestScheduler()
    waiter, _ = watch(locks.acquire("a", timeout=1, scheduler=scheduler))
    assert timer.fire() == 1
    assert locks.stats().timeouts_total == 1  # withdrawn by the timer callback itself
    assert not waiter.errors

    def delivered() -> bool:
        scheduler.advance_by(1)
        return bool(waiter.errors)

    wait_until(delivered)
    assert isinstance(waiter.errors[0], LockTimeout)
    a.lease.release()


def test_a_grant_before_the_deadline_cancels_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = ManualTimer.install(monkeypatch)
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    waiter, _ = watch(locks.acquire("a", timeout=WAIT))
    assert timer.pending == 1
    a.lease.release()
    assert timer.pending == 0  # cancelled by the delivery
    assert waiter.granted
    assert waiter.completed
    assert not waiter.errors
    waiter.lease.release()
    assert locks.stats().timeouts_total == 0


def test_timeout_zero_is_a_try_lock_that_leaves_no_trace() -> None:
    locks = KeyedLocks()
    a, _ = watch(locks.acquire("a"))
    failed, _ = watch(locks.acquire("a", timeout=0))
    assert failed.done.is_set()  # synchronously
    assert isinstance(failed.errors[0], LockTimeout)
    free, _ = watch(locks.acquire("b", timeout=0))
    assert free.granted
    assert locks.stats().waiting == 0
    assert locks.stats().contended_total == 0
    free.lease.release()
    a.lease.release()


def test_hold_timeout_raises_and_withdraws() -> None:
    locks = KeyedLocks()
    errors: list[BaseException] = []
    with locks.hold("a"):

        def attempt() -> None:
            try:
                with locks.hold_many(["b", "a"], timeout=0.05):
                    pass
            except LockTimeout as exc:
                errors.append(exc)

        in_thread(attempt)
        assert len(errors) == 1
        assert len(locks) == 1  # only the holder's key: b was withdrawn with the request
        assert locks.stats().waiting == 0
    assert locks.stats().timeouts_total == 1


def test_timeouts_are_logged_at_info_when_enabled() -> None:
    locks = KeyedLocks()
    messages: list[str] = []
    sink = logger.add(messages.append, level="INFO", format="{level} {message}")
    logger.enable("rxcoord")
    try:
        with locks.hold("a"):
            with pytest.raises(LockTimeout):
                locks.hold("a", timeout=0).__enter__()  # a try-lock failing is not news
            assert messages == []
            with pytest.raises(LockTimeout):
                locks.hold("a", timeout=0.001).__enter__()
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
    assert any(m.startswith("INFO") and "'a' was not granted" in m for m in messages)


def test_on_next_failure_releases_the_lease_and_reports_it() -> None:
    locks = KeyedLocks()
    errors: list[Exception] = []

    def boom(lease: Lease) -> None:
        raise RuntimeError("subscriber bug")

    locks.acquire("a").subscribe(boom, errors.append)
    assert [str(e) for e in errors] == ["subscriber bug"]
    assert is_free(locks, "a")

    # Delivered later, on the releasing thread: same outcome, and the releaser is unharmed.
    holder, _ = watch(locks.acquire("a"))
    locks.acquire("a").subscribe(boom, errors.append)
    holder.lease.release()
    assert len(errors) == 2
    assert is_free(locks, "a")


def test_a_failing_subscriber_without_on_error_does_not_break_the_releaser() -> None:
    locks = KeyedLocks()
    messages: list[str] = []
    sink = logger.add(messages.append, level="ERROR", format="{message}")
    logger.enable("rxcoord")
    try:
        holder, _ = watch(locks.acquire("a"))

        def broken(lease: Lease) -> None:
            raise ZeroDivisionError

        locks.acquire("a").subscribe(broken)
        follower, _ = watch(locks.acquire("a"))
        holder.lease.release()  # must not raise ZeroDivisionError into the releaser
        assert follower.granted  # the failed subscriber's lease was released
        follower.lease.release()
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)
    assert any("lease subscriber failed" in m for m in messages)


# -- 8. no leak, stats -------------------------------------------------------------------------


def test_many_distinct_keys_leave_nothing_behind() -> None:
    locks = KeyedLocks()
    sink: list[Lease] = []
    for i in range(20_000):
        with locks.hold(i):
            pass
        with locks.hold_many([("x", i), ("y", i)]):
            pass
        locks.acquire(("z", i)).subscribe(sink.append)
        sink.pop().release()
        locks.run(("r", i), lambda: None).subscribe()
    assert len(locks) == 0
    stats = locks.stats()
    assert (stats.keys, stats.held, stats.waiting) == (0, 0, 0)


def test_distinct_keys_retain_no_memory() -> None:
    # Every path (fast hold, bulk, contended, global, Observable, run) leaves no object
    # behind: after a warm-up, tens of thousands more operations do not grow the heap.
    locks = KeyedLocks()
    sink: list[Lease] = []

    def operations(start: int, count: int) -> None:
        for i in range(start, start + count):
            with locks.hold(i):
                pass
            with locks.hold_many([("x", i), ("y", i)]):
                pass
            holder = locks.hold(("c", i)).__enter__()
            locks.acquire(("c", i)).subscribe(sink.append)  # waits: a queue is created
            if i % 100 == 0:
                locks.acquire_all().subscribe(sink.append)  # waits: segments are created
            holder.release()
            while sink:  # each release grants the next waiter
                sink.pop(0).release()
            locks.run(("r", i), lambda: None).subscribe()

    operations(0, 1_000)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        operations(1_000, 4_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(locks) == 0
    assert grown < 16_384, f"{grown} bytes retained"


@pytest.mark.slow
def test_ten_million_distinct_keys_leave_nothing_behind() -> None:
    locks = KeyedLocks()
    hold = locks.hold
    for key in range(10_000_000):
        with hold(key):
            pass
    assert len(locks) == 0
    stats = locks.stats()
    assert (stats.keys, stats.held, stats.waiting) == (0, 0, 0)


def test_stats_is_a_frozen_snapshot() -> None:
    locks = KeyedLocks()
    with locks.hold("a"):
        stats = locks.stats()
    assert stats.held == 1
    assert stats.keys == 1
    assert locks.stats().held == 0  # the snapshot did not change
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.held = 2  # type: ignore[misc]
    assert "held=0" in repr(locks)
    assert locks  # len() is 0, but `locks or KeyedLocks()` must not replace it


def test_lease_repr_and_context_manager() -> None:
    locks = KeyedLocks()
    recorder, _ = watch(locks.acquire("a"))
    assert repr(recorder.lease) == "<Lease keys=['a'] held>"
    with recorder.lease as lease:  # a granted lease entered as is, released on exit
        assert lease is recorder.lease
    assert repr(lease) == "<Lease keys=['a'] released>"
    assert "all keys" in repr(locks.hold_all())
