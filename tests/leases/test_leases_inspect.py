"""``rxcoord inspect``: what every backend's store holds, listed read-only, against real servers.

Each backend answers one listing primitive (``_store_list``); the command shows it as JSON or
tables. Checked per backend: leases (token, time left, released early, holder where the store
records one, waiter marks on PostgreSQL), fleet groups (running per tenant, limits, demand),
that listing writes nothing (not even a schema), and that ``memory://`` says why it is empty.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from pathlib import Path

import pytest
from support.waiting import wait_until

from rxcoord._cli.inspect import MEMORY_NOTE
from rxcoord._cli.main import main
from rxcoord.leases import LeaseProvider, LockTimeout, PostgresLeases
from rxcoord.leases._listing import TenantEntry

from .conftest import Backend, drop_table, pg_row_waited


def cli_args(backend: Backend) -> list[str]:
    """The store's URL and namespace as ``rxcoord inspect`` options."""
    assert backend.url is not None
    args = [backend.url]
    if "table" in backend.options:
        args += ["--table", str(backend.options["table"])]
    if "prefix" in backend.options:
        args += ["--prefix", str(backend.options["prefix"])]
    if backend.options.get("cluster"):
        args.append("--cluster")
    return args


def inspect_json(backend: Backend, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["inspect", *cli_args(backend), "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def fill(leases: LeaseProvider, name: str) -> dict[str, int]:
    """Two leases (one released early, kept by at_least_for) and a busy fleet group."""
    held = leases.acquire(name, at_most_for=30)
    kept = leases.acquire(name + "-kept", at_most_for=30, at_least_for=20)
    kept.release()
    group = f"group-{name}"
    # tenant a: 2 of its limit 2; tenant b wants 2 and gets the last of 3, so it waits.
    args = (1.0, 2, 3, 30.0, 30.0, False)  # weight, tenant limit, limit, most, demand_for, more
    assert len(leases._permits_acquire(group, "a", 2, *args).tokens) == 2
    assert len(leases._permits_acquire(group, "b", 2, *args).tokens) == 1
    return {"held": held.token, "kept": kept.token}


def test_inspect_lists_leases_and_groups(
    backend: Backend, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    leases = backend.new()
    tokens = fill(leases, name)
    data = listed(backend, capsys)
    assert data["backend"] == backend.name
    rows = {row["name"]: row for row in data["leases"]}  # type: ignore[attr-defined]
    assert set(rows) == {name, name + "-kept"}
    held, kept = rows[name], rows[name + "-kept"]
    assert (held["token"], held["released"]) == (tokens["held"], False)
    assert (kept["token"], kept["released"]) == (tokens["kept"], True)
    assert 0 < held["expires_in"] <= 30
    assert 0 < kept["expires_in"] <= 20
    me = f"{socket.gethostname()}:{os.getpid()}"
    expected_holder = me if backend.name in ("sqlite", "postgres") else None
    assert held["holder"] == expected_holder
    assert held["waited"] == (False if backend.name == "postgres" else None)
    groups = data["groups"]
    assert isinstance(groups, list)
    (group,) = groups
    assert group["name"] == f"group-{name}"
    assert group["running"] == 3
    assert group["tenants"] == [
        {"tenant": "a", "running": 2, "limit": None, "demand": False},
        {"tenant": "b", "running": 1, "limit": 2, "demand": True},
    ]
    assert 0 < group["next_expiry"] <= 30


def _as_dict(listing: object) -> dict[str, object]:
    from dataclasses import asdict

    data: dict[str, object] = json.loads(json.dumps(asdict(listing)))  # type: ignore[call-overload]
    return data


def listed(backend: Backend, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """The listing through the command (memory: through a provider of the store itself)."""
    if backend.url is None:
        return _as_dict(backend.new()._store_list())
    return inspect_json(backend, capsys)


def test_inspect_writes_nothing(backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    assert backend.records() == 0  # (SQLite: this makes an empty file; a missing one is an error)
    data = listed(backend, capsys)  # a namespace no provider has set up
    assert (data["leases"], data["groups"]) == ([], [])
    assert backend.records() == 0  # listing created nothing
    leases = backend.new()
    fill(leases, "n")
    filled = backend.records()
    listed(backend, capsys)
    assert backend.records() == filled


def test_inspect_marks_waiters_on_postgres(
    postgres_url: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Only PostgreSQL marks the leases waiters wait for (the others list waited=None, above).
    table = f"leases_{uuid.uuid4().hex[:12]}"
    holder = PostgresLeases(postgres_url, table=table, timeout=2.0)
    waiter = PostgresLeases(postgres_url, table=table, timeout=2.0)
    failed: list[BaseException] = []
    try:
        lease = holder.acquire(name)

        def wait() -> None:
            try:
                waiter.acquire(name, timeout=30).release()
            except LockTimeout as exc:
                failed.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        wait_until(lambda: pg_row_waited(postgres_url, table, name), what="the waiter's mark")
        assert main(["inspect", postgres_url, "--table", table, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["leases"]
        assert row["waited"] is True
        lease.release()
        thread.join(10)
    finally:
        holder.close()
        waiter.close()
        drop_table(postgres_url, table)
    assert failed == []


def test_inspect_memory_says_why_it_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "memory://", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["leases"], data["groups"], data["note"]) == ([], [], MEMORY_NOTE)
    assert main(["inspect", "memory://"]) == 0
    assert "private to the process" in " ".join(capsys.readouterr().out.split())


def test_inspect_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rxcoord.leases import SqliteLeases

    path = tmp_path / "leases.db"
    name = f"job-{uuid.uuid4().hex[:6]}"
    with SqliteLeases(path) as leases:
        fill(leases, name)
        assert main(["inspect", f"sqlite://{path}"]) == 0
    out = capsys.readouterr().out
    for text in (name, f"group-{name}", "held", "released (kept by at_least_for)", "waiting"):
        assert text in out


def test_inspect_missing_sqlite_file_is_one_line_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "absent.db"
    assert main(["inspect", f"sqlite://{path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("rxcoord: error: ")
    assert not path.exists()


def test_inspect_rejects_options_of_another_backend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", f"sqlite://{tmp_path / 'x.db'}", "--prefix", "p:"]) == 2
    assert "--prefix and --cluster apply to redis://" in capsys.readouterr().err


def test_inspect_leaves_out_what_expired_by_the_stores_clock() -> None:
    from rxcoord.leases import MemoryLeases, MemoryLeaseStore

    now = [1000.0]
    store = MemoryLeaseStore(clock=lambda: now[0])
    with MemoryLeases(store) as leases:
        leases.acquire("short", at_most_for=1)
        leases.acquire("long", at_most_for=60)
        args = (1.0, 2, 3)  # weight, tenant limit, limit
        leases._permits_acquire("g", "a", 2, *args, 1.0, 30.0, False)  # permits for 1 s
        leases._permits_acquire("g", "b", 2, *args, 60.0, 5.0, False)  # 1 permit, demand 5 s
        listing = leases._store_list()
        assert [lease.name for lease in listing.leases] == ["long", "short"]
        assert [(t.tenant, t.running, t.demand) for t in listing.groups[0].tenants] == [
            ("a", 2, False),
            ("b", 1, True),
        ]
        now[0] += 10  # a's permits, b's demand and the short lease have expired
        listing = leases._store_list()
        assert [lease.name for lease in listing.leases] == ["long"]
        (group,) = listing.groups
        assert (group.running, group.tenants) == (1, (TenantEntry("b", 1, None, False),))
        assert group.next_expiry == 50.0
