"""Fixtures of the cache tests: a real Redis-protocol server and stores on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from services.cache.metrics import CacheMetrics
from services.cache.store import RedisStore
from tests.cache.redis_server import RedisProcess, start_redis_server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One server for the session, on a free port; stopped by pid at the end."""
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    """A plain client on an emptied database (to check what the store wrote)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def metrics() -> CacheMetrics:
    """Metrics in a fresh registry, so a test reads exact values."""
    return CacheMetrics.create(CollectorRegistry())


@pytest.fixture
async def redis_store(redis_client: redis.Redis, redis_server: RedisProcess,
                      metrics: CacheMetrics) -> AsyncIterator[RedisStore]:
    """A started RedisStore on the session server (database emptied first)."""
    store = RedisStore(redis_server.url, metrics=metrics)
    await store.start()
    yield store
    await store.close()
