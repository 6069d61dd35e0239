"""Lease stores as a test sees them: read directly, beside the provider under test (keys, marks,
rows as the store holds them), and a memory store's clock that moves only when the test says."""

from __future__ import annotations

from typing import Any

__all__ = ["FakeClock", "redis_client"]


def redis_client(url: str, *, cluster: bool = False) -> Any:
    """A plain redis-py client on the server at ``url``, or on the cluster one of its nodes is."""
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url)
    import redis

    return redis.Redis.from_url(url)


class FakeClock:
    """A clock for ``MemoryLeaseStore(clock)``: ``now`` stands still until the test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
