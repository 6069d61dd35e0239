"""Fencing tokens on the resource side: FencingGuard, and Kleppmann's paused-holder scenario."""

from __future__ import annotations

import threading
import time

import pytest

from rxcoord import LeaseError
from rxcoord.leases import FencingGuard, LeaseLost, StaleToken

from .conftest import Backend


def test_the_guard_accepts_equal_or_newer_tokens_and_refuses_older_ones() -> None:
    guard = FencingGuard()
    guard.check("report", 5)
    guard.check("report", 5)  # one holder writing twice under one grant
    guard.check("report", 7)
    with pytest.raises(StaleToken) as caught:
        guard.check("report", 6)
    error = caught.value
    assert (error.name, error.token, error.highest) == ("report", 6, 7)
    assert "stale fencing token 6" in str(error)
    assert isinstance(error, LeaseLost)  # handled wherever a lost lease is
    assert isinstance(error, LeaseError)
    guard.check("other", 1)  # names are fenced independently
    assert guard.highest("report") == 7
    assert guard.highest("missing") is None
    stats = guard.stats()
    assert (stats.names, stats.accepted, stats.rejected) == (2, 4, 1)


def test_the_guard_rejects_non_integer_tokens() -> None:
    with pytest.raises(TypeError):
        FencingGuard().check("n", "3")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        FencingGuard().check("n", True)


def test_fenced_makes_check_and_write_atomic() -> None:
    guard = FencingGuard()
    written: list[int] = []
    barrier = threading.Barrier(8)

    def writer(token: int) -> None:
        barrier.wait()
        try:
            with guard.fenced("file", token):
                written.append(token)
        except StaleToken:
            pass

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    # Whatever the interleaving, the accepted writes happened in token order.
    assert written == sorted(written)
    assert written[-1] == 7


def test_a_paused_holders_write_is_refused(backend: Backend, name: str) -> None:
    """Kleppmann's scenario: the holder pauses past its lease, a new holder writes first."""
    storage: list[tuple[int, str]] = []
    guard = FencingGuard()

    def write(token: int, data: str) -> None:
        with guard.fenced(name, token):
            storage.append((token, data))

    client1 = backend.new().acquire(name, at_most_for=0.3)
    time.sleep(0.45)  # a stop-the-world pause: client 1's lease expires meanwhile
    with backend.new().lock(name, at_most_for=5.0) as client2:
        write(client2.token, "from client 2")
    with pytest.raises(StaleToken):
        write(client1.token, "from client 1")  # wakes up believing it still holds the lease
    assert storage == [(client2.token, "from client 2")]


def test_the_guard_refuses_a_negative_token_or_a_bad_name_at_the_call() -> None:
    guard = FencingGuard()
    with pytest.raises(ValueError, match=">= 0"):
        guard.check("n", -1)
    with pytest.raises(TypeError, match="str"):
        guard.check(None, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        guard.check("n", True)
    assert guard.highest("n") is None  # nothing was recorded
    assert guard.stats().accepted == 0
