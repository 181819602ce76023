"""32 concurrent streams through Envoy with mixed stop strings, cancels and
deadlines: each stream's text is its solo run's (or a prefix of it, where it
was cut), and the engine ends idle with no KV block in use."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import pytest

from llmesh.v1 import engine_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import chat_request

pytestmark = pytest.mark.mesh

QUESTIONS = (
    "What is the capital of France?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for tea.",
    "What is 12 times 7?",
    "Describe a cat in one sentence.",
)
#: Tokens of a full answer (EOS ignored: every answer runs to this length).
MAX_TOKENS = 24
#: Streams per kind, in the order they are sent (interleaved below).
KINDS = ("plain", "stop", "cancel", "deadline")
#: Deltas a "cancel" stream reads before it cancels.
CANCEL_AFTER = 3
#: A "deadline" stream asks for DEADLINE_TOKENS with this deadline: at 32 streams
#: on a CPU that is far too short (it would need < 8 ms a step at batch 32).
DEADLINE_S = 0.5
DEADLINE_TOKENS = 64


@dataclass
class Outcome:
    text: str
    code: grpc.StatusCode
    finish_reason: int = 0
    matched_stop: str = ""
    completion_tokens: int = 0


async def run(stub: generation_pb2_grpc.GenerationServiceStub, request, *,
              timeout: float = 120.0, cancel_after: int | None = None) -> Outcome:
    call = stub.Generate(request, timeout=timeout)
    text: list[str] = []
    last = None
    try:
        async for response in call:
            text.append(response.text)
            last = response
            if cancel_after is not None and len(text) >= cancel_after:
                call.cancel()
                return Outcome("".join(text), grpc.StatusCode.CANCELLED)
    except grpc.aio.AioRpcError as err:
        return Outcome("".join(text), err.code())
    assert last is not None
    return Outcome("".join(text), grpc.StatusCode.OK, last.finish_reason, last.matched_stop,
                   last.usage.completion_tokens)


def request_for(question: str, max_tokens: int = MAX_TOKENS, **sampling):
    return chat_request(question, temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        **sampling)


def stop_of(answer: str) -> str:
    """A stop string inside ``answer``: its middle word with the space before it."""
    words = answer.split(" ")
    assert len(words) >= 4, answer
    return " " + words[len(words) // 2]


async def scenario(target: str) -> tuple[dict[str, str], dict[str, str],
                                          list[tuple[str, str, Outcome]]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        solo: dict[str, str] = {}
        long_solo: dict[str, str] = {}
        for question in QUESTIONS:  # one at a time: the reference
            solo[question] = (await run(stub, request_for(question))).text
            long_solo[question] = (await run(stub, request_for(question, DEADLINE_TOKENS))).text
        jobs = []
        for i in range(32):
            kind, question = KINDS[i % len(KINDS)], QUESTIONS[i % len(QUESTIONS)]
            if kind == "plain":
                job = run(stub, request_for(question))
            elif kind == "stop":
                job = run(stub, request_for(question, stop=[stop_of(solo[question])]))
            elif kind == "cancel":
                job = run(stub, request_for(question), cancel_after=CANCEL_AFTER)
            else:
                job = run(stub, request_for(question, DEADLINE_TOKENS), timeout=DEADLINE_S)
            jobs.append((kind, question, job))
        outcomes = await asyncio.gather(*(job for _, _, job in jobs))
        return solo, long_solo, [(k, q, o) for (k, q, _), o in zip(jobs, outcomes)]


def test_32_mixed_streams_equal_their_solo_runs_and_leak_no_kv_block(mesh: Mesh) -> None:
    solo, long_solo, results = asyncio.run(scenario(mesh.ingress_address))
    assert all(len(text) > 20 for text in solo.values()), solo
    deadlines_hit = 0
    for kind, question, got in results:
        where = (kind, question, got)
        if kind == "plain":
            assert got.code == grpc.StatusCode.OK and got.text == solo[question], where
            assert got.completion_tokens == MAX_TOKENS, where
        elif kind == "stop":
            stop = stop_of(solo[question])
            assert got.code == grpc.StatusCode.OK, where
            assert got.text == solo[question][:solo[question].index(stop)], where
            assert got.matched_stop == stop and got.finish_reason == 1, where  # STOP
            assert 0 < got.completion_tokens < MAX_TOKENS, where
        elif kind == "cancel":
            assert got.code == grpc.StatusCode.CANCELLED, where
            assert solo[question].startswith(got.text), where
        else:
            assert got.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK), where
            if got.code == grpc.StatusCode.OK:
                assert got.text == long_solo[question], where
            else:
                deadlines_hit += 1
                assert long_solo[question].startswith(got.text), where
    assert deadlines_hit >= 1  # the deadline streams were cut, not all finished

    # Every sequence left the engine and freed its blocks (prefix-cached blocks
    # are free for reuse: KV usage counts blocks held by running sequences).
    channel = grpc.insecure_channel(mesh.engines[0].grpc_address)
    try:
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        deadline = time.monotonic() + 10
        while True:
            load = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
            idle = (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert idle, load
    finally:
        channel.close()
