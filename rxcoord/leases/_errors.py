"""Two lease errors that ``rxcoord._errors`` does not define (yet).

They extend the package's tree rather than start a new one, so ``except LeaseError`` and
``except RxcoordError`` keep catching everything a lease provider raises on purpose::

    LeaseError
     ├── LeaseLost
     │    └── StaleToken           a fenced resource refused a write from an older holder
     ├── LeaseStoreUnavailable
     └── LeaseProviderClosed      the provider was closed            (also a RuntimeError)
"""

from __future__ import annotations

from rxcoord._errors import LeaseError, LeaseLost

__all__ = ["LeaseProviderClosed", "StaleToken"]


class LeaseProviderClosed(LeaseError, RuntimeError):
    """The lease provider was closed: it grants, extends and releases nothing any more.

    ``close()`` released the leases the provider still held, so other holders do not have to wait
    for them to expire. Open a new provider to take leases again.
    """


class StaleToken(LeaseLost):
    """A fenced resource refused a write whose fencing token is older than one it already saw.

    The writer's lease expired (a pause, a slow network) and a newer holder has written since:
    the write must be dropped, not retried. Being a :class:`LeaseLost`, it is handled wherever a
    lost lease is.

    Attributes:
        name: The fenced name (usually the lease name).
        token: The refused token.
        highest: The highest token the resource had accepted for ``name``.
    """

    def __init__(self, name: str, token: int, highest: int) -> None:
        super().__init__(
            f"stale fencing token {token} for {name!r}: the resource already accepted token "
            f"{highest} from a newer holder; this holder's lease has expired, drop the write"
        )
        self.name = name
        self.token = token
        self.highest = highest
