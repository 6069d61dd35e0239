"""Errors of the Kafka consumer, under rxcoord's tree::

    RxcoordError
     └── KafkaConsumerError          the keyed consumer could not do its job
          ├── BrokerUnavailable      no broker answered at start     (also a ConnectionError)
          ├── UnknownTopic           a subscribed topic does not exist (also a LookupError)
          └── ConsumerClosed         the consumer was closed or already ran (also a RuntimeError)

A handler's own exception is not wrapped: with ``on_error="stop"``, ``run()`` raises it as is.
confluent-kafka's ``KafkaException`` is mapped at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from rxcoord import RxcoordError

__all__ = ["BrokerUnavailable", "ConsumerClosed", "KafkaConsumerError", "UnknownTopic"]


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
