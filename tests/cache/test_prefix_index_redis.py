"""RedisPrefixIndex beyond the contract: outage and restart, a shared index, key layout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TypeVar

import pytest
import redis

from services.cache.metrics import CacheMetrics
from services.cache.prefix_index import RedisPrefixIndex
from services.cache.store import RedisOptions, StoreUnavailableError
from services.common.block_hash import block_hash_seed, prompt_block_hashes
from services.common.kv_events import BlockStored
from tests.cache.helpers import FakeClock, sample
from tests.cache.redis_server import RedisProcess, start_redis_server

H = prompt_block_hashes(block_hash_seed("smollm2"), list(range(1600)), 16)
T = TypeVar("T")
TIMEOUT_S = 0.2
SLACK_S = 0.3


@pytest.fixture
def own_server() -> Iterator[RedisProcess]:
    """A server of this test's own, which it may kill and restart."""
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture
async def shared_pair(redis_client: redis.Redis, redis_server: RedisProcess,
                      metrics: CacheMetrics) -> AsyncIterator[tuple[RedisPrefixIndex, ...]]:
    """Two indexes on the session server (as two cache-service instances)."""
    pair = tuple(RedisPrefixIndex(redis_server.url, metrics=metrics) for _ in range(2))
    for index in pair:
        await index.start()
    yield pair
    for index in pair:
        await index.close()


async def timed(call: Awaitable[T]) -> T:
    """``await call``, asserting it answers within the timeout plus slack."""
    started = time.perf_counter()
    result = await call
    assert time.perf_counter() - started < TIMEOUT_S + SLACK_S
    return result


async def test_an_outage_answers_false_and_empty_then_a_restart_needs_a_resync(
        own_server: RedisProcess, metrics: CacheMetrics) -> None:
    clock = FakeClock()
    options = RedisOptions(timeout_seconds=TIMEOUT_S, retry_interval_seconds=5.0, clock=clock)
    index = RedisPrefixIndex(own_server.url, options=options, metrics=metrics)
    await index.start()
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:5])
    assert await index.score(H) == {"a": 5}

    own_server.kill()
    assert await timed(index.heartbeat("a", 1)) is False  # tried: connection refused
    assert await timed(index.apply("a", 1, [BlockStored((H[5],), None, (), 16)])) is False
    assert await timed(index.replace("a", 1, H[:3])) is False
    assert await timed(index.register("a", 2, 100)) is False
    assert await timed(index.score(H)) == {}
    assert await timed(index.sizes()) == {}
    assert await timed(index.drop("a", 1)) is None
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="kv_heartbeat") == 1
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="kv_apply") == 0  # in the pause: not even tried
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 0
    assert sample(metrics, "llmesh:kv_index_resyncs_total", replica="a", reason="backend") == 3

    clock.advance(5.0)
    assert await timed(index.score(H)) == {}  # tried again, still down
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="kv_score") == 1

    own_server.restart()
    clock.advance(5.0)
    assert await index.heartbeat("a", 1) is False  # Redis came back empty
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 1
    assert sample(metrics, "llmesh:kv_index_resyncs_total", replica="a",
                  reason="not_registered") == 1
    assert await index.score(H) == {}
    assert await index.register("a", 1, 100) is True
    assert await index.replace("a", 1, H[:4]) is True
    assert await index.heartbeat("a", 1) is True
    assert await index.score(H) == {"a": 4}
    await index.close()


async def test_a_hung_redis_costs_at_most_the_timeout(own_server: RedisProcess,
                                                      metrics: CacheMetrics) -> None:
    index = RedisPrefixIndex(own_server.url, options=RedisOptions(timeout_seconds=TIMEOUT_S),
                             metrics=metrics)
    await index.start()
    await index.register("a", 1, 100)
    client = redis.Redis.from_url(own_server.url)
    client.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # the server stops answering
    started = time.perf_counter()
    assert await index.score(H) == {}
    assert 0.15 < time.perf_counter() - started < TIMEOUT_S + SLACK_S
    client.close()
    await index.close()


async def test_start_fails_fast_when_redis_is_unreachable(metrics: CacheMetrics) -> None:
    server = start_redis_server()
    url = server.url
    server.stop()
    index = RedisPrefixIndex(url, options=RedisOptions(timeout_seconds=0.5), metrics=metrics)
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        await index.start()
    await index.close()


async def test_two_instances_share_one_index(shared_pair: tuple[RedisPrefixIndex, ...]) -> None:
    first, second = shared_pair
    await first.register("a", 1, 100)
    await first.replace("a", 1, H[:5])
    assert await second.score(H) == {"a": 5}
    assert await second.apply("a", 1, [BlockStored((H[5],), None, (), 16)]) is True
    assert await first.score(H) == {"a": 6}
    assert await second.register("a", 2, 100) is True  # the engine restarted, seen by the other
    assert await first.apply("a", 1, [BlockStored((H[6],), None, (), 16)]) is False
    assert await first.sizes() == {"a": 0}
    await first.drop("a", 2)
    assert await second.sizes() == {}


async def test_an_expired_replica_leaves_no_key_behind(redis_client: redis.Redis,
                                                       redis_server: RedisProcess,
                                                       metrics: CacheMetrics) -> None:
    index = RedisPrefixIndex(redis_server.url, liveness_ttl_s=0.2, metrics=metrics)
    await index.start()
    await index.register("a", 1, 100)
    await index.replace("a", 1, H[:5])
    assert sorted(redis_client.keys("*")) == [b"llmesh:kv:blocks:a:1", b"llmesh:kv:live:a",
                                              b"llmesh:kv:replicas"]
    await asyncio.sleep(0.3)
    assert await index.score(H) == {}
    assert redis_client.keys("*") == []
    await index.close()


async def test_the_key_prefix_separates_indexes(redis_client: redis.Redis,
                                                redis_server: RedisProcess,
                                                metrics: CacheMetrics) -> None:
    blue = RedisPrefixIndex(redis_server.url, key_prefix="blue:", metrics=metrics)
    green = RedisPrefixIndex(redis_server.url, key_prefix="green:", metrics=metrics)
    await blue.register("a", 1, 100)
    await blue.replace("a", 1, H[:3])
    assert await green.score(H) == {}
    assert await green.heartbeat("a", 1) is False
    assert all(key.startswith(b"blue:") for key in redis_client.keys("*"))
    await blue.close()
    await green.close()
