"""The shared timer thread: ordering, cancellation, one thread, exits when idle."""

from __future__ import annotations

import threading
import time

from rxcoord._core.timer import Timers


def test_timers_fire_in_deadline_order_on_one_thread() -> None:
    timers = Timers()
    fired: list[int] = []
    threads: set[int] = set()
    done = threading.Event()

    def make(i: int) -> object:
        def cb() -> None:
            fired.append(i)
            threads.add(threading.get_ident())
            if len(fired) == 5:
                done.set()

        return cb

    for i, delay in enumerate([0.05, 0.01, 0.04, 0.02, 0.03]):
        timers.call_later(delay, make(i))  # type: ignore[arg-type]
    assert done.wait(5)
    assert fired == [1, 3, 4, 2, 0]
    assert len(threads) == 1


def test_an_earlier_timer_wakes_a_sleeping_thread() -> None:
    timers = Timers()
    early = threading.Event()
    timers.call_later(30, lambda: None)
    timers.call_later(0.01, early.set)
    assert early.wait(5)  # did not sleep until the 30 s timer


def test_cancelled_timer_never_fires_and_leaves_the_count() -> None:
    timers = Timers()
    fired = threading.Event()
    later = threading.Event()
    handle = timers.call_later(0.05, fired.set)
    timers.call_later(0.1, later.set)  # fires only after the cancelled one's deadline passed
    handle.cancel()
    handle.cancel()  # idempotent
    assert handle.cancelled
    assert later.wait(5)
    assert not fired.is_set()
    long = timers.call_later(60, lambda: None)
    assert timers.pending() == 1
    long.cancel()
    assert timers.pending() == 0


def test_pending_stays_exact_when_cancels_race_the_timer_thread() -> None:
    # Cancels of timers whose deadlines are passing while the timer thread pops them: a cancel
    # that marked its handle before the thread dropped it, and counted it after, counted a
    # cancelled entry that was gone (pending() came out one short; in CI, 0 instead of 1).
    for _ in range(10):
        timers = Timers(name="rxcoord-timer-race")
        handles = [timers.call_later(0.0005 * (i % 7), lambda: None) for i in range(3000)]
        for handle in handles:
            handle.cancel()
        kept = timers.call_later(60, lambda: None)
        time.sleep(0.01)  # past every deadline but the kept one's: the thread drops the rest
        assert timers.pending() == 1
        kept.cancel()
        assert timers.pending() == 0


def test_ten_thousand_pending_timers_use_one_thread() -> None:
    timers = Timers(name="rxcoord-timer-test")
    before = threading.active_count()
    handles = [timers.call_later(60, lambda: None) for _ in range(10_000)]
    assert threading.active_count() <= before + 1
    for h in handles:
        h.cancel()
    assert timers.pending() == 0


def test_cancelled_timers_are_compacted_away() -> None:
    timers = Timers()
    handles = [timers.call_later(60, lambda: None) for _ in range(1000)]
    for h in handles:
        h.cancel()
    assert len(timers._heap) < 200  # cancelled entries do not pile up


def test_callback_exception_does_not_kill_the_thread() -> None:
    timers = Timers()
    ok = threading.Event()

    def boom() -> None:
        raise RuntimeError("callback bug")

    timers.call_later(0.0, boom)
    timers.call_later(0.01, ok.set)
    assert ok.wait(5)


def test_idle_thread_exits_and_restarts_on_demand() -> None:
    timers = Timers(name="rxcoord-timer-idle")
    first = threading.Event()
    timers.call_later(0.0, first.set)
    assert first.wait(5)
    deadline = time.monotonic() + 5
    while any(t.name == "rxcoord-timer-idle" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "idle timer thread never exited"
        time.sleep(0.05)
    again = threading.Event()
    timers.call_later(0.0, again.set)
    assert again.wait(5)


def test_a_huge_delay_neither_kills_the_thread_nor_stalls_other_timers() -> None:
    timers = Timers()
    timers.call_later(1e12, lambda: None)  # beyond threading.TIMEOUT_MAX
    fired = threading.Event()
    time.sleep(0.02)  # the thread is now waiting on the huge timer
    timers.call_later(0.01, fired.set)
    assert fired.wait(5)
    assert timers.pending() == 1


def test_a_callback_raising_a_base_exception_does_not_kill_the_thread() -> None:
    timers = Timers()
    ok = threading.Event()

    def exits() -> None:
        raise SystemExit("callback bug")

    timers.call_later(0.0, exits)
    timers.call_later(0.01, ok.set)
    assert ok.wait(5)
