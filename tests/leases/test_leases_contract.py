"""The lease contract, run against every provider: memory, sqlite, postgres, redis.

Durations are short (0.3-1 s) so the suite stays quick; the only sleeps let a lease expire on
the store's clock, with margins. Nothing here asserts speed: the wake-up test compares two paths
of the same run as a ratio.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from loguru import logger
from reactivex import abc
from support.waiting import wait_until

from rxcoord import TenantTaskCoordinator
from rxcoord.leases import (
    DistributedLease,
    LeaseLost,
    LeaseNotHeld,
    LeaseProvider,
    LeaseProviderClosed,
    LeaseReleasedError,
    LockTimeout,
)

from .conftest import Backend

# Margin added to an expiry before relying on it: covers the store round trip and scheduling.
MARGIN = 0.15


# -- exclusion ------------------------------------------------------------------------------


def test_lease_excludes_other_holders_until_released(backend: Backend, name: str) -> None:
    first, second = backend.new(), backend.new()
    lease = first.try_acquire(name, at_most_for=5.0)
    assert lease is not None
    assert lease.name == name
    assert lease.held
    assert second.try_acquire(name, at_most_for=5.0) is None
    assert first.try_acquire(name, at_most_for=5.0) is None  # not reentrant, even for its owner
    lease.release()
    assert lease.released
    again = second.try_acquire(name, at_most_for=5.0)
    assert again is not None
    again.release()


def test_names_are_independent(leases: LeaseProvider, name: str) -> None:
    a = leases.try_acquire(name + "-a", 5.0)
    b = leases.try_acquire(name + "-b", 5.0)
    assert a is not None
    assert b is not None
    a.release()
    b.release()


def test_acquire_times_out_while_taken(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, at_most_for=5.0)
    with pytest.raises(LockTimeout, match=name) as caught:
        backend.new().acquire(name, at_most_for=5.0, timeout=0.2)
    assert isinstance(caught.value, TimeoutError)
    with pytest.raises(LockTimeout):
        backend.new().acquire(name, timeout=0)
    holder.release()


def test_threads_never_hold_a_lease_at_once(backend: Backend, name: str) -> None:
    providers = [backend.new(), backend.new()]
    inside = 0
    overlaps = 0
    tokens: list[int] = []
    guard = threading.Lock()

    def work(provider: LeaseProvider) -> None:
        nonlocal inside, overlaps
        for _ in range(8):
            with provider.lock(name, at_most_for=10.0, timeout=30.0) as lease:
                with guard:
                    inside += 1
                    overlaps += inside > 1
                    tokens.append(lease.token)
                time.sleep(0.001)  # widen the window an overlap would need
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work, args=(providers[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert overlaps == 0
    assert len(tokens) == 32
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)  # every critical section had a grant of its own


# -- expiry and at_least_for ----------------------------------------------------------------


def test_lease_expires_after_at_most_for(backend: Backend, name: str) -> None:
    old = backend.new().try_acquire(name, at_most_for=0.3)
    assert old is not None
    other = backend.new()
    assert other.try_acquire(name, at_most_for=5.0) is None
    time.sleep(0.3 + MARGIN)
    new = other.try_acquire(name, at_most_for=5.0)
    assert new is not None
    assert new.token > old.token
    new.release()


def test_at_least_for_keeps_the_name_taken_after_an_early_release(
    backend: Backend, name: str
) -> None:
    holder, other = backend.new(), backend.new()
    started = time.monotonic()
    lease = holder.try_acquire(name, at_most_for=5.0, at_least_for=0.6)
    assert lease is not None
    lease.release()
    assert lease.released
    assert other.try_acquire(name, at_most_for=5.0) is None  # still inside at_least_for
    waited = other.acquire(name, at_most_for=5.0, timeout=5.0)  # woken at the at_least_for end
    # Granted no earlier than at_least_for after the grant (small margin for clock reads).
    assert time.monotonic() - started >= 0.6 - 0.05
    waited.release()


def test_release_after_at_least_for_frees_the_name_at_once(backend: Backend, name: str) -> None:
    lease = backend.new().try_acquire(name, at_most_for=5.0, at_least_for=0.2)
    assert lease is not None
    time.sleep(0.2 + MARGIN)
    lease.release()
    again = backend.new().try_acquire(name, at_most_for=5.0)
    assert again is not None
    again.release()


def test_extend_moves_the_expiry(backend: Backend, name: str) -> None:
    holder, other = backend.new(), backend.new()
    lease = holder.try_acquire(name, at_most_for=0.4)
    assert lease is not None
    time.sleep(0.2)
    lease.extend(1.0)  # now expires ~1.0 s from here, long after the original 0.4 s
    assert lease.at_most_for == 1.0
    time.sleep(0.2 + MARGIN)  # past the original expiry
    assert other.try_acquire(name, at_most_for=5.0) is None
    assert lease.stats().extensions == 1
    lease.release()


# -- fencing tokens -------------------------------------------------------------------------


def test_tokens_strictly_increase_across_release_expiry_and_new_clients(
    backend: Backend, name: str
) -> None:
    tokens: list[int] = []
    first = backend.new()
    lease = first.try_acquire(name, 5.0)
    assert lease is not None
    tokens.append(lease.token)
    lease.release()
    lease = first.try_acquire(name, 0.2)
    assert lease is not None
    tokens.append(lease.token)
    time.sleep(0.2 + MARGIN)  # expires without release
    lease = backend.new().try_acquire(name, 5.0)
    assert lease is not None
    tokens.append(lease.token)
    lease.release()
    first.close()  # a client restart: the counter lives in the store, not the client
    lease = backend.new().try_acquire(name, 5.0)
    assert lease is not None
    tokens.append(lease.token)
    lease.release()
    assert tokens == sorted(set(tokens)), tokens


# -- ownership and loss ---------------------------------------------------------------------


def test_a_stale_holder_cannot_release_or_extend_the_new_holders_lease(
    backend: Backend, name: str
) -> None:
    stale = backend.new().try_acquire(name, at_most_for=0.3)
    assert stale is not None
    time.sleep(0.3 + MARGIN)
    current = backend.new().try_acquire(name, at_most_for=5.0)
    assert current is not None

    with pytest.raises(LeaseLost):
        stale.extend(5.0)
    with pytest.raises(LeaseLost):
        stale.release()
    assert stale.lost
    # ShedLock's plain DEL would have freed the name here; the new holder still has it.
    assert backend.new().try_acquire(name, 5.0) is None
    assert current.held
    current.release()


def test_leases_of_two_threads_cannot_release_each_other(backend: Backend, name: str) -> None:
    leases = backend.new()
    mine = leases.try_acquire(name, at_most_for=0.3)
    assert mine is not None
    time.sleep(0.3 + MARGIN)
    theirs: list[DistributedLease] = []
    thread = threading.Thread(target=lambda: theirs.append(leases.acquire(name, 5.0, timeout=5)))
    thread.start()
    thread.join(10)
    # Same provider, same name, another thread: the store tells the grants apart by token.
    with pytest.raises(LeaseLost):
        mine.release()
    assert theirs[0].held
    assert leases.try_acquire(name, 5.0) is None
    # Ownership is the lease object, not the thread: any thread may release it.
    releaser = threading.Thread(target=theirs[0].release)
    releaser.start()
    releaser.join(10)
    assert theirs[0].released


def test_an_expired_lease_is_lost_even_if_nobody_took_it(leases: LeaseProvider, name: str) -> None:
    lease = leases.try_acquire(name, at_most_for=0.3)
    assert lease is not None
    time.sleep(0.3 + MARGIN)
    with pytest.raises(LeaseLost):
        lease.extend()
    assert lease.lost


def test_using_a_released_lease_raises_lease_released_error(
    leases: LeaseProvider, name: str
) -> None:
    """A double release is the caller's bug, not a loss: the same error as KeyedLocks raises."""
    lease = leases.try_acquire(name, 5.0)
    assert lease is not None
    lease.release()
    with pytest.raises(LeaseReleasedError, match="already released") as caught:
        lease.release()
    assert not isinstance(caught.value, LeaseLost)
    assert isinstance(caught.value, LeaseNotHeld)
    with pytest.raises(LeaseReleasedError, match="already released"):
        lease.extend()
    with pytest.raises(LeaseReleasedError):
        lease.verify()
    assert not lease.lost


def test_loss_is_reported_by_flag_callback_and_observable(leases: LeaseProvider, name: str) -> None:
    lease = leases.try_acquire(name, at_most_for=0.3)
    assert lease is not None
    calls: list[LeaseLost] = []
    events: list[object] = []
    lease.on_lost(calls.append)
    lease.when_lost.subscribe(events.append, on_completed=lambda: events.append("completed"))
    time.sleep(0.3 + MARGIN)
    with pytest.raises(LeaseLost) as caught:
        lease.extend()
    assert lease.lost
    assert calls == [caught.value]
    assert events == [caught.value, "completed"]
    late: list[LeaseLost] = []
    lease.on_lost(late.append)  # registered after the loss: told at once
    assert late == [caught.value]
    assert leases.stats().lost == 1


def test_a_normal_release_completes_when_lost_without_a_loss(
    leases: LeaseProvider, name: str
) -> None:
    lease = leases.try_acquire(name, 5.0)
    assert lease is not None
    calls: list[LeaseLost] = []
    events: list[object] = []
    lease.on_lost(calls.append)
    lease.when_lost.subscribe(events.append, on_completed=lambda: events.append("completed"))
    lease.release()
    assert calls == []
    assert events == ["completed"]


# -- keep-alive -----------------------------------------------------------------------------


def test_keep_alive_holds_the_lease_well_past_at_most_for(backend: Backend, name: str) -> None:
    other = backend.new()
    # Renewed every 0.2 s: 0.4 s of slack per renewal, so a stalled store write on a busy
    # machine does not look like a lost lease.
    with backend.new().lock(name, at_most_for=0.6, keep_alive=True) as lease:
        assert lease.keep_alive
        deadline = time.monotonic() + 2.0  # more than three times at_most_for
        while time.monotonic() < deadline:
            assert other.try_acquire(name, 5.0) is None
            time.sleep(0.05)
        assert lease.held
        assert lease.stats().extensions >= 3
    assert lease.released
    assert not lease.keep_alive
    again = other.try_acquire(name, 5.0)
    assert again is not None
    again.release()


def test_keep_alive_failure_marks_the_lease_lost_and_tells_the_holder(
    backend: Backend, name: str
) -> None:
    holder = backend.new()
    lease = holder.try_acquire(name, at_most_for=0.3)
    assert lease is not None
    time.sleep(0.3 + MARGIN)
    thief = backend.new().try_acquire(name, 5.0)
    assert thief is not None
    told = threading.Event()
    lease.on_lost(lambda _error: told.set())
    lease.start_keep_alive()  # the first renewal is refused: the lease is someone else's
    assert told.wait(5.0)
    assert lease.lost
    assert not lease.keep_alive
    assert holder.stats().keep_alive == 0
    with pytest.raises(LeaseLost):
        lease.release()
    assert thief.held
    thief.release()


def test_extend_to_a_shorter_duration_reschedules_keep_alive(backend: Backend, name: str) -> None:
    holder, other = backend.new(), backend.new()
    lease = holder.acquire(name, at_most_for=60.0, keep_alive=True)  # next renewal in 20 s
    lease.extend(1.2)  # from now on renewed every 0.4 s
    # One explicit extension, then renewals for longer than the new at_most_for (4 x 0.4 s >
    # 1.2 s): the lease would have expired by now without them. (0.8 s of slack per renewal:
    # a store write stalled by a busy machine must not look like a lost lease.)
    wait_until(
        lambda: lease.stats().extensions >= 5, timeout=15.0, what="renewals at the new period"
    )
    assert other.try_acquire(name, 5.0) is None
    assert lease.held
    lease.release()


# -- waiting --------------------------------------------------------------------------------


def test_a_waiter_wakes_on_release_long_before_the_expiry(backend: Backend, name: str) -> None:
    """Release-to-wake latency as a ratio of the time the expiry path would have taken."""
    holder, waiter = backend.new(), backend.new()
    lease = holder.acquire(name, at_most_for=3.0)
    woken: list[float] = []

    def wait() -> None:
        waiter.acquire(name, 3.0, timeout=10.0)
        woken.append(time.monotonic())

    thread = threading.Thread(target=wait)
    thread.start()
    # A release before the waiter's subscription is confirmed is caught by the retry that
    # follows the confirmation, so no settling time is needed here.
    wait_until(lambda: waiter.stats().waiting == 1, what="the waiter to wait")
    expiry_path = lease.remaining  # when the waiter would wake without a notification
    released = time.monotonic()
    lease.release()
    thread.join(15)
    assert woken
    ratio = (woken[0] - released) / expiry_path
    assert ratio < 0.2, f"woke after {woken[0] - released:.3f}s of a {expiry_path:.3f}s expiry"


def test_a_waiter_wakes_when_the_holders_lease_expires(backend: Backend, name: str) -> None:
    """A crashed holder never releases: the store's expiry time is the waiter's deadline."""
    waiter = backend.new()
    # Before the grant: it expires 0.5 s after some moment past this one, whatever the
    # connecting costs (a cluster client on a loaded box takes a while).
    started = time.monotonic()
    crashed = backend.new().try_acquire(name, at_most_for=0.5)
    assert crashed is not None
    lease = waiter.acquire(name, 5.0, timeout=10.0)
    waited = time.monotonic() - started
    assert waited >= 0.5 - 0.1
    # Woken by the expiry, not by the timeout (which would also end in a last, successful try).
    assert waited / 10.0 < 0.5, f"waited {waited:.3f}s"
    assert lease.token > crashed.token
    if backend.notifies:
        # Not polling: the first try, one after the subscription, a couple at the expiry.
        assert waiter.stats().busy <= 5, waiter.stats()
    lease.release()


def test_waiting_does_not_poll_a_store_that_notifies(backend: Backend, name: str) -> None:
    if not backend.notifies:
        pytest.skip(f"{backend.id} cannot notify other processes: waiters poll with backoff")
    holder, waiter = backend.new(), backend.new()
    lease = holder.acquire(name, at_most_for=5.0)
    thread = threading.Thread(target=lambda: waiter.acquire(name, 5.0, timeout=10).release())
    thread.start()
    wait_until(lambda: waiter.stats().waiting == 1)
    time.sleep(0.5)  # a poller would try a dozen times meanwhile
    assert waiter.stats().busy <= 3, waiter.stats()
    lease.release()
    thread.join(10)


# -- validation and lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 1.0, 0.0), "empty"),
        (("TOO-LONG-ASCII", 1.0, 0.0), "bytes of UTF-8"),
        (("TOO-LONG-UTF8", 1.0, 0.0), "bytes of UTF-8"),
        (("\ud800", 1.0, 0.0), "UTF-8"),
        (("a\x00b", 1.0, 0.0), "NUL"),
        (("n", 0.0, 0.0), "at_most_for"),
        (("n", -1.0, 0.0), "at_most_for"),
        (("n", float("inf"), 0.0), "finite"),
        (("n", 1e13, 0.0), "at most"),
        (("n", 1e17, 0.0), "at most"),
        (("n", 1.0, -0.1), "at_least_for"),
        (("n", 1.0, 2.0), "must not exceed"),
    ],
    ids=[
        "empty",
        "too-long",
        "too-many-bytes",
        "surrogate",
        "nul",
        "zero",
        "negative",
        "infinite",
        "beyond-the-store-1e13",
        "beyond-the-store-1e17",
        "negative-least",
        "least>most",
    ],
)
def test_bad_arguments_raise_value_error(
    leases: LeaseProvider, args: tuple[str, float, float], message: str
) -> None:
    """Refused at the call, before any round trip: never reported as a store outage.

    The names are one byte over the backend's documented limit: ASCII, and two-byte
    characters (under the limit in characters, over it in bytes).
    """
    limit = leases.max_name_bytes
    if args[0] == "TOO-LONG-ASCII":
        args = ("x" * (limit + 1), *args[1:])
    elif args[0] == "TOO-LONG-UTF8":
        args = ("é" * (limit // 2 + 1), *args[1:])
    with pytest.raises(ValueError, match=message):
        leases.try_acquire(*args)
    with pytest.raises(ValueError, match=message):
        leases.acquire(*args, timeout=1)
    with pytest.raises(ValueError, match=message):
        leases.run(args[0], lambda _: None, at_most_for=args[1], at_least_for=args[2])
    with pytest.raises(ValueError, match=message):
        leases.acquire_rx(args[0], at_most_for=args[1], at_least_for=args[2])
    if args[1] == 1.0 and args[2] == 0.0:  # the name is the bad part
        with pytest.raises(ValueError, match=message):
            leases.holder(args[0])
    stats = leases.stats()
    assert stats.granted == 0
    assert stats.store_errors == 0


def test_names_up_to_the_documented_limit_are_stored(leases: LeaseProvider) -> None:
    """The limit is real: a name of exactly max_name_bytes (3-byte characters) works."""
    name = "€" * (leases.max_name_bytes // 3)
    lease = leases.try_acquire(name, 5.0)
    assert lease is not None
    holder = leases.holder(name)
    assert holder is not None
    assert holder.token == lease.token
    lease.release()
    lease = leases.try_acquire("n", leases.max_duration)  # the longest lease the store takes
    assert lease is not None
    lease.release()


# Braces decide a key's hash slot on a Redis Cluster (its first "{...}"), so names made of them
# are where a key layout breaks: each must stay a lease of its own, with its whole life cycle.
AWKWARD_NAMES = ["}", "}x", "#}x", "{", "{}", "{a}", "a}b", "x{y}z", "#", " ", "%s", "\\", "é"]


def test_names_with_braces_and_other_awkward_characters_are_leases_of_their_own(
    backend: Backend, name: str
) -> None:
    holder, other = backend.new(), backend.new()
    names = [name + "/" + awkward for awkward in AWKWARD_NAMES] + [
        awkward + name for awkward in AWKWARD_NAMES
    ]
    leases = [holder.try_acquire(n, 10.0, at_least_for=0.2) for n in names]  # all at once
    assert all(lease is not None for lease in leases), names
    for n, lease in zip(names, leases, strict=True):
        assert lease is not None
        assert other.try_acquire(n, 10.0) is None, n  # taken, and by that name only
        found = other.holder(n)
        assert found is not None, n
        assert found.token == lease.token, n
        lease.release()  # inside at_least_for: the released marker, under the name's key
    first = "}x" + name  # a waiter on a name that starts with "}", woken by its marker's end
    woken = other.acquire(first, 5.0, timeout=10.0)
    assert woken.token > leases[len(AWKWARD_NAMES) + 1].token  # type: ignore[union-attr]
    woken.release()
    wait_until(
        lambda: all(other.holder(n) is None for n in names), what="the released markers to end"
    )


def test_extend_beyond_the_stores_range_is_refused_at_the_call(
    leases: LeaseProvider, name: str
) -> None:
    lease = leases.try_acquire(name, 5.0)
    assert lease is not None
    with pytest.raises(ValueError, match="at most"):
        lease.extend(1e13)
    assert lease.held  # nothing was sent, nothing changed
    assert leases.stats().store_errors == 0
    lease.release()


def test_wrong_types_raise_type_error(leases: LeaseProvider) -> None:
    with pytest.raises(TypeError):
        leases.try_acquire(42, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        leases.try_acquire("n", "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        leases.acquire("n", 1.0, timeout=-1)


def test_close_releases_held_leases_and_refuses_further_use(backend: Backend, name: str) -> None:
    provider = backend.new()
    lease = provider.acquire(name, at_most_for=30.0)
    provider.close()
    provider.close()  # idempotent
    assert provider.closed
    assert provider.stats().state == "closed"
    assert lease.released
    # Released on close: nobody waits 30 s for the name.
    again = backend.new().try_acquire(name, 5.0)
    assert again is not None
    again.release()
    with pytest.raises(LeaseProviderClosed, match="closed"):
        provider.try_acquire(name, 5.0)
    with pytest.raises(LeaseProviderClosed):
        lease.release()


def test_provider_is_a_context_manager_and_a_disposable(backend: Backend, name: str) -> None:
    with backend.new() as provider:
        lease = provider.acquire(name, at_most_for=30.0)
    assert provider.closed
    assert lease.released
    disposable: abc.DisposableBase = backend.new()
    disposable.dispose()  # the reactivex Disposable protocol: dispose() is close()
    assert isinstance(disposable, LeaseProvider)
    assert disposable.closed


def test_close_wakes_waiters_with_a_clear_error(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, at_most_for=10.0)
    provider = backend.new()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            provider.acquire(name, 5.0, timeout=10.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: provider.stats().waiting == 1)
    provider.close()
    thread.join(5)
    assert not thread.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], LeaseProviderClosed)
    holder.release()


def test_providers_are_context_managers(backend: Backend, name: str) -> None:
    with backend.new() as provider:
        lease = provider.try_acquire(name, 5.0)
        assert lease is not None
    assert provider.closed
    assert lease.released


def test_lock_reports_a_lease_lost_during_the_block(backend: Backend, name: str) -> None:
    holder, other = backend.new(), backend.new()
    leases: list[DistributedLease] = []

    def block() -> None:
        with holder.lock(name, at_most_for=0.3) as lease:
            leases.append(lease)
            time.sleep(0.3 + MARGIN)
            assert other.try_acquire(name, 5.0) is not None  # taken over meanwhile

    with pytest.raises(LeaseLost):
        block()
    assert leases[0].lost


def test_lock_raises_lease_lost_on_exit_when_keep_alive_found_the_loss(
    backend: Backend, name: str
) -> None:
    holder, other = backend.new(), backend.new()
    told = threading.Event()
    thieves: list[DistributedLease] = []

    def block() -> None:
        with holder.lock(name, at_most_for=0.3, keep_alive=True) as lease:
            lease.on_lost(lambda _error: told.set())
            lease.stop_keep_alive()  # a pause: the lease expires on the store
            thieves.append(other.acquire(name, 5.0, timeout=10.0))
            lease.start_keep_alive()  # its next renewal finds the lease gone
            assert told.wait(10)
            assert lease.lost

    with pytest.raises(LeaseLost):
        block()
    assert thieves[0].held  # the exit did not touch the new holder's lease
    thieves[0].release()


def test_lock_lets_the_blocks_own_error_through(leases: LeaseProvider, name: str) -> None:
    with pytest.raises(KeyError), leases.lock(name, 5.0) as lease:
        raise KeyError("boom")
    assert lease.released


def test_stats_count_what_happened(backend: Backend, name: str) -> None:
    provider = backend.new()
    lease = provider.try_acquire(name, 5.0)
    assert lease is not None
    assert provider.try_acquire(name, 5.0) is None
    lease.extend()
    stats = provider.stats()
    assert (stats.backend, stats.state, stats.held) == (backend.name, "open", 1)
    assert (stats.granted, stats.busy, stats.extended) == (1, 1, 1)
    lease.release()
    stats = provider.stats()
    assert (stats.held, stats.released, stats.lost, stats.store_errors) == (0, 1, 0, 0)
    lease_stats = lease.stats()
    assert (lease_stats.name, lease_stats.token, lease_stats.state) == (
        name,
        lease.token,
        "released",
    )


# -- across processes -----------------------------------------------------------------------


def _needs_processes(backend: Backend) -> None:
    if backend.url is None:
        pytest.skip(
            f"{backend.id}: the store lives in one process; other processes cannot share it"
        )


def test_processes_incrementing_a_shared_counter_lose_no_update(
    backend: Backend, name: str, tmp_path: Path
) -> None:
    _needs_processes(backend)
    counter, log = tmp_path / "counter", tmp_path / "tokens"
    counter.write_text("0")
    log.write_text("")
    workers = [backend.worker("counter", name, str(counter), str(log), "8") for _ in range(3)]
    for worker in workers:
        out, _ = worker.communicate(timeout=90)
        assert worker.returncode == 0
        assert '"done": true' in out
    assert counter.read_text() == "24"
    tokens = [int(line) for line in log.read_text().split()]
    assert len(tokens) == 24
    assert tokens == sorted(set(tokens))  # writes happened in grant order


def test_a_killed_holder_blocks_the_name_until_at_most_for(backend: Backend, name: str) -> None:
    _needs_processes(backend)
    import json
    import os
    import signal

    from .conftest import stop_process

    worker = backend.worker("hold", name, "0.6")
    try:
        assert worker.stdout is not None
        token = json.loads(worker.stdout.readline())["token"]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        leases = backend.new()
        assert leases.try_acquire(name, 5.0) is None  # a dead holder still excludes
        lease = leases.acquire(name, 5.0, timeout=5.0)  # ...until its lease expires
        assert lease.token > token
        lease.release()
    finally:
        stop_process(worker)


def test_a_paused_holder_finds_its_lease_lost_and_its_token_stale(
    backend: Backend, name: str
) -> None:
    _needs_processes(backend)
    import json
    import os
    import signal

    from .conftest import stop_process

    worker = backend.worker("pause", name, "0.5")
    try:
        assert worker.stdout is not None
        assert worker.stdin is not None
        token = json.loads(worker.stdout.readline())["token"]
        os.kill(worker.pid, signal.SIGSTOP)  # a GC pause, a frozen VM...
        leases = backend.new()
        lease = leases.acquire(name, 10.0, timeout=5.0)  # after the paused holder's expiry
        assert lease.token > token  # a fenced resource would refuse the paused holder
        os.kill(worker.pid, signal.SIGCONT)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        result = json.loads(worker.stdout.readline())
        assert result == {"extend": "LeaseLost", "release": "LeaseLost", "lost": True}
        assert lease.held
        assert backend.new().try_acquire(name, 5.0) is None  # its release freed nothing
        lease.release()
    finally:
        stop_process(worker)


def test_close_stops_every_thread_the_provider_started(backend: Backend, name: str) -> None:
    holder = backend.new().acquire(name, at_most_for=5.0)
    before = set(threading.enumerate())
    provider = backend.make()
    with pytest.raises(LockTimeout):
        provider.acquire(name, 5.0, timeout=0.2)  # starts the notification listener, if any
    kept = provider.acquire(name + "-kept", at_most_for=1.0, keep_alive=True)
    wait_until(lambda: kept.stats().extensions >= 1)  # keep-alive workers ran
    provider.close()

    def ours_gone() -> bool:
        started = set(threading.enumerate()) - before
        # The shared timer thread is rxcoord's, not the provider's; it lingers a moment.
        return all(t.name == "rxcoord-timer" for t in started)

    wait_until(ours_gone, what="the provider's threads to end")
    holder.release()


def test_a_loss_callback_may_close_the_provider(backend: Backend, name: str) -> None:
    provider = backend.make()
    lease = provider.try_acquire(name, at_most_for=0.3)
    assert lease is not None
    time.sleep(0.3 + MARGIN)
    thief = backend.new().try_acquire(name, 5.0)
    assert thief is not None
    closed = threading.Event()

    def on_lost(_error: LeaseLost) -> None:
        provider.close()  # runs on the provider's own keep-alive worker
        closed.set()

    lease.on_lost(on_lost)
    lease.start_keep_alive()
    assert closed.wait(5)
    assert provider.closed
    thief.release()


# -- nothing left behind (issue 13, 1) ------------------------------------------------------


def _churn(leases: LeaseProvider, names: list[str], *, threads: int = 4) -> list[int]:
    """Acquire and release every name once, through the public API, a few threads at once."""

    def pair(name: str) -> int:
        lease = leases.try_acquire(name, 30.0)
        assert lease is not None, name
        lease.release()
        return lease.token

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(pair, names, chunksize=256))


def test_released_and_expired_names_leave_nothing_behind(backend: Backend, name: str) -> None:
    leases = backend.new()
    _churn(leases, [f"{name}-{i}" for i in range(100)])
    assert backend.records() <= backend.bookkeeping  # released: deleted at once
    kept = [leases.try_acquire(f"{name}-least-{i}", 5.0, at_least_for=0.2) for i in range(5)]
    expiring = [leases.try_acquire(f"{name}-exp-{i}", 0.2) for i in range(5)]
    for lease in kept:
        assert lease is not None
        lease.release()
    assert all(lease is not None for lease in expiring)
    time.sleep(0.2 + MARGIN)
    # Expired and at_least_for rows go once a later grant sweeps them (at most once a second;
    # Redis and memory need no sweep: keys expire, records are dropped when found expired).
    deadline = time.monotonic() + 10.0
    while backend.records() > backend.bookkeeping and time.monotonic() < deadline:
        lease = leases.try_acquire(f"{name}-sweeper", 5.0)
        assert lease is not None
        lease.release()
        time.sleep(0.1)
    assert backend.records() <= backend.bookkeeping
    assert all(leases.holder(f"{name}-exp-{i}") is None for i in range(5))


def test_tokens_of_a_name_increase_although_its_record_is_deleted(
    backend: Backend, name: str
) -> None:
    first = backend.new()
    tokens = []
    for round_ in range(3):
        lease = first.try_acquire(name, 5.0)
        assert lease is not None
        tokens.append(lease.token)
        lease.release()
        assert first.holder(name) is None  # the record is gone...
        _churn(first, [f"{name}-other-{round_}-{i}" for i in range(3)], threads=1)
    restarted = backend.new()  # ...and a new client starts above every earlier token
    lease = restarted.try_acquire(name, 0.2)
    assert lease is not None
    tokens.append(lease.token)
    time.sleep(0.2 + MARGIN)  # expired, never released
    again = restarted.try_acquire(name, 5.0)
    assert again is not None
    tokens.append(again.token)
    again.release()
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


@pytest.mark.slow
def test_100000_names_leave_at_most_the_bookkeeping_behind(backend: Backend) -> None:
    # SQLite: durable=False spares 200,000 fsyncs; what is deleted does not depend on it.
    leases = backend.new(durable=False) if backend.id == "sqlite" else backend.new()
    tokens = _churn(leases, [f"n{i}" for i in range(100_000)])
    if backend.id != "redis-cluster":  # a cluster has a sequence per hash slot instead
        assert len(set(tokens)) == len(tokens)  # one store-wide sequence: no token twice
    assert backend.records() <= backend.bookkeeping


@pytest.mark.slow
def test_10000_customers_through_a_leased_coordinator_leave_nothing_behind(
    backend: Backend,
) -> None:
    leases = backend.new(durable=False) if backend.id == "sqlite" else backend.new()
    coordinator = TenantTaskCoordinator(
        max_concurrency=8, max_queue_size=10_000, name="orders", leases=leases
    )
    done = threading.Semaphore(0)
    errors: list[Exception] = []

    def failed(error: Exception) -> None:
        errors.append(error)
        done.release()

    try:
        for customer in range(10_000):
            coordinator.execute(lambda: None, key=f"customer-{customer}").subscribe(
                on_completed=done.release, on_error=failed
            )
        for _ in range(10_000):
            assert done.acquire(timeout=60)
    finally:
        coordinator.close()
    assert errors == []
    assert leases.stats().granted >= 10_000
    assert backend.records() <= backend.bookkeeping


# -- the store's view (issue 13, 3) ---------------------------------------------------------


def test_holder_reports_the_stores_current_grant(backend: Backend, name: str) -> None:
    mine, other = backend.new(), backend.new()
    assert other.holder(name) is None
    lease = mine.try_acquire(name, 5.0)
    assert lease is not None
    seen = other.holder(name)  # another client's view: the store's, not local bookkeeping
    assert seen is not None
    assert (seen.name, seen.token, seen.released) == (name, lease.token, False)
    assert 0 < seen.remaining <= 5.0
    lease.release()
    assert other.holder(name) is None
    kept = mine.try_acquire(name, 5.0, at_least_for=0.5)
    assert kept is not None
    kept.release()
    seen = other.holder(name)  # released, but at_least_for keeps the name taken
    assert seen is not None
    assert (seen.token, seen.released) == (kept.token, True)
    assert seen.remaining <= 0.5


def test_verify_finds_an_expiry_and_a_takeover_that_held_does_not_see(
    backend: Backend, name: str
) -> None:
    mine, other = backend.new(), backend.new()
    old = mine.try_acquire(name, 0.3)
    assert old is not None
    assert old.verify()
    losses: list[LeaseLost] = []
    old.on_lost(losses.append)
    time.sleep(0.3 + MARGIN)
    new = other.try_acquire(name, 5.0)
    assert new is not None
    assert old.held  # the local view: nothing told this process
    assert not old.verify()  # the store's view: someone else's grant
    assert old.lost
    assert len(losses) == 1
    assert f"token {new.token}" in str(losses[0])
    assert new.verify()
    new.release()
    with pytest.raises(LeaseReleasedError):
        new.verify()


async def test_holder_and_verify_have_async_forms(backend: Backend, name: str) -> None:
    leases = backend.new()
    assert await leases.holder_async(name) is None
    lease = await leases.acquire_async(name, 5.0)
    seen = await leases.holder_async(name)
    assert seen is not None
    assert seen.token == lease.token
    assert await lease.verify_async()
    await lease.release_async()


# -- forgotten leases end (issue 13, 4) -----------------------------------------------------


def test_a_dropped_lease_stops_its_keep_alive_and_frees_by_at_most_for(
    backend: Backend, name: str
) -> None:
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    logger.enable("rxcoord")
    try:
        holder = backend.new()
        lease = holder.acquire(name, at_most_for=0.6, keep_alive=True)
        token = lease.token
        del lease  # dropped without release(): nobody can release it any more
        gc.collect()
        other = backend.new()
        # Renewed forever, the name would never free; stopped, it frees within at_most_for.
        again = other.acquire(name, 5.0, timeout=10.0)
        assert again.token > token
        again.release()
        wait_until(lambda: holder.stats().keep_alive == 0, what="keep-alive to stop")
        assert holder.stats().held == 0
        assert any(name in line and "dropped without release" in line for line in warnings)
    finally:
        logger.disable("rxcoord")
        logger.remove(sink)


# -- cancel-safe release (issue 13, 5) ------------------------------------------------------


async def test_a_cancelled_release_async_still_releases_and_a_retry_loses_nothing(
    backend: Backend, name: str
) -> None:
    leases, other = backend.new(), backend.new()
    lease = await leases.acquire_async(name, 30.0, keep_alive=True)
    loop = asyncio.get_running_loop()
    # One busy worker: the release's round trip has to queue behind it, so the cancellation
    # below arrives while the release is decided but not yet done.
    gate = threading.Event()
    executor = ThreadPoolExecutor(1)
    loop.set_default_executor(executor)
    blocker = loop.run_in_executor(None, gate.wait, 10.0)
    try:
        task = asyncio.create_task(lease.release_async())
        await asyncio.sleep(0)  # the task runs up to its first await
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not lease.held  # decided: it reads as released at once
        assert lease.released
        with pytest.raises(LeaseReleasedError):  # a retry: never a false LeaseLost
            await lease.release_async()
        with pytest.raises(LeaseReleasedError):
            lease.release()
    finally:
        gate.set()
        await blocker
    for _ in range(5000):  # the round trip runs once the worker is free
        if lease.state == "released":
            break
        await asyncio.sleep(0.002)
    assert lease.state == "released"
    assert not lease.lost
    assert await other.holder_async(name) is None
    again = await other.try_acquire_async(name, 5.0)
    assert again is not None
    await again.release_async()
    assert leases.stats().lost == 0
