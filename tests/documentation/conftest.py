"""The documentation's runnable examples get the suite's throwaway servers and broker.

The fixtures are the suites' own (imported, not copied; the servers' are the whole suite's, see
``tests/conftest.py``): a block
marked ``<!-- needs: redis -->`` (or ``postgres``, ``kafka``) runs with ``RXCOORD_REDIS_URL``
(``RXCOORD_POSTGRES_URL``, ``RXCOORD_KAFKA_BOOTSTRAP``) pointing at them, as a reader's
program would read its configuration from the environment.
"""

from __future__ import annotations

from kafka.conftest import kafka_bootstrap

__all__ = ["kafka_bootstrap"]
