"""The documentation's runnable examples get the suite's throwaway servers and broker.

The fixtures are the lease suite's and the Kafka suite's own (imported, not copied): a block
marked ``<!-- needs: redis -->`` (or ``postgres``, ``kafka``) runs with ``RXCOORD_REDIS_URL``
(``RXCOORD_POSTGRES_URL``, ``RXCOORD_KAFKA_BOOTSTRAP``) pointing at them, as a reader's
program would read its configuration from the environment.
"""

from __future__ import annotations

from kafka.conftest import kafka_bootstrap
from leases.conftest import postgres_server, postgres_url, redis_server, redis_url

__all__ = ["kafka_bootstrap", "postgres_server", "postgres_url", "redis_server", "redis_url"]
