"""The router's response-cache lookups on one long-lived GetCachedResponses
call (:mod:`services.router.cache_lookups`), against the real CacheService on
loopback: hits and misses on the call, misses (never errors) when the cache
stalls, restarts or is older than the call."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2, cache_pb2_grpc, generation_pb2
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore
from services.common.wire.cache import CacheKey
from services.router import cache_stores
from services.router.clients import CacheClient
from tests.router.test_router_cache_stores import (
    ANSWER,
    SHORT_UNARY_FOR_S,
    StalledStore,
    UpgradedLater,
    cache_metric,
    cache_on,
    client_of,
    key_of,
    real_cache,
)
from tests.router.test_router_service import collect, greedy, make_mesh, text_of, wait_for


def handled(cache: CacheService, method: str) -> float:
    """``method``'s handler runs at the cache (a GetCachedResponses message
    counts once, whatever lookups it carries)."""
    return cache_metric(cache, "llmesh:cache_request_duration_seconds_count", method=method)


def lookup_messages(cache: CacheService) -> float:
    return handled(cache, "GetCachedResponses")


def unary_gets(cache: CacheService) -> float:
    return handled(cache, "GetCachedResponse")


async def test_lookups_ride_the_call_and_a_repeat_is_replayed():
    """Fails on the old code: each lookup was a unary GetCachedResponse."""
    cache = real_cache()
    request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy())
    async with make_mesh(cache_servicer=cache) as mesh:
        first = await collect(mesh.stub.Generate(request))
        second = await collect(mesh.stub.Generate(request))
        assert first[-1].cached is False
        assert second[-1].cached is True and text_of(second) == text_of(first)
        assert len(mesh.engines[0].log.starts) == 1
        assert lookup_messages(cache) == 2 and unary_gets(cache) == 0
        assert cache_metric(cache, "llmesh:response_cache_hits_total") == 1


async def test_concurrent_lookups_share_one_call_each_answered():
    cache = real_cache()
    async with cache_on(0, cache) as target:
        client = CacheClient(target)
        try:
            assert await client.put(key_of(7), ANSWER, request_id="p") is True
            found = await asyncio.gather(*(
                client.get(key_of(i), request_id=f"g{i}", deadline=None) for i in range(50)))
            assert found == [ANSWER if i == 7 else None for i in range(50)]
            assert 1 <= lookup_messages(cache) <= 50 and unary_gets(cache) == 0
            assert client.lookups.open_lookups == 0
        finally:
            await client.close()


async def test_a_stalled_lookup_misses_within_its_budget_and_the_call_goes_on():
    stalled = StalledStore()
    async with cache_on(0, real_cache(stalled)) as target:
        client = CacheClient(target, timeout=0.3)
        patient = CacheClient(target, timeout=30.0)
        try:
            started = time.monotonic()
            assert await client.get(key_of(1), request_id="g", deadline=None) is None
            assert 0.25 <= time.monotonic() - started < 5.0
            # The client's deadline, when nearer than the cache's budget, bounds it.
            started = time.monotonic()
            assert await patient.get(key_of(1), request_id="g",
                                     deadline=started + 0.2) is None
            assert 0.15 <= time.monotonic() - started < 5.0
            stalled.gate.set()  # the late results are dropped; the call serves on
            assert await client.put(key_of(2), ANSWER, request_id="p") is True
            assert await client.get(key_of(2), request_id="g", deadline=None) == ANSWER
            assert client.lookups.open_lookups == 0 and patient.lookups.open_lookups == 0
        finally:
            await client.close()
            await patient.close()


async def test_a_cache_restart_makes_lookups_miss_then_the_call_is_reopened():
    async with make_mesh(cache_servicer=real_cache()) as mesh:
        client = mesh.router._cache
        port = int(client.target.rsplit(":", 1)[1])
        assert await client.get(key_of(1), request_id="g", deadline=None) is None
        await mesh.servers[1].stop(None)  # the cache goes away
        request = generation_pb2.GenerateRequest(prompt="q", sampling=greedy())
        started = time.monotonic()
        first = await collect(mesh.stub.Generate(request))  # a miss, not an error
        assert time.monotonic() - started < 2.0 and first[-1].cached is False
        assert await client.get(key_of(1), request_id="g", deadline=None) is None
        restarted = real_cache()
        async with cache_on(port, restarted):
            assert await client.put(key_of(3), ANSWER, request_id="p") is True

            async def hit() -> bool:
                return await client.get(key_of(3), request_id="g", deadline=None) == ANSWER

            deadline = time.monotonic() + 5.0
            while not await hit():  # unary during the backoff, then a new call
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.1)  # past the longest backoff
            assert await hit()
            assert lookup_messages(restarted) >= 1


class CacheWithoutTheLookupStream(CacheService):
    """A cache service from before GetCachedResponses (a rolling upgrade)."""

    GetCachedResponses = cache_pb2_grpc.CacheServiceServicer.GetCachedResponses


async def test_a_cache_without_the_lookup_stream_is_looked_up_unary_from_the_first():
    old = CacheWithoutTheLookupStream(MemoryStore(),
                                      metrics=CacheMetrics.create(CollectorRegistry()))
    async with make_mesh(cache_servicer=old) as mesh:
        client = mesh.router._cache
        assert await client.put(key_of(1), ANSWER, request_id="p") is True
        # The first lookup finds it too: retried unary once the call says UNIMPLEMENTED.
        assert await client.get(key_of(1), request_id="g1", deadline=None) == ANSWER
        assert await client.get(key_of(1), request_id="g2", deadline=None) == ANSWER
        assert unary_gets(old) == 2


async def put_unary(client: CacheClient, key: CacheKey) -> None:
    """Stores :data:`ANSWER` under ``key`` by a unary ``PutCachedResponse``."""
    reply = await client.stub.PutCachedResponse(
        cache_pb2.PutCachedResponseRequest(key=key.to_pb(), response=ANSWER.to_pb()),
        timeout=30)
    assert reply.stored


@contextlib.asynccontextmanager
async def old_cache_process() -> AsyncIterator[str]:
    """:mod:`tests.router.old_cache_server` in a process of its own; yields
    its target."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.router.old_cache_server",
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        async with asyncio.timeout(60):
            port = int(await process.stdout.readline())
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        await process.wait()


async def test_every_fresh_routers_first_lookup_hits_an_older_cache_in_another_process():
    """QA: against a cache without GetCachedResponses in another process, a
    fresh router's first lookup missed about one time in three: its first
    write raced the UNIMPLEMENTED and the call ended "INTERNAL: Internal
    error from Core", so the lookup was not retried unary. A lookup whose call
    broke, for whatever reason, is now asked unary within its budget."""
    async with old_cache_process() as target:
        writer = CacheClient(target)
        try:
            await put_unary(writer, key_of(1))
        finally:
            await writer.close()
        hits = []
        for i in range(20):
            client = CacheClient(target, timeout=5.0)  # a fresh channel: the first write races
            try:
                hits.append(await client.get(key_of(1), request_id=f"g{i}",
                                             deadline=None) == ANSWER)
            finally:
                await client.close()
        assert hits == [True] * 20


class RefusesTheLookupCall(CacheService):
    """Ends each GetCachedResponses call INTERNAL "Internal error from Core"
    before reading it (how a call racing a refusal can end), the unary
    lookup served as usual."""

    async def GetCachedResponses(self, request_iterator, context):  # noqa: N802
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        yield cache_pb2.GetCachedResponsesResponse()  # never reached


async def test_a_lookup_whose_call_breaks_is_asked_unary_within_its_budget():
    cache = RefusesTheLookupCall(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    async with client_of(cache, timeout=5.0) as (client, _):
        await put_unary(client, key_of(1))
        assert await client.get(key_of(1), request_id="g1", deadline=None) == ANSWER
        assert await client.get(key_of(2), request_id="g2", deadline=None) is None
        assert unary_gets(cache) >= 1


async def test_unary_lookups_expire_so_an_upgraded_cache_gets_the_call_back(monkeypatch):
    """QA: once a cache answered UNIMPLEMENTED, every lookup of the router's
    life was unary. Unary mode lasts ``UNARY_FOR_S``; then the next lookup
    tries the call again."""
    monkeypatch.setattr(cache_stores, "UNARY_FOR_S", SHORT_UNARY_FOR_S)
    cache = UpgradedLater()
    async with client_of(cache, timeout=5.0) as (client, _):
        await put_unary(client, key_of(1))
        assert await client.get(key_of(1), request_id="g1", deadline=None) == ANSWER
        cache.upgraded = True
        assert await client.get(key_of(1), request_id="g2", deadline=None) == ANSWER
        assert unary_gets(cache) == 2 and lookup_messages(cache) == 0  # unary for now
        await asyncio.sleep(SHORT_UNARY_FOR_S + 0.2)
        assert await client.get(key_of(1), request_id="g3", deadline=None) == ANSWER
        assert lookup_messages(cache) == 1 and unary_gets(cache) == 2
