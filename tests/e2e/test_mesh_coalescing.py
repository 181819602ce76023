"""Request coalescing (single flight) on the real mesh: Envoy's ingress, the
router, the cache on Redis and the SmolLM2 engine. Identical greedy requests
in flight cost the engine one generation (its own counters say so), every
client gets the same complete stream, and the first client cancelling does
not break the others.

Each test uses a prompt of its own, so the response cache (shared by the
session's mesh) misses; ``bypass_cache`` would turn coalescing off."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
import uuid

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import chat_request

pytestmark = pytest.mark.mesh

#: Clients per test, and tokens each answer runs to (EOS ignored: all complete at this length).
CLIENTS = 10
MAX_TOKENS = 32
TIMEOUT_S = 120.0


def metric(address: str, name: str) -> float:
    """Sum over every label set of ``name`` at ``http://address/metrics``."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(value) for value in re.findall(
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body, re.M))


def engine_counter(mesh: Mesh, name: str) -> float:
    return sum(metric(engine.metrics_address, name) for engine in mesh.engines)


def coalesced(mesh: Mesh) -> float:
    return metric(mesh.router.metrics_address, "llmesh:router_coalesced_requests_total")


def unique_request() -> generation_pb2.GenerateRequest:
    """A greedy chat request no earlier test asked (a response-cache miss)."""
    tag = uuid.uuid4().hex[:8]
    return chat_request(f"Tell me a short story about a robot named R-{tag}.",
                        bypass_cache=False, temperature=0.0, max_tokens=MAX_TOKENS,
                        ignore_eos=True)


def engine_generations_after(mesh: Mesh, before: float) -> float:
    """Engine generations finished since ``before``, once the count has settled
    (the engine counts a request as its last update leaves)."""
    end = time.monotonic() + 10
    while engine_counter(mesh, "llmesh:request_success_total") < before + 1:
        assert time.monotonic() < end, "the engine finished no request"
        time.sleep(0.05)
    time.sleep(0.5)  # a second generation, were there one, would have ended by now
    return engine_counter(mesh, "llmesh:request_success_total") - before


def stream_of(responses: list[generation_pb2.GenerateResponse]) -> tuple:
    """What a client saw, without its own request id and without message
    boundaries: a subscriber whose transport lags gets the deltas that waited
    for it merged (services/router/slow_reader.py), the same tokens in fewer
    messages."""
    final = responses[-1]
    return ("".join(r.text for r in responses),
            tuple(t for r in responses for t in r.token_ids), final.finish_reason,
            final.usage.prompt_tokens, final.usage.completion_tokens,
            {r.cached for r in responses})


async def read_all(call) -> list[generation_pb2.GenerateResponse]:
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:
        out.append(response)
    return out


def assert_complete(responses: list[generation_pb2.GenerateResponse]) -> None:
    final = responses[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH, final
    assert final.usage.completion_tokens == MAX_TOKENS, final
    assert sum(len(r.token_ids) for r in responses) == MAX_TOKENS
    assert "".join(r.text for r in responses).strip()


def test_identical_greedy_requests_sent_together_cost_one_engine_generation(
        mesh: Mesh) -> None:
    request = unique_request()

    async def scenario() -> list[list[generation_pb2.GenerateResponse]]:
        async with grpc.aio.insecure_channel(mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            return await asyncio.gather(*[
                read_all(stub.Generate(request, timeout=TIMEOUT_S)) for _ in range(CLIENTS)])

    generations_before = engine_counter(mesh, "llmesh:request_success_total")
    prompt_tokens_before = engine_counter(mesh, "llmesh:prompt_tokens_total")
    coalesced_before = coalesced(mesh)
    results = asyncio.run(scenario())

    assert engine_generations_after(mesh, generations_before) == 1
    prompt_tokens = results[0][-1].usage.prompt_tokens
    assert engine_counter(mesh, "llmesh:prompt_tokens_total") - prompt_tokens_before == \
        prompt_tokens
    assert coalesced(mesh) - coalesced_before == CLIENTS - 1
    streams = [stream_of(r) for r in results]
    assert all(s == streams[0] for s in streams)
    assert_complete(results[0])
    assert not results[0][-1].cached


def test_the_first_client_cancelling_does_not_break_the_others(mesh: Mesh) -> None:
    request = unique_request()

    async def scenario() -> tuple[generation_pb2.GenerateResponse,
                                  list[list[generation_pb2.GenerateResponse]]]:
        async with grpc.aio.insecure_channel(mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            first = stub.Generate(request, timeout=TIMEOUT_S)
            head = await first.read()  # its first token: it leads the generation
            assert head.token_ids, head
            others = [stub.Generate(request, timeout=TIMEOUT_S) for _ in range(CLIENTS - 1)]
            # Each has joined once its first message (the buffer's first) came.
            heads = await asyncio.gather(*[call.read() for call in others])
            first.cancel()
            rests = await asyncio.gather(*[read_all(call) for call in others])
            return head, [[h, *rest] for h, rest in zip(heads, rests)]

    generations_before = engine_counter(mesh, "llmesh:request_success_total")
    coalesced_before = coalesced(mesh)
    head, results = asyncio.run(scenario())

    assert engine_generations_after(mesh, generations_before) == 1
    assert coalesced(mesh) - coalesced_before == CLIENTS - 1
    streams = [stream_of(r) for r in results]
    assert all(s == streams[0] for s in streams)
    text, token_ids = streams[0][:2]  # each replays the leader's stream from its start
    assert text.startswith(head.text) and token_ids[:len(head.token_ids)] == tuple(
        head.token_ids)
    assert_complete(results[0])
