"""Async client helpers of the overload tests (admission, preemption, failover):
one request's outcome with its timings, status and retry hint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

#: Engines of the overload tests' mesh (conftest.py's ``two_small_engines``),
#: and sequence slots of each: a handful of streams fills them.
SMALL_ENGINES = 2
SLOTS_PER_ENGINE = 2


def long_request(max_tokens: int, tag: str, *,
                 priority: int = common_pb2.PRIORITY_UNSPECIFIED) -> generation_pb2.GenerateRequest:
    """A greedy request that never stops before ``max_tokens`` (no cache) and
    takes one engine step per token (no speculation: the suffix cache would
    let these near-identical answers end in a few steps, and the tests time
    scheduling, not speculation)."""
    return generation_pb2.GenerateRequest(
        prompt=f"Request {tag}. List the numbers from one to one thousand in words:",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True),
        speculative=common_pb2.SpeculativeParams(method=common_pb2.SPECULATIVE_METHOD_NONE),
        bypass_cache=True, priority=priority)


@dataclass
class Outcome:
    """How one call went (``time.monotonic()`` seconds)."""

    sent_at: float
    ended_at: float = 0.0
    code: grpc.StatusCode = grpc.StatusCode.OK
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    retry_after_ms: int | None = None
    details: str = ""

    @property
    def latency(self) -> float:
        return self.ended_at - self.sent_at


async def run_one(stub: generation_pb2_grpc.GenerationServiceStub,
                  request: generation_pb2.GenerateRequest, *,
                  first_token: asyncio.Event | None = None, first_token_count: int = 8,
                  metadata: Sequence[tuple[str, str]] = (), timeout: float = 120) -> Outcome:
    """Streams ``request`` to its end; ``first_token`` is set once
    ``first_token_count`` tokens arrived."""
    out = Outcome(time.monotonic())
    call = stub.Generate(request, timeout=timeout, metadata=tuple(metadata) or None)
    try:
        async for response in call:
            out.tokens += len(response.token_ids)
            out.token_ids.extend(response.token_ids)
            if response.token_ids and out.first_token_at is None:
                out.first_token_at = time.monotonic()
            if first_token is not None and out.tokens >= first_token_count:
                first_token.set()
    except grpc.aio.AioRpcError as err:
        out.code = err.code()
        out.details = err.details() or ""
        trailers = dict(err.trailing_metadata() or ())
        if "retry-after-ms" in trailers:
            out.retry_after_ms = int(trailers["retry-after-ms"])
    out.ended_at = time.monotonic()
    return out
