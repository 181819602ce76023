"""The router's metrics and its engine calls, against fake upstreams (no model):
when each histogram is observed, what a refused request counts, and that a
finished engine stream is left to end by itself (not cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry

from llmesh.v1 import (
    common_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.cache.metrics import LATENCY_BUCKETS_SECONDS as CACHE_BUCKETS
from services.router.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
    RouterMetrics,
)
from services.router.service import RouterConfig, RouterService
from services.tokenizer.metrics import LATENCY_BUCKETS_SECONDS as TOKENIZER_BUCKETS
from tests.router.router_fakes import FakeEngine, FakeTokenizer, serve

REPLY = "Paris."  # the fake engine sends one character per step, then EOS
MODEL = {"model_name": "fake-model"}


@dataclass
class Router:
    stub: generation_pb2_grpc.GenerationServiceStub
    engine: FakeEngine
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[Router]:
    tok_server, tok_target = await serve(
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, FakeTokenizer())
    engine = FakeEngine(REPLY)
    engine_server, engine_target = await serve(
        engine_pb2_grpc.add_EngineServiceServicer_to_server, engine)
    registry = CollectorRegistry()
    service = RouterService(RouterConfig(tokenizer=tok_target, engines=(engine_target,),
                                         startup_timeout=10), metrics=RouterMetrics(registry))
    await service.start()
    server = grpc.aio.server()
    service.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Router(generation_pb2_grpc.GenerationServiceStub(channel), engine, registry)
    finally:
        await channel.close()
        await server.stop(None)
        await service.close()
        await tok_server.stop(None)
        await engine_server.stop(None)


def _request(**sampling: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="q", sampling=common_pb2.SamplingParams(
        temperature=0.0, **sampling))


async def _wait(predicate, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.01)


def test_buckets_resolve_milliseconds() -> None:
    assert TTFT_BUCKETS[0] <= 0.001 and E2E_BUCKETS[0] <= 0.001
    assert ITL_BUCKETS[0] <= 0.0005 and QUEUE_BUCKETS[0] <= 0.0001
    assert TOKENIZER_BUCKETS[0] <= 0.000025 and CACHE_BUCKETS[0] <= 0.00001
    for buckets in (TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS, QUEUE_BUCKETS):
        assert list(buckets) == sorted(set(buckets))
        assert sum(1 for b in buckets if b <= 0.01) >= 4  # several bounds below 10 ms
    assert TTFT_BUCKETS[-1] >= 60 and E2E_BUCKETS[-1] >= 600


async def test_ttft_is_observed_when_the_first_token_leaves() -> None:
    async with router() as r:
        r.engine.step_delay = 0.05
        call = r.stub.Generate(_request())
        first = await call.read()
        assert first.token_ids
        # Still streaming: TTFT and the in-flight gauge are there already, e2e not yet.
        assert r.metric("llmesh:time_to_first_token_seconds_count", **MODEL) == 1
        assert r.metric("llmesh:router_requests_in_flight", **MODEL) == 1
        assert r.metric("llmesh:e2e_request_latency_seconds_count", **MODEL) == 0
        responses = [first]
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
    tokens = sum(len(x.token_ids) for x in responses)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert r.metric("llmesh:router_requests_in_flight", **MODEL) == 0
    assert r.metric("llmesh:e2e_request_latency_seconds_count", **MODEL) == 1
    assert r.metric("llmesh:request_time_per_output_token_seconds_count", **MODEL) == 1
    assert r.metric("llmesh:inter_token_latency_seconds_count", **MODEL) == sum(
        1 for x in responses if x.token_ids) - 1
    assert r.metric("llmesh:generation_tokens_total", **MODEL) == tokens
    tpot = r.metric("llmesh:request_time_per_output_token_seconds_sum", **MODEL)
    assert 0.04 <= tpot <= 0.5  # ~ the engine's step delay


@pytest.mark.parametrize(("request_", "outcome"), [
    (_request(top_p=0.0), "invalid_argument"),
    (generation_pb2.GenerateRequest(prompt="q", model="no-such-model"), "invalid_argument"),
    (_request(max_tokens=10**6), "out_of_range"),
])
async def test_refused_requests_are_counted_without_latency_or_tokens(
        request_: generation_pb2.GenerateRequest, outcome: str) -> None:
    async with router() as r:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await r.stub.Generate(request_).read()
        assert info.value.code().name.lower() == outcome
        # The label is a served model, never the name the client sent.
        assert r.metric("llmesh:requests_total", outcome=outcome, priority="interactive",
                        **MODEL) == 1
        for name in ("llmesh:e2e_request_latency_seconds_count",
                     "llmesh:time_to_first_token_seconds_count", "llmesh:prompt_tokens_total"):
            assert r.metric(name, **MODEL) == 0, name
        assert r.metric("llmesh:router_requests_in_flight", **MODEL) == 0


async def test_refused_start_on_a_stream_is_counted() -> None:
    async with router() as r:
        call = r.stub.GenerateStream()
        await call.write(generation_pb2.GenerateStreamRequest(start=_request(top_k=-1)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert r.metric("llmesh:requests_total", outcome="invalid_argument",
                        priority="interactive", **MODEL) == 1


async def test_a_finished_engine_stream_ends_by_itself_not_cancelled() -> None:
    async with router() as r:
        for _ in range(3):
            responses = [x async for x in r.stub.Generate(_request())]
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        await _wait(lambda: len(r.engine.log.ended) == 3)
        await asyncio.sleep(0.05)  # a cancel sent after the last message would be in by now
        assert r.engine.log.ended == ["finished"] * 3
        assert r.engine.log.late_cancels == 0


async def test_a_cancelled_request_cancels_the_engine_stream() -> None:
    async with router() as r:
        r.engine.step_delay = 0.05
        call = r.stub.Generate(_request(max_tokens=50, ignore_eos=True))
        assert (await call.read()).token_ids
        call.cancel()
        await _wait(lambda: r.engine.log.ended == ["cancel_msg"])
        await _wait(lambda: r.metric("llmesh:requests_total", outcome="cancelled",
                                     priority="interactive", **MODEL) == 1)
        assert r.metric("llmesh:e2e_request_latency_seconds_count", **MODEL) == 1
        assert r.metric("llmesh:request_time_per_output_token_seconds_count", **MODEL) == 0
        assert r.metric("llmesh:router_requests_in_flight", **MODEL) == 0
