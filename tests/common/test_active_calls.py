"""The server kit counts the calls in progress (what a drain waits for), on a
real router served by :func:`make_server`: a streaming ``Generate`` counts
while it streams and no longer once it ended."""

from __future__ import annotations

import asyncio

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.active_calls import ActiveCalls

from tests.common.test_request_guard import router_on_the_kit

GENERATE = "/llmesh.v1.GenerationService/Generate"


async def test_a_stream_counts_until_it_ends() -> None:
    calls = ActiveCalls()
    async with router_on_the_kit(calls) as (channel, _engine, _registry):
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Generate(generation_pb2.GenerateRequest(
            prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=40)))
        first = await call.read()
        assert first.text or first.token_ids
        assert calls.working() == {GENERATE: 1}
        assert not await calls.wait_idle(0.05)
        while await call.read() is not grpc.aio.EOF:
            pass
        assert await calls.wait_idle(5)
        assert calls.working() == {}


def test_health_and_reflection_are_not_work() -> None:
    calls = ActiveCalls()
    with calls.track("/grpc.health.v1.Health/Watch"), \
            calls.track("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert calls.working() == {}
        assert asyncio.run(calls.wait_idle(0))
        with calls.track(GENERATE):
            assert calls.working() == {GENERATE: 1}
