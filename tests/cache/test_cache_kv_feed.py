"""CacheService.PublishKvEvents and ScorePrefix over real gRPC on loopback, with
the memory and the Redis prefix index: a publisher's hello, snapshot and
events land in the index, a bad stream gets a precise status, a stale
publisher is refused, the call's end drops the replica, and a Redis restart
asks the publisher for a snapshot."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import grpc
import pytest

from llmesh.v1 import cache_pb2, cache_pb2_grpc
from services.cache.metrics import CacheMetrics
from services.cache.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex
from services.cache.service import CacheService
from services.cache.store import MemoryStore
from tests.cache.helpers import sample, serve
from tests.cache.redis_server import RedisProcess, start_redis_server

Stub = cache_pb2_grpc.CacheServiceStub


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def hello(replica: str = "r0", epoch: int = 10, capacity: int = 100
          ) -> cache_pb2.PublishKvEventsRequest:
    return cache_pb2.PublishKvEventsRequest(
        hello=cache_pb2.KvEventsHello(replica_id=replica, epoch=epoch, model="m",
                                      block_size=16, capacity_blocks=capacity),
        snapshot=cache_pb2.KvSnapshot(block_hashes=[h(0), h(1)]))


def stored(*ids: int) -> cache_pb2.PublishKvEventsRequest:
    return cache_pb2.PublishKvEventsRequest(events=[cache_pb2.KvEvent(
        stored=cache_pb2.KvBlocksStored(block_hashes=[h(i) for i in ids]))])


def removed(*ids: int) -> cache_pb2.PublishKvEventsRequest:
    return cache_pb2.PublishKvEventsRequest(events=[cache_pb2.KvEvent(
        removed=cache_pb2.KvBlocksRemoved(block_hashes=[h(i) for i in ids]))])


class Publisher:
    """One PublishKvEvents call the test writes to and reads from."""

    def __init__(self, stub: Stub) -> None:
        self.queue: asyncio.Queue[cache_pb2.PublishKvEventsRequest | None] = asyncio.Queue()
        self.call = stub.PublishKvEvents(self._messages())

    async def _messages(self) -> AsyncIterator[cache_pb2.PublishKvEventsRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    def send(self, message: cache_pb2.PublishKvEventsRequest) -> None:
        self.queue.put_nowait(message)


async def scores(stub: Stub, *ids: int) -> dict[str, int]:
    reply = await stub.ScorePrefix(cache_pb2.ScorePrefixRequest(block_hashes=[h(i) for i in ids]))
    return {s.replica_id: s.matched_blocks for s in reply.scores}


async def until(stub: Stub, ids: tuple[int, ...], expected: dict[str, int],
                timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (got := await scores(stub, *ids)) != expected:
        assert loop.time() < deadline, f"{got} != {expected}"
        await asyncio.sleep(0.02)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest, metrics: CacheMetrics) -> PrefixIndex:
    if request.param == "memory":
        return MemoryPrefixIndex(metrics=metrics)
    request.getfixturevalue("redis_client")  # empties the database
    server: RedisProcess = request.getfixturevalue("redis_server")
    return RedisPrefixIndex(server.url, metrics=metrics)


@pytest.fixture
async def stub(index: PrefixIndex, metrics: CacheMetrics) -> AsyncIterator[Stub]:
    async with serve(CacheService(MemoryStore(), metrics=metrics, index=index)) as s:
        yield s


async def test_snapshot_and_events_land_in_the_index(stub: Stub, metrics: CacheMetrics) -> None:
    publisher = Publisher(stub)
    publisher.send(hello())
    await until(stub, (0, 1, 2), {"r0": 2})
    publisher.send(stored(2, 3))
    await until(stub, (0, 1, 2, 3), {"r0": 4})
    publisher.send(removed(1))
    await until(stub, (0, 1, 2, 3), {"r0": 1})
    assert sample(metrics, "llmesh:kv_events_received_total", replica="r0") == 2
    publisher.send(cache_pb2.PublishKvEventsRequest(
        events=[cache_pb2.KvEvent(cleared=cache_pb2.KvAllBlocksCleared())]))
    await until(stub, (0,), {})


async def test_offload_tier_blocks_are_scored_after_the_pool_run(stub: Stub) -> None:
    """An engine with a KV offload tier: its hello's tier capacity widens the
    index's room, its snapshot's and events' offloaded hashes answer as
    ``offloaded_blocks`` after the pool's ``matched_blocks``."""
    offload = cache_pb2.KV_MEDIUM_OFFLOAD
    publisher = Publisher(stub)
    first = hello(capacity=2)  # the pool's 2 blocks
    first.hello.offload_capacity_blocks = 2
    first.snapshot.offloaded_block_hashes.extend([h(2)])
    publisher.send(first)

    async def matched(*ids: int) -> list[tuple[str, int, int]]:
        reply = await stub.ScorePrefix(
            cache_pb2.ScorePrefixRequest(block_hashes=[h(i) for i in ids]))
        return [(s.replica_id, s.matched_blocks, s.offloaded_blocks) for s in reply.scores]

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while await matched(0, 1, 2, 3) != [("r0", 2, 1)]:
        assert loop.time() < deadline
        await asyncio.sleep(0.02)
    publisher.send(cache_pb2.PublishKvEventsRequest(events=[
        cache_pb2.KvEvent(removed=cache_pb2.KvBlocksRemoved(block_hashes=[h(0)])),
        cache_pb2.KvEvent(stored=cache_pb2.KvBlocksStored(block_hashes=[h(0)], medium=offload)),
    ]))
    while await matched(0, 1, 2, 3) != [("r0", 0, 3)]:  # all in 4 entries: none refused
        assert loop.time() < deadline
        await asyncio.sleep(0.02)


async def test_the_calls_end_drops_the_replica_and_two_replicas_score_apart(stub: Stub) -> None:
    a, b = Publisher(stub), Publisher(stub)
    a.send(hello("a"))
    b.send(hello("b"))
    b.send(stored(2))
    await until(stub, (0, 1, 2), {"a": 2, "b": 3})
    a.send(None)  # the engine closes its call
    await until(stub, (0, 1, 2), {"b": 3}, timeout=1.0)
    b.call.cancel()  # the engine dies: the call is reset
    await until(stub, (0, 1, 2), {}, timeout=1.0)


@pytest.mark.parametrize("first, field", [
    (cache_pb2.PublishKvEventsRequest(), "hello"),
    (cache_pb2.PublishKvEventsRequest(hello=cache_pb2.KvEventsHello(
        replica_id="x", epoch=1, block_size=16)), "capacity_blocks"),
    (cache_pb2.PublishKvEventsRequest(hello=cache_pb2.KvEventsHello(
        replica_id="x", epoch=1, block_size=16, capacity_blocks=4),
        snapshot=cache_pb2.KvSnapshot(block_hashes=[b"short"])), "snapshot.block_hashes[0]"),
])
async def test_a_bad_stream_is_invalid_argument_naming_the_field(
        stub: Stub, first: cache_pb2.PublishKvEventsRequest, field: str) -> None:
    publisher = Publisher(stub)
    publisher.send(first)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await publisher.call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


async def test_a_stale_publisher_is_refused(stub: Stub) -> None:
    new = Publisher(stub)
    new.send(hello("r", epoch=20))
    await until(stub, (0,), {"r": 1})
    old = Publisher(stub)
    old.send(hello("r", epoch=19))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await old.call.read()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "newer epoch" in err.value.details()
    assert await scores(stub, 0) == {"r": 1}


async def test_score_prefix_checks_its_hashes(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ScorePrefix(cache_pb2.ScorePrefixRequest(block_hashes=[h(0), b"x" * 31]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_hashes[1]" in err.value.details()
    assert await scores(stub) == {}


async def test_a_redis_restart_asks_for_a_snapshot(metrics: CacheMetrics) -> None:
    server = start_redis_server()
    try:
        index = RedisPrefixIndex(server.url, metrics=metrics)
        async with serve(CacheService(MemoryStore(), metrics=metrics, index=index)) as stub:
            publisher = Publisher(stub)
            publisher.send(hello())
            await until(stub, (0, 1), {"r0": 2})
            server.kill()
            server.restart()  # empty: the index lost r0
            await asyncio.sleep(1.1)  # the guard's retry pause after the failed call
            publisher.send(cache_pb2.PublishKvEventsRequest())  # a heartbeat
            reply = await asyncio.wait_for(publisher.call.read(), 5)
            assert reply.resync is True
            publisher.send(stored(5))  # before the snapshot: discarded
            publisher.send(cache_pb2.PublishKvEventsRequest(
                snapshot=cache_pb2.KvSnapshot(block_hashes=[h(0), h(1), h(2)])))
            await until(stub, (0, 1, 2, 5), {"r0": 3})
            publisher.send(None)
    finally:
        server.stop()


async def test_a_superseded_publisher_is_told(stub: Stub) -> None:
    """Two engines with one replica id: the one with the older epoch gets
    FAILED_PRECONDITION as soon as the newer one takes over."""
    old = Publisher(stub)
    old.send(hello("dup", epoch=5))
    await until(stub, (0,), {"dup": 1})
    new = Publisher(stub)
    new.send(hello("dup", epoch=6))
    new.send(stored(7))
    await until(stub, (0, 1, 7), {"dup": 3})
    old.send(stored(9))  # refused: a newer epoch holds the id
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(old.call.read(), 5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "share one --replica-id" in err.value.details()
    assert await scores(stub, 0, 1, 7) == {"dup": 3}
    new.send(None)


async def test_a_second_hello_is_invalid_argument(stub: Stub) -> None:
    publisher = Publisher(stub)
    publisher.send(hello())
    publisher.send(hello())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(publisher.call.read(), 5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only on the first message" in err.value.details()
