"""Helpers of the cache tests (fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc
from llmesh.v1 import cache_pb2, cache_pb2_grpc, common_pb2

from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def sample(metrics: CacheMetrics, name: str, **labels: str) -> float:
    """Current value of sample ``name`` in ``metrics``' registry (0 when absent)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def make_key(prompt: Sequence[int] = (1, 2, 3), model: str = "smollm2", **sampling: object,
             ) -> cache_pb2.CacheKey:
    """A CacheKey; ``sampling`` are SamplingParams fields (greedy when none is given)."""
    return cache_pb2.CacheKey(model=model, prompt_token_ids=list(prompt),
                              sampling=common_pb2.SamplingParams(**sampling))


def make_response(token_ids: Sequence[int] = (7, 8, 9), text: str = "hi there",
                  finish_reason: int = common_pb2.FINISH_REASON_STOP,
                  matched_stop: str = "") -> cache_pb2.CachedResponse:
    return cache_pb2.CachedResponse(token_ids=list(token_ids), text=text,
                                    finish_reason=finish_reason, matched_stop=matched_stop)


@contextlib.asynccontextmanager
async def serve(service: CacheService) -> AsyncIterator[cache_pb2_grpc.CacheServiceStub]:
    """Runs ``service`` on a loopback port chosen by the OS; yields a stub on one channel."""
    server = grpc.aio.server()
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await service.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield cache_pb2_grpc.CacheServiceStub(channel)
        finally:
            await channel.close()
    finally:
        await server.stop(grace=None)
        await service.close()
