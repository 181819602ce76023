"""CacheService over real gRPC on loopback, with the memory and the Redis store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import redis
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2

from services.cache.keys import response_key
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore, RedisStore, ResponseStore
from tests.cache.helpers import make_key, make_response, sample, serve
from tests.cache.redis_server import RedisProcess, start_redis_server

Stub = cache_pb2_grpc.CacheServiceStub


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, metrics: CacheMetrics) -> ResponseStore:
    if request.param == "memory":
        return MemoryStore()
    request.getfixturevalue("redis_client")  # empties the database
    server: RedisProcess = request.getfixturevalue("redis_server")
    return RedisStore(server.url, metrics=metrics)


@pytest.fixture
async def stub(store: ResponseStore, metrics: CacheMetrics) -> AsyncIterator[Stub]:
    async with serve(CacheService(store, default_ttl_seconds=600, metrics=metrics)) as s:
        yield s


async def get(stub: Stub, key: cache_pb2.CacheKey) -> cache_pb2.GetCachedResponseResponse:
    return await stub.GetCachedResponse(cache_pb2.GetCachedResponseRequest(key=key))


async def put(stub: Stub, key: cache_pb2.CacheKey, response: cache_pb2.CachedResponse,
              ttl_seconds: int = 0) -> cache_pb2.PutCachedResponseResponse:
    return await stub.PutCachedResponse(cache_pb2.PutCachedResponseRequest(
        key=key, response=response, ttl_seconds=ttl_seconds))


async def test_miss_put_hit_round_trip(stub: Stub, metrics: CacheMetrics) -> None:
    key = make_key((10, 11, 12), max_tokens=32, stop=["\n\n"])
    response = make_response((5, 6), "ok.", common_pb2.FINISH_REASON_STOP, matched_stop="\n\n")

    miss = await get(stub, key)
    assert miss.found is False and not miss.HasField("response")
    assert (await put(stub, key, response)).stored is True
    hit = await get(stub, key)
    assert hit.found is True
    assert hit.response == response
    # Another prompt, model or max_tokens is another entry.
    assert (await get(stub, make_key((10, 11, 13), max_tokens=32, stop=["\n\n"]))).found is False
    assert (await get(stub, make_key((10, 11, 12), max_tokens=33, stop=["\n\n"]))).found is False
    assert (await get(stub, make_key((10, 11, 12), model="other", max_tokens=32,
                                     stop=["\n\n"]))).found is False

    assert sample(metrics, "llmesh:response_cache_queries_total") == 5
    assert sample(metrics, "llmesh:response_cache_hits_total") == 1
    assert sample(metrics, "llmesh:response_cache_stores_total") == 1
    assert sample(metrics, "llmesh:cache_request_duration_seconds_count",
                  method="GetCachedResponse") == 5
    assert sample(metrics, "llmesh:cache_request_duration_seconds_count",
                  method="PutCachedResponse") == 1


async def test_length_finish_is_cached_too(stub: Stub) -> None:
    key = make_key(max_tokens=2)
    response = make_response((1, 2), "ab", common_pb2.FINISH_REASON_LENGTH)
    assert (await put(stub, key, response)).stored is True
    assert (await get(stub, key)).response.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_greedy_lookup_ignores_seed_and_explicit_defaults(stub: Stub) -> None:
    await put(stub, make_key(seed=42), make_response(text="greedy"))
    hit = await get(stub, make_key(temperature=0.0, top_p=1.0, top_k=0))
    assert hit.found is True and hit.response.text == "greedy"


async def test_seeded_sampled_request_is_cached_per_seed(stub: Stub) -> None:
    key = make_key(temperature=0.8, seed=1)
    assert (await put(stub, key, make_response(text="seed 1"))).stored is True
    assert (await get(stub, key)).response.text == "seed 1"
    assert (await get(stub, make_key(temperature=0.8, seed=2))).found is False


async def test_put_of_a_sampled_request_without_seed_is_failed_precondition(
        stub: Stub, metrics: CacheMetrics) -> None:
    key = make_key(temperature=0.7)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await put(stub, key, make_response())
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "deterministic" in raised.value.details()
    assert sample(metrics, "llmesh:response_cache_stores_total") == 0


async def test_get_of_a_sampled_request_without_seed_is_a_miss_not_a_query(
        stub: Stub, metrics: CacheMetrics) -> None:
    assert (await get(stub, make_key(temperature=0.7))).found is False
    assert sample(metrics, "llmesh:response_cache_queries_total") == 0


@pytest.mark.parametrize("reason", [common_pb2.FINISH_REASON_CANCELLED,
                                    common_pb2.FINISH_REASON_ERROR,
                                    common_pb2.FINISH_REASON_UNSPECIFIED])
async def test_unfinished_responses_are_not_stored(stub: Stub, reason: int,
                                                   metrics: CacheMetrics) -> None:
    key = make_key((99, reason))
    assert (await put(stub, key, make_response(finish_reason=reason))).stored is False
    assert (await get(stub, key)).found is False
    assert sample(metrics, "llmesh:response_cache_stores_total") == 0


@pytest.mark.parametrize(("request_", "details"), [
    (cache_pb2.PutCachedResponseRequest(response=make_response()), "key: required"),
    (cache_pb2.PutCachedResponseRequest(key=make_key(prompt=()), response=make_response()),
     "key.prompt_token_ids"),
    (cache_pb2.PutCachedResponseRequest(key=make_key(top_p=1.5), response=make_response()),
     "key.sampling.top_p"),
    # QA: an empty model and a negative token id were stored and looked up before.
    (cache_pb2.PutCachedResponseRequest(key=make_key(model=""), response=make_response()),
     "key.model"),
    (cache_pb2.PutCachedResponseRequest(key=make_key(prompt=(1, -1)), response=make_response()),
     "key.prompt_token_ids: token id -1 at index 1"),
    (cache_pb2.PutCachedResponseRequest(key=make_key(prompt=(1, 2**30)), response=make_response()),
     "key.prompt_token_ids: token id 1073741824 at index 1"),
])
async def test_invalid_keys_are_invalid_argument(stub: Stub, request_: object,
                                                 details: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.PutCachedResponse(request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in raised.value.details()
    get_request = cache_pb2.GetCachedResponseRequest()
    if request_.HasField("key"):
        get_request.key.CopyFrom(request_.key)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.GetCachedResponse(get_request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_response_with_a_negative_token_id_is_invalid_argument(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await put(stub, make_key(), make_response(token_ids=(7, -2)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response.token_ids: token id -2 at index 1" in raised.value.details()
    assert (await get(stub, make_key())).found is False


async def test_ttl_of_the_request_or_the_default_reaches_redis(
        redis_server: RedisProcess, redis_client: redis.Redis, metrics: CacheMetrics) -> None:
    store = RedisStore(redis_server.url, metrics=metrics)
    async with serve(CacheService(store, default_ttl_seconds=600, metrics=metrics)) as stub:
        await put(stub, make_key((1,)), make_response(), ttl_seconds=30)
        await put(stub, make_key((2,)), make_response())
    assert 29_000 < redis_client.pttl(response_key(make_key((1,)))) <= 30_000
    assert 599_000 < redis_client.pttl(response_key(make_key((2,)))) <= 600_000
    stored = redis_client.get(response_key(make_key((2,))))
    assert cache_pb2.CachedResponse.FromString(stored) == make_response()


async def test_memory_entries_expire_by_request_ttl(metrics: CacheMetrics) -> None:
    from tests.cache.helpers import FakeClock

    clock = FakeClock()
    service = CacheService(MemoryStore(clock=clock), default_ttl_seconds=600, metrics=metrics)
    async with serve(service) as stub:
        await put(stub, make_key((1,)), make_response(), ttl_seconds=30)
        await put(stub, make_key((2,)), make_response())
        clock.advance(30)
        assert (await get(stub, make_key((1,)))).found is False
        assert (await get(stub, make_key((2,)))).found is True
        clock.advance(570)
        assert (await get(stub, make_key((2,)))).found is False


async def test_a_corrupt_entry_is_a_miss(metrics: CacheMetrics) -> None:
    store = MemoryStore()
    async with serve(CacheService(store, metrics=metrics)) as stub:
        await store.put(response_key(make_key()), b"\xff\xff\xff", 60)
        assert (await get(stub, make_key())).found is False
        assert sample(metrics, "llmesh:response_cache_hits_total") == 0


async def test_draining_service_answers_unavailable(metrics: CacheMetrics) -> None:
    service = CacheService(MemoryStore(), metrics=metrics)
    async with serve(service) as stub:
        await service.drain()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await get(stub, make_key())
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_redis_killed_mid_run_then_restarted(metrics: CacheMetrics) -> None:
    server = start_redis_server()
    try:
        store = RedisStore(server.url, retry_interval_seconds=0.05, metrics=metrics)
        async with serve(CacheService(store, metrics=metrics)) as stub:
            key = make_key((4, 5, 6))
            assert (await put(stub, key, make_response())).stored is True
            assert (await get(stub, key)).found is True

            server.kill()
            started = time.perf_counter()
            assert (await get(stub, key)).found is False
            assert (await put(stub, key, make_response())).stored is False
            assert (await get(stub, key)).found is False
            assert time.perf_counter() - started < 0.5
            assert sample(metrics, "llmesh:cache_backend_errors_total",
                          backend="redis", operation="get") >= 1
            assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 0

            server.restart()  # same port, empty
            deadline = time.monotonic() + 5.0
            while not (await put(stub, key, make_response(text="after"))).stored:
                assert time.monotonic() < deadline, "the service never reconnected"
                await asyncio.sleep(0.02)
            hit = await get(stub, key)
            assert hit.found is True and hit.response.text == "after"
            assert sample(metrics, "llmesh:cache_backend_up", backend="redis") == 1
    finally:
        server.stop()


# --------------------------------------------------------------------------- #
# PutCachedResponses: the router's stores, batched on one long-lived call


def store_entry(store_id: int, key: cache_pb2.CacheKey,
                response: cache_pb2.CachedResponse | None = None) -> cache_pb2.CachedResponseStore:
    return cache_pb2.CachedResponseStore(
        store_id=store_id, request_id=f"rid-{store_id}",
        put=cache_pb2.PutCachedResponseRequest(key=key, response=response or make_response()))


async def test_a_batch_of_stores_is_answered_in_one_message_each_by_its_own_status(
        stub: Stub, metrics: CacheMetrics) -> None:
    good, bad, sampled, cancelled = (
        make_key((1,)), make_key((2,), top_p=1.5), make_key((3,), temperature=0.8),
        make_key((4,)))
    call = stub.PutCachedResponses()
    await call.write(cache_pb2.PutCachedResponsesRequest(stores=[
        store_entry(7, good), store_entry(8, bad), store_entry(9, sampled),
        store_entry(10, cancelled, make_response(finish_reason=common_pb2.FINISH_REASON_CANCELLED)),
    ]))
    answer = await call.read()
    results = [(r.store_id, r.stored, grpc.StatusCode.OK.value[0] == r.status_code)
               for r in answer.results]
    assert results == [(7, True, True), (8, False, False), (9, False, False), (10, False, True)]
    assert answer.results[1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "key.sampling.top_p" in answer.results[1].status_message
    assert answer.results[2].status_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert (await get(stub, good)).found is True
    # The call stays open for the next batch.
    await call.write(cache_pb2.PutCachedResponsesRequest(stores=[store_entry(11, make_key((5,)))]))
    assert [r.store_id for r in (await call.read()).results] == [11]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert sample(metrics, "llmesh:response_cache_stores_total") == 2
    assert sample(metrics, "llmesh:cache_request_duration_seconds_count",
                  method="PutCachedResponses") == 2


async def test_a_store_with_an_empty_model_or_a_negative_id_is_refused_alone(
        stub: Stub, metrics: CacheMetrics) -> None:
    """QA: both were stored (stored: true) before."""
    call = stub.PutCachedResponses()
    await call.write(cache_pb2.PutCachedResponsesRequest(stores=[
        store_entry(1, make_key(model="")), store_entry(2, make_key((5, -3))),
        store_entry(3, make_key((6,)), make_response(token_ids=(-1,))),
        store_entry(4, make_key((7,))),
    ]))
    answer = await call.read()
    assert [(r.store_id, r.stored) for r in answer.results] == [
        (1, False), (2, False), (3, False), (4, True)]
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [r.status_code for r in answer.results[:3]] == [invalid] * 3
    assert "key.model" in answer.results[0].status_message
    assert "key.prompt_token_ids: token id -3" in answer.results[1].status_message
    assert "response.token_ids: token id -1" in answer.results[2].status_message
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    assert sample(metrics, "llmesh:response_cache_stores_total") == 1


async def test_a_message_of_stores_reaches_redis_in_one_round_trip(
        redis_server: RedisProcess, redis_client: redis.Redis, metrics: CacheMetrics) -> None:
    """The stores of one PutCachedResponses message were written one SET and
    one round trip each (64 socket reads by Redis for 64 stores): now one
    pipeline, each store's result as before (a refused one among them)."""
    service = CacheService(RedisStore(redis_server.url, metrics=metrics), metrics=metrics)
    async with serve(service) as stub:
        entries = [store_entry(i, make_key((i + 1,))) for i in range(64)]
        entries[5] = store_entry(5, make_key((6,), top_p=2.0))
        call = stub.PutCachedResponses()
        before = int(redis_client.info("stats")["total_reads_processed"])
        await call.write(cache_pb2.PutCachedResponsesRequest(stores=entries))
        answer = await call.read()
        reads = int(redis_client.info("stats")["total_reads_processed"]) - before
        assert reads <= 8, reads
        assert [(r.store_id, r.stored) for r in answer.results] == [
            (i, i != 5) for i in range(64)]
        assert answer.results[5].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert redis_client.get(response_key(make_key((64,)))) is not None
        assert sample(metrics, "llmesh:response_cache_stores_total") == 63
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_a_store_message_over_the_limit_ends_the_call_invalid_argument(stub: Stub) -> None:
    call = stub.PutCachedResponses()
    await call.write(cache_pb2.PutCachedResponsesRequest(
        stores=[store_entry(i, make_key((i + 1,))) for i in range(4097)]))
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stores: at most 4096" in await call.details()


async def test_a_drain_ends_open_store_calls_and_refuses_new_ones(metrics: CacheMetrics) -> None:
    service = CacheService(MemoryStore(), metrics=metrics)
    async with serve(service) as stub:
        call = stub.PutCachedResponses()
        await call.write(cache_pb2.PutCachedResponsesRequest(stores=[store_entry(1, make_key())]))
        assert (await call.read()).results[0].stored is True
        await service.drain()
        assert await call.read() is grpc.aio.EOF  # ended at once, not at the drain deadline
        assert await call.code() == grpc.StatusCode.OK
        refused = stub.PutCachedResponses()
        assert await refused.code() == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- #
# GetCachedResponses: the router's lookups on one long-lived call


def lookup(lookup_id: int, key: cache_pb2.CacheKey | None) -> cache_pb2.CachedResponseLookup:
    found = cache_pb2.CachedResponseLookup(lookup_id=lookup_id, request_id=f"rid-{lookup_id}")
    if key is not None:
        found.key.CopyFrom(key)
    return found


async def results_of(call: object, count: int) -> dict[int, cache_pb2.CachedResponseLookupResult]:
    """The next ``count`` results read from ``call``, by lookup id."""
    results: dict[int, cache_pb2.CachedResponseLookupResult] = {}
    while len(results) < count:
        answer = await call.read()  # type: ignore[attr-defined]
        assert answer is not grpc.aio.EOF
        results.update((r.lookup_id, r) for r in answer.results)
    return results


async def test_a_batch_of_lookups_is_answered_each_by_its_own_status(
        stub: Stub, metrics: CacheMetrics) -> None:
    stored, missing, sampled = make_key((1,)), make_key((2,)), make_key((3,), temperature=0.8)
    response = make_response((5, 6), "ok.", common_pb2.FINISH_REASON_STOP)
    assert (await put(stub, stored, response)).stored is True
    call = stub.GetCachedResponses()
    await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[
        lookup(7, stored), lookup(8, make_key((4,), top_p=1.5)), lookup(9, missing),
        lookup(10, sampled), lookup(11, None)]))
    results = await results_of(call, 5)
    assert results[7].found is True and results[7].response == response
    assert results[7].status_code == 0
    assert results[8].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "key.sampling.top_p" in results[8].status_message and not results[8].found
    assert results[11].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert results[11].status_message == "key: required"
    for miss in (9, 10):  # a sampled key without a seed is a miss, as on the unary call
        assert results[miss].found is False and results[miss].status_code == 0
        assert not results[miss].HasField("response")
    # The call stays open; a lookup id may be used again once answered.
    await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[lookup(7, stored)]))
    assert (await results_of(call, 1))[7].found is True
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert sample(metrics, "llmesh:response_cache_queries_total") == 3  # 7, 9 and 7 again
    assert sample(metrics, "llmesh:response_cache_hits_total") == 2
    assert sample(metrics, "llmesh:cache_request_duration_seconds_count",
                  method="GetCachedResponses") == 2
    assert sample(metrics, "llmesh:cache_request_duration_seconds_count",
                  method="GetCachedResponse") == 0


class StalledStore(MemoryStore):
    """A memory store whose gets of ``slow`` wait until ``gate`` is set."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.slow = slow
        self.gate = asyncio.Event()

    async def get(self, key: str) -> bytes | None:
        if key == self.slow:
            await self.gate.wait()
        return await super().get(key)


async def test_a_slow_lookup_holds_up_no_later_one(metrics: CacheMetrics) -> None:
    slow, fast = make_key((1,)), make_key((2,))
    store = StalledStore(response_key(slow))
    async with serve(CacheService(store, metrics=metrics)) as stub:
        call = stub.GetCachedResponses()
        await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[lookup(1, slow)]))
        await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[lookup(2, fast)]))
        assert list(await results_of(call, 1)) == [2]
        # An id still open is the caller's bug: the call ends INVALID_ARGUMENT.
        await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[lookup(1, fast)]))
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lookup_id" in await call.details()
        store.gate.set()


async def test_a_lookup_message_over_the_limit_ends_the_call_invalid_argument(
        stub: Stub) -> None:
    call = stub.GetCachedResponses()
    await call.write(cache_pb2.GetCachedResponsesRequest(
        lookups=[lookup(i, make_key((i + 1,))) for i in range(4097)]))
    assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lookups: at most 4096" in await call.details()


async def test_a_drain_ends_open_lookup_calls_and_refuses_new_ones(
        metrics: CacheMetrics) -> None:
    service = CacheService(MemoryStore(), metrics=metrics)
    async with serve(service) as stub:
        call = stub.GetCachedResponses()
        await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[lookup(1, make_key())]))
        assert (await results_of(call, 1))[1].found is False
        await service.drain()
        assert await call.read() is grpc.aio.EOF  # ended at once, not at the drain deadline
        assert await call.code() == grpc.StatusCode.OK
        refused = stub.GetCachedResponses()
        assert await refused.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_batch_of_lookups_is_one_redis_round_trip(
        redis_client: redis.Redis, redis_server: RedisProcess, metrics: CacheMetrics) -> None:
    store = RedisStore(redis_server.url, metrics=metrics)
    async with serve(CacheService(store, metrics=metrics)) as stub:
        assert (await put(stub, make_key((3,)), make_response(text="three"))).stored is True
        redis_client.config_resetstat()
        call = stub.GetCachedResponses()
        await call.write(cache_pb2.GetCachedResponsesRequest(
            lookups=[lookup(i, make_key((i,))) for i in range(1, 9)]))
        results = await results_of(call, 8)
        call.cancel()
    assert [i for i, r in sorted(results.items()) if r.found] == [3]
    assert results[3].response.text == "three"
    stats = redis_client.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
