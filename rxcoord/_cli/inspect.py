"""``rxcoord inspect URL [--json]``: what a lease store holds right now, read-only.

Leases (name, holder, fencing token, expires in, released, waiters marked) and busy fleet
groups (permits running per tenant, tenant limits, demand), from the backend's one listing
primitive (``LeaseProvider._store_list``, see ``rxcoord/leases/_listing.py``). Nothing is
written: no table, key or file is created, nothing is swept or released.

``memory://`` names a store private to each process: the one this command would open is new
and empty, so it shows nothing and says why.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..leases import leases_from_url
from ..leases._listing import StoreListing
from ..leases._registry import backend_for_scheme

__all__ = ["MEMORY_NOTE", "inspect_store", "listing_json", "read_listing"]

MEMORY_NOTE = (
    "memory:// is a store private to the process that created it: this command would open a "
    "new, empty one, so there is nothing to show; inspect a shared store (sqlite://, "
    "postgresql://, redis://)"
)


def read_listing(
    url: str,
    *,
    table: str | None = None,
    prefix: str | None = None,
    cluster: bool = False,
) -> tuple[StoreListing | None, str | None]:
    """The store's listing, or ``(None, note)`` for a store nobody else can see (memory).

    Raises:
        ValueError: Unknown scheme, or an option the backend does not take.
        ImportError: The backend's driver is missing (with the extra to install).
        LeaseStoreUnavailable, LeaseStoreMisconfigured: The store could not be read.
    """
    scheme = url.partition("://")[0]
    backend = backend_for_scheme(scheme)
    if backend is not None and not backend.shared:
        return None, MEMORY_NOTE
    options: dict[str, object] = {}
    name = backend.name if backend is not None else ""
    if table is not None:
        if name not in ("sqlite", "postgres"):
            raise ValueError(f"--table applies to sqlite:// and postgresql:// stores, not {url}")
        options["table"] = table
    if prefix is not None or cluster:
        if name != "redis":
            raise ValueError(f"--prefix and --cluster apply to redis:// stores, not {url}")
        if prefix is not None:
            options["prefix"] = prefix
        if cluster:
            options["cluster"] = True
    if name == "postgres":
        options["min_size"] = 0  # one connection of its own for the listing, none pooled
    with leases_from_url(url, **options) as provider:
        return provider._store_list(), None


def listing_json(url: str, listing: StoreListing | None, note: str | None) -> str:
    """The listing as JSON (times in seconds by the store's clock)."""
    data: dict[str, Any] = {"url": url, "note": note}
    if listing is None:
        data.update(backend="memory", leases=[], groups=[])
    else:
        data.update(asdict(listing))
    return json.dumps(data, indent=2)


def inspect_store(
    url: str,
    *,
    as_json: bool,
    shown_url: str,
    table: str | None = None,
    prefix: str | None = None,
    cluster: bool = False,
) -> int:
    """Print what the store holds: a rich table, or JSON. Returns the exit status (0).

    Raises:
        As :func:`read_listing`.
    """
    listing, note = read_listing(url, table=table, prefix=prefix, cluster=cluster)
    if as_json:
        print(listing_json(shown_url, listing, note))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped or captured: keep the tables readable
        console = Console(width=max(console.width, 160))
    if listing is None:
        console.print(f"[bold]{shown_url}[/]: nothing to show. {note}")
        return 0
    console.print(
        f"[bold]{shown_url}[/] ({listing.backend}): {len(listing.leases)} lease(s), "
        f"{len(listing.groups)} busy fleet group(s); times by the store's clock"
    )
    leases = Table(title="leases", title_justify="left")
    for column in ("name", "holder", "token", "expires in", "state", "waiters"):
        leases.add_column(column, justify="right" if column in ("token", "expires in") else "left")
    for lease in listing.leases:
        leases.add_row(
            lease.name,
            lease.holder if lease.holder is not None else "-",
            str(lease.token),
            f"{lease.expires_in:.3f} s",
            "released (kept by at_least_for)" if lease.released else "held",
            "-" if lease.waited is None else ("marked" if lease.waited else ""),
        )
    console.print(leases)
    groups = Table(title="fleet groups", title_justify="left")
    for column in ("group", "running", "tenant", "tenant running", "tenant limit", "demand"):
        groups.add_column(column, justify="left" if column in ("group", "tenant") else "right")
    for group in listing.groups:
        for index, tenant in enumerate(group.tenants):
            groups.add_row(
                group.name if index == 0 else "",
                str(group.running) if index == 0 else "",
                tenant.tenant,
                str(tenant.running),
                "-" if tenant.limit is None else str(tenant.limit),
                "waiting" if tenant.demand else "",
            )
    console.print(groups)
    notes = []
    if not listing.holders:
        notes.append(f"{listing.backend} records no holder of a lease")
    if not listing.waiter_marks:
        notes.append(f"{listing.backend} marks no waiters")
    notes.append("a group's overall limit is passed by each process and kept by no store")
    console.print("[dim]" + "; ".join(notes) + "[/]")
    return 0
