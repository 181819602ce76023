"""RedisStore against a real server: get/put/TTL, fail-fast start, outage and recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from services.cache.metrics import CacheMetrics
from services.cache.store import RedisStore, StoreUnavailableError, StoreWrite, redact_url
from tests.cache.helpers import FakeClock, sample
from tests.cache.redis_server import RedisProcess, start_redis_server


async def test_put_then_get_round_trips_bytes(redis_store: RedisStore,
                                              redis_client: redis.Redis) -> None:
    value = bytes(range(256)) * 4
    assert await redis_store.put("llmesh:test:a", value, 60) is True
    assert await redis_store.get("llmesh:test:a") == value
    assert redis_client.get("llmesh:test:a") == value
    assert await redis_store.get("llmesh:test:missing") is None


async def test_put_sets_the_ttl_in_redis(redis_store: RedisStore,
                                         redis_client: redis.Redis) -> None:
    await redis_store.put("llmesh:test:ttl", b"v", 3600)
    assert 3_590_000 < redis_client.pttl("llmesh:test:ttl") <= 3_600_000
    await redis_store.put("llmesh:test:ttl", b"v2", 7)  # overwrite replaces the TTL
    assert 6_000 < redis_client.pttl("llmesh:test:ttl") <= 7_000


async def test_entries_expire(redis_store: RedisStore) -> None:
    await redis_store.put("llmesh:test:short", b"v", 0.05)
    assert await redis_store.get("llmesh:test:short") == b"v"
    await asyncio.sleep(0.15)
    assert await redis_store.get("llmesh:test:short") is None


async def test_ttl_must_be_positive(redis_store: RedisStore) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        await redis_store.put("k", b"v", 0)


async def test_start_fails_fast_when_redis_is_unreachable(metrics: CacheMetrics) -> None:
    server = start_redis_server()
    url = server.url
    server.stop()  # the port is now closed
    store = RedisStore(url, timeout_seconds=0.5, metrics=metrics)
    started = time.perf_counter()
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis at redis://127.0.0.1"):
        await store.start()
    assert time.perf_counter() - started < 1.0
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 0
    await store.close()


def test_passwords_are_redacted() -> None:
    assert redact_url("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


@pytest.fixture
def own_server() -> Iterator[RedisProcess]:
    """A server of this test's own, which it may kill and restart."""
    server = start_redis_server()
    yield server
    server.stop()


async def test_outage_degrades_to_miss_then_recovers(own_server: RedisProcess,
                                                     metrics: CacheMetrics) -> None:
    clock = FakeClock()
    store = RedisStore(own_server.url, retry_interval_seconds=5.0, metrics=metrics, clock=clock)
    await store.start()
    assert await store.put("k", b"v", 60) is True
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 1

    own_server.kill()
    assert await store.get("k") is None  # stale pooled connection, one retry, refused
    assert await store.put("k", b"v", 60) is False  # within the pause: not even tried
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="get") == 1
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="put") == 0
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 0

    clock.advance(5.0)
    assert await store.put("k", b"v", 60) is False  # tried again, still down
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="put") == 1

    own_server.restart()
    assert await store.get("k") is None  # pause not over: still answers miss at once
    clock.advance(5.0)
    assert await store.get("k") is None  # reached Redis: a real miss (restart lost data)
    assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 1
    assert await store.put("k", b"again", 60) is True
    assert await store.get("k") == b"again"
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="get") == 1
    await store.close()


async def test_a_hung_redis_costs_at_most_the_timeout(metrics: CacheMetrics,
                                                      own_server: RedisProcess) -> None:
    store = RedisStore(own_server.url, timeout_seconds=0.2, metrics=metrics)
    await store.start()
    client = redis.Redis.from_url(own_server.url)
    client.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # the server stops answering
    started = time.perf_counter()
    assert await store.get("k") is None
    elapsed = time.perf_counter() - started
    assert 0.15 < elapsed < 0.5
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="get") == 1
    client.close()
    await store.close()


def reads_processed(client: redis.Redis) -> int:
    """The server's socket reads so far (each ``INFO`` call costs one)."""
    return int(client.info("stats")["total_reads_processed"])


async def test_put_many_is_one_pipeline_with_each_writes_ttl_and_result(
        redis_store: RedisStore, redis_client: redis.Redis) -> None:
    writes = [StoreWrite(f"llmesh:test:many:{i}", b"v%d" % i, 60 + i) for i in range(64)]
    writes.append(StoreWrite("llmesh:test:many:0", b"last", 7))  # a later write of a key wins
    before = reads_processed(redis_client)
    assert await redis_store.put_many(writes) == [True] * 65
    # 65 SETs in one round trip (a few socket reads), not one read each
    assert reads_processed(redis_client) - before <= 6
    assert redis_client.get("llmesh:test:many:63") == b"v63"
    assert 122_000 < redis_client.pttl("llmesh:test:many:63") <= 123_000
    assert redis_client.get("llmesh:test:many:0") == b"last"
    assert 6_000 < redis_client.pttl("llmesh:test:many:0") <= 7_000
    assert await redis_store.put_many([]) == []


async def test_put_many_refuses_a_bad_ttl_before_writing_anything(
        redis_store: RedisStore, redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="ttl_seconds"):
        await redis_store.put_many([StoreWrite("llmesh:test:ok", b"v", 60),
                                    StoreWrite("llmesh:test:bad", b"v", 0)])
    assert redis_client.get("llmesh:test:ok") is None


async def test_put_many_during_an_outage_is_all_false_and_one_error(
        own_server: RedisProcess, metrics: CacheMetrics) -> None:
    store = RedisStore(own_server.url, metrics=metrics)
    await store.start()
    own_server.kill()
    assert await store.put_many([StoreWrite("a", b"1", 60), StoreWrite("b", b"2", 60)]) == [
        False, False]
    assert sample(metrics, "llmesh:cache_backend_errors_total", backend="redis",
                  operation="put") == 1
    await store.close()
