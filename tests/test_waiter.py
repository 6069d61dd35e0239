"""The one waiter primitive: a granted value is taken or released, never lost, never both."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rxcoord._core.waiter import CANCELLED, GRANTED, PENDING, TAKEN, Waiter


def test_grant_then_take_owns_the_value() -> None:
    released: list[int] = []
    waiter: Waiter[int] = Waiter(released.append)
    assert waiter.grant(7)
    assert waiter.state == GRANTED
    assert waiter.take() == 7
    assert waiter.cancel() == TAKEN  # too late: the taker owns it
    assert released == []


def test_grant_to_a_cancelled_waiter_is_released() -> None:
    released: list[int] = []
    waiter: Waiter[int] = Waiter(released.append)
    assert waiter.cancel() == PENDING
    assert not waiter.grant(7)
    assert released == [7]
    assert waiter.take() is None


def test_cancel_after_grant_before_take_releases() -> None:
    released: list[int] = []
    waiter: Waiter[int] = Waiter(released.append)
    waiter.grant(7)
    assert waiter.cancel() == GRANTED
    assert released == [7]
    assert waiter.take() is None
    assert waiter.cancel() == CANCELLED


def test_a_grant_is_one_shot() -> None:
    waiter: Waiter[int] = Waiter(lambda _: None)
    waiter.grant(1)
    with pytest.raises(RuntimeError, match="granted twice"):
        waiter.grant(2)


def test_bind_wakes_once_on_grant_or_at_once_if_granted() -> None:
    woken: list[str] = []
    waiter: Waiter[int] = Waiter(lambda _: None)
    waiter.bind(lambda: woken.append("a"))
    waiter.grant(1)
    assert woken == ["a"]
    late: Waiter[int] = Waiter(lambda _: None)
    late.grant(1)
    late.bind(lambda: woken.append("b"))
    assert woken == ["a", "b"]


def test_cancelled_waiter_is_not_woken() -> None:
    woken: list[str] = []
    waiter: Waiter[int] = Waiter(lambda _: None)
    waiter.bind(lambda: woken.append("x"))
    waiter.cancel()
    waiter.grant(1)
    assert woken == []


def test_blocking_wait_returns_a_grant_from_another_thread() -> None:
    waiter: Waiter[str] = Waiter(lambda _: None)
    threading.Timer(0.01, waiter.grant, ("lease",)).start()
    assert waiter.wait() == "lease"
    assert waiter.state == TAKEN


def test_blocking_wait_timeout_cancels_and_a_late_grant_is_released() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    assert waiter.wait(timeout=0.0) is None
    assert waiter.state == CANCELLED
    assert not waiter.grant("late")
    assert released == ["late"]


async def test_async_wait_and_cancellation_releases_a_racing_grant() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    asyncio.get_running_loop().call_soon(waiter.grant, "lease")
    assert await waiter.wait_async() == "lease"

    racing: Waiter[str] = Waiter(released.append)
    task = asyncio.ensure_future(racing.wait_async())
    await asyncio.sleep(0)
    racing.grant("raced")  # the wake-up is scheduled; the cancellation comes first
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == ["raced"]
    assert racing.state == CANCELLED


async def test_async_wait_on_a_closed_loop_path_never_loses() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    task = asyncio.ensure_future(waiter.wait_async())
    await asyncio.sleep(0)
    waiter.cancel()  # the owner gave up (closed) while the task waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not waiter.grant("x")
    assert released == ["x"]


@settings(max_examples=200, deadline=None)
@given(
    order=st.permutations(["grant", "cancel", "take"]),
    threaded=st.booleans(),
)
def test_exactly_one_of_taken_or_released(order: list[str], threaded: bool) -> None:
    """Whatever the order (sequential, or racing on three threads), the value ends up once."""
    released: list[int] = []
    taken: list[int] = []
    waiter: Waiter[int] = Waiter(released.append)

    def step(name: str) -> None:
        if name == "grant":
            waiter.grant(1)
        elif name == "cancel":
            waiter.cancel()
        else:
            value = waiter.take()
            if value is not None:
                taken.append(value)

    if threaded:
        barrier = threading.Barrier(3)

        def run(name: str) -> None:
            barrier.wait()
            step(name)

        threads = [threading.Thread(target=run, args=(n,)) for n in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for name in order:
            step(name)
    assert len(taken) + len(released) == 1


# -- deadlines with an owner's say: expire() ------------------------------------------------------


def test_blocking_wait_expire_true_gives_up_and_a_late_grant_is_released() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    asked: list[bool] = []

    def expire() -> bool:
        asked.append(True)
        return True  # the owner withdrew the request

    assert waiter.wait(timeout=0.0, expire=expire) is None
    assert asked == [True]
    assert waiter.state == CANCELLED
    assert not waiter.grant("late")
    assert released == ["late"]


def test_blocking_wait_expire_false_waits_for_the_grant_on_its_way() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    granter = threading.Thread(target=waiter.grant, args=("lease",))

    def expire() -> bool:
        granter.start()  # the owner decided the grant before the deadline; it arrives later
        return False

    assert waiter.wait(timeout=0.0, expire=expire) == "lease"
    granter.join()
    assert waiter.state == TAKEN
    assert released == []


def test_blocking_wait_expire_is_not_asked_when_the_grant_came_in_time() -> None:
    waiter: Waiter[str] = Waiter(lambda _: None)
    waiter.grant("lease")
    assert waiter.wait(timeout=0.0, expire=lambda: pytest.fail("asked")) == "lease"


async def test_async_wait_timeout_raises_and_cancels() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    with pytest.raises(TimeoutError):
        await waiter.wait_async(0.0)
    assert waiter.state == CANCELLED
    assert not waiter.grant("late")
    assert released == ["late"]


async def test_async_wait_expire_false_waits_for_the_grant_on_its_way() -> None:
    released: list[str] = []
    waiter: Waiter[str] = Waiter(released.append)
    loop = asyncio.get_running_loop()

    def expire() -> bool:
        loop.call_soon(waiter.grant, "lease")  # decided; the hand-over comes a moment later
        return False

    assert await waiter.wait_async(0.0, expire=expire) == "lease"
    assert released == []


async def test_async_wait_expire_true_raises_timeout() -> None:
    waiter: Waiter[str] = Waiter(lambda _: None)

    def expire() -> bool:
        waiter.cancel()  # the owner withdrew the request and cancelled the waiter
        return True

    with pytest.raises(TimeoutError):
        await waiter.wait_async(0.0, expire=expire)
    assert waiter.state == CANCELLED


async def test_async_wait_with_a_timeout_still_gets_a_grant_in_time() -> None:
    waiter: Waiter[str] = Waiter(lambda _: None)
    asyncio.get_running_loop().call_soon(waiter.grant, "lease")
    assert await waiter.wait_async(30.0) == "lease"


async def test_async_wait_granted_from_another_thread_wakes_the_loop() -> None:
    # The same-loop wake-up skips the self-pipe; a grant from another thread still uses it.
    waiter: Waiter[str] = Waiter(lambda _: None)
    task = asyncio.ensure_future(waiter.wait_async())
    await asyncio.sleep(0)
    await asyncio.to_thread(waiter.grant, "lease")
    assert await asyncio.wait_for(task, 10) == "lease"
