"""The engine's bidi ``Generate`` on the server kit's server: a message whose
bytes do not parse (first or later) ends the stream INVALID_ARGUMENT naming the
field, and a running sequence is freed as for a client that went away."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.server import make_server
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.service import EngineService
from services.engine.torch_backend.backend import TorchBackend

from .conftest import MAX_TOKENS_CAP
from .prompts import CHAT

pytestmark = pytest.mark.model

METHOD = "/llmesh.v1.EngineService/Generate"


def start(request_id: str, max_tokens: int) -> engine_pb2.EngineServiceGenerateRequest:
    return engine_pb2.EngineServiceGenerateRequest(start=engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=CHAT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


#: A ``start`` whose request_id is the bytes 0xff 0xfe (not UTF-8).
BAD_START = start("@@", 1).SerializeToString().replace(b"@@", b"\xff\xfe")


async def test_unparsable_messages_end_the_stream_invalid_argument(
        torch_backend: TorchBackend, engine_config: EngineConfig,
        engine_metrics: EngineMetrics) -> None:
    service = EngineService(torch_backend, engine_config, engine_metrics)
    await service.start()
    server = make_server(service)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            generate = channel.stream_stream(
                METHOD, request_serializer=lambda raw: raw,
                response_deserializer=engine_pb2.EngineServiceGenerateResponse.FromString)
            load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad
            expected = ("llmesh.v1.EngineServiceGenerateRequest: the request could not be "
                        "parsed: field `start.request_id` holds invalid UTF-8")

            first = generate(timeout=30)
            await first.write(BAD_START)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await first.read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith(expected)

            running = generate(timeout=30)
            await running.write(start("runs", MAX_TOKENS_CAP).SerializeToString())
            assert (await running.read()).token_ids
            assert (await load(engine_pb2.GetLoadRequest())).num_running == 1
            await running.write(BAD_START)
            with pytest.raises(grpc.aio.AioRpcError) as later:
                while (await running.read()) is not grpc.aio.EOF:
                    pass
            assert later.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert later.value.details().startswith(expected)
            deadline = time.monotonic() + 2
            while (await load(engine_pb2.GetLoadRequest())).num_running:
                assert time.monotonic() < deadline, "the sequence still runs"
                await asyncio.sleep(0.01)

            good = generate(timeout=30)
            await good.write(start("good", 2).SerializeToString())
            await good.done_writing()
            replies = [reply async for reply in good]
            assert replies[-1].usage.completion_tokens == 2
    finally:
        await server.stop(grace=None)
