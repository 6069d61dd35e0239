"""Errors of the Kafka consumer, under rxcoord's tree::

    RxcoordError
     └── KafkaConsumerError          the keyed consumer could not do its job
          ├── BrokerUnavailable      no broker answered at start     (also a ConnectionError)
          ├── UnknownTopic           a subscribed topic does not exist (also a LookupError)
          ├── ConsumerClosed         the consumer was closed or already ran (also a RuntimeError)
          ├── DeadLetterFailed       a failed record could not be written to its dead-letter
          │                          topic: it is not done, and the consumer stops with it
          └── OffsetStoreError       the offsets store (``PostgresOffsets``) could not do its job:
               │                     the record is not done, and the consumer stops with it
               ├── OffsetStoreUnavailable    the database could not be reached for longer than
               │                             ``outage_timeout``          (also a ConnectionError)
               └── OffsetStoreMisconfigured  the database refused for good (a missing privilege,
                                             a wrong password): fix it, then restart

A handler's own exception is not wrapped: with ``on_error="stop"``, ``run()`` raises it as is.
confluent-kafka's ``KafkaException`` and psycopg's errors are mapped at the boundary with
``raise ... from exc``.

Why an ``OffsetStoreError`` stops the consumer whatever ``on_error`` says: ``"skip"`` (and an
``on_error`` callable that returns) means "the record is done", and a record whose transaction
could not be written is not done: skipping it would move the stored position past a record
whose effects were never applied.
"""

from __future__ import annotations

from rxcoord import RxcoordError

__all__ = [
    "BrokerUnavailable",
    "ConsumerClosed",
    "DeadLetterFailed",
    "KafkaConsumerError",
    "OffsetStoreError",
    "OffsetStoreMisconfigured",
    "OffsetStoreUnavailable",
    "UnknownTopic",
]


class KafkaConsumerError(RxcoordError):
    """Base class of the Kafka consumer's own errors."""


class BrokerUnavailable(KafkaConsumerError, ConnectionError):
    """No broker of ``bootstrap.servers`` answered within the start-up timeout.

    Check the address and that the cluster is up, or raise ``startup_timeout``.
    """


class UnknownTopic(KafkaConsumerError, LookupError):
    """A subscribed topic does not exist on the cluster. Create it first (consumers never do)."""


class ConsumerClosed(KafkaConsumerError, RuntimeError):
    """The consumer was closed, or ``run()`` was called a second time: create a new consumer."""


class DeadLetterFailed(KafkaConsumerError):
    """A record that failed its last attempt could not be written to the ``dead_letter`` topic.

    The broker refused the delivery or did not acknowledge it in time (the producer's
    ``message.timeout.ms``). The record is not done and not committed: ``run()`` raises this
    error (as ``on_error="stop"`` would), and the next run consumes the record again. The
    handler's exception is the ``__cause__``; the message names the record, the topic and the
    broker's answer.
    """


class OffsetStoreError(KafkaConsumerError):
    """The offsets store could not record a record's transaction: the record is not done.

    ``run()`` raises it (whatever ``on_error`` says): the stored position stays before the
    record, so the next run processes it. Also raised when a handler given ``tx`` ends that
    transaction itself (``tx.commit()``), which would commit its effects without the record's
    mark.
    """


class OffsetStoreUnavailable(OffsetStoreError, ConnectionError):
    """The database could not be reached (or kept failing) for longer than ``outage_timeout``.

    Each record's transaction is retried through shorter outages (a restart, a failover); past
    ``outage_timeout`` the consumer stops with this error and the next run resumes from the
    stored position.
    """


class OffsetStoreMisconfigured(OffsetStoreError):
    """The database refused the offsets store for a reason no retry fixes.

    A missing privilege on the offsets table, a wrong password, an unknown database or role. The
    message names the cause; the driver's error is the ``__cause__``.
    """
