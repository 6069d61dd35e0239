"""rxcoord.kafka: a keyed Kafka consumer with key-level parallelism and ordered commits.

Records of one key are handled in offset order, one at a time; keys of one partition run in
parallel; each partition commits only the contiguous prefix of completed offsets. Built on
confluent-kafka (install with ``pip install rxcoord[kafka]``)::

    from rxcoord.kafka import KeyedConsumer

    consumer = KeyedConsumer({"bootstrap.servers": "localhost:9092", "group.id": "orders"},
                             ["orders"], handle, max_concurrency=64)
    consumer.run()          # until close(), SIGTERM or SIGINT; then drains and commits

:func:`kafka_records` and :func:`commit_records` are the same path as Rx pieces, for pipelines
written with :func:`rxcoord.serialize_by_key`. :class:`PostgresOffsets` makes the consumer
exactly-once into PostgreSQL: each record's effects and its position in one transaction::

    offsets = PostgresOffsets("postgresql://app@db/app")
    consumer = KeyedConsumer(config, ["orders"], handle_in_tx, offsets=offsets)
"""

try:
    import confluent_kafka as _confluent_kafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "rxcoord.kafka needs confluent-kafka: install it with: pip install rxcoord[kafka]"
    ) from exc

from ._consumer import KeyedConsumer, OnError
from ._errors import (
    BrokerUnavailable,
    ConsumerClosed,
    DeadLetterFailed,
    KafkaConsumerError,
    OffsetStoreError,
    OffsetStoreMisconfigured,
    OffsetStoreUnavailable,
    UnknownTopic,
)
from ._offsets import OffsetStoreStats, PostgresOffsets
from ._record import Record
from ._rx import commit_records, kafka_records
from ._stats import ConsumerState, ConsumerStats, PartitionStats

__all__ = [
    "BrokerUnavailable",
    "ConsumerClosed",
    "ConsumerState",
    "ConsumerStats",
    "DeadLetterFailed",
    "KafkaConsumerError",
    "KeyedConsumer",
    "OffsetStoreError",
    "OffsetStoreMisconfigured",
    "OffsetStoreStats",
    "OffsetStoreUnavailable",
    "OnError",
    "PartitionStats",
    "PostgresOffsets",
    "Record",
    "UnknownTopic",
    "commit_records",
    "kafka_records",
]
