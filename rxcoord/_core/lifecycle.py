"""What every closeable rxcoord object shares: ``close()`` is the real method; ``dispose()``
(the reactivex Disposable protocol) and the ``with`` block call it."""

from __future__ import annotations

from abc import abstractmethod
from enum import Enum
from typing import Self

from reactivex import abc

__all__ = ["Closeable", "CoordinatorState"]


class CoordinatorState(Enum):
    """Lifecycle of a coordinator or scheduler: open -> closing -> closed."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Closeable(abc.DisposableBase):
    """A reactivex Disposable and a context manager whose disposal is ``close()``."""

    __slots__ = ()

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent."""

    def dispose(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
