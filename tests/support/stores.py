"""Reading a lease store directly, beside the provider under test (what the provider is checked
against: keys, marks, rows, as the store holds them)."""

from __future__ import annotations

from typing import Any

__all__ = ["redis_client"]


def redis_client(url: str, *, cluster: bool = False) -> Any:
    """A plain redis-py client on the server at ``url``, or on the cluster one of its nodes is."""
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url)
    import redis

    return redis.Redis.from_url(url)
