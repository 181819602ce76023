"""The router's response-cache stores on one long-lived PutCachedResponses call
(:mod:`services.router.cache_stores`), against the real CacheService on
loopback: batched, acknowledged, and through a cache restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2, cache_pb2_grpc, generation_pb2
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore
from services.common.sampling import FinishReason, SamplingOptions
from services.common.wire.cache import CachedResponse, CacheKey
from services.router import cache_stores
from services.router.clients import CacheClient
from tests.router.test_router_service import collect, greedy, make_mesh, text_of, wait_for

MODEL = "fake-model"


def key_of(i: int) -> CacheKey:
    return CacheKey(MODEL, (i, i + 1), SamplingOptions())


ANSWER = CachedResponse((5, 6), "ok", FinishReason.STOP)


def cache_metric(cache: CacheService, name: str, **labels: str) -> float:
    return cache._metrics.registry.get_sample_value(name, labels) or 0.0


def put_messages(cache: CacheService) -> float:
    """PutCachedResponses messages the cache answered."""
    return cache_metric(cache, "llmesh:cache_request_duration_seconds_count",
                        method="PutCachedResponses")


def unary_puts(cache: CacheService) -> float:
    return cache_metric(cache, "llmesh:cache_request_duration_seconds_count",
                        method="PutCachedResponse")


def real_cache(store: MemoryStore | None = None) -> CacheService:
    return CacheService(store if store is not None else MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))


class GatedStore(MemoryStore):
    """A memory store whose puts wait until ``gate`` is set (a slow backend)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0  # puts waiting at the gate

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        self.waiting += 1
        await self.gate.wait()
        return await super().put(key, value, ttl_seconds)


@contextlib.asynccontextmanager
async def cache_on(port: int, cache: CacheService) -> AsyncIterator[str]:
    """Serves ``cache`` on ``port`` (0: any free one); yields its target."""
    server = grpc.aio.server()
    cache_pb2_grpc.add_CacheServiceServicer_to_server(cache, server)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await cache.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await cache.close()


def stores(mesh, outcome: str) -> float:
    return mesh.metric("llmesh:router_response_cache_stores_total", model_name=MODEL,
                       outcome=outcome)


async def test_a_store_travels_on_the_stream_and_an_identical_request_right_after_hits():
    cache = real_cache()
    request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy())
    async with make_mesh(cache_servicer=cache) as mesh:
        first = await collect(mesh.stub.Generate(request))
        second = await collect(mesh.stub.Generate(request))  # no wait: the store may be in flight
        assert len(mesh.engines[0].log.starts) == 1
        assert second[-1].cached is True and text_of(second) == text_of(first)
        assert put_messages(cache) == 1 and unary_puts(cache) == 0
        assert stores(mesh, "stored") == 1


async def test_a_burst_of_100_stores_goes_in_few_messages_each_acknowledged():
    cache = real_cache()
    async with make_mesh(cache_servicer=cache) as mesh:
        client = mesh.router._cache
        results = await asyncio.gather(*(
            asyncio.ensure_future(client.put(key_of(i), ANSWER, request_id=f"r{i}"))
            for i in range(100)))
        assert results == [True] * 100
        hits = [await client.get(key_of(i), request_id="g", deadline=None) for i in (0, 99)]
        assert hits == [ANSWER, ANSWER]
        assert cache_metric(cache, "llmesh:response_cache_stores_total") == 100
        assert 1 <= put_messages(cache) <= 3 and unary_puts(cache) == 0
        assert stores(mesh, "stored") == 100


async def test_a_backlog_of_long_responses_is_split_under_the_message_limit():
    """QA: 1,000 stores of 70 KB in one write made one ~70 MB message, over
    gRPC's 64 MiB limit: the write failed and all 1,000 were lost. Messages
    are bounded by bytes too, so each store lands."""
    cache = real_cache()
    long_answer = CachedResponse(tuple(range(10)), "x" * 70_000, FinishReason.LENGTH)
    # The router and the cache share this process's loop: 70 MB through both
    # leaves gaps of 0.1-0.2 s between answers on a loaded 2-core machine, so
    # the stores' answer timeout (the cache timeout) is set well above that.
    async with make_mesh(cache_servicer=cache, cache_timeout=5.0) as mesh:
        client = mesh.router._cache
        results = await asyncio.gather(*(
            asyncio.ensure_future(client.put(key_of(i), long_answer, request_id=f"r{i}"))
            for i in range(1000)))
        assert results == [True] * 1000
        assert await client.get(key_of(999), request_id="g", deadline=None) == long_answer
        assert put_messages(cache) >= 70_000_000 // (4 << 20)
        assert stores(mesh, "stored") == 1000 and stores(mesh, "failed") == 0


class StalledStore(GatedStore):
    """A memory store whose puts and gets both wait for ``gate`` (a stalled cache)."""

    async def get(self, key: str) -> bytes | None:
        await self.gate.wait()
        return await super().get(key)


async def test_a_lookup_waiting_for_its_pending_store_spends_one_cache_budget():
    """QA: with the cache stalled (SIGSTOP), a repeated request waited 0.5 s for
    the pending store of its key, then 0.5 s more for its own lookup. The wait
    and the lookup now share one budget (the router's cache timeout) and the
    request is answered by the engine after it."""
    stalled = StalledStore()
    request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy())
    async with make_mesh(cache_servicer=real_cache(stalled), cache_timeout=0.4) as mesh:
        first = await collect(mesh.stub.Generate(request))  # its lookup times out: 0.4 s
        await wait_for(lambda: stalled.waiting == 1)  # its store is stuck at the cache
        started = time.monotonic()
        second = await collect(mesh.stub.Generate(request))
        took = time.monotonic() - started
        assert second[-1].cached is False and text_of(second) == text_of(first)
        # one budget of 0.4 s, not 0.5 s of waiting and then 0.4 s (0.9 s before)
        assert took < 0.7, took
        stalled.gate.set()


async def test_a_cache_restart_loses_only_the_stores_in_flight_and_recovers():
    gated = GatedStore()
    async with make_mesh(cache_servicer=real_cache(gated)) as mesh:
        client = mesh.router._cache
        port = int(client.target.rsplit(":", 1)[1])
        lost = asyncio.ensure_future(client.put(key_of(1), ANSWER, request_id="lost"))
        await wait_for(lambda: gated.waiting == 1)  # at the cache, not answered
        await mesh.servers[1].stop(None)  # the cache goes away with the store in flight
        assert await asyncio.wait_for(lost, 3) is False
        # While it is down a request is served as usual; its store waits for the cache.
        request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy())
        started = time.monotonic()
        first = await collect(mesh.stub.Generate(request))
        assert time.monotonic() - started < 2.0 and first[-1].cached is False
        kept = asyncio.ensure_future(client.put(key_of(2), ANSWER, request_id="kept"))
        # Over twice the cache timeout (0.5 s): a store's answer timeout runs
        # only while the channel is connected, so it waits for the cache.
        await asyncio.sleep(1.2)
        assert not kept.done()
        restarted = real_cache()
        async with cache_on(port, restarted):
            assert await asyncio.wait_for(kept, 5) is True
            await wait_for(lambda: stores(mesh, "stored") == 2, timeout=5)
            again = await collect(mesh.stub.Generate(request))
            assert again[-1].cached is True and text_of(again) == text_of(first)
            assert await client.get(key_of(1), request_id="g", deadline=None) is None
        assert stores(mesh, "failed") == 1 and stores(mesh, "dropped") == 0


async def test_stores_beyond_the_bound_are_dropped_and_counted_never_queued():
    gated = GatedStore()
    outcomes: list[tuple[str, str]] = []
    async with cache_on(0, real_cache(gated)) as target:
        client = CacheClient(target, max_pending_stores=2,
                             on_store=lambda model, outcome: outcomes.append((model, outcome)))
        try:
            held = [client.put(key_of(i), ANSWER, request_id=f"r{i}") for i in range(2)]
            dropped = client.put(key_of(9), ANSWER, request_id="r9")
            assert dropped.done() and dropped.result() is False
            assert outcomes == [(MODEL, "dropped")] and client.stores.pending == 2
            gated.gate.set()
            assert await asyncio.gather(*held) == [True, True]
            assert outcomes[1:] == [(MODEL, "stored")] * 2 and client.stores.pending == 0
        finally:
            await client.close()


class CacheWithoutTheStream(CacheService):
    """A cache service from before PutCachedResponses (a rolling upgrade)."""

    PutCachedResponses = cache_pb2_grpc.CacheServiceServicer.PutCachedResponses


async def test_a_cache_without_the_stream_gets_unary_stores():
    old = CacheWithoutTheStream(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    async with make_mesh(cache_servicer=old) as mesh:
        client = mesh.router._cache
        assert await client.put(key_of(1), ANSWER, request_id="r1") is False  # on the call
        assert await client.put(key_of(2), ANSWER, request_id="r2") is True  # unary from now
        assert await client.get(key_of(2), request_id="g", deadline=None) == ANSWER
        assert unary_puts(old) == 1
        assert stores(mesh, "failed") == 1 and stores(mesh, "stored") == 1


@contextlib.asynccontextmanager
async def client_of(cache, *, timeout: float, store_timeout: float | None = None
                    ) -> AsyncIterator[tuple[CacheClient, list[str]]]:
    """``cache`` served on a free port and a connected router cache client of
    it with the ``timeout`` (and ``store_timeout``: None, the client's
    default); yields the client and its stores' outcomes."""
    outcomes: list[str] = []
    async with cache_on(0, cache) as target:
        client = CacheClient(target, timeout=timeout, store_timeout=store_timeout,
                             on_store=lambda model, outcome: outcomes.append(outcome))
        try:
            await client.wait_until_serving(10)
            yield client, outcomes
        finally:
            await client.close()


class StallsItsFirstStoreCall(CacheService):
    """Accepts its first PutCachedResponses call and never answers on it (a
    wedged cache: the call stays open, nothing comes back); serves the next
    calls as the real service does."""

    def __init__(self) -> None:
        super().__init__(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
        self.calls = 0
        self.stalled_call_ended = asyncio.Event()

    async def PutCachedResponses(self, request_iterator, context):  # noqa: N802
        self.calls += 1
        if self.calls > 1:
            async for answer in super().PutCachedResponses(request_iterator, context):
                yield answer
            return
        try:
            await asyncio.Event().wait()  # until the router gives the call up
        finally:
            self.stalled_call_ended.set()
        yield cache_pb2.PutCachedResponsesResponse()  # never reached


async def test_stores_on_a_stalled_call_time_out_counted_and_the_next_store_opens_a_new_call():
    """QA: a cache that accepted PutCachedResponses and never answered left its
    stores pending for ever (never resolved, never counted). Each store now
    resolves False once unanswered for the client's timeout on a connected
    channel (``timed_out``; the others on the given-up call ``failed``), and
    the next store goes to a new call."""
    stalled = StallsItsFirstStoreCall()
    async with client_of(stalled, timeout=1.0, store_timeout=1.0) as (client, outcomes):
        first = client.put(key_of(1), ANSWER, request_id="r1")
        second = client.put(key_of(2), ANSWER, request_id="r2")
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [False, False]
        assert sorted(outcomes) == ["failed", "timed_out"]
        await asyncio.wait_for(stalled.stalled_call_ended.wait(), 10)  # given up
        assert await asyncio.wait_for(client.put(key_of(3), ANSWER, request_id="r3"),
                                      10) is True
        assert stalled.calls == 2 and outcomes[2:] == ["stored"]
        assert await client.get(key_of(3), request_id="g", deadline=None) == ANSWER
        assert client.stores.pending == 0


class Replicas(cache_pb2_grpc.CacheServiceServicer):
    """One address whose calls go to ``current``: a cache that drains and the
    one that takes its place (a restart, or another replica behind a
    Kubernetes Service), without a transport in between to time."""

    def __init__(self, *caches: CacheService) -> None:
        self.caches = tuple(dict.fromkeys(caches))
        self.current = caches[0]
        self.store_calls = {id(cache): 0 for cache in caches}

    async def start(self) -> None:
        for cache in self.caches:
            await cache.start()

    async def close(self) -> None:
        for cache in self.caches:
            await cache.close()

    async def PutCachedResponses(self, request_iterator, context):  # noqa: N802
        cache = self.current
        self.store_calls[id(cache)] += 1
        async for answer in cache.PutCachedResponses(request_iterator, context):
            yield answer

    async def GetCachedResponse(self, request, context):  # noqa: N802
        return await self.current.GetCachedResponse(request, context)


class RefusesWithInternal(CacheService):
    """Ends each PutCachedResponses call INTERNAL "Internal error from Core"
    before reading it: how the router sees a draining cache's refusal when its
    first write races it (seen with real processes)."""

    async def PutCachedResponses(self, request_iterator, context):  # noqa: N802
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        yield cache_pb2.PutCachedResponsesResponse()  # never reached


@pytest.mark.parametrize("refusal", ["draining", "internal"])
async def test_stores_made_while_the_cache_drains_go_to_the_next_cache(refusal: str):
    """QA: a draining cache refuses each new PutCachedResponses call
    (UNAVAILABLE), so every store made during its drain (up to
    ``--drain-seconds``) was lost. The store in flight when the drain ends the
    call still resolves False at once (``failed``, not at its timeout); a store
    made after waits through the refusals (it was never read), whatever
    status they end with, and lands on the cache that takes over, logged
    without a warning that claims it failed."""
    gated = GatedStore()
    draining, successor = real_cache(gated), real_cache()
    refuser = draining if refusal == "draining" else RefusesWithInternal(
        MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    replicas = Replicas(draining, refuser, successor)
    async with client_of(replicas, timeout=5.0) as (client, outcomes):
        in_flight = client.put(key_of(1), ANSWER, request_id="in-flight")
        await wait_for(lambda: gated.waiting == 1, timeout=10)  # at the cache's store
        with structlog.testing.capture_logs() as logs:
            await draining.drain()
            assert await asyncio.wait_for(in_flight, 10) is False
            assert outcomes == ["failed"]  # at the drain, not at the 5 s timeout
            replicas.current = refuser
            refused = replicas.store_calls[id(refuser)]
            later = client.put(key_of(2), ANSWER, request_id="later")
            await wait_for(lambda: later.done()
                           or replicas.store_calls[id(refuser)] >= refused + 2,
                           timeout=10)  # refused twice
            assert not later.done()
            replicas.current = successor
            assert await asyncio.wait_for(later, 10) is True
        assert outcomes == ["failed", "stored"]
        assert await client.get(key_of(2), request_id="g", deadline=None) == ANSWER
        assert replicas.store_calls[id(successor)] == 1
    # Only the store in flight at the drain failed: the refused calls' stores,
    # sent again, are no mux_call_failed warning (cache_store_call_refused).
    failed = [line for line in logs if line["event"] == "mux_call_failed"]
    assert [line["open_streams"] for line in failed] == [1]
    assert sum(line["event"] == "cache_store_call_refused" for line in logs) >= 2


class SlowStore(MemoryStore):
    """A memory store whose puts take ``delay_s`` (Redis slow for about the
    cache's own timeout)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        await asyncio.sleep(self.delay_s)
        return await super().put(key, value, ttl_seconds)


async def test_a_store_the_cache_answers_after_a_second_is_stored_with_the_default_timeouts():
    """QA: the router's store answer timeout was its cache timeout (0.5 s),
    the cache's Redis timeout too: a Redis slow for 0.5 s made the router give
    up a healthy call (``timed_out``, its other stores ``failed``). The store
    timeout is stall detection, at least 5 s: a store answered after ~1 s is
    ``stored``."""
    async with client_of(real_cache(SlowStore(1.0)), timeout=0.5) as (client, outcomes):
        assert client.stores.timeout_s >= 5.0
        slow = [client.put(key_of(i), ANSWER, request_id=f"r{i}") for i in range(2)]
        assert await asyncio.wait_for(asyncio.gather(*slow), 30) == [True, True]
        assert outcomes == ["stored", "stored"]
        assert await client.get(key_of(1), request_id="g", deadline=None) == ANSWER


class UpgradedLater(CacheService):
    """A cache from before the stream RPCs (both answer UNIMPLEMENTED, as an
    older server does) until ``upgraded`` is set: a rolling upgrade that
    puts a new cache behind the router's channel."""

    def __init__(self) -> None:
        super().__init__(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
        self.upgraded = False

    async def PutCachedResponses(self, request_iterator, context):  # noqa: N802
        if not self.upgraded:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for answer in super().PutCachedResponses(request_iterator, context):
            yield answer

    async def GetCachedResponses(self, request_iterator, context):  # noqa: N802
        if not self.upgraded:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        async for answer in super().GetCachedResponses(request_iterator, context):
            yield answer


#: A short unary period for the tests (the router's is 30 s).
SHORT_UNARY_FOR_S = 1.0


async def test_unary_stores_expire_so_an_upgraded_cache_gets_the_stream_back(monkeypatch):
    """QA: once a cache answered UNIMPLEMENTED, every store of the router's
    life was unary, the upgraded cache's stream never used again. Unary mode
    lasts ``UNARY_FOR_S``; then the next store tries the stream."""
    monkeypatch.setattr(cache_stores, "UNARY_FOR_S", SHORT_UNARY_FOR_S)
    cache = UpgradedLater()
    async with client_of(cache, timeout=5.0) as (client, outcomes):
        assert await client.put(key_of(1), ANSWER, request_id="r1") is False  # on the call
        cache.upgraded = True
        assert await client.put(key_of(2), ANSWER, request_id="r2") is True  # unary for now
        assert unary_puts(cache) == 1 and put_messages(cache) == 0
        await asyncio.sleep(SHORT_UNARY_FOR_S + 0.2)
        assert await client.put(key_of(3), ANSWER, request_id="r3") is True
        assert put_messages(cache) == 1 and unary_puts(cache) == 1
        assert outcomes == ["failed", "stored", "stored"]
