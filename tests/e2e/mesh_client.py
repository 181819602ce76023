"""Small client helpers for the end-to-end tests (named to avoid pytest module clashes)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

CAPITAL_QUESTION = "What is the capital of France?"


def chat_request(content: str = CAPITAL_QUESTION, *, bypass_cache: bool = True,
                 **sampling: object) -> generation_pb2.GenerateRequest:
    """A chat request with one user message and the given sampling fields."""
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content=content)]),
        sampling=common_pb2.SamplingParams(**sampling),
        bypass_cache=bypass_cache,
    )


@dataclass
class Collected:
    """Everything a stream returned."""

    deltas: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last: generation_pb2.GenerateResponse | None = None
    tool_calls: list[generation_pb2.ToolCallDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def collect(responses: Iterator[generation_pb2.GenerateResponse]) -> Collected:
    """Drains a Generate stream."""
    out = Collected()
    for response in responses:
        out.deltas.append(response.text)
        out.token_ids.extend(response.token_ids)
        out.tool_calls.extend(response.tool_calls)
        out.last = response
    return out


def generate(channel: grpc.Channel, request: generation_pb2.GenerateRequest,
             timeout: float = 120.0) -> Collected:
    """Runs one server-streaming Generate call to the end."""
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return collect(stub.Generate(request, timeout=timeout))


class BidiSession:
    """A GenerateStream call whose requests are pushed from the test."""

    def __init__(self, channel: grpc.Channel, timeout: float = 120.0) -> None:
        self._requests: queue.Queue[generation_pb2.GenerateStreamRequest | None] = queue.Queue()
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        self.call = stub.GenerateStream(iter(self._requests.get, None), timeout=timeout)
        self._lock = threading.Lock()

    def send(self, request: generation_pb2.GenerateStreamRequest) -> None:
        self._requests.put(request)

    def start(self, request: generation_pb2.GenerateRequest) -> None:
        self.send(generation_pb2.GenerateStreamRequest(start=request))

    def cancel(self) -> None:
        self.send(generation_pb2.GenerateStreamRequest(cancel=generation_pb2.CancelGeneration()))

    def close(self) -> None:
        self._requests.put(None)

    def next(self) -> generation_pb2.GenerateResponse:
        return next(self.call).response
