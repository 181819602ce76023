"""History summaries in the cache service (GetHistorySummary, ClaimHistorySummary,
PutHistorySummary) over real gRPC, with the memory and the Redis store."""

from __future__ import annotations

import hashlib
import grpc
import pytest
from llmesh.v1 import cache_pb2

from tests.cache.test_cache_service import Stub, store, stub

__all__ = ["store", "stub"]  # the service's fixtures, over both stores


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


async def lookup(stub: Stub, *names: str, scope: str = "t1"
                 ) -> cache_pb2.GetHistorySummaryResponse:
    return await stub.GetHistorySummary(cache_pb2.GetHistorySummaryRequest(
        cache_scope=scope, prefix_hashes=[h(n) for n in names]))


async def claim(stub: Stub, name: str, scope: str = "t1", lease: int = 0) -> bool:
    reply = await stub.ClaimHistorySummary(cache_pb2.ClaimHistorySummaryRequest(
        cache_scope=scope, prefix_hash=h(name), lease_seconds=lease))
    return reply.claimed


async def put(stub: Stub, name: str, text: str, scope: str = "t1") -> bool:
    reply = await stub.PutHistorySummary(cache_pb2.PutHistorySummaryRequest(
        cache_scope=scope, prefix_hash=h(name), summary=cache_pb2.HistorySummary(
            text=text, summarized_messages=4, summarized_tokens=100, summary_tokens=20,
            model="m")))
    return reply.stored


async def test_longest_prefix_wins_and_claims_show_as_pending(stub: Stub) -> None:
    assert (await lookup(stub, "a", "b", "c")).found is False
    assert await claim(stub, "b") is True
    assert await claim(stub, "b") is False  # a second router: held
    miss = await lookup(stub, "a", "b", "c")
    assert (miss.found, miss.pending) == (False, True)
    assert await put(stub, "b", "summary of a+b") is True
    assert await claim(stub, "b") is False  # stored: nothing to write
    hit = await lookup(stub, "a", "b", "c")
    assert (hit.found, hit.prefix_index, hit.pending) == (True, 1, False)
    assert hit.summary.text == "summary of a+b" and hit.summary.summarized_messages == 4
    assert await put(stub, "a", "older") is True
    assert (await lookup(stub, "a", "b", "c")).prefix_index == 1  # the longest
    assert await claim(stub, "c") is True
    assert (await lookup(stub, "a", "b", "c")).pending is True


async def test_scopes_do_not_meet(stub: Stub) -> None:
    assert await put(stub, "a", "tenant one's") is True
    assert (await lookup(stub, "a", scope="t2")).found is False
    assert await claim(stub, "a", scope="t2") is True


async def test_bad_hash_is_invalid_argument(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetHistorySummary(cache_pb2.GetHistorySummaryRequest(
            prefix_hashes=[h("a"), b"short"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefix_hashes[1]" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ClaimHistorySummary(cache_pb2.ClaimHistorySummaryRequest(prefix_hash=b"x"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
