"""The fleet permit table on SQLite: what the contract suite cannot see.

Each step is one ``BEGIN IMMEDIATE`` transaction over the group's ``PermitGroup`` JSON, so it
must be atomic against other connections to the file, share the leases' token sequence with
every provider on the file, give up at the caller's timeout when another process holds the
write lock, and leave no transaction open when a step fails.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from rxcoord import LeaseStoreUnavailable
from rxcoord.leases import SqliteLeases
from rxcoord.leases._permits import PermitGroup, hub_name


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "leases.db"


def test_permit_and_lease_tokens_share_the_files_sequence(path: Path) -> None:
    with SqliteLeases(path) as leases, SqliteLeases(path) as permits:
        lease = leases.try_acquire("n", 30.0)
        assert lease is not None
        reply = permits._permits_acquire("g", "a", 2, 1.0, 5, 5, 30.0, 30.0, False)
        assert min(reply.tokens) > lease.token
        lease.release()
        later = leases.try_acquire("n", 30.0)
        assert later is not None
        assert later.token > max(reply.tokens)
        again = permits._permits_acquire("g", "a", 1, 1.0, 5, 5, 30.0, 30.0, False)
        assert again.tokens[0] > later.token
        later.release()
        assert permits._permits_release("g", [(t, "a") for t in reply.tokens + again.tokens]) == 3


def test_the_row_holds_the_reference_state_and_goes_when_idle(path: Path) -> None:
    with SqliteLeases(path) as provider:
        reply = provider._permits_acquire("g", "a", 1, 2.0, 1, 1, 30.0, 30.0, True)

        def row() -> list[tuple[str, str]]:
            conn = sqlite3.connect(path)
            try:
                return conn.execute('SELECT name, state FROM "rxcoord_leases_permits"').fetchall()
            finally:
                conn.close()

        [(name, state)] = row()
        group = PermitGroup.loads(state)
        assert name == "g"
        assert list(group.permits) == list(reply.tokens)
        assert group.passes == {"a": 0.5}
        assert set(group.demand) == {"a"}, "more=True registers demand"
        assert group.limits == {"a": 1}
        assert provider._permits_release("g", [(reply.tokens[0], "a")]) == 1
        assert row() != [], "a's demand is still there"
        provider._permits_acquire("g", "a", 0, 2.0, 1, 1, 30.0, 30.0, False)
        assert row() == []


def test_limits_hold_across_connections(path: Path) -> None:
    providers = [SqliteLeases(path, timeout=10.0) for _ in range(3)]
    lock = threading.Lock()
    out = [0]
    worst = [0]
    errors: list[BaseException] = []

    def worker(provider: SqliteLeases, tenant: str) -> None:
        try:
            for _ in range(40):
                reply = provider._permits_acquire("g", tenant, 1, 1.0, 2, 2, 30.0, 30.0, False)
                if not reply.tokens:
                    continue
                with lock:  # counted after the grant, uncounted before the release
                    out[0] += 1
                    worst[0] = max(worst[0], out[0])
                with lock:
                    out[0] -= 1
                assert provider._permits_release("g", [(reply.tokens[0], tenant)]) == 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(providers[i % 3], f"t{i % 2}")) for i in range(6)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert worst[0] <= 2
    finally:
        for provider in providers:
            provider.close()


def test_a_foreign_write_lock_fails_the_call_at_its_timeout(path: Path) -> None:
    with SqliteLeases(path, timeout=5.0) as provider:
        reply = provider._permits_acquire("g", "a", 1, 1.0, 1, 1, 30.0, 30.0, False)
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another process's write transaction
            started = time.monotonic()
            with pytest.raises(LeaseStoreUnavailable):
                provider._permits_release("g", [(reply.tokens[0], "a")], timeout=0.2)
            with pytest.raises(LeaseStoreUnavailable):
                provider._permits_extend("g", [(reply.tokens[0], "a")], 30.0, timeout=0.2)
            assert time.monotonic() - started < 3.0
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert provider._permits_extend("g", [(reply.tokens[0], "a")], 30.0) == []
        assert provider._permits_release("g", [(reply.tokens[0], "a")]) == 1


def test_a_step_that_fails_leaves_nothing_half_done(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SqliteLeases(path) as provider:
        reply = provider._permits_acquire("g", "a", 1, 1.0, 5, 5, 30.0, 30.0, False)
        real = PermitGroup.release

        def broken(self: PermitGroup, *args: object, **kwargs: object) -> int:
            real(self, *args, **kwargs)  # type: ignore[arg-type]
            raise RuntimeError("boom")

        monkeypatch.setattr(PermitGroup, "release", broken)
        with pytest.raises(RuntimeError):
            provider._permits_release("g", [(reply.tokens[0], "a")])
        monkeypatch.undo()
        # Rolled back: the permit is still held, and the connection is usable.
        assert provider._permits_release("g", [(reply.tokens[0], "a")]) == 1


def test_releases_and_withdrawals_wake_this_providers_waiters(path: Path) -> None:
    with SqliteLeases(path) as provider:
        held = provider._permits_acquire("g", "a", 1, 1.0, 1, 2, 30.0, 30.0, True)
        watch = provider._hub.watch(hub_name("g"))
        try:
            provider._permits_release("g", [(held.tokens[0], "a")])
            assert watch.wait(1.0), "a release with permits held must notify"
        finally:
            watch.close()
        watch = provider._hub.watch(hub_name("g"))
        try:
            provider._permits_acquire("g", "a", 0, 1.0, 1, 2, 30.0, 30.0, False)
            assert watch.wait(1.0), "a pure withdrawal with permits free must notify"
        finally:
            watch.close()
