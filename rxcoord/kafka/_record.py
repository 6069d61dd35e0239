"""The record a handler receives: a thin, immutable view of a confluent-kafka ``Message``.

Fields the consumer needs itself (topic, partition, offset, key) are read once when the record is
made; the others are read from the message when asked for, because most handlers touch one or two
of them and every attribute copied costs time on each record of a batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from confluent_kafka import Message

    from rxcoord._core.telemetry import RecordSpan

    from ._partitions import PartitionState

__all__ = ["Record"]

_NO_TIMESTAMP: Final = -1


class Record:
    """One Kafka record, with bytes as Kafka gives them.

    Attributes:
        topic: The topic name.
        partition: The partition number.
        offset: The record's offset in its partition.
        key: The record's key (``bytes``) or ``None``.
    """

    # ``_span``: the record's span while tracing (see _telemetry.py); set only then, so the
    # consumer's hot path, which makes records without __init__, never writes it.
    __slots__ = ("_lane", "_msg", "_span", "_state", "key", "offset")

    offset: int
    key: bytes | None
    _span: RecordSpan

    def __init__(self, msg: Message, offset: int, key: bytes | None, state: PartitionState) -> None:
        self._msg = msg
        self.offset = offset
        self.key = key
        # The partition's assignment (its epoch) this record was fetched under: completions are
        # reported to it, and ignored once it was revoked.
        self._state = state
        self._lane: object = None  # its ordering key, once the keyed dispatcher queued it

    @property
    def topic(self) -> str:
        """The topic name."""
        return self._state.topic

    @property
    def partition(self) -> int:
        """The partition number."""
        return self._state.partition

    @property
    def value(self) -> bytes | None:
        """The record's value (``bytes``), or ``None`` for a tombstone."""
        value: Any = self._msg.value()
        return value  # type: ignore[no-any-return]

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        """The record's headers as ``(name, value)`` pairs; empty when it has none."""
        headers = self._msg.headers()
        return list(headers) if headers else []  # type: ignore[arg-type]

    @property
    def timestamp(self) -> int | None:
        """The record's timestamp in milliseconds since the epoch, or ``None``."""
        kind, value = self._msg.timestamp()
        return None if kind == 0 or value == _NO_TIMESTAMP else value

    @property
    def epoch(self) -> int:
        """The assignment this record was fetched under (grows with each assignment)."""
        return self._state.epoch

    @property
    def current(self) -> bool:
        """False once the record's partition was revoked from this consumer (result dropped)."""
        return self._state.phase == 0

    def __repr__(self) -> str:
        return f"Record({self.topic}[{self.partition}]@{self.offset}, key={self.key!r})"
