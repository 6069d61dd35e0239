"""Every ``Raises:`` entry of the lease API is what the code raises (issue 26, 5).

The lease methods' docstrings list, per method, the exceptions a caller must be ready for. This
file reads those lists and runs one scenario per (method, exception) that makes the method
raise it; a documented exception without a scenario, or a scenario for an exception the
docstring does not list, fails the first test. So the API reference cannot drift from the code
again (``DistributedLease.extend`` documented ``LeaseLost`` for a released lease, and raises
``LeaseReleasedError``: the docstring was fixed, the behaviour kept).

Stores: an in-memory store with a fake clock (expiry and takeover without sleeping), a Redis
server of this module's own, started by the lease suite's ``start_redis`` (stopped to make an
outage; an ACL user whose rights are revoked makes a refusal for good), and a port nobody
listens on (an outage before any connection).
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import re
import socket
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from support.servers import ThrowawayRedis, start_redis
from support.stores import FakeClock

import rxcoord.leases
from rxcoord.leases import (
    DistributedLease,
    LeaseProvider,
    MemoryLeases,
    MemoryLeaseStore,
    RedisLeases,
)

# The lease API whose Raises: sections are checked: (class, method names).
API: tuple[tuple[type[Any], tuple[str, ...]], ...] = (
    (
        LeaseProvider,
        (
            "try_acquire",
            "acquire",
            "lock",
            "holder",
            "run",
            "acquire_rx",
            "try_acquire_async",
            "acquire_async",
            "lock_async",
            "holder_async",
        ),
    ),
    (
        DistributedLease,
        (
            "extend",
            "extend_async",
            "release",
            "release_async",
            "verify",
            "verify_async",
            "start_keep_alive",
        ),
    ),
)

_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*:")


def documented_raises(function: Callable[..., Any]) -> list[str]:
    """The exception names a Google-style ``Raises:`` section lists, in order."""
    doc = inspect.getdoc(function) or ""
    lines = doc.splitlines()
    names: list[str] = []
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Raises:")
    except StopIteration:
        return names
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:
            break  # the next section
        if indent is None:
            indent = width
        if width != indent:
            continue  # the continuation of an entry's description
        entry = _ENTRY.match(line)
        assert entry is not None, f"{function.__qualname__}: unreadable Raises entry {line!r}"
        names += [name.strip().rsplit(".", 1)[-1] for name in entry.group(2).split(",")]
    return names


def documented_cases() -> set[tuple[str, str]]:
    return {
        (f"{cls.__name__}.{method}", error)
        for cls, methods in API
        for method in methods
        for error in documented_raises(getattr(cls, method))
    }


# -- the stores the scenarios use --------------------------------------------------------------


_P = TypeVar("_P", bound=LeaseProvider)


@pytest.fixture(scope="module")
def own_redis() -> Iterator[ThrowawayRedis]:
    """A Redis server this module stops and starts (the outages below), and ACL users."""
    server = start_redis()
    try:
        yield server
    finally:
        server.remove()


class Stores:
    """What one scenario needs: created on demand, closed after the test."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self.clock = FakeClock()
        self.store = MemoryLeaseStore(self.clock)
        self.memory = MemoryLeases(self.store)
        self.other = MemoryLeases(self.store)  # another holder on the same store
        self._opened: list[LeaseProvider] = [self.memory, self.other]
        self._restart: ThrowawayRedis | None = None

    def close(self) -> None:
        if self._restart is not None:
            self._restart.start()
        for provider in self._opened:
            provider.close()

    def closed_memory(self) -> MemoryLeases:
        provider = MemoryLeases(self.store)
        provider.close()
        return provider

    def lost_lease(self) -> DistributedLease:
        """A lease whose grant expired and was granted to another holder."""
        lease = self.memory.acquire("n", 1.0)
        self.clock.now += 2.0
        assert self.other.try_acquire("n", 10.0) is not None
        return lease

    def released_lease(self) -> DistributedLease:
        lease = self.memory.acquire("n", 10.0)
        lease.release()
        return lease

    def lease_of_closed_provider(self) -> DistributedLease:
        provider = MemoryLeases(self.store)
        lease = provider.acquire("closing", 10.0)
        provider.close()  # releases it
        return lease

    def unreachable(self) -> RedisLeases:
        """A provider whose store refuses connections (nobody listens on the port)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return self._open(RedisLeases(f"redis://127.0.0.1:{port}/0", timeout=1.0))

    def lease_then_outage(self) -> DistributedLease:
        """A lease held on a Redis server that has just stopped."""
        server: ThrowawayRedis = self._request.getfixturevalue("own_redis")
        provider = self._open(RedisLeases(server.url, prefix=self._prefix(), timeout=1.0))
        lease = provider.acquire("n", 10.0)
        server.stop()
        self._restart = server
        return lease

    def refusing(self) -> RedisLeases:
        """A provider whose user may not run a command: a refusal no retry fixes."""
        return self._open(RedisLeases(self._user_url(rights="-@all"), prefix=self._prefix()))

    def lease_then_refusal(self) -> DistributedLease:
        """A lease whose provider's user has just lost every right."""
        url = self._user_url(rights="+@all")
        provider = self._open(RedisLeases(url, prefix=self._prefix(), timeout=1.0))
        lease = provider.acquire("n", 10.0)
        user = self._user
        self._admin(lambda client: client.execute_command("ACL", "SETUSER", user, "-@all"))
        return lease

    def _user_url(self, rights: str) -> str:
        server: ThrowawayRedis = self._request.getfixturevalue("own_redis")
        self._user = f"u{uuid.uuid4().hex[:8]}"
        self._admin(
            lambda client: client.execute_command(
                "ACL", "SETUSER", self._user, "on", ">pw", "~*", "&*", rights
            )
        )
        return f"redis://{self._user}:pw@127.0.0.1:{server.port}/0"

    def _admin(self, action: Callable[[Any], object]) -> None:
        import redis

        server: ThrowawayRedis = self._request.getfixturevalue("own_redis")
        with redis.Redis.from_url(server.url) as client:
            action(client)

    def _prefix(self) -> str:
        return f"raises:{uuid.uuid4().hex[:8]}:"

    def _open(self, provider: _P) -> _P:
        self._opened.append(provider)
        return provider


@pytest.fixture
def stores(request: pytest.FixtureRequest) -> Iterator[Stores]:
    made = Stores(request)
    try:
        yield made
    finally:
        made.close()


# -- one scenario per documented (method, exception) -------------------------------------------

Scenario = Callable[[Stores], object]
SCENARIOS: dict[tuple[str, str], Scenario] = {}
# Scenarios that need the module's Redis server (marked as backend tests).
NEEDS_REDIS: set[tuple[str, str]] = set()

_S = TypeVar("_S", bound=Scenario)


def case(method: str, error: str, *, redis: bool = False) -> Callable[[_S], _S]:
    def register(scenario: _S) -> _S:
        key = (method, error)
        assert key not in SCENARIOS, key
        SCENARIOS[key] = scenario
        if redis:
            NEEDS_REDIS.add(key)
        return scenario

    return register


def run_async(coroutine: Coroutine[Any, Any, object]) -> object:
    return asyncio.run(coroutine)


async def _enter_lock_async(provider: LeaseProvider, name: str, **options: Any) -> None:
    async with provider.lock_async(name, **options):
        pass


def store_cases(method: str, call: Callable[..., object], *args: object) -> None:
    """``call(provider, *args)`` on a provider whose store is out of reach, refuses for good,
    or which is closed: the three errors every provider method that asks the store documents."""
    case(method, "LeaseStoreUnavailable", redis=True)(lambda s: call(s.unreachable(), *args))
    case(method, "LeaseStoreMisconfigured", redis=True)(lambda s: call(s.refusing(), *args))
    case(method, "LeaseProviderClosed")(lambda s: call(s.closed_memory(), *args))


def lease_cases(
    method: str, call: Callable[[DistributedLease], object], *, lost: bool = True
) -> None:
    """``call(lease)`` on a lease that was released, was lost (if ``lost``), whose store has
    just stopped or refuses for good, or whose provider was closed."""
    case(method, "LeaseReleasedError")(lambda s: call(s.released_lease()))
    if lost:
        case(method, "LeaseLost")(lambda s: call(s.lost_lease()))
    case(method, "LeaseStoreUnavailable", redis=True)(lambda s: call(s.lease_then_outage()))
    case(method, "LeaseStoreMisconfigured", redis=True)(lambda s: call(s.lease_then_refusal()))
    case(method, "LeaseProviderClosed")(lambda s: call(s.lease_of_closed_provider()))


# LeaseProvider.try_acquire, try_acquire_async
for _method, _call in (
    ("try_acquire", lambda p, *a: p.try_acquire(*a)),
    ("try_acquire_async", lambda p, *a: run_async(p.try_acquire_async(*a))),
):
    case(f"LeaseProvider.{_method}", "TypeError")(lambda s, c=_call: c(s.memory, 42, 1.0))
    case(f"LeaseProvider.{_method}", "ValueError")(lambda s, c=_call: c(s.memory, "n", 0.0))
    store_cases(f"LeaseProvider.{_method}", _call, "n", 1.0)


def _taken(stores: Stores) -> MemoryLeases:
    assert stores.other.try_acquire("n", 10.0) is not None
    return stores.memory


# LeaseProvider.acquire, acquire_async
for _method, _acquire in (
    ("acquire", lambda p, *a, **k: p.acquire(*a, **k)),
    ("acquire_async", lambda p, *a, **k: run_async(p.acquire_async(*a, **k))),
):
    case(f"LeaseProvider.{_method}", "LockTimeout")(
        lambda s, c=_acquire: c(_taken(s), "n", 1.0, timeout=0)
    )
    case(f"LeaseProvider.{_method}", "TypeError")(
        lambda s, c=_acquire: c(s.memory, "n", 1.0, timeout="5")
    )
    case(f"LeaseProvider.{_method}", "ValueError")(
        lambda s, c=_acquire: c(s.memory, "n", 1.0, timeout=-1)
    )
    store_cases(f"LeaseProvider.{_method}", _acquire, "n", 1.0)


def _enter_lock(provider: LeaseProvider, name: str, **options: Any) -> None:
    with provider.lock(name, **options):
        pass


def _lock_lost_inside(stores: Stores) -> None:
    with stores.memory.lock("n", 1.0):
        stores.clock.now += 2.0
        assert stores.other.try_acquire("n", 10.0) is not None


async def _lock_async_lost_inside(stores: Stores) -> None:
    async with stores.memory.lock_async("n", 1.0):
        stores.clock.now += 2.0
        assert stores.other.try_acquire("n", 10.0) is not None


# LeaseProvider.lock, lock_async
for _method, _enter in (
    ("lock", _enter_lock),
    ("lock_async", lambda p, *a, **k: run_async(_enter_lock_async(p, *a, **k))),
):
    case(f"LeaseProvider.{_method}", "LockTimeout")(
        lambda s, c=_enter: c(_taken(s), "n", timeout=0)
    )
    case(f"LeaseProvider.{_method}", "TypeError")(lambda s, c=_enter: c(s.memory, "n", timeout=[]))
    case(f"LeaseProvider.{_method}", "ValueError")(lambda s, c=_enter: c(s.memory, ""))
    store_cases(f"LeaseProvider.{_method}", _enter, "n")
case("LeaseProvider.lock", "LeaseLost")(_lock_lost_inside)
case("LeaseProvider.lock_async", "LeaseLost")(lambda s: run_async(_lock_async_lost_inside(s)))

# LeaseProvider.holder, holder_async
for _method, _holder in (
    ("holder", lambda p, n: p.holder(n)),
    ("holder_async", lambda p, n: run_async(p.holder_async(n))),
):
    case(f"LeaseProvider.{_method}", "TypeError")(lambda s, c=_holder: c(s.memory, b"n"))
    case(f"LeaseProvider.{_method}", "ValueError")(lambda s, c=_holder: c(s.memory, "x" * 5000))
    store_cases(f"LeaseProvider.{_method}", _holder, "n")

# LeaseProvider.run and acquire_rx: argument errors at the call, before any subscription.
case("LeaseProvider.run", "TypeError")(lambda s: s.memory.run("n", lambda a, b: None))
case("LeaseProvider.run", "ValueError")(lambda s: s.memory.run("", lambda: None))
case("LeaseProvider.acquire_rx", "TypeError")(lambda s: s.memory.acquire_rx("n", "30"))
case("LeaseProvider.acquire_rx", "ValueError")(lambda s: s.memory.acquire_rx("n", 1.0, 2.0))


# DistributedLease.extend, extend_async
for _method, _extend in (
    ("extend", lambda lease, *a: lease.extend(*a)),
    ("extend_async", lambda lease, *a: run_async(lease.extend_async(*a))),
):
    lease_cases(f"DistributedLease.{_method}", _extend)
    case(f"DistributedLease.{_method}", "TypeError")(
        lambda s, c=_extend: c(s.memory.acquire("n", 1.0), "10")
    )
    case(f"DistributedLease.{_method}", "ValueError")(
        lambda s, c=_extend: c(s.memory.acquire("n", 1.0), -1.0)
    )

# DistributedLease.release, release_async
lease_cases("DistributedLease.release", lambda lease: lease.release())
lease_cases("DistributedLease.release_async", lambda lease: run_async(lease.release_async()))

# DistributedLease.verify, verify_async (a lost lease answers False)
lease_cases("DistributedLease.verify", lambda lease: lease.verify(), lost=False)
lease_cases(
    "DistributedLease.verify_async", lambda lease: run_async(lease.verify_async()), lost=False
)


def _keep_alive_of_lost(stores: Stores) -> None:
    lease = stores.lost_lease()
    assert lease.verify() is False  # the store has another grant: now it is marked lost
    lease.start_keep_alive()


case("DistributedLease.start_keep_alive", "LeaseLost")(_keep_alive_of_lost)
case("DistributedLease.start_keep_alive", "LeaseReleasedError")(
    lambda s: s.released_lease().start_keep_alive()
)
case("DistributedLease.start_keep_alive", "LeaseProviderClosed")(
    lambda s: s.lease_of_closed_provider().start_keep_alive()
)


# -- the tests ---------------------------------------------------------------------------------


def test_every_documented_exception_has_a_scenario_and_no_scenario_is_undocumented() -> None:
    documented = documented_cases()
    assert documented, "no Raises: sections found"
    missing = sorted(documented - set(SCENARIOS))
    undocumented = sorted(set(SCENARIOS) - documented)
    assert not missing, f"documented, but no scenario raises it: {missing}"
    assert not undocumented, f"raised by a scenario, but not in the docstring: {undocumented}"


def _error_class(name: str) -> type[BaseException]:
    found = getattr(rxcoord.leases, name, None) or getattr(builtins, name)
    assert isinstance(found, type), name
    assert issubclass(found, BaseException), name
    return found


@pytest.mark.parametrize(
    ("method", "error"),
    [
        pytest.param(*key, id=f"{key[0]}-{key[1]}", marks=[pytest.mark.backend])
        if key in NEEDS_REDIS
        else pytest.param(*key, id=f"{key[0]}-{key[1]}")
        for key in sorted(SCENARIOS)
    ],
)
def test_the_method_raises_what_its_docstring_says(method: str, error: str, stores: Stores) -> None:
    expected = _error_class(error)
    with pytest.raises(expected) as raised:
        SCENARIOS[method, error](stores)
    if error == "LeaseLost":  # a subclass of it would be a different promise
        assert type(raised.value) is expected, type(raised.value)
    if error == "LeaseReleasedError":
        assert not isinstance(raised.value, rxcoord.leases.LeaseLost)


def test_extend_of_a_released_lease_is_a_released_error_not_a_loss() -> None:
    # The case, kept as behaviour: the holder released it, nothing was lost; code
    # that must handle both cases catches their common base, LeaseNotHeld.
    with MemoryLeases() as leases:
        lease = leases.acquire("n", 10.0)
        lease.release()
        with pytest.raises(rxcoord.leases.LeaseReleasedError) as raised:
            lease.extend()
        assert isinstance(raised.value, rxcoord.leases.LeaseNotHeld)
        assert not isinstance(raised.value, rxcoord.leases.LeaseLost)


def test_run_reports_store_errors_on_subscription_not_at_the_call() -> None:
    # Why run and acquire_rx document only argument errors: the rest reaches on_error.
    provider = MemoryLeases()
    provider.close()
    for observable in (provider.run("n", lambda: 1), provider.acquire_rx("n")):  # no raise
        with pytest.raises(rxcoord.leases.LeaseProviderClosed):
            observable.run()  # subscribes: the error arrives through on_error


@pytest.mark.backend
def test_close_finishes_when_the_store_refuses_to_release_for_good(stores: Stores) -> None:
    # Found by the scenarios above: close() used to raise LeaseStoreMisconfigured from the
    # release of a lease still held, and stayed "closing" with its connections open.
    lease = stores.lease_then_refusal()
    provider = lease._provider
    provider.close()  # returns
    assert provider.stats().state == "closed"
    assert lease.lost
    with pytest.raises(rxcoord.leases.LeaseProviderClosed):
        provider.try_acquire("m", 1.0)
